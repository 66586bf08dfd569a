"""Inputs the new decode paths (gspo.sampling.layerdecode, kvcache, graphs, hfdecode, fastdecode's LoRA) were not
built for. The contract under test: the log-probs recorded while sampling equal the training forward's
(completion_logprobs) in float32 to 1e-5, greedy equals `model.generate`, and what gspo cannot do exactly is
refused up front (a reason from fd.path / layerdecode.unsupported), never a silently wrong log-prob or a crash.

The first tests are defects a breaker found: each failed on commit a51b4a7 (what was measured is said), and
holds since its fix.
The rest are attacks that held (they pass)."""

import contextlib

import pytest
import torch
import transformers as tf

import gspo.sampling.fastdecode as fd
import gspo.sampling.graphs as graphs
import gspo.sampling.hfdecode as hfdecode
import gspo.sampling.rollout as rollout_module
from gspo.models.logprobs import completion_logprobs
from gspo.sampling import layerdecode
from gspo.sampling.layerdecode import LayerDecoder
from gspo.sampling.rollout import PolicySampler, generate, sampling_params
from tests.test_real_model import cache, converted_dir, needs_model  # noqa: F401, F811  (the converted SmolLM2)

PROMPTS = ["12+7=", "999-123=", "5+5=", "40+2="]


def _common(vocab: int, **kw) -> dict:
    c = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return {**c, **kw}


def build(cfg, attn: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    with torch.no_grad():  # norms start at one (or zero): give them shape
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    return model


def encode(tok, texts=PROMPTS):
    return [tok(t)["input_ids"] for t in texts]


def spy(monkeypatch, make=None) -> list:
    made = []

    def record(m, max_len, **kw):
        made.append(make(m, max_len) if make else fd.decoder(m, max_len, **kw))
        return made[-1]

    monkeypatch.setattr(rollout_module, "decoder", record)
    return made


MAKERS = {"auto": None, "eager": lambda m, n: LayerDecoder(m, n),
          "static": lambda m, n: LayerDecoder(m, n, static=True, graphs=graphs.Runner(graphs.Recording()))}


def sample_gap(model, tok, monkeypatch, mode="auto", prompts=None, G=2, T=16, **kw):
    """(decoder, max |recorded logp - training forward logp|) of one rollout decoded by `mode`."""
    made = spy(monkeypatch, MAKERS[mode])
    ro = generate(model, prompts or encode(tok), sampling_params(tok, group_size=G, max_new_tokens=T,
                                                                 min_new_tokens=kw.pop("min_new_tokens", T), **kw),
                  generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask,
                                 temperature=kw.get("temperature", 1.0))
    return made[0], float((ro.logp - lp).abs().max())


def greedy_equals_generate(model, tok, T=16) -> bool:
    prompts = encode(tok)
    ro = generate(model, prompts, sampling_params(tok, group_size=1, max_new_tokens=T, min_new_tokens=T,
                                                  temperature=0.0))
    for b, ids in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=T, min_new_tokens=T, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, len(ids):]
        if ro.completion_ids[b].tolist() != ref.tolist():
            return False
    return True


# ----------------------------------------------------------------------------------------------
# Defects (each failed on a51b4a7; fixed since)
# ----------------------------------------------------------------------------------------------


def test_longrope_rollouts_past_the_original_length_are_exact_or_refused(char_tokenizer, monkeypatch):
    # Phi-3 with LongRoPE (as Phi-3-mini-128k: short factors up to original_max_position_embeddings, long past it).
    # transformers picks the factors per forward from max(position_ids) + 1: the prefill (9 columns) and the early
    # decode steps rotate with the short factors, the training forward over all 25 columns with the long ones for
    # every position. No decoder with a KV cache can equal it; gspo decodes with LayerDecoder, no fallback, no
    # refusal. Correct: refused up front (a reason naming the rope scaling), or decoded exactly.
    # Measured: recorded log-probs differ from completion_logprobs by 5.3e-3 (4.5e-3 at T=20; eager and static
    # alike); `gspo train` on such a directory stops at step 1 with an integrity breach blaming "other weights".
    # Fixed: refused (hfdecode.why_inexact) by a training run's sampler (strict) and at the run's start; within
    # the original length the rollouts are exact.
    tok = char_tokenizer
    cfg = tf.Phi3Config(**_common(len(tok)), original_max_position_embeddings=16,
                        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})
    model = build(cfg)
    _refused_past_and_exact_within(model, tok, monkeypatch, "longrope")


def test_dynamic_ntk_rollouts_past_max_positions_are_exact_or_refused(char_tokenizer, monkeypatch):
    # Llama with dynamic NTK rope scaling: inv_freq is recomputed from the longest position a forward sees.
    # FastDecoder takes its cos/sin tables for max_len positions at once (scaled for 25), Hugging Face's prefill
    # used the unscaled ones (9 columns), the training forward the ones of its own length. Correct: refused up
    # front (or exact). Measured: FastDecoder 2.4e-4 (2.9e-4 at T=20), LayerDecoder 9.6e-4 (T=20), neither falls back.
    tok = char_tokenizer
    model = build(tf.LlamaConfig(**_common(len(tok), max_position_embeddings=16),
                                 rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    assert fd.path(model, 25) == ("fast", None)
    _refused_past_and_exact_within(model, tok, monkeypatch, "dynamic")


def _refused_past_and_exact_within(model, tok, monkeypatch, kind):
    from gspo.sampling.hfdecode import DecodeError, why_inexact

    assert why_inexact(model, 16) is None and f"rotary scaling ({kind})" in why_inexact(model, 17)
    params = sampling_params(tok, group_size=2, max_new_tokens=16, min_new_tokens=16)
    with pytest.raises(DecodeError, match=rf"decode: its rotary scaling \({kind}\) is chosen by each forward's "
                                          r"longest position: a rollout of 24 positions, past 16"):
        PolicySampler(model, strict=True).sample(encode(tok), params, generator=torch.Generator().manual_seed(0))
    _, gap = sample_gap(model, tok, monkeypatch, T=16 - 8)  # the longest prompt, "999-123=", is 8 tokens
    assert gap < 1e-5


def _lfm2(vocab):
    return tf.Lfm2Config(**_common(vocab), layer_types=["conv", "full_attention", "conv", "full_attention"])


def _qwen3_next(vocab):
    return tf.Qwen3NextConfig(**_common(vocab), head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
                              linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                              linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32)


@pytest.mark.parametrize("family", ["lfm2", "qwen3_next"])
def test_models_with_state_space_or_conv_layers_sample_on_the_fallback(char_tokenizer, monkeypatch, family):
    # LFM2 (conv layers) and Qwen3-Next / Qwen3.5 (linear attention) are refused by the layer decoder with a reason,
    # and the plan says "decode: Hugging Face's forward (...)". That forward then crashes in the prefill:
    # HFDecoder.prefill (hfdecode.py:64) hands the model a plain `DynamicCache()` (attention layers only), whose
    # layers[i] the conv / linear-attention layer asks for its state (cache.get_conv_state -> IndexError: list index
    # out of range). `gspo train --model <lfm2 dir>` dies so at the first rollout. The same for Jamba, Bamba,
    # FalconH1, GraniteMoeHybrid, Mamba, Mamba2. (Before a51b4a7 the model's own cache got further and failed at
    # expand: LinearAttentionLayer has no batch_repeat_interleave.) Correct: the refused model samples exactly on
    # Hugging Face's forward with the cache its config asks for, or the run is refused up front with a reason.
    tok = char_tokenizer
    model = build(_lfm2(len(tok)) if family == "lfm2" else _qwen3_next(len(tok)))
    assert fd.path(model, 64)[0] == "hf"
    try:
        _, gap = sample_gap(model, tok, monkeypatch, T=8)
    except (ValueError, NotImplementedError) as e:  # a refusal with its reason would do too (not an IndexError)
        assert "layer" in str(e)
        return
    assert gap < 1e-5


def test_recurrent_layers_are_not_claimed_by_the_layer_decoder(char_tokenizer):
    # RecurrentGemma: config.layer_types = [linear_attention, linear_attention, sliding_attention] (RG-LRU recurrent
    # blocks, state kept outside any Cache). Its forward builds one sliding-window mask for all layers, so
    # kvcache.layer_kinds (kvcache.py:104-106, the one-mask branch never reads config.layer_types) calls every
    # layer "sliding_attention": layerdecode.unsupported says None and fd.path says "layers", against the
    # layerdecode docstring ("linear or state-space layers ... are refused"). Sampling then crashes
    # (AttributeError: 'BaseModelOutput' object has no attribute 'cache'). Correct: a reason naming layer 0.
    tok = char_tokenizer
    model = build(tf.RecurrentGemmaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                                          lru_width=64, attention_window_size=6, pad_token_id=0, eos_token_id=1,
                                          bos_token_id=None))
    assert model.config.layer_types[0] == "linear_attention"
    assert layerdecode.unsupported(model, 64) is not None, layerdecode.layer_kinds(model)


def test_a_forward_with_bidirectional_masks_is_refused(char_tokenizer, monkeypatch):
    # Gemma 3 with use_bidirectional_attention (EmbeddingGemma's setting): its forward builds its masks with
    # create_causal_mask(or_mask_function=<always True>) and a bidirectional window overlay, so the training forward
    # lets every token see the ones after it. layer_kinds only looks for the names create_bidirectional_mask & co
    # (kvcache.py:96), not for or_mask_function / and_mask_function, so the layer decoder takes it and decodes
    # causally. Correct: refused ("a forward that builds its masks otherwise", as the docstring promises).
    # Measured: recorded log-probs 0.53 off the training forward, no fallback, no refusal.
    tok = char_tokenizer
    model = build(tf.Gemma3TextConfig(**_common(len(tok)), head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                                      use_bidirectional_attention=True))
    # Fixed: refused by every decoder (kvcache.layer_kinds) and by a training run's sampler (hfdecode.why_inexact)
    from gspo.sampling.hfdecode import DecodeError

    why = "its config asks for bidirectional attention (use_bidirectional_attention)"
    assert layerdecode.unsupported(model, 64) == why and fd.path(model, 64)[0] == "hf"
    with pytest.raises(DecodeError, match=r"decode: its config asks for bidirectional attention"):
        PolicySampler(model, strict=True).sample(encode(tok), sampling_params(tok, group_size=2, max_new_tokens=4))


def _lora(model, seed: int = 1, **kw):
    from peft import LoraConfig, get_peft_model

    from gspo.models.loading import quiet_peft

    with quiet_peft():
        pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **{"target_modules": "all-linear", **kw}))
    _bump(pm, seed)
    return pm.eval()


def _bump(pm, seed):
    torch.manual_seed(seed)
    with torch.no_grad():  # B starts at zero: give the adapters (and what modules_to_save copies) something to say
        for n, p in pm.named_parameters():
            if "lora_B" in n or "modules_to_save" in n or (n.endswith("bias") and "lora" not in n):
                p.normal_(0, 0.3)


@pytest.mark.parametrize("change", ["set_adapter", "disable_adapter"])
def test_a_kept_cache_is_not_reused_under_other_adapters(char_tokenizer, change):
    # A PolicySampler (keep_cache=True) over a PEFT model: turn 1 with adapter "default", then the active adapter
    # switches (set_adapter) or adapters are disabled (disable_adapter) before turn 2. No parameter changes, so
    # turncache.weights_key (the parameters' _version counters, turncache.py:82-84) matches and turn 2 goes on from
    # keys and values computed under the other adapter. Correct: a full prefill (the key must include the adapter
    # state: active adapters, disabled, merged). Measured: turn 2's log-probs off the training forward by 0.23
    # (set_adapter) and 0.54 (disable_adapter); with keep_cache=False 2e-7.
    pytest.importorskip("peft")
    from peft import LoraConfig

    from tests.conftest import random_tiny_model

    tok = char_tokenizer
    pm = _lora(random_tiny_model(tok, num_hidden_layers=2))
    pm.add_adapter("b", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    _bump(pm, 2)
    pm.set_adapter("default")
    prompts = encode(tok, ["12+7=", "999-123=", "5+5="])
    sampler = PolicySampler(pm, keep_cache=True)
    first = sampler.sample(prompts, sampling_params(tok, group_size=1, max_new_tokens=6, min_new_tokens=6),
                           generator=torch.Generator().manual_seed(0), rows=(torch.arange(3), 3))
    rows = torch.tensor([2, 0])
    turn = [prompts[r] + first.completion_ids[r].tolist() + tok("=11+", add_special_tokens=False)["input_ids"]
            for r in rows.tolist()]
    if change == "set_adapter":
        pm.set_adapter("b")
    with pm.disable_adapter() if change == "disable_adapter" else contextlib.nullcontext():
        second = sampler.sample(turn, sampling_params(tok, group_size=1, max_new_tokens=8, min_new_tokens=8),
                                generator=torch.Generator().manual_seed(1), rows=(rows, 3))
        with torch.no_grad():
            lp = completion_logprobs(pm, second.input_ids, second.attention_mask, second.completion_mask)
    torch.testing.assert_close(second.logp, lp, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Attacks that held
# ----------------------------------------------------------------------------------------------


def _family(name: str, vocab: int):
    c = _common(vocab)
    return {
        "gemma2": lambda: tf.Gemma2Config(**c, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                                          attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        "gemma3-w3": lambda: tf.Gemma3TextConfig(**c, head_dim=16, sliding_window=3, query_pre_attn_scalar=16),
        "cohere2": lambda: tf.Cohere2Config(**c, sliding_window=6),
        "starcoder2": lambda: tf.Starcoder2Config(**c, sliding_window=6),
        "mixtral-w6": lambda: tf.MixtralConfig(**c, sliding_window=6, num_local_experts=4, num_experts_per_tok=2),
        "qwen2-max-window-layers": lambda: tf.Qwen2Config(**c, use_sliding_window=True, sliding_window=6,
                                                          max_window_layers=2),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**c),
        "phi": lambda: tf.PhiConfig(**c),
        "stablelm": lambda: tf.StableLmConfig(**c),
        "deepseek_v3-mla": lambda: tf.DeepseekV3Config(**{**c, "num_key_value_heads": 4}, q_lora_rank=None,
                                                       kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                       v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                                                       topk_group=1),
        "gpt_oss-sinks": lambda: tf.GptOssConfig(**c, head_dim=16, sliding_window=4, num_local_experts=4,
                                                 num_experts_per_tok=2,
                                                 layer_types=["sliding_attention", "full_attention"] * 2),
        "gemma3n-kv-sharing": lambda: tf.Gemma3nTextConfig(
            **{**c, "intermediate_size": [96] * 4}, head_dim=16, sliding_window=6, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=vocab, laurel_rank=4, activation_sparsity_pattern=[0.0] * 4),
    }[name]()


EAGER_ATTN = {"gemma2", "gpt_oss-sinks"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3-w3", "cohere2", "starcoder2", "mixtral-w6",
                                  "qwen2-max-window-layers", "gpt_neox", "phi", "stablelm", "deepseek_v3-mla",
                                  "gpt_oss-sinks", "gemma3n-kv-sharing"])
def test_held_other_families_decode_exactly(char_tokenizer, monkeypatch, name, mode):
    # windows (6, 4, 3) shorter than the prompts, soft-caps, MLA latents, attention sinks, KV sharing, MoE:
    # the model's own layers over gspo's cache, exact, no fallback; greedy as generate
    tok = char_tokenizer
    model = build(_family(name, len(tok)), "eager" if name in EAGER_ATTN else "sdpa")
    assert layerdecode.unsupported(model, 64) is None
    dec, gap = sample_gap(model, tok, monkeypatch, mode)
    assert type(dec) is LayerDecoder and not dec.fallback and gap < 1e-5
    if mode == "eager":
        monkeypatch.undo()
        assert greedy_equals_generate(model, tok)


@pytest.mark.slow
def test_held_moe_routing_over_the_model_layers_is_hugging_faces(char_tokenizer, monkeypatch):
    from gspo.models.moe import Routing, find_routers

    tok = char_tokenizer
    model = build(tf.MixtralConfig(**_common(len(tok)), sliding_window=4, num_local_experts=4, num_experts_per_tok=2))
    with torch.no_grad():
        for _, r in find_routers(model):
            r.weight.normal_(0, 1.0)
    routing = Routing(model)
    out = []
    for make in (MAKERS["eager"], lambda m, n: hfdecode.HFDecoder(m)):
        spy(monkeypatch, make)
        out.append(generate(model, encode(tok), sampling_params(tok, group_size=3, max_new_tokens=15),
                            generator=torch.Generator().manual_seed(0), routing=routing))
    assert torch.equal(out[0].completion_ids, out[1].completion_ids) and torch.equal(out[0].routing, out[1].routing)
    routing.remove()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dropout", "bias-all", "rslora", "lora-bias", "two-active", "switched",
                                  "switched+disabled", "merged", "merged+disabled", "modules-to-save-norms"])
def test_held_lora_variants_on_the_hand_written_step(char_tokenizer, monkeypatch, case):
    pytest.importorskip("peft")
    from peft import LoraConfig

    from tests.conftest import random_tiny_model

    tok = char_tokenizer
    kw = {"dropout": {"lora_dropout": 0.5}, "bias-all": {"bias": "all"}, "rslora": {"use_rslora": True},
          "lora-bias": {"lora_bias": True}, "modules-to-save-norms": {"modules_to_save": ["input_layernorm", "norm"]}}
    pm = _lora(random_tiny_model(tok, num_hidden_layers=2, attention_bias=case == "bias-all"),
               **kw.get(case, {}))
    if case.startswith(("two", "switched")):
        pm.add_adapter("b", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
        _bump(pm, 2)
        pm.base_model.set_adapter(["default", "b"]) if case == "two-active" else pm.set_adapter("b")
    if case.startswith("merged"):
        pm.merge_adapter()
    assert fd.path(pm, 64) == ("fast", None)
    with pm.disable_adapter() if case.endswith("+disabled") else contextlib.nullcontext():
        dec, gap = sample_gap(pm, tok, monkeypatch, T=12)
    assert type(dec) is fd.FastDecoder and not dec.fallback and gap < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_held_later_turns_of_a_windowed_model(char_tokenizer, monkeypatch, mode):
    # Gemma 3 with a window of 40 (the turns stay within it, so the kept cache is used), rows reordered and dropped
    # over three turns; static mode's bucket keeps its buffers and grows its columns (reach)
    tok = char_tokenizer
    model = build(tf.Gemma3TextConfig(**_common(len(tok)), head_dim=16, sliding_window=40, query_pre_attn_scalar=16,
                                      layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                   "sliding_attention"], final_logit_softcapping=30.0))
    prompts = encode(tok, ["12+7=", "999-123=", "5+5="])
    out, made = [], spy(monkeypatch, MAKERS[mode])
    for keep in (False, True):
        sampler = PolicySampler(model, keep_cache=keep)
        ro = sampler.sample(prompts, sampling_params(tok, group_size=1, max_new_tokens=6),
                            generator=torch.Generator().manual_seed(0), rows=(torch.arange(3), 3))
        convo = {r: prompts[r] + ro.completion_ids[r, :int(ro.lengths[r])].tolist() for r in range(3)}
        for turn, rows in enumerate(([2, 0], [0])):
            new = [convo[r] + tok("=11+", add_special_tokens=False)["input_ids"] for r in rows]
            ro = sampler.sample(new, sampling_params(tok, group_size=1, max_new_tokens=8),
                                generator=torch.Generator().manual_seed(1 + turn), rows=(torch.tensor(rows), 3))
            convo = {r: new[i] + ro.completion_ids[i, :int(ro.lengths[i])].tolist() for i, r in enumerate(rows)}
        out.append(ro)
    assert len(made) == 4 and not made[-1].fallback  # 3 prefills without the kept cache, 1 with it
    assert torch.equal(out[0].completion_ids, out[1].completion_ids)
    torch.testing.assert_close(out[0].logp, out[1].logp, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_held_shapes_and_sampling_options(char_tokenizer, monkeypatch, mode):
    # heavy left padding (a 41-token prompt beside 1-token ones), a 1-token prompt with 16 samples, completions
    # past the eager cache's first block (64 columns) up to max_position_embeddings, top-p/top-k/temperature with
    # completions that stop early (EOS) while others go on
    tok = char_tokenizer
    model = build(tf.Gemma3TextConfig(**_common(len(tok), max_position_embeddings=128), head_dim=16, sliding_window=6,
                                      query_pre_attn_scalar=16, final_logit_softcapping=30.0))
    long = [tok("1" * 40)["input_ids"], tok("2")["input_ids"], [5]]
    for prompts, G, T, kw in ((long, 2, 16, {}), ([[5]], 16, 8, {}), (None, 2, 120, {}),
                              (None, 4, 40, {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_new_tokens": 0})):
        dec, gap = sample_gap(model, tok, monkeypatch, mode, prompts=prompts, G=G, T=T, **kw)
        assert not dec.fallback and gap < 1e-5, (G, T, kw, gap)


@pytest.mark.slow
@needs_model
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_held_smollm2_through_the_layer_decoder(converted_dir, monkeypatch, mode):  # noqa: F811
    from gspo.models.loading import load_policy

    model, tok = load_policy(str(converted_dir))
    model.eval()
    msgs = ["What is 2+2?", "Write a haiku about autumn leaves falling slowly.", "Hi"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=False)
               for m in msgs]
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    made = spy(monkeypatch, MAKERS[mode])
    ro = generate(model, prompts, sampling_params(tok, group_size=2, max_new_tokens=24, min_new_tokens=24),
                  generator=torch.Generator().manual_seed(0))
    assert type(made[0]) is LayerDecoder and not made[0].fallback
    with torch.no_grad():
        lp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    # the same 1.6e-5 as Hugging Face's own decode (fp32 sums in another order), within assert_close's rtol
    torch.testing.assert_close(ro.logp, lp, rtol=1e-5, atol=1e-5)

