"""The CPU threads a run takes (gspo.processes.threads): `--threads N`, OMP_NUM_THREADS, or half
the cores, fewer when busy.

Beside a competing load, all-cores intra-op threads wait for the scheduler at every barrier (1.9x
to 4.1x slower steps on 2 cores: docs/performance.md); the default takes at most half the cores
and no more than other processes leave free, at least 1; the run's config.yaml keeps the count.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from gspo.processes import threads
from gspo.processes.threads import busy_cores, choose_threads

BUSY = "while True:\n    pass\n"


def test_asked_threads_are_taken_as_they_are():
    assert choose_threads(3) == (3, "--threads")


def test_omp_num_threads_is_the_users_choice(monkeypatch):
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert choose_threads(0) == (torch.get_num_threads(), "OMP_NUM_THREADS=1")


def test_busy_cores_by_hand(monkeypatch):
    # two cores over the sample: cpu0 idle 50 of 100 jiffies (half busy), cpu1 idle 100 of 100 (free)
    #   busy = (1 - 50/100) + (1 - 100/100) = 0.5;  free = 2 - round(0.5) = 2 - 1 = 1 (0.5 rounds up)
    times = iter([[(100, 1000), (100, 1000)], [(150, 1100), (200, 1100)]])
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: next(times))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    assert busy_cores([0, 1]) == pytest.approx(0.5, rel=1e-12)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    # 4 cores, none busy: min(half = (4 + 1) // 2 = 2, 4 - 0) = 2 threads
    times = iter([[(0, 0)] * 4, [(100, 100)] * 4])
    assert choose_threads(0) == (2, "half of 4 cores, 0.0 busy")
    # 4 cores, three kept busy (idle 0 of 100 each): min(2, 4 - round(3.0)) = 1 thread
    times = iter([[(0, 0)] * 4, [(0, 100), (0, 100), (0, 100), (100, 100)]])
    assert choose_threads(0) == (1, "half of 4 cores, 3.0 busy")
    # 5 cores, one busy: min((5 + 1) // 2 = 3, 5 - 1 = 4) = 3
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    times = iter([[(0, 0)] * 5, [(0, 100)] + [(100, 100)] * 4])
    assert choose_threads(0) == (3, "half of 5 cores, 1.0 busy")


@pytest.mark.slow  # starts a process
@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="measures /proc/stat (Linux)")
def test_a_competing_load_is_seen_and_left_its_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    loads = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(cores)]
    try:
        time.sleep(0.5)
        n, why = choose_threads(0)
    finally:
        for p in loads:
            p.kill()
            p.wait()
    assert n == 1, why  # every core busy: one thread, which never waits at a barrier
    assert float(why.split(", ")[1].split()[0]) >= cores - 0.5, why


@pytest.mark.slow  # starts a process
@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="measures /proc/stat (Linux)")
def test_gspo_train_beside_a_busy_machine_takes_one_thread_and_keeps_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as a user runs it (conftest sets it)
    cores = len(os.sched_getaffinity(0))
    loads = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(cores)]
    try:
        r = subprocess.run([sys.executable, "-m", "gspo", "train", "--steps", "1", "--eval-size", "0",
                            "--prompts-per-step", "4", "--group-size", "2", "--no-progress",
                            "--output-dir", str(tmp_path / "run")],
                           capture_output=True, text=True, env=env, timeout=300)
        # gspo eval takes its threads alike (it took torch's default, every core, before)
        e = subprocess.run([sys.executable, "-m", "gspo", "eval", "--model", str(tmp_path / "run"), "--k", "0",
                            "--eval-size", "4", "--no-progress"],
                           capture_output=True, text=True, env=env, timeout=300)
    finally:
        for p in loads:
            p.kill()
            p.wait()
    assert r.returncode == 0, r.stderr[-2000:]
    assert e.returncode == 0, e.stderr[-2000:]
    assert json.loads(e.stdout)["threads"] == 1
    assert f"1 process of 1 CPU thread (half of {cores} cores, " in r.stdout, r.stdout
    assert "threads: 1\n" in (tmp_path / "run" / "config.yaml").read_text()  # a resume computes alike


def test_gspo_eval_takes_asked_threads_and_gives_the_callers_back(capsys):
    from gspo.cli import main

    before = torch.get_num_threads()
    asked = before + 1  # a count that differs from the caller's
    assert main(["eval", "--model", "tiny", "--k", "0", "--eval-size", "2", "--no-progress",
                 "--threads", str(asked)]) == 0
    assert json.loads(capsys.readouterr().out)["threads"] == asked
    assert torch.get_num_threads() == before
    assert main(["eval", "--model", "tiny", "--threads", "-1"]) == 2
    assert capsys.readouterr().err.strip() == \
        "gspo eval: error: --threads: must be >= 0 (0: half the cores, fewer when busy), got -1"
