"""Power (gspo.lab.power) by hand and by simulation, every report's minimum detectable difference, and
`gspo compare --plan`.

The simulations draw the reports' own test (gspo.lab.stats.Estimate: reject at level alpha' when
|mean| > sqrt(t² s²/n + z² known_var)) with numpy's seeded default_rng, vectorised: the same figures on
every run."""

import json
import math
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest

from gspo.cli import main
from gspo.lab.power import (
    Costs,
    approximate_mdd,
    floor,
    held_out_var,
    mdd,
    pooled_sd,
    power_at,
    problems_for,
    seeds_for,
    trade,
)
from gspo.lab.stats import Estimate, t_quantile

ROOT = Path(__file__).resolve().parents[1]
N = statistics.NormalDist()


def simulated_power(d, sd, n, judged, known_var, reps=200_000, seed=0):
    """The share of simulated paired differences (true mean d, per-seed spread sd, a shared held-out
    offset of variance known_var) whose p-value reaches 0.05/judged: Estimate's interval rule."""
    rng = np.random.default_rng(seed)
    shared = rng.normal(0.0, math.sqrt(known_var), reps) if known_var else 0.0
    xs = d + shared[:, None] * (known_var > 0) + rng.normal(0.0, sd, (reps, n)) if known_var else \
        d + rng.normal(0.0, sd, (reps, n))
    mean, var = xs.mean(axis=1), xs.var(axis=1, ddof=1) / n
    q = 1 - 0.05 / (2 * judged)
    half = np.sqrt(t_quantile(q, n - 1) ** 2 * var + N.inv_cdf(q) ** 2 * known_var)
    return float(np.mean(np.abs(mean) > half))


def test_the_simulations_rule_is_the_reports_p_value():
    # p <= alpha' exactly when the 1 - alpha' interval excludes 0 (gspo.lab.stats.Estimate): on a few draws
    rng = np.random.default_rng(1)
    for _ in range(20):
        xs = 0.03 + rng.normal(0, 0.02, 3)
        est = Estimate(float(xs.mean()), float(xs.var(ddof=1) / 3), 0.00064, 3)
        q = 1 - 0.05 / 6
        half = math.sqrt(t_quantile(q, 2) ** 2 * est.seeds_var + N.inv_cdf(q) ** 2 * 0.00064)
        assert (est.p <= 0.05 / 3) == (abs(est.mean) > half)


def test_power_by_hand():
    # the held-out part alone (sd = 0): the mean is N(d, kv) and the test |mean| > z sqrt(kv), z = z(1 - 0.05/6)
    # = 2.39398: d = 0.1, kv = 0.00064 (sqrt 0.0252982): P = Phi((0.1 - 0.0605630)/0.0252982) + Phi(-6.3469)
    # = Phi(1.558893) + ~0 = 0.940486
    kv = 2 * 0.16 / 500
    z = N.inv_cdf(1 - 0.05 / 6)
    assert z == pytest.approx(2.39398, abs=1e-5)
    by_hand = N.cdf((0.1 - z * math.sqrt(kv)) / math.sqrt(kv)) + N.cdf((-0.1 - z * math.sqrt(kv)) / math.sqrt(kv))
    assert by_hand == pytest.approx(0.940486, abs=1e-6)
    assert power_at(0.1, 0.0, 3, 3, kv) == pytest.approx(by_hand, abs=1e-9)
    # and its MDD: (z + z(0.8)) sqrt(kv) = (2.39398 + 0.841621) x 0.0252982 = 0.0818550 (the wrong tail ~1e-12)
    assert mdd(0.0, 3, 3, kv) == pytest.approx(0.0818550, abs=1e-6)
    assert floor(3, kv) == pytest.approx(0.0818550, abs=1e-6)
    # the textbook formula with 3 seeds: t(1 - 0.05/6, 2) by its closed form for 2 df, t = u sqrt(2/(1 - u²)),
    # u = 2q - 1 = 0.983333: sqrt(2 x 0.966944 / 0.0330556) = 7.64880; t(0.8, 2) = 0.6 sqrt(2 / 0.64) = 1.06066;
    # (7.64880 + 1.06066) x 0.05 / sqrt(3) = 0.251420
    u = 2 * (1 - 0.05 / 6) - 1
    t_c, t_p = u * math.sqrt(2 / (1 - u * u)), 0.6 * math.sqrt(2 / 0.64)
    assert approximate_mdd(0.05, 3, 3) == pytest.approx((t_c + t_p) * 0.05 / math.sqrt(3), rel=1e-9)
    assert approximate_mdd(0.05, 3, 3) == pytest.approx(0.251420, abs=1e-6)
    # the exact MDD is larger with 3 seeds: the textbook's has less than 80% power
    assert mdd(0.05, 3, 3) == pytest.approx(0.283374, abs=1e-5)
    assert power_at(mdd(0.05, 3, 3), 0.05, 3, 3) == pytest.approx(0.8, abs=1e-6)
    # more differences judged, a larger MDD; one seed: nothing detectable
    assert mdd(0.05, 3, 50) > mdd(0.05, 3, 3) > mdd(0.05, 3, 1)
    assert mdd(0.05, 1, 3) is None and power_at(0.5, 0.05, 1, 3) == 0.0
    with pytest.raises(ValueError):
        mdd(-0.01, 3, 3)


@pytest.mark.parametrize("n", [2, 3, 5, 10, 20])
@pytest.mark.parametrize("known_var", [0.0, 2 * 0.16 / 500])
def test_the_mdd_has_the_power_it_claims(n, known_var):
    """200,000 simulated reports at the MDD: 80% of them call it outside the noise (standard error 0.09%)."""
    d = mdd(0.02, n, 3, known_var)
    assert simulated_power(d, 0.02, n, 3, known_var) == pytest.approx(0.80, abs=0.006)


def test_with_no_difference_the_power_is_the_tests_size_at_any_seeds():
    # d = 0, no held-out noise: the test is Student's t, so it rejects with chance exactly alpha' = 0.05/judged
    # (an even grid from log 1e-12 df missed the chi-squared's mass at many df: 1.0002 of it at 1000 seeds,
    # 1.0044 at 2000)
    for seeds in (3, 10, 100, 1000, 2000):
        for judged in (1, 3, 50):
            assert power_at(0.0, 1.0, seeds, judged) == pytest.approx(0.05 / judged, rel=1e-6)


def _one_df_power(d, sd, judged):
    """The power with 2 seeds by another road: with one degree of freedom s = sd |X| / sqrt(2), X ~ N(0, 1),
    so the test rejects when |Z + d sqrt(2)/sd| > t |X|: 2 x the integral over x > 0 of phi(x) (Phi(delta - t x)
    + Phi(-delta - t x)), by Simpson's rule on 1.2 million intervals of [0, 12]."""
    t, delta = t_quantile(1 - 0.05 / (2 * judged), 1), d * math.sqrt(2) / sd
    x = np.linspace(0.0, 12.0, 1_200_001)
    erf = np.vectorize(math.erf)
    phi = lambda u: 0.5 * (1.0 + erf(u / math.sqrt(2.0)))  # noqa: E731
    f = np.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (phi(delta - t * x) + phi(-delta - t * x))
    w = np.ones_like(x)
    w[1:-1:2], w[2:-1:2] = 4, 2
    return 2 * (x[1] - x[0]) / 3 * float((w * f).sum())


@pytest.mark.parametrize("d", [2.0, 10.0, 20.0])
def test_two_seeds_and_many_differences_where_the_rejection_steps_sharply(d):
    # t(1 - 0.05/100, 1) = 636.6: the chance to reject falls from 1 to 0 within ~0.002 in log V, narrower than
    # an even grid's step (the power at d = 20, 0.343, was 2.7e-4 off)
    assert power_at(d, 0.1, 2, 50) == pytest.approx(_one_df_power(d, 0.1, 50), abs=2e-6)


def test_the_mdd_scales_with_the_spread_and_bad_figures_are_refused():
    import signal

    def stuck(*_):
        raise TimeoutError("the search did not end")

    signal.signal(signal.SIGALRM, stuck)
    signal.alarm(20)  # before, a spread whose square underflows, or NaN, was searched for ever
    try:
        assert mdd(1e-170, 3, 3) == pytest.approx(mdd(1.0, 3, 3) * 1e-170, rel=1e-6)
        assert mdd(3e150, 3, 3) == pytest.approx(mdd(1.0, 3, 3) * 3e150, rel=1e-6)
        for bad in (math.nan, math.inf, -0.01):
            with pytest.raises(ValueError, match="finite and >= 0"):
                mdd(bad, 3, 3)
            with pytest.raises(ValueError, match="finite and >= 0"):
                power_at(0.1, 0.02, 3, 3, bad)
        for bad in (math.nan, math.inf, 0.0):
            with pytest.raises(ValueError, match="finite and > 0"):
                seeds_for(bad, 0.02, 3)  # NaN and inf answered 2 seeds
        with pytest.raises(ValueError, match=">= 0"):
            held_out_var(0.8, -500)  # a negative variance
        with pytest.raises(ValueError, match="accuracy finite"):
            held_out_var(math.nan, 500)
    finally:
        signal.alarm(0)


def test_the_textbook_formula_and_a_forgotten_correction_fall_short():
    # what the exact search is for: 3 seeds at the textbook's MDD have ~72% power; an MDD computed as if
    # the report judged one difference, used in a report of 3, ~39%
    assert simulated_power(approximate_mdd(0.02, 3, 3), 0.02, 3, 3, 0.0) < 0.75
    assert simulated_power(mdd(0.02, 3, 1), 0.02, 3, 3, 0.0) < 0.5


def test_seeds_and_problems_needed_are_the_fewest():
    n = seeds_for(0.05, 0.04, 3)
    assert n == 10 and mdd(0.04, n, 3) <= 0.05 < mdd(0.04, n - 1, 3)
    kv = held_out_var(0.8, 500)  # 2 x 0.8 x 0.2 / 500 = 0.00064
    assert kv == pytest.approx(0.00064)
    assert seeds_for(0.05, 0.011, 3, kv) is None  # below the held-out sets' floor, 8.19 points
    need = seeds_for(0.09, 0.011, 3, kv)
    assert mdd(0.011, need, 3, kv) <= 0.09 < mdd(0.011, need - 1, 3, kv)
    problems = problems_for(0.10, 0.011, 3, 3, 0.8)
    assert problems == 513
    assert mdd(0.011, 3, 3, held_out_var(0.8, problems)) <= 0.10 < mdd(0.011, 3, 3, held_out_var(0.8, problems - 1))
    assert problems_for(0.05, 0.05, 3, 3, 0.8) is None  # the seeds alone need 28 points


def test_pooled_spread_by_hand():
    # sd 0.01 on 3 seeds (2 df) and 0.02 on 5 (4 df): sqrt((2 x 0.0001 + 4 x 0.0004) / 6) = sqrt(0.0003)
    rows = [{"sd": 0.01, "seeds": 3}, {"sd": 0.02, "seeds": 5}, {"sd": None, "seeds": 1}]
    sd, df = pooled_sd(rows)
    assert (sd, df) == (pytest.approx(math.sqrt(0.0003)), 6)
    assert pooled_sd([{"sd": None, "seeds": 1}]) is None


def test_one_seed_more_against_more_problems_by_hand():
    # 3 configurations, 33 s a run: a seed more is 99 s; evaluation 0.005 s a problem a run, on 9 runs:
    # 99 / 0.045 = 2200 more problems
    t = trade(0.011, 3, 3, 0.8, 500, Costs(configs=3, run_seconds=33, eval_seconds_per_problem=0.005))
    assert t.problems_instead == 2200 and t.seed_minutes == pytest.approx(1.65)
    assert t.one_seed_more == pytest.approx(mdd(0.011, 4, 3, held_out_var(0.8, 500)))
    assert t.more_problems == pytest.approx(mdd(0.011, 3, 3, held_out_var(0.8, 2700)))
    assert t.better == "problems"  # the held-out noise dominates here: 7.0 points against 8.8
    t = trade(0.05, 3, 3, 0.8, 500, Costs(configs=3, run_seconds=33, eval_seconds_per_problem=0.005))
    assert t.better == "seeds"  # a wide seed spread: the seeds' part dominates


def _report(values: dict[str, list[float]], eval_n=500) -> dict:
    from gspo.lab.report import aggregate

    return {name: aggregate({s: {"accuracy": v, "eval_n": eval_n} for s, v in enumerate(vs)})
            for name, vs in values.items()}


def test_every_report_states_its_minimum_detectable_difference():
    from gspo.lab.report import judge, noise_lines

    # a - b per seed: 0.02, 0.00, 0.01 (sd 0.01); a - c: 0.00, 0.02, 0.01 (sd 0.01); b - c: -0.02, 0.02, 0.00
    # (sd 0.02): pooled sqrt((2 x 0.0001 + 2 x 0.0001 + 2 x 0.0004) / 6) = sqrt(0.0002) = 0.0141421 on 6 df
    report = _report({"a": [0.82, 0.80, 0.81], "b": [0.80, 0.80, 0.80], "c": [0.82, 0.78, 0.80]})
    judged = judge(report)
    m = judged["mdd"]["accuracy"]
    assert m["sd"] == pytest.approx(math.sqrt(0.0002)) and m["df"] == 6 and m["differences"] == 3
    for row in judged["differences"]:  # each with its own held-out variance: (pa(1-pa) + pb(1-pb)) / 500
        pa, pb = (statistics.fmean(report[x]["seeds"][s]["accuracy"] for s in "012") for x in (row["a"], row["b"]))
        kv = (pa * (1 - pa) + pb * (1 - pb)) / 500
        assert row["known_var"] == pytest.approx(kv)
        assert row["mdd"] == pytest.approx(mdd(math.sqrt(0.0002), 3, 3, kv))
    text = "\n".join(noise_lines(report, judged))
    assert "**Minimum detectable difference**: " in text
    low, high = 100 * m["low"], 100 * m["high"]
    assert f"{low:.1f} to {high:.1f} points of final accuracy" in text or f"{low:.1f} points of final accuracy" in text
    assert "pooled over the report's 3 differences of it: 1.4 points on 6 degrees of freedom" in text
    first = judged["differences"][0]
    assert first["verdict"] == "within the noise"
    assert f"within the noise (the smallest difference it could see: {100 * first['mdd']:.1f})." in text


def test_compare_plan_trains_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--plan", "--detect", "5", "12"]) == 0
    out = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    pilots = json.loads((ROOT / "gspo" / "lab" / "pilots.json").read_text())["paper"]
    sd = pilots["figures"]["accuracy"]["sd"]
    kv = held_out_var(pilots["accuracy"], 500)
    assert "plan: paper preset, 3 configurations x 3 seeds (9 runs of 80 steps), 500 held-out problems" in out
    assert "judged: 3 differences (final accuracy, paired over the seeds)" in out
    assert f"minimum detectable difference {100 * mdd(sd, 3, 3, kv):.1f} points" in out
    assert f"to detect 12 points: {seeds_for(0.12, sd, 3, kv)} seeds at 500 problems" in out
    assert "to detect 5 points: no number of seeds at 500 problems" in out  # the floor is above 5 points here


def test_plan_of_a_study_counts_what_its_report_will_judge(capsys):
    # the staleness preset at lags 0 2: 6 configurations x 2 lags, per figure 6 within (K2 - K0) + 2 x 5 across
    # (each - gspo at a lag) = 16 pairs; gspo-behaviour@K0 is gspo@K0's runs (not judged), and grpo-behaviour@K0
    # - gspo@K0 is grpo@K0 - gspo@K0 again (counted once): 14 a figure, 28 for the two. The default lags
    # 0 2 8: 12 + 15 - 2 = 25 a figure, 50: what the stored study's report judged
    assert main(["compare", "--preset", "staleness", "--lags", "0", "2", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "judged: 28 differences (final accuracy and accuracy averaged over the evaluations" in out
    assert "12 configurations x 3 seeds (30 runs of 80 steps)" in out  # 2 of the 12 linked: 10 runs a seed
    assert main(["compare", "--preset", "staleness", "--plan"]) == 0
    stored = json.loads((ROOT / "docs" / "compare-staleness" / "compare.json").read_text())
    family = next(iter(stored.values()))["judged"]["judged"]
    assert family == 50 and f"judged: {family} differences" in capsys.readouterr().out


def test_a_pilot_that_did_not_record_its_steps_says_so():
    # the objectives study stored no step count (pilots.json: "steps": null): the plan read "measured at None
    # steps" and "scaled from None steps"
    assert json.loads((ROOT / "gspo" / "lab" / "pilots.json").read_text())["objectives"]["steps"] is None
    import io
    from contextlib import redirect_stdout

    with redirect_stdout(io.StringIO()) as out:
        assert main(["compare", "--preset", "objectives", "--plan"]) == 0
    text = out.getvalue()
    assert "None" not in text and "3 seeds, unrecorded steps, 100 held-out problems" in text
    assert "(the pilot's seconds per run; its steps not recorded)" in text


def test_plan_from_a_pilot_directory_recomputes_its_spread(tmp_path, capsys):
    pilot = tmp_path / "pilot"
    shutil.copytree(ROOT / "docs" / "compare-default", pilot)
    stored = json.loads((pilot / "compare.json").read_text())
    # the pooled per-seed spread of the three paired differences, from the seeds' own accuracies
    names = list(stored)
    num = 0.0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            diffs = [stored[a]["seeds"][s]["accuracy"] - stored[b]["seeds"][s]["accuracy"] for s in ("0", "1", "2")]
            num += 2 * statistics.variance(diffs)
    sd = math.sqrt(num / 6)
    assert main(["compare", "--plan", "--pilot", str(pilot), "--seeds", "0", "1", "2", "3", "4"]) == 0
    out = capsys.readouterr().out
    assert f"per-seed spread of a paired difference {100 * sd:.1f} points (6 df)" in out
    assert f"pilot: {pilot} (3 seeds" in out


@pytest.mark.parametrize("argv, msg", [
    (["--detect", "5"], "--detect: only with --plan"),
    (["--plan", "--detect", "five"], "--detect: expected differences in points of accuracy, got five"),
    (["--plan", "--detect", "0"], "--detect: each difference is in (0, 100] points, got 0"),
    (["--plan", "--pilot", "/nonexistent/dir"], "--pilot /nonexistent/dir: no compare.json there"),
    (["--preset", "length", "--plan", "--pilot", "NOTE"], "no compare.json there"),
])
def test_bad_plan_arguments_are_refused_in_one_line(argv, msg, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["compare", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_broken_pilot_file_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "compare.json").write_text('{"gspo": {"seeds": 3}}')
    assert main(["compare", "--plan", "--pilot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--pilot {tmp_path / 'compare.json'}: not a gspo compare.json" in err and "Traceback" not in err


def test_a_preset_without_a_stored_study_is_refused_in_one_line():
    from gspo.config import ConfigError
    from gspo.lab.plan import stored_pilot

    with pytest.raises(ConfigError, match=r"--plan: no stored study of the 'corrections' preset .* --pilot DIR"):
        stored_pilot("corrections")
    assert stored_pilot("paper").source == "docs/compare-default"


def test_presets_bring_their_seeds_and_levels(capsys):
    # the moe preset: 6 seeds and the task's 1000 held-out problems by default; staleness-chain: K = 0 1 2 4 8,
    # 4 configurations, 2 of them linked at K0 (the behaviour anchors are the proximal runs there): 18 runs a seed
    assert main(["compare", "--preset", "moe", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "plan: moe preset, 3 configurations x 6 seeds (18 runs of 40 steps), 1000 held-out problems" in out
    assert main(["compare", "--preset", "staleness-chain", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "plan: staleness-chain preset, 20 configurations x 3 seeds (54 runs of 20 steps), 100 held-out" in out
    assert main(["compare", "--preset", "moe", "--seeds", "0", "1", "--plan"]) == 0
    assert "3 configurations x 2 seeds" in capsys.readouterr().out
