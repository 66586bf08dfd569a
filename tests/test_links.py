"""The transport between a trainer and its local rollout workers (gspo.processes.links), through real spawned
processes, and the worker's side of a run (gspo.sampling.pipeline): sizes, deaths, the spool, the bound.

The sizes: 64 KiB is what a Linux pipe holds; the results here are 8 MiB (128 times that), as a
batch of GSM8K rows with long completions is. Each test runs a stub worker (a module-level
function below, as spawn requires) through LocalLink itself.
"""

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from gspo.processes import links
from gspo.processes.links import LocalLink, WorkerDied

BIG = 8 * 2**20  # bytes of payload: 128 pipes' worth


def _big_sender(n_bytes: int, end) -> None:
    """Send one result of `n_bytes` (text and a tensor, as a batch has), then wait to be stopped."""
    end.start()
    payload = {"text": "x" * (n_bytes // 2), "tensor": torch.arange(n_bytes // 8, dtype=torch.float32)}
    end.put(("done", 0, payload))
    while (msg := end.next(0.2)) is None or msg[0] != "stop":
        pass


def _dies_mid_write(n_bytes: int, end) -> None:
    """Begin writing a result into the spool, then die as the OOM killer would."""
    end.start()
    (end.spool / "worker0-1.part").write_bytes(b"\0" * n_bytes)
    os.kill(os.getpid(), signal.SIGKILL)


def _echo_weights(end) -> None:
    """Answer each ("tensor", name, t) request with the tensor's sum; stop on ("stop",)."""
    end.start()
    while (msg := end.next(0.2)) is None or msg[0] != "stop":
        if msg is not None:
            end.put(("done", 0, (msg[1], float(msg[2].double().sum()))))


def _ignores_stop(end) -> None:
    """A worker busy sampling: it never reads its requests (close must escalate)."""
    end.start()
    end.put(("ready", 0, None))
    while True:
        time.sleep(0.1)


def _receive(link, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (msg := link.recv(0.2)) is not None:
            return msg
        link.check()
    raise AssertionError(f"no message within {seconds} s")


@pytest.mark.slow  # starts a process
def test_a_result_of_megabytes_arrives_whole_and_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("GSPO_SPOOL_DIR", str(tmp_path))
    link = LocalLink(1, _big_sender, lambda i: (BIG,))
    try:
        kind, w, payload = _receive(link, 60)
        assert (kind, w) == ("done", 0)
        assert payload["text"] == "x" * (BIG // 2)
        assert torch.equal(payload["tensor"], torch.arange(BIG // 8, dtype=torch.float32))  # 4 MiB, exact
        assert [p.name for p in link.spool.iterdir()] == [links.SPOOL_LOCK]  # read, then removed
    finally:
        link.close()
    assert not list(tmp_path.iterdir())  # the spool directory itself is gone


@pytest.mark.slow  # starts a process
def test_a_worker_killed_mid_write_is_reported_and_its_partial_result_never_read(tmp_path, monkeypatch):
    monkeypatch.setenv("GSPO_SPOOL_DIR", str(tmp_path))
    link = LocalLink(1, _dies_mid_write, lambda i: (BIG,))
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerDied) as e:
            _receive(link, 30)
        assert e.value.args[:2] == (0, "killed by SIGKILL")
        assert time.monotonic() - t0 < 30
    finally:
        link.close()


@pytest.mark.slow  # starts a process
def test_weights_reach_the_worker_and_close_stops_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GSPO_SPOOL_DIR", str(tmp_path))
    link = LocalLink(1, _echo_weights, lambda i: ())
    try:
        t = torch.linspace(-1, 1, 1000)  # sums to 0 up to rounding; the ones below to 1000
        link.send(0, ("tensor", "w", torch.ones(1000)))
        link.send(0, ("tensor", "v", t))
        assert _receive(link, 60)[2] == ("w", 1000.0)
        assert _receive(link, 10)[2] == ("v", float(t.double().sum()))
        proc = link.procs[0]
    finally:
        link.close()
    assert not proc.is_alive() and proc.exitcode == 0  # it left on the stop request


@pytest.mark.slow  # starts a process
def test_close_escalates_on_a_worker_that_never_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("GSPO_SPOOL_DIR", str(tmp_path))
    monkeypatch.setattr(links, "CLOSE_STOP_S", 0.5)
    link = LocalLink(1, _ignores_stop, lambda i: ())
    proc = link.procs[0]
    assert _receive(link, 60)[0] == "ready"  # started, its signals in place
    t0 = time.monotonic()
    link.close()
    # stop request ignored (0.5 s), then SIGTERM, honoured because the link is closing: exit code 0
    assert not proc.is_alive() and proc.exitcode == 0
    assert time.monotonic() - t0 < 0.5 + links.CLOSE_TERM_S


@pytest.mark.slow  # starts a process
def test_a_sigterm_to_the_process_group_is_left_to_the_trainer(tmp_path, monkeypatch):
    # a cluster's SIGTERM to every process: the worker keeps serving (the trainer checkpoints with
    # the batches in flight, then stops it)
    monkeypatch.setenv("GSPO_SPOOL_DIR", str(tmp_path))
    link = LocalLink(1, _echo_weights, lambda i: ())
    try:
        link.send(0, ("tensor", "w", torch.ones(3)))
        _receive(link, 60)  # started, signals in place
        os.kill(link.procs[0].pid, signal.SIGTERM)
        link.send(0, ("tensor", "w", torch.ones(4)))
        assert _receive(link, 10)[2] == ("w", 4.0)
    finally:
        link.close()


def test_a_result_the_spool_cannot_hold_is_one_line_naming_the_way_out(tmp_path):
    end = links.ProcessEnd(0, None, None, str(tmp_path / "no" / "such" / "dir"), None, os.getpid())
    with pytest.raises(OSError, match=r"could not spool a 0\.0 MB result in .*no/such/dir .*set GSPO_SPOOL_DIR"):
        end.put(("done", 0, "x" * 1000))


def test_the_staleness_bound_is_checked_without_assert():
    # a bare `assert` is gone under `python -O`; the bound must hold whatever the interpreter's flags
    from types import SimpleNamespace

    from gspo.sampling.pipeline import Pipeline

    cfg = SimpleNamespace(async_rl=SimpleNamespace(max_staleness=1), run=SimpleNamespace(steps=10))
    pipe = Pipeline(SimpleNamespace(cfg=cfg))
    pipe.request = lambda step, version: pipe.pending.__setitem__(step, SimpleNamespace(step=step, version=0))
    pipe.metrics = lambda *args: {}
    pipe.take(1)  # version 0 samples batch 1 (and 2): within the bound
    pipe.pending[4] = SimpleNamespace(step=4, version=0)  # batch 4 from version 0 for version 3: 3 > K = 1 stale
    pipe.requested = 4
    with pytest.raises(RuntimeError, match="staleness bound is broken"):
        pipe.take(4)


def test_with_workers_the_trainer_keeps_no_low_precision_copy(tmp_path):
    # --dtype bfloat16: the trainer's own sampler would be a bf16 copy of the policy (a 7B model's
    # 14 GB); with rollout workers nothing in the trainer samples, so there is none
    from gspo.config import TrainConfig
    from gspo.train.run import build_run

    cfg = TrainConfig(steps=1, prompts_per_step=4, group_size=2, eval_size=0, dtype="bfloat16", rollout_workers=1,
                      max_staleness=1, output_dir=str(tmp_path / "run"))
    run = build_run(cfg)
    assert run.sampler.model is run.policy
    assert next(run.policy.parameters()).dtype == torch.float32
    no_workers = build_run(dataclasses.replace(cfg, rollout_workers=0, output_dir=str(tmp_path / "r2")))
    assert no_workers.sampler.model is not no_workers.policy  # the copy is made when the trainer samples


@pytest.mark.parametrize("dtype,keep", [("float16", "_keep_in_fp32_modules"),
                                        ("bfloat16", "_keep_in_fp32_modules_strict")])
def test_a_worker_holds_its_policy_as_the_trainers_copy_holds_it(monkeypatch, dtype, keep):
    # a loader asked for a low precision directly keeps the modules a model lists in float32
    # (transformers: `_keep_in_fp32_modules` under fp16, `..._strict` under bf16 too); the trainer's
    # copy casts every parameter: the worker must hold what that copy holds
    from transformers import Qwen3ForCausalLM

    from gspo.agents.side import sampling_side
    from gspo.config import TrainConfig
    from gspo.models.loading import DTYPES, load_policy, low_precision_copy
    from gspo.train.resolve import resolve

    monkeypatch.setattr(Qwen3ForCausalLM, keep, ["norm"])
    cfg = resolve(TrainConfig(prompts_per_step=4, group_size=2, dtype=dtype, rollout_workers=1, max_staleness=1))
    side = sampling_side(cfg, torch.device("cpu"))
    trainer_copy = low_precision_copy(load_policy(cfg.policy.model, dtype=torch.float32)[0], DTYPES[dtype])
    held = {n: p.dtype for n, p in side.policy.named_parameters()}
    assert held == {n: p.dtype for n, p in trainer_copy.named_parameters()}
    assert set(held.values()) == {DTYPES[dtype]}  # the norms too, which the loader would keep in fp32
    for (n, a), (_, b) in zip(side.policy.named_parameters(), trainer_copy.named_parameters()):
        assert torch.equal(a, b), n


def test_spool_root_prefers_memory(monkeypatch):
    monkeypatch.delenv("GSPO_SPOOL_DIR", raising=False)
    shm = Path("/dev/shm")
    expected = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    if expected is not None:
        assert links.spool_root() == expected
    monkeypatch.setenv("GSPO_SPOOL_DIR", "/somewhere/else")
    assert links.spool_root() == Path("/somewhere/else")


def test_sending_weights_is_not_counted_as_waiting():
    # the trainer hands a worker 4 tensors of new weights at 0.1 s each (a stand-in for a large
    # model's transfer), then finds the batch already there: it waited ~0 s, it synced ~0.4 s
    from types import SimpleNamespace

    from gspo.processes.distributed import Dist
    from gspo.sampling.pipeline import WorkerPipeline

    batch = SimpleNamespace(step=1, version=0, versions=torch.zeros(2, 3, dtype=torch.int32), seconds=1.0, idle=0.0,
                            on=lambda device: batch)

    class Link:  # a worker that has the batch ready; each tensor takes 0.1 s to hand over
        sender = True

        def send(self, w, msg):
            if msg[0] == "tensor":
                time.sleep(0.1)

        def recv(self, timeout):
            return ("done", 0, batch)

    pipe = WorkerPipeline.__new__(WorkerPipeline)
    cfg = SimpleNamespace(async_rl=SimpleNamespace(max_staleness=0, drop_uniform_groups=False),
                          run=SimpleNamespace(steps=1))
    pipe.run = SimpleNamespace(cfg=cfg, dist=Dist(),
                               policy=torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    pipe.lag, pipe.pending, pipe.requested, pipe.link, pipe.sent, pipe.in_flight = 0, {}, 0, Link(), [-1], {}
    _, metrics = pipe.take(1)
    assert metrics["async/trainer_idle_seconds"] < 0.1
    assert metrics["async/weight_sync_seconds"] >= 0.4  # 4 tensors (2 weights, 2 biases) x 0.1 s


def _rank_of_a_closing_world(rank: int, port: int, late_s: float, out: str) -> None:
    """One rank of a torchrun-like world of 2 trainers and 1 rollout rank, at the end of a run:
    trainer rank 0 reaches close `late_s` after rank 1 (it writes the final checkpoint alone), past
    rank 1's wait for its goodbye; the rollout rank is slow between its two goodbyes (a loaded
    machine deschedules it). Each trainer then leaves as gspo's does: a barrier of the trainers,
    the group destroyed, os._exit. Writes its exit code to `out`/rank."""
    from types import SimpleNamespace

    import torch.distributed as torch_dist

    links.CLOSE_STOP_S, links.CLOSE_TERM_S = 0.1, 0.1  # rank 1 stops waiting for its goodbye after 0.2 s
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    trainers = torch_dist.new_group([0, 1], backend="gloo")
    link = torch_dist.new_group([0, 1, 2], backend="gloo")
    code = 0
    try:
        if rank == 2:
            send = links._send

            def slow_send(obj, dst, group):  # a pause before each goodbye but the first
                if obj == ("bye",) and slow_send.sent:
                    time.sleep(1.0)
                slow_send.sent += obj == ("bye",)
                send(obj, dst, group)

            slow_send.sent = 0
            links._send = slow_send
            end = links.RankEnd(link, 2)
            while (msg := end.next(1.0)) is None or msg[0] != "stop":
                pass
            end.close()
        else:
            if rank == 0:
                time.sleep(late_s)
            links.RankLink(SimpleNamespace(link=link, world=2, rank=rank), 1).close()
            torch_dist.barrier(group=trainers)
            torch_dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 (the code says it)
        code = 1
        Path(out, f"{rank}.err").write_text(str(e))
    Path(out, str(rank)).write_text(str(code))
    os._exit(code)


@pytest.mark.slow  # starts a process
def test_a_rollout_rank_ends_cleanly_when_the_trainers_leave_at_different_times(tmp_path):
    # the end of a torchrun run with a rollout rank (seen once in CI as a failed run after its last
    # step): trainer rank 0 arrives 1.5 s after rank 1, whose wait (0.2 s here, 5 s in gspo) has
    # ended, and the rollout rank pauses 1 s between goodbyes. Said to rank 0 first, the goodbye to
    # rank 1 found it gone (its barrier released by rank 0) and the rollout rank failed (exit 1).
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_of_a_closing_world, args=(r, port, 1.5, str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    codes = {r: (tmp_path / str(r)).read_text() if (tmp_path / str(r)).exists() else None for r in range(3)}
    errors = {r: (tmp_path / f"{r}.err").read_text() for r in range(3) if (tmp_path / f"{r}.err").exists()}
    assert [p.exitcode for p in procs] == [0, 0, 0], (codes, errors)
