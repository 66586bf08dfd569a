"""A scored rollout batch: everything the updates of one step read, per row.

    batch = Batch(rollout, rewards, all_rewards, parts, advantages, old_logp, ref_logp, examples, completions)
    cols = batch.rows(idx, ps, ts)   # the per-row tensors of rows idx, cut to a trimmed micro-batch's columns

Built by gspo.trainer.prepare (old log-probs, reference log-probs, advantages); read by
`minibatch_loss`, the metrics of the step and samples.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gspo.rollout import Rollout

Tensor = torch.Tensor


@dataclass
class Batch:
    """A scored rollout batch, ready for updates: this process's rows (B of B_all)."""

    rollout: Rollout
    rewards: Tensor  # (B,) weighted sum of all rewards
    all_rewards: Tensor  # (B_all,) every process's rewards, in rank order
    reward_parts: dict[str, list[float]]  # name -> (B,) each reward's values
    advantages: Tensor  # (B,) group-relative, or (B, T) from GAE (PPO)
    old_logp: Tensor  # (B, T) log π_θold of the sampled tokens
    ref_logp: Tensor | None  # (B, T) log π_ref, when beta > 0 or reward_kl_coef > 0
    examples: list  # (B / G,) the prompts' Examples
    completions: list[str]  # (B,) decoded completions
    old_values: Tensor | None = None  # (B, T) PPO: V_old(s_t) before the updates
    returns: Tensor | None = None  # (B, T) PPO: GAE returns, the value targets
    routing: Tensor | None = None  # (B, P+T, L, k) MoE: experts used under the old policy
    is_weights: Tensor | None = None  # (B, T) --rollout-is: π_old/π_rollout, truncated or masked
    is_metrics: dict | None = None  # their statistics over the global batch (gspo.corrections)

    def rows(self, idx: Tensor, ps: slice, ts: slice) -> dict[str, Tensor | None]:
        """The per-row tensors of rows `idx`, cut to prompt columns `ps` and completion columns
        `ts` (a trimmed micro-batch's)."""
        P = self.rollout.prompt_ids.shape[1]

        def cut(x: Tensor | None) -> Tensor | None:  # (B, T, ...) or (B,) -> rows idx, columns ts
            return None if x is None else (x[idx][:, ts] if x.dim() >= 2 else x[idx])

        routing = None
        if self.routing is not None:  # (B, P+T, L, k): prompt and completion columns cut alike
            r = self.routing[idx]
            routing = torch.cat([r[:, :P][:, ps], r[:, P:][:, ts]], 1)
        return {"old_logp": cut(self.old_logp), "advantages": cut(self.advantages), "ref_logp": cut(self.ref_logp),
                "old_values": cut(self.old_values), "returns": cut(self.returns), "routing": routing,
                "is_weights": cut(self.is_weights), "rollout_logp": cut(self.rollout.logp)}
