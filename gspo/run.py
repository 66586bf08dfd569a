"""Setting up a run: everything the training loop needs, built and checked before anything is written.

    from gspo.run import build_run
    run = build_run(TrainConfig(steps=60), resume=None)   # raises on any bad input
    run.policy, run.sampler, run.optimizer, run.task, run.rewards ...

`build_run` validates the configuration, the task's rows, the rewards and the model before
the run directory is created, so bad input never leaves a half-made run behind. It loads the
policy (or, resuming, the checkpoint's weights; a LoRA checkpoint onto its base), the sampler
(the policy itself, or a copy in `--rollout-dtype`), MoE routing hooks, the frozen reference,
PPO's value model, the DDP/FSDP wrappers under torchrun, and the optimizers with their
learning-rate schedules. Restoring the optimizer state and the run's progress from a
checkpoint is gspo.checkpoint's (`restore_run`).

The optimizers and their learning-rate schedules are gspo.optim's.
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
from gspo.config import ConfigError, TrainConfig, resolve
from gspo.configfile import load_yaml
from gspo.data import DataError
from gspo.distributed import Dist
from gspo.lifecycle import absolute_paths, check_no_writer, resume_config
from gspo.env import episode_env, tool_schemas
from gspo.logprobs import TokenLogprobs, supports_packing
from gspo.models import (DTYPES, add_lora, disable_dropout, enable_checkpointing, load_policy, load_tokenizer,
                         low_precision_copy, prepare_tokenizer, quiet_peft, unwrap)
from gspo.moe import MoEError, Routing, is_moe
from gspo.optim import make_optimizers
from gspo.rewards import Reward, load_rewards
from gspo.rollout import PolicySampler, Sampler, encode_prompts, fsdp_sampling_note, stop_token_ids
from gspo.tasks import build_task
from gspo.tasks.base import SystemPrompt
from gspo.value import Critic, ValueHead, ValueModel


@dataclass
class Run:
    """A run: its configuration, models, optimizers, data and where it stands."""

    cfg: TrainConfig
    run_dir: Path
    task: object  # train_batch(step, n, seed), test_set(n)
    rewards: list[Reward]
    policy: object  # the model being trained (PEFT-wrapped with LoRA); what checkpoints save
    tokenizer: object
    sampler: Sampler  # who samples rollouts
    dist: Dist
    train_model: object  # what training forwards call: the policy, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: object | None = None  # the frozen initial policy, for the KL terms (not with LoRA)
    value_model: ValueModel | None = None  # PPO
    routing: Routing | None = None  # MoE models: hooks on every router
    resume_from: Path | None = None  # the checkpoint to continue from
    stop_ids: tuple[int, ...] = ()  # tokens that end a completion (gspo.rollout.stop_token_ids)
    scaler: torch.amp.GradScaler | None = None  # float16 mixed precision: loss scaling
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
        compute = DTYPES[self.cfg.dtype]
        if compute == DTYPES[self.cfg.param_dtype]:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=compute)

    @property
    def optimized(self):
        """The modules whose parameters the policy optimizer holds (FSDP names its state by them)."""
        vm = self.value_model
        if vm is not None and vm.shared:
            return torch.nn.ModuleDict({"policy": self.policy, "value_head": vm.head})
        return self.policy


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
    (gspo.config.SAFE_ON_RESUME). Raises AlreadyComplete when the run has done its steps.
    """
    resume_from, restart = None, False
    if resume is not None:
        cfg, resume_from = _resume_target(Path(resume).absolute(), cfg)
        restart = resume_from is None
    default_length = resume is None and cfg.max_new_tokens is None  # the task's default: may be capped to the model
    cfg = resolve(cfg)
    if resume is None:
        cfg = absolute_paths(cfg)  # the run directory works from any working directory
    world = distributed.world_size_from_env()
    if cfg.prompts_per_step % world:
        raise ConfigError(f"prompts_per_step: must be divisible by the number of processes, {world}, so that "
                          f"each process samples whole groups (got {cfg.prompts_per_step})")
    dist = distributed.init(cfg.parallel, cfg.device)  # a single process without torchrun
    cfg = dataclasses.replace(cfg, output_dir=dist.broadcast_object(cfg.output_dir))  # rank 0's timestamp
    run_dir = Path(cfg.output_dir)
    if dist.is_main:
        check_no_writer(run_dir)  # a live run holds it: refused in one line
    if resume is None and not ckpt.is_empty_run_dir(run_dir):
        raise FileExistsError(f"{run_dir}: output directory exists and is not empty (use --resume {run_dir} to continue it)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)

    inputs = inputs or Inputs()
    task = _task(cfg, inputs)
    reference = _reference(cfg, inputs, dist.device)  # the initial policy, before any weight is loaded or trained
    policy, tokenizer = _load_policy(cfg, resume_from, dist.device, inputs)
    _check_chat_template(cfg, task, tokenizer)
    env, max_turns = episode_env(inputs.env or cfg.env, task, cfg.max_turns, tokenizer)
    cfg, notes = _fit_lengths(cfg, task, tokenizer, policy, default_length=default_length, env=env)
    rewards = _rewards(cfg, task, inputs, dist.device)  # learned reward models load on the policy's device
    notes = list(getattr(task, "notes", [])) + notes
    disable_dropout(policy)  # training forwards compute the log-probs the no-grad passes do
    if cfg.gradient_checkpointing:
        enable_checkpointing(unwrap(policy))
    stop_ids = stop_token_ids(tokenizer, policy, cfg.stop_token)
    sampler, routing = _sampler_and_routing(cfg, policy, dist, inputs)
    vm = _value_model(cfg, policy, resume_from, dist.device, from_object=inputs.model_object is not None)
    mixed = DTYPES[cfg.dtype] if cfg.param_dtype != cfg.dtype else None  # FSDP gathers parameters in it
    if isinstance(sampler, PolicySampler) and dist.enabled and dist.parallel == "fsdp":  # read before sharding
        notes.append(fsdp_sampling_note(policy, DTYPES[cfg.dtype], cfg.max_prompt_length + cfg.max_new_tokens))
    packed = _packing(cfg, policy, routing, notes)  # decided before sharding: an FSDP model has DTensor weights
    # what training forwards call: the log-prob forward (LM head included), DDP-wrapped or FSDP-sharded
    train_model = parallel.wrap(TokenLogprobs(policy), dist, find_unused=routing is not None, mixed=mixed)
    if vm is not None and not vm.shared:
        vm.critic_train = parallel.wrap(vm.critic, dist, mixed=mixed)
    if reference is not None and dist.enabled and dist.parallel == "fsdp":
        parallel.shard(reference, dist)
    if isinstance(sampler, PolicySampler) and sampler.model is policy:
        sampler.root = train_model  # under FSDP, gathering the root gathers every parameter
    optimizer, scheduler = make_optimizers(cfg, policy, vm)
    scaler = torch.amp.GradScaler(dist.device.type) if cfg.dtype == "float16" and mixed is not None else None
    return Run(cfg, run_dir, task, rewards, policy, tokenizer, sampler, dist, train_model, optimizer, scheduler,
               reference, vm, routing, resume_from, stop_ids, scaler, packed, restart, notes, env, max_turns)


def _packing(cfg: TrainConfig, policy, routing: Routing | None, notes: list[str]) -> bool:
    """Whether training forwards pack (--packing, where the model can); a refusal is said once."""
    if not cfg.packing:
        return False
    if routing is not None:
        notes.append("--packing: off for this MoE model (its routing is recorded in the padded layout); "
                     "micro-batches are padded")
        return False
    if not supports_packing(policy):
        notes.append(f"--packing: off for {cfg.model} (a packed forward does not give the padded forward's hidden "
                     "states, or the model has no plain linear LM head); micro-batches are padded")
        return False
    return True


def _check_chat_template(cfg: TrainConfig, task, tokenizer) -> None:
    """Chat prompts (or --system-prompt) need the tokenizer's chat template: one line if it has none."""
    if any(ex.is_chat for ex in task.test_set()[:1] + task.train_batch(1, 1, cfg.seed)) and not tokenizer.chat_template:
        why = "--system-prompt makes prompts chat messages" if cfg.system_prompt is not None else "prompts are chat messages"
        raise DataError(f"{cfg.dataset or 'task ' + cfg.task}: {why} but the tokenizer of {cfg.model} has no chat template")


def _resume_target(run_dir: Path, changed: TrainConfig | None) -> tuple[TrainConfig, Path | None]:
    """The configuration a resumed run continues with, and its newest checkpoint (None: start
    over from step 0). Raises AlreadyComplete when the run has done its steps."""
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir}: not a gspo run directory (no config.yaml) to resume")
    saved = dataclasses.replace(load_yaml(run_dir / "config.yaml"), output_dir=str(run_dir))
    cfg = resume_config(saved, changed)
    last = ckpt.latest_checkpoint(run_dir)
    done = ckpt.is_complete(run_dir, cfg.steps)
    if done is not None and last is not None and last.name == f"step-{cfg.steps:06d}":
        raise AlreadyComplete(done)
    return cfg, last


def task_and_rewards(cfg: TrainConfig, inputs: Inputs | None = None) -> tuple[object, list[Reward]]:
    """The task (built-in, the user's dataset file, or in-memory rows; validated) and its rewards."""
    task = _task(cfg, inputs or Inputs())
    return task, _rewards(cfg, task, inputs or Inputs())


def _task(cfg: TrainConfig, inputs: Inputs):
    specs = tuple(inputs.reward_funcs or cfg.reward)
    task = build_task(task=cfg.task, dataset=inputs.train_dataset if inputs.train_dataset is not None else cfg.dataset,
                      dataset_split=cfg.dataset_split, eval_split=cfg.eval_split, prompt_column=cfg.prompt_column,
                      eval_dataset=inputs.eval_dataset if inputs.eval_dataset is not None else cfg.eval_dataset,
                      answer_column=cfg.answer_column, eval_size=cfg.eval_size, rewards=specs,
                      dataset_config=cfg.dataset_config)
    return task if cfg.system_prompt is None else SystemPrompt(task, cfg.system_prompt)  # training, eval, `gspo eval`


def _rewards(cfg: TrainConfig, task, inputs: Inputs, device=None) -> list[Reward]:
    """The rewards; a learned reward model goes on --reward-model-device, else `device` (the policy's)."""
    return load_rewards(list(inputs.reward_funcs or cfg.reward) or list(task.default_rewards),
                        list(cfg.reward_weights) or None, format_pattern=cfg.format_pattern,
                        max_new_tokens=cfg.max_new_tokens, device=device or cfg.device,
                        reward_model_device=cfg.reward_model_device, batch_size=cfg.reward_model_batch_size)


def _fit_lengths(cfg: TrainConfig, task, tokenizer, policy, *, default_length: bool, env=None,
                 sample: int = 256) -> tuple[TrainConfig, list[str]]:
    """Prompt + completion must fit the model's positions: a given --max-new-tokens that does
    not is a one-line error, the task's default is capped to fit (said in a warning); prompts
    longer than --max-prompt-length are cut (a warning says how many). Multi-turn (`env`): the
    episode's token budget is what the positions leave after the longest prompt (a larger
    --max-episode-tokens is an error). Checked on the first `sample` training and evaluation
    prompts. Returns the config and the warnings."""
    notes = []
    examples = task.train_batch(1, min(sample, cfg.prompts_per_step * 8), cfg.seed) + task.test_set()[:sample]
    tools = tool_schemas(list(getattr(env, "tools", None) or []))
    lengths = [len(ids) for ids in encode_prompts(tokenizer, [ex.prompt for ex in examples], tools=tools)]
    longest = max(lengths)
    if cfg.max_prompt_length and longest > cfg.max_prompt_length:
        cut = sum(n > cfg.max_prompt_length for n in lengths)
        notes.append(f"max_prompt_length: {cut} of the {len(lengths)} prompts checked are longer than "
                     f"{cfg.max_prompt_length} tokens (up to {longest}); they keep their last {cfg.max_prompt_length}")
        longest = cfg.max_prompt_length
    limit = getattr(unwrap(policy).config, "max_position_embeddings", None)
    if limit and longest + cfg.max_new_tokens > limit:
        if not default_length or longest >= limit:
            raise ConfigError(f"max_new_tokens: prompts of up to {longest} tokens + {cfg.max_new_tokens} new tokens "
                              f"exceed the model's max_position_embeddings ({limit}); lower --max-new-tokens or set "
                              "--max-prompt-length")
        whose = f"the default for a dataset ({cfg.dataset})" if cfg.dataset else f"task {cfg.task}'s default"
        notes.append(f"max_new_tokens: {whose}, {cfg.max_new_tokens}, capped to {limit - longest}, so that "
                     f"prompts of up to {longest} tokens fit the model's {limit} positions")
        cfg = dataclasses.replace(cfg, max_new_tokens=limit - longest)
    if env is not None and limit:
        if longest + cfg.max_episode_tokens > limit:
            raise ConfigError(f"max_episode_tokens: prompts of up to {longest} tokens + {cfg.max_episode_tokens} "
                              f"exceed the model's max_position_embeddings ({limit})")
        cfg = dataclasses.replace(cfg, max_episode_tokens=cfg.max_episode_tokens or limit - longest)
    return cfg, notes


def _reference(cfg: TrainConfig, inputs: Inputs, device: torch.device):
    """The frozen initial policy for the KL terms (beta > 0 or reward_kl_coef > 0), in the
    compute dtype; None with LoRA (the base model with the adapters off serves)."""
    if not (cfg.beta > 0 or cfg.reward_kl_coef > 0) or cfg.lora_r > 0:
        return None
    if inputs.model_object is not None:
        reference = copy.deepcopy(inputs.model_object).to(device=device, dtype=DTYPES[cfg.dtype])
    else:
        reference, _ = load_policy(cfg.model, dtype=DTYPES[cfg.dtype], device=device, revision=cfg.revision,
                                   with_tokenizer=False)
    return reference.eval().requires_grad_(False)


@quiet_peft()  # peft's deprecation warning when it wraps a model is not the user's
def _load_policy(cfg: TrainConfig, resume_from: Path | None, device: torch.device, inputs: Inputs):
    """The policy to train and its tokenizer: the model (a directory, or the API's model
    object), or the checkpoint's weights (a LoRA checkpoint: its base plus the saved adapter)."""
    dtype = DTYPES[cfg.param_dtype]  # float32 master weights unless pure low precision is asked for
    obj = inputs.model_object
    if resume_from is not None and cfg.lora_r > 0:
        if obj is None:
            return load_policy(str(resume_from), dtype=dtype, device=device, base_model=cfg.model,
                               trainable_adapter=True, revision=cfg.revision)
        from peft import PeftModel

        policy = PeftModel.from_pretrained(obj.to(device=device, dtype=dtype), resume_from, is_trainable=True)
        return policy, inputs.tokenizer or load_tokenizer(resume_from)
    if resume_from is not None:
        return load_policy(str(resume_from), dtype=dtype, device=device)
    if obj is not None:
        policy, tokenizer = obj.to(device=device, dtype=dtype), prepare_tokenizer(inputs.tokenizer, "tokenizer")
    else:
        policy, tokenizer = load_policy(cfg.model, dtype=dtype, device=device, revision=cfg.revision,
                                        with_tokenizer=inputs.tokenizer is None)
        if inputs.tokenizer is not None:
            tokenizer = prepare_tokenizer(inputs.tokenizer, "tokenizer")
    if cfg.lora_r > 0:
        policy = add_lora(policy, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_target_modules), revision=cfg.revision)
    return policy, tokenizer


def _sampler_and_routing(cfg: TrainConfig, policy, dist: Dist, inputs: Inputs) -> tuple[Sampler, Routing | None]:
    """The sampler (the policy, or a copy in the sampling precision made before any hook is
    installed: --rollout-dtype, else the compute --dtype; under FSDP always the policy, sampling
    in --dtype) and, for MoE models, the routing hooks (drift is always measured)."""
    rollout_dtype = DTYPES[cfg.dtype] if cfg.rollout_dtype == "same" else DTYPES[cfg.rollout_dtype]
    if cfg.rollout_engine == "vllm":
        if inputs.model_object is not None:
            raise ConfigError("rollout_engine: vllm loads the model from its directory; pass model= as a path "
                              "(or save_pretrained it first)")
        return _vllm_sampler(cfg, policy, dist, rollout_dtype), (Routing(policy, cfg.model) if is_moe(policy) else None)
    # FSDP: the policy itself (sharded next), gathered for each rollout in the compute dtype (its
    # MixedPrecisionPolicy's param dtype), never a full copy per process; rollout_dtype == dtype there
    fsdp = dist.enabled and dist.parallel == "fsdp"
    model = policy if fsdp or rollout_dtype == DTYPES[cfg.param_dtype] else low_precision_copy(policy, rollout_dtype)
    sampler = PolicySampler(model, dist=dist)
    if not is_moe(policy):
        if cfg.routing_replay or cfg.router_aux_loss_coef > 0:
            option = "--routing-replay" if cfg.routing_replay else "--router-aux-loss-coef"
            raise MoEError(f"{option}: {cfg.model} is not a Mixture-of-Experts model with router modules "
                           "(Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE style)")
        return sampler, None
    routing = Routing(policy, cfg.model)
    if cfg.old_logp == "sampling":  # the experts used while sampling are the old policy's
        sampler.routing = routing if model is policy else Routing(model, cfg.model)
    return sampler, routing


def _vllm_sampler(cfg: TrainConfig, policy, dist: Dist, dtype: torch.dtype):
    """A colocated vLLM engine over the model's directory (the base model for LoRA); the
    policy's weights are loaded into it before every rollout."""
    from gspo.models import resolve_model_path
    from gspo.vllm_engine import VLLMSampler

    max_len = cfg.vllm_max_model_len or int(getattr(unwrap(policy).config, "max_position_embeddings", 4096))
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    path = resolve_model_path(cfg.model, revision=cfg.revision)  # a Hub id: its snapshot directory
    return VLLMSampler(str(path), dtype=name, seed=cfg.seed, device=dist.device,
                       max_model_len=max_len, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                       kv_cache_gib=cfg.vllm_kv_cache_gib, sleep=cfg.vllm_sleep, dist=dist)


def _value_model(cfg: TrainConfig, policy, resume_from: Path | None, device: torch.device,
                 from_object: bool = False) -> ValueModel | None:
    """PPO's critic, initialised from the policy's weights (or restored from the checkpoint)."""
    if cfg.algorithm != "ppo":
        return None
    if cfg.critic == "separate" and resume_from is None and from_object:  # the critic copies the object's trunk
        critic = Critic.from_model(unwrap(policy)).to(device)
        disable_dropout(critic)
        return ValueModel(critic=critic)
    if cfg.critic == "separate":
        src = resume_from / "critic" if resume_from is not None else cfg.model
        critic = Critic.from_pretrained(src, dtype=DTYPES[cfg.param_dtype], device=device, revision=cfg.revision,
                                        head_from=resume_from / "critic" if resume_from else None)
        disable_dropout(critic)
        return ValueModel(critic=critic)
    head = ValueHead(unwrap(policy).config.hidden_size)
    if resume_from is not None:
        head.load(resume_from / "value_head")
    return ValueModel(head=head.to(device))
