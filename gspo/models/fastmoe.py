"""The compact decode step's MLPs (gspo.sampling.fastdecode): a dense SiLU-gated MLP, or a sparse MoE block.

    out = mlp_step(layer.mlp, h)        # (N, H) -> (N, H), a row per token
    why = unsupported_mlp(layers)       # None when every layer's MLP is one of these

Sparse blocks are those of Qwen3-MoE and Qwen2-MoE in transformers 5: a `*TopKRouter` module
(softmax over the experts, top-k, renormalised when `norm_topk_prob`) and experts stored as 3-D
weights, `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I); Qwen2-MoE adds a shared expert,
scaled by sigmoid(shared_expert_gate(h)). Layers a config keeps dense (`mlp_only_layers`,
`decoder_sparse_step`) hold a plain MLP and take the dense path.

Routing. The router *module* is called, so its forward hooks fire: gspo.models.moe records (or, under
Routing Replay, forces) the experts exactly as in Hugging Face's forward, and the gates used
are the hook's.

Experts. On CPU they are computed here as transformers' `grouped_mm` experts compute them: the
(token, slot) pairs sorted by expert, two grouped matmuls, each pair's output scaled by its gate
and a token's k outputs summed, without the experts module's dispatch, histogram and reshapes.
On tiny-long-moe at 64 rows that makes the compact step ~4% faster than calling the experts
module after the router, and ~10% faster than calling the whole block module
(benchmarks/moe_decode.py --variants). Elsewhere (a GPU, where transformers picks its kernels
and fallbacks by device and dtype; float64; a torch without `grouped_mm`) the model's own
experts module computes them, after the same router call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gspo.models.adapters import lin

Tensor = torch.Tensor

SPARSE_BLOCKS = ("Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock")


def dense_mlp(mlp, h: Tensor) -> Tensor:
    """A bias-free SiLU-gated MLP: down(silu(gate(h)) · up(h)) (LoRA adapters on its projections applied:
    gspo.models.adapters.lin)."""
    return lin(mlp.down_proj, F.silu(lin(mlp.gate_proj, h)) * lin(mlp.up_proj, h))


def _grouped(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """x (S, in) rows grouped by expert (`offsets`: cumulative row counts) through weight (E, out, in)."""
    return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


def grouped_here(h: Tensor) -> bool:
    """Whether `experts_step` computes the experts for h (else the model's experts module does)."""
    return h.device.type == "cpu" and hasattr(F, "grouped_mm") and h.dtype in (torch.float32, torch.bfloat16,
                                                                                torch.float16)


def experts_step(experts, h: Tensor, chosen: Tensor, gates: Tensor) -> Tensor:
    """Σ_j gates[:, j] · expert_{chosen[:, j]}(h): h (B, H), chosen and gates (B, k) -> (B, H)."""
    B, k = chosen.shape
    flat = chosen.reshape(-1)  # (B·k,)
    _, order = flat.sort()  # (token, slot) pairs grouped by expert
    offsets = torch.bincount(flat, minlength=experts.gate_up_proj.shape[0]).cumsum(0).to(torch.int32)  # (E,)
    x = h[order // k].to(experts.gate_up_proj.dtype)  # (B·k, H)
    gate, up = _grouped(x, experts.gate_up_proj, offsets).chunk(2, dim=-1)  # (B·k, I) each
    y = _grouped(F.silu(gate) * up, experts.down_proj, offsets) * gates.reshape(-1)[order, None]  # (B·k, H)
    out = torch.empty_like(y)
    out[order] = y  # back to (token, slot) order
    return out.view(B, k, -1).sum(1).to(h.dtype)


def sparse_moe(block, h: Tensor) -> Tensor:
    """A Qwen3-MoE / Qwen2-MoE sparse block on h (N, H) -> (N, H)."""
    _, gates, chosen = block.gate(h)  # the router module: gspo.models.moe's hooks record (or force) the experts
    if grouped_here(h):
        out = experts_step(block.experts, h, chosen, gates)
    else:  # the model's own experts module (transformers' kernels for the device and dtype)
        out = block.experts(h, chosen, gates)
    if hasattr(block, "shared_expert"):  # Qwen2-MoE
        out = out + torch.sigmoid(lin(block.shared_expert_gate, h)) * dense_mlp(block.shared_expert, h)
    return out


def mlp_step(mlp, h: Tensor) -> Tensor:
    """One decoder layer's MLP on h (N, H): dense, or a sparse MoE block."""
    return dense_mlp(mlp, h) if hasattr(mlp, "gate_proj") else sparse_moe(mlp, h)


def _unknown_block(block) -> str | None:
    """What about a sparse block's router or experts the compact step does not compute; None if nothing."""
    if not type(block.gate).__name__.endswith("TopKRouter"):
        return f"its router is a {type(block.gate).__name__}, not a TopKRouter module"
    ex = block.experts
    layout = (getattr(ex, "has_gate", True), getattr(ex, "has_bias", False), getattr(ex, "is_transposed", False),
              getattr(ex, "is_concatenated", True), getattr(ex, "has_post_expert_norm", False))
    if layout != (True, False, False, True, False) or getattr(ex, "gate_up_proj", torch.empty(0)).dim() != 3:
        return f"its experts ({type(ex).__name__}) are not bias-free gated experts with 3-D [gate; up] weights"
    if hasattr(block, "shared_expert") and (block.shared_expert_gate.bias is not None or
                                             not hasattr(block.shared_expert, "gate_proj")):
        return "its shared expert is not a bias-free SiLU-gated MLP with a bias-free gate"
    return None


def unsupported_mlp(layers) -> str | None:
    """Why some decoder layer's MLP is not one `mlp_step` computes (naming the layer and its
    class); None when all are."""
    for i, layer in enumerate(layers):
        mlp, name = layer.mlp, type(layer.mlp).__name__
        if hasattr(mlp, "gate_proj"):
            continue
        if name not in SPARSE_BLOCKS:
            return f"layer {i}'s MLP is a {name}, which the compact decode step does not know"
        why = _unknown_block(mlp)
        if why is not None:
            return f"layer {i}'s {name}: {why}"
    return None
