"""Rollout workers at the size a user runs them: a worker or a trainer killed, a second Ctrl-C, an
error in the trainer, each while a batch of megabytes is in flight (gspo.processes.links, gspo.sampling.pipeline).

Why these sizes. A worker's result carries the batch's dataset rows, completions and reward parts;
a pipe holds 64 KiB. Each row of the dataset here has a 96 KiB `context` column (a GSM8K row with a
long worked solution, say), and a batch holds 32 prompts' rows: 32 x 96 KiB = 3 MiB per result,
48 times a pipe. The old transport (one multiprocessing queue for every worker's results) wrote
such a result half into the pipe and blocked; killed there, a worker hung its trainer in the
read, and a trainer killed there left its worker blocked at exit forever.

Why this moment. The trainer evaluates 100 held-out problems after every step (`--eval-every 1`),
so a step takes seconds while the worker samples the next batch in a fraction of one (K = 1:
batch t+1 is sampled during step t) and then sends it: killing 40% into a step lands while the
next batch's result is written and not yet read. Each test was run against the transport before
this one (a queue, results pickled into its pipe) and hung or left an orphan there.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo.io.files import read_jsonl
from gspo.train import checkpoint as ckpt
from tests.test_async import _children, _wait_for
from tests.test_distributed import ENV

pytestmark = pytest.mark.slow

ROW_KIB = 96  # the `context` column of each row
ARGS = ["--prompt-column", "question", "--reward", "exact_match", "--prompts-per-step", "32", "--group-size", "4",
        "--max-new-tokens", "8", "--rollout-workers", "1", "--max-staleness", "1", "--threads", "1",
        "--eval-every", "1", "--eval-size", "100", "--no-progress", "--seed", "0"]


@pytest.fixture(scope="module")
def big_rows(tmp_path_factory) -> Path:
    """Two-digit sums, each row with a 96 KiB context column: 3 MiB of rows in every batch."""
    path = tmp_path_factory.mktemp("big") / "sums.jsonl"
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(300):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            context = "".join(rng.choice("abcdefgh ") for _ in range(ROW_KIB * 1024))
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b), "context": context}) + "\n")
    return path


def start(data: Path, run: Path, *extra, steps: int = 200, session: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gspo", "train", "--dataset", str(data), *ARGS,
                             "--steps", str(steps), *extra, "--output-dir", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=session)


def in_flight(p: subprocess.Popen, run: Path) -> int:
    """Wait for the first step's row, then 40% into the next step (a result written, not yet read);
    the worker's pid."""
    worker = _wait_for(lambda: _children(p.pid), 120, "the rollout worker")
    assert len(worker) == 1
    rows = _wait_for(lambda: read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else None,
                     240, "a first step")
    time.sleep(0.4 * rows[-1]["time/step_seconds"])
    assert p.poll() is None, p.stderr.read()
    return worker[0]


def gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(") ")[1].startswith("Z")  # a zombie has exited
    except (OSError, IndexError):
        return True


def finish(p: subprocess.Popen, within: float, workers=()) -> tuple[int, str, float]:
    """The process's exit code and stderr once it exits, and how long that took; fails after `within`
    s, killing it and its `workers` (which would hold its stderr open)."""
    t0 = time.monotonic()
    try:
        _, err = p.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        p.kill()
        for w in workers:
            kill(w)
        _, err = p.communicate(timeout=30)
        raise AssertionError(f"still running {within} s later; stderr: {err[-2000:]}") from None
    return p.returncode, err, time.monotonic() - t0


def kill(pid: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_worker_killed_with_megabytes_in_flight_stops_the_run_in_one_line(big_rows, tmp_path):
    run = tmp_path / "run"
    p = start(big_rows, run, "--save-every", "1")
    try:
        worker = in_flight(p, run)
        os.kill(worker, signal.SIGKILL)
        code, err, _ = finish(p, 30)
    finally:
        if p.poll() is None:
            p.kill()
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert f"rollout worker 0 (pid {worker}, cpu) died (killed by SIGKILL)" in last, err[-2000:]
    assert f"gspo train --resume {run}" in last, last
    assert "Traceback" not in err and "terminate called" not in err, err[-2000:]
    # the last checkpoint is whole: the run continues from it (in the trainer's process this time)
    done = int(ckpt.latest_checkpoint(run).name.split("-")[1])
    r = subprocess.run([sys.executable, "-m", "gspo", "train", "--resume", str(run), "--rollout-workers", "0",
                        "--steps", str(done + 1), "--eval-every", "0"], capture_output=True, text=True, env=ENV,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(read_jsonl(run / "metrics.jsonl")) == done + 1


def test_a_killed_trainer_takes_its_workers_with_it(big_rows, tmp_path):
    run = tmp_path / "run"
    p, worker = start(big_rows, run), None
    try:
        worker = in_flight(p, run)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        _wait_for(lambda: gone(worker), 30, f"worker {worker} to exit after its trainer was killed")
    finally:
        if p.poll() is None:
            p.kill()
        if worker is not None and not gone(worker):
            kill(worker)


def test_a_second_ctrl_c_exits_within_10_s(big_rows, tmp_path):
    # a terminal's Ctrl-C goes to the whole foreground process group: the trainer and its worker
    run = tmp_path / "run"
    p, worker = start(big_rows, run, session=True), None
    try:
        worker = in_flight(p, run)
        os.killpg(p.pid, signal.SIGINT)
        time.sleep(0.3)
        os.killpg(p.pid, signal.SIGINT)
        code, err, _ = finish(p, 10, [worker])
    finally:
        kill(p.pid, group=True)
    assert code == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "gspo train: interrupted", err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    _wait_for(lambda: gone(worker), 5, "the worker to exit")


ERROR_IN_TRAINER = '''
import sys, time
from gspo import Trainer, TrainConfig

def boom(step, metrics):
    if step == 2:  # batch 3 is being sampled (a 2 s reward per batch, in the worker)
        print("raising", flush=True)
        raise RuntimeError("an error in the trainer")

cfg = TrainConfig(dataset=sys.argv[1], prompt_column="question", reward=["exact_match", sys.argv[2]],
                  prompts_per_step=32, group_size=4, max_new_tokens=8, rollout_workers=1, max_staleness=1,
                  threads=1, steps=50, eval_size=8, progress=False, output_dir=sys.argv[3])
if __name__ == "__main__":
    Trainer(cfg, callbacks=[boom]).train()
'''

SLOW = '''
import time

def slow(completions, **kwargs):
    time.sleep(2.0)  # in the rollout worker: batch 3 is still being sampled when the trainer fails
    return [0.0] * len(completions)
'''


def test_an_error_in_the_trainer_with_a_batch_in_flight_exits_within_10_s(big_rows, tmp_path):
    (tmp_path / "script.py").write_text(ERROR_IN_TRAINER)
    (tmp_path / "slow.py").write_text(SLOW)
    p = subprocess.Popen([sys.executable, str(tmp_path / "script.py"), str(big_rows), f"{tmp_path / 'slow.py'}:slow",
                          str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    worker = []
    try:
        _wait_for(lambda: "raising" in p.stdout.readline(), 240, "the callback to raise")
        worker = _children(p.pid)
        code, err, _ = finish(p, 10, worker)
    finally:
        if p.poll() is None:
            p.kill()
        for w in worker:
            if not gone(w):
                kill(w)
    assert code != 0 and "RuntimeError: an error in the trainer" in err, err[-2000:]
    assert "terminate called" not in err, err[-2000:]
    assert all(gone(w) for w in worker), worker
