"""A configuration checked and completed: `resolve(cfg)` before any work starts.

    from gspo.train.resolve import resolve
    cfg = resolve(TrainConfig(algorithm="grpo", steps=50))   # checked; clip range, model, steps ... filled

One validator, in three passes, each from the facts written where they belong: every option's
type (gspo.config.checks, strict pydantic), then its bounds (`opt(..., ge=1)` in gspo.config.sections), then
the rules between options, section by section below (the losses' own facts, such as which take
per-token advantages, come from their registration, gspo.algo.losses.register_loss). The first bad
value is a ConfigError with one line naming the option. Then the derived values: the clip range
from the algorithm's preset, pi_old's source (`--old-logp auto`), the task's model, steps and
completion length, the critic's learning rate, the run directory. Also what a resumed run may
change (`resume_config`: the options marked `resume=True`) and the absolute paths a run's config
records (`absolute_paths`), so a run directory works from anywhere.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from gspo.agents.vfenv import VerifiersTask, is_verifiers
from gspo.algo.aggregation import AGG_MODES
from gspo.algo.losses import LOSSES, own_options
from gspo.config import RESUME_SAFE, ConfigError, TrainConfig, bounds_error, options
from gspo.config.checks import check_value
from gspo.io.words import plural
from gspo.models.loading import BUILTIN_MODELS
from gspo.sampling.integrity import renormalises
from gspo.tasks import TASKS, GymTask, get_task, is_gym
from gspo.tasks.data import DatasetTask
from gspo.train.distill import distill_rules


def validate(cfg: TrainConfig) -> None:
    """Raise ConfigError with a one-line message for the first bad value of a config whose types
    are checked (`checked`): its bounds, then the rules."""
    for rules in (_bounds, _loss_rules, _policy_rules, _data_rules, _sampling_rules, _corrections_rules, _async_rules,
                  distill_rules, _optim_rules):
        for ok, name, msg in rules(cfg):
            if not ok:
                _fail(cfg, name, msg)


def _bounds(cfg: TrainConfig):
    """(ok, option, message) for every option's bounds (gspo.config.sections), the message the one
    of the bound enforced: group_size's is 2, not 1, for a loss whose advantages are relative to the group."""
    info = LOSSES.get(cfg.loss.algorithm)
    for f in options():
        bounds, why = f.metadata["bounds"], ""
        if f.name == "group_size" and info is not None and info.group_advantages:
            bounds, why = {"ge": 2}, " (advantages are relative to the group)"
        msg = bounds_error(bounds, getattr(cfg, f.name))
        yield msg is None, f.name, f"{msg}{why}"


def _fail(cfg: TrainConfig, name: str, msg: str):
    raise ConfigError(f"{name}: {msg} (got {getattr(cfg, name)!r})")


def _loss_rules(cfg: TrainConfig):
    """(ok, option, message) for the loss section's rules, in order."""
    loss, info = cfg.loss, LOSSES.get(cfg.loss.algorithm)
    yield info is not None, "algorithm", f"must be one of {', '.join(LOSSES)}"
    batch = cfg.sampling.prompts_per_step * cfg.sampling.group_size
    yield batch % loss.num_minibatches == 0, "num_minibatches", \
        f"must divide the rollout batch prompts_per_step * group_size = {batch}"
    yield loss.clip_low is None or loss.clip_low <= 1 or (info is not None and info.log_space_clip), "clip_low", \
        "must be <= 1 (the ratio is clipped at 1 - clip_low >= 0)"
    yield loss.loss_agg in AGG_MODES, "loss_agg", f"must be one of {', '.join(AGG_MODES)}"
    turn = [name for name, i in LOSSES.items() if i.turn_advantages]
    yield not cfg.episodes.turn_advantages or cfg.loss.algorithm in turn, "turn_advantages", \
        f"needs a token-level loss ({', '.join(turn)}), not --algorithm {loss.algorithm}: a sequence ratio takes " \
        "one advantage per episode"


def _policy_rules(cfg: TrainConfig):
    policy, parallel = cfg.policy, cfg.run.parallel
    yield len(cfg.lora.lora_target_modules) >= 1, "lora_target_modules", "needs at least one module name"
    yield cfg.run.device == "auto" or cfg.run.device.split(":")[0] in ("cpu", "cuda", "mps"), "device", \
        "must be cpu, cuda, cuda:N, mps or auto"
    yield not (cfg.moe.routing_replay and policy.gradient_checkpointing), "routing_replay", \
        "cannot be combined with --gradient-checkpointing (the recomputed forward would route freely)"
    rollout_dtype = cfg.sampling.rollout_dtype
    yield not (parallel == "fsdp" and rollout_dtype not in ("same", policy.dtype)), "parallel", \
        f"fsdp samples with the sharded policy itself, in --dtype {policy.dtype}: a --rollout-dtype of " \
        f"{rollout_dtype} would need a second full copy of the weights on every process; drop --rollout-dtype " \
        f"(or set --dtype {rollout_dtype}), or use --parallel ddp"
    yield policy.param_dtype in ("float32", policy.dtype), "param_dtype", \
        f"must be float32 (mixed precision) or the compute --dtype {policy.dtype} (pure low precision)"
    yield policy.param_dtype != "float16", "param_dtype", \
        "float16 weights cannot be trained directly (Adam's eps 1e-8 rounds to 0 and every weight turns NaN); " \
        "use the default float32 master weights with --dtype float16"
    yield not (policy.dtype == "float16" and parallel == "fsdp"), "dtype", \
        "float16 (loss scaling) is not supported with --parallel fsdp; use bfloat16"


def _data_rules(cfg: TrainConfig):
    data, rewards = cfg.data, cfg.rewards
    yield data.dataset is not None or data.task in TASKS or is_gym(data.task) or is_verifiers(data.task), "task", \
        f"must be one of {', '.join(TASKS)}, reasoning_gym:NAME or verifiers:TASKSET_ID (or give --dataset)"
    yield not ((is_gym(data.task) or is_verifiers(data.task)) and data.dataset is None and cfg.policy.model is None), \
        "model", f"--task {data.task} needs --model: a model that reads text (a .gguf file, a model directory or a " \
        "Hub id)"
    yield not rewards.reward_weights or len(rewards.reward_weights) == len(rewards.reward), "reward_weights", \
        f"needs one weight per --reward ({plural(len(rewards.reward), 'reward')} given)"


def _sampling_rules(cfg: TrainConfig):
    s = cfg.sampling
    yield s.max_new_tokens is None or s.min_new_tokens <= s.max_new_tokens, "min_new_tokens", \
        "must be <= max_new_tokens"
    vllm = s.rollout_engine in ("vllm", "vllm-server")
    yield not (vllm and cfg.moe.routing_replay), "routing_replay", \
        f"cannot be combined with --rollout-engine {s.rollout_engine}: this vLLM cannot return the experts it " \
        "routed each token to (R3 needs its Model Runner V2); use --rollout-engine hf"
    yield not (renormalises(s.rollout_engine, s) and cfg.loss.old_logp == "sampling"), \
        "old_logp", f"sampling with --rollout-engine {s.rollout_engine} needs --top-p 1, --top-k 0 and " \
        "--min-new-tokens 0: vLLM renormalises its log-probs over the tokens top-p/top-k keep and without the " \
        "stop tokens it bans, which are then not the policy's (use --old-logp recompute or auto)"
    server = s.rollout_engine == "vllm-server"
    yield not (server and cfg.async_rl.rollout_workers), "rollout_workers", \
        "cannot be combined with --rollout-engine vllm-server: the servers are the rollout side (add servers with " \
        "--vllm-server-url; --max-staleness still applies)"
    yield not (cfg.vllm.vllm_server_url and not server), "vllm_server_url", \
        f"names servers to sample on, and --rollout-engine is {s.rollout_engine} (give --rollout-engine vllm-server)"


def _corrections_rules(cfg: TrainConfig):
    yield not (corrects_mismatch(cfg) and cfg.loss.old_logp == "sampling"), "old_logp", \
        "sampling cannot be combined with --rollout-is or --opsm-delta: the corrections compare the sampler's " \
        "log-probs with the trainer's recomputed ones (use --old-logp recompute or auto)"


def _async_rules(cfg: TrainConfig):
    a = cfg.async_rl
    yield not a.rollout_devices or a.rollout_workers > 0, "rollout_devices", \
        "places rollout workers, and --rollout-workers is 0 (give --rollout-workers N)"
    yield not a.rollout_devices or len(a.rollout_devices) % max(1, a.rollout_workers) == 0, "rollout_devices", \
        f"needs one device per rollout worker ({plural(a.rollout_workers, 'worker')}; under torchrun, or one per " \
        "worker of every process, in rank order)"
    yield all(d == "cpu" or d.split(":")[0] == "cuda" for d in a.rollout_devices), "rollout_devices", \
        "each must be cpu, cuda or cuda:N"
    yield not (a.drop_uniform_groups and cfg.sampling.group_size < 2), "drop_uniform_groups", \
        "needs --group-size >= 2 (a group of one is always uniform)"
    episodes = cfg.episodes.env or cfg.data.task == "calculator" or is_verifiers(cfg.data.task)  # tasks with an env
    yield not (a.partial_rollouts and cfg.sampling.rollout_engine != "vllm-server"), "partial_rollouts", \
        "continues generations across a weight sync on vLLM servers: give --rollout-engine vllm-server"
    yield not (a.partial_rollouts and a.max_staleness == 0), "partial_rollouts", \
        "needs --max-staleness >= 1: with 0 no sync happens while a batch is sampled"
    yield not (a.partial_rollouts and episodes), "partial_rollouts", \
        "cannot be combined with multi-turn episodes or agents yet (their turns do not carry per-token versions)"
    yield not (a.drop_uniform_groups and episodes), "drop_uniform_groups", \
        "cannot be combined with multi-turn episodes yet (their refill rounds would need their episodes joined)"


def _optim_rules(cfg: TrainConfig):
    yield all(0 <= b < 1 for b in cfg.optim.adam_betas), "adam_betas", "each must be in [0, 1)"


@dataclass(frozen=True)
class Facts:
    """What a run brings besides its options, for `unused`."""

    dataset: bool = False  # rows to train on (--dataset, or the API's train_dataset)
    env: bool = False  # multi-turn episodes (an environment: --env, or the task's own)
    rewards: tuple = ()  # the reward specs: names, paths, callables
    reward_model: bool = False  # one of them is a learned reward model, or a judge model gspo loads
    judge: bool = False  # one of them is a judge (judge:MODEL_OR_URL)
    local_model: bool = False  # --model is a built-in or a local full model: no Hub revision applies


PPO_OPTIONS = ("critic", "critic_lr", "gamma", "gae_lambda", "value_clip", "vf_coef", "whiten_advantages",
               "reward_kl_coef")


def unused(cfg: TrainConfig, facts: Facts) -> list[tuple[str, str]]:
    """(option, why) for each option that the rest of a run's resolved configuration, and `facts`,
    leave without effect; gspo.train.run refuses those the user gave (`given`)."""
    alg, info, c = cfg.loss.algorithm, LOSSES[cfg.loss.algorithm], cfg.corrections
    table = [  # (the options cannot act, which, why)
        (info.group_advantages, PPO_OPTIONS, f"sets PPO's value model; --algorithm {alg} has none"),
        (not info.group_advantages, ("adv_scale",),
         f"{info.display}'s advantages are GAE's over its value model, not a group's"),
        (not info.group_advantages and cfg.ppo.critic == "separate", ("vf_coef",),
         "weighs the value loss of --critic shared; --critic separate has its own optimizer"),
        (info.gate, ("clip_low", "clip_high", "target_clip_frac"), f"--algorithm {alg} gates instead of clipping"
         f"{' (' + ', '.join('--' + o.replace('_', '-') for o in info.options) + ')' if info.options else ''}"),
        *((True, (option,), f"is {LOSSES[owner].display.split(' (')[0]}'s option (--algorithm {owner}); "
                            f"--algorithm {alg} has none")
          for option, owner in own_options().items() if option not in info.options),
        (cfg.lora.lora_r == 0, ("lora_alpha", "lora_dropout", "lora_target_modules"),
         "shapes LoRA adapters, and --lora-r is 0 (all weights train): give --lora-r N"),
        (c.rollout_is == "off", ("rollout_is_mode", "rollout_is_low", "rollout_is_high"),
         "shapes the --rollout-is weights, and --rollout-is is off"),
        (c.rollout_is != "off" and c.rollout_is_mode == "truncate", ("rollout_is_low",),
         "is the lower bound of --rollout-is-mode mask; truncate caps at --rollout-is-high only"),
        (not cfg.async_rl.drop_uniform_groups, ("resample_rounds",), "applies with --drop-uniform-groups"),
        (cfg.loss.beta == 0, ("kl_estimator",), "estimates the --beta KL penalty, and --beta is 0"),
        ("format" not in facts.rewards, ("format_pattern",), "is the format reward's, and no --reward is format"),
        ("wandb" not in cfg.run.report_to, ("wandb_project",), "applies with --report-to wandb"),
        (cfg.eval.eval_size == 0, ("eval_every",), "--eval-size is 0: nothing is evaluated"),
        (not facts.dataset, ("dataset_config", "dataset_split", "eval_dataset", "eval_split", "prompt_column",
                             "answer_column"),
         f"applies to a --dataset; the built-in task {cfg.data.task} brings its own rows"),
        (facts.dataset or not is_gym(cfg.data.task), ("answer_from",), "applies to a reasoning_gym:NAME task"),
        (facts.dataset or not (is_gym(cfg.data.task) or is_verifiers(cfg.data.task)), ("task_options",),
         "applies to a reasoning_gym:NAME or verifiers:TASKSET_ID task"),
        (not facts.env, ("turn_advantages", "max_episode_tokens"),
         "applies to multi-turn episodes, and this run's are single-turn (no --env)"),
        (not facts.reward_model, ("reward_model_device", "reward_model_batch_size"),
         "applies to learned reward models and judge models, and no --reward is one"),
        (not facts.judge, ("judge_template", "judge_rubric", "judge_max_new_tokens", "judge_timeout"),
         "applies to judges, and no --reward is one (judge:MODEL_OR_URL)"),
        (facts.local_model, ("revision",),
         f"picks a Hugging Face Hub revision, and --model {cfg.policy.model} is local"),
    ]
    return [(name, why) for idle, names, why in table if idle for name in names]


DEFAULTS = {f.name: f.default for f in options()}
# options whose value a run's config.yaml holds as gspo derived it (critic_lr = 10 x lr, the algorithm's clip
# range, a multi-turn run's episode budget): given again with --config, under another --lr, --algorithm or task,
# they are not the user's choice, so gspo.train.run says they do not act rather than refusing them
DERIVED = ("critic_lr", "clip_low", "clip_high", "max_episode_tokens")


def given(cfg: TrainConfig, name: str) -> bool:
    """Whether option `name` of a resolved config holds a value of the user's: neither its default
    nor the value `resolve` derives (a saved config.yaml holds those)."""
    value, info = getattr(cfg, name), LOSSES.get(cfg.loss.algorithm)
    derived = {"critic_lr": 10 * cfg.optim.lr, "clip_low": getattr(info, "clip_low", None),
               "clip_high": getattr(info, "clip_high", None)}
    return value != DEFAULTS[name] and (name not in derived or value != derived[name])


def flag(name: str, value) -> str:
    """An option and its value as a flag: `--lora-alpha 32`, `--turn-advantages`, `--no-progress`."""
    f = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return f if value else "--no-" + f[2:]
    shown = (
        " ".join(map(str, value)) if isinstance(value, tuple) else f"{value:g}" if isinstance(value, float) else value
    )
    return f"{f} {shown}"


def corrects_mismatch(cfg: TrainConfig) -> bool:
    """A sampler/trainer mismatch correction is on: it needs both log-probs, the sampler's and
    the trainer's recomputed ones."""
    return cfg.corrections.rollout_is != "off" or cfg.corrections.opsm_delta is not None


def checked(cfg: TrainConfig) -> TrainConfig:
    """A copy of `cfg` with every value converted as its type checks it (lists -> tuples, ints -> floats)."""
    return dataclasses.replace(cfg, **{f.name: check_value(f.name, getattr(cfg, f.name), f.name) for f in options()})


def resolve(cfg: TrainConfig) -> TrainConfig:
    """Check (types, bounds, rules), then fill the derived values: the clip range from the preset,
    the run directory ... `cfg` itself is left as it is."""
    out = checked(cfg)  # a copy, filled in below
    validate(out)
    info = LOSSES[out.loss.algorithm]
    out.loss.clip_low = info.clip_low if out.loss.clip_low is None else out.loss.clip_low
    out.loss.clip_high = info.clip_high if out.loss.clip_high is None else out.loss.clip_high
    if out.loss.old_logp == "auto":
        out.loss.old_logp = _old_logp(out)
    task = get_task(out.data.task) if out.data.dataset is None and out.data.task in TASKS else None
    out.policy.model = out.policy.model or getattr(task, "default_model", "tiny")
    out.run.steps = getattr(task, "default_steps", 60) if out.run.steps is None else out.run.steps
    out.ppo.critic_lr = 10 * out.optim.lr if out.ppo.critic_lr is None else out.ppo.critic_lr
    s = out.sampling
    task_length = s.max_new_tokens is None
    if task_length:
        s.max_new_tokens = DatasetTask.default_max_new_tokens if out.data.dataset else \
            GymTask.default_max_new_tokens if is_gym(out.data.task) else \
            VerifiersTask.default_max_new_tokens if is_verifiers(out.data.task) else \
            get_task(out.data.task).default_max_new_tokens
    if s.min_new_tokens > s.max_new_tokens:  # the task's default max_new_tokens is known only now
        raise ConfigError(f"min_new_tokens: must be <= max_new_tokens, {s.max_new_tokens} (the "
                          f"{'task' if task_length else 'given'} value) (got {s.min_new_tokens})")
    if out.run.output_dir is None:
        out.run.output_dir = str(Path("runs") / f"{out.loss.algorithm}-{time.strftime('%Y%m%d-%H%M%S')}")
    return out


def _old_logp(cfg: TrainConfig) -> str:
    """--old-logp auto: the sampling pass's log-probs where they are the recomputation's (fp32, to 1e-5)."""
    s = cfg.sampling
    same_precision = cfg.policy.dtype == "float32" and s.rollout_dtype in ("same", "float32")
    # vLLM renormalises its log-probs over the tokens top-p/top-k keep, and over the non-stop
    # tokens for the first min_new_tokens (it bans them first): not the policy's distribution
    full_distribution = not renormalises(s.rollout_engine, s)
    # stale batches (--max-staleness > 0): pi_old is the proximal policy, the weights that train
    # the batch, recomputed (AReaL's decoupled objective); --rollout-is then corrects proximal vs behaviour
    fresh = cfg.async_rl.max_staleness == 0
    return "sampling" if same_precision and full_distribution and fresh and not corrects_mismatch(cfg) else "recompute"


def resume_config(saved: TrainConfig, changed: TrainConfig | None) -> TrainConfig:
    """The configuration a resumed run continues with: `saved` (its config.yaml), with the
    options of `changed` that differ from it, when they are safe to change (`opt(..., resume=True)`
    in gspo.config.sections: none of them alters the steps already taken; a longer --steps with a
    decaying LR schedule stretches the schedule, though)."""
    if changed is None:
        return saved
    new, old = absolute_paths(resolve(dataclasses.replace(changed, output_dir=saved.run.output_dir))), resolve(saved)
    diff = [f.name for f in options() if getattr(new, f.name) != getattr(old, f.name)]
    unsafe = [name for name in diff if name not in RESUME_SAFE]
    if unsafe:
        flags = ", ".join("--" + n.replace("_", "-") for n in unsafe)
        raise ConfigError(f"--resume: {flags} cannot change in a resumed run (the steps already taken used the saved "
                          f"value); options that can: {', '.join('--' + n.replace('_', '-') for n in RESUME_SAFE)}")
    return dataclasses.replace(saved, **{name: getattr(new, name) for name in diff})


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """Paths made absolute (model and data directories, reward and environment files, reward-model
    directories, the run directory), so a run directory and its checkpoints work from any
    working directory. Hub ids and built-in names are left as they are (they are no paths)."""

    def absolute(p):
        return str(Path(p).expanduser().resolve()) if p is not None and Path(p).expanduser().exists() else p

    def named(r: str | None) -> str | None:
        target, colon, attr = (r or "").rpartition(":")
        if colon and Path(target).exists():  # path/to/file.py:function, path/to/file.py:Class
            return f"{absolute(target)}:{attr}"
        return absolute(r) if r and not colon and Path(r).expanduser().is_dir() else r  # a reward model's directory

    def local(spec: str) -> str:  # a teacher or judge model: a directory or file, not a built-in name, URL or self
        return spec if spec in BUILTIN_MODELS or spec == "self" or spec.startswith(("http://", "https://")) \
            else absolute(spec)

    def teacher(spec: str) -> str:  # TEACHER or NAME=TEACHER (gspo.train.distill.teacher_specs)
        name, eq, rest = spec.partition("=")
        if eq and not Path(spec).expanduser().exists() and "/" not in name and ":" not in name:
            return f"{name}={local(rest)}"
        return local(spec)

    def judged(r: str) -> str:  # judge:MODEL: its model directory
        return f"judge:{local(r.removeprefix('judge:'))}" if r.startswith("judge:") else named(r)

    def file(p: str | None) -> str | None:  # a judge template or rubric: a file, else text or a built-in name
        return str(Path(p).expanduser().resolve()) if p and Path(p).expanduser().is_file() else p

    rewards = tuple(judged(r) for r in cfg.rewards.reward)
    out = (
        str(Path(cfg.run.output_dir).expanduser().absolute()) if cfg.run.output_dir not in (None, "-")
        else cfg.run.output_dir
    )
    model = cfg.policy.model if cfg.policy.model in BUILTIN_MODELS else absolute(cfg.policy.model)
    return dataclasses.replace(cfg, model=model, dataset=absolute(cfg.data.dataset),
                               eval_dataset=absolute(cfg.data.eval_dataset), reward=rewards,
                               env=named(cfg.episodes.env), output_dir=out,
                               teacher=tuple(teacher(t) for t in cfg.distill.teacher),
                               judge_template=file(cfg.rewards.judge_template),
                               judge_rubric=file(cfg.rewards.judge_rubric))


__all__ = ["DERIVED", "Facts", "absolute_paths", "checked", "corrects_mismatch", "flag", "given", "resolve",
           "resume_config", "unused", "validate"]
