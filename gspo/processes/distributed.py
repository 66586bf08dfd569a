"""Several processes, one run: torch.distributed under torchrun: collectives and the data split.

    torchrun --nproc-per-node 4 -m gspo train --parallel ddp  --device cuda ...
    torchrun --nproc-per-node 8 -m gspo train --parallel fsdp --device cuda ...

A run started by `torchrun` (WORLD_SIZE > 1) creates one `Dist` per process; without
torchrun, `Dist()` is a single process and every method below is the identity, so the trainer
has one code path.

What each process does (the trainer's side is in gspo.train.trainer):
- samples its contiguous share of the step's prompts (a group never straddles processes) with
  the sampling uniforms of *its rows of the global batch* (gspo.sampling.rollout `rows=`), so a
  completion does not depend on how many processes there are;
- scores its groups and computes their advantages from the gathered global rewards;
- in each update, takes its rows of the *global* minibatch (one permutation of all rows, the
  same on every process), and scales its loss so that the gradient DDP/FSDP average is the
  gradient of the global minibatch's loss, normalised by global counts (`loss_scales`);
- reduces metrics exactly (gspo.algo.metrics: each metric declares what it averages over).

Backends: gloo for CPU, NCCL for CUDA, chosen from `--device`. Under torchrun `--device cuda`
means `cuda:$LOCAL_RANK`. Wrapping models (DDP, FSDP2 sharding), gathering sharded
parameters and state dicts is gspo.processes.parallel's.
"""

from __future__ import annotations

import gc
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as torch_dist

from gspo.config import TrainConfig

Tensor = torch.Tensor

RANK_GRACE_S = 3.0  # how long a rank other than 0 waits before saying its failure (say_once)


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
    group: object = None  # the trainer processes' group; None: the whole world (no rollout ranks)
    link: object = None  # with rollout ranks (`init`): the gloo group over every rank that carries their traffic

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
        return self._reduce(t, torch_dist.ReduceOp.SUM)

    def gather(self, t: Tensor) -> Tensor:
        """Concatenate every process's `t` along dim 0, in rank order (sizes may differ)."""
        if not self.enabled:
            return t
        parts = [None] * self.world
        torch_dist.all_gather_object(parts, t.detach().cpu(), group=self.group)
        return torch.cat(parts).to(t.device)

    def gather_objects(self, obj) -> list:
        if not self.enabled:
            return [obj]
        parts = [None] * self.world
        torch_dist.all_gather_object(parts, obj, group=self.group)
        return parts

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every process."""
        if not self.enabled:
            return obj
        box = [obj]
        torch_dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_min(self, t: Tensor) -> Tensor:
        return self._reduce(t, torch_dist.ReduceOp.MIN)

    def all_max(self, t: Tensor) -> Tensor:
        return self._reduce(t, torch_dist.ReduceOp.MAX)

    def _reduce(self, t: Tensor, op) -> Tensor:
        if not self.enabled:
            return t
        out = self._comm(t)
        torch_dist.all_reduce(out, op=op, group=self.group)
        return out.to(t.device)

    def max_int(self, n: int) -> int:
        """The largest `n` over processes."""
        return int(self.all_max(torch.tensor([n], dtype=torch.long))) if self.enabled else n

    def barrier(self) -> None:
        if self.enabled:
            torch_dist.barrier(group=self.group)

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

    def close(self, clean: bool = True) -> None:
        """Leave the process group; `clean`: after a barrier, so that no process tears down its
        connections while another still uses them (skipped after an error: it could hang)."""
        if (self.enabled or self.link is not None) and torch_dist.is_initialized():
            if clean and self.enabled:
                torch_dist.barrier(group=self.group)
            torch_dist.destroy_process_group()
            gc.collect()  # collective work objects freed now, not by gloo's threads at interpreter exit


def exit_process(code: int) -> None:
    """End the command with `code`. Under torchrun a worker ends with `os._exit` once its output
    is flushed: at interpreter finalization gloo's threads can still free work objects that hold
    tensors, and the process then aborts (`terminate called without an active exception`,
    SIGABRT) after a run that succeeded (seen in ~1 of 10 4-process runs on a loaded 2-core
    machine). Everything gspo writes is closed and flushed before this point."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def say_once(line: str) -> None:
    """Print a failure once under torchrun, where every process usually fails alike.

    Rank 0 says it. Another rank waits first: had it exited at once, torchrun could stop rank 0
    before rank 0 printed; and when rank 0 fails too, torchrun stops this one while it waits. A
    rank still running after the wait failed on its own and says so.
    """
    rank = int(os.environ.get("RANK", "0"))
    if rank:
        time.sleep(RANK_GRACE_S)
        line = f"{line} (rank {rank})"
    print(line, file=sys.stderr, flush=True)


def command_line(args: list[str]) -> str:
    """The command that runs gspo with `args` the way this process was launched: `gspo ARGS`,
    or under torchrun the torchrun line the user ran with its gspo arguments replaced by `args`
    (read from the launcher's command line, the parent process's; where that cannot be read,
    `torchrun --nproc-per-node N -m gspo ARGS`). What a resume hint should say.

    >>> command_line(["train", "--resume", "runs/a b"])  # not under torchrun
    "gspo train --resume 'runs/a b'"
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return shlex.join(["gspo", *args])
    launcher, own = _launcher_argv(), sys.argv[1:]  # own: this worker's arguments, the launcher's last ones
    head = launcher[:len(launcher) - len(own)] if own and launcher[len(launcher) - len(own):] == own else []
    if len(head) > 1 and Path(head[0]).name == "torchrun":  # torchrun OPTIONS -m gspo
        return shlex.join(["torchrun", *head[1:], *args])
    if len(head) > 2 and Path(head[1]).name == "torchrun":  # python .../bin/torchrun OPTIONS -m gspo
        return shlex.join(["torchrun", *head[2:], *args])
    if len(head) > 3 and head[1:3] == ["-m", "torch.distributed.run"]:  # python -m torch.distributed.run ...
        return shlex.join(["torchrun", *head[3:], *args])
    return shlex.join(["torchrun", "--nproc-per-node", os.environ.get("LOCAL_WORLD_SIZE", "1"), "-m", "gspo", *args])


def _launcher_argv() -> list[str]:
    """The command line of the process that started this one (torchrun's agent), [] where unknown."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
    except (OSError, UnicodeDecodeError):
        return []


def init(parallel: str, device: str, rollout_ranks: int = 0) -> Dist:
    """Join the process group torchrun set up (a single-process Dist without torchrun).
    rollout_ranks: the last N ranks of the world are rollout workers (gspo.sampling.pipeline.serve_rank):
    the trainer processes are the others, their collectives on a group of their own."""
    from gspo.models.loading import resolve_device

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
    if not rollout_ranks:
        if not torch_dist.is_initialized():
            torch_dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                          device_id=dev if dev.type == "cuda" else None)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (world,)) if parallel == "fsdp" else None
        return Dist(rank=rank, world=world, local_rank=local_rank, parallel=parallel, device=dev, mesh=mesh)
    trainers = world - rollout_ranks
    if trainers < 1:
        raise ValueError(f"rollout_workers: {rollout_ranks} rollout ranks leave no trainer process in a torchrun world "
                         f"of {world}")
    group, link = rollout_world(trainers, "nccl" if dev.type == "cuda" else "gloo")
    mesh = None
    if parallel == "fsdp" and trainers > 1:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group, dev.type)
    return Dist(rank=rank, world=trainers, local_rank=local_rank, parallel=parallel if trainers > 1 else "none",
                device=dev, mesh=mesh, group=group, link=link)


def rollout_world(trainers: int, backend: str) -> tuple[object, object]:
    """Every rank of a world with rollout ranks calls this, in the same order: the process group,
    then the trainers' group (ranks 0 .. trainers-1) and the gloo group rollouts travel on."""
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(backend)
    group = torch_dist.new_group(list(range(trainers)), backend=backend)
    link = torch_dist.new_group(list(range(world_size_from_env())), backend="gloo")
    return group, link


def rollout_rank(rollout_ranks: int) -> int | None:
    """This process's index among the rollout ranks (the last N of a torchrun world), or None."""
    world, rank = world_size_from_env(), int(os.environ.get("RANK", "0"))
    return rank - (world - rollout_ranks) if world > 1 and rollout_ranks and rank >= world - rollout_ranks else None


def worker_devices(cfg: TrainConfig, dist: Dist) -> list[str]:
    """This trainer process's workers' devices: --rollout-devices as given (N entries, the same for
    every process) or N per process in rank order (N x processes entries); default its own device."""
    n, given = cfg.async_rl.rollout_workers, list(cfg.async_rl.rollout_devices)
    if len(given) == n * dist.world and dist.world > 1:
        return given[dist.rank * n:(dist.rank + 1) * n]
    return given or [str(dist.device)] * n
