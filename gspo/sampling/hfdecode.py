"""Hugging Face's forward as a decoder, and the first-step check every faster decoder runs against it.

    dec = HFDecoder(model)
    logits = dec.prefill(ids, mask, pos)  # (N, V) last-position logits of N prompts
    dec.expand(G)                         # share each prompt's KV cache with its G samples
    logits = dec.step(tok, attn, pos)     # (B, V) one token per row; (B, S) ids: a chunk (a later turn)

`Checked` is the base of gspo's faster decoders (gspo.sampling.fastdecode's hand-written step,
gspo.sampling.layerdecode's step over the model's own layers): they prefill with Hugging Face's forward,
and the first decode step of every rollout is computed both ways. If the logits differ by more than
`CHECK_TOL` the rollout goes on with Hugging Face's forward (said once per process, in a warning
line) and the faster decoder's answer is never used; an MoE model's routing is recorded once, from
the computation whose logits are returned (gspo.models.moe.held). Left out: checking later steps
(the same code, on the same weights, as the first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version

from gspo.io.reporting import warn
from gspo.models.lmhead import fused_head
from gspo.models.moe import held, keep
from gspo.sampling.kvcache import bidirectional, layer_kinds, text_config, windows

Tensor = torch.Tensor

CHECK_TOL = {torch.float32: 1e-3, torch.float64: 1e-6}  # bf16/fp16: 0.25


class DecodeError(ValueError):
    """A rollout no decoder can sample so that the training forward gives its log-probs (`why_inexact`)."""


def why_inexact(model, max_len: int) -> str | None:
    """Why no decode step can record the training forward's log-probs for rollouts of up to `max_len`
    positions; None when one can.
    - Rotary scaling chosen by the sequence's length (transformers' `dynamic_rope_update`): LongRoPE
      (Phi-3-128k) rotates with its short factors up to `original_max_position_embeddings` and its long
      ones past it, dynamic NTK rescales past `max_position_embeddings`, each from the longest position
      a forward sees. A decode step sees the positions so far, the training forward the whole sequence:
      past the threshold the keys cached early were rotated otherwise than the training forward rotates them.
    - A config that asks for bidirectional attention (`kvcache.bidirectional`)."""
    why = bidirectional(text_config(model))
    if why is not None:
        return why
    for m in model.modules():
        kinds = getattr(m, "rope_type", None)
        if kinds is None or not hasattr(m, "original_max_seq_len"):
            continue
        for layer_type, kind in (kinds.items() if isinstance(kinds, dict) else [(None, kinds)]):
            if kind == "longrope":
                params = getattr(m.config, "rope_parameters", None) or {}
                params = params.get(layer_type, params) if layer_type else params
                limit = params.get("original_max_position_embeddings") or \
                    getattr(m.config, "original_max_position_embeddings", None) or m.original_max_seq_len
            elif "dynamic" in kind:
                limit = m.original_max_seq_len
            else:
                continue
            if max_len > limit:
                return (f"its rotary scaling ({kind}) is chosen by each forward's longest position: a rollout of "
                        f"{max_len} positions, past {limit}, would be sampled with other rotary factors than the "
                        f"training forward uses; keep prompt + completion within {limit} tokens "
                        f"(--max-prompt-length, --max-new-tokens)")
    return None
# the KV cache's name, as a forward's argument and on its output: transformers 5.24 renamed
# past_key_values to cache (the old name still works there, with a FutureWarning every call site sees)
CACHE = "cache" if Version(transformers.__version__) >= Version("5.24.0.dev0") else "past_key_values"


class HFDecoder:
    """The model's own forward with a DynamicCache and logits for the last position only."""

    def __init__(self, model):
        self.model = model
        fused = fused_head(model)
        self.backbone, self.head = fused if fused is not None else (None, None)
        self.cache = None

    def _forward(self, ids, attn, pos):
        if self.backbone is None:
            out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                             **{CACHE: self.cache})
            self.cache = getattr(out, CACHE)
            return out.logits[:, -1]
        out = self.backbone(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **{CACHE: self.cache})
        self.cache = getattr(out, CACHE)
        return F.linear(out.last_hidden_state[:, -1], self.head.weight)  # (B, V)

    def prefill(self, ids: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
        """A model of attention layers alone (gspo.sampling.kvcache.layer_kinds) gets a plain DynamicCache,
        every column kept: the one its forward makes from its config drops all but the last window-1 columns
        of every layer whenever the config has a `sliding_window`, even where the forward's masks never slide
        (a Llama config carrying one), and the decode then differs from the training forward. Any other model
        (state-space, convolution or linear-attention layers) gets the cache its own forward makes."""
        from transformers.cache_utils import DynamicCache

        self.rows, self.width = ids.shape  # the prompts, and the cache's columns after it
        self.cache = DynamicCache() if not isinstance(layer_kinds(self.model), str) else None
        return self._forward(ids, attn, pos)

    def expand(self, group_size: int) -> None:
        if group_size > 1:
            for layer in self.cache.layers:
                _repeat_rows(layer, group_size, self.rows)

    def step(self, tok: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
        """tok, pos (B,): one token per row; or (B, S): a chunk (a later turn, gspo.sampling.turncache), left-padded so
        that each row's last token is the last column. attn covers every cache column. Logits (B, V) there."""
        return self._forward(tok, attn, pos) if tok.dim() == 2 else self._forward(tok[:, None], attn, pos[:, None])

    def select(self, rows: Tensor) -> None:
        """Keep rows `rows` (R,) of the cache, in that order (the episodes a later turn samples)."""
        self.cache.batch_select_indices(rows)

    def reach(self, max_len: int) -> bool:
        """Whether the cache can go on to `max_len` columns, holes among them (a later turn): Hugging
        Face's plain DynamicCache, and no sliding window it would pass (its mask counts columns, not real
        tokens)."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(self.cache, "layers", None) or [None]
        kinds = layer_kinds(self.model)
        return (all(type(layer) is DynamicLayer for layer in layers) and not isinstance(kinds, str)
                and all(w is None for w in windows(self.model, max_len)))


def _repeat_rows(layer, group_size: int, rows: int) -> None:
    """Each of a cache layer's `rows` rows G times, in place of it: its keys and values by its own
    `batch_repeat_interleave`, and any other state it holds, alone or in a dict or list (a linear-attention
    or convolution layer's conv and recurrent states, which transformers 5.24's layers do not repeat), that
    is a tensor whose first dimension is still `rows`."""
    if hasattr(layer, "batch_repeat_interleave"):
        layer.batch_repeat_interleave(group_size)

    def rep(v):
        return v.repeat_interleave(group_size, 0) if isinstance(v, Tensor) and v.dim() > 1 and v.shape[0] == rows else v

    for name, value in list(vars(layer).items()):
        if name in ("keys", "values"):
            continue
        if isinstance(value, dict):
            setattr(layer, name, {k: rep(v) for k, v in value.items()})
        elif isinstance(value, list):
            setattr(layer, name, [rep(v) for v in value])
        else:
            setattr(layer, name, rep(value))


class Checked(HFDecoder):
    """A faster decoder's frame: Hugging Face's prefill, then `_fast_step` (the subclass's), checked
    against Hugging Face's step at the first decode step of the rollout (module docstring). Until
    then both caches are kept; after it only the fast one (`self.cache` None), or, on a disagreement,
    only Hugging Face's (`fallback`)."""

    def __init__(self, model, max_len: int):
        super().__init__(model)
        self.max_len = max_len
        self.checked = False
        self.fallback = False

    def _fast_step(self, tok: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
        raise NotImplementedError

    def step(self, tok: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
        if self.fallback:
            return super().step(tok, attn, pos)
        if self.checked:
            return self._fast_step(tok, attn, pos)
        # the first decode step of every rollout is computed both ways; an MoE model's routing
        # (gspo.models.moe) is recorded for the one whose logits are returned, once
        with held() as fast_routing:
            logits = self._fast_step(tok, attn, pos)
        with held() as hf_routing:
            reference = super().step(tok, attn, pos)
        tol = CHECK_TOL.get(logits.dtype, 0.25)
        if not torch.allclose(logits.float(), reference.float(), atol=tol, rtol=0):
            self.fallback = True
            keep(hf_routing)
            say_fallback(type(self).__name__, float((logits.float() - reference.float()).abs().max()), tol)
            return reference
        keep(fast_routing)
        self.checked = True
        self.cache = None  # the fast cache carries on alone
        return logits


_said = []  # the fallback is said once per process


def say_fallback(name: str, diff: float, tol: float) -> None:
    if not _said:
        warn(f"decode: {name}'s decode step's logits differ from Hugging Face's forward by {diff:.3g} "
             f"(> {tol:g}) at a rollout's first step; such rollouts decode with Hugging Face's forward (slower)")
        _said.append(True)
