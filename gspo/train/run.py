"""Setting up a run: everything the training loop needs, built and checked before anything is written.

    from gspo.train.run import build_run
    run = build_run(TrainConfig(steps=60), resume=None)   # raises on any bad input
    run.policy, run.sampler, run.trainables, run.critic, run.routing, run.task, run.rewards ...

`build_run` validates the configuration, the task's rows, the rewards and the model before
the run directory is created, so bad input never leaves a half-made run behind. It loads the
policy (or, resuming, the checkpoint's weights; a LoRA checkpoint onto its base), the sampler
(the policy itself, or a copy in `--rollout-dtype`), MoE routing hooks (gspo.models.moe.NO_ROUTING
for a dense model), the frozen reference, PPO's critic (gspo.train.critic: NoCritic for the other
algorithms), the DDP/FSDP wrappers under torchrun, and the trainables: the policy's
optimizer and learning-rate schedule, and a separate critic's (gspo.train.optim.Trainable).
Restoring the optimizer state and the run's progress is gspo.train.checkpoint's (`restore_run`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gspo.agents.side import episodes_for, task_for
from gspo.algo.clipcontrol import ClipController
from gspo.algo.losses import LOSSES
from gspo.config import ConfigError, TrainConfig, options
from gspo.config.yamlfile import load_yaml
from gspo.io.words import plural
from gspo.models.loading import BUILTIN_MODELS, DTYPES, disable_dropout, enable_checkpointing, load_policy, unwrap
from gspo.models.logprobs import TokenLogprobs, supports_packing
from gspo.models.moe import NO_ROUTING, NoRouting, Routing
from gspo.processes import distributed, parallel
from gspo.processes.distributed import Dist
from gspo.processes.memory import keep_large_on_heap
from gspo.processes.threads import choose_threads
from gspo.rewards.builtin import BUILTIN_REWARDS
from gspo.rewards.judge import is_judge, is_local_judge
from gspo.sampling.hfdecode import why_inexact
from gspo.sampling.pipeline import Pipeline
from gspo.sampling.produce import SamplingSide
from gspo.sampling.rollout import PolicySampler, encode_prompts, fsdp_sampling_note, stop_token_ids
from gspo.sampling.samplers import Inputs, load_policy_for, rewards_for, sampler_and_routing
from gspo.tasks.base import for_tokenizer, prompt_note
from gspo.tasks.data import DataError
from gspo.tasks.env import is_agent, tool_schemas
from gspo.train import checkpoint as ckpt
from gspo.train.checkpoint import Progress
from gspo.train.critic import NoCritic, make_critic
from gspo.train.distill import Teachers, load_teachers
from gspo.train.lifecycle import check_no_writer
from gspo.train.optim import Trainable, make_optimizers
from gspo.train.resolve import DERIVED, Facts, absolute_paths, flag, given, resolve, resume_config, unused

FIT_SAMPLE = 256  # prompts whose lengths _fit_lengths checks


@dataclass(kw_only=True)
class Run(SamplingSide):
    """A run: what `build_run` makes once (its configuration, models, optimizers, data), the
    pipeline the loop starts, and where it stands (`progress`). Built by keyword. It is the
    sampling side of the trainer's process (gspo.sampling.produce.SamplingSide: cfg, dist, task,
    tokenizer, policy, rewards, sampler, env, max_turns, stop_ids, play), and more; each module of
    gspo.train reads the part it declares (a Protocol of its own), not the whole."""

    run_dir: Path
    train_model: torch.nn.Module | None = None  # what training forwards call: the log-prob forward, or its wrapper
    trainables: list[Trainable] = field(default_factory=list)  # the policy's, then a separate critic's
    reference: torch.nn.Module | None = None  # the frozen initial policy, for the KL terms (not with LoRA)
    critic: NoCritic = field(default_factory=NoCritic)  # PPO's value model (gspo.train.critic); NoCritic otherwise
    routing: Routing | NoRouting = NO_ROUTING  # MoE models: hooks on every router; NO_ROUTING for dense ones
    teachers: Teachers | None = None  # on-policy distillation (gspo.train.distill); None without --teacher
    resume_from: Path | None = None  # the checkpoint to continue from
    packed: bool = False  # training forwards pack their sequences (--packing, where the model supports it)
    notes: list[str] = field(default_factory=list)  # warnings, said when the run starts
    threads: str = ""  # why torch has the CPU threads it has (gspo.processes.threads.choose_threads)
    memory: str = ""  # where large CPU tensors are allocated, in words (gspo.processes.memory)
    progress: Progress = field(default_factory=Progress)
    # where each step's batch comes from (gspo.sampling.pipeline), once the loop starts
    pipeline: Pipeline | None = None

    def autocast(self):
        """Mixed precision: forwards compute in --dtype over float32 master weights."""
        compute = DTYPES[self.cfg.policy.dtype]
        if compute == DTYPES[self.cfg.policy.param_dtype]:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=compute)

    def loss_options(self):
        """The loss section the updates read: `cfg.loss`, with the clip range the controller holds
        under --target-clip-frac (gspo.algo.clipcontrol)."""
        clip = self.progress.clip
        if clip is None:
            return self.cfg.loss
        return dataclasses.replace(self.cfg.loss, clip_low=clip.eps_low, clip_high=clip.eps_high)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The policy's optimizer (with a shared value head, its parameters too)."""
        return self.trainables[0].optimizer

    @property
    def scheduler(self):
        return self.trainables[0].scheduler

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """float16 mixed precision: the loss scaler (one for every trainable); else None."""
        return self.trainables[0].scaler if self.trainables else None


class AlreadyComplete(Exception):
    """`--resume` of a run that has done all its steps: nothing to do."""

    def __init__(self, summary: dict):
        self.summary = summary
        super().__init__(f"the run is complete ({plural(summary.get('steps'), 'step')})")


def build_run(cfg: TrainConfig | None, resume: str | Path | None = None, inputs: Inputs | None = None) -> Run:
    """Check everything and build the run; nothing is written.

    resume: a run directory to continue with its saved configuration, from its newest
    checkpoint, or from step 0 when it has none (killed before its first checkpoint); `cfg`
    (optional) then carries options to change, only those safe to change
    (gspo.config.sections: `opt(..., resume=True)`). Raises AlreadyComplete when the run has done its steps.
    """
    resume_from, restart, changed = None, False, None
    if resume is not None:
        cfg, resume_from, changed = _resume_target(Path(resume).absolute(), cfg)
        restart = resume_from is None
    # the task's default: may be capped to the model
    default_length = resume is None and cfg.sampling.max_new_tokens is None
    cfg, dist, threads = _start(cfg, fresh=resume is None)
    memory = keep_large_on_heap(cfg.run.malloc_heap)
    inputs = inputs or Inputs()
    _check_workers(cfg, inputs, dist)
    task = task_for(cfg, inputs)
    idle = _check_unused(cfg, inputs, task, only=changed)  # before any weight is loaded
    reference = _reference(cfg, inputs, dist.device)  # the initial policy, before any weight is loaded or trained
    policy, tokenizer = load_policy_for(cfg, resume_from, dist.device, inputs)
    task = for_tokenizer(task, tokenizer)  # a task's own system prompt, as plain text without a chat template
    _check_chat_template(cfg, task, tokenizer)
    env, max_turns, play = episodes_for(inputs.env or cfg.episodes.env, task, cfg.episodes.max_turns, tokenizer)
    check_agent(cfg, env, dist)
    cfg, notes = _fit_lengths(cfg, task, tokenizer, policy, default_length=default_length, env=env)
    rewards = rewards_for(cfg, task, inputs, dist.device)  # learned reward models load on the policy's device
    teachers = load_teachers(cfg, task, tokenizer, dist.device, env=env)  # checked: vocabulary, context, server
    disable_dropout(policy)  # training forwards compute the log-probs the no-grad passes do
    if cfg.policy.gradient_checkpointing:
        enable_checkpointing(unwrap(policy))
    run = Run(cfg=cfg, run_dir=Path(cfg.run.output_dir), dist=dist, task=task, rewards=rewards, policy=policy,
              tokenizer=tokenizer, reference=reference, teachers=teachers, resume_from=resume_from,
              progress=Progress(restart=restart, clip=clip_controller(cfg)),
              notes=list(getattr(task, "notes", [])) + prompt_note(task, cfg.policy.model) + idle + notes, env=env,
              max_turns=max_turns, play=play,
              stop_ids=stop_token_ids(tokenizer, policy, cfg.sampling.stop_token), threads=threads, memory=memory)
    _training_side(run, inputs)
    return run


def clip_controller(cfg: TrainConfig) -> ClipController | None:
    """--target-clip-frac's controller, from the resolved clip range (None: the range stays fixed)."""
    if cfg.loss.target_clip_frac is None:
        return None
    return ClipController(cfg.loss.target_clip_frac, cfg.loss.clip_low, cfg.loss.clip_high,
                          log_space=LOSSES[cfg.loss.algorithm].log_space_clip)


def _start(cfg: TrainConfig, fresh: bool) -> tuple[TrainConfig, Dist, str]:
    """The resolved configuration and the process group; the run directory checked (a new run's
    must be empty), the seeds and the CPU threads set (and why that many, in words). fresh: not a
    resumed run."""
    cfg = resolve(cfg)
    if fresh:
        cfg = absolute_paths(cfg)  # the run directory works from any working directory
    ranks = distributed.world_size_from_env()
    rollout_ranks = cfg.async_rl.rollout_workers if ranks > 1 else 0  # under torchrun: the world's last N ranks
    world = ranks - rollout_ranks
    if fresh and cfg.run.parallel == "fsdp":  # ddp is the default: gspo.cli refuses it when the flag is given
        check_processes("fsdp")
    if cfg.sampling.prompts_per_step % world:
        raise ConfigError(f"prompts_per_step: must be divisible by the number of processes, {world}, so that "
                          f"each process samples whole groups (got {cfg.sampling.prompts_per_step})")
    dist = distributed.init(cfg.run.parallel, cfg.run.device, rollout_ranks)  # a single process without torchrun
    cfg = dataclasses.replace(cfg, output_dir=dist.broadcast_object(cfg.run.output_dir))  # rank 0's timestamp
    run_dir = Path(cfg.run.output_dir)
    if dist.is_main:
        _check_output_dir(run_dir)
        check_no_writer(run_dir)  # a live run holds it: refused in one line
    if fresh and not ckpt.is_empty_run_dir(run_dir):
        raise FileExistsError(f"--output-dir {run_dir}: exists and is not empty (use --resume {run_dir} to continue "
                              "it, or choose another --output-dir)")
    threads, why = choose_threads(cfg.run.threads)  # 0: the cores free now (gspo.processes.threads)
    torch.set_num_threads(threads)
    cfg = dataclasses.replace(cfg, threads=threads)  # config.yaml keeps the count: a resume computes alike
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    return cfg, dist, why


def check_agent(cfg: TrainConfig, env, dist: Dist) -> None:
    """Agent code (gspo.agents.runner) with what it does not run with yet, refused in one line;
    --episode-timeout without an agent, too."""
    if env is None or not is_agent(env):
        if given(cfg, "episode_timeout"):
            raise ConfigError(f"{flag('episode_timeout', cfg.episodes.episode_timeout)}: not used: it bounds an "
                              "agent's episodes (--env naming an async rollout function, docs/agents.md)")
        return
    name = f"env {env.__name__} (an agent)"
    for bad, why in [(dist.world > 1, "several processes: not yet (one process; torchrun is refused)"),
                     (cfg.async_rl.rollout_workers > 0, "--rollout-workers: not yet (the endpoint runs in the "
                                                        "trainer's process)"),
                     (cfg.moe.routing_replay, "--routing-replay: not yet (the endpoint does not record the experts)")]:
        if bad:
            raise ConfigError(f"{name}: {why}")


def check_processes(parallel: str) -> None:
    """--parallel replicates or shards over the processes torchrun starts: refused in one process."""
    if distributed.world_size_from_env() == 1:
        raise ConfigError(f"--parallel {parallel}: needs several processes started by torchrun "
                          "(torchrun --nproc-per-node "
                          f"N -m gspo train --parallel {parallel} ...); this is one process")


def _check_output_dir(run_dir: Path) -> None:
    """--output-dir: a directory, or a path one can be made at (no file on the way, the nearest
    existing directory writable)."""
    for p in (run_dir, *run_dir.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"--output-dir {run_dir}: {'it' if p == run_dir else p} is a file, not a directory")
            if p != run_dir and not os.access(p, os.W_OK | os.X_OK):
                raise ConfigError(f"--output-dir {run_dir}: cannot be made, {p} is not writable")
            return


def _check_unused(cfg: TrainConfig, inputs: Inputs, task, only=None) -> list[str]:
    """Options the rest of the run leaves without effect (gspo.train.resolve.unused): the first the user
    gave is refused in one line. Said in a warning instead: the options a saved config.yaml holds as
    gspo derived them (gspo.train.resolve.DERIVED), vLLM settings without --rollout-engine vllm (a recipe's
    stay when a flag samples with hf) and --task with --dataset (documented as ignored there).
    only: the options to check (resuming: those the resume changes). Returns the warnings."""
    specs = tuple(inputs.reward_funcs or cfg.rewards.reward) or tuple(task.default_rewards)
    model = Path(str(cfg.policy.model)).expanduser()
    facts = Facts(dataset=cfg.data.dataset is not None or inputs.train_dataset is not None,
                  env=(inputs.env or cfg.episodes.env or getattr(task, "default_env", None)) is not None, rewards=specs,
                  reward_model=any(isinstance(r, str) and ":" not in r and r not in BUILTIN_REWARDS or is_local_judge(r)
                                   for r in specs), judge=any(map(is_judge, specs)),
                  local_model=inputs.model_object is None and (cfg.policy.model in BUILTIN_MODELS or model.is_dir() and
                                                               not (model / "adapter_config.json").exists()))
    mine = [name for name in (f.name for f in options()) if given(cfg, name) and (only is None or name in only)]
    idle = [(name, why) for name, why in unused(cfg, facts) if name in mine]
    for name, why in idle:
        if name not in DERIVED:
            raise ConfigError(f"{flag(name, getattr(cfg, name))}: {why}")
    notes = [f"{flag(name, getattr(cfg, name))}: not used: {why}" for name, why in idle]
    vllm = ([flag(n, getattr(cfg, n)) for n in mine if n.startswith("vllm_")]
            if cfg.sampling.rollout_engine == "hf" else [])
    notes += [f"{', '.join(vllm)}: not used: they set the vLLM engine, and this run samples with --rollout-engine "
              f"{cfg.sampling.rollout_engine}"] if vllm else []
    if "task" in mine and facts.dataset:
        notes.append(f"{flag('task', cfg.data.task)}: not used: --dataset gives the prompts, rewards and defaults")
    return notes


def _check_workers(cfg: TrainConfig, inputs: Inputs, dist: Dist) -> None:
    """Rollout workers build their own copy of the sampling side from names: Python objects
    cannot reach them."""
    held = [name for name in ("model", "tokenizer", "train_dataset", "reward_funcs", "env")
            if getattr(inputs, name) is not None and not (name == "model" and inputs.model_object is None)]
    count, n = len(cfg.async_rl.rollout_devices), cfg.async_rl.rollout_workers
    if count and count not in (n, n * dist.world):
        each = "" if dist.world == 1 else (
            f" (the same for every process) or {n * dist.world} (the {n} of each of the "
            f"{plural(dist.world, 'process', 'processes')}, in rank order)"
        )
        raise ConfigError(f"rollout_devices: needs {plural(n, 'device')}, one per rollout worker{each} (got {count})")
    if cfg.async_rl.rollout_workers and held:
        raise ConfigError(f"rollout_workers: the workers build the model, data, rewards and environment from names and "
                          f"paths; this run passes {', '.join(held)} as Python objects (save them and pass paths, or "
                          "use --rollout-workers 0 with --max-staleness)")


def _training_side(run: Run, inputs: Inputs) -> None:
    """The sampler, MoE routing hooks, PPO's critic, the DDP/FSDP wrappers and the trainables
    (the policy's optimizer and LR schedule, and a separate critic's)."""
    cfg, dist, policy = run.cfg, run.dist, run.policy
    # with rollout workers the trainer's own sampler is the policy itself (no engine, no low-precision copy: in
    # the dtype it holds its weights): it never samples
    own = dataclasses.replace(cfg, rollout_engine="hf", rollout_dtype=cfg.policy.param_dtype) \
        if cfg.async_rl.rollout_workers else cfg
    run.sampler, run.routing = sampler_and_routing(own, policy, dist, inputs)
    run.critic = make_critic(cfg, policy, run.resume_from, dist.device, from_object=inputs.model_object is not None)
    # FSDP gathers parameters in it
    mixed = DTYPES[cfg.policy.dtype] if cfg.policy.param_dtype != cfg.policy.dtype else None
    if isinstance(run.sampler, PolicySampler) and dist.enabled and dist.parallel == "fsdp":  # read before sharding
        run.notes.append(fsdp_sampling_note(policy, DTYPES[cfg.policy.dtype],
                                            cfg.data.max_prompt_length + cfg.sampling.max_new_tokens,
                                            cfg.sampling.cuda_graphs))
    run.packed = _packing(cfg, policy, run.routing, run.notes)  # before sharding: an FSDP model has DTensor weights
    # what training forwards call: the log-prob forward (LM head included), DDP-wrapped or FSDP-sharded
    run.train_model = parallel.wrap(TokenLogprobs(policy), dist, find_unused=run.routing.moe, mixed=mixed)
    if dist.enabled and dist.parallel == "fsdp":  # the frozen models: the reference, local teachers
        for frozen in [run.reference, *(t.model for t in (run.teachers.teachers if run.teachers else []))]:
            if frozen is not None:
                parallel.shard(frozen, dist)
    if isinstance(run.sampler, PolicySampler) and run.sampler.model is policy:
        run.sampler.root = run.train_model  # under FSDP, gathering the root gathers every parameter
    optimizer, scheduler = make_optimizers(cfg, policy, run.critic)
    scaler = torch.amp.GradScaler(dist.device.type) if cfg.policy.dtype == "float16" and mixed is not None else None
    run.trainables = [Trainable(run.critic.optimized(policy), optimizer, scheduler, scaler, train=run.train_model),
                      *run.critic.trainables(cfg, dist, mixed, scaler)]


def _packing(cfg: TrainConfig, policy, routing: Routing | NoRouting, notes: list[str]) -> bool:
    """Whether training forwards pack (--packing, where the model can); a refusal is said once."""
    if not cfg.policy.packing:
        return False
    if routing.moe:
        notes.append("--packing: off for this MoE model (its routing is recorded in the padded layout); "
                     "micro-batches are padded")
        return False
    if not supports_packing(policy):
        notes.append(f"--packing: off for {cfg.policy.model} "
                     "(a packed forward does not give the padded forward's hidden "
                     "states, or the model has no plain linear LM head); micro-batches are padded")
        return False
    return True


def _check_chat_template(cfg: TrainConfig, task, tokenizer) -> None:
    """Chat prompts (or --system-prompt) need the tokenizer's chat template: one line if it has none."""
    if (any(ex.is_chat for ex in task.test_set()[:1] + task.train_batch(1, 1, cfg.run.seed))
            and not tokenizer.chat_template):
        why = ("--system-prompt makes prompts chat messages" if cfg.data.system_prompt is not None
               else "prompts are chat messages")
        raise DataError(f"{cfg.data.dataset or 'task ' + cfg.data.task}: {why} "
                        f"but the tokenizer of {cfg.policy.model} has no chat template")


def _resume_target(run_dir: Path, changed: TrainConfig | None) -> tuple[TrainConfig, Path | None, set[str]]:
    """The configuration a resumed run continues with, its newest checkpoint (None: start over
    from step 0), and the options the resume changes. Raises AlreadyComplete when the run has done its steps."""
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"--resume {run_dir}: not a gspo run directory (no config.yaml)")
    saved = dataclasses.replace(load_yaml(run_dir / "config.yaml"), output_dir=str(run_dir))
    cfg = resume_config(saved, changed)
    last = ckpt.latest_checkpoint(run_dir)
    done = ckpt.is_complete(run_dir, cfg.run.steps)
    if done is not None and last is not None and last.name == f"step-{cfg.run.steps:06d}":
        raise AlreadyComplete(done)
    return cfg, last, {f.name for f in options() if getattr(cfg, f.name) != getattr(saved, f.name)}


def _fit_lengths(cfg: TrainConfig, task, tokenizer, policy, *, default_length: bool,
                 env=None) -> tuple[TrainConfig, list[str]]:
    """Prompt + completion must fit the model's positions: a given --max-new-tokens that does
    not is a one-line error, the task's default is capped to fit (said in a warning); prompts
    longer than --max-prompt-length are cut (a warning says how many). Multi-turn (`env`): the
    episode's token budget is what the positions leave after the longest prompt (a larger
    --max-episode-tokens is an error). Checked on the first FIT_SAMPLE training and evaluation
    prompts. Returns the config and the warnings."""
    notes, sample = [], FIT_SAMPLE
    examples = (
        task.train_batch(1, min(sample, cfg.sampling.prompts_per_step * 8), cfg.run.seed) + task.test_set()[:sample]
    )
    tools = tool_schemas(list(getattr(env, "tools", None) or []))
    lengths = [len(ids) for ids in encode_prompts(tokenizer, [ex.prompt for ex in examples], tools=tools)]
    longest = max(lengths)
    if cfg.data.max_prompt_length and longest > cfg.data.max_prompt_length:
        cut = sum(n > cfg.data.max_prompt_length for n in lengths)
        one = cut == 1
        notes.append(f"max_prompt_length: {cut} of the {plural(len(lengths), 'prompt')} "
                     f"checked {'is' if one else 'are'} "
                     f"longer than {plural(cfg.data.max_prompt_length, 'token')} (up to {longest}); "
                     f"{'it keeps its' if one else 'they keep their'} last {cfg.data.max_prompt_length}")
        longest = cfg.data.max_prompt_length
    limit = getattr(unwrap(policy).config, "max_position_embeddings", None)
    if limit and longest + cfg.sampling.max_new_tokens > limit:
        if not default_length or longest >= limit:
            raise ConfigError(f"max_new_tokens: prompts of up to {plural(longest, 'token')} + "
                              f"{plural(cfg.sampling.max_new_tokens, 'new token')} "
                              f"exceed the model's max_position_embeddings ({limit}); lower --max-new-tokens or set "
                              "--max-prompt-length")
        whose = (
            f"the default for a dataset ({cfg.data.dataset})" if cfg.data.dataset else f"task {cfg.data.task}'s default"
        )
        notes.append(f"max_new_tokens: {whose}, {cfg.sampling.max_new_tokens}, capped to {limit - longest}, so that "
                     f"prompts of up to {plural(longest, 'token')} fit the model's {limit} positions")
        cfg = dataclasses.replace(cfg, max_new_tokens=limit - longest)
    if env is not None and limit:
        if longest + cfg.episodes.max_episode_tokens > limit:
            raise ConfigError(f"max_episode_tokens: prompts of up to {plural(longest, 'token')} "
                              f"+ {cfg.episodes.max_episode_tokens} "
                              f"exceed the model's max_position_embeddings ({limit})")
        cfg = dataclasses.replace(cfg, max_episode_tokens=cfg.episodes.max_episode_tokens or limit - longest)
    span = longest + (cfg.episodes.max_episode_tokens if env is not None else cfg.sampling.max_new_tokens)
    why = why_inexact(unwrap(policy), span)  # no sampler, an engine's neither, samples what training computes
    if why is not None:  # (gspo's own sampler checks each rollout again: prompts longer than those checked here)
        raise ConfigError(f"model {cfg.policy.model}: {why}")
    return cfg, notes


def _reference(cfg: TrainConfig, inputs: Inputs, device: torch.device):
    """The frozen initial policy for the KL terms (beta > 0 or reward_kl_coef > 0), in the
    compute dtype; None with LoRA (the base model with the adapters off serves)."""
    if not (cfg.loss.beta > 0 or cfg.ppo.reward_kl_coef > 0) or cfg.lora.lora_r > 0:
        return None
    if inputs.model_object is not None:
        reference = copy.deepcopy(inputs.model_object).to(device=device, dtype=DTYPES[cfg.policy.dtype])
    else:
        reference, _ = load_policy(cfg.policy.model, dtype=DTYPES[cfg.policy.dtype], device=device,
                                   revision=cfg.policy.revision, with_tokenizer=False)
    return reference.eval().requires_grad_(False)
