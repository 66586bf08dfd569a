"""Error bars (gspo.lab.stats) by hand, and `gspo compare`'s compare.json and report.md carrying them.

The report is tested on run directories written here with known accuracies (gspo.lab.compare's
summarise and aggregate read them, gspo.lab.report writes the report): no training. The simulations
are seeded (numpy's default_rng), so their figures are the same on every run."""

import json
import math

import numpy as np
import pytest

from gspo.lab.stats import ci95, eval_noise, outside_noise, paired_ci95, t975


def _t_pdf(t, df):
    """Student's t density, for the table's rounding bound below."""
    return math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
                    - (df + 1) / 2 * math.log1p(t * t / df))


def test_incomplete_beta_against_closed_forms():
    from gspo.lab.stats import betainc

    # I_x(a, 1) = x^a: 0.3^2.5 = 0.0492950; I_x(1, b) = 1 - (1 - x)^b: 1 - 0.8^3 = 0.488
    assert betainc(2.5, 1, 0.3) == pytest.approx(0.3 ** 2.5, rel=1e-12)
    assert betainc(1, 3, 0.2) == pytest.approx(0.488, rel=1e-12)
    # I_x(2, 2) = x^2 (3 - 2x): 0.16 * 2.2 = 0.352 (both sides of the continued fraction's switch)
    assert betainc(2, 2, 0.4) == pytest.approx(0.352, rel=1e-12)
    assert betainc(2, 2, 0.9) == pytest.approx(0.81 * 1.2, rel=1e-12)
    assert betainc(7.5, 7.5, 0.5) == pytest.approx(0.5, rel=1e-12)  # symmetric
    assert (betainc(3, 4, 0.0), betainc(3, 4, 1.0)) == (0.0, 1.0)
    with pytest.raises(ValueError):
        betainc(0, 1, 0.5)


def test_student_t_cdf_against_closed_forms_and_the_table():
    from gspo.lab.stats import T975, t_cdf, t_quantile, t_sf2

    for t in (-3.0, -0.5, 0.0, 0.7, 2.0, 4.303, 25.0):
        # df = 1 (Cauchy): 1/2 + atan(t)/pi; df = 2: 1/2 + t / (2 sqrt(2 + t^2))
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, rel=1e-12, abs=1e-15)
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), rel=1e-12, abs=1e-15)
        # df = 3: 1/2 + (1/pi) (t/sqrt3 / (1 + t^2/3) + atan(t/sqrt3))
        u = t / math.sqrt(3)
        assert t_cdf(t, 3) == pytest.approx(0.5 + (u / (1 + u * u) + math.atan(u)) / math.pi, rel=1e-12, abs=1e-15)
    # the table's t(0.975, df) give 0.975, to its 3 decimals: |F(t) - 0.975| <= 0.0005 x the density there
    for df, t in enumerate(T975, start=1):
        assert abs(t_cdf(t, df) - 0.975) <= 0.0005 * _t_pdf(t, df) * 1.0001, df
    # the two-sided p of t = 3 on 2 df: 1 - 3/sqrt(11) = 0.0954660; an infinite df is the normal's
    assert t_sf2(3.0, 2) == pytest.approx(1 - 3 / math.sqrt(11), rel=1e-12)
    assert t_sf2(1.959964, math.inf) == pytest.approx(0.05, rel=1e-6)
    assert t_sf2(1.959964, 1e6) == pytest.approx(0.05, rel=1e-5)  # within 1e-5 of the normal there
    # quantiles: df = 1: tan(0.475 pi) = 12.7062047; df = 2: 0.95 sqrt2 / sqrt(1 - 0.95^2) = 4.3026527
    assert t_quantile(0.975, 1) == pytest.approx(12.7062047, rel=1e-8)
    assert t_quantile(0.975, 2) == pytest.approx(4.30265273, rel=1e-8)
    assert t_quantile(0.025, 2) == pytest.approx(-4.30265273, rel=1e-8)
    assert t_quantile(0.975, math.inf) == pytest.approx(1.959964, rel=1e-6)
    for df in (1.5, 6.78, 40, 1580.8):  # fractional df invert too
        assert t_cdf(t_quantile(0.975, df), df) == pytest.approx(0.975, rel=1e-12)


def test_t_quantiles_from_the_table_and_beyond():
    assert (t975(1), t975(2), t975(30)) == (12.706, 4.303, 2.042)
    # past the table (and at a fractional df) the exact quantile: 2.0210754 at df = 40 (the table's
    # 2.021), 1.9623391 at 1000, 1.959964 at infinity
    assert t975(40) == pytest.approx(2.0210754, rel=1e-7)
    assert t975(1000) == pytest.approx(1.9623391, rel=1e-7)
    assert t975(math.inf) == pytest.approx(1.959964, rel=1e-6)
    with pytest.raises(ValueError):
        t975(0)


def test_interval_of_three_seeds_by_hand():
    # mean 0.66; deviations -0.04, +0.04, 0: s = sqrt(0.0032 / 2) = 0.04; half-width = t(0.975, 2) * s / sqrt(3)
    # = 4.3026527 * 0.04 / 1.7320508 = 0.0993655 (the exact quantile; the table's 4.303 gives 0.0993736)
    mean, half = ci95([0.62, 0.70, 0.66])
    assert mean == pytest.approx(0.66, abs=1e-12) and half == pytest.approx(0.0993655085, rel=1e-8)
    # None and NaN are left out (a run without a number): the same three values
    assert ci95([0.62, None, 0.70, float("nan"), 0.66]) == (mean, half)
    assert ci95([0.5]) == (0.5, None) and ci95([None]) == (None, None)
    assert ci95([0.5], eval_n=500) == (0.5, None)  # one seed: the seeds' part is unknown, no interval


def test_interval_with_the_held_out_sets_noise_by_hand():
    from gspo.lab.stats import estimate

    # the same accuracies on the same 500 problems: the seeds' part s^2/n = 0.0016/3 = 0.000533333 (2 df),
    # the held-out set's 0.66 * 0.34 / 500 = 0.0004488 (known): each with its own 95% factor, in quadrature,
    # half = sqrt(4.3026527^2 * 0.000533333 + 1.959964^2 * 0.0004488) = sqrt(0.00987350 + 0.00172405)
    # = 0.1076919 (the seeds' alone 0.0993655, the held-out set's alone 0.0415216)
    est = estimate([0.62, 0.70, 0.66], 0.66 * 0.34 / 500)
    assert est.seeds_var == pytest.approx(0.0016 / 3, rel=1e-9) and (est.df, est.known_var) == (2, 0.66 * 0.34 / 500)
    assert est.half == pytest.approx(0.1076919263, rel=1e-8)
    assert ci95([0.62, 0.70, 0.66], eval_n=500) == (pytest.approx(0.66), pytest.approx(0.1076919263, rel=1e-8))
    # its p-value is the level whose interval just reaches 0: p <= 0.05 exactly when the 95% interval excludes 0
    assert est.half_at(1 - est.p) == pytest.approx(0.66, rel=1e-9)
    # seeds that agree exactly (every seed evaluates the same initial model): only the held-out set's
    # noise, on infinite df: 1.959964 * sqrt(0.272 * 0.728 / 500) = 1.959964 * 0.0198996 = 0.0390025
    mean, half = ci95([0.272, 0.272, 0.272], eval_n=500)
    assert half == pytest.approx(1.959964 * math.sqrt(0.272 * 0.728 / 500), rel=1e-6)
    assert ci95([0.272, 0.272, 0.272]) == (pytest.approx(0.272), 0.0)  # without it: an interval of 0


def test_paired_difference_by_hand():
    from gspo.lab.stats import paired_test

    # differences 0.2, 0.2, 0.05: mean 0.15; deviations 0.05, 0.05, -0.1: s = sqrt(0.015 / 2) = 0.0866025;
    # half = 4.3026527 * 0.0866025 / 1.7320508 = 0.2151326: the interval [-0.065, 0.365] holds 0
    mean, half = paired_ci95([0.7, 0.8, 0.6], [0.5, 0.6, 0.55])
    assert mean == pytest.approx(0.15, abs=1e-12) and half == pytest.approx(0.2151326365, rel=1e-8)
    assert outside_noise(mean, half) is False
    # its p-value: t = 0.15 / (0.0866025 / sqrt3) = 3.0 on 2 df, p = 1 - 3/sqrt(11) = 0.0954660
    est = paired_test([0.7, 0.8, 0.6], [0.5, 0.6, 0.55])
    assert (est.n, est.df) == (3, 2) and est.p == pytest.approx(1 - 3 / math.sqrt(11), rel=1e-9)
    # a seed where one run has no accuracy is left out of the pairs
    assert paired_ci95([0.7, None, 0.6], [0.5, 0.6, 0.55])[0] == pytest.approx(0.125, abs=1e-12)
    assert outside_noise(0.3, 0.2) is True and outside_noise(0.3, None) is None
    # with both evaluations' noise, 500 problems each: gspo 0.62, 0.70, 0.66 against grpo 0.30, 0.40,
    # 0.35: differences 0.32, 0.30, 0.31 (mean 0.31, s = 0.01: the seeds' part 0.0001/3 = 3.33333e-5);
    # the held-out sets' (0.66 * 0.34 + 0.35 * 0.65) / 500 = 0.4519 / 500 = 0.0009038;
    # half = sqrt(4.3026527^2 * 3.33333e-5 + 1.959964^2 * 0.0009038) = sqrt(0.000617094 + 0.003471911)
    # = 0.0639453 (the seeds' alone: 4.3026527 * 0.01 / sqrt3 = 0.0248414). p: the alpha whose interval
    # is 0.31 wide, a^2 * 3.33333e-5 + z(alpha)^2 * 0.0009038 = 0.31^2 with alpha = P(|T_2| > a):
    # a = 50.42144, alpha = 0.000393109 (mpmath, 30 digits)
    est = paired_test([0.62, 0.70, 0.66], [0.30, 0.40, 0.35], eval_n=500)
    assert est.half == pytest.approx(0.0639453243, rel=1e-8)
    assert est.p == pytest.approx(0.00039310933, rel=1e-7)


def test_holm_by_hand():
    from gspo.lab.stats import holm

    # sorted 0.01, 0.03, 0.04: 3 x 0.01 = 0.03; 2 x 0.03 = 0.06; 1 x 0.04 = 0.04, raised to the 0.06 before it
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06], rel=1e-12)
    # None is not a test: not counted (m = 3 here) and left None; adjusted p-values stop at 1 (2 x 0.6 = 1.2)
    assert holm([0.02, None, 0.6, 0.7]) == [pytest.approx(0.06), None, 1.0, 1.0]
    assert holm([]) == [] and holm([0.05]) == [0.05]


def test_evaluation_noise_by_hand():
    # 1.959964 * sqrt(0.66 * 0.34 / 500) = 1.959964 * 0.0211849 = 0.0415216
    assert eval_noise(0.66, 500) == pytest.approx(0.0415216, rel=1e-5)
    assert eval_noise(0.5, 100) == pytest.approx(0.0979982, rel=1e-6)  # 1.959964 * 0.05
    assert eval_noise(None, 100) is None and eval_noise(0.5, 0) is None


def _fake_run(run, accuracy: float, clip: float, diverged=False, n=500):
    """A finished run directory as gspo train leaves it, with the figures compare reads."""
    run.mkdir(parents=True)
    evals = [{"step": 0, "accuracy": 0.2, "n": n}, {"step": 2, "accuracy": 0.9 if diverged else accuracy, "n": n}]
    after = {"accuracy": accuracy, "n": n}
    (run / "summary.json").write_text(json.dumps({"evals": evals + [{"step": 3, **after}], "eval_before": evals[0],
                                                  "eval_after": after, "wall_seconds": 10.0}))
    rows = [{"step": s, "reward/mean": 0.5, "clip/frac": clip, "loss/policy": 0.1, "grad_norm": 1.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _report_of(tmp_path, acc: dict, n=500, diverged=()):
    """compare.json and report.md of finished runs with these accuracies (what gspo.lab.compare.compare
    writes after training), through summarise, aggregate and write_report."""
    from gspo.config import TrainConfig
    from gspo.lab.compare import summarise
    from gspo.lab.report import aggregate, write_report

    report = {}
    for name, values in acc.items():
        for seed, a in enumerate(values):
            _fake_run(tmp_path / "runs" / f"{name}-seed{seed}", a, clip=0.01 * (seed + 1),
                      diverged=(name, seed) in diverged, n=n)
        report[name] = aggregate({s: summarise(tmp_path / "runs" / f"{name}-seed{s}") for s in range(len(values))})
    write_report(tmp_path, TrainConfig(steps=3), report, list(range(3)), 60.0)
    return (tmp_path / "report.md").read_text()


def test_compare_json_has_an_interval_for_every_averaged_figure(tmp_path):
    md = _report_of(tmp_path, {"gspo": [0.62, 0.70, 0.66], "grpo": [0.30, 0.40, 0.35]}, diverged={("grpo", 1)})
    saved = json.loads((tmp_path / "compare.json").read_text())
    g = saved["gspo"]
    averaged = [k for k in g if not k.endswith("_ci95") and k not in ("seeds", "diverged", "diverged_count", "judged")]
    assert {"accuracy", "accuracy_best", "clip_frac_mean", "wall_seconds"} <= set(averaged)
    assert all(f"{k}_ci95" in g for k in averaged)
    # the final accuracy's interval holds the 500 problems' binomial noise: 0.1076919 (by hand above)
    assert g["accuracy"] == pytest.approx(0.66) and g["accuracy_ci95"] == pytest.approx(0.1076919263, rel=1e-8)
    # clip/frac 0.01, 0.02, 0.03: mean 0.02, s = 0.01, half = 4.3026527 * 0.01 / 1.7320508 = 0.0248414 (no evaluation)
    assert g["clip_frac_mean_ci95"] == pytest.approx(0.0248413771, rel=1e-8)
    assert g["wall_seconds_ci95"] == 0.0 and g["eval_n"] == 500  # the same for every seed
    # accuracy before training, 0.2 for every seed: the held-out set's noise alone, 1.959964 * sqrt(0.16 / 500)
    assert g["accuracy_before_ci95"] == pytest.approx(1.959964 * math.sqrt(0.2 * 0.8 / 500), rel=1e-6)
    # grpo's seed 1 reached 0.9 and ended at 0.40: more than 10 points below its best, diverged
    assert (saved["grpo"]["diverged"], saved["grpo"]["diverged_count"], g["diverged_count"]) == (True, 1, 0)
    assert "66.0% ± 10.8" in md
    # gspo - grpo, paired: +0.31 ± 0.0639453, p = 0.000393109 (by hand above); one difference, Holm's p is p
    assert ("- gspo - grpo: +31.0 ± 6.4 points of final accuracy (paired over 3 seeds; p = 0.00039, "
            "Holm-adjusted 0.00039): outside the noise.") in md
    assert "**1 difference judged** (final accuracy, paired over the seeds), at a familywise level of 5%" in md
    # one accuracy on 500 problems, at the configurations' mean accuracies 0.66 and 0.35: the larger is
    # 1.959964 * sqrt(0.35 * 0.65 / 500) = 0.0418 (p nearer 0.5)
    assert "that alone is up to ±4.2 points" in md
    # compare.json: under each configuration, the report's family and the differences it is the first term of
    judged = g["judged"]
    assert (judged["method"], judged["level"], judged["judged"], judged["outside"]) == ("holm", 0.05, 1, 1)
    assert saved["grpo"]["judged"] == {**judged, "differences": []}
    (d,) = judged["differences"]
    assert (d["a"], d["b"], d["figure"], d["seeds"], d["eval_n"], d["verdict"]) == (
        "gspo", "grpo", "accuracy", 3, 500, "outside the noise")
    assert d["mean"] == pytest.approx(0.31) and d["ci95"] == pytest.approx(0.0639453243, rel=1e-8)
    assert d["p"] == pytest.approx(0.00039310933, rel=1e-7) and d["p_holm"] == d["p"]
    # without the held-out sets' noise: t = 0.31 / (0.01 / sqrt3) = 53.69 on 2 df, p = 1 - t / sqrt(2 + t^2)
    t = 0.31 / (0.01 / math.sqrt(3))
    assert d["p_seeds"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-6)


def test_report_verdicts_are_corrected_for_every_difference_judged(tmp_path):
    # b = a - (0.03, 0.05, 0.04) seed by seed: mean 0.04, s = 0.01, t = 0.04 / (0.01 / sqrt3) = sqrt48 = 6.9282
    # on 2 df: p = 1 - sqrt48 / sqrt50 = 1 - sqrt(0.96) = 0.0202041. One difference alone, its interval
    # 4.3026527 * 0.01 / sqrt3 = 0.0248 excludes 0: "outside the noise" before the correction. Three
    # configurations make three differences; c - a = (0.1, -0.1, 0): mean 0, p = 1; c - b = (0.13, -0.05,
    # 0.04): mean 0.04, s = 0.09, t = 0.7698, p = 0.5219. Holm: 3 x 0.0202041 = 0.0606123 > 0.05: within.
    # No evaluation noise here (eval_n 0: the runs record no held-out problems), so this is the seeds alone.
    a = [0.80, 0.82, 0.81]
    acc = {"a": a, "b": [x - d for x, d in zip(a, (0.03, 0.05, 0.04))], "c": [x + d for x, d in zip(a, (0.1, -0.1, 0))]}
    md = _report_of(tmp_path, acc, n=0)
    assert "- a - b: +4.0 ± 2.5 points of final accuracy (paired over 3 seeds" in md
    # the smallest difference it could see (gspo.lab.power): the per-seed spreads 0.01, 0.1 and 0.09 pooled,
    # sqrt((0.0001 + 0.01 + 0.0081) / 3) = 0.0779, at 3 seeds, Holm over 3: 44.1 points
    assert ("- a - b: +4.0 ± 2.5 points of final accuracy (paired over 3 seeds; p = 0.02, Holm-adjusted 0.061): "
            "within the noise (the smallest difference it could see: 44.1).") in md  # before the correction:
    # "(paired over 3 seeds): outside the noise."
    assert "**3 differences judged**" in md and "**0 outside the noise.**" in md
    judged = json.loads((tmp_path / "compare.json").read_text())["a"]["judged"]
    (ab,) = [d for d in judged["differences"] if (d["a"], d["b"]) == ("a", "b")]
    assert ab["p"] == pytest.approx(1 - math.sqrt(0.96), rel=1e-6)
    assert ab["p_holm"] == pytest.approx(3 * (1 - math.sqrt(0.96)), rel=1e-6)
    assert outside_noise(ab["mean"], ab["ci95"]) is True  # the old, per-difference rule
    assert (judged["judged"], judged["outside"], ab["verdict"]) == (3, 0, "within the noise")


def _null_reports(rng, reports: int, pairs: int, seeds: int = 3):
    """Simulated reports with no true effect: `pairs` pairs of configurations (a_i, b_i), each
    seed's final accuracy 0.8 plus normal noise (sd 0.02) drawn independently: every difference's
    true value is 0. No held-out problems recorded (eval_n 0): the seeds' noise alone."""
    noise = rng.normal(0.0, 0.02, size=(reports, pairs, 2, seeds))
    for r in range(reports):
        yield {f"{side}{i}": {"seeds": {str(s): {"accuracy": 0.8 + float(noise[r, i, j, s]), "wall_seconds": float(s)}
                                        for s in range(seeds)}}
               for i in range(pairs) for j, side in enumerate("ab")}


@pytest.mark.slow  # 9 s
def test_simulated_null_reports_mark_few_differences_after_the_correction():
    """54 paired differences on 3 seeds, none real, 2000 simulated reports. The old rule (each
    difference's own 95% interval excludes 0) marks each with probability 0.05: on average
    54 x 0.05 = 2.7 a report, and at least one in 1 - 0.95^54 = 93.7% of reports. Holm's
    correction at 5% marks at least one only when the smallest of the 54 p-values is <= 0.05/54:
    1 - (1 - 0.05/54)^54 = 4.88% of reports (independent differences). Here (seeded): 2.70 a
    report, 93.8%, and 3.85%. Simulation slack, 2000 reports: sd sqrt(0.937 x 0.063 / 2000) =
    0.0054 and sqrt(0.0488 x 0.9512 / 2000) = 0.0048, and the mean count's sd
    sqrt(54 x 0.05 x 0.95 / 2000) = 0.036."""
    from gspo.lab.report import judge

    rng = np.random.default_rng(20260511)
    pairs = [(f"a{i}", f"b{i}") for i in range(54)]
    old_any = new_any = old_marked = judged = 0
    for report in _null_reports(rng, 2000, 54):
        old = sum(bool(outside_noise(*paired_ci95([report[a]["seeds"][s]["accuracy"] for s in "012"],
                                                  [report[b]["seeds"][s]["accuracy"] for s in "012"])))
                  for a, b in pairs)
        verdict = judge(report, pairs)
        judged += verdict["judged"]
        old_marked += old
        old_any += old > 0
        new_any += verdict["outside"] > 0
    assert judged == 2000 * 54
    assert old_marked / 2000 == pytest.approx(2.7, abs=0.15)
    assert 0.91 <= old_any / 2000 <= 0.96  # 1 - 0.95^54 = 0.937
    assert 0.03 <= new_any / 2000 <= 0.065  # 0.0488: at most the familywise 5%, plus 3 sd of slack


def test_simulated_intervals_cover_the_task_accuracy_with_the_held_out_sets_noise():
    """What the held-out set's noise is for. A task whose problems a trained model either solves
    (80% of them) or does not, every seed agreeing but for 2% of problems flipped at random: the
    seeds vary by sqrt(0.02 x 0.98 / 500) = 0.6 points, while which 500 problems were drawn moves
    every seed's accuracy together by sqrt(0.8 x 0.2 / 500) = 1.8 points. The target is the task's
    accuracy, 0.8 x 0.98 + 0.2 x 0.02 = 0.788, and a difference of two such configurations (each on
    its own draw of which problems it solves: independent evaluations) is 0. Over 1000 simulated
    comparisons on 3 seeds, the seeds-only 95% interval covers them far less than 95% of the time;
    with the binomial variance it covers them at least 95% (conservatively: the bound p(1-p)/n
    also counts the flips the seeds already show)."""
    from gspo.lab.stats import paired_test

    rng = np.random.default_rng(7)
    n, reps = 500, 1000
    cover = {"seeds": [0, 0], "held-out": [0, 0]}
    for _ in range(reps):
        acc = []
        for _config in range(2):
            solved = rng.binomial(n, 0.8)  # which problems the drawn set lets this configuration solve
            lost, gained = rng.binomial(solved, 0.02, size=3), rng.binomial(n - solved, 0.02, size=3)
            acc.append(list((solved - lost + gained) / n))
        for key, eval_n in (("seeds", None), ("held-out", n)):
            mean, half = ci95(acc[0], eval_n=eval_n)
            cover[key][0] += abs(mean - 0.788) <= half
            diff = paired_test(acc[0], acc[1], eval_n)
            cover[key][1] += abs(diff.mean) <= diff.half
    assert cover["seeds"][0] / reps < 0.8 and cover["seeds"][1] / reps < 0.8
    assert cover["held-out"][0] / reps >= 0.95 and cover["held-out"][1] / reps >= 0.95


def test_the_held_out_noise_is_added_conservatively_down_to_holms_levels():
    """Why the two parts of the variance are added each with its own factor, not as one variance
    on Welch-Satterthwaite's degrees of freedom. Null differences on 3 seeds, the seeds' part of
    the mean's variance 1/3 (normal, sd 1 a seed) and a known part r/3 (normal: the held-out set's
    draw, common to the seeds), r = 0.1, 1, 10; 20000 simulated differences each. The interval
    sqrt(t^2 s^2/n + z^2 v) misses 0 at most as often as its level says, down to the 0.1% that
    Holm's step-down asks of the smallest p-values (slack: 3 sd of 20000 draws). Satterthwaite's
    df = 2 (1 + v/(s^2/n))^2 grows exactly when s^2 is small by chance, which is when |t| is large:
    at r = 0.1 it calls 2% or more of null differences significant at 1%."""
    from gspo.lab.stats import Estimate, t_sf2

    rng = np.random.default_rng(3)
    draws = 20000
    for r in (0.1, 1.0, 10.0):
        known = r / 3
        x = rng.normal(0.0, 1.0, size=(draws, 3)) + rng.normal(0.0, math.sqrt(known), size=(draws, 1))
        means, seeds_var = x.mean(1), x.var(1, ddof=1) / 3
        for level in (0.95, 0.99, 0.999):
            missed = sum(abs(m) > Estimate(float(m), float(v), known, 3).half_at(level)
                         for m, v in zip(means, seeds_var)) / draws
            alpha = 1 - level
            assert missed <= alpha + 3 * math.sqrt(alpha * level / draws), (r, level, missed)
        if r == 0.1:
            total = seeds_var + known
            satterthwaite = [t_sf2(float(m / math.sqrt(v)), float(2 * (v / s) ** 2)) for m, v, s in
                             zip(means, total, seeds_var)]
            assert sum(p <= 0.01 for p in satterthwaite) / draws >= 0.02
