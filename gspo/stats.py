"""Error bars for figures averaged over seeds: Student-t 95% intervals, paired differences, evaluation noise.

    mean, half = ci95([0.62, 0.70, 0.66])        # 0.66, 0.0994: t(0.975, 2) = 4.303 x s / sqrt(3)
    paired_ci95([0.7, 0.8, 0.6], [0.5, 0.6, 0.55])  # the mean difference and its interval, seed by seed
    eval_noise(0.66, 500)                       # 0.0415: 1.96 x sqrt(p (1 - p) / n), one run's accuracy

A 95% interval over n seeds is mean ± t(0.975, n-1) · s / sqrt(n), s the sample standard
deviation (n - 1 in its denominator): the seeds are the replicates, and the interval is for the
mean over seeds (what `gspo compare` reports). With one seed there is no interval (None). Two
configurations run on the same seeds (the same prompts and sampling draws for a seed) are compared
seed by seed: the interval of the mean paired difference; a difference is outside the noise when
that interval excludes 0. This module imports nothing from gspo.
"""

from __future__ import annotations

import math
import statistics

# t(0.975, df) for df = 1 .. 30 (two-sided 95%), from the t table
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
Z975 = 1.959964


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (table to 30, then the
    Cornish-Fisher expansion around the normal quantile, within 1e-3 there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(T975):
        return T975[df - 1]
    z = Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def ci95(values: list[float | None]) -> tuple[float | None, float | None]:
    """(mean, half-width of its 95% interval) over the values that are numbers; (mean, None)
    with one, (None, None) with none."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return None, None
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, None
    return mean, t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def paired_ci95(a: list[float | None], b: list[float | None]) -> tuple[float | None, float | None]:
    """(mean of a - b, half-width) over the seeds where both are numbers."""
    return ci95([x - y for x, y in zip(a, b) if x is not None and y is not None])


def outside_noise(mean: float | None, half: float | None) -> bool | None:
    """Whether an interval mean ± half excludes 0 (None: no interval)."""
    if mean is None or half is None:
        return None
    return abs(mean) > half


def eval_noise(accuracy: float | None, n: int) -> float | None:
    """Half-width of the 95% interval of one held-out accuracy measured on n problems (binomial,
    normal approximation): the evaluation's own noise, whatever the training."""
    if accuracy is None or n <= 0:
        return None
    return Z975 * math.sqrt(accuracy * (1 - accuracy) / n)
