"""Error bars for figures averaged over seeds: Student-t 95% intervals, paired differences, the
held-out set's own noise, p-values and Holm's correction for the many differences one report judges.

    mean, half = ci95([0.62, 0.70, 0.66])        # 0.66, 0.0994: t(0.975, 2) = 4.3027 x s / sqrt(3)
    mean, half = ci95([0.62, 0.70, 0.66], eval_n=500)   # 0.1077: + the held-out set's binomial noise
    paired_ci95([0.7, 0.8, 0.6], [0.5, 0.6, 0.55])  # the mean difference and its interval, seed by seed
    paired_test([0.7, 0.8, 0.6], [0.5, 0.6, 0.55]).p  # 0.0955: t = 3 on 2 degrees of freedom, two-sided
    holm([0.01, 0.04, 0.03])                    # [0.03, 0.06, 0.06]: Holm's step-down adjusted p-values
    eval_noise(0.66, 500)                       # 0.0415: 1.96 x sqrt(p (1 - p) / n), one run's accuracy

A 95% interval over n seeds is mean ± half. The seeds are the replicates: their part of the
variance of the mean is s²/n, s the sample standard deviation (n - 1 in its denominator), on n - 1
degrees of freedom, and alone it gives the Student interval t(0.975, n-1) · s / sqrt(n). A held-out
accuracy has a second part the seeds cannot see: every seed is evaluated on the same `eval_n`
held-out problems, so the luck of which problems those are is common to all seeds. `eval_n` adds
it, bounded by the binomial variance v = p(1 - p)/eval_n of an accuracy p on eval_n problems (for
a difference of two configurations, the sum of their two binomial variances: their evaluations
treated as independent, an upper bound whenever a problem one configuration finds hard the other
does not find easier). v is known, not estimated, so each part keeps its own 95% factor and the
two are added in quadrature: half = sqrt(t² s²/n + z² v), z = 1.96 (the form of Banerjee's
conservative interval for means of unequal variances). It is never narrower than either part
alone; one variance on Welch-Satterthwaite's degrees of freedom can be, and with 3 seeds it
rejects true nulls several times too often at the small levels a correction asks for
(tests/test_stats.py). With one seed there is no interval (None): the seeds' part is unknown. The
reasoning is in docs/compare.md ("Noise").

Two configurations run on the same seeds (the same prompts and sampling draws for a seed) are
compared seed by seed: `paired_test` gives the mean paired difference, its interval and the
two-sided p-value of "no difference": the level at which that interval just reaches 0 (Student t
on n - 1 df without eval_n). A report judges many such differences at once, so its verdicts are
Holm's (`holm`): a difference is outside the noise when its adjusted p-value is at most the
familywise level (5%), which keeps the chance of calling even one null difference outside the
noise at 5% or less, whatever the dependence between them.

The Student t distribution is computed here (`t_cdf`, `t_sf2`, `t_quantile`) from the regularised
incomplete beta function (`betainc`): no scipy. This module imports nothing from gspo.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

# t(0.975, df) for df = 1 .. 30 (two-sided 95%), from the t table (3 decimals)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Z975 = 1.959964
FAMILY_LEVEL = 0.05  # the familywise level of a report's verdicts (Holm)
_NORMAL = statistics.NormalDist()
_NORMAL_DF = 1e7  # past this many degrees of freedom t is the normal (|F_t - Phi| < 1e-8)


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) = B(x; a, b) / B(a, b), a, b > 0, x in
    [0, 1]: its continued fraction (modified Lentz), on the side of x where it converges fast
    (I_x(a, b) = 1 - I_{1-x}(b, a) on the other)."""
    if a <= 0 or b <= 0:
        raise ValueError(f"betainc needs a, b > 0, got {a}, {b}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc needs 0 <= x <= 1, got {x}")
    if x == 0.0 or x == 1.0:
        return x
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (Numerical Recipes' betacf), to relative 1e-15."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((a + m2 - 1) * (a + m2)),  # the even step, then the odd one
                    -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            return h
    raise ArithmeticError(f"betainc({a}, {b}, {x}): the continued fraction did not converge")


def t_sf2(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` (> 0, possibly fractional or inf) degrees of
    freedom: the two-sided p-value of t, I_{df/(df+t²)}(df/2, 1/2)."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    t = abs(t)
    if math.isinf(t):
        return 0.0
    if df >= _NORMAL_DF:
        return math.erfc(t / math.sqrt(2.0))
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom (df = 1: 1/2 + atan(t)/pi;
    df = 2: 1/2 + t / (2 sqrt(2 + t²)))."""
    tail = t_sf2(t, df) / 2.0
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=1024)
def t_quantile(q: float, df: float) -> float:
    """The q quantile of Student's t with `df` degrees of freedom: t_cdf inverted (Newton's method
    from the normal's quantile, to 1e-12 relative; the normal's past 1e7 degrees of freedom)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"a quantile needs 0 < q < 1, got {q}")
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    if q == 0.5:
        return 0.0
    if df >= _NORMAL_DF:
        return _NORMAL.inv_cdf(q)
    tail, t = 1.0 - q, _NORMAL.inv_cdf(q)  # the upper tail wanted; the normal's quantile, below t's
    for _ in range(100):  # Newton on the tail, convex for t > 0: from below, it rises to the root
        step = (t_sf2(t, df) / 2.0 - tail) / _t_pdf(t, df)
        t += step
        if abs(step) <= 1e-12 * t:  # the tail itself is good to ~1e-13 relative at large df
            break
    return t


def _t_pdf(t: float, df: float) -> float:
    return math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
                    - (df + 1) / 2 * math.log1p(t * t / df))


def t975(df: float) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom: the table's value for a
    whole df up to 30 (3 decimals, as printed in every textbook), the exact quantile otherwise
    (df > 30 or fractional; the normal's 1.96 at df = inf). The intervals themselves use the
    exact quantile (`t_quantile`), so that p <= 0.05 exactly when the 95% interval excludes 0."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isfinite(df) and df == int(df) and df <= len(T975):
        return T975[int(df) - 1]
    return t_quantile(0.975, df)


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds as an estimate: `mean`; `seeds_var`, the seeds' part of its variance
    (s²/n, on n - 1 degrees of freedom; None with one seed); `known_var`, a part known rather than
    estimated from the seeds (the held-out set's binomial variance); `n`, the seeds.

    Its interval at `level` has half-width sqrt(t² · s²/n + z² · known_var), t the Student
    quantile on n - 1 degrees of freedom and z the normal's: each part with its own 95% factor,
    added in quadrature (the form of Banerjee's conservative interval for means with unequal
    variances; with known_var = 0 the ordinary t interval, with s = 0 the normal's). Its p-value is
    the level at which that interval just reaches 0, so p <= alpha exactly when the 1 - alpha
    interval excludes 0."""

    mean: float
    seeds_var: float | None
    known_var: float
    n: int

    @property
    def df(self) -> int | None:
        """The degrees of freedom of the seeds' part: n - 1."""
        return None if self.seeds_var is None else self.n - 1

    def half_at(self, level: float) -> float | None:
        """The half-width of the `level` interval (None with one seed)."""
        if self.seeds_var is None:
            return None
        q = 1.0 - (1.0 - level) / 2.0
        return math.sqrt(t_quantile(q, self.n - 1) ** 2 * self.seeds_var + _NORMAL.inv_cdf(q) ** 2 * self.known_var)

    @property
    def half(self) -> float | None:
        """The half-width of the 95% interval."""
        return self.half_at(0.95)

    @property
    def p(self) -> float | None:
        """The two-sided p-value of "the true mean is 0" (a paired difference: no difference): the
        alpha whose 1 - alpha interval has half-width |mean|."""
        if self.seeds_var is None:
            return None
        m, vs, ve, df = abs(self.mean), self.seeds_var, self.known_var, self.n - 1
        if m == 0:
            return 1.0
        if vs == 0 and ve == 0:
            return 0.0
        if ve == 0:
            return t_sf2(m / math.sqrt(vs), df)
        if vs == 0:
            return math.erfc(m / math.sqrt(2.0 * ve))

        def reach(a: float) -> float:  # the interval whose seeds' factor is a, less |mean|: rises with a
            alpha = t_sf2(a, df)
            if alpha == 0.0:
                return math.inf
            return a * a * vs - m * m + (_NORMAL.inv_cdf(alpha / 2.0) ** 2 * ve if alpha < 1.0 else 0.0)

        lo, hi = 0.0, m / math.sqrt(vs)  # reach(0) = -m² < 0 <= reach(m / sqrt(vs))
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if mid in (lo, hi):
                break
            lo, hi = (mid, hi) if reach(mid) < 0 else (lo, mid)
        return t_sf2(0.5 * (lo + hi), df)


def _fmean(values) -> float:
    xs = list(values)
    return math.fsum(xs) / len(xs)


def is_number(v) -> bool:
    """Whether a figure counts: the statistics here leave out None and NaN or infinite values."""
    return v is not None and math.isfinite(float(v))


def _numbers(values) -> list[float]:
    return [float(v) for v in values if is_number(v)]


def estimate(values: list[float | None], known_var: float = 0.0) -> Estimate | None:
    """The mean of the values that are numbers, as an Estimate: the seeds' part of its variance
    s²/n over them, and `known_var`, a part known rather than estimated from the seeds. None
    without a number."""
    xs = _numbers(values)
    if not xs:
        return None
    mean = math.fsum(xs) / len(xs)
    if len(xs) < 2:
        return Estimate(mean, None, known_var, 1)
    # s²/n (exactly 0 when the seeds agree: a mean of equal floats need not round to them)
    seeds_var = 0.0 if min(xs) == max(xs) else math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / len(xs)
    return Estimate(mean, seeds_var, known_var, len(xs))


def binomial_var(p: float | None, n: int | None) -> float:
    """p(1 - p)/n: the variance of an accuracy p measured on n problems (0 without n or p)."""
    if p is None or not n or n <= 0:
        return 0.0
    p = min(max(float(p), 0.0), 1.0)
    return p * (1.0 - p) / n


def ci95(values: list[float | None], eval_n: int | None = None) -> tuple[float | None, float | None]:
    """(mean, half-width of its 95% interval) over the values that are numbers; (mean, None)
    with one, (None, None) with none. eval_n: the values are held-out accuracies measured on the
    same eval_n problems, and the interval includes that set's binomial variance p̄(1 - p̄)/eval_n
    (Estimate: half = sqrt(t² s²/n + z² p̄(1 - p̄)/eval_n))."""
    xs = _numbers(values)
    if not xs:
        return None, None
    est = estimate(xs, binomial_var(_fmean(xs), eval_n))
    return est.mean, est.half


def paired_test(a: list[float | None], b: list[float | None], eval_n: int | None = None) -> Estimate | None:
    """The mean of a - b over the seeds where both are numbers, as an Estimate (its interval,
    its p-value). eval_n: a and b are held-out accuracies on the same eval_n problems; the
    variance then adds (p̄a(1 - p̄a) + p̄b(1 - p̄b))/eval_n (p̄: the means over those seeds), the
    two evaluations treated as independent (conservative when per-problem outcomes correlate
    positively across configurations, as they do)."""
    pairs = [(float(x), float(y)) for x, y in zip(a, b) if is_number(x) and is_number(y)]
    if not pairs:
        return None
    known = 0.0
    if eval_n:
        known = (binomial_var(_fmean(x for x, _ in pairs), eval_n)
                 + binomial_var(_fmean(y for _, y in pairs), eval_n))
    return estimate([x - y for x, y in pairs], known)


def paired_ci95(a: list[float | None], b: list[float | None],
                eval_n: int | None = None) -> tuple[float | None, float | None]:
    """(mean of a - b, half-width) over the seeds where both are numbers (paired_test)."""
    est = paired_test(a, b, eval_n)
    return (None, None) if est is None else (est.mean, est.half)


def holm(ps: list[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (None stays None and is not counted): sorted
    p(1) <= ... <= p(m), the k-th adjusted is max over j <= k of min(1, (m - j + 1) p(j)).
    Rejecting where it is <= alpha holds the familywise error rate at alpha under any dependence."""
    order = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    out: list[float | None] = [None] * len(ps)
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(order) - k) * ps[i]))
        out[i] = running
    return out


def outside_noise(mean: float | None, half: float | None) -> bool | None:
    """Whether an interval mean ± half excludes 0 (None: no interval). One difference alone;
    a report's verdicts correct for all it judges (`holm`)."""
    if mean is None or half is None:
        return None
    return abs(mean) > half


def eval_noise(accuracy: float | None, n: int) -> float | None:
    """Half-width of the 95% interval of one held-out accuracy measured on n problems (binomial,
    normal approximation): the evaluation's own noise, whatever the training."""
    if accuracy is None or n <= 0:
        return None
    return Z975 * math.sqrt(accuracy * (1 - accuracy) / n)
