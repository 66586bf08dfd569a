"""Aggregation of a per-token loss `(B, T)` to a scalar over completion tokens: the named modes
(`--loss-agg`) and what each divides by (`agg_count`, which distributed training sums over
processes). gspo.algo.losses re-exports these names.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(values: Tensor, mask: Tensor, mode: str, *, max_len: int | None = None) -> Tensor:
    """Reduce a per-token `(B, T)` tensor to a scalar over completion tokens.

    - "seq-mean-token-mean": mean over responses of each response's token mean (the paper's
      Eq. 2/5 weighting; each response counts once). Rows with no completion token are not
      responses and are left out of the mean.
    - "token-mean": sum over all completion tokens / number of completion tokens; a response
      weighs in proportion to its length.
    - "seq-mean-token-sum": mean over responses of each response's token sum; long responses
      weigh more, in proportion to their length.
    - "seq-mean-token-sum-norm" (Dr. GRPO): token sums divided by the constant `max_len`, then
      the mean over responses; no length-dependent normaliser at all.
    """
    masked = values * mask  # (B, T)
    count = agg_count(mask, mode).clamp(min=1)
    if mode == "token-mean":
        return masked.sum() / count
    seq_len = mask.sum(-1)  # (B,)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / seq_len.clamp(min=1.0)  # (B,)
    elif mode == "seq-mean-token-sum":
        per_seq = masked.sum(-1)  # (B,)
    else:
        if max_len is None or max_len <= 0:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs max_len > 0 (the fixed generation length)")
        per_seq = masked.sum(-1) / max_len  # (B,)
    return per_seq.sum() / count


def agg_count(mask: Tensor, mode: str) -> Tensor:
    """What `aggregate` divides by: completion tokens ("token-mean") or responses with at least
    one completion token (the seq-mean modes). Distributed training sums these over processes
    to normalise by the global minibatch (gspo.processes.distributed)."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    if mode == "token-mean":
        return mask.sum()
    return (mask.sum(-1) > 0).sum().to(mask.dtype)


__all__ = ["AGG_MODES", "agg_count", "aggregate"]
