"""The sampling side of a run, built from its configuration: the task, its rewards, the policy, the sampler.

    policy, tokenizer = load_policy_for(cfg, resume_from=None, device=dev, inputs=Inputs())
    sampler, routing = sampler_and_routing(cfg, policy, dist, inputs)

What the trainer (gspo.train.run.build_run) and each rollout worker (gspo.sampling.pipeline) build alike, so a
worker's copy samples what the trainer's process would. Inputs are the Python API's objects in
place of names and paths (gspo.Trainer); a rollout worker builds from names alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from gspo.config import ConfigError, TrainConfig
from gspo.models.loading import (
    DTYPES,
    AdapterLoad,
    add_lora,
    load_policy,
    load_tokenizer,
    low_precision_copy,
    prepare_tokenizer,
    quiet_peft,
    resolve_model_path,
    unwrap,
)
from gspo.models.moe import NO_ROUTING, MoEError, NoRouting, Routing, is_moe
from gspo.processes.distributed import Dist
from gspo.rewards.builtin import Reward, load_rewards
from gspo.rewards.judge import JudgeOptions
from gspo.sampling.rollout import PolicySampler, Sampler
from gspo.sampling.vllm_engine import VLLMSampler
from gspo.tasks import build_task
from gspo.tasks.base import SystemPrompt


@dataclass
class Inputs:
    """What the Python API (gspo.Trainer) passes as objects instead of names and paths."""

    model: object = None  # a transformers PreTrainedModel (its directory, a str, goes into the config)
    tokenizer: object = None
    train_dataset: object = None  # a list of dicts or a datasets.Dataset
    eval_dataset: object = None
    reward_funcs: list | None = None  # callables (completions, **columns) -> list[float], and/or reward names
    env: type | None = None  # the environment class of multi-turn episodes (gspo.tasks.env)
    task: object = None  # a task object (a verifiers environment's, gspo.agents.vfenv): replaces --task

    @property
    def model_object(self):
        return self.model if isinstance(self.model, torch.nn.Module) else None


def task_for(cfg: TrainConfig, inputs: Inputs):
    """The task: the API's object (`inputs.task`), in-memory rows, the user's dataset, or a built-in
    one by name (a verifiers taskset's: gspo.agents.side.task_for), with its system prompt."""
    specs = tuple(inputs.reward_funcs or cfg.rewards.reward)
    task = inputs.task or build_task(cfg.data, specs, cfg.eval.eval_size, train_rows=inputs.train_dataset,
                                     eval_rows=inputs.eval_dataset)
    if cfg.data.system_prompt is not None:  # training, eval, `gspo eval`
        return SystemPrompt(task, cfg.data.system_prompt)
    default = getattr(task, "default_system_prompt", None)  # reasoning-gym's: the answer format (gspo.tasks.gym)
    return task if default is None else SystemPrompt(task, default, default=True)


def rewards_for(cfg: TrainConfig, task, inputs: Inputs, device=None) -> list[Reward]:
    """The rewards; a learned reward model or a judge model goes on --reward-model-device, else `device`
    (the policy's). `--reward none` (distillation alone): the task's default rewards, each weighted 0, so
    that training gets no reward while its accuracy is still measured and logged (reward/<name>/mean,
    evaluation)."""
    rw = cfg.rewards
    judge = JudgeOptions(template=rw.judge_template, rubric=rw.judge_rubric, max_new_tokens=rw.judge_max_new_tokens,
                         timeout=rw.judge_timeout)
    specs = list(inputs.reward_funcs or rw.reward) or list(task.default_rewards)
    none = specs == ["none"] and not inputs.reward_funcs
    specs = list(task.default_rewards) if none else specs
    weights = [0.0] * len(specs) if none else list(rw.reward_weights) or None
    return load_rewards(specs, weights, format_pattern=rw.format_pattern,
                        max_new_tokens=cfg.sampling.max_new_tokens, device=device or cfg.run.device,
                        reward_model_device=rw.reward_model_device, batch_size=rw.reward_model_batch_size, judge=judge)


@quiet_peft()  # peft's deprecation warning when it wraps a model is not the user's
def load_policy_for(cfg: TrainConfig, resume_from: Path | None, device: torch.device, inputs: Inputs):
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


def sampler_and_routing(cfg: TrainConfig, policy, dist: Dist, inputs: Inputs) -> tuple[Sampler, Routing | NoRouting]:
    """The sampler (the policy, or a copy in the sampling precision made before any hook is
    installed: --rollout-dtype, else the compute --dtype; under FSDP always the policy, sampling
    in --dtype) and, for MoE models, the routing hooks (drift is always measured)."""
    rollout_dtype = (DTYPES[cfg.policy.dtype] if cfg.sampling.rollout_dtype == "same"
                     else DTYPES[cfg.sampling.rollout_dtype])
    if cfg.sampling.rollout_engine in ("vllm", "vllm-server"):
        if inputs.model_object is not None:
            raise ConfigError(f"rollout_engine: {cfg.sampling.rollout_engine} loads the model from its directory; pass "
                              "model= as a path (or save_pretrained it first)")
        build = vllm_sampler if cfg.sampling.rollout_engine == "vllm" else server_sampler
        return build(cfg, policy, dist, rollout_dtype), \
            (Routing(policy, cfg.policy.model) if is_moe(policy) else NO_ROUTING)
    # FSDP: the policy itself (sharded next), gathered for each rollout in the compute dtype (its
    # MixedPrecisionPolicy's param dtype), never a full copy per process; rollout_dtype == dtype there
    fsdp = dist.enabled and dist.parallel == "fsdp"
    model = (policy if fsdp or rollout_dtype == DTYPES[cfg.policy.param_dtype]
             else low_precision_copy(policy, rollout_dtype))
    sampler = PolicySampler(model, dist=dist, strict=True)
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


def server_sampler(cfg: TrainConfig, policy, dist: Dist, dtype: torch.dtype):
    """vLLM servers (--vllm-server-url), or one gspo starts on this machine, checked before step 1
    (gspo.sampling.vllm_server.connect); the policy's weights reach them before every rollout."""
    import secrets
    import shutil
    import tempfile

    from gspo.sampling import vllm_server as vs

    v = cfg.vllm
    max_pos = int(getattr(unwrap(policy).config, "max_position_embeddings", 4096))
    path, max_len, name = _engine_model(cfg, policy, dtype)
    deadlines = vs.Deadlines(request=v.vllm_server_timeout, sync=v.vllm_server_sync_timeout,
                             start=v.vllm_server_start_timeout)
    method = v.vllm_server_sync if v.vllm_server_sync != "auto" else \
        ("nccl" if dist.device.type == "cuda" else "directory")
    owned, servers = None, vs.servers_from(v.vllm_server_url) if v.vllm_server_url else []
    if not servers and dist.enabled:
        raise ConfigError("vllm_server_url: under torchrun give the servers (--vllm-server-url); gspo starts one "
                          "only for a one-process run")
    if cfg.async_rl.partial_rollouts and dist.enabled:
        raise ConfigError("partial_rollouts: not under torchrun yet (every process samples its share, and a sync "
                          "would abort the other processes' generations mid-request); run one trainer process")
    scratch = Path(tempfile.mkdtemp(prefix="gspo-vllm-server-"))  # pushed weights (by default), a started server's log
    try:
        if not servers:
            owned = vs.OwnedServer(path, vs.Serve(name, cfg.run.seed, max_len, kv_cache_gib=v.vllm_kv_cache_gib,
                                                  gpu_memory_utilization=v.vllm_gpu_memory_utilization,
                                                  weight_transfer="nccl" if method == "nccl" else None),
                                   log=scratch / "vllm-server.log")
            servers = vs.servers_from([owned.url], key=owned.key)
            owned.wait_ready(deadlines.start)
        vs.connect(servers, model=path if owned else str(cfg.policy.model), served_dir=path,  # every rank samples
                   needed_len=min(max_pos, cfg.data.max_prompt_length + (cfg.sampling.max_new_tokens or 0)),
                   deadlines=deadlines)
        _refuse_cpu_moe(policy, servers)
        if method == "nccl":
            from gspo.sampling.server_nccl import NcclPush

            push = NcclPush(dtype, deadlines)
        else:
            push = vs.DirectoryPush(Path(v.vllm_server_weights_dir) if v.vllm_server_weights_dir else scratch, dtype)
        return vs.ServerSampler(servers, push, deadlines, run_id=f"{Path(cfg.run.output_dir).name}-"
                                f"{secrets.token_hex(4)}", device=dist.device,
                                check=sync_check(cfg, dist, name) if v.vllm_check_weight_sync else None,
                                temperature=cfg.sampling.temperature, dist=dist, owned=owned, scratch=scratch,
                                partial=cfg.async_rl.partial_rollouts,
                                vocab_size=int(unwrap(policy).get_input_embeddings().num_embeddings),
                                max_model_len=min((s.max_model_len for s in servers if s.max_model_len),
                                                  default=max_len))
    except BaseException as e:
        if owned is not None:
            owned.stop()
        if owned is None or str(owned.log) not in str(e):  # a server that would not start: its log is kept
            shutil.rmtree(scratch, ignore_errors=True)  # refused before step 1: nothing of it is left
        raise


def _refuse_cpu_moe(policy, servers) -> None:
    cpu = [s.url for s in servers if s.device == "cpu"]
    if is_moe(policy) and cpu:
        raise ConfigError(f"rollout_engine: vllm-server with a Mixture-of-Experts model on a CPU server "
                          f"({cpu[0]}): vLLM 0.32 on CPU does not repack expert weights on a reload, so the "
                          "server would sample from stale experts (use --rollout-engine vllm, which repacks "
                          "them, or a GPU server)")


def sync_check(cfg: TrainConfig, dist: Dist, dtype: str):
    """The sync check's comparison (gspo.sampling.vllm_server.ServerSampler `check`): the trainer's
    log-probs of a server's sampled tokens against the server's, as a row mean, with the integrity
    check's row bound for vLLM in this dtype (float32: 0.02; bfloat16: 2.0)."""
    from gspo.models.logprobs import completion_logprobs
    from gspo.sampling.integrity import tolerance

    bound = tolerance("vllm", dtype, dtype)
    limit = bound.row if bound is not None else 2.0

    def check(model, prompt, ids, logps):
        full = torch.tensor([list(prompt) + list(ids)], device=dist.device)
        cmask = torch.ones((1, len(ids)), device=dist.device)
        with torch.no_grad():
            mine = completion_logprobs(unwrap(model), full, torch.ones_like(full), cmask,
                                       temperature=cfg.sampling.temperature)[0].float().cpu()
        gap = float((mine - torch.tensor(logps)).abs().mean())  # the row mean, as the integrity bound
        return gap > limit, gap, limit

    return check


def vllm_sampler(cfg: TrainConfig, policy, dist: Dist, dtype: torch.dtype):
    """A colocated vLLM engine over the model's directory (the base model for LoRA); the
    policy's weights are loaded into it before every rollout."""
    path, max_len, name = _engine_model(cfg, policy, dtype)
    return VLLMSampler(path, dataclasses.replace(cfg.vllm, vllm_max_model_len=max_len), dtype=name,
                       seed=cfg.run.seed, dist=dist)


def _engine_model(cfg: TrainConfig, policy, dtype: torch.dtype) -> tuple[str, int, str]:
    """What a vLLM engine or server is given: the model's directory (a Hub id: its snapshot; the
    base model for LoRA), its longest prompt + completion (--vllm-max-model-len, else the model's
    max_position_embeddings) and the dtype's name."""
    max_len = cfg.vllm.vllm_max_model_len or int(getattr(unwrap(policy).config, "max_position_embeddings", 4096))
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    return str(resolve_model_path(cfg.policy.model, revision=cfg.policy.revision)), max_len, name
