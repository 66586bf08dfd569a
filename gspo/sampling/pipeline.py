"""Where each step's batch comes from: sampled now, or by weights up to K versions older (--max-staleness K).

    pipeline = make_pipeline(run)            # Pipeline (this process samples) or WorkerPipeline
    produced, metrics = pipeline.take(step)  # batch `step`, and its async/... metrics

Versions: the policy's version is the number of steps done; the weights that train step t are
version t-1. With a fixed lag K, batch t is sampled by version max(0, t-1-K), so its staleness
at consumption is min(t-1, K) versions. At the start of step t (version t-1) every batch whose
sampling version has come, t .. t+K, is requested; in the trainer's process that means sampled
at once (the same mathematics as asynchronous sampling, without the overlap: deterministic, for
tests and for science on CPU), in worker mode sent to the rollout workers, which sample while
the trainer trains. K = 0 samples batch t at the start of step t: today's synchronous loop.

A checkpoint waits for the batches in flight (`drain`) and saves the sampled batches not yet
trained with their versions (gspo.train.checkpoint): a resumed run trains what the uninterrupted run
would, and the bound holds across the resume.

Rollout workers (--rollout-workers N) sample in processes of their own:

    gspo train --rollout-workers 1 --max-staleness 1       # the trainer starts 1 worker process
    torchrun --nproc-per-node 8 -m gspo train --parallel fsdp --device cuda --rollout-workers 2 --max-staleness 1
                                                           # ranks 0-5 train, ranks 6 and 7 sample

Without torchrun the trainer starts N processes (torch.multiprocessing, spawn; their devices:
--rollout-devices, default the trainer's) and talks to them through queues; under torchrun the
world's last N ranks are the workers (torchrun's rendezvous, across machines too), the trainer
processes the others, with their collectives on a group of their own, and the rollouts travel
on a gloo group (gspo.processes.links). Each worker builds the sampling side of the run from the trainer's
configuration (`build`, given by the trainer: gspo.agents.side.sampling_side makes the task, the
tokenizer, its own copy of the policy, the rewards, the sampler: gspo's or a vLLM engine) and serves
requests, in order:

    ("tensor", name, tensor) x the trainable tensors    the weights of the next version, one at a time
    ("sample", step, version)   produce batch `step` (gspo.sampling.produce) for every trainer process's share
    ("stop",)

Batch s goes to worker s mod N. Before asking a worker for a batch of version v, the trainer
sends it version v's trainable weights (under FSDP each gathered in turn), unless it has them.
A worker therefore samples batch t with exactly the weights of version max(0, t-1-K) and each
trainer process's share of prompts with its rows' uniforms, as the trainer processes would:
worker mode with a fixed lag equals the trainer-process run bit for bit on CPU (the worker runs
with the trainer's number of threads), under torchrun too.

a worker that dies stops the run with one line naming it (and how to resume); an
error in a worker (a reward that raises) is said by the trainer as the worker's. Workers ignore
SIGINT and SIGTERM: the trainer, which gets them, finishes its step, checkpoints (waiting for the
batches in flight) and stops them; a worker whose trainer is gone exits on its own.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from gspo.config import TrainConfig
from gspo.models.loading import resolve_device
from gspo.processes import distributed
from gspo.processes.distributed import Dist
from gspo.processes.links import LocalLink, RankEnd, RankLink, WorkerDied
from gspo.processes.memory import keep_large_on_heap
from gspo.sampling.produce import Produced, SamplingSide, produce

Tensor = torch.Tensor


# a rollout worker's sampling side, built in its own process from the trainer's configuration and
# device: a module-level function, so that it reaches a spawned process by name
# (gspo.agents.side.sampling_side)
Build = Callable[[TrainConfig, torch.device], SamplingSide]


def make_pipeline(run: SamplingSide, run_dir: Path, pending: list[Produced] = (),
                  build: Build | None = None) -> Pipeline:
    """The run's source of batches: its own process (--rollout-workers 0) or rollout workers, each
    building its sampling side with `build`. run_dir: where the run writes (a worker's death says
    how to resume it)."""
    if run.cfg.async_rl.rollout_workers == 0:
        return ServerPipeline(run, pending) if overlaps(run) else Pipeline(run, pending)
    assert build is not None, "rollout workers build their sampling side: make_pipeline(..., build=)"
    return WorkerPipeline(run, pending, run_dir=run_dir, build=build)


class Pipeline:
    """Batches for the steps of a run (gspo.train.run.Run), sampled in the trainer's process with a
    fixed lag of --max-staleness versions. pending: sampled batches a checkpoint saved."""

    def __init__(self, run: SamplingSide, pending: list[Produced] = ()):
        self.run, self.lag = run, run.cfg.async_rl.max_staleness
        self.pending: dict[int, Produced] = {p.step: p for p in pending}
        self.requested = max(self.pending, default=0)  # the newest batch asked for

    def take(self, step: int) -> tuple[Produced, dict]:
        """Batch `step` (sampled by version max(0, step-1-K)) and the step's async/... metrics."""
        version = step - 1
        self.sync_seconds = 0.0  # of the requests: sending weights to workers (not waiting)
        t0 = time.perf_counter()
        for s in range(max(self.requested + 1, step), min(step + self.lag, self.run.cfg.run.steps) + 1):
            self.request(s, version)
            self.requested = s
        produced = self.wait(step)
        waited = time.perf_counter() - t0 - self.sync_seconds
        if produced.step != step or produced.version < version - self.lag:  # the bound: a bug, never the user's
            raise RuntimeError(f"batch {produced.step} sampled by version {produced.version} arrived for step {step} "
                               f"(version {version}, --max-staleness {self.lag}): the staleness bound is broken")
        return produced, self.metrics(produced, version, waited)

    def request(self, step: int, version: int) -> None:
        """Batch `step`, to be sampled by the current weights (version `version`): here, now."""
        self.pending[step] = produce(self.run, step, version)

    def wait(self, step: int) -> Produced:
        return self.pending.pop(step)

    def drain(self) -> list[Produced]:
        """The sampled batches not yet trained (a checkpoint saves them), once none is in flight."""
        return [self.pending[s] for s in sorted(self.pending)]

    def hold(self) -> None:
        """Wait for whatever samples in this process (nothing here: it samples when asked)."""

    def close(self) -> None:
        """Stop whatever samples (nothing here)."""

    def metrics(self, produced: Produced, version: int, waited: float) -> dict:
        """Staleness over the global batch's completion tokens, the queue, idle time and overlap."""
        dist = self.run.dist
        versions = produced.versions  # (B, T)
        live = versions >= 0
        stale = (version - versions)[live].long()  # (n,) policy versions behind, per token
        counts = dist.all_sum(torch.bincount(stale, minlength=self.lag + 1)[: self.lag + 1].double())  # (K+1,)
        top = dist.all_max(stale.max().reshape(1).double() if stale.numel() else torch.zeros(1, dtype=torch.float64))
        # rows whose tokens more than one version sampled (partial rollouts: a generation that spanned a sync)
        big = torch.where(live, versions, torch.iinfo(versions.dtype).min).amax(1)  # (B,)
        small = torch.where(live, versions, torch.iinfo(versions.dtype).max).amin(1)  # (B,)
        spanning, rows = dist.all_sum(torch.tensor([float((big > small).sum()),  # (a row with no token: big < small)
                                                    float(live.any(1).sum())], dtype=torch.float64)).tolist()
        total = counts.sum().clamp(min=1)
        out = {
            "async/staleness_mean": float((counts * torch.arange(self.lag + 1)).sum() / total),
            "async/staleness_max": float(top),
            **{f"async/staleness_hist/{k}": float(counts[k] / total) for k in range(self.lag + 1)},
            "async/spanning_rows": spanning / max(rows, 1.0),  # share of the batch's completions
            "async/queue_depth": float(self.requested - produced.step),  # batches asked for ahead of this one
            "async/ready_batches": float(len(self.pending)),  # ... of which sampled already
            "async/trainer_idle_seconds": waited,
            "async/weight_sync_seconds": self.sync_seconds,
            "async/sample_seconds": produced.seconds,
            "async/worker_idle_seconds": produced.idle,
            "async/overlap": self.overlap(produced, waited),
        }
        if self.run.cfg.async_rl.drop_uniform_groups:  # counts over the global batch; rounds: the most any process ran
            g = produced.groups
            dropped, resampled = dist.all_sum(torch.tensor([g["groups/dropped"], g["groups/resampled"]],
                                                           dtype=torch.float64)).tolist()
            out.update({"groups/dropped": dropped, "groups/resampled": resampled,
                        "groups/rounds": float(dist.max_int(int(g["groups/rounds"])))})
        return out

    overlapping = False  # whether something samples while the trainer trains (workers, a sampling thread)

    def overlap(self, produced: Produced, waited: float) -> float:
        """The share of the batch's sampling time that ran while the trainer worked: 0 where the
        trainer samples its batches itself."""
        if not self.overlapping:
            return 0.0
        return max(0.0, 1.0 - waited / produced.seconds) if produced.seconds > 0 else 1.0


# ----------------------------------------------------------------------------------------------
# Rollout workers
# ----------------------------------------------------------------------------------------------

POLL_S = 0.5  # how often a waiting trainer checks its workers are alive


class WorkerError(ValueError):
    """A rollout worker died or failed; one line naming it."""


class Share(Dist):
    """A worker's place in the run: the rows of trainer process `rank` of `world`, no collectives."""

    @property
    def enabled(self) -> bool:
        return False


def worker_main(index: int, cfg: TrainConfig, device: str, shares: list[tuple[int, int, int | None]],
                how: tuple[int, Build], end) -> None:
    """A rollout worker: build the sampling side, then serve requests until told to stop.
    shares: (rank, world, destination) of each trainer process it samples for; end: its link's end;
    how: the trainer's number of threads, and what builds the sampling side."""
    threads, build = how
    end.start()  # SIGINT is the trainer's (it checkpoints, then stops us); we die with the trainer
    try:
        torch.set_num_threads(threads)
        keep_large_on_heap(cfg.run.malloc_heap)  # the process's own allocator, as the trainer's (gspo.processes.memory)
        side = build(cfg, torch.device(device))
        params = dict(side.policy.named_parameters())
        t0 = time.perf_counter()
        while (msg := end.next(1.0)) is None or msg[0] != "stop":
            if msg is None:
                continue
            if msg[0] == "tensor":  # a weight of the version being sent; a name the sampler's model
                if msg[1] in params:  # lacks (a PPO value head on the trainer's) is not the sampler's
                    with torch.no_grad():
                        params[msg[1]].copy_(msg[2])
            elif msg[0] == "sample":
                idle = time.perf_counter() - t0
                for rank, world, dest in shares:
                    side.dist = Share(rank=rank, world=world, device=side.dist.device)
                    out = dataclasses.replace(produce(side, msg[1], msg[2]).on("cpu"), worker=index, idle=idle)
                    end.put(("done", index, out), dest)
                t0 = time.perf_counter()
    except BaseException as e:  # said by the trainer, in one line
        for _, _, dest in shares:
            end.put(("error", index, " ".join(f"{type(e).__name__}: {e}".split())), dest)
        raise SystemExit(1) from None


def serve_rank(cfg_workers: int, device: str, build: Build) -> dict:
    """A rollout rank of a torchrun world (the last --rollout-workers ranks): join the world, get
    the run's configuration from trainer rank 0, serve its requests, leave. Returns {}."""
    world = distributed.world_size_from_env()
    index = distributed.rollout_rank(cfg_workers)
    trainers = world - cfg_workers
    backend = "nccl" if resolve_device(device).type == "cuda" else "gloo"  # the trainers' (--device)
    _, link = distributed.rollout_world(trainers, backend)
    end = RankEnd(link, trainers)
    while (msg := end.next(60.0)) is None:
        pass
    if msg[0] == "config":
        _, cfg, threads, device = msg
        if device is None:  # this rank's own: cuda:LOCAL_RANK, or the CPU
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if backend == "nccl" else "cpu"
        try:
            worker_main(index, cfg, device, [(r, trainers, r) for r in range(trainers)], (threads, build), end)
        except SystemExit:
            time.sleep(distributed.RANK_GRACE_S)  # the trainers say the error first
            raise
    end.close()
    return {}


# ----------------------------------------------------------------------------------------------
# The trainer's side
# ----------------------------------------------------------------------------------------------


class WorkerPipeline(Pipeline):
    """Batches sampled by --rollout-workers processes, each batch by weights at most K versions old."""

    overlapping = True

    def __init__(self, run: SamplingSide, pending: list[Produced] = (), *, run_dir: Path, build: Build):
        super().__init__(run, pending)
        self.run_dir = run_dir
        cfg, dist = run.cfg, run.dist
        n, threads = cfg.async_rl.rollout_workers, torch.get_num_threads()
        self.devices = distributed.worker_devices(cfg, dist)
        if dist.link is not None:  # the last n ranks of the torchrun world
            self.link = RankLink(dist, n)
            given = list(cfg.async_rl.rollout_devices)
            self.devices = given or [f"rank {dist.world + w}" for w in range(n)]
            for w in range(n):  # a rank's own device unless --rollout-devices names one
                self.link.send(w, ("config", cfg, threads, given[w] if given else None))
        else:
            self.link = LocalLink(n, worker_main, lambda i: (i, cfg, self.devices[i], [(dist.rank, dist.world, None)],
                                                             (threads, build)))
        self.sent = [-1] * n  # the newest version each worker has
        self.in_flight: dict[int, int] = {}  # step -> worker

    def request(self, step: int, version: int) -> None:
        w = step % len(self.sent)
        if self.sent[w] < version:
            self._send_weights(w, version)
        self.link.send(w, ("sample", step, version))
        self.in_flight[step] = w

    def _send_weights(self, w: int, version: int) -> None:
        """The policy's trainable tensors, one at a time (FSDP: each gathered in turn, by every process)."""
        t0 = time.perf_counter()
        for name, p in self.run.policy.named_parameters():
            if p.requires_grad:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                if self.link.sender:  # pickled into shared memory or onto the wire: a snapshot of this version
                    self.link.send(w, ("tensor", name, full.detach().to("cpu", copy=True)))
        self.sent[w] = version
        self.sync_seconds += time.perf_counter() - t0

    def wait(self, step: int) -> Produced:
        while step not in self.pending:
            self._receive()
        return self.pending.pop(step).on(self.run.dist.device)

    def drain(self) -> list[Produced]:
        while self.in_flight:
            self._receive()
        return super().drain()

    def _receive(self) -> None:
        msg = self.link.recv(POLL_S)
        if msg is None:
            try:
                self.link.check()
            except WorkerDied as e:
                self._died(*e.args)
            return
        kind, w, payload = msg
        if kind == "error":
            raise WorkerError(f"rollout worker {w} ({self.devices[w]}): {payload}")
        self.in_flight.pop(payload.step, None)
        self.pending[payload.step] = payload

    def _died(self, w: int, how: str, pid: int | None) -> None:
        doing = [s for s, k in self.in_flight.items() if k == w]
        who = f"pid {pid}, " if pid is not None else ""
        raise WorkerError(f"rollout worker {w} ({who}{self.devices[w]}) died ({how})"
                          f"{f' while sampling batch {doing[0]}' if doing else ''}; the run stops; continue it with: "
                          f"{distributed.command_line(['train', '--resume', str(self.run_dir)])}")

    def close(self) -> None:
        self.link.close()
        gc.collect()  # the queues' semaphores released before an os._exit (gspo.processes.distributed.exit_process)


# ----------------------------------------------------------------------------------------------
# Inference servers: sampling in a thread of the trainer's process, while it trains
# ----------------------------------------------------------------------------------------------


def overlaps(run: SamplingSide) -> bool:
    """Whether batches are sampled on the servers while the trainer trains (ServerPipeline):
    --rollout-engine vllm-server with --max-staleness K >= 1, one trainer process, single-turn
    rollouts. Under torchrun, and with multi-turn episodes or agents, the K-late batches are sampled
    in the trainer's thread instead (the same lag, no overlap; the plan says which)."""
    return (run.cfg.async_rl.max_staleness > 0 and run.cfg.sampling.rollout_engine == "vllm-server"
            and not run.dist.enabled and run.env is None and getattr(run.sampler, "gate", None) is not None)


class _Synced:
    """The sampler as the sampling thread sees it: its weights are the trainer's to sync (a sync
    reads the policy the trainer is updating), so `sync` here does nothing."""

    def __init__(self, sampler):
        self.sampler = sampler

    def sync(self, policy, version: int | None = None) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.sampler, name)


class ServerPipeline(Pipeline):
    """Batches sampled on vLLM servers (--rollout-engine vllm-server) by a thread of the trainer's
    process while the trainer trains, each by weights at most K versions old.

    At the start of step t the trainer syncs version t-1 to the servers (in its own thread, between
    updates), then asks for batches t .. t+K; the sampling thread samples and scores them in order,
    one at a time, over HTTP (the trainer's computation and the servers' run side by side). A sync
    and the sampling meet at the sampler's gate (gspo.sampling.vllm_server.Gate): the sync waits for
    the generations under way, or with --partial-rollouts aborts them and they continue under the new
    weights. Every token records the version that sampled it (Produced.versions): a batch asked for
    at version v may hold tokens of v+1 .. t-1, never older than v. Not bit-reproducible (which
    version samples which token depends on timing); the fixed-lag run in the trainer's thread is
    (--rollout-engine vllm-server under torchrun, or the other engines)."""

    overlapping = True

    def __init__(self, run: SamplingSide, pending: list[Produced] = ()):
        super().__init__(run, pending)
        fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(SamplingSide)}
        self.side = SamplingSide(**{**fields, "sampler": _Synced(run.sampler)})
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gspo-sampling")  # one batch at a time
        self.in_flight: dict[int, Future] = {}

    def request(self, step: int, version: int) -> None:
        t0 = time.perf_counter()
        self.run.sampler.sync(self.run.policy, version=version)  # the trainer's thread: the weights are still
        self.sync_seconds += time.perf_counter() - t0
        self.in_flight[step] = self.thread.submit(produce, self.side, step, version)

    def wait(self, step: int) -> Produced:
        if step in self.in_flight:
            self.pending[step] = self.in_flight.pop(step).result()  # the thread's error is raised here
        return self.pending.pop(step)

    def drain(self) -> list[Produced]:
        for step in sorted(self.in_flight):
            self.pending[step] = self.in_flight.pop(step).result()
        return super().drain()

    def hold(self) -> None:
        """Wait for the batches in flight (before the trainer uses what the sampling thread does: the
        tokenizer, in a held-out evaluation)."""
        self.drain()

    def close(self) -> None:
        for f in self.in_flight.values():
            f.cancel()
        self.thread.shutdown(wait=False, cancel_futures=True)  # a request under way ends by its deadline
