"""Models across processes: DDP wrappers, FSDP2 sharding, gathered parameters and state dicts.

    train_model = parallel.wrap(policy, dist)            # what training forwards call
    with parallel.gathered(policy, dist): sample(...)    # full parameters for a block (FSDP)
    sd = parallel.full_state_dict(policy, dist)          # for a checkpoint (FSDP: rank 0 only)
    w = parallel.full_tensor(p, torch.bfloat16)          # one parameter whole (FSDP: gathered), for a weight sync

Every function is the identity (or the module's own state) in one process or under DDP where
nothing is sharded, so callers have one code path; `dist` is a gspo.processes.distributed.Dist.

- `ddp`: the policy (and a separate critic) replicated, gradients all-reduced by
  `DistributedDataParallel`. Training forwards go through the DDP wrapper; sampling and
  no-grad passes use the module itself.
- `fsdp`: FSDP2 `fully_shard` on every decoder layer and on the root (policy, separate critic,
  frozen reference): parameters, gradients and AdamW state are sharded. Sampling runs with the
  parameters gathered (`gathered`), since processes decode different numbers of tokens and
  so cannot take part in per-layer collectives. They are gathered in the compute dtype (with
  `mixed`, the MixedPrecisionPolicy's param dtype: bf16 for --dtype bfloat16), and the sampler
  is the sharded policy itself: the rollout computes in that dtype with no second copy of the
  weights, and the gathered parameters are freed when it ends.
- A shared value head (`--critic shared`) is small and replicated; its gradients are
  all-reduced by hand (`Dist.average_grads`).
- LoRA under `fsdp`: the PEFT-wrapped policy is sharded the same way (as torchtune does), each
  decoder layer's frozen base weights and trainable adapters in one FSDP2 unit (FSDP2 shards
  per parameter, so frozen and trainable ones may share a unit); gradients and AdamW state
  exist for the adapters alone, and a checkpoint gathers only them (`trainable_only`).
"""

from __future__ import annotations

import contextlib

import torch


def wrap(model, dist, *, find_unused: bool = False, mixed: torch.dtype | None = None):
    """Prepare a trainable model; returns what training forwards should call.

    ddp: the DDP wrapper (the module itself is unchanged and used for sampling; buffers are not
    broadcast at every forward, so processes may run different numbers of no-grad passes);
    fsdp: the module, sharded in place, its parameters gathered in `mixed` (mixed precision,
    gradients reduced in float32); one process: the module.
    """
    if not dist.enabled:
        return model
    if dist.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [dist.device.index] if dist.device.type == "cuda" else None
        import inspect

        no_sync_buffers = {"forward_sync_buffers": False} if "forward_sync_buffers" in \
            inspect.signature(DistributedDataParallel).parameters else {"broadcast_buffers": False}  # torch < 2.13
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=find_unused,
                                       process_group=dist.group, **no_sync_buffers)
    if dist.parallel == "fsdp":
        shard(model, dist, mixed=mixed)
    return model


def shard(model, dist, *, mixed: torch.dtype | None = None) -> None:
    """FSDP2: fully_shard each decoder layer (the model's `_no_split_modules`), then the root;
    `mixed`: a MixedPrecisionPolicy gathering parameters in that dtype, reducing in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mesh": dist.mesh}
    if mixed is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed, reduce_dtype=torch.float32)
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    for m in list(model.modules()):
        if m is not model and type(m).__name__ in names:
            fully_shard(m, **kw)
    fully_shard(model, **kw)
    # settle which module is the root now: sampling may call the decoder layers without
    # going through the root's forward (gspo.sampling.fastdecode), which FSDP would otherwise reject
    model._get_fsdp_state()._lazy_init()


@contextlib.contextmanager
def gathered(model, dist):
    """FSDP: hold `model`'s full parameters on every process for the block (sampling,
    evaluation), so forwards there need no collectives; in the MixedPrecisionPolicy's param
    dtype when `shard` had `mixed`, else their own. A no-op otherwise."""
    if dist.parallel != "fsdp":
        yield model
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


@contextlib.contextmanager
def no_sync(model, dist, skip: bool):
    """Gradient accumulation: with `skip`, the backward passes in the block keep their gradients
    local (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)`); the last micro-batch of
    a minibatch runs without it and reduces everything accumulated."""
    if not (skip and dist.enabled):
        yield
        return
    if dist.parallel == "ddp":
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_state_dict(model, dist, *, trainable_only: bool = False) -> dict | None:
    """FSDP: the gathered state dict on rank 0 (None elsewhere); otherwise None (the
    module's own state dict is complete). trainable_only: the parameters that train, alone
    (LoRA: the adapters; the frozen base is never gathered)."""
    if dist.parallel != "fsdp":
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                              ignore_frozen_params=trainable_only))
    if not dist.is_main:
        return None
    seen, tied = set(), set()  # tied weights (embeddings = LM head) are written once, as save_pretrained does
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    return {k: v for k, v in sd.items() if k not in tied}


def optimizer_state(model, optimizer, dist) -> dict:
    """FSDP: the gathered optimizer state (keyed by parameter name) on rank 0; otherwise
    the optimizer's own state dict (identical on every DDP process)."""
    if dist.parallel != "fsdp":
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, optimizer, state: dict, dist) -> None:
    if dist.parallel != "fsdp":
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if dist.group is not None:  # with rollout ranks: torch's broadcast_from_rank0 would use the whole world
        set_optimizer_state_dict(model, optimizer, optim_state_dict=dist.broadcast_object(state),
                                 options=StateDictOptions(full_state_dict=True))
        return
    # rank 0 holds the full state and sends each process its shard; the others pass nothing
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def clip_grad_norm(params: list, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ that also takes a mix of FSDP-sharded (DTensor) and plain
    parameters (a sharded policy and its replicated value head): the norm is over all of them."""
    params = [p for p in params if p.grad is not None]
    sharded = [p for p in params if hasattr(p, "placements")]
    if not sharded or len(sharded) == len(params):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    plain = [p for p in params if not hasattr(p, "placements")]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in (sharded, plain)]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    for group in (sharded, plain):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return float(total)


def full_tensor(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One parameter whole: FSDP (a DTensor) all-gathers its shards, so every process must call
    this for the same parameter in the same order; a plain tensor is returned as it is. With
    `dtype`, cast first (the shard: for bf16, half the traffic and the memory of the gather;
    the cast is elementwise, so the result is the same as casting the gathered tensor)."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.full_tensor() if hasattr(t, "full_tensor") else t
