"""A run survives any interruption, any neighbour and any working directory.

Every kill test compares the resumed run with an uninterrupted one: the metrics of every step
(timings aside) and the final weights, bit for bit (CPU, same seed, same thread count).
"""

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gspo.io.files import read_jsonl
from gspo.train import checkpoint as ckpt

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
FAST = ["--prompts-per-step", "4", "--group-size", "4", "--eval-size", "16", "--no-progress"]
ARGS = ["train", *FAST, "--steps", "6", "--save-every", "2", "--keep-checkpoints", "5"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def gspo(*args, popen=False, cwd=None, env=None):
    cmd = [sys.executable, "-m", "gspo", *args]
    e = {**ENV, "PYTHONPATH": str(ROOT), **(env or {})}
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, cwd=cwd)
    return subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=cwd, timeout=600)


def metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_jsonl(run / "metrics.jsonl")]


def weights(run: Path) -> dict:
    return load_file(ckpt.latest_checkpoint(run) / "model.safetensors")


def assert_same_run(a: Path, b: Path):
    assert metrics(a) == metrics(b) and [r["step"] for r in metrics(b)] == list(range(1, 7))
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["eval_before"] == sb["eval_before"] and sa["eval_after"] == sb["eval_after"]
    steps = [r["step"] for r in read_jsonl(b / "samples.jsonl")]
    assert steps == sorted(steps) and set(steps) == set(range(1, 7))  # each step's samples once


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    run = tmp_path_factory.mktemp("full") / "run"
    r = gspo(*ARGS, "--output-dir", str(run))
    assert r.returncode == 0, r.stderr
    return run


def _wait(p, until, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None and not until():
        time.sleep(0.01)
    assert p.poll() is None, p.stderr.read()[-2000:]


@pytest.mark.parametrize("when", ["before_first_checkpoint", "during_checkpoint_write", "after_checkpoint"])
def test_killed_at_any_moment_resumes_to_the_same_run(full, tmp_path, when):
    run = tmp_path / "run"
    rows = lambda: len(read_jsonl(run / "metrics.jsonl"))  # noqa: E731
    env = {"GSPO_TEST_PAUSE_IN_CHECKPOINT": "3"} if when == "during_checkpoint_write" else None
    p = gspo(*ARGS, "--output-dir", str(run), popen=True, env=env)
    if when == "before_first_checkpoint":  # step 1 done, step 2 (the first checkpoint) not yet saved
        _wait(p, lambda: rows() >= 1)
    elif when == "during_checkpoint_write":  # step 4's checkpoint half-written, step 2's complete
        _wait(p, lambda: (run / "checkpoints" / ".tmp-step-000004" / "WRITING").exists())
    else:
        _wait(p, lambda: ckpt.latest_checkpoint(run) is not None and rows() >= 3)
    p.send_signal(signal.SIGKILL)
    p.wait()
    last = ckpt.latest_checkpoint(run)
    assert not (run / "summary.json").exists()
    assert {"before_first_checkpoint": last is None, "during_checkpoint_write": last is not None and last.name ==
            "step-000002", "after_checkpoint": last is not None}[when], (when, last)
    r = gspo("train", "--resume", str(run))
    assert r.returncode == 0, r.stderr
    assert_same_run(full, run)
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_resuming_a_complete_run_says_so_and_changes_nothing(full, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(full, run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    r = gspo("train", "--resume", str(run))
    assert r.returncode == 0 and "the run is complete (6 steps); nothing to do" in r.stdout, r.stdout + r.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    # killed after its last checkpoint but before its summary: resuming evaluates and writes it
    (run / "summary.json").unlink()
    assert gspo("train", "--resume", str(run)).returncode == 0
    assert json.loads((run / "summary.json").read_text())["eval_after"] == \
        json.loads((full / "summary.json").read_text())["eval_after"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_with_a_checkpoint_and_resumes(full, tmp_path, sig):
    run = tmp_path / "run"
    p = gspo(*ARGS, "--output-dir", str(run), popen=True)
    _wait(p, lambda: len(read_jsonl(run / "metrics.jsonl")) >= 1)
    p.send_signal(sig)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 128 + sig, err
    lines = err.strip().splitlines()
    done = len(read_jsonl(run / "metrics.jsonl"))
    assert lines == [f"gspo train: interrupted by {signal.Signals(sig).name} after step {done}; checkpoint written; "
                     f"continue with: gspo train --resume {run}"]
    assert ckpt.latest_checkpoint(run).name == f"step-{done:06d}" and done < 6
    r = gspo("train", "--resume", str(run))
    assert r.returncode == 0, r.stderr
    assert_same_run(full, run)


def test_a_second_ctrl_c_exits_at_once():
    from types import SimpleNamespace

    from gspo.train.lifecycle import Guard

    run = SimpleNamespace(run_dir=Path("/nonexistent/x"), dist=SimpleNamespace(is_main=False, max_int=lambda n: n))
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground shell, whatever runs pytest
    try:
        guard = Guard(run)
        assert signal.getsignal(signal.SIGINT) == guard._handler
        try:
            guard._handler(signal.SIGINT, None)  # the first: noted, the step finishes
            assert guard.signum == signal.SIGINT
            with pytest.raises(KeyboardInterrupt):
                guard._handler(signal.SIGINT, None)  # the second: now
        finally:
            guard.release()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler that was there
    finally:
        signal.signal(signal.SIGINT, before)
    # torchrun relays a second Ctrl-C to its workers as SIGTERM: at once too; two SIGTERMs (a
    # cluster's to every process, and torchrun's relay of it) are one request to stop
    for first, second, at_once in [(signal.SIGINT, signal.SIGTERM, True), (signal.SIGTERM, signal.SIGINT, True),
                                   (signal.SIGTERM, signal.SIGTERM, False)]:
        guard = Guard(run)
        try:
            guard._handler(first, None)
            if at_once:
                with pytest.raises(KeyboardInterrupt):
                    guard._handler(second, None)
            else:
                guard._handler(second, None)
                assert guard.signum == signal.SIGTERM
        finally:
            guard.release()


def test_a_signal_ignored_at_entry_stays_ignored():
    # a shell's `cmd &` starts cmd with SIGINT ignored, so a Ctrl-C meant for the foreground
    # job does not stop it; the run keeps it so, as Python does, and gives back SIG_IGN
    from types import SimpleNamespace

    from gspo.train.lifecycle import Guard

    run = SimpleNamespace(run_dir=Path("/nonexistent/x"), dist=SimpleNamespace(is_main=False, max_int=lambda n: n))
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        guard = Guard(run)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == guard._handler  # SIGTERM was not ignored: caught
        guard.release()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, before)


def test_one_writer_per_run_directory(tmp_path):
    run = tmp_path / "run"
    # a is still running whatever the machine's speed: it only stops when told to (SIGTERM below)
    a = gspo(*ARGS, "--steps", "100000", "--output-dir", str(run), popen=True)
    _wait(a, lambda: (run / "config.yaml").exists())
    b = gspo(*ARGS, "--output-dir", str(run))
    assert b.returncode == 2 and b.stderr.strip().count("\n") == 0
    assert f"{run}: another gspo run is writing it (pid {a.pid})" in b.stderr
    c = gspo("train", "--resume", str(run))  # nor can it be resumed under a's feet
    assert c.returncode == 2 and "another gspo run is writing it" in c.stderr
    assert a.poll() is None  # a was writing the whole time
    a.send_signal(signal.SIGTERM)
    a.communicate(timeout=300)
    assert a.returncode == 128 + signal.SIGTERM
    done = [r["step"] for r in metrics(run)]  # a's steps alone, each once, b and c wrote nothing
    assert done == list(range(1, len(done) + 1)) and ckpt.latest_checkpoint(run).name == f"step-{len(done):06d}"
    # both started at the same moment: one runs, the other is refused
    run2 = tmp_path / "run2"
    ps = [gspo(*ARGS, "--steps", "2", "--output-dir", str(run2), popen=True) for _ in range(2)]
    codes = sorted(p.wait(timeout=300) for p in ps)
    assert codes == [0, 2] and [r["step"] for r in metrics(run2)] == [1, 2]


def test_run_directory_works_from_any_working_directory(tmp_path):
    # relative paths for the data, the reward file, the model and the run; LoRA
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    shutil.copy(ROOT / "examples" / "arithmetic.jsonl", a / "data.jsonl")
    shutil.copy(ROOT / "examples" / "rewards.py", a / "rewards.py")
    shutil.copytree(ROOT / "gspo" / "assets" / "tiny", a / "model")
    args = ["train", *FAST, "--dataset", "data.jsonl", "--prompt-column", "question", "--reward", "exact_match",
            "--reward", "rewards.py:digit_credit", "--model", "model", "--lora-r", "4", "--output-dir", "run"]
    assert gspo(*args, "--steps", "2", cwd=a).returncode == 0
    saved = (a / "run" / "config.yaml").read_text()
    assert f"dataset: {a / 'data.jsonl'}" in saved and f"{a / 'rewards.py'}:digit_credit" in saved
    r = gspo("train", "--resume", str(a / "run"), "--steps", "3", cwd=b)  # elsewhere, and one step more
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in metrics(a / "run")] == [1, 2, 3]
    adapter = json.loads((ckpt.latest_checkpoint(a / "run") / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(a / "model")
    r = gspo("eval", "--model", str(ckpt.latest_checkpoint(a / "run")), "--eval-size", "4", "--k", "0",
             "--no-progress", cwd=b)
    assert r.returncode == 0, r.stderr


def test_resume_changes_only_what_is_safe(tmp_path):
    run, longer = tmp_path / "run", tmp_path / "longer"
    assert gspo(*ARGS, "--steps", "4", "--output-dir", str(run)).returncode == 0
    r = gspo("train", "--resume", str(run), "--lr", "1e-3", "--seed", "1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--resume: --lr, --seed cannot change in a resumed run" in r.stderr and "--steps" in r.stderr
    assert gspo("train", "--resume", str(run), "--steps", "6", "--threads", "1").returncode == 0
    assert gspo(*ARGS, "--output-dir", str(longer)).returncode == 0  # 6 steps at once (constant LR)
    assert metrics(run) == metrics(longer)
    wa, wb = weights(run), weights(longer)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    from gspo.cli import main

    real = torch.save

    def full_at_step_4(obj, path, *a, **k):
        if "step-000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full_at_step_4)
    run = tmp_path / "run"
    code = main([*ARGS[:-4], "--steps", "6", "--save-every", "2", "--output-dir", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "step-000004: cannot write the checkpoint (No space left on device); the previous one, step-000002, " \
           "is intact" in err[0]
    assert [d.name for _, d in ckpt.checkpoint_dirs(run)] == ["step-000002"]
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the half-written one is gone
    monkeypatch.setattr(ckpt.torch, "save", real)
    assert main(["train", "--resume", str(run)]) == 0  # and the run goes on from step 2


def test_unwritable_output_dir_is_one_line(tmp_path, capsys):
    from gspo.cli import main

    (tmp_path / "a-file").write_text("x")
    code = main(["train", *FAST, "--steps", "1", "--output-dir", str(tmp_path / "a-file" / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "a-file/run" in err[0]


def test_a_false_start_leaves_nothing_behind(tmp_path):
    run = tmp_path / "run"
    (tmp_path / "r.py").write_text("def boom(completions, **kw):\n    raise RuntimeError('no grader')\n")
    r = gspo("train", *FAST, "--steps", "2", "--reward", f"{tmp_path / 'r.py'}:boom", "--output-dir", str(run))
    assert r.returncode == 2 and "reward 'boom' raised RuntimeError: no grader" in r.stderr
    assert not run.exists()  # the same command (with a working reward) can run again
    assert gspo("train", *FAST, "--steps", "1", "--output-dir", str(run)).returncode == 0


def test_a_checkpoint_written_by_gspo_0_2_loads_its_pending_batches(tmp_path):
    # tests/data/trainer_state-0.2.0.pt is step 1's trainer state of a run of gspo 0.2.0 (the flat
    # package, commit 32ecf23): `gspo train --steps 2 --save-every 1 --max-staleness 1
    # --prompts-per-step 4 --group-size 4 --eval-size 0 --threads 1`. Its batch 2, sampled by
    # version 0 and not yet trained, was pickled as gspo.produce.Produced (with a
    # gspo.sequences.Rollout, gspo.scoring.Scored, gspo.data.Example): 0.3 finds each in its room
    # (resumed, such a run went on to the same step-2 metrics as the uninterrupted 0.2 run)
    shutil.copy(Path(__file__).parent / "data" / "trainer_state-0.2.0.pt", tmp_path / "trainer_state.pt")
    with pytest.raises(ModuleNotFoundError, match="gspo.produce"):  # what a plain unpickler makes of it
        torch.load(tmp_path / "trainer_state.pt", map_location="cpu", weights_only=False)
    from gspo.models.sequences import Rollout
    from gspo.sampling.produce import Produced

    state = ckpt.load_trainer_state(tmp_path)
    (batch,) = state["pending_per_rank"][0]
    assert type(batch) is Produced and type(batch.rollout) is Rollout
    assert (batch.step, batch.version, state["step"]) == (2, 0, 1)
    assert batch.rollout.completion_ids.shape[0] == 16  # 4 prompts x 4 completions


def test_a_checkpoint_finds_the_processes_room_under_its_old_names():
    # gspo 0.2's gspo.distributed and 0.3's gspo.dist.distributed are gspo.processes.distributed now
    from gspo.processes.distributed import Dist

    for old in ("gspo.distributed", "gspo.dist.distributed"):
        assert ckpt._Unpickler(io.BytesIO()).find_class(old, "Dist") is Dist, old
