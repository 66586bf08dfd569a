"""Metrics of the updates: how each one averages and reduces across processes, declared where it is made.

    from gspo.metrics import Mean, Max, Min, step_means
    m = {"clip/frac": Mean(0.25, count=8), "ratio/max": Max(1.3), "grad_norm": Mean(0.7)}
    metrics = combine(micro_batch_metrics)     # an update's metrics from its micro-batches'
    history = reduce_across(history, dist)     # each update's global value (identity on one process)
    row = step_means(history)                  # one value per metric for the step's log row
    row.update(mismatch(sampled_logp, old_logp, mask))   # mismatch/token_abs, mismatch/seq_log_ratio

A per-update metric is a float that says how it combines:
- `Mean(value, count)`: an average over `count` items (completion tokens, responses, real
  tokens). Across processes the global value is Σ_r count_r · value_r / Σ_r count_r, exactly
  the value one process holding the whole minibatch would compute. The default count of 1
  is a plain mean over processes, right for values that are the same everywhere (the
  gradient norm after DDP's all-reduce).
- `Min(value)`, `Max(value)`: the min and the max.
Over a step's updates a Mean is averaged (each update counts once), a Min/Max takes the
min/max. NaN values (a statistic over nothing) are skipped.

Also here: `step_row`, a step's row of metrics.jsonl, and `mismatch`, the gap between the
sampler's log-probs and the trainer's.

They are floats, so callers of `gspo.losses.policy_loss` still get plain numbers; a metric
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
    raise TypeError(f"metric {key!r} is a plain {type(value).__name__}; make it a gspo.metrics Mean, Min or Max "
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
    gspo.distributed.Dist; the identity on one process)."""
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


def mismatch(sampled: Tensor, recomputed: Tensor, mask: Tensor, gather=None) -> dict[str, float]:
    """How far the sampling pass's log-probs are from the training forward's (precision gap):
    per token, and per response as the length-normalised log-ratio GSPO's s_i would see.
    gather: concatenates per-row statistics over processes (Dist.gather)."""
    diff = (recomputed - sampled) * mask  # (B, T)
    rows = torch.stack([diff.abs().sum(-1), diff.sum(-1), mask.sum(-1)], -1)  # (B, 3)
    abs_sum, diff_sum, n_tok = (gather or (lambda t: t))(rows).unbind(-1)  # (B_all,) each
    seq = diff_sum / n_tok.clamp(min=1)  # (B_all,) (1/|y|) Σ_t (log π_train - log π_sample)
    has = n_tok > 0
    return {"mismatch/token_abs": float(abs_sum.sum() / n_tok.sum().clamp(min=1)),
            "mismatch/seq_log_ratio": float(seq[has].abs().mean()) if has.any() else 0.0}


def step_row(run, step: int, batch, history: list[dict]) -> dict:
    """The step's row of metrics.jsonl (without timings), over the global batch: batch-level
    values gathered from every process, then the step's means of the updates' `history`.
    run: a gspo.run.Run; batch: a gspo.trainer.Batch."""
    cfg, dist, ro = run.cfg, run.dist, batch.rollout
    groups = batch.all_rewards.view(-1, cfg.group_size)  # (N_all, G)
    lengths = dist.gather(ro.lengths.float())  # (B_all,)
    all_parts = {name: dist.gather(torch.tensor(v, dtype=torch.float64)) for name, v in batch.reward_parts.items()}
    metrics = {
        "step": step,
        "reward/mean": float(batch.all_rewards.mean()),
        "reward/std": float(batch.all_rewards.std()) if batch.all_rewards.numel() > 1 else 0.0,
        "reward/flat_group_frac": float((groups.amax(1) == groups.amin(1)).float().mean()),
        **{f"reward/{name}/mean": float(v.nanmean()) for name, v in all_parts.items()},  # None rewards left out
        **step_means(history),
        "completion/mean_length": float(lengths.mean()),
        "completion/max_length": float(lengths.max()),
        "completion/truncated_frac": float(dist.gather(ro.truncated.float()).mean()),
        **(mismatch(ro.logp, batch.old_logp, ro.completion_mask, dist.gather)
           if cfg.old_logp == "recompute" else {}),
        **{k: float(v) for k, v in (batch.is_metrics or {}).items()},
        "lr": run.optimizer.param_groups[0]["lr"],
    }
    if batch.episodes is not None:
        metrics.update(episode_metrics(batch, run.max_turns, dist))
    if run.value_model is not None:
        on = ro.completion_mask > 0
        v, r = dist.gather(batch.old_values[on]), dist.gather(batch.returns[on])  # completion tokens of all processes
        metrics["value/mean"] = float(v.mean()) if v.numel() else 0.0
        from gspo.value import explained_variance

        metrics["value/explained_variance"] = explained_variance(v, r, torch.ones_like(v))
    return metrics


def episode_metrics(batch, max_turns: int, dist) -> dict[str, float]:
    """Multi-turn episodes over the global batch: turns, tool calls and the share that failed,
    the share of episodes ended by the turn limit, model and environment tokens per episode, and
    the environment's mean reward at each turn (over the episodes that reached it)."""
    ep, ro = batch.episodes, batch.rollout
    rows = torch.stack([ep.turns, ep.tool_calls, ep.tool_errors, ep.turn_limit, ro.completion_mask.sum(1).cpu(),
                        ro.env_mask.sum(1).cpu()], 1).double()  # (B, 6)
    turns, calls, errors, limited, model_tokens, env_tokens = dist.gather(rows).unbind(1)  # (B_all,) each
    by_turn = torch.full((len(ep.turn_rewards), max_turns), float("nan"), dtype=torch.float64)  # (B, K)
    for b, rewards in enumerate(ep.turn_rewards):
        by_turn[b, :len(rewards)] = torch.tensor(rewards, dtype=torch.float64)
    by_turn = dist.gather(by_turn)  # (B_all, K)
    return {
        "episode/turns": float(turns.mean()),
        "episode/tool_calls": float(calls.mean()),
        "episode/tool_error_rate": float(errors.sum() / calls.sum()) if calls.sum() > 0 else 0.0,
        "episode/turn_limit_frac": float(limited.mean()),
        "episode/model_tokens": float(model_tokens.mean()),
        "episode/env_tokens": float(env_tokens.mean()),
        **{f"episode/turn_{k + 1}_reward": float(by_turn[:, k].nanmean()) for k in range(max_turns)
           if not by_turn[:, k].isnan().all()},
    }
