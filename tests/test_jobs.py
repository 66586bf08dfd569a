"""`gspo compare --jobs`: runs side by side in processes of their own, each equal to its run alone."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo.cli import main
from gspo.config import TrainConfig
from gspo.lab.compare import ratio_variances
from gspo.lab.jobs import MAX_AUTO_JOBS, plan_jobs
from gspo.train import checkpoint as ckpt
from gspo.train.lifecycle import check_no_writer
from tests.test_async import _children
from tests.test_vllm_server import alive


@pytest.mark.parametrize("device,threads,cores,pending,jobs,want", [
    ("cpu", 0, 2, 12, 0, (2, 1)),   # 2 cores: 2 jobs of 1 thread
    ("cpu", 0, 8, 12, 0, (4, 2)),   # 8 cores: MAX_AUTO_JOBS (4) jobs, 8 // 4 = 2 threads each
    ("cpu", 0, 16, 3, 0, (3, 5)),   # 3 runs: 3 jobs, 16 // 3 = 5 threads each
    ("cpu", 2, 8, 12, 0, (4, 2)),   # --threads 2 on 8 cores: 8 // 2 = 4 jobs, the configuration's 2 threads
    ("cpu", 4, 4, 12, 0, (1, 4)),   # --threads 4 on 4 cores: one job
    ("cpu", 0, 2, 1, 0, (1, 0)),    # one run: in this process, torch's default threads
    ("cuda", 0, 16, 12, 0, (1, 0)),  # a GPU: one job (runs would share it)
    ("cpu", 0, 2, 12, 3, (3, 1)),   # --jobs 3 on 2 cores: 3 jobs, at least 1 thread each
    ("cpu", 0, 2, 12, 1, (1, 0)),   # --jobs 1: one after another, as before
])
def test_plan_jobs(device, threads, cores, pending, jobs, want):
    assert MAX_AUTO_JOBS == 4
    cfg = TrainConfig(device=device, threads=threads)
    assert plan_jobs(cfg, pending, jobs, cores=cores) == want


def _steps(run):
    """metrics.jsonl without the timings (they differ run to run)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "async/"))} for r in rows]


BASE = ["--model", "tiny", "--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8",
        "--eval-every", "1", "--no-progress"]


@pytest.mark.slow
def test_runs_in_parallel_equal_each_run_alone(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--configs", "gspo", "grpo", "--seeds", "0", "--jobs", "2", *BASE,
                 "--output-dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "2 runs, 2 at a time, 1 thread each" in said
    for name, algorithm in (("gspo", "gspo"), ("grpo", "grpo")):
        run = out / "runs" / f"{name}-seed0"
        assert "threads: 1" in (run / "config.yaml").read_text()
        alone = tmp_path / f"alone-{name}"
        assert main(["train", "--algorithm", algorithm, "--seed", "0", "--threads", "1", *BASE,
                     "--output-dir", str(alone)]) == 0
        assert _steps(run) == _steps(alone)  # bit for bit: every logged number of every step
        together, by_itself = (json.loads((d / "summary.json").read_text()) for d in (run, alone))
        assert together["evals"] == by_itself["evals"] and together["eval_after"] == by_itself["eval_after"]
        # step 1's evaluation is timed in its row; summary.json's eval_seconds adds those before and after
        first = json.loads((alone / "metrics.jsonl").read_text().splitlines()[0])
        assert 0 < first["time/eval_seconds"] < by_itself["eval_seconds"] < by_itself["wall_seconds"]
    assert _steps(out / "runs" / "gspo-seed0") != _steps(out / "runs" / "grpo-seed0")  # the check can fail


@pytest.mark.slow  # starts a process
def test_a_failing_run_stops_the_comparison_in_one_line(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main(["compare", "--configs", "gspo", "bad:model=/nonexistent/model", "--seeds", "0", "--jobs", "2",
                 *BASE, "--output-dir", str(out)])
    captured = capsys.readouterr()
    assert code != 0
    assert "[compare] bad seed 0: failed" in captured.out
    assert "/nonexistent/model" in captured.err and "Traceback" not in captured.err
    assert not (out / "compare.json").exists()


def test_jobs_flag_is_checked(tmp_path, capsys):
    assert main(["compare", "--jobs", "two", "--output-dir", str(tmp_path / "c")]) == 2
    assert "--jobs: expected a number of runs at once (0: auto), got 'two'" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_ratio_variances_side_by_side_equal_each_alone():
    cfgs = [TrainConfig(model=m, prompts_per_step=4, group_size=4, max_new_tokens=8, progress=False, threads=1)
            for m in ("tiny", "tiny-moe")]
    together = ratio_variances(cfgs, 32, jobs=2, threads=1, log=lambda line: None)
    alone = ratio_variances(cfgs, 32, jobs=1, threads=1, log=lambda line: None)
    assert [r["model"] for r in together] == ["tiny", "tiny-moe"]  # in order
    assert together == alone
    assert together[0] != together[1]  # the check can fail



@pytest.mark.slow  # ~40 s
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_killing_the_comparison_stops_its_jobs_at_a_checkpoint(tmp_path):
    # gspo compare --jobs 2 SIGKILLed while both runs train: before, the two jobs trained on for all their
    # steps, orphaned, each holding its run directory's lock (the next gspo compare on it was refused). Now
    # each is sent SIGTERM: it finishes its step, writes a checkpoint, releases its lock and exits
    out = tmp_path / "cmp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["compare", "--configs", "gspo", "grpo", "--seeds", "0", "--jobs", "2", "--model", "tiny",
            "--eval-size", "8", "--prompts-per-step", "4", "--group-size", "2", "--num-minibatches", "1",
            "--no-progress", "--steps", "400", "--save-every", "1", "--output-dir", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "gspo", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    runs = [out / "runs" / f"{name}-seed0" for name in ("gspo", "grpo")]
    deadline = time.monotonic() + 240
    while not all(ckpt.checkpoint_dirs(r) and ckpt.checkpoint_dirs(r)[-1][0] >= 2 for r in runs):
        assert proc.poll() is None and time.monotonic() < deadline, "the runs did not reach their second checkpoint"
        time.sleep(0.5)
    jobs = _children(proc.pid)
    assert len(jobs) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    while any(map(alive, jobs)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(map(alive, jobs)), "the jobs trained on without their comparison"
    said = proc.stdout.read()
    for run in runs:
        check_no_writer(run)  # the lock is free: raises while a live run holds it
        assert not (run / "summary.json").exists()  # stopped, not finished: 400 steps take minutes
        step, newest = ckpt.checkpoint_dirs(run)[-1]  # trainer_state.pt is written last
        assert (newest / "config.yaml").exists() and step < 400
        assert f"interrupted by SIGTERM after step {step}; checkpoint written" in said
    assert said.count("[compare] the comparison's process is gone") == 2
