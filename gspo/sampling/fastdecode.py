"""Decoding steps for the sampling loop: Hugging Face's forward, or a compact one for Llama-family models.

    dec = decoder(model, max_len)        # FastDecoder when the model qualifies, else HFDecoder
    logits = dec.prefill(ids, mask, pos) # (N, V) last-position logits of N prompts
    dec.expand(G)                        # share each prompt's KV cache with its G samples
    logits = dec.step(tok, attn, pos)    # (B, V) one token per row
    dec.reach(max_len); dec.select(rows) # a later turn (gspo.sampling.turncache): go on with rows of the cache,
    logits = dec.step(ids, attn, pos)    # (B, V) and feed a chunk ids (B, S) after it

Why. On CPU, a Hugging Face decode step for a 35M-parameter Qwen3 at 32 rows spends ~22 ms
walking modules, building a causal mask and growing the KV cache by concatenation, for
~10-14 ms of weight traffic. `FastDecoder` runs the same mathematics as a flat loop of
`F.linear` calls on the model's own weights (no packed or transposed copy of them is made),
a KV cache of its own seeded from Hugging Face's prefill, and the model's own
rotary-embedding module for identical cos/sin.

Memory. The KV cache grows with what is generated: it starts at the prompt width plus
`BLOCK` columns and doubles when full, up to the longest possible completion, so a rollout
whose completions stop early never holds prompt + max_new_tokens columns for every row.

Later turns (gspo.sampling.turncache). A decoder is kept from one turn of multi-turn episodes to the
next: `select` keeps the rows still running, `reach` extends it to the new turn's columns (or
says it cannot: a sliding window), and `step` feeds a chunk of S tokens per row at once (the
compact step computes the chunk's real tokens as rows, its padding only inside attention, which
is causal within the chunk, holes masked by `attn`).
The chunk goes through the same compact step as one token does, so a rollout's first-step check
holds for its later turns (same weights, same code); a chunk that comes before any decode step
of the rollout is itself computed both ways and checked.

MoE. Qwen3-MoE and Qwen2-MoE decode the same way, their sparse blocks computed by
gspo.models.fastmoe, which calls each layer's router module: gspo.models.moe's hooks then record (or force)
the experts exactly as in Hugging Face's forward, so `Rollout.routing` and Routing Replay are
unchanged (tests/test_fastdecode_moe.py).

Safety. It is used only for Llama-family decoders it knows (Llama, Mistral, Qwen2, Qwen3,
Qwen2-MoE, Qwen3-MoE: RMSNorm, rotary, SiLU-gated MLP or experts, optional QKV bias and Q/K
norms), not for PEFT-wrapped models, MoE blocks or routers of other kinds (the reason names
the layer and class), or sliding windows that the rollout would reach. And every rollout checks
it: the first decode step is computed both ways and must agree (1e-3 on the logits in fp32),
or the rollout continues with Hugging Face's forward (said once, in a warning line); an MoE
model's routing is recorded for that step once, from the computation whose logits are used
(gspo.models.moe.held). The log-probs it records equal a full-sequence recomputation to 1e-5
(tests/test_rollout.py).

FSDP. A sharded model is decoded with its parameters gathered (gspo.processes.parallel.gathered): the
compact step then reads plain tensors, in the MixedPrecisionPolicy's dtype; `describe` says
which path a run takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version

from gspo.io.reporting import warn
from gspo.models.fastmoe import mlp_step, unsupported_mlp
from gspo.models.lmhead import fused_head
from gspo.models.moe import held, keep

Tensor = torch.Tensor

FAST_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"}
BLOCK = 64  # KV-cache columns added beyond the prompt at first; the cache doubles when full
CHECK_TOL = {torch.float32: 1e-3, torch.float64: 1e-6}  # bf16/fp16: 0.25
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
        return self._forward(ids, attn, pos)

    def expand(self, group_size: int) -> None:
        if group_size > 1:
            self.cache.batch_repeat_interleave(group_size)

    def step(self, tok: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
        """tok, pos (B,): one token per row; or (B, S): a chunk (a later turn, gspo.sampling.turncache), left-padded so
        that each row's last token is the last column. attn covers every cache column. Logits (B, V) there."""
        return self._forward(tok, attn, pos) if tok.dim() == 2 else self._forward(tok[:, None], attn, pos[:, None])

    def select(self, rows: Tensor) -> None:
        """Keep rows `rows` (R,) of the cache, in that order (the episodes a later turn samples)."""
        self.cache.batch_select_indices(rows)

    def reach(self, max_len: int) -> bool:
        """Whether the cache can go on to `max_len` columns, holes among them (a later turn): Hugging
        Face's plain DynamicCache, and no sliding window (its mask counts columns, not real tokens)."""
        from transformers.cache_utils import DynamicLayer

        window = getattr(self.model.config, "sliding_window", None)
        layers = getattr(self.cache, "layers", None) or [None]
        return all(type(layer) is DynamicLayer for layer in layers) and not (window and max_len > window)


def _rms(x: Tensor, norm) -> Tensor:
    """Hugging Face's RMSNorm module `norm` applied to x: in fp32, scaled by the weight after
    casting back (one fused op when the model is fp32 already)."""
    weight, eps = norm.weight, norm.variance_epsilon
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FastDecoder(HFDecoder):
    """Prefill with Hugging Face, then compact decode steps over the model's own weights."""

    def __init__(self, model, max_len: int):
        super().__init__(model)
        cfg = model.config
        self.max_len = max_len
        a0 = self.backbone.layers[0].self_attn
        self.head_dim = a0.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.scaling = a0.scaling
        self.checked = False
        self.fallback = False

    @staticmethod
    def supports(model, max_len: int) -> bool:
        return unsupported(model, max_len) is None

    def expand(self, group_size: int) -> None:
        super().expand(group_size)  # the DynamicCache too: it is the fallback and the check's reference
        first = self.cache.layers[0].keys  # (B, n_kv, P, hd)
        B, _, P, hd = first.shape
        cap = min(self.max_len, P + BLOCK)
        self.k = first.new_zeros((len(self.cache.layers), B, self.n_kv, cap, hd))  # (L, B, n_kv, cap, hd)
        self.v = torch.zeros_like(self.k)
        for i, lay in enumerate(self.cache.layers):
            self.k[i, :, :, :P] = lay.keys
            self.v[i, :, :, :P] = lay.values
        self.t = P  # next cache column
        self._tables()

    def _tables(self) -> None:
        """cos/sin of every position this rollout can reach, from the model's own rotary module."""
        positions = torch.arange(self.max_len, device=self.k.device)[None]  # (1, max_len)
        probe = torch.zeros((1, 1, 1), dtype=self.k.dtype, device=self.k.device)
        cos, sin = self.backbone.rotary_emb(probe, positions)  # (1, max_len, hd)
        self.cos, self.sin = cos[0], sin[0]  # (max_len, hd)

    def _grow(self, n: int = 1) -> None:
        """Double the KV cache's columns (up to max_len; at least enough) when the next n tokens would not fit."""
        cap = self.k.shape[3]
        if self.t + n <= cap:
            return
        more = max(self.t + n - cap, min(cap, self.max_len - cap))
        empty = self.k.new_zeros((*self.k.shape[:3], more, self.k.shape[4]))
        self.k, self.v = torch.cat([self.k, empty], 3), torch.cat([self.v, empty], 3)

    def select(self, rows: Tensor) -> None:
        if not self.fallback:
            self.k, self.v = self.k.index_select(1, rows), self.v.index_select(1, rows)
        if self.cache is not None:  # Hugging Face's: the fallback, or the first step's check still to come
            super().select(rows)

    def reach(self, max_len: int) -> bool:
        """HFDecoder.reach; the compact step must still serve `max_len` (a sliding window), whose cos/sin it adds."""
        if (self.fallback or self.cache is not None) and not super().reach(max_len):
            return False
        if self.fallback:
            return True
        if not self.supports(self.model, max_len):
            return False
        if max_len > self.max_len:
            self.max_len = max_len
            self._tables()
        return True

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
            _say_fallback(float((logits.float() - reference.float()).abs().max()), tol)
            return reference
        keep(fast_routing)
        self.checked = True
        self.cache = None  # the fast cache carries on alone
        return logits

    def _fast_step(self, tok: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
        tok, pos = (tok, pos) if tok.dim() == 2 else (tok[:, None], pos[:, None])  # (B, S): a chunk, or S = 1
        S, hd, t = tok.shape[1], self.head_dim, self.t
        self._grow(S)
        real = attn[:, t:t + S].bool() if S > 1 else None  # (B, S) a chunk's tokens, its padding not computed
        ids, pos = (tok[:, 0], pos[:, 0]) if real is None else (tok[real], pos[real])  # (N,) a row per token
        x = self.backbone.embed_tokens(ids)  # (N, H)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (N, 1, hd)
        mask = attn[:, None, None, : t + S].bool()  # (B, 1, 1, t+S) real tokens only
        if S > 1:  # and causal within the chunk
            mask = mask & torch.ones((S, t + S), dtype=torch.bool, device=mask.device).tril(t)  # (B, 1, S, t+S)
        for i, layer in enumerate(self.backbone.layers):
            a, mlp = layer.self_attn, layer.mlp
            h = _rms(x, layer.input_layernorm)  # (N, H)
            q = F.linear(h, a.q_proj.weight, a.q_proj.bias).view(-1, self.n_heads, hd)  # (N, nh, hd)
            k = F.linear(h, a.k_proj.weight, a.k_proj.bias).view(-1, self.n_kv, hd)
            v = F.linear(h, a.v_proj.weight, a.v_proj.bias).view(-1, self.n_kv, hd)
            if hasattr(a, "q_norm"):
                q, k = _rms(q, a.q_norm), _rms(k, a.k_norm)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            q, k, v = _spread(q, real), _spread(k, real), _spread(v, real)  # (B, heads, S, hd)
            self.k[i, :, :, t:t + S] = k
            self.v[i, :, :, t:t + S] = v
            # (B, nh, S, hd)
            att = F.scaled_dot_product_attention(q, self.k[i, :, :, : t + S], self.v[i, :, :, : t + S], attn_mask=mask,
                                                 scale=self.scaling, enable_gqa=self.n_heads != self.n_kv)
            att = att[:, :, 0] if real is None else att.transpose(1, 2)[real]  # (N, nh, hd)
            x = x + F.linear(att.reshape(x.shape[0], -1), a.o_proj.weight, a.o_proj.bias)  # (N, H)
            h = _rms(x, layer.post_attention_layernorm)
            x = x + mlp_step(mlp, h)  # (N, H) dense or sparse MoE (gspo.models.fastmoe: the router module runs)
        self.t += S
        last = x if real is None else x[real.sum(1).cumsum(0) - 1]  # (B, H) each row's last token
        return F.linear(_rms(last, self.backbone.norm), self.head.weight)  # (B, V)


def _spread(y: Tensor, real: Tensor | None) -> Tensor:
    """(N, heads, hd) of the tokens computed -> (B, heads, S, hd), zeros at a chunk's padding
    (`real` (B, S); None: one token per row, N = B)."""
    if real is None:
        return y[:, :, None]
    out = y.new_zeros((*real.shape, *y.shape[1:]))  # (B, S, heads, hd)
    out[real] = y
    return out.transpose(1, 2)


_said = []  # the fallback is said once per process


def _say_fallback(diff: float, tol: float) -> None:
    if not _said:
        warn(f"fastdecode: the compact decode step's logits differ from Hugging Face's forward by {diff:.3g} "
             f"(> {tol:g}) at a rollout's first step; such rollouts decode with Hugging Face's forward (slower)")
        _said.append(True)


def unsupported(model, max_len: int) -> str | None:
    """Why `model` decodes with Hugging Face's forward rather than the compact step, for
    rollouts of up to `max_len` tokens; None when the compact step serves it. An FSDP-sharded
    model qualifies only while its parameters are gathered (the head must be a plain tensor)."""
    if hasattr(model, "get_base_model"):
        return "a PEFT model"
    fused = fused_head(model)  # (backbone, head)
    if fused is None:
        return "its LM head is not a plain bias-free linear map of the last hidden state"
    cfg = model.config
    if cfg.model_type not in FAST_MODEL_TYPES:
        return f"model_type {cfg.model_type} is not one of {', '.join(sorted(FAST_MODEL_TYPES))}"
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return "its MLP is not a bias-free SiLU-gated one"
    why = unsupported_mlp(fused[0].layers)  # dense, or a sparse MoE block gspo.models.fastmoe knows
    if why is not None:
        return why
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {cfg._attn_implementation}"
    window = getattr(cfg, "sliding_window", None)
    uses_window = (getattr(cfg, "use_sliding_window", True)
                   or "sliding_attention" in (getattr(cfg, "layer_types", None) or []))
    if window is not None and uses_window and max_len > window:
        return f"rollouts of {max_len} tokens pass its sliding window of {window}"
    return None


def describe(model, max_len: int) -> str:
    """The decode path `generate` takes for `model`, in words (for the run's start-up notes)."""
    why = unsupported(model, max_len)
    return "the compact decode step (gspo.sampling.fastdecode)" if why is None else f"Hugging Face's forward ({why})"


def decoder(model, max_len: int) -> HFDecoder:
    return FastDecoder(model, max_len) if FastDecoder.supports(model, max_len) else HFDecoder(model)
