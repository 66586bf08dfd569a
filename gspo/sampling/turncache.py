"""Later turns of multi-turn episodes feed only their new tokens: each row's KV cache is kept between turns.

    sampler = PolicySampler(model)                            # keep_cache=True: a TurnCache
    ro = sampler.sample(prompts, params, rows=(0, B))         # turn 0: prefill and decode; the cache is kept
    ro = sampler.sample(longer, params_1, rows=(idx, B))      # turn 1: only what the cache lacks is fed
    sampler.end_rollout()                                     # the cache is dropped

Why. A later turn's prompt is the conversation so far: the prompt, the model's turns and the
environment's answers (gspo.sampling.episodes). All of it but the last sampled token and the
environment's tokens is already in the cache that sampled the turn before; prefilling it again
was most of a later turn's time. The rollout of `gspo train --task calculator` (256 episodes,
2 CPU threads; benchmarks/multiturn_cache.py): turn 1 took 1.74 s, 1.32 s of it that prefill;
with the cache kept 0.64 s, 0.28 s of it the new tokens; the rollout 2.50 s -> 1.43 s.

How. After each `sample`, `TurnCache.keep` holds the decoder (gspo.sampling.fastdecode: its KV cache, a
column per token fed: the prompt's, then one per decode step), the attention mask over those
columns, and per row its global row index and the tokens in its cache, in order. A later
`sample` goes on from them (`resume`) when its `rows` are global indices (gspo.sampling.episodes' later
turns), all kept, one completion per prompt. Per row, the longest common prefix of its new
prompt and its cached tokens stays (at least the row's first prompt, at most all of the new
prompt but its last token); the columns past it are masked out and stay holes (what a stop
string or the token budget cut; and a row keeps its completion but its last token, so the stop
token and pads a finished row was fed while others decoded are holes too). The rest of the
prompt, the last sampled token then the environment's tokens, is fed as one chunk: left-padded
across rows so that each row's last token is the chunk's last column, whose logits start the
decode loop as a prefill's do (no (B, S, V) logits); causal within the chunk; each token at the
position `position_ids_from_mask` gives it in the whole conversation (its count of real tokens
before it). Rows are taken from the cache by index (episodes end between turns), and
gspo.sampling.rollout's decode loop goes on as after a prefill, with the same uniforms per step: the
tokens are a full prefill's, the log-probs equal to float rounding (tests/test_multiturn_cache.py).

A full prefill instead, never a wrong result, when a row is not kept, a prompt does not extend
its row's first prompt, G > 1, the weights changed since (the parameters' version counters: an
optimizer step, a `sync`; a PEFT model's active, disabled or merged adapters), or the decoder
cannot go that far (`reach`: a sliding window the columns would pass, a cache other than Hugging
Face's plain DynamicCache). Such a `sample` is a later turn's as before: its Rollout's routing
(MoE) is assembled; a resumed one's is None.

Cost. Columns are never compacted: a turn adds its chunk's width and its decode steps to every
row it keeps, holes included, and the chunk's attention runs over its padded width. Nothing
outlives a rollout: `end_rollout` (after the last turn) and `sync` drop the cache, and each
`sample` replaces it. Under FSDP it is plain tensors: no gathered parameter is held between
`sample` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gspo.models.sequences import left_pad, position_ids_from_mask

Tensor = torch.Tensor


@dataclass
class Start:
    """Where a call's decode loop starts (gspo.sampling.rollout): the decoder holding its B rows' context,
    the logits of each row's next token, the attention mask over the cache's W columns, each row's
    next position, and the Rollout's prompts. With a TurnCache: `fed`, per row the tokens in the
    cache (real ones, in order), and `base`, the length of each row's first prompt (None: `fed`'s)."""

    dec: object
    logits: Tensor  # (B, V)
    attn: Tensor  # (B, W)
    next_pos: Tensor  # (B,)
    prompt_ids: Tensor  # (B, P) left-padded
    prompt_mask: Tensor  # (B, P)
    fed: list[list[int]] | None = None
    base: list[int] | None = None


@dataclass
class _Kept:
    dec: object  # its cache: R rows, C columns
    attn: Tensor  # (R, C) 1 on the columns that hold `fed`, in order
    fed: list[list[int]]  # (R,) the tokens in the cache, real ones
    base: list[int]  # (R,) the length of each row's first prompt
    index: dict[int, int]  # global row index -> kept row


def weights_key(model) -> tuple:
    """The parameters' version counters: any in-place update (an optimizer step, a copy) moves one; and
    a PEFT model's adapter state, which changes what the same parameters compute (the active adapters,
    disabled or merged: `set_adapter`, `disable_adapter()`, `merge_adapter()`)."""
    adapters = tuple((tuple(m.active_adapters), bool(m.disable_adapters), tuple(getattr(m, "merged_adapters", ())))
                     for m in model.modules() if hasattr(m, "active_adapters") and hasattr(m, "base_layer"))
    return tuple(p._version for p in model.parameters()), adapters


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of a and b."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TurnCache:
    """What a PolicySampler keeps from one `sample` to the next (module docstring)."""

    def __init__(self):
        self.kept: _Kept | None = None
        self.weights: tuple | None = None

    def drop(self) -> None:
        self.kept = None

    def begin(self, model) -> TurnCache:
        """A `sample` starts: the kept cache stays only if the weights are those it was computed with
        (read before FSDP gathers them: the sharded parameters' versions)."""
        weights = weights_key(model)
        if weights != self.weights:
            self.kept, self.weights = None, weights
        return self

    def resume(self, prompts: list[list[int]], params, rows) -> Start | None:
        """The decode loop's start for `prompts` from the kept cache, feeding each row only what it
        lacks; None: this call prefills (module docstring). The kept cache is given up either way."""
        kept, self.kept = self.kept, None
        if kept is None or params.group_size != 1 or rows is None or not isinstance(rows[0], Tensor):
            return None
        at = [kept.index.get(r) for r in rows[0].tolist()]  # kept row of each prompt
        if None in at or len(at) != len(prompts):
            return None
        n = [min(_common(kept.fed[i], p), len(p) - 1) for i, p in zip(at, prompts)]  # tokens that stay
        if any(m < max(kept.base[i], 1) for m, i in zip(n, at)):
            return None  # a prompt that does not extend its row's first one
        suffix = [p[m:] for p, m in zip(prompts, n)]
        dec = kept.dec
        if not dec.reach(kept.attn.shape[1] + max(map(len, suffix)) + params.max_new_tokens):
            return None
        device = kept.attn.device
        sel = torch.tensor(at, device=device)  # (B,)
        dec.select(sel)
        stay = torch.tensor(n, device=device)  # (B,)
        old = kept.attn.index_select(0, sel)  # (B, C)
        old = old * (old.cumsum(1) <= stay[:, None])  # the first n real columns; the rest become holes
        ids, mask = left_pad(suffix, params.pad_token_id, device)  # (B, S)
        pos = stay[:, None] + position_ids_from_mask(mask)  # (B, S) positions in the whole conversation
        attn = torch.cat([old, mask.to(old.dtype)], 1)  # (B, C+S)
        logits = dec.step(ids, attn, pos)  # (B, V) at each row's last token
        prompt_ids, prompt_mask = left_pad(prompts, params.pad_token_id, device)
        return Start(dec, logits, attn, torch.tensor([len(p) for p in prompts], device=device), prompt_ids,
                     prompt_mask, [kept.fed[i][:m] + s for i, m, s in zip(at, n, suffix)], [kept.base[i] for i in at])

    def keep(self, start: Start, tokens: Tensor, lengths: Tensor, rows) -> None:
        """Keep the cache this call leaves for the next turn: `start`'s columns, then one per decode
        step, each fed a sampled token; a row keeps those of its completion but the last token (a
        finished row's stop token and pads, fed while others decoded, become holes, so a later turn
        always feeds the last sampled token and what follows it). tokens (B, T), lengths (B,): this
        call's completions; rows: `generate`'s (None: 0...B-1)."""
        B, T = tokens.shape
        steps = torch.arange(T - 1, device=tokens.device)[None, :] < (lengths[:, None] - 1)  # (B, T-1) kept
        attn = torch.cat([start.attn, steps.to(start.attn.dtype)], 1)
        offset = rows[0] if rows is not None else 0
        index = range(offset, offset + B) if isinstance(offset, int) else offset.tolist()
        fed = [f + s[:max(n - 1, 0)] for f, s, n in zip(start.fed, tokens.tolist(), lengths.tolist())]
        self.kept = _Kept(start.dec, attn, fed, start.base or [len(f) for f in start.fed],
                          {r: j for j, r in enumerate(index)})
