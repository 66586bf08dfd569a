"""Metrics of the updates: how each one averages and reduces across processes, declared where it is made.

    from gspo.algo.metrics import Mean, Max, Min, step_means
    m = {"clip/frac": Mean(0.25, count=8), "ratio/max": Max(1.3), "grad_norm": Mean(0.7)}
    metrics = combine(micro_batch_metrics)     # an update's metrics from its micro-batches'
    history = reduce_across(history, dist)     # each update's global value (identity on one process)
    row = step_means(history)                  # one value per metric for the step's log row

A per-update metric is a float that says how it combines:
- `Mean(value, count)`: an average over `count` items (completion tokens, responses, real
  tokens). Across processes the global value is Σ_r count_r · value_r / Σ_r count_r, exactly
  the value one process holding the whole minibatch would compute. The default count of 1
  is a plain mean over processes, right for values that are the same everywhere (the
  gradient norm after DDP's all-reduce).
- `Min(value)`, `Max(value)`: the min and the max.
Over a step's updates a Mean is averaged (each update counts once), a Min/Max takes the
min/max. NaN values (a statistic over nothing) are skipped.

A step's row of metrics.jsonl (batch-level values: the sampler/trainer mismatch, multi-turn
episodes' statistics ...) is gspo.train.steplog's. This module imports nothing of gspo: every other
module may import it.

They are floats, so callers of `gspo.algo.losses.policy_loss` still get plain numbers; a metric
made as a plain float cannot be reduced and raises (a new metric must say how it averages,
rather than silently fall back to a wrong mean).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


class Mean(float):
    """An average over `count` items."""

    __slots__ = ("count",)

    def __new__(cls, value, count=1.0):
        self = super().__new__(cls, value)
        self.count = float(count)
        return self


class Min(float):
    """Reduces to the minimum."""

    __slots__ = ()


class Max(float):
    """Reduces to the maximum."""

    __slots__ = ()


def _kind(key: str, value) -> type:
    for kind in (Mean, Min, Max):
        if isinstance(value, kind):
            return kind
    raise TypeError(f"metric {key!r} is a plain {type(value).__name__}; make it a gspo.algo.metrics Mean, Min or Max "
                    "so that it averages and reduces across processes correctly")


def step_means(history: list[dict]) -> dict[str, float]:
    """One value per metric over a step's updates: Mean → the mean over updates, Min/Max →
    the min/max over updates (NaN entries skipped; NaN when all are NaN)."""
    out = {}
    for key in history[0]:
        kind = _kind(key, history[0][key])
        vals = [float(h[key]) for h in history if h[key] == h[key]]  # skip NaN
        if not vals:
            out[key] = float("nan")
        elif kind is Min:
            out[key] = min(vals)
        elif kind is Max:
            out[key] = max(vals)
        else:
            out[key] = sum(vals) / len(vals)
    return out


def combine(parts: list[dict]) -> dict:
    """One update's metrics from its micro-batches' (Mean: count-weighted, Min/Max: min/max),
    exactly what one pass over all their rows gives; a single part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for key, first in parts[0].items():
        kind = _kind(key, first)
        vals = [p[key] for p in parts if p[key] == p[key]]  # skip NaN
        if kind is Min:
            out[key] = Min(min(vals)) if vals else Min("nan")
        elif kind is Max:
            out[key] = Max(max(vals)) if vals else Max("nan")
        else:
            count = sum(v.count for v in vals)
            out[key] = Mean(sum(v * v.count for v in vals) / count, count) if count > 0 else Mean("nan", 0.0)
    return out


def reduce_across(history: list[dict], dist) -> list[dict]:
    """The global value of every per-update metric, the same on every process (`dist`: a
    gspo.processes.distributed.Dist; the identity on one process)."""
    for h in history[:1]:
        for key, value in h.items():
            _kind(key, value)  # every metric declares its reduction, in one process too
    if not dist.enabled or not history:
        return history
    keys = list(history[0])
    n = len(history)
    num = torch.zeros(n, len(keys), dtype=torch.float64)
    den = torch.zeros(n, len(keys), dtype=torch.float64)
    lo = torch.full((n, len(keys)), math.inf, dtype=torch.float64)
    hi = torch.full((n, len(keys)), -math.inf, dtype=torch.float64)
    kinds = [_kind(key, history[0][key]) for key in keys]
    for i, h in enumerate(history):
        for j, (key, kind) in enumerate(zip(keys, kinds)):
            v = h[key]
            if kind is Min:
                lo[i, j] = v if v == v else math.inf
            elif kind is Max:
                hi[i, j] = v if v == v else -math.inf
            elif v.count > 0 and v == v:
                num[i, j], den[i, j] = v * v.count, v.count
    both = dist.all_sum(torch.stack([num, den]))  # (2, n, K)
    lo, hi = dist.all_min(lo), dist.all_max(hi)
    out = []
    for i in range(n):
        row = {}
        for j, (key, kind) in enumerate(zip(keys, kinds)):
            if kind is Min:
                row[key] = Min(lo[i, j]) if math.isfinite(lo[i, j]) else Min("nan")
            elif kind is Max:
                row[key] = Max(hi[i, j]) if math.isfinite(hi[i, j]) else Max("nan")
            else:
                total = float(both[1, i, j])
                row[key] = Mean(both[0, i, j] / both[1, i, j], total) if total > 0 else Mean("nan", 0.0)
        out.append(row)
    return out
