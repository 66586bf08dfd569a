"""The compact decode step on MoE models (gspo.sampling.fastdecode + gspo.models.fastmoe): its logits equal Hugging
Face's forward step by step, recorded log-probs equal a full recomputation, the routing it records
equals Hugging Face's (one capture per decode step, the check's second computation not recorded),
and what it does not know is refused with a reason."""

import pytest
import torch

import gspo.models.fastmoe as fastmoe
import gspo.sampling.fastdecode as fd
import gspo.sampling.hfdecode as hfdecode
import gspo.sampling.rollout as rollout_module
from gspo.models.logprobs import completion_logprobs
from gspo.models.moe import Routing, find_routers
from gspo.models.sequences import left_pad, position_ids_from_mask
from gspo.sampling.rollout import generate, sample_token, sampling_params

PROMPTS = ["12+7=", "999-123=", "5+5=", "40+2="]
MODELS = ["tiny-moe", "tiny-moe-wide", "tiny-long-moe", "qwen2_moe", "qwen3_moe"]
# tiny-moe-wide sums 8 experts a token in each layer (top-8 of 32): its logits (about ±3) differ between
# the two decoders by up to 1.9e-4 after 20 steps (measured), 4x the rollout check's margin below 1e-3
WIDE_ATOL = 3e-4
COMPACT = "the compact decode step (gspo.sampling.fastdecode)"


def small_moe(arch: str, vocab: int, seed: int = 0):
    """A random MoE with a dense layer among its sparse ones: Qwen2-MoE (3 layers, the middle one
    dense through mlp_only_layers, a shared expert, QKV biases, gates not renormalised) or Qwen3-MoE
    (4 layers, every other one dense through decoder_sparse_step, attention biases, 6 experts, top-3)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, moe_intermediate_size=48, max_position_embeddings=128, pad_token_id=0,
                  eos_token_id=1, bos_token_id=None)
    if arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, num_hidden_layers=3, mlp_only_layers=[1], num_experts=4,
                                num_experts_per_tok=2, shared_expert_intermediate_size=80, norm_topk_prob=False,
                                qkv_bias=True)
    else:
        cfg = tf.Qwen3MoeConfig(**common, num_hidden_layers=4, decoder_sparse_step=2, num_experts=6,
                                num_experts_per_tok=3, norm_topk_prob=True, attention_bias=True)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # routers start at zero: give them real preferences; biases too
        for _, r in find_routers(model):
            r.weight.normal_(0, 1.0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "shared_expert_gate" in name:
                p.normal_(0, 0.5)
    return model


def load(name: str, tok):
    from gspo.models.loading import load_policy

    return load_policy(name)[0] if name.startswith("tiny") else small_moe(name, len(tok))


@pytest.fixture(scope="module")
def models(char_tokenizer):
    return {name: load(name, char_tokenizer) for name in MODELS}


def encode(tok, texts=PROMPTS):
    return [tok(t)["input_ids"] for t in texts]


def hf_only(monkeypatch):
    monkeypatch.setattr(fd, "path", lambda model, max_len, **kw: ("hf", "test: Hugging Face's forward only"))


def spy_decoders(monkeypatch) -> list:
    made = []

    def spy(m, max_len, **kw):
        made.append(fd.decoder(m, max_len, **kw))
        return made[-1]

    monkeypatch.setattr(rollout_module, "decoder", spy)
    return made


@pytest.mark.parametrize("experts", ["fastmoe", "module"])
@pytest.mark.parametrize("name", MODELS)
def test_compact_step_logits_equal_hf_forward_step_by_step(models, char_tokenizer, name, experts, monkeypatch):
    # fp32: 20 decode steps at 16 rows, the same tokens fed to both decoders; the logits agree far
    # inside the rollout's own check (1e-3): to 1e-4. The experts computed by gspo.models.fastmoe (on
    # CPU), or by the model's experts module (elsewhere)
    if experts == "module":
        monkeypatch.setattr(fastmoe, "grouped_here", lambda h: False)
    model, tok = models[name], char_tokenizer
    assert fd.unsupported(model, 400) is None and fd.describe(model, 400) == COMPACT
    assert any(not hasattr(layer.mlp, "gate_proj") for layer in model.model.layers)  # sparse blocks, ...
    if name.startswith("qwen"):  # ... and a dense layer among them
        assert any(hasattr(layer.mlp, "gate_proj") for layer in model.model.layers)
    ids, mask = left_pad(encode(tok), tok.pad_token_id, "cpu")
    (N, P), G, T = ids.shape, 4, 20
    fast, hf = fd.decoder(model, P + T + 1), fd.HFDecoder(model)
    assert isinstance(fast, fd.FastDecoder)
    pos = position_ids_from_mask(mask)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        torch.testing.assert_close(fast.prefill(ids, mask, pos), logits := hf.prefill(ids, mask, pos))
        fast.expand(G)
        hf.expand(G)
        logits = logits.repeat_interleave(G, 0)  # (B, V)
        attn = torch.cat([mask.repeat_interleave(G, 0), torch.ones(N * G, T, dtype=mask.dtype)], 1)
        next_pos = pos[:, -1].repeat_interleave(G, 0) + 1
        for t in range(T):
            tok_t, _ = sample_token(logits, 1.0, 1.0, torch.rand(N * G, generator=g))
            compact = fast.step(tok_t, attn[:, : P + t + 1], next_pos + t)
            logits = hf.step(tok_t, attn[:, : P + t + 1], next_pos + t)
            torch.testing.assert_close(compact, logits, rtol=0, atol=WIDE_ATOL if name == "tiny-moe-wide" else 1e-4)
    assert fast.checked and not fast.fallback and fast.cache is None  # the compact step ran on its own


@pytest.mark.parametrize("name", MODELS)
def test_recorded_logprobs_and_routing_equal_hf_and_a_full_forward(models, char_tokenizer, name, monkeypatch):
    # the experts recorded token by token by the compact step are Hugging Face's decode loop's,
    # to the bit, and those a full forward over the same sequences picks; one capture per decode
    # step (the first step, computed both ways for the check, is recorded once); the recorded
    # log-probs equal a full recomputation to 1e-5
    model, tok = models[name], char_tokenizer
    routing = Routing(model)
    calls = []
    assemble = rollout_module._assemble_routing
    monkeypatch.setattr(rollout_module, "_assemble_routing",
                        lambda cap, ro, n: calls.append(len(cap.used[0])) or assemble(cap, ro, n))
    made = spy_decoders(monkeypatch)
    params = sampling_params(tok, group_size=4, max_new_tokens=20)
    ro = generate(model, encode(tok), params, generator=torch.Generator().manual_seed(0), routing=routing)
    assert isinstance(made[0], fd.FastDecoder) and made[0].checked and not made[0].fallback
    T = ro.completion_ids.shape[1]
    assert T > 2 and calls == [T]  # the prefill + one per decode step fed (the last token is never fed)
    hf_only(monkeypatch)
    ro_hf = generate(model, encode(tok), params, generator=torch.Generator().manual_seed(0), routing=routing)
    assert isinstance(made[1], fd.HFDecoder) and not isinstance(made[1], fd.FastDecoder)
    assert torch.equal(ro.completion_ids, ro_hf.completion_ids) and torch.equal(ro.routing, ro_hf.routing)
    B, S = ro.input_ids.shape
    with routing.capture() as cap, torch.no_grad():
        lp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    real = ro.attention_mask.bool()
    real[:, -1] = False  # the last token is never fed
    assert (ro.routing[real] >= 0).all() and torch.equal(ro.routing[real], cap.indices(B, S)[real])
    # float32, summed in another order (one token at a time against the cache, or the whole sequence at
    # once): with 2 threads, the longest model's worst token differs by 1.7e-5 on a log-prob of -0.59;
    # 5e-5 is still 46x below a bf16 rounding of the same log-prob (2^-8 x 0.59 = 2.3e-3)
    torch.testing.assert_close(lp, ro.logp, rtol=5e-5, atol=5e-5)
    routing.remove()


def test_sampled_tokens_are_hf_forwards(models, char_tokenizer, monkeypatch):
    # tiny-moe, seeded, 8 prompts' worth of rows: the compact step samples exactly the tokens
    # Hugging Face's forward samples, with the same log-probs
    model, tok = models["tiny-moe"], char_tokenizer
    params = sampling_params(tok, group_size=8, max_new_tokens=40, min_new_tokens=12)  # answers are short
    prompts = encode(tok, PROMPTS + ["3+4=", "77-7=", "100+1=", "8*9="])
    made = spy_decoders(monkeypatch)
    fast = generate(model, prompts, params, generator=torch.Generator().manual_seed(3))
    hf_only(monkeypatch)
    hf = generate(model, prompts, params, generator=torch.Generator().manual_seed(3))
    assert type(made[0]) is fd.FastDecoder and not made[0].fallback and type(made[1]) is fd.HFDecoder
    assert fast.completion_ids.shape[1] > 12 and torch.equal(fast.completion_ids, hf.completion_ids)
    assert torch.equal(fast.lengths, hf.lengths)
    torch.testing.assert_close(fast.logp, hf.logp, rtol=1e-5, atol=1e-5)


def test_a_fallback_records_the_routing_of_hf_forward(models, char_tokenizer, monkeypatch):
    # a compact step that routes wrongly (each row routed by another row's hidden state) fails the
    # first step's check: the rollout goes on with Hugging Face's forward, and the routing
    # recorded for that first step is Hugging Face's, not the failed step's
    model, tok = models["tiny-moe"], char_tokenizer
    routing = Routing(model)
    params = sampling_params(tok, group_size=4, max_new_tokens=12, min_new_tokens=12)
    made = spy_decoders(monkeypatch)
    monkeypatch.setattr(hfdecode, "_said", [])
    right = fastmoe.sparse_moe

    def misrouted(block, h):
        _, gates, chosen = block.gate(h.flip(0))
        return fastmoe.experts_step(block.experts, h, chosen, gates)

    monkeypatch.setattr(fastmoe, "sparse_moe", misrouted)
    ro = generate(model, encode(tok), params, generator=torch.Generator().manual_seed(0), routing=routing)
    assert made[0].fallback
    monkeypatch.setattr(fastmoe, "sparse_moe", right)
    hf_only(monkeypatch)
    ro_hf = generate(model, encode(tok), params, generator=torch.Generator().manual_seed(0), routing=routing)
    assert torch.equal(ro.completion_ids, ro_hf.completion_ids) and torch.equal(ro.routing, ro_hf.routing)
    routing.remove()


class _Wrapped(torch.nn.Module):
    """A module that forwards to `inner`: its class name is what the refusal must name."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, h):
        return self.inner(h)


class UnknownMoeBlock(_Wrapped):
    pass


class PlainRouter(_Wrapped):
    pass


def _unknown_block(model):
    model.model.layers[1].mlp = UnknownMoeBlock(model.model.layers[1].mlp)


def _plain_router(model):
    model.model.layers[0].mlp.gate = PlainRouter(model.model.layers[0].mlp.gate)


def _transposed_experts(model):
    model.model.layers[0].mlp.experts.is_transposed = True


@pytest.mark.parametrize("change, reason", [
    (_unknown_block, "layer 1's MLP is a UnknownMoeBlock, which the compact decode step does not know"),
    (_plain_router, "layer 0's Qwen3MoeSparseMoeBlock: its router is a PlainRouter, not a TopKRouter module"),
    (_transposed_experts, "layer 0's Qwen3MoeSparseMoeBlock: its experts (Qwen3MoeExperts) are not bias-free gated"),
])
def test_what_the_compact_step_does_not_know_is_refused_with_a_reason(char_tokenizer, change, reason):
    from transformers import Qwen3MoeForCausalLM

    from gspo.models.tiny import tiny_moe_config

    model = Qwen3MoeForCausalLM(tiny_moe_config(len(char_tokenizer), num_hidden_layers=2)).eval()
    assert fd.path(model, 64) == ("fast", None)
    change(model)
    # the hand-written step says why not; the model's own layers (its own MoE blocks) decode it instead
    kind, why = fd.path(model, 64)
    assert kind == "layers" and why.startswith(f"the hand-written step: {reason}")
    assert fd.unsupported(model, 64) is None  # not Hugging Face's forward
    assert fd.describe(model, 64) == \
        f"the compact decode step over the model's own layers (gspo.sampling.layerdecode; {why})"
    assert type(fd.decoder(model, 64)) is fd.LayerDecoder


def test_other_moe_families_decode_over_their_own_layers(char_tokenizer):
    # Mixtral and OLMoE: not the hand-written step's; the model's own forward over gspo's cache, its own
    # routers recording the experts, and the recorded log-probs equal a full recomputation
    from tests.test_moe import tiny_moe

    tok = char_tokenizer
    for arch in ("mixtral", "olmoe"):
        model = tiny_moe(arch, vocab=len(tok))
        assert fd.path(model, 64) == ("layers", f"the hand-written step: model_type {arch} is not one of llama, "
                                                "mistral, qwen2, qwen2_moe, qwen3, qwen3_moe")
        assert type(fd.decoder(model, 64)) is fd.LayerDecoder
        routing = Routing(model)
        ro = generate(model, encode(tok), sampling_params(tok, group_size=3, max_new_tokens=10, min_new_tokens=10),
                      generator=torch.Generator().manual_seed(0), routing=routing)
        with torch.no_grad():
            lp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
        torch.testing.assert_close(lp, ro.logp, rtol=1e-5, atol=1e-5)
        assert ro.routing is not None and (ro.routing[:, :-1] >= 0).all()  # every fed token's experts recorded
        routing.remove()
