"""Log-probabilities of target tokens through the LM head, in chunks of tokens.

    logp = chunked_logprobs(hidden, weight, targets, temperature=1.0)   # (N,)
    # = log_softmax(hidden @ weight.T / τ).gather(targets), without the (N, V) logits

A language model's head turns N hidden states into N × V logits; for a Qwen3 vocabulary
(V = 151,936) and 8,192 completion tokens that is 5 GB of fp32 logits, plus as much again
for log_softmax and for each gradient. Policy losses only need one number per token,
log π(y_t), and its gradient. The forward pass computes, chunk by chunk,

    logp_t = z_t[y_t] - logsumexp(z_t)            z_t = h_t W^T / τ

and keeps logsumexp (N floats); the backward pass forms the gradient of the logits,
(onehot(y_t) - softmax(z_t)) · g_t / τ, in place, then dL/dh = G W and dL/dW = G^T h, chunk
by chunk. When all N × V logits fit in `SAVE_BYTES` the forward pass keeps exp(z - max) and
its sum (the backward's softmax is then one in-place pass); beyond that each chunk's logits are
recomputed in the backward pass (one extra matmul per chunk), so peak memory is one chunk of
logits (`CHUNK_BYTES`) whatever N and V. Either way what is saved is the full-size
log-softmax, its backward and the scatter behind `gather`.

Passes. Each chunk's (c, V) logits are worked on in place where they can be (z - max, its exp),
and the entropy's Σ_v e_v (z_v - max) is a batched matmul rather than a product tensor and a
sum: at the benchmark's mid shapes (1,024 tokens a minibatch, a 32k vocabulary) torch.logsumexp,
softmax and the product each wrote a fresh 131 MB tensor, a third of the update's time outside
its matmuls (benchmarks/update_profile.py).

Log-probs and gradients equal the full-logits computation to float rounding (tested to 1e-5).
Logits are computed in the weights' dtype (or autocast's, under mixed precision) and promoted
to fp32, like the full path. The entropy of each token's distribution comes from the same
chunks of logits when asked for (a metric; no gradient).

Left out: logit soft-capping and logit scaling (models with them use the full path; see
`fused_head`), vocabulary-parallel heads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

Tensor = torch.Tensor

CHUNK_BYTES = 128 * 2**20  # fp32 logits computed at once: 128 MiB
SAVE_BYTES = 512 * 2**20  # logits kept for the backward pass when all of them fit, else recomputed

# config attributes that change what the head computes; a model with any of them set keeps the full path
# (logits_soft_cap: RecurrentGemma's; logits_mup_width_multiplier: Inkling's hidden state divided before its head)
_SPECIAL_HEAD_ATTRS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                       "logits_scaling", "logits_soft_cap", "logits_mup_width_multiplier")


def chunk_tokens(vocab: int) -> int:
    return max(16, CHUNK_BYTES // (4 * vocab))


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on (mixed precision: float32
    weights, bf16 compute), else the weights'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _How(NamedTuple):
    """What a chunked log-prob pass computes besides its tensors: the temperature, the compute
    dtype and whether to return entropies."""

    temperature: float
    dtype: torch.dtype
    entropy: bool


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, how: _How):
        temperature, dtype, entropy = how
        N, V = hidden.shape[0], weight.shape[0]
        step = chunk_tokens(V)
        keep = N * V * 4 <= SAVE_BYTES
        w = weight.to(dtype)  # (V, H) the compute copy (the weight itself when dtypes agree)
        acc = torch.promote_types(dtype, torch.float32)  # logits and sums: float32 (float64 for a float64 model)
        logp = torch.empty(N, dtype=acc, device=hidden.device)  # (N,)
        lse = torch.empty(N, dtype=acc, device=hidden.device)  # (N,)
        ent = torch.empty(N if entropy else 0, dtype=acc, device=hidden.device)  # (N,)
        kept = []
        for s in range(0, N, step):
            z = (hidden[s:s + step].to(dtype) @ w.T).to(acc)  # (c, V)
            if temperature != 1.0:
                z.div_(temperature)
            top = z.gather(-1, targets[s:s + step, None]).squeeze(-1)  # (c,) the targets' logits
            m = z.amax(-1, keepdim=True)  # (c, 1)
            d = z.sub_(m)  # (c, V) z - max, in place
            e = d.exp() if entropy else d.exp_()  # (c, V) unnormalised probabilities (in place unless d is needed)
            total = e.sum(-1)  # (c,) Σ_v e_v >= 1
            log_total = total.log()
            lse[s:s + step] = m.squeeze(-1) + log_total  # logsumexp(z), as torch.logsumexp computes it
            logp[s:s + step] = top - lse[s:s + step]
            if entropy:  # H = lse - Σ_v p_v z_v = log Σe - (Σ_v e_v d_v) / Σe; the dot product as a batched matmul,
                # in `acc` whatever autocast asks (bfloat16 would round it to 1e-3, float16 overflow past 65504)
                with torch.autocast(hidden.device.type, enabled=False):
                    ent[s:s + step] = log_total - torch.bmm(e[:, None], d[:, :, None]).view(-1) / total
            if keep:
                kept.append((e, total))  # softmax(z) = e / Σe: what the backward pass needs
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.kept, ctx.dtype = temperature, kept, dtype
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        tau, kept, dtype = ctx.temperature, ctx.kept, ctx.dtype
        ctx.kept = None
        step = chunk_tokens(weight.shape[0])
        w = weight.to(dtype)  # (V, H)
        acc = lse.dtype
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # (N, H) every row is written
        grad_w = None  # (V, H) float32 (or float64): the first chunk assigns, the others accumulate
        for i, s in enumerate(range(0, hidden.shape[0], step)):
            h = hidden[s:s + step].to(dtype)  # (c, H)
            g = grad[s:s + step].to(acc)  # (c,)
            # d logp / d z = onehot(y) - softmax(z); times the upstream gradient and d z / d(hW^T) = 1/τ
            if kept:
                e, total = kept[i]  # (c, V), (c,) the forward's exp(z - max) and its sum, consumed in place
                gz = e.mul_((-g / total)[:, None])  # (c, V) -softmax · g, one pass
            else:
                gz = (h @ w.T).to(acc)  # (c, V) recomputed
                if tau != 1.0:
                    gz.div_(tau)
                gz.sub_(lse[s:s + step, None]).exp_().mul_(-g[:, None])  # (c, V) -softmax · g
            gz.scatter_add_(-1, targets[s:s + step, None], g[:, None])
            if tau != 1.0:
                gz.div_(tau)
            gz = gz.to(dtype)
            if grad_h is not None:
                grad_h[s:s + step] = gz @ w  # (c, H)
            if ctx.needs_input_grad[1]:
                if grad_w is None:
                    grad_w = gz.T.to(acc) @ h.to(acc)  # (V, H)
                else:
                    grad_w.addmm_(gz.T.to(acc), h.to(acc))
        if grad_w is None and ctx.needs_input_grad[1]:  # no tokens: a zero gradient, as the full path's
            grad_w = torch.zeros_like(weight, dtype=acc)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None


def chunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, *,
                     entropy: bool = False):
    """log softmax(hidden @ weight.T / τ)[targets] for (N, H) hidden and (V, H) weight: (N,).
    With `entropy`, also the entropy of each token's distribution, (N,) (no gradient)."""
    how = _How(float(temperature), compute_dtype(hidden, weight), entropy)
    logp, ent = _ChunkedLogprobs.apply(hidden, weight, targets, how)
    return (logp, ent) if entropy else logp


def fused_head(model):
    """(backbone, lm_head) when the model's head is a plain bias-free linear map of the
    backbone's last hidden state (so the chunked path computes exactly the model's logits);
    None otherwise (the caller then uses the full-logits path)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    prefix = getattr(base, "base_model_prefix", None)
    backbone = getattr(base, prefix, None) if prefix else None
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if get_head else None
    if backbone is None or not isinstance(head, torch.nn.Linear) or type(head) is not torch.nn.Linear:
        return None  # e.g. a LoRA-wrapped head, or no separable backbone
    if head.bias is not None or hasattr(head.weight, "placements"):
        return None  # a bias, or a sharded (FSDP DTensor) weight: the model's own forward gathers it
    cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    for attr in _SPECIAL_HEAD_ATTRS:
        if getattr(cfg, attr, None) not in (None, 1.0, 0.0):
            return None
    unpadded = getattr(cfg, "unpadded_vocab_size", None)  # Inkling: the logits sliced to the real vocabulary
    if unpadded is not None and unpadded < head.out_features:
        return None
    return backbone, head
