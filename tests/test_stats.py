"""Error bars (gspo.stats) by hand, and `gspo compare`'s compare.json and report.md carrying them.

compare() reuses a finished run (its summary.json), so the comparison is tested on run
directories written here with known accuracies: no training."""

import json
import math

import pytest

from gspo.stats import ci95, eval_noise, outside_noise, paired_ci95, t975


def test_t_quantiles_from_the_table_and_beyond():
    assert (t975(1), t975(2), t975(30)) == (12.706, 4.303, 2.042)
    # df = 40, the expansion: z = 1.959964; z + (z^3 + z)/160 + (5 z^5 + 16 z^3 + 3 z)/153600
    # = 1.959964 + 0.060258 + 0.001762 = 2.02198 (the table's 2.021)
    assert t975(40) == pytest.approx(2.0210, abs=1.5e-3)
    assert t975(1000) == pytest.approx(1.9623, abs=1e-3)
    with pytest.raises(ValueError):
        t975(0)


def test_interval_of_three_seeds_by_hand():
    # mean 0.66; deviations -0.04, +0.04, 0: s = sqrt(0.0032 / 2) = 0.04;
    # half-width = t(0.975, 2) * s / sqrt(3) = 4.303 * 0.04 / 1.7320508 = 0.0993736
    mean, half = ci95([0.62, 0.70, 0.66])
    assert mean == pytest.approx(0.66, abs=1e-12) and half == pytest.approx(0.0993736, abs=1e-6)
    # None and NaN are left out (a run without a number): the same three values
    assert ci95([0.62, None, 0.70, float("nan"), 0.66]) == (mean, half)
    assert ci95([0.5]) == (0.5, None) and ci95([None]) == (None, None)


def test_paired_difference_by_hand():
    # differences 0.2, 0.2, 0.05: mean 0.15; deviations 0.05, 0.05, -0.1: s = sqrt(0.015 / 2) = 0.0866025;
    # half = 4.303 * 0.0866025 / 1.7320508 = 0.21515: the interval [-0.065, 0.365] holds 0
    mean, half = paired_ci95([0.7, 0.8, 0.6], [0.5, 0.6, 0.55])
    assert mean == pytest.approx(0.15, abs=1e-12) and half == pytest.approx(0.21515, abs=1e-5)
    assert outside_noise(mean, half) is False
    # a seed where one run has no accuracy is left out of the pairs
    assert paired_ci95([0.7, None, 0.6], [0.5, 0.6, 0.55])[0] == pytest.approx(0.125, abs=1e-12)
    assert outside_noise(0.3, 0.2) is True and outside_noise(0.3, None) is None


def test_evaluation_noise_by_hand():
    # 1.959964 * sqrt(0.66 * 0.34 / 500) = 1.959964 * 0.0211849 = 0.0415216
    assert eval_noise(0.66, 500) == pytest.approx(0.0415216, abs=1e-6)
    assert eval_noise(0.5, 100) == pytest.approx(0.0979982, abs=1e-6)  # 1.959964 * 0.05
    assert eval_noise(None, 100) is None and eval_noise(0.5, 0) is None


def _fake_run(run, accuracy: float, clip: float, diverged=False):
    """A finished run directory as gspo train leaves it, with the figures compare reads."""
    run.mkdir(parents=True)
    evals = [{"step": 0, "accuracy": 0.2, "n": 500}, {"step": 2, "accuracy": 0.9 if diverged else accuracy, "n": 500}]
    after = {"accuracy": accuracy, "n": 500}
    (run / "summary.json").write_text(json.dumps({"evals": evals + [{"step": 3, **after}], "eval_before": evals[0],
                                                  "eval_after": after, "wall_seconds": 10.0}))
    rows = [{"step": s, "reward/mean": 0.5, "clip/frac": clip, "loss/policy": 0.1, "grad_norm": 1.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_compare_json_has_an_interval_for_every_averaged_figure(tmp_path):
    from gspo.compare import compare
    from gspo.config import TrainConfig

    acc = {"gspo": [0.62, 0.70, 0.66], "grpo": [0.30, 0.40, 0.35]}
    for name, values in acc.items():
        for seed, a in enumerate(values):
            _fake_run(tmp_path / "runs" / f"{name}-seed{seed}", a, clip=0.01 * (seed + 1), diverged=name == "grpo"
                      and seed == 1)
    report = compare(TrainConfig(steps=3), ["gspo", "grpo"], seeds=[0, 1, 2], out_dir=tmp_path, log=lambda *a: None)
    saved = json.loads((tmp_path / "compare.json").read_text())
    g = saved["gspo"]
    averaged = [k for k in g if not k.endswith("_ci95") and k not in ("seeds", "diverged", "diverged_count")]
    assert {"accuracy", "accuracy_best", "clip_frac_mean", "wall_seconds"} <= set(averaged)
    assert all(f"{k}_ci95" in g for k in averaged)
    assert g["accuracy"] == pytest.approx(0.66) and g["accuracy_ci95"] == pytest.approx(0.0993736, abs=1e-6)
    # clip/frac 0.01, 0.02, 0.03: mean 0.02, s = 0.01, half = 4.303 * 0.01 / 1.7320508 = 0.0248434
    assert g["clip_frac_mean_ci95"] == pytest.approx(0.0248434, abs=1e-6)
    assert g["wall_seconds_ci95"] == 0.0 and g["eval_n"] == 500  # the same for every seed
    # grpo's seed 1 reached 0.9 and ended at 0.40: more than 10 points below its best, diverged
    assert (saved["grpo"]["diverged"], saved["grpo"]["diverged_count"], g["diverged_count"]) == (True, 1, 0)
    assert report["gspo"]["accuracy"] == g["accuracy"]
    md = (tmp_path / "report.md").read_text()
    assert "66.0% ± 9.9" in md
    # gspo - grpo per seed: 0.32, 0.30, 0.31: mean 0.31, s = 0.01, half = 0.0248434: outside the noise
    assert "- gspo - grpo: +31.0 ± 2.5 points of final accuracy (paired over 3 seeds): outside the noise." in md
    # one accuracy on 500 problems, at the configurations' mean accuracies 0.66 and 0.35: the larger is
    # 1.959964 * sqrt(0.35 * 0.65 / 500) = 0.0418 (p nearer 0.5)
    worst = max(1.959964 * math.sqrt(p * (1 - p) / 500) for p in (0.66, 0.35))
    assert f"its own 95% interval is up to ±{100 * worst:.1f} points" in md
