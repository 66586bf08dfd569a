"""MoE and §5.4 features in real training steps, and `gspo compare`."""

import json
import os
import subprocess
import sys

import pytest

from gspo.cli import main
from gspo.config import TrainConfig
from gspo.train.resolve import resolve
from gspo.train.run import build_run
from gspo.train.trainer import train_step
from tests.test_moe import tiny_moe


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A random tiny Qwen3-MoE with the character tokenizer, saved like a user's model."""
    from gspo.models.tiny import build_char_tokenizer

    d = tmp_path_factory.mktemp("moe")
    tok = build_char_tokenizer()
    tiny_moe("qwen3_moe", vocab=len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def run_steps(model: str, steps: int = 2, **kw):
    cfg = resolve(TrainConfig(model=model, prompts_per_step=4, group_size=4, output_dir="-", progress=False, **kw))
    run = build_run(cfg)
    return [train_step(run, step)[0] for step in range(1, steps + 1)]


DETERMINISTIC = ("reward/mean", "loss/policy", "clip/frac", "ratio/mean", "ratio/min", "ratio/max", "kl/old_new",
                 "grad_norm")


@pytest.mark.parametrize("model", ["tiny", "moe"])
def test_old_logp_sampling_equals_recompute_in_fp32(model, moe_dir):
    path = str(moe_dir) if model == "moe" else "tiny"
    a = run_steps(path, old_logp="recompute", lr=1e-3)
    b = run_steps(path, old_logp="sampling", lr=1e-3)
    assert a[0]["mismatch/token_abs"] < 1e-5  # fp32: sampling and training log-probs agree
    for ma, mb in zip(a, b):
        for k in DETERMINISTIC:
            assert ma[k] == pytest.approx(mb[k], rel=1e-5, abs=1e-6), k
        if model == "moe":
            assert ma["moe/drift"] == pytest.approx(mb["moe/drift"], abs=1e-6)


@pytest.mark.slow  # trains
def test_drift_zero_under_replay_positive_without(moe_dir):
    # a large learning rate moves the routers within a step: the updates after the first
    # minibatch see other experts than the old policy chose. The length reward varies within
    # every group even for a random model, so every step has a gradient.
    kw = dict(lr=3e-2, steps=2, reward=("length",))
    free = run_steps(str(moe_dir), **kw)
    assert free[1]["moe/drift"] > 0
    assert free[1]["moe/drift_in_ratio"] == free[1]["moe/drift"]  # without replay the ratio uses what the router picks
    replay = run_steps(str(moe_dir), **kw, routing_replay=True)
    assert all(m["moe/drift_in_ratio"] == 0.0 for m in replay)  # the ratio sees the old experts exactly
    assert replay[1]["moe/drift"] > 0  # while the router itself has moved
    # replay with routing recorded in a recomputation pass, too (the default records it while sampling)
    replay_r = run_steps(str(moe_dir), **kw, routing_replay=True, old_logp="recompute")
    assert all(m["moe/drift_in_ratio"] == 0.0 for m in replay_r)


def test_router_aux_loss_is_logged_and_trains(moe_dir):
    m = run_steps(str(moe_dir), steps=1, router_aux_loss_coef=0.01)
    assert m[0]["moe/aux_loss"] >= 1.0 - 1e-3  # E·Σ f P >= 1, equality only when balanced


@pytest.mark.slow  # trains
def test_rollout_in_bfloat16_shows_a_precision_gap():
    m = run_steps("tiny", steps=1, rollout_dtype="bfloat16")[0]
    # sampled in bf16, recomputed in fp32: token log-probs differ ...
    assert m["mismatch/token_abs"] > 1e-4
    # ... and the length-normalised sequence log-ratio is an average of the same errors, so
    # |mean| <= mean |.|: sequence-level ratios see at most the token-level gap
    assert m["mismatch/seq_log_ratio"] <= m["mismatch/token_abs"] + 1e-9


def test_moe_options_on_a_dense_model_are_refused(tmp_path, capsys):
    for flag in (["--routing-replay"], ["--router-aux-loss-coef", "0.01"]):
        code = main(["train", "--model", "tiny", *flag, "--output-dir", str(tmp_path / "r")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "not a Mixture-of-Experts model" in err and "\n" not in err
        assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_compare_smoke(moe_dir, tmp_path):
    out = tmp_path / "cmp"
    r = subprocess.run([sys.executable, "-m", "gspo", "compare", "--configs", "gspo", "grpo", "grpo-rr",
                        "lowlr:algorithm=grpo,lr=1e-5", "tis:rollout_dtype=bfloat16,rollout_is=token", "--steps", "2",
                        "--model", str(moe_dir), "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8",
                        "--eval-every", "1", "--no-progress",
                        "--output-dir", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "compare.json").read_text())
    assert set(report) == {"gspo", "grpo", "grpo-rr", "lowlr", "tis"}
    # a bf16 sampler with recomputed old log-probs logs its gap; the fp32 sampler reuses its own (no gap logged)
    assert report["tis"]["mismatch_mean"] > 0 and report["gspo"]["mismatch_mean"] is None
    assert (out / "mismatch.png").read_bytes()[:4] == b"\x89PNG" and "mismatch.png" in (out / "report.md").read_text()
    for _name, v in report.items():
        assert {"accuracy", "clip_frac_mean", "drift_mean", "diverged"} <= set(v)
        assert 0 <= v["accuracy"] <= 1 and v["drift_mean"] is not None
    assert report["grpo-rr"]["drift_in_ratio_mean"] == 0.0
    for png in ("reward_accuracy.png", "clip_fraction.png", "drift.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    md = (out / "report.md").read_text()
    assert "| grpo-rr |" in md and "clip_fraction.png" in md
    cfg = (out / "runs" / "lowlr-seed0" / "config.yaml").read_text()
    assert "lr: 1.0e-05" in cfg and "algorithm: grpo" in cfg
    # run again with the same directory and options: finished runs are reused, the report rewritten
    r = subprocess.run([sys.executable, "-m", "gspo", "compare", "--configs", "gspo", "--steps", "2", "--model",
                        str(moe_dir), "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8",
                        "--eval-every", "1", "--no-progress", "--output-dir", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "already done" in r.stdout


@pytest.mark.parametrize("spec,msg", [
    ("nope", "unknown configuration 'nope'"),
    ("x:lr", "is not key=value"),
    ("x:bogus=1", "is not key=value"),
    ("x:lr=fast", "expected a number"),
])
def test_compare_bad_configurations(spec, msg, capsys, tmp_path):
    code = main(["compare", "--configs", spec, "--output-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert code == 2 and msg in err, err
    assert not (tmp_path / "c").exists()
