"""Which decoder a model gets, and gspo's hand-written compact decode step for the Llama family.

    dec = decoder(model, max_len)        # FastDecoder, LayerDecoder or HFDecoder, by the model and its device
    logits = dec.prefill(ids, mask, pos) # (N, V) last-position logits of N prompts
    dec.expand(G)                        # share each prompt's KV cache with its G samples
    logits = dec.step(tok, attn, pos)    # (B, V) one token per row
    dec.reach(max_len); dec.select(rows) # a later turn (gspo.sampling.turncache): go on with rows of the cache,
    logits = dec.step(ids, attn, pos)    # (B, V) and feed a chunk ids (B, S) after it
    kind, why = path(model, max_len)     # what `decoder` gives, in words for the plan (`describe`)

Three decoders.
- `FastDecoder` (here): the hand-written step. Dense Llama, Mistral, Qwen2, Qwen3 and the
  Qwen2-MoE / Qwen3-MoE families (RMSNorm, rotary, SiLU-gated MLP or experts, optional QKV bias
  and Q/K norms), LoRA adapters included (gspo.models.adapters.lin: each projection's active
  adapters added as PEFT adds them). Where it serves, it is the fastest on the CPU.
- `LayerDecoder` (gspo.sampling.layerdecode): the model's own forward over gspo's KV cache and
  masks, for any other decoder-only model (Gemma 3, Phi-3, OLMo 2, granite, SmolLM3, ...; LoRA
  through the model's own PEFT modules); on a CUDA device for every model a graph can serve, with
  a static cache and the step captured in a CUDA graph (gspo.sampling.graphs).
- `HFDecoder` (gspo.sampling.hfdecode): Hugging Face's forward, where neither serves; the reason is
  said in the plan.

Why a hand-written step. On CPU, a Hugging Face decode step for a 35M-parameter Qwen3 at 32 rows spends ~22 ms
walking modules, building a causal mask and growing the KV cache by concatenation, for
~10-14 ms of weight traffic. `FastDecoder` runs the same mathematics as a flat loop of
`F.linear` calls on the model's own weights (no packed or transposed copy of them is made),
a KV cache of its own seeded from Hugging Face's prefill (gspo.sampling.kvcache.Columns), and the
model's own rotary-embedding module for identical cos/sin.

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

Safety. The hand-written step is used only for the decoders it knows, not for MoE blocks or
routers of other kinds, LoRA variants or adapters on modules it reads as weights (the reason names
the layer and class; such models get `LayerDecoder`), or sliding windows the rollout would reach.
And every rollout checks it: the first decode step is computed both ways and must agree (1e-3 on
the logits in fp32), or the rollout continues with Hugging Face's forward
(gspo.sampling.hfdecode.Checked). The log-probs it records equal a full-sequence recomputation
to 1e-5 (tests/test_rollout.py, tests/test_decode_families.py).

FSDP. A sharded model is decoded with its parameters gathered (gspo.processes.parallel.gathered): the
compact step then reads plain tensors, in the MixedPrecisionPolicy's dtype; `describe` says
which path a run takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gspo.models.adapters import lin, unsupported_adapters
from gspo.models.fastmoe import mlp_step, unsupported_mlp
from gspo.models.lmhead import fused_head
from gspo.sampling import graphs, layerdecode
from gspo.sampling.hfdecode import Checked, HFDecoder
from gspo.sampling.kvcache import BLOCK, Columns

Tensor = torch.Tensor

__all__ = ["BLOCK", "FastDecoder", "HFDecoder", "LayerDecoder", "decoder", "describe", "path", "unsupported"]

LayerDecoder = layerdecode.LayerDecoder
FAST_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"}
# the modules the hand-written step computes through `lin` or calls (a LoRA adapter there is applied)
REACHED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate",
           "embed_tokens"}


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


class FastDecoder(Checked):
    """Prefill with Hugging Face, then compact decode steps over the model's own weights."""

    def __init__(self, model, max_len: int):
        super().__init__(model, max_len)
        cfg = model.config
        a0 = self.backbone.layers[0].self_attn
        self.head_dim = a0.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.scaling = a0.scaling
        self.cols: Columns | None = None

    @staticmethod
    def supports(model, max_len: int) -> bool:
        return unsupported_compact(model, max_len) is None

    def expand(self, group_size: int) -> None:
        super().expand(group_size)  # the DynamicCache too: it is the fallback and the check's reference
        self.cols = Columns.seed(self.cache, self.width, max_len=self.max_len)
        self._tables()

    def _tables(self) -> None:
        """cos/sin of every position this rollout can reach, from the model's own rotary module."""
        k = self.cols.k[0]
        positions = torch.arange(self.max_len, device=k.device)[None]  # (1, max_len)
        probe = torch.zeros((1, 1, 1), dtype=k.dtype, device=k.device)
        cos, sin = self.backbone.rotary_emb(probe, positions)  # (1, max_len, hd)
        self.cos, self.sin = cos[0], sin[0]  # (max_len, hd)

    def select(self, rows: Tensor) -> None:
        if not self.fallback:
            self.cols.select(rows)
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
            self.max_len = self.cols.max_len = max_len
            self._tables()
        return True

    def _fast_step(self, tok: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
        tok, pos = (tok, pos) if tok.dim() == 2 else (tok[:, None], pos[:, None])  # (B, S): a chunk, or S = 1
        S, hd, cols = tok.shape[1], self.head_dim, self.cols
        cols.reserve(S)
        real = attn[:, cols.t:cols.t + S].bool() if S > 1 else None  # (B, S) a chunk's tokens, its padding not computed
        ids, pos = (tok[:, 0], pos[:, 0]) if real is None else (tok[real], pos[real])  # (N,) a row per token
        x = self.backbone.embed_tokens(ids)  # (N, H)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (N, 1, hd)
        mask = cols.masks(attn, S, {None})[None]  # (B, 1, S, t+S) real tokens, causal within a chunk
        for i, layer in enumerate(self.backbone.layers):
            a, mlp = layer.self_attn, layer.mlp
            h = _rms(x, layer.input_layernorm)  # (N, H)
            q = lin(a.q_proj, h).view(-1, self.n_heads, hd)  # (N, nh, hd)
            k = lin(a.k_proj, h).view(-1, self.n_kv, hd)
            v = lin(a.v_proj, h).view(-1, self.n_kv, hd)
            if hasattr(a, "q_norm"):
                q, k = _rms(q, a.q_norm), _rms(k, a.k_norm)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            q, k, v = _spread(q, real), _spread(k, real), _spread(v, real)  # (B, heads, S, hd)
            keys, values = cols.write(i, k, v)  # (B, n_kv, t+S, hd)
            # (B, nh, S, hd)
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                                 enable_gqa=self.n_heads != self.n_kv)
            att = att[:, :, 0] if real is None else att.transpose(1, 2)[real]  # (N, nh, hd)
            x = x + lin(a.o_proj, att.reshape(x.shape[0], -1))  # (N, H)
            h = _rms(x, layer.post_attention_layernorm)
            x = x + mlp_step(mlp, h)  # (N, H) dense or sparse MoE (gspo.models.fastmoe: the router module runs)
        cols.advance(S)
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


def unsupported_compact(model, max_len: int) -> str | None:
    """Why the hand-written step does not serve `model` for rollouts of up to `max_len` tokens; None
    when it does. An FSDP-sharded model qualifies only while its parameters are gathered (the head
    must be a plain tensor)."""
    cfg = model.config
    if cfg.model_type not in FAST_MODEL_TYPES:
        return f"model_type {cfg.model_type} is not one of {', '.join(sorted(FAST_MODEL_TYPES))}"
    fused = fused_head(model)  # (backbone, head)
    if fused is None:
        return "its LM head is not a plain bias-free linear map of the last hidden state"
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return "its MLP is not a bias-free SiLU-gated one"
    why = unsupported_mlp(fused[0].layers)  # dense, or a sparse MoE block gspo.models.fastmoe knows
    if why is not None:
        return why
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {cfg._attn_implementation}"
    kinds = layerdecode.layer_kinds(model)  # as its forward masks its layers
    if isinstance(kinds, str):
        return kinds
    passed = [w for w in layerdecode.windows(model, max_len) if w is not None]
    if passed:
        return f"rollouts of {max_len} tokens pass its sliding window of {passed[0]}"
    if hasattr(model, "get_base_model"):  # PEFT: every adapter where the step applies it
        why = unsupported_adapters(model, lambda name: name.rpartition(".")[2] in REACHED)
        if why is not None:
            return why
    return None


def path(model, max_len: int, *, cuda_graphs: bool = True) -> tuple[str, str | None]:
    """The decoder `decoder` gives `model`: ("graphs", None) the model's own layers captured in a CUDA
    graph; ("fast", None) the hand-written step; ("layers", why) the model's own layers, eagerly, and
    why not the hand-written step (or graphs); ("hf", why) Hugging Face's forward, and why."""
    no_graph = graphs.why_not(model) if cuda_graphs else "--cuda-graphs is off"
    layers_why = layerdecode.unsupported(model, max_len)
    if layers_why is None and no_graph is None:
        return "graphs", None
    compact_why = unsupported_compact(model, max_len)
    if compact_why is None:
        return "fast", None
    if layers_why is None:
        on_cuda = next(model.parameters()).device.type == "cuda"
        return "layers", (f"CUDA graphs: {no_graph}; " if on_cuda else "") + f"the hand-written step: {compact_why}"
    return "hf", f"{compact_why}; and the model's own layers over gspo's cache: {layers_why}"


def unsupported(model, max_len: int) -> str | None:
    """Why `model` decodes with Hugging Face's forward rather than one of gspo's steps, for rollouts of
    up to `max_len` tokens; None when gspo's hand-written step or its step over the model's layers serves it."""
    kind, why = path(model, max_len)
    return why if kind == "hf" else None


def describe(model, max_len: int, *, cuda_graphs: bool = True) -> str:
    """The decode path `generate` takes for `model`, in words (for the run's start-up notes)."""
    kind, why = path(model, max_len, cuda_graphs=cuda_graphs)
    return words(kind, why)


WORDS = {"fast": "the compact decode step (gspo.sampling.fastdecode)",
         "graphs": "the compact decode step over the model's own layers, in CUDA graphs (gspo.sampling.layerdecode)",
         "layers": "the compact decode step over the model's own layers (gspo.sampling.layerdecode; {why})",
         "hf": "Hugging Face's forward ({why})"}


def words(kind: str, why: str | None) -> str:
    """`path`'s answer in words (each of gspo's own steps starts "the compact decode step")."""
    return WORDS[kind].format(why=why)


def kind_of(text: str) -> tuple[str, str | None]:
    """`words` read back: (kind, why) of a decode path said in words (an FSDP run's start-up note)."""
    for kind, pattern in WORDS.items():
        head, _, tail = pattern.partition("{why}")
        if pattern == text:
            return kind, None
        if tail and text.startswith(head) and text.endswith(tail):
            return kind, text[len(head):len(text) - len(tail)]
    raise ValueError(f"not a decode path: {text!r}")


def decoder(model, max_len: int, *, cuda_graphs: bool = True) -> HFDecoder:
    kind, _ = path(model, max_len, cuda_graphs=cuda_graphs)
    if kind == "graphs":
        return LayerDecoder(model, max_len, static=True, graphs=graphs.Runner())
    if kind == "fast":
        return FastDecoder(model, max_len)
    if kind == "layers":
        return LayerDecoder(model, max_len)
    return HFDecoder(model)
