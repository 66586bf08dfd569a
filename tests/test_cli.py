"""The command line, as a user runs it: a subprocess smoke run, eval, and one-line errors."""

import json
import os
import subprocess
import sys

import pytest

FAST = ["--prompts-per-step", "4", "--group-size", "4", "--eval-size", "16", "--no-progress"]


def gspo(*args, cwd=None):
    # help text wraps at the terminal's width: pinned to 100 columns (what it is without a terminal),
    # so the checks read the same words under pytest-xdist or in a narrow terminal
    return subprocess.run([sys.executable, "-m", "gspo", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100"}, timeout=300)


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


@pytest.mark.slow  # starts a process
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
    (["eval", "--model", "tiny", "--k", "many"], "--k"),
    (["eval"], "Missing from gspo eval: --model"),
    (["eval", "--model", "/nonexistent"], "no such directory"),
    (["frobnicate"], "unknown command"),
])
def test_bad_input_gives_one_line_and_exit_2(args, expected, tmp_path):
    r = (gspo(*args, "--output-dir", str(tmp_path / "out")) if args[0] == "train" and "--resume" not in args
         else gspo(*args))
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "\n" not in err, err
    assert "Traceback" not in err
    assert expected in err, err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


@pytest.mark.slow  # starts a process
def test_existing_run_directory_is_not_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("precious\n")
    r = gspo("train", "--output-dir", str(run), "--steps", "1")
    assert r.returncode == 2 and "--resume" in r.stderr
    assert (run / "metrics.jsonl").read_text() == "precious\n"


@pytest.fixture(scope="module")
def train_help():
    """`gspo train --help`, run once for the tests that read it."""
    return gspo("train", "--help")


@pytest.mark.slow  # starts a process
def test_help_lists_documented_options(train_help):
    r = train_help
    assert r.returncode == 0
    for flag in ("--algorithm", "--group-size", "--num-minibatches", "--clip-low", "--loss-agg", "--old-logp"):
        assert flag in r.stdout
    assert "Responses" in r.stdout or "Completions sampled per prompt" in r.stdout


@pytest.mark.slow  # starts a process
def test_train_help_is_grouped_with_presets_and_kl(train_help):
    import dataclasses

    from gspo.config import SECTIONS, TrainConfig

    out = train_help.stdout
    names = [f.name for cls, _ in SECTIONS.values() for f in dataclasses.fields(cls)]
    # option names are unique across sections (flags carry no prefix): 107, then vllm-server's 7 and --partial-rollouts,
    # then --cuda-graphs and --malloc-heap (0.4: the decode's CUDA graphs, large tensors from the heap)
    assert len(names) == len(set(names)) == 126
    assert set(TrainConfig().policy.__dataclass_fields__) < set(names)
    sections = [title for _, title in SECTIONS.values()]
    assert [out.index(f"\n{t}:\n") for t in sections] == sorted(out.index(f"\n{t}:\n") for t in sections)
    for name in names:
        assert "--" + name.replace("_", "-") in out
    assert out.index("\nmodel:\n") < out.index("--lora-r") < out.index("\ndata:\n")  # options sit in their section
    for algorithm in ("gspo", "gspo_token", "grpo", "ppo", "cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "cppo",
                      "ctpo"):
        assert f"  {algorithm} " in out
    assert "clip [1 - 0.0003, 1 + 0.0004]" in out and "k1 = -log ρ has an expected gradient of" in out
    # the successors' presets say what they bound: CISPO's IS weight, GMPO's log-ratio, SAPO's gate
    assert "clip [1 - 1, 1 + 0.28]" in out and "log-ratio clip [-0.4, 0.4]" in out
    assert "gate --sapo-tau-pos 1, --sapo-tau-neg 1.05" in out  # SAPO's own options, from its registration
    # the divergence masks and CTPO's band say what their range bounds, with their papers' presets
    assert "TV mask: π - π_old within [-0.15, 0.15]" in out and "KL(π_old‖π) within 0.05 (falling), 0.05" in out
    assert "prefix log-ratio clip [-0.025, 0.05]·t^p" in out
    assert "tiny-moe" in out


@pytest.mark.slow  # starts a process
def test_eval_help_lists_what_eval_uses():
    out = gspo("eval", "--help").stdout
    assert "--k INT" in out and "--model" in out and "--reward" in out
    assert "--lr" not in out and "--num-minibatches" not in out


@pytest.mark.slow  # starts a process
def test_version_and_top_level_help():
    from gspo import __version__

    r = gspo("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"gspo {__version__}"
    assert "PPO" in gspo("--help").stdout
    # one source: pyproject.toml takes the version from gspo/__init__.py, and the installed
    # package says the same (an editable install is made again by scripts/setup.sh)
    import importlib.metadata
    from pathlib import Path

    import tomllib

    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and meta["project"]["dynamic"] == ["version"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gspo.__version__"}
    assert importlib.metadata.version("gspo") == __version__


@pytest.mark.slow
def test_eval_of_a_run_directory_uses_the_run(tmp_path):
    # a dataset run with 6 new tokens; `gspo eval RUN_DIR` evaluates its newest checkpoint with
    # the run's data, rewards and 6 new tokens (it used to fall back to 256 and the built-in task)
    import sys as _sys

    _sys.path.insert(0, os.path.dirname(__file__))
    from conftest import build_chat_model

    build_chat_model(tmp_path / "m")
    rows = [{"messages": [{"role": "user", "content": f"{i}+1?"}], "solution": str(i + 1)} for i in range(30)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    r = gspo("train", *FAST, "--steps", "1", "--model", str(tmp_path / "m"), "--dataset", str(tmp_path / "d.jsonl"),
             "--prompt-column", "messages", "--answer-column", "solution", "--max-new-tokens", "6",
             "--output-dir", str(run))
    assert r.returncode == 0, r.stderr
    r = gspo("eval", "--model", str(run), "--k", "0")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["model"].endswith("checkpoints/step-000001") and res["max_new_tokens"] == 6
    assert res["task"] == str(tmp_path / "d.jsonl") and res["metric"] == "exact_match" and res["n"] == 3


def test_graded_first_reward_is_named_not_called_accuracy(capsys):
    from gspo.cli import _print_summary

    ev = {"accuracy": 0.25, "n": 10, "metric": "digit_credit", "binary": False}
    _print_summary({"algorithm": "gspo", "task": "t", "steps": 2, "wall_seconds": 3, "eval_before": ev,
                    "eval_after": {**ev, "accuracy": 0.5}})
    out = capsys.readouterr().out
    assert "held-out greedy mean digit_credit 0.25 -> 0.5 (+0.25)" in out and "accuracy" not in out


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("args,expected", [
    (["--min-new-tokens", "10"], "min_new_tokens: must be <= max_new_tokens, 8 (the task value) (got 10)"),
    (["--max-new-tokens", "60"], "max_new_tokens: prompts of up to 8 tokens + 60 new tokens exceed the model's "
                                 "max_position_embeddings (64)"),
    (["--device", "mps"], "Apple's MPS is not available"),
    (["--top-k", "-1"], "top_k: must be >= 0"),
])
def test_silent_misbehaviour_is_now_a_one_line_error(args, expected, tmp_path):
    r = gspo("train", *FAST, "--steps", "1", *args, "--output-dir", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert expected in r.stderr and not (tmp_path / "out").exists()


def test_missing_optional_dependencies_are_one_line(tmp_path, monkeypatch, capsys):
    from gspo.cli import main

    monkeypatch.setitem(sys.modules, "peft", None)
    assert main(["train", *FAST, "--steps", "1", "--lora-r", "4", "--output-dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gspo train: error: --lora-r needs the peft package: pip install 'gspo[lora]'"]
    assert not (tmp_path / "a").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    assert main(["plot", str(run), "--metrics", "reward/mean", "--output", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err.strip() == "gspo plot: error: plotting needs matplotlib: pip install 'gspo[plot]'"


@pytest.mark.slow
def test_wandb_that_cannot_start_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    import wandb

    from gspo.cli import main

    def no_key(*a, **k):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", no_key)
    code = main(["train", *FAST, "--steps", "1", "--report-to", "wandb", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--report-to wandb: W&B did not start (UsageError: api_key" in err[0]
    assert "WANDB_MODE=offline" in err[0] and not (tmp_path / "run").exists()  # the same command can run again


@pytest.mark.slow
def test_no_evaluation_with_eval_size_0(tmp_path):
    r = gspo("train", *FAST[:-3], "--no-progress", "--eval-size", "0", "--steps", "2",
             "--output-dir", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert "2 steps in" in r.stdout and "no evaluation" in r.stdout
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["eval_after"] == {"accuracy": None, "reward": None, "n": 0}


def test_plot_does_not_smooth_evaluations_and_checks_metrics(tmp_path, monkeypatch):
    import matplotlib.axes

    from gspo.lab.plot import PlotError, plot_runs

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "reward/mean": float(s % 2), "clip/frac": 0.0, **({"eval/accuracy": 0.1 * s} if s % 5 == 0
                                                                          else {})} for s in range(1, 21)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"evals": [{"step": 0, "accuracy": 0.0},
                                                            {"step": 20, "accuracy": 2.0}]}))
    drawn, notes = {}, []
    real_plot, real_text = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.text

    def plot(ax, xs, ys, **kw):
        drawn.setdefault(ax.get_ylabel() or len(drawn), []).append((list(xs), list(ys), ax))
        return real_plot(ax, xs, ys, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    monkeypatch.setattr(matplotlib.axes.Axes, "text", lambda ax, *a, **k: notes.append(a[2]) or real_text(ax, *a, **k))
    plot_runs([run], ["eval/accuracy", "reward/mean", "clip/frac"], tmp_path / "p.png", smooth_n=5)
    (xs_e, ys_e, _), (xs_r, ys_r, ax), _ = [v[0] for v in drawn.values()]
    assert xs_e == [0, 5, 10, 15, 20] and ys_e == [0.0, 0.5, 1.0, 1.5, 2.0]  # as logged: the final 2.0 stays 2.0
    assert ys_r[-1] == pytest.approx(0.4)  # the training metric is smoothed: mean of steps 16..20 = 2/5
    assert notes == ["all values are 0: nothing to draw on a log scale"]
    assert ax.xaxis.get_major_locator()._integer
    with pytest.raises(PlotError, match="--metrics: reward/meen not logged by these runs; available: .*reward/mean"):
        plot_runs([run], ["reward/meen"], tmp_path / "q.png")
