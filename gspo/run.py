"""Setting up a run: everything the training loop needs, built and checked before anything is written.

    from gspo.run import build_run
    run = build_run(TrainConfig(steps=60), resume=None)   # raises on any bad input
    run.policy, run.sampler, run.trainables, run.critic, run.routing, run.task, run.rewards ...

`build_run` validates the configuration, the task's rows, the rewards and the model before
the run directory is created, so bad input never leaves a half-made run behind. It loads the
policy (or, resuming, the checkpoint's weights; a LoRA checkpoint onto its base), the sampler
(the policy itself, or a copy in `--rollout-dtype`), MoE routing hooks (gspo.moe.NO_ROUTING
for a dense model), the frozen reference, PPO's critic (gspo.critic: NoCritic for the other
algorithms), the DDP/FSDP wrappers under torchrun, and the trainables: the policy's
optimizer and learning-rate schedule, and a separate critic's (gspo.optim.Trainable).
Restoring the optimizer state and the run's progress is gspo.checkpoint's (`restore_run`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gspo import checkpoint as ckpt
from gspo import distributed, parallel
from gspo.config import ConfigError, TrainConfig
from gspo.configfile import load_yaml
from gspo.resolve import absolute_paths, resolve, resume_config
from gspo.data import DataError
from gspo.distributed import Dist
from gspo.lifecycle import check_no_writer
from gspo.env import episode_env, tool_schemas
from gspo.critic import NoCritic, make_critic
from gspo.logprobs import TokenLogprobs, supports_packing
from gspo.models import (DTYPES, AdapterLoad, add_lora, disable_dropout, enable_checkpointing, load_policy,
                         load_tokenizer, low_precision_copy, prepare_tokenizer, quiet_peft, resolve_model_path, unwrap)
from gspo.moe import NO_ROUTING, MoEError, NoRouting, Routing, is_moe
from gspo.optim import Trainable, make_optimizers
from gspo.rewards import Reward, load_rewards
from gspo.rollout import PolicySampler, Sampler, encode_prompts, fsdp_sampling_note, stop_token_ids
from gspo.tasks import build_task
from gspo.tasks.base import SystemPrompt
from gspo.vllm_engine import VLLMSampler

FIT_SAMPLE = 256  # prompts whose lengths _fit_lengths checks


@dataclass
class Run:
    """A run: its configuration, models, optimizers, data and where it stands. Built by keyword."""

    cfg: TrainConfig
    run_dir: Path
    dist: Dist
    task: object = None  # train_batch(step, n, seed), test_set(n)
    rewards: list[Reward] = field(default_factory=list)
    policy: object = None  # the model being trained (PEFT-wrapped with LoRA); what checkpoints save
    tokenizer: object = None
    sampler: Sampler | None = None  # who samples rollouts
    train_model: object = None  # what training forwards call: the policy's log-prob forward, or its DDP wrapper
    trainables: list[Trainable] = field(default_factory=list)  # the policy's, then a separate critic's
    reference: object | None = None  # the frozen initial policy, for the KL terms (not with LoRA)
    critic: NoCritic = field(default_factory=NoCritic)  # PPO's value model (gspo.critic); NoCritic otherwise
    routing: Routing | NoRouting = NO_ROUTING  # MoE models: hooks on every router; NO_ROUTING for dense ones
    resume_from: Path | None = None  # the checkpoint to continue from
    stop_ids: tuple[int, ...] = ()  # tokens that end a completion (gspo.rollout.stop_token_ids)
    packed: bool = False  # training forwards pack their sequences (--packing, where the model supports it)
    restart: bool = False  # resumed, but killed before its first checkpoint: start over from step 0
    notes: list[str] = field(default_factory=list)  # warnings, said when the run starts
    env: type | None = None  # multi-turn: the environment class (gspo.env), one instance per episode
    max_turns: int = 1  # model turns per episode at most
    # where the run stands; saved in every checkpoint
    start_step: int = 0
    steps_done: int = 0
    eval_before: dict | None = None
    evals: list[dict] = field(default_factory=list)
    t_start: float = field(default_factory=time.time)

    def autocast(self):
        """Mixed precision: forwards compute in --dtype over float32 master weights."""
        compute = DTYPES[self.cfg.policy.dtype]
        if compute == DTYPES[self.cfg.policy.param_dtype]:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=compute)

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
        super().__init__(f"the run is complete ({summary.get('steps')} steps)")


@dataclass
class Inputs:
    """What the Python API (gspo.Trainer) passes as objects instead of names and paths."""

    model: object = None  # a transformers PreTrainedModel (its directory, a str, goes into the config)
    tokenizer: object = None
    train_dataset: object = None  # a list of dicts or a datasets.Dataset
    eval_dataset: object = None
    reward_funcs: list | None = None  # callables (completions, **columns) -> list[float], and/or reward names
    env: type | None = None  # the environment class of multi-turn episodes (gspo.env)

    @property
    def model_object(self):
        return self.model if isinstance(self.model, torch.nn.Module) else None


def build_run(cfg: TrainConfig | None, resume: str | Path | None = None, inputs: Inputs | None = None) -> Run:
    """Check everything and build the run; nothing is written.

    resume: a run directory to continue with its saved configuration, from its newest
    checkpoint, or from step 0 when it has none (killed before its first checkpoint); `cfg`
    (optional) then carries options to change, only those safe to change
    (gspo.config.sections: `opt(..., resume=True)`). Raises AlreadyComplete when the run has done its steps.
    """
    resume_from, restart = None, False
    if resume is not None:
        cfg, resume_from = _resume_target(Path(resume).absolute(), cfg)
        restart = resume_from is None
    default_length = resume is None and cfg.sampling.max_new_tokens is None  # the task's default: may be capped to the model
    cfg, dist = _start(cfg, fresh=resume is None)
    inputs = inputs or Inputs()
    task = _task(cfg, inputs)
    reference = _reference(cfg, inputs, dist.device)  # the initial policy, before any weight is loaded or trained
    policy, tokenizer = _load_policy(cfg, resume_from, dist.device, inputs)
    _check_chat_template(cfg, task, tokenizer)
    env, max_turns = episode_env(inputs.env or cfg.episodes.env, task, cfg.episodes.max_turns, tokenizer)
    cfg, notes = _fit_lengths(cfg, task, tokenizer, policy, default_length=default_length, env=env)
    rewards = _rewards(cfg, task, inputs, dist.device)  # learned reward models load on the policy's device
    disable_dropout(policy)  # training forwards compute the log-probs the no-grad passes do
    if cfg.policy.gradient_checkpointing:
        enable_checkpointing(unwrap(policy))
    run = Run(cfg=cfg, run_dir=Path(cfg.run.output_dir), dist=dist, task=task, rewards=rewards, policy=policy,
              tokenizer=tokenizer, reference=reference, resume_from=resume_from, restart=restart,
              notes=list(getattr(task, "notes", [])) + notes, env=env, max_turns=max_turns,
              stop_ids=stop_token_ids(tokenizer, policy, cfg.sampling.stop_token))
    _training_side(run, inputs)
    return run


def _start(cfg: TrainConfig, fresh: bool) -> tuple[TrainConfig, Dist]:
    """The resolved configuration and the process group; the run directory checked (a new run's
    must be empty), the seeds set. fresh: not a resumed run."""
    cfg = resolve(cfg)
    if fresh:
        cfg = absolute_paths(cfg)  # the run directory works from any working directory
    world = distributed.world_size_from_env()
    if cfg.sampling.prompts_per_step % world:
        raise ConfigError(f"prompts_per_step: must be divisible by the number of processes, {world}, so that "
                          f"each process samples whole groups (got {cfg.sampling.prompts_per_step})")
    dist = distributed.init(cfg.run.parallel, cfg.run.device)  # a single process without torchrun
    cfg = dataclasses.replace(cfg, output_dir=dist.broadcast_object(cfg.run.output_dir))  # rank 0's timestamp
    run_dir = Path(cfg.run.output_dir)
    if dist.is_main:
        check_no_writer(run_dir)  # a live run holds it: refused in one line
    if fresh and not ckpt.is_empty_run_dir(run_dir):
        raise FileExistsError(f"{run_dir}: output directory exists and is not empty (use --resume {run_dir} to continue it)")
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    return cfg, dist


def _training_side(run: Run, inputs: Inputs) -> None:
    """The sampler, MoE routing hooks, PPO's critic, the DDP/FSDP wrappers and the trainables
    (the policy's optimizer and LR schedule, and a separate critic's)."""
    cfg, dist, policy = run.cfg, run.dist, run.policy
    run.sampler, run.routing = _sampler_and_routing(cfg, policy, dist, inputs)
    run.critic = make_critic(cfg, policy, run.resume_from, dist.device, from_object=inputs.model_object is not None)
    mixed = DTYPES[cfg.policy.dtype] if cfg.policy.param_dtype != cfg.policy.dtype else None  # FSDP gathers parameters in it
    if isinstance(run.sampler, PolicySampler) and dist.enabled and dist.parallel == "fsdp":  # read before sharding
        run.notes.append(fsdp_sampling_note(policy, DTYPES[cfg.policy.dtype], cfg.data.max_prompt_length + cfg.sampling.max_new_tokens))
    run.packed = _packing(cfg, policy, run.routing, run.notes)  # before sharding: an FSDP model has DTensor weights
    # what training forwards call: the log-prob forward (LM head included), DDP-wrapped or FSDP-sharded
    run.train_model = parallel.wrap(TokenLogprobs(policy), dist, find_unused=run.routing.moe, mixed=mixed)
    if run.reference is not None and dist.enabled and dist.parallel == "fsdp":
        parallel.shard(run.reference, dist)
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
        notes.append(f"--packing: off for {cfg.policy.model} (a packed forward does not give the padded forward's hidden "
                     "states, or the model has no plain linear LM head); micro-batches are padded")
        return False
    return True


def _check_chat_template(cfg: TrainConfig, task, tokenizer) -> None:
    """Chat prompts (or --system-prompt) need the tokenizer's chat template: one line if it has none."""
    if any(ex.is_chat for ex in task.test_set()[:1] + task.train_batch(1, 1, cfg.run.seed)) and not tokenizer.chat_template:
        why = "--system-prompt makes prompts chat messages" if cfg.data.system_prompt is not None else "prompts are chat messages"
        raise DataError(f"{cfg.data.dataset or 'task ' + cfg.data.task}: {why} but the tokenizer of {cfg.policy.model} has no chat template")


def _resume_target(run_dir: Path, changed: TrainConfig | None) -> tuple[TrainConfig, Path | None]:
    """The configuration a resumed run continues with, and its newest checkpoint (None: start
    over from step 0). Raises AlreadyComplete when the run has done its steps."""
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir}: not a gspo run directory (no config.yaml) to resume")
    saved = dataclasses.replace(load_yaml(run_dir / "config.yaml"), output_dir=str(run_dir))
    cfg = resume_config(saved, changed)
    last = ckpt.latest_checkpoint(run_dir)
    done = ckpt.is_complete(run_dir, cfg.run.steps)
    if done is not None and last is not None and last.name == f"step-{cfg.run.steps:06d}":
        raise AlreadyComplete(done)
    return cfg, last


def task_and_rewards(cfg: TrainConfig, inputs: Inputs | None = None) -> tuple[object, list[Reward]]:
    """The task (built-in, the user's dataset file, or in-memory rows; validated) and its rewards."""
    task = _task(cfg, inputs or Inputs())
    return task, _rewards(cfg, task, inputs or Inputs())


def _task(cfg: TrainConfig, inputs: Inputs):
    specs = tuple(inputs.reward_funcs or cfg.rewards.reward)
    task = build_task(cfg.data, specs, cfg.eval.eval_size, train_rows=inputs.train_dataset,
                      eval_rows=inputs.eval_dataset)
    return task if cfg.data.system_prompt is None else SystemPrompt(task, cfg.data.system_prompt)  # training, eval, `gspo eval`


def _rewards(cfg: TrainConfig, task, inputs: Inputs, device=None) -> list[Reward]:
    """The rewards; a learned reward model goes on --reward-model-device, else `device` (the policy's)."""
    return load_rewards(list(inputs.reward_funcs or cfg.rewards.reward) or list(task.default_rewards),
                        list(cfg.rewards.reward_weights) or None, format_pattern=cfg.rewards.format_pattern,
                        max_new_tokens=cfg.sampling.max_new_tokens, device=device or cfg.run.device,
                        reward_model_device=cfg.rewards.reward_model_device, batch_size=cfg.rewards.reward_model_batch_size)


def _fit_lengths(cfg: TrainConfig, task, tokenizer, policy, *, default_length: bool,
                 env=None) -> tuple[TrainConfig, list[str]]:
    """Prompt + completion must fit the model's positions: a given --max-new-tokens that does
    not is a one-line error, the task's default is capped to fit (said in a warning); prompts
    longer than --max-prompt-length are cut (a warning says how many). Multi-turn (`env`): the
    episode's token budget is what the positions leave after the longest prompt (a larger
    --max-episode-tokens is an error). Checked on the first FIT_SAMPLE training and evaluation
    prompts. Returns the config and the warnings."""
    notes, sample = [], FIT_SAMPLE
    examples = task.train_batch(1, min(sample, cfg.sampling.prompts_per_step * 8), cfg.run.seed) + task.test_set()[:sample]
    tools = tool_schemas(list(getattr(env, "tools", None) or []))
    lengths = [len(ids) for ids in encode_prompts(tokenizer, [ex.prompt for ex in examples], tools=tools)]
    longest = max(lengths)
    if cfg.data.max_prompt_length and longest > cfg.data.max_prompt_length:
        cut = sum(n > cfg.data.max_prompt_length for n in lengths)
        notes.append(f"max_prompt_length: {cut} of the {len(lengths)} prompts checked are longer than "
                     f"{cfg.data.max_prompt_length} tokens (up to {longest}); they keep their last {cfg.data.max_prompt_length}")
        longest = cfg.data.max_prompt_length
    limit = getattr(unwrap(policy).config, "max_position_embeddings", None)
    if limit and longest + cfg.sampling.max_new_tokens > limit:
        if not default_length or longest >= limit:
            raise ConfigError(f"max_new_tokens: prompts of up to {longest} tokens + {cfg.sampling.max_new_tokens} new tokens "
                              f"exceed the model's max_position_embeddings ({limit}); lower --max-new-tokens or set "
                              "--max-prompt-length")
        whose = f"the default for a dataset ({cfg.data.dataset})" if cfg.data.dataset else f"task {cfg.data.task}'s default"
        notes.append(f"max_new_tokens: {whose}, {cfg.sampling.max_new_tokens}, capped to {limit - longest}, so that "
                     f"prompts of up to {longest} tokens fit the model's {limit} positions")
        cfg = dataclasses.replace(cfg, max_new_tokens=limit - longest)
    if env is not None and limit:
        if longest + cfg.episodes.max_episode_tokens > limit:
            raise ConfigError(f"max_episode_tokens: prompts of up to {longest} tokens + {cfg.episodes.max_episode_tokens} "
                              f"exceed the model's max_position_embeddings ({limit})")
        cfg = dataclasses.replace(cfg, max_episode_tokens=cfg.episodes.max_episode_tokens or limit - longest)
    return cfg, notes


def _reference(cfg: TrainConfig, inputs: Inputs, device: torch.device):
    """The frozen initial policy for the KL terms (beta > 0 or reward_kl_coef > 0), in the
    compute dtype; None with LoRA (the base model with the adapters off serves)."""
    if not (cfg.loss.beta > 0 or cfg.ppo.reward_kl_coef > 0) or cfg.lora.lora_r > 0:
        return None
    if inputs.model_object is not None:
        reference = copy.deepcopy(inputs.model_object).to(device=device, dtype=DTYPES[cfg.policy.dtype])
    else:
        reference, _ = load_policy(cfg.policy.model, dtype=DTYPES[cfg.policy.dtype], device=device, revision=cfg.policy.revision,
                                   with_tokenizer=False)
    return reference.eval().requires_grad_(False)


@quiet_peft()  # peft's deprecation warning when it wraps a model is not the user's
def _load_policy(cfg: TrainConfig, resume_from: Path | None, device: torch.device, inputs: Inputs):
    """The policy to train and its tokenizer: the model (a directory, or the API's model
    object), or the checkpoint's weights (a LoRA checkpoint: its base plus the saved adapter)."""
    dtype = DTYPES[cfg.policy.param_dtype]  # float32 master weights unless pure low precision is asked for
    obj = inputs.model_object
    if resume_from is not None and cfg.lora.lora_r > 0:
        if obj is None:
            return load_policy(str(resume_from), dtype=dtype, device=device, revision=cfg.policy.revision,
                               adapter=AdapterLoad(cfg.policy.model, trainable=True))
        from peft import PeftModel

        policy = PeftModel.from_pretrained(obj.to(device=device, dtype=dtype), resume_from, is_trainable=True)
        return policy, inputs.tokenizer or load_tokenizer(resume_from)
    if resume_from is not None:
        return load_policy(str(resume_from), dtype=dtype, device=device)
    if obj is not None:
        policy, tokenizer = obj.to(device=device, dtype=dtype), prepare_tokenizer(inputs.tokenizer, "tokenizer")
    else:
        policy, tokenizer = load_policy(cfg.policy.model, dtype=dtype, device=device, revision=cfg.policy.revision,
                                        with_tokenizer=inputs.tokenizer is None)
        if inputs.tokenizer is not None:
            tokenizer = prepare_tokenizer(inputs.tokenizer, "tokenizer")
    if cfg.lora.lora_r > 0:
        policy = add_lora(policy, r=cfg.lora.lora_r, alpha=cfg.lora.lora_alpha, dropout=cfg.lora.lora_dropout,
                          target_modules=list(cfg.lora.lora_target_modules), revision=cfg.policy.revision)
    return policy, tokenizer


def _sampler_and_routing(cfg: TrainConfig, policy, dist: Dist, inputs: Inputs) -> tuple[Sampler, Routing | NoRouting]:
    """The sampler (the policy, or a copy in the sampling precision made before any hook is
    installed: --rollout-dtype, else the compute --dtype; under FSDP always the policy, sampling
    in --dtype) and, for MoE models, the routing hooks (drift is always measured)."""
    rollout_dtype = DTYPES[cfg.policy.dtype] if cfg.sampling.rollout_dtype == "same" else DTYPES[cfg.sampling.rollout_dtype]
    if cfg.sampling.rollout_engine == "vllm":
        if inputs.model_object is not None:
            raise ConfigError("rollout_engine: vllm loads the model from its directory; pass model= as a path "
                              "(or save_pretrained it first)")
        return _vllm_sampler(cfg, policy, dist, rollout_dtype), \
            (Routing(policy, cfg.policy.model) if is_moe(policy) else NO_ROUTING)
    # FSDP: the policy itself (sharded next), gathered for each rollout in the compute dtype (its
    # MixedPrecisionPolicy's param dtype), never a full copy per process; rollout_dtype == dtype there
    fsdp = dist.enabled and dist.parallel == "fsdp"
    model = policy if fsdp or rollout_dtype == DTYPES[cfg.policy.param_dtype] else low_precision_copy(policy, rollout_dtype)
    sampler = PolicySampler(model, dist=dist)
    if not is_moe(policy):
        if cfg.moe.routing_replay or cfg.moe.router_aux_loss_coef > 0:
            option = "--routing-replay" if cfg.moe.routing_replay else "--router-aux-loss-coef"
            raise MoEError(f"{option}: {cfg.policy.model} is not a Mixture-of-Experts model with router modules "
                           "(Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE style)")
        return sampler, NO_ROUTING
    routing = Routing(policy, cfg.policy.model)
    if cfg.loss.old_logp == "sampling":  # the experts used while sampling are the old policy's
        sampler.routing = routing if model is policy else Routing(model, cfg.policy.model)
    return sampler, routing


def _vllm_sampler(cfg: TrainConfig, policy, dist: Dist, dtype: torch.dtype):
    """A colocated vLLM engine over the model's directory (the base model for LoRA); the
    policy's weights are loaded into it before every rollout."""
    max_len = cfg.vllm.vllm_max_model_len or int(getattr(unwrap(policy).config, "max_position_embeddings", 4096))
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    path = resolve_model_path(cfg.policy.model, revision=cfg.policy.revision)  # a Hub id: its snapshot directory
    return VLLMSampler(str(path), dataclasses.replace(cfg.vllm, vllm_max_model_len=max_len), dtype=name,
                       seed=cfg.run.seed, dist=dist)
