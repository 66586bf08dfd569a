"""Linear maps as gspo's hand-written decode step computes them: a plain nn.Linear, or a PEFT LoRA Linear.

    y = lin(module, x)                     # module(x), without the module call
    why = unsupported_adapters(model, ok)  # None when every PEFT layer is one `lin` computes, at a place it runs

Why. The compact decode step (gspo.sampling.fastdecode) calls `F.linear` on a projection's weight
instead of calling the module: at decode batch sizes a module call costs as much as the matmul.
A LoRA-wrapped projection's `.weight` is its frozen base weight, so reading it would silently
drop the adapter. `lin` computes what PEFT's `lora.Linear.forward` computes (peft 0.15-0.21):
the base layer, plus for each active adapter B(A(x)) · scaling, x cast to A's dtype where PEFT
casts it, the sum cast back to the base's dtype; nothing when the adapters are disabled or
merged. Dropout is left out: the sampler runs in eval mode, where PEFT's dropout is the identity.

Left out (refused by `unsupported_adapters`, naming the module): LoRA variants (DoRA, aLoRA, ...),
adapters of other kinds (IA3, LoHa, ...), and adapters on a module the step does not reach through
`lin` or a module call (an MoE layer's 3-D expert weights, an LM head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _is_lora_linear(m) -> bool:
    return type(m).__name__ == "Linear" and hasattr(m, "base_layer") and hasattr(m, "lora_A")


def lin(m, x: Tensor) -> Tensor:
    """m(x) for an nn.Linear, or a PEFT LoRA Linear with its active adapters (eval mode)."""
    base = getattr(m, "base_layer", None)
    if base is None:
        return F.linear(x, m.weight, m.bias)
    out = F.linear(x, base.weight, base.bias)
    if m.disable_adapters or m.merged:
        return out
    dtype = out.dtype
    for name in m.active_adapters:
        if name not in m.lora_A:
            continue
        A, B = m.lora_A[name], m.lora_B[name]
        cast = x.dtype != A.weight.dtype and getattr(m, "cast_input_dtype_enabled", True)
        xa = x.to(A.weight.dtype) if cast else x
        out = out + F.linear(F.linear(xa, A.weight), B.weight, B.bias) * m.scaling[name]
    return out.to(dtype)


def unsupported_adapters(model, reached) -> str | None:
    """Why some PEFT layer of `model` is not one `lin` computes where the step runs it; None if none.
    reached(name): whether the step computes the module at `name` (its qualified name) through `lin`
    or by calling the module itself."""
    for name, m in model.named_modules():
        if not hasattr(m, "active_adapters") or not hasattr(m, "base_layer"):
            continue  # not a PEFT tuner layer
        if not _is_lora_linear(m):
            return f"its {type(m).__module__.rpartition('.')[0] or 'peft'} layer {name} ({type(m).__name__})"
        active = set(m.active_adapters)
        dora = {n for n, on in (getattr(m, "use_dora", {}) or {}).items() if on}
        if (set(getattr(m, "lora_variant", {}) or {}) | dora) & active:
            return f"a LoRA variant (DoRA or another) at {name}"
        if not reached(name):
            return f"a LoRA adapter on {name}, which the hand-written step reads as a weight"
    return None
