"""Corrections for the gap between the sampler's log-probs and the trainer's.

An inference engine (vLLM, a bf16 copy of the policy, a stale policy) samples from π_rollout,
not from the π_θold the trainer recomputes; the ratio r_t = π_θ/π_θold then corrects for the
updates but not for that gap. These weights do, per token or per response, before the loss is
aggregated (`gspo.algo.losses.policy_loss(..., is_weights=w)`); the options are the Corrections
section's (`cfg.corrections`):

    from gspo.algo.corrections import rollout_is_weights
    from gspo.config import Corrections
    w, metrics = rollout_is_weights(old_logp, rollout_logp, mask, Corrections(rollout_is="token", rollout_is_high=2.0))

With d_t = old_logp_t - rollout_logp_t (the log of π_θold/π_rollout per token):

    level       mode       weight
    token       truncate   w_t = min(exp(d_t), high)                        (TIS)
    token       mask       w_t = 1 if low <= exp(d_t) <= high else 0         (IcePop, token MIS)
    sequence    truncate   w_i = min(exp(Σ_t d_t), high) on every token of i
    sequence    mask       w_i = 1 if low <= exp(Σ_t d_t) <= high else 0
    geometric   mask       w_i = 1 if low <= exp(mean_t d_t) <= high else 0 (GSPO's length-normalised ratio)
    geometric   truncate   w_i = min(exp(mean_t d_t), high)

and off-policy sequence masking (OPSM, DeepSeek-V3.2): a response with a negative advantage
whose sampler log-probs are, on average per token, more than `delta` above the current
policy's is left out of the loss (`opsm_keep`). A masked token or response keeps its place in
the aggregation's denominator: the weights scale terms, they do not re-normalise.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from gspo.algo.metrics import Max, Mean, Min

Tensor = torch.Tensor


class CorrectionOptions(Protocol):
    """What the corrections read of their options (gspo.config.sections.Corrections, `cfg.corrections`,
    has them; this room imports no configuration)."""

    rollout_is: str  # off, token, sequence or geometric
    rollout_is_mode: str  # truncate or mask
    rollout_is_low: float
    rollout_is_high: float
    opsm_delta: float | None


LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")
LOG_CLAMP = 20.0  # as gspo.algo.losses: exp() of a clamped log cannot overflow to inf


def _check(level: str, mode: str, low: float, high: float, shapes: list) -> None:
    if level not in LEVELS:
        raise ValueError(f"rollout_is_weights: unknown level {level!r}; valid levels: {', '.join(LEVELS)}")
    if mode not in MODES:
        raise ValueError(f"rollout_is_weights: unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"rollout_is_weights: needs 0 <= low <= 1 <= high, got low={low}, high={high}")
    if len(set(shapes)) != 1 or len(shapes[0]) != 2:
        raise ValueError("rollout_is_weights: old_logp, rollout_logp and mask must share one (B, T) shape, "
                         f"got {shapes}")


def _response_mean(x: Tensor, mask: Tensor) -> Tensor:
    """(B, T) -> (B,): each response's mean over its completion tokens (0 for an empty row)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


@torch.no_grad()
def rollout_is_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                       corrections: CorrectionOptions) -> tuple[Tensor, dict[str, float]]:
    """Detached importance weights π_θold/π_rollout, truncated or masked, `(B, T)` with 0 on padding.

    The section's options: `rollout_is` is the level (token, sequence or geometric; "off" is
    refused), `rollout_is_mode` the mode, `rollout_is_low`/`rollout_is_high` the bounds.

    Metrics (each says how it averages, gspo.algo.metrics): `is/truncated_frac` (truncate) or
    `is/masked_frac` (mask), the fraction of tokens (token level) or responses (sequence and
    geometric levels) the bound changed; `is/weight_mean` and `is/weight_sq_mean` over completion
    tokens (`spread` turns the latter into `is/weight_std` once reduced over processes),
    `is/weight_min` and `is/weight_max`, of the weights applied.
    """
    level, mode = corrections.rollout_is, corrections.rollout_is_mode
    low, high = corrections.rollout_is_low, corrections.rollout_is_high
    _check(level, mode, low, high, [tuple(old_logp.shape), tuple(rollout_logp.shape), tuple(mask.shape)])
    mask = mask.to(old_logp.dtype)
    d = (old_logp - rollout_logp) * mask  # (B, T) log π_old/π_rollout, 0 on padding
    if level == "token":
        log_w, on = d, mask > 0  # (B, T)
    else:
        length = mask.sum(-1)  # (B,)
        log_w = d.sum(-1) if level == "sequence" else _response_mean(d, mask)  # (B,)
        on = length > 0  # (B,) responses with at least one token
    raw = torch.exp(log_w.clamp(-LOG_CLAMP, LOG_CLAMP))  # (B, T) or (B,)
    if mode == "truncate":
        w, changed = raw.clamp(max=high), raw > high
    else:
        inside = (raw >= low) & (raw <= high)
        w, changed = inside.to(raw.dtype), ~inside
    if level != "token":
        w = w.unsqueeze(-1).expand_as(mask)  # (B,) -> (B, T): every token of a response
    w = w * mask  # (B, T)
    units = float(on.sum())
    tokens = float(mask.sum())
    frac = float((changed & on).sum()) / max(units, 1.0)
    changed_name = "is/truncated_frac" if mode == "truncate" else "is/masked_frac"
    nan = float("nan")
    return w, {
        changed_name: Mean(frac, units),
        "is/weight_mean": Mean(float(w.sum()) / max(tokens, 1.0) if tokens else nan, tokens),
        "is/weight_sq_mean": Mean(float(w.square().sum()) / max(tokens, 1.0) if tokens else nan, tokens),
        "is/weight_min": Min(float(w[mask > 0].min()) if tokens else nan),
        "is/weight_max": Max(float(w[mask > 0].max()) if tokens else nan),
    }


# --rollout-is sequence: below this mean applied weight (over completion tokens), the weights shrink the
# batch's policy gradient more than two-fold, whatever the advantages: `weight_collapse` says so.
COLLAPSE_MEAN = 0.5


def spread(metrics: dict[str, float]) -> dict[str, float]:
    """`rollout_is_weights`'s metrics (reduced over processes) with `is/weight_std`, the standard
    deviation of the applied weights over completion tokens, in place of `is/weight_sq_mean`:
    sqrt(E[w²] - E[w]²)."""
    out = dict(metrics)
    sq, mean = out.pop("is/weight_sq_mean"), out["is/weight_mean"]
    out["is/weight_std"] = Mean(math.sqrt(max(sq - mean * mean, 0.0)) if sq == sq else float("nan"))
    return out


def weight_collapse(metrics: dict[str, float], level: str) -> str | None:
    """A one-line warning when --rollout-is sequence weights down-weight the batch: their mean over
    completion tokens below COLLAPSE_MEAN (the sum of hundreds of per-token log-ratios compounds
    small gaps into a weight far below 1); None otherwise, and for the other levels."""
    mean = metrics.get("is/weight_mean", float("nan"))
    if level != "sequence" or not mean < COLLAPSE_MEAN:
        return None
    return (f"--rollout-is sequence: the importance weights average {mean:.3g} over this batch's tokens "
            f"(spread {metrics.get('is/weight_std', float('nan')):.3g}, below {COLLAPSE_MEAN}): each response's weight "
            "is the product of its token ratios and the batch's gradient shrinks with it; --rollout-is geometric "
            "is the length-normalised weight (docs/corrections.md)")


@torch.no_grad()
def opsm_keep(logp: Tensor, rollout_logp: Tensor, advantages: Tensor, mask: Tensor, delta: float) -> Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2): 0 for a response with adv < 0 and
    mean_t (rollout_logp_t - logp_t) > delta, else 1; `(B,)`. `advantages` is (B,) or (B, T)
    (then a response's sign is that of its mean advantage over its tokens)."""
    mask = mask.to(logp.dtype)
    gap = _response_mean(rollout_logp - logp, mask)  # (B,) mean log π_rollout/π_θ
    adv = advantages if advantages.dim() == 1 else _response_mean(advantages, mask)  # (B,)
    return (~((adv < 0) & (gap > delta))).to(logp.dtype)


def apply_opsm(per_token: Tensor, *, logp: Tensor, rollout_logp: Tensor, advantages: Tensor, mask: Tensor,
               delta: float) -> tuple[Tensor, dict[str, float]]:
    """The per-token loss with OPSM's dropped responses zeroed (their place in the aggregation's
    denominator kept), and `opsm/masked_frac`, the share of responses dropped."""
    keep = opsm_keep(logp, rollout_logp, advantages, mask, delta)  # (B,)
    responses = mask.sum(-1) > 0  # (B,)
    n = float(responses.sum())
    return (per_token * keep.unsqueeze(-1),
            {"opsm/masked_frac": Mean(float((keep[responses] == 0).sum()) / max(n, 1.0), n)})
