"""Power: the smallest difference a report could have seen, and the seeds a named difference needs.

    mdd(0.05, seeds=3, judged=3)                        # 0.2834 (the textbook formula's 0.2514 has 72% power)
    mdd(0.05, seeds=3, judged=3, known_var=2 * 0.16 / 500)  # 0.2925: with the held-out sets' noise
    seeds_for(0.05, sd=0.04, judged=3)                  # 10: mdd(0.04, 10, 3) = 0.0489 <= 0.05 < mdd(0.04, 9, 3)
    floor(judged=3, known_var=2 * 0.16 / 500)           # 0.0819: (2.3940 + 0.8416) x sqrt(0.00064), any seeds
    problems_for(0.10, sd=0.011, seeds=3, judged=3, accuracy=0.8)   # 513 held-out problems

A report judges `judged` paired differences at a familywise level alpha (5%) with Holm's
step-down (gspo.lab.stats.holm). A difference that is real among others that are not is called
outside the noise only if its adjusted p-value, m times its own when it is the smallest, is at most
alpha: its own p-value must reach alpha/m, Bonferroni's threshold, the first step of Holm's. The
minimum detectable difference (MDD) is the true difference that reaches it with probability
`power` (80%), for a paired difference whose per-seed spread is `sd` (the standard deviation of
a - b over seeds) on n seeds, with `known_var` the part of its variance that seeds do not reduce
(the held-out sets' binomial variance, pa(1-pa)/N + pb(1-pb)/N on N problems, which every seed
shares). The test is gspo.lab.stats.Estimate's: reject when |mean| > sqrt(t² s²/n + z² known_var),
t and z the 1 - alpha/2m quantiles of Student's t on n - 1 degrees of freedom and of the normal.
`power_at` integrates its rejection chance over the sample variance s² (chi-squared on n - 1
degrees of freedom), so the MDD is the exact one for that test, not the textbook approximation
sqrt((t(1 - alpha/2m) + t(power))² sd²/n + (z(1 - alpha/2m) + z(power))² known_var)
(`approximate_mdd`), which with 3 seeds has 72% power. tests/test_power.py simulates the reports'
own test at the MDD: 80% ± 2 for 2 to 20 seeds, with and without the held-out part.

`sd` comes from a pilot: the paired differences of a report already written (`pooled_sd`: their
spreads pooled over all the differences it judged, each weighted by its degrees of freedom) or of
the stored studies (gspo/lab/pilots.json, made by scripts/pilots.py from docs/compare-*/compare.json).
A spread measured on 3 seeds is itself uncertain; pooled over a report's differences it has their
degrees of freedom together (6 for 3 differences on 3 seeds, 50 for the staleness study).

Which buys more power per CPU minute: another seed (a whole run per configuration) or a larger
held-out set (evaluation time on every run)? `trade` answers for a measured run: the MDD with one
seed more against the MDD with the held-out set grown by as many problems as one seed's CPU
minutes would evaluate. This module imports only gspo.lab.stats.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

from gspo.lab.stats import FAMILY_LEVEL, t_quantile

POWER = 0.8
_NORMAL = statistics.NormalDist()
MAX_SEEDS = 1000
MAX_PROBLEMS = 10_000_000


def power_at(difference: float, sd: float, seeds: int, judged: int, known_var: float = 0.0, *,
             level: float = FAMILY_LEVEL) -> float:
    """The chance that a true paired `difference` is called outside the noise: that its p-value
    (gspo.lab.stats.Estimate.p, two-sided) reaches Holm's first threshold level/judged. The test
    rejects when |mean| > sqrt(t² s²/n + z² known_var), t and z the 1 - level/2m quantiles; the mean
    is normal around the difference with variance sd²/n + known_var, and s² = sd² V/(n-1) with V
    chi-squared on n - 1 degrees of freedom, independent of it. So the power is the integral over V
    of P(|N(difference, sd²/n + known_var)| > that half-width), computed here on a grid in log V
    (Simpson's rule over the chi-squared's mass, with a grid of its own where the rejection chance
    falls from 1 to 0: exact to ~1e-6)."""
    if seeds < 2:
        return 0.0
    _check(judged, sd, known_var)
    df = seeds - 1
    q = 1.0 - level / (2.0 * judged)
    t, z = t_quantile(q, df), _NORMAL.inv_cdf(q)
    spread = math.sqrt(sd * sd / seeds + known_var)
    if spread == 0.0:
        return 1.0 if difference > 0 else 0.0
    log_norm = -(df / 2.0) * math.log(2.0) - math.lgamma(df / 2.0)
    # log V has spread ~sqrt(2/df): the grid spans 40 of them below log df (and the old 1e-12 df floor for few
    # df), so that its steps see the mass at any df (from log 1e-12 df alone the mass was 1.0003 at 999 df,
    # 1.007 at 1999, and wrong enough at 10^6 that mdd's search never ended)
    lo = max(math.log(1e-12 * df), math.log(df) - 40.0 * math.sqrt(2.0 / df))
    hi = math.log(df + 40.0 * math.sqrt(2.0 * df) + 60.0)

    def integrand(x: float) -> float:
        v = math.exp(x)
        density = math.exp(log_norm + (df / 2.0) * x - v / 2.0)  # chi-squared's density at v, times v (d log v)
        half = math.sqrt(t * t * sd * sd * (v / df) / seeds + z * z * known_var)
        return density * (_NORMAL.cdf((difference - half) / spread) + _NORMAL.cdf((-difference - half) / spread))

    # the rejection chance steps from 1 to 0 where the half-width passes the difference, at log v*, within
    # ~2 d spread / (d² - z² kv) in log v: with few seeds and many differences (t large) far narrower than an
    # even grid's step (2 seeds, 50 judged: 0.0024 against 0.04, the power 0.4% off), so it has a grid of its own
    cuts = [lo, hi]
    gap = difference * difference - z * z * known_var
    if sd > 0 and gap > 0:
        centre = math.log(gap * df * seeds / (t * t * sd * sd))
        width = 2.0 * abs(difference) * spread / gap
        cuts = sorted({lo, hi, *(min(hi, max(lo, centre + k * width)) for k in (-30.0, 30.0))})
    total = sum(_simpson(integrand, a, b, 400) for a, b in zip(cuts, cuts[1:]) if b > a)
    return min(1.0, total)


def _simpson(f, a: float, b: float, steps: int) -> float:
    """Simpson's rule for f over [a, b] on `steps` (even) intervals."""
    width = (b - a) / steps
    return width / 3.0 * sum((1 if i in (0, steps) else 4 if i % 2 else 2) * f(a + i * width) for i in range(steps + 1))


def mdd(sd: float, seeds: int, judged: int, known_var: float = 0.0, *, power: float = POWER,
        level: float = FAMILY_LEVEL) -> float | None:
    """The minimum detectable difference (module docstring) of a paired difference of per-seed
    spread `sd` over `seeds` seeds, one of `judged` differences Holm-corrected at `level`: the
    difference whose `power_at` is `power`, to 1e-7 of the spread; None with fewer than 2 seeds (no
    interval, nothing detectable)."""
    if seeds < 2:
        return None
    _check(judged, sd, known_var)
    if sd == 0 and known_var == 0:
        return 0.0
    # the MDD scales with the spread: searched at unit scale (a spread whose square underflowed made the start
    # 0 and the doubling below endless), once for each shape (a report's rows share theirs without held-out noise)
    scale = max(sd, math.sqrt(known_var))
    return scale * _unit_mdd(sd / scale, known_var / scale / scale, seeds, judged, power, level)


@functools.lru_cache(maxsize=4096)
def _unit_mdd(sd: float, known_var: float, seeds: int, judged: int, power: float, level: float) -> float:
    """mdd at unit scale (max(sd, sqrt(known_var)) = 1), by the Illinois variant of false position on
    power_at - power within a bracket (a few evaluations where bisection to 1e-7 took ~30: 3 s a
    report of 54 differences, an hour for a test that simulates 2000 of them), to 1e-7."""
    def gap(d: float) -> float:
        return power_at(d, sd, seeds, judged, known_var, level=level) - power

    lo, hi = 0.0, approximate_mdd(sd, seeds, judged, known_var, power=power, level=level)
    f_lo, f_hi = gap(lo), gap(hi)
    while f_hi < 0:
        lo, f_lo, hi = hi, f_hi, 2.0 * hi
        f_hi = gap(hi)
    side = 0
    while hi - lo > 1e-7:
        mid = hi - f_hi * (hi - lo) / (f_hi - f_lo)
        if not lo < mid < hi:  # flat ends: fall back to halving
            mid = 0.5 * (lo + hi)
        f_mid = gap(mid)
        if f_mid < 0:
            lo, f_lo = mid, f_mid
            f_hi, side = (f_hi / 2, 0) if side == -1 else (f_hi, -1)  # the same end kept twice: halve the other's
        else:
            hi, f_hi = mid, f_mid
            f_lo, side = (f_lo / 2, 0) if side == 1 else (f_lo, 1)
        if abs(f_mid) < 1e-12:
            return mid
    return hi


def _check_difference(difference: float) -> None:
    if not 0 < difference < math.inf:
        raise ValueError(f"a difference to detect is finite and > 0, got {difference}")


def _check(judged: int, sd: float, known_var: float) -> None:
    """A family of one difference or more, a finite spread and variance >= 0 (NaN was searched for ever)."""
    if judged < 1:
        raise ValueError(f"a report judges at least one difference, got {judged}")
    if not (0 <= sd < math.inf and 0 <= known_var < math.inf):
        raise ValueError(f"a spread and a variance are finite and >= 0, got sd {sd}, known_var {known_var}")


def approximate_mdd(sd: float, seeds: int, judged: int, known_var: float = 0.0, *, power: float = POWER,
                    level: float = FAMILY_LEVEL) -> float:
    """The textbook sample-size formula: sqrt((t(1 - alpha/2m) + t(power))² sd²/n + (z(1 - alpha/2m) +
    z(power))² known_var), the critical value plus the power quantile times each part's standard error,
    with central t quantiles. It undershoots with few seeds (3 seeds: 72% power, not 80%); `mdd` starts
    its search from it."""
    q = 1.0 - level / (2.0 * judged)
    t = t_quantile(q, seeds - 1) + t_quantile(power, seeds - 1)
    z = _NORMAL.inv_cdf(q) + _NORMAL.inv_cdf(power)
    return math.sqrt(t * t * sd * sd / seeds + z * z * known_var)


def floor(judged: int, known_var: float, *, power: float = POWER, level: float = FAMILY_LEVEL) -> float:
    """The MDD with infinitely many seeds: what the held-out sets' noise alone leaves, (z(1 - alpha/2m)
    + z(power)) sqrt(known_var)."""
    _check(judged, 0.0, known_var)
    q = 1.0 - level / (2.0 * judged)
    return (_NORMAL.inv_cdf(q) + _NORMAL.inv_cdf(power)) * math.sqrt(known_var)


def seeds_for(difference: float, sd: float, judged: int, known_var: float = 0.0, *, power: float = POWER,
              level: float = FAMILY_LEVEL) -> int | None:
    """The fewest seeds (>= 2) whose MDD is at most `difference`; None when no number up to MAX_SEEDS
    does (the held-out noise's `floor` is above it, or the spread needs more)."""
    _check_difference(difference)  # NaN and inf answered 2 seeds
    if floor(judged, known_var, power=power, level=level) >= difference:
        return None
    lo, hi = 2, MAX_SEEDS  # mdd falls as seeds grow: the first n with mdd(n) <= difference, by bisection
    if mdd(sd, hi, judged, known_var, power=power, level=level) > difference:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if mdd(sd, mid, judged, known_var, power=power, level=level) > difference else (lo, mid)
    return lo


def problems_for(difference: float, sd: float, seeds: int, judged: int, accuracy: float, *,
                 power: float = POWER) -> int | None:
    """The fewest held-out problems N (up to MAX_PROBLEMS) with which `seeds` seeds detect `difference`
    between two accuracies near `accuracy` (known_var = held_out_var(accuracy, N)); None when the
    seeds' part alone is already at or above it."""
    _check_difference(difference)
    held_out_var(accuracy, 1)  # an accuracy it can use
    seeds_part = mdd(sd, seeds, judged, power=power)
    if seeds_part is None or seeds_part >= difference:
        return None

    def enough(n: int) -> bool:
        return mdd(sd, seeds, judged, held_out_var(accuracy, n), power=power) <= difference

    if not enough(MAX_PROBLEMS):
        return None
    lo, hi = 1, MAX_PROBLEMS
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if not enough(mid) else (lo, mid)
    return lo


def held_out_var(accuracy: float | None, problems: int | None) -> float:
    """2 p(1-p)/N: the held-out part of a difference of two accuracies near p, each on N problems."""
    if accuracy is None or not problems:
        return 0.0
    if problems < 0 or not math.isfinite(accuracy):  # a negative count gave a negative variance, NaN a NaN one
        raise ValueError(f"held-out problems are >= 0 and an accuracy finite, got {problems}, {accuracy}")
    p = min(max(accuracy, 0.0), 1.0)
    return 2.0 * p * (1.0 - p) / problems


def pooled_sd(differences: list[dict]) -> tuple[float, int] | None:
    """The per-seed spread of paired differences pooled over a report's judged ones (rows with "sd",
    the standard deviation of a - b over their seeds, and "seeds", how many):
    sqrt(sum (n_i - 1) sd_i² / sum (n_i - 1)), and its degrees of freedom sum (n_i - 1); None without
    a row of two seeds or more. The spread does not see the differences' means: a real difference
    among them widens nothing."""
    num, df = 0.0, 0
    for d in differences:
        n, sd = d.get("seeds") or 0, d.get("sd")
        if n < 2 or sd is None or not math.isfinite(sd):
            continue
        num += sd * sd * (n - 1)
        df += n - 1
    return None if df == 0 else (math.sqrt(num / df), df)


@dataclass(frozen=True)
class Trade:
    """One more seed against a larger held-out set for the same CPU minutes (`trade`)."""

    now: float | None  # the MDD as asked
    one_seed_more: float | None  # with seeds + 1
    problems_instead: int  # the held-out problems the seed's minutes would evaluate on every run, added
    more_problems: float | None  # the MDD with them
    seed_minutes: float  # one seed more: a run per configuration

    @property
    def better(self) -> str:
        if self.one_seed_more is None or self.more_problems is None:
            return "seeds"
        return "seeds" if self.one_seed_more <= self.more_problems else "problems"


@dataclass(frozen=True)
class Costs:
    """What a comparison's runs cost: `configs` runs a seed of `run_seconds` each, evaluation
    `eval_seconds_per_problem` a run (all its evaluations together), at most `max_problems` held-out
    problems in all (the task's split; None: no limit)."""

    configs: int
    run_seconds: float
    eval_seconds_per_problem: float
    max_problems: int | None = None


def trade(sd: float, seeds: int, judged: int, accuracy: float, problems: int, costs: Costs) -> Trade:
    """The MDD with one more seed (costs.configs more runs) against the MDD with as many more held-out
    problems as that CPU time evaluates on all configs x seeds runs, up to costs.max_problems in all."""
    configs, run_seconds, max_problems = costs.configs, costs.run_seconds, costs.max_problems
    eval_seconds_per_problem = costs.eval_seconds_per_problem
    seed_seconds = configs * run_seconds
    extra = int(seed_seconds / max(eval_seconds_per_problem * configs * seeds, 1e-9))
    if max_problems is not None:
        extra = max(0, min(extra, max_problems - problems))
    extra = min(extra, MAX_PROBLEMS)  # free evaluation (0 s a problem) offered 99 billion problems
    return Trade(now=mdd(sd, seeds, judged, held_out_var(accuracy, problems)),
                 one_seed_more=mdd(sd, seeds + 1, judged, held_out_var(accuracy, problems)),
                 problems_instead=extra, more_problems=mdd(sd, seeds, judged, held_out_var(accuracy, problems + extra)),
                 seed_minutes=seed_seconds / 60)
