"""The command line, as a user runs it: a subprocess smoke run, eval, and one-line errors."""

import json
import os
import subprocess
import sys

import pytest

FAST = ["--prompts-per-step", "4", "--group-size", "4", "--eval-size", "16", "--no-progress"]


def gspo(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "gspo", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


@pytest.mark.slow
def test_train_smoke_then_eval(tmp_path):
    run = tmp_path / "run"
    r = gspo("train", *FAST, "--steps", "2", "--output-dir", str(run), "--algorithm", "grpo")
    assert r.returncode == 0, r.stderr
    assert "held-out greedy accuracy" in r.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["eval_before"]["accuracy"] <= 1.0 and summary["algorithm"] == "grpo"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    cfg = (run / "config.yaml").read_text()
    assert "clip_low: 0.2" in cfg and "clip_high: 0.27" in cfg  # the resolved preset is saved

    r = gspo("eval", "--model", str(run / "checkpoints" / "step-000002"), "--eval-size", "16", "--k", "2")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["n"] == 16 and 0 <= res["accuracy"] <= 1 and 0 <= res["pass@2"] <= 1


@pytest.mark.slow
def test_config_file_and_flags(tmp_path):
    (tmp_path / "run.yaml").write_text("algorithm: gspo_token\nsteps: 1\nclip_high: 0.001\n")
    run = tmp_path / "r"
    r = gspo("train", "--config", str(tmp_path / "run.yaml"), *FAST, "--output-dir", str(run), "--clip-high", "0.002")
    assert r.returncode == 0, r.stderr
    cfg = (run / "config.yaml").read_text()
    assert "algorithm: gspo_token" in cfg and "clip_high: 0.002" in cfg and "steps: 1" in cfg


@pytest.mark.parametrize("args,expected", [
    (["train", "--group-size", "1"], "group_size: must be >= 2"),
    (["train", "--group-size", "four"], "--group-size"),
    (["train", "--clip-low", "-0.1"], "clip_low: must be >= 0"),
    (["train", "--algorithm", "dpo"], "--algorithm"),
    (["train", "--task", "chess"], "task: must be one of"),
    (["train", "--prompts-per-step", "3", "--group-size", "5"], "num_minibatches: must divide"),
    (["train", "--config", "/nonexistent/run.yaml"], "no such config file"),
    (["train", "--model", "/nonexistent/model"], "no such directory"),
    (["train", "--bogus-flag", "1"], "--bogus-flag"),
    (["train", "--resume", "/nonexistent/run"], "/nonexistent/run: not a gspo run directory (no config.yaml)"),
    (["eval", "--k", "many"], "--k: expected an integer"),
    (["eval", "--model", "/nonexistent"], "no such directory"),
    (["frobnicate"], "unknown command"),
])
def test_bad_input_gives_one_line_and_exit_2(args, expected, tmp_path):
    r = gspo(*args, "--output-dir", str(tmp_path / "out")) if args[0] == "train" and "--resume" not in args else gspo(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "\n" not in err, err
    assert "Traceback" not in err
    assert expected in err, err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_existing_run_directory_is_not_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("precious\n")
    r = gspo("train", "--output-dir", str(run), "--steps", "1")
    assert r.returncode == 2 and "--resume" in r.stderr
    assert (run / "metrics.jsonl").read_text() == "precious\n"


def test_help_lists_documented_options():
    r = gspo("train", "--help")
    assert r.returncode == 0
    for flag in ("--algorithm", "--group-size", "--num-minibatches", "--clip-low", "--loss-agg", "--old-logp"):
        assert flag in r.stdout
    assert "Responses" in r.stdout or "Completions sampled per prompt" in r.stdout
