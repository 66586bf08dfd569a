"""The chunked LM-head log-prob path equals the full-logits path: values and gradients."""

import pytest
import torch

from gspo.models import lmhead
from gspo.models.lmhead import chunked_logprobs, fused_head
from gspo.models.logprobs import completion_logprobs


def full_logprobs(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T).float() / temperature  # (N, V)
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_bytes", [None, 4 * 1000 * 16])  # one chunk; 16-token chunks (N=300 -> 19 chunks)
@pytest.mark.parametrize("keep", [True, False])  # logits kept for the backward pass, or recomputed there
@pytest.mark.parametrize("entropy", [False, True])  # the entropy's pass keeps exp(z - max) in a tensor of its own
def test_chunked_equals_full(monkeypatch, temperature, chunk_bytes, keep, entropy):
    if chunk_bytes:
        monkeypatch.setattr(lmhead, "CHUNK_BYTES", chunk_bytes)
    if not keep:
        monkeypatch.setattr(lmhead, "SAVE_BYTES", 0)
    g = torch.Generator().manual_seed(0)
    N, H, V = 300, 32, 1000
    h1 = torch.randn(N, H, generator=g, requires_grad=True)
    w1 = (0.3 * torch.randn(V, H, generator=g)).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(N, generator=g)  # an arbitrary dL/dlogp, as a policy loss would give
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    a = chunked_logprobs(h1, w1, y, temperature, entropy=entropy)
    b = full_logprobs(h2, w2, y, temperature)
    if entropy:  # H = -Σ_v p_v log p_v of softmax(hW^T / τ), computed apart from the log-probs' graph
        a, ent = a
        with torch.no_grad():
            lp = torch.log_softmax((h2 @ w2.T).float() / temperature, -1)
            torch.testing.assert_close(ent, -(lp.exp() * lp).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    (a * upstream).sum().backward()
    (b * upstream).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-5)


def test_fused_path_in_completion_logprobs_equals_full_logits(tiny_random, char_tokenizer, monkeypatch):
    tok = char_tokenizer
    ids = torch.tensor([tok("12+34=46")["input_ids"], tok("99-1=98")["input_ids"] + [0]])
    mask = torch.ones_like(ids)
    mask[1, -1] = 0
    cm = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert fused_head(tiny_random) is not None
    a = completion_logprobs(tiny_random, ids, mask, cm, temperature=0.8)
    a.sum().backward()
    grads_a = {n: p.grad.clone() for n, p in tiny_random.named_parameters()}
    tiny_random.zero_grad()
    import gspo.models.logprobs

    monkeypatch.setattr(gspo.models.logprobs, "fused_head", lambda m: None)  # force the full-logits path
    b = completion_logprobs(tiny_random, ids, mask, cm, temperature=0.8)
    b.sum().backward()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for n, p in tiny_random.named_parameters():
        torch.testing.assert_close(grads_a[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_models_with_special_heads_keep_the_full_path(tiny_random):
    tiny_random.config.final_logit_softcapping = 30.0
    assert fused_head(tiny_random) is None
    tiny_random.config.final_logit_softcapping = None
    assert fused_head(tiny_random) is not None
    # RecurrentGemma's soft-cap (logits_soft_cap, 30 by default), Inkling's hidden state divided before the head and
    # its logits sliced to the unpadded vocabulary: a chunked head over the plain weight computes other log-probs
    # (-42.2 against -26.0 for the soft-cap, 0.53 off for the padded vocabulary: a breaker's finding)
    V = tiny_random.lm_head.out_features
    specials = (("logits_soft_cap", 30.0), ("logits_mup_width_multiplier", 2.0), ("unpadded_vocab_size", V - 5))
    for attr, value in specials:
        setattr(tiny_random.config, attr, value)
        assert fused_head(tiny_random) is None, attr
        setattr(tiny_random.config, attr, None)
    tiny_random.config.unpadded_vocab_size = V  # nothing sliced: the plain head serves
    assert fused_head(tiny_random) is not None
    tiny_random.lm_head.bias = torch.nn.Parameter(torch.zeros(tiny_random.lm_head.out_features))
    assert fused_head(tiny_random) is None


@pytest.mark.parametrize("dtype, vocab, spread, tol", [(torch.bfloat16, 32_000, 0.3, 1e-4),
                                                       (torch.float16, 262_144, 0.3, 1e-3)])
def test_the_entropy_is_summed_in_float32_under_autocast(dtype, vocab, spread, tol):
    # Under mixed precision (--dtype bfloat16/float16 over float32 weights) the forward runs in autocast; the
    # entropy's dot product Σ_v e_v (z_v - max) must not be autocast with it: in bfloat16 it rounds the entropy
    # to ~1e-3 relative (1.6e-2 absolute at a 32k vocabulary), in float16 a flat 262k-entry distribution's sum
    # (about 262144 x e^-0.3 x 0.3 ≈ 6e4 in size, past float16's 65504 once the logits spread) overflows to inf.
    # The reference: the full path, the autocast logits promoted to float32 before the softmax.
    g = torch.Generator().manual_seed(0)
    N, H = 8, 64
    h = torch.randn(N, H, generator=g)
    h = h / h.norm(dim=-1, keepdim=True)
    w = spread * torch.randn(vocab, H, generator=g)
    y = torch.randint(0, vocab, (N,), generator=g)
    with torch.autocast("cpu", dtype=dtype):
        _, ent = chunked_logprobs(h, w, y, entropy=True)
        logits = h @ w.T
    lp = torch.log_softmax(logits.float(), -1)
    assert ent.isfinite().all()
    torch.testing.assert_close(ent, -(lp.exp() * lp).sum(-1), rtol=tol, atol=tol)


def test_no_tokens_give_a_zero_weight_gradient_as_the_full_path_does():
    # a micro-batch with no completion tokens: the full path's weight gradient is zeros, and a None would leave the
    # parameter out of AdamW's step and of DDP's reduction (a breaker's finding)
    h = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(50, 8, requires_grad=True)
    chunked_logprobs(h, w, torch.zeros(0, dtype=torch.long)).sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w)) and h.grad.shape == (0, 8)
