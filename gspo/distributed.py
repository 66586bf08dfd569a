"""Several processes, one run: torch.distributed under torchrun, with DDP or FSDP2.

    torchrun --nproc-per-node 4 -m gspo train --parallel ddp  --device cuda ...
    torchrun --nproc-per-node 8 -m gspo train --parallel fsdp --device cuda ...

A run started by `torchrun` (WORLD_SIZE > 1) creates one `Dist` per process; without
torchrun, `Dist()` is a single process and every method below is the identity, so the trainer
has one code path.

What each process does (the trainer's side is in gspo.trainer):
- samples its contiguous share of the step's prompts (a group never straddles processes) with
  the sampling uniforms of *its rows of the global batch* (gspo.rollout `rows=`), so a
  completion does not depend on how many processes there are;
- scores its groups and computes their advantages from the gathered global rewards;
- in each update, takes its rows of the *global* minibatch (one permutation of all rows, the
  same on every process), and scales its loss so that the gradient DDP/FSDP average is the
  gradient of the global minibatch's loss, normalised by global counts (`loss_scale`);
- reduces metrics exactly: each process's value weighted by its share of the count it was
  averaged over (`reduce_metrics`).

Backends: gloo for CPU, NCCL for CUDA, chosen from `--device`. Under torchrun `--device cuda`
means `cuda:$LOCAL_RANK`.

Parallelism:
- `ddp`: the policy (and a separate critic) replicated, gradients all-reduced by
  `DistributedDataParallel`. Training forwards go through the DDP wrapper; sampling and
  no-grad passes use the module itself.
- `fsdp`: FSDP2 `fully_shard` on every decoder layer and on the root (policy, separate critic,
  frozen reference): parameters, gradients and AdamW state are sharded. Sampling runs with the
  parameters gathered (`gathered`), since processes decode different numbers of tokens and
  so cannot take part in per-layer collectives.
- A shared value head (`--critic shared`) is small and replicated; its gradients are
  all-reduced by hand (`average_grads`).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as torch_dist

Tensor = torch.Tensor

# metric name -> which count the per-process value is an average over ("min"/"max": reduce so)
TOKEN_METRICS = ("clip/frac", "clip/low_frac", "clip/high_frac", "ratio/mean", "kl/old_new", "value/loss",
                 "value/clip_frac")
AGG_METRICS = ("loss/policy", "kl/ref", "loss/kl")
MOE_METRICS = ("moe/drift", "moe/drift_in_ratio", "moe/aux_loss")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class Dist:
    """This process's place in the run; a single process when world == 1."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    parallel: str = "none"  # "none" (one process), "ddp" or "fsdp"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: object = None

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # --- collectives (identity on one process) ---------------------------------------------

    def _comm(self, t: Tensor) -> Tensor:
        """A copy of t on the device the backend communicates on (CPU for gloo)."""
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        return t.detach().to(dev, copy=True)

    def all_sum(self, t: Tensor) -> Tensor:
        if not self.enabled:
            return t
        out = self._comm(t)
        torch_dist.all_reduce(out, op=torch_dist.ReduceOp.SUM)
        return out.to(t.device)

    def gather(self, t: Tensor) -> Tensor:
        """Concatenate every process's `t` along dim 0, in rank order (sizes may differ)."""
        if not self.enabled:
            return t
        parts = [None] * self.world
        torch_dist.all_gather_object(parts, t.detach().cpu())
        return torch.cat(parts).to(t.device)

    def gather_objects(self, obj) -> list:
        if not self.enabled:
            return [obj]
        parts = [None] * self.world
        torch_dist.all_gather_object(parts, obj)
        return parts

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every process."""
        if not self.enabled:
            return obj
        box = [obj]
        torch_dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            torch_dist.barrier()

    def average_grads(self, params) -> None:
        """All-reduce the gradients of replicated parameters and divide by the world size
        (what DDP does), for the few parameters no DDP/FSDP wrapper owns."""
        if not self.enabled:
            return
        for p in params:
            if p.grad is not None:
                p.grad.copy_(self.all_sum(p.grad) / self.world)

    # --- the data split --------------------------------------------------------------------

    def share(self, n: int) -> tuple[int, int]:
        """[lo, hi) of this process's contiguous share of n items (the last shares may be shorter)."""
        per = math.ceil(n / self.world)
        lo = min(n, self.rank * per)
        return lo, min(n, lo + per)

    def loss_scales(self, local_counts: Tensor) -> Tensor:
        """Multipliers that turn per-process losses (normalised by local counts) into this
        process's part of the global loss (normalised by global counts), times the world size
        because DDP/FSDP average gradients over processes. local_counts: (..., k) -> same shape."""
        if not self.enabled:
            return torch.ones_like(local_counts)
        total = self.all_sum(local_counts)
        return self.world * local_counts / total.clamp(min=1)

    def reduce_metrics(self, history: list[dict], weights: list[dict]) -> list[dict]:
        """Exact cross-process values of per-update metrics.

        history[i][key] is this process's value for update i, an average over weights[i][name]
        items (completion tokens, responses, ...): the global value is Σ_r w_r·m_r / Σ_r w_r.
        Keys ending in /min and /max take the min and max; any other key the plain mean over
        processes (e.g. grad_norm, already the same everywhere).
        """
        if not self.enabled or not history:
            return history
        keys = list(history[0])
        n = len(history)
        num = torch.zeros(n, len(keys), dtype=torch.float64)
        den = torch.zeros(n, len(keys), dtype=torch.float64)
        lo = torch.full((n, len(keys)), math.inf, dtype=torch.float64)
        hi = torch.full((n, len(keys)), -math.inf, dtype=torch.float64)
        for i, (h, w) in enumerate(zip(history, weights)):
            for j, key in enumerate(keys):
                v = h[key]
                if key.endswith("/min"):
                    lo[i, j] = v if v == v else math.inf
                elif key.endswith("/max"):
                    hi[i, j] = v if v == v else -math.inf
                else:
                    wt = float(w.get(metric_count(key), 1.0))
                    if wt > 0 and v == v:
                        num[i, j], den[i, j] = v * wt, wt
        if self.device.type == "cuda":
            num, den, lo, hi = (x.to(self.device) for x in (num, den, lo, hi))
        both = torch.stack([num, den])
        torch_dist.all_reduce(both, op=torch_dist.ReduceOp.SUM)
        torch_dist.all_reduce(lo, op=torch_dist.ReduceOp.MIN)
        torch_dist.all_reduce(hi, op=torch_dist.ReduceOp.MAX)
        both, lo, hi = both.cpu(), lo.cpu(), hi.cpu()
        out = []
        for i in range(n):
            row = {}
            for j, key in enumerate(keys):
                if key.endswith("/min"):
                    row[key] = float(lo[i, j]) if math.isfinite(lo[i, j]) else float("nan")
                elif key.endswith("/max"):
                    row[key] = float(hi[i, j]) if math.isfinite(hi[i, j]) else float("nan")
                else:
                    row[key] = float(both[0, i, j] / both[1, i, j]) if both[1, i, j] > 0 else float("nan")
            out.append(row)
        return out

    # --- models ----------------------------------------------------------------------------

    def wrap(self, model, *, find_unused: bool = False):
        """Prepare a trainable model; returns what training forwards should call.

        ddp: the DDP wrapper (the module itself is unchanged and used for sampling);
        fsdp: the module, sharded in place; none: the module.
        """
        if self.parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=find_unused)
        if self.parallel == "fsdp":
            self.shard(model)
        return model

    def shard(self, model) -> None:
        """FSDP2: fully_shard each decoder layer (the model's `_no_split_modules`), then the root."""
        from torch.distributed.fsdp import fully_shard

        names = set()
        for m in model.modules():
            names.update(getattr(m, "_no_split_modules", None) or [])
        for m in list(model.modules()):
            if m is not model and type(m).__name__ in names:
                fully_shard(m, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        # settle which module is the root now: sampling may call the decoder layers without
        # going through the root's forward (gspo.fastdecode), which FSDP would otherwise reject
        model._get_fsdp_state()._lazy_init()

    @contextlib.contextmanager
    def gathered(self, model):
        """FSDP: hold `model`'s full parameters on every process for the block (sampling,
        evaluation), so forwards there need no collectives; a no-op otherwise."""
        if self.parallel != "fsdp":
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

    def full_state_dict(self, model) -> dict | None:
        """FSDP: the gathered state dict on rank 0 (None elsewhere); otherwise None (the
        module's own state dict is complete)."""
        if self.parallel != "fsdp":
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return None
        seen, tied = set(), set()  # tied weights (embeddings = LM head) are written once, as save_pretrained does
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                tied.add(name)
            seen.add(id(p))
        return {k: v for k, v in sd.items() if k not in tied}

    def optimizer_state(self, model, optimizer) -> dict:
        """FSDP: the gathered optimizer state (keyed by parameter name) on rank 0; otherwise
        the optimizer's own state dict (identical on every DDP process)."""
        if self.parallel != "fsdp":
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        if self.parallel != "fsdp":
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))

    def close(self, clean: bool = True) -> None:
        """Leave the process group; `clean`: after a barrier, so that no process tears down its
        connections while another still uses them (skipped after an error: it could hang)."""
        if self.enabled and torch_dist.is_initialized():
            if clean:
                torch_dist.barrier()
            torch_dist.destroy_process_group()


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


def metric_count(key: str) -> str:
    """Which count a per-update metric is an average over (see Dist.reduce_metrics)."""
    if key in TOKEN_METRICS:
        return "tokens"
    if key in AGG_METRICS:
        return "agg"
    if key in MOE_METRICS:
        return "attention"
    return "rank"


def init(parallel: str, device: str) -> Dist:
    """Join the process group torchrun set up (a single-process Dist without torchrun)."""
    from gspo.models import resolve_device

    world = world_size_from_env()
    dev = resolve_device(device)
    if world <= 1:
        return Dist(device=dev)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r}: multi-process training runs on cpu (gloo) or cuda (nccl)")
    if not torch_dist.is_initialized():
        torch_dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (world,)) if parallel == "fsdp" else None
    return Dist(rank=rank, world=world, local_rank=local_rank, parallel=parallel, device=dev, mesh=mesh)
