"""A batch of sampled sequences: the Rollout, its padding and its positions.

    ro = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, logp, lengths, truncated, group_size=G)
    ro.select(idx)                                    # rows idx (a minibatch)
    ids, mask = left_pad([[5, 6], [7]], pad_id=0)     # (N, P) each

Layout. Prompts are left-padded to a common width P and completions right-padded to T, so
every completion starts at column P; row b holds prompt b // G (groups are contiguous).
Position ids count real tokens only (cumsum of the attention mask), in sampling and in
training alike, so a padded row computes exactly what it would alone. Samplers make Rollouts
(gspo.sampling.rollout), training forwards read them (gspo.models.logprobs); this module imports nothing of gspo.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class Rollout:
    """G completions for each of N prompts, B = N·G rows, groups contiguous."""

    prompt_ids: Tensor  # (B, P) left-padded prompt tokens
    prompt_mask: Tensor  # (B, P) 1 on real prompt tokens
    completion_ids: Tensor  # (B, T) right-padded sampled tokens (pad after EOS)
    completion_mask: Tensor  # (B, T) 1.0 on completion tokens, EOS included
    logp: Tensor  # (B, T) log-prob of each sampled token at sampling time; 0 on padding
    lengths: Tensor  # (B,) completion lengths (number of ones in completion_mask)
    truncated: Tensor  # (B,) bool: stopped by max_new_tokens before an EOS
    group_size: int
    routing: Tensor | None = None  # (B, P+T, L, k) int8/int16 MoE experts used while sampling; -1 = not fed
    # multi-turn episodes (gspo.sampling.episodes): 1.0 on the environment's tokens between the model's
    # turns, which the model reads (attention) but is never trained on (completion_mask is 0
    # there, logp 0); `lengths` then counts model and environment tokens
    env_mask: Tensor | None = None  # (B, T)
    # partial rollouts (gspo.sampling.vllm_server, --partial-rollouts): the policy version that sampled each
    # completion token, where a generation spanned a weight sync (-1 on padding); None: the batch's own version
    versions: Tensor | None = None  # (B, T) int32

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], 1)  # (B, P+T)

    @property
    def attention_mask(self) -> Tensor:
        seen = self.completion_mask if self.env_mask is None else self.completion_mask + self.env_mask  # (B, T)
        return torch.cat([self.prompt_mask, seen.to(self.prompt_mask.dtype)], 1)  # (B, P+T)

    def map(self, fn) -> Rollout:
        """The same rollout with `fn` applied to every tensor field."""
        return dataclasses.replace(self, **{f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), Tensor)})

    def select(self, idx: Tensor) -> Rollout:
        """Rows `idx` (for minibatches); the group layout no longer holds for the result."""
        return self.map(lambda t: t[idx])


def left_pad(seqs: list[list[int]], pad_id: int, device=None) -> tuple[Tensor, Tensor]:
    """Left-pad token lists to one width: (ids (N, P), mask (N, P))."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def position_ids_from_mask(mask: Tensor) -> Tensor:
    """Positions that count real tokens only: (B, L) attention mask -> (B, L) positions."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
