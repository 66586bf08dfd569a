"""`gspo compare --preset staleness` and `--preset precision` (gspo.studies) at toy size, end to end,
and the study's expansion, levels and noise pairs."""

import json

import pytest

from gspo.cli import main
from gspo.config import ConfigError
from gspo.studies import PRECISION, STALENESS, Study, levels_arg

TOY = ["--prompts-per-step", "2", "--group-size", "2", "--num-minibatches", "1", "--eval-size", "4",
       "--max-new-tokens", "6", "--no-progress"]


def test_a_study_is_every_configuration_at_every_level():
    study = Study(STALENESS, (0, 2), (("gspo", {"algorithm": "gspo"}), ("cispo", {"algorithm": "cispo", "lr": 1e-5})))
    assert study.expand() == [
        ("gspo@K0", {"algorithm": "gspo", "max_staleness": 0}), ("gspo@K2", {"algorithm": "gspo", "max_staleness": 2}),
        ("cispo@K0", {"algorithm": "cispo", "lr": 1e-5, "max_staleness": 0}),
        ("cispo@K2", {"algorithm": "cispo", "lr": 1e-5, "max_staleness": 2})]
    # each lag against K = 0 within a loss; each loss against the first at every lag
    assert study.pairs() == [("gspo@K2", "gspo@K0"), ("cispo@K2", "cispo@K0"),
                             ("cispo@K0", "gspo@K0"), ("cispo@K2", "gspo@K2")]
    p = Study(PRECISION, ("float32", "float16"), (("grpo", {"algorithm": "grpo"}),))
    assert [n for n, _ in p.expand()] == ["grpo@fp32", "grpo@fp16"]
    # fp32 master weights, the sampler a copy in the same dtype, pi_old recomputed (so the gap is measured)
    assert p.expand()[1][1] == {"algorithm": "grpo", "dtype": "float16", "param_dtype": "float32",
                                "rollout_dtype": "same", "old_logp": "recompute"}
    # a configuration's own options win over the study's fixed ones; the factor itself it cannot set
    mine = Study(PRECISION, ("bfloat16",), (("x", {"algorithm": "gspo", "rollout_dtype": "float32"}),))
    assert mine.expand()[0][1]["rollout_dtype"] == "float32"
    with pytest.raises(ConfigError, match="--max-staleness is the factor this study varies"):
        Study(STALENESS, (0,), (("y", {"max_staleness": 4}),)).expand()


@pytest.mark.parametrize("axis,values,msg", [
    (STALENESS, ["2", "x"], "--lags: expected int values, got 2 x"),
    (STALENESS, ["0", "-1"], "--lags: each must be >= 0"),
    (STALENESS, ["2", "2"], "--lags: expected distinct values"),
    (PRECISION, ["float32", "fp8"], "--precisions: each must be one of float32, bfloat16, float16, got float32 fp8"),
])
def test_bad_levels_are_refused_in_one_line(axis, values, msg):
    with pytest.raises(ConfigError) as e:
        levels_arg(axis, values)
    assert str(e.value) == msg or str(e.value).startswith(msg)


def test_level_flags_belong_to_their_preset(tmp_path, capsys):
    assert main(["compare", "--lags", "0", "2", "--output-dir", str(tmp_path / "c")]) == 2
    assert "--lags: only with --preset staleness" in capsys.readouterr().err
    assert main(["compare", "--preset", "staleness", "--precisions", "float16", "--output-dir",
                 str(tmp_path / "c")]) == 2
    assert "--precisions: only with --preset precision" in capsys.readouterr().err
    assert main(["compare", "--preset", "staleness", "--lags", "1", "one", "--output-dir", str(tmp_path / "c")]) == 2
    assert "--lags: expected int values, got 1 one" in capsys.readouterr().err
    assert main(["compare", "--preset", "precision", "--dtype", "bfloat16", "--output-dir", str(tmp_path / "c")]) == 2
    assert "--dtype: the precision study varies it; choose its values with --precisions" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_staleness_preset_end_to_end(tmp_path, capsys):
    out = tmp_path / "st"
    code = main(["compare", "--preset", "staleness", "--configs", "gspo", "gspo-behaviour", "--lags", "0", "2",
                 "--seeds", "0", "1", "--steps", "3", "--eval-every", "3", *TOY, "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "compare.json").read_text())
    assert set(report) == {"gspo@K0", "gspo@K2", "gspo-behaviour@K0", "gspo-behaviour@K2"}
    # K = 2 over 3 steps: batch t sampled by version max(0, t-3), trained by t-1: staleness 0, 1, 2, mean 1
    for name in ("gspo@K2", "gspo-behaviour@K2"):
        assert report[name]["staleness_mean"] == 1.0 and report[name]["staleness_mean_ci95"] == 0.0
    assert report["gspo@K0"]["staleness_mean"] == 0.0
    cfg = (out / "runs" / "gspo-behaviour@K2-seed1" / "config.yaml").read_text()
    assert "max_staleness: 2" in cfg and "old_logp: sampling" in cfg and "model: tiny-moe" in cfg
    assert "old_logp: recompute" in (out / "runs" / "gspo@K2-seed1" / "config.yaml").read_text()  # auto: proximal
    # at K = 0 both anchors are the sampling pass: one run, linked, not trained twice
    assert (out / "runs" / "gspo-behaviour@K0-seed0").resolve() == (out / "runs" / "gspo@K0-seed0").resolve()
    assert report["gspo-behaviour@K0"]["accuracy"] == report["gspo@K0"]["accuracy"]
    # the recomputed (proximal) anchor logs the behaviour/proximal gap; the behaviour anchor has none to log
    assert report["gspo@K2"]["mismatch_seq_mean"] > 0 and report["gspo-behaviour@K2"]["mismatch_seq_mean"] is None
    study = json.loads((out / "study.json").read_text())
    assert study["axis"] == "K" and study["levels"] == [0, 2]
    acc = study["figures"]["accuracy"]["gspo-behaviour"]["K2"]
    assert acc == {"mean": report["gspo-behaviour@K2"]["accuracy"], "ci95": report["gspo-behaviour@K2"]["accuracy_ci95"]}
    md = (out / "report.md").read_text()
    assert "; 6 runs trained in " in md  # 4 configurations x 2 seeds, the 2 linked ones not counted
    assert "## Against K" in md and "| configuration | K0 | K2 |" in md and "**final held-out accuracy**" in md
    assert "- gspo@K2 - gspo@K0: " in md and "- gspo-behaviour@K2 - gspo@K2: " in md
    assert "- gspo@K2 - gspo-behaviour@K0" not in md  # only the study's pairs are judged
    for png in ("accuracy_vs_K.png", "clip_frac_vs_K.png", "seq_log_abs_vs_K.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG" and png in md


def test_precision_preset_end_to_end(tmp_path, capsys):
    out = tmp_path / "pr"
    code = main(["compare", "--preset", "precision", "--configs", "gspo-tis", "--precisions", "float32", "bfloat16",
                 "--seeds", "0", "--steps", "2", "--eval-every", "2", *TOY, "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "compare.json").read_text())
    assert set(report) == {"gspo-tis@fp32", "gspo-tis@bf16"}
    cfg = (out / "runs" / "gspo-tis@bf16-seed0" / "config.yaml").read_text()
    assert "dtype: bfloat16" in cfg and "param_dtype: float32" in cfg and "old_logp: recompute" in cfg
    # the same weights in bf16 (sampler) and under bf16 autocast (trainer) part by far more than fp32's rounding
    fp32, bf16 = report["gspo-tis@fp32"]["mismatch_mean"], report["gspo-tis@bf16"]["mismatch_mean"]
    assert fp32 < 1e-4 < bf16, (fp32, bf16)
    md = (out / "report.md").read_text()
    assert "## Against precision" in md and "| configuration | fp32 | bf16 |" in md
    for png in ("accuracy_vs_precision.png", "mismatch_vs_precision.png", "mismatch_seq_vs_precision.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG" and png in md
