"""gspo's compact decode for the families the hand-written step does not know (gspo.sampling.layerdecode),
for LoRA policies, and its static mode (the CUDA-graph code, run on the CPU with a recording stand-in).

Each family is a tiny random config with the family's own peculiarities switched on (Gemma 3's
(1 + w) norms, sandwich norms, sliding and full layers with two rotary tables and a logit soft-cap;
Phi-3's fused projections, partial rotary and a window on every layer; OLMo 2's post-norms and Q/K
norms over whole projections; granite's four multipliers; SmolLM3's layers without rotary), with
windows small enough that every rollout passes them. What must hold, per family and mode:
- the plan names gspo's compact decode, and the rollout never fell back to Hugging Face's forward;
- the recorded log-probs equal a full-sequence training forward (completion_logprobs) in fp32, to 1e-5;
- greedy decoding equals `model.generate`, token for token;
- step by step, the logits equal Hugging Face's own decode step, to 1e-4 (well inside the check's 1e-3).
"""

import pytest
import torch
import transformers as tf

import gspo.sampling.fastdecode as fd
import gspo.sampling.graphs as graphs
import gspo.sampling.hfdecode as hfdecode
import gspo.sampling.rollout as rollout_module
from gspo.models.logprobs import completion_logprobs
from gspo.models.sequences import left_pad, position_ids_from_mask
from gspo.sampling import layerdecode
from gspo.sampling.kvcache import Columns
from gspo.sampling.layerdecode import LayerDecoder, bucket
from gspo.sampling.rollout import PolicySampler, generate, sampling_params

PROMPTS = ["12+7=", "999-123=", "5+5=", "40+2="]
T = 20  # tokens per completion: past every window below


def _common(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=None)


def family_config(name: str, vocab: int):
    c = _common(vocab)
    if name == "gemma3":  # window 6 on three layers of four; the full one has its own rotary base; a logit soft-cap
        return tf.Gemma3TextConfig(**c, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                "sliding_attention"], final_logit_softcapping=30.0)
    if name == "phi3":  # a window on every layer, half the head dims rotated
        return tf.Phi3Config(**c, sliding_window=7, partial_rotary_factor=0.5)
    if name == "olmo2":
        return tf.Olmo2Config(**c)
    if name == "granite":
        return tf.GraniteConfig(**c, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                logits_scaling=4.0)
    if name == "smollm3":  # layers 1 and 3 without rotary embeddings (NoPE)
        return tf.SmolLM3Config(**c, no_rope_layers=[1, 0, 1, 0])
    raise ValueError(name)


FAMILIES = ["gemma3", "phi3", "olmo2", "granite", "smollm3"]


def build(name: str, tok, attn: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(family_config(name, len(tok)), attn_implementation=attn).eval()
    with torch.no_grad():  # norms start at one (zero in Gemma's 1 + w form): give them shape
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


def static_with(backend):
    return lambda m, n: LayerDecoder(m, n, static=True, graphs=graphs.Runner(backend))


@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_decodes_with_the_compact_step_exactly(char_tokenizer, monkeypatch, name, mode):
    tok = char_tokenizer
    model = build(name, tok)
    kind, why = fd.path(model, 64)
    assert kind == "layers" and why.startswith("the hand-written step: ")
    assert fd.describe(model, 64).startswith("the compact decode step over the model's own layers")
    rec = graphs.Recording()
    made = spy(monkeypatch, static_with(rec) if mode == "static" else None)
    ro = generate(model, encode(tok), sampling_params(tok, group_size=3, max_new_tokens=T, min_new_tokens=T),
                  generator=torch.Generator().manual_seed(0))
    dec = made[0]
    assert type(dec) is LayerDecoder and dec.checked and not dec.fallback
    with torch.no_grad():
        logp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    torch.testing.assert_close(ro.logp, logp, rtol=1e-5, atol=1e-5)
    if mode == "static":
        # 12 rows -> a bucket of 16, the cache's whole width from the start; the first of the T - 1 decode steps
        # is captured (its replay checked against the eager step, then against Hugging Face's), every one a replay
        assert dec.cols.rows == 16 and dec.cols.capacity == dec.max_len
        assert (rec.captures, rec.replays) == (1, T - 1)
    else:
        assert dec.cols.rows == 12 and not dec.cols.static


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_is_greedy_as_transformers_generate(char_tokenizer, name):
    tok = char_tokenizer
    model = build(name, tok)
    prompts = encode(tok)
    ro = generate(model, prompts, sampling_params(tok, group_size=1, max_new_tokens=T, min_new_tokens=T,
                                                  temperature=0.0))
    for b, ids in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=T, min_new_tokens=T, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, len(ids):]
        assert ro.completion_ids[b].tolist() == ref.tolist()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_step_logits_equal_hugging_face_step_by_step(char_tokenizer, name, static, attn):
    # the same tokens fed to both decoders for T steps (past the windows); eager attention takes additive masks
    tok = char_tokenizer
    model = build(name, tok, attn)
    ids, mask = left_pad(encode(tok), tok.pad_token_id, "cpu")  # (4, P)
    pos = position_ids_from_mask(mask)
    P = ids.shape[1]
    with torch.inference_mode():
        ours, hf = LayerDecoder(model, P + T, static=static), hfdecode.HFDecoder(model)
        torch.testing.assert_close(ours.prefill(ids, mask, pos), hf.prefill(ids, mask, pos))
        ours.expand(2)
        hf.expand(2)
        attn_mask = torch.cat([mask.repeat_interleave(2, 0), torch.ones((8, T), dtype=mask.dtype)], 1)
        nxt, g = pos[:, -1].repeat_interleave(2) + 1, torch.Generator().manual_seed(0)
        for s in range(T):
            tok_s = torch.randint(3, len(tok), (8,), generator=g)
            a = ours._fast_step(tok_s, attn_mask[:, :P + s + 1], nxt)
            b = hf.step(tok_s, attn_mask[:, :P + s + 1], nxt)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
            nxt = nxt + 1


def test_a_stray_sliding_window_in_a_config_is_not_applied(char_tokenizer, monkeypatch):
    # a Llama config that carries sliding_window (some fine-tunes' config.json do): LlamaModel never applies
    # it, and neither may gspo. Rollouts longer than it must equal the training forward, which attends to all
    tok = char_tokenizer
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**_common(len(tok)), sliding_window=4)).eval()
    assert layerdecode.windows(model, 64) == [None] * 4 and fd.path(model, 64) == ("fast", None)
    for make in (None, lambda m, n: LayerDecoder(m, n)):
        made = spy(monkeypatch, make)
        ro = generate(model, encode(tok), sampling_params(tok, group_size=2, max_new_tokens=T, min_new_tokens=T),
                      generator=torch.Generator().manual_seed(0))
        assert not made[0].fallback
        with torch.no_grad():
            logp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
        torch.testing.assert_close(ro.logp, logp, rtol=1e-5, atol=1e-5)
    # Hugging Face's forward as gspo decodes with it (a fallback, or a model neither step serves): prefilled into
    # a plain DynamicCache. The one transformers' forward makes from this config keeps only the last 3 columns
    # of every layer (it reads sliding_window from the config), which its masks do not know: `generate` then
    # differs from the training forward by 0.18-0.5 in the logits from the second step on
    monkeypatch.setattr(fd, "path", lambda m, n, **kw: ("hf", "test"))
    made = spy(monkeypatch)
    ro = generate(model, encode(tok), sampling_params(tok, group_size=2, max_new_tokens=T, min_new_tokens=T),
                  generator=torch.Generator().manual_seed(0))
    assert type(made[0]) is hfdecode.HFDecoder
    with torch.no_grad():
        logp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    torch.testing.assert_close(ro.logp, logp, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    # Mistral's forward does slide over every layer: its window is applied
    mistral = tf.AutoModelForCausalLM.from_config(tf.MistralConfig(**_common(len(tok)), sliding_window=4))
    assert layerdecode.windows(mistral, 64) == [4] * 4
    assert fd.path(mistral, 64)[1] == "the hand-written step: rollouts of 64 tokens pass its sliding window of 4"


def lora(model, seed: int = 1, **kw):
    from peft import LoraConfig, get_peft_model

    from gspo.models.loading import quiet_peft

    with quiet_peft():
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **{"target_modules": "all-linear", **kw}))
    torch.manual_seed(seed)
    with torch.no_grad():  # B starts at zero: give the adapters something to say
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    return peft_model.eval()


@pytest.mark.parametrize("case", ["qwen3", "qwen3-moe-experts", "qwen3-dora", "qwen3-head", "gemma3"])
def test_lora_policies_decode_on_the_compact_step_with_their_adapters(char_tokenizer, monkeypatch, case):
    # the hand-written step applies the adapters of every projection it reads (gspo.models.adapters.lin); what
    # it would read as a weight (DoRA's magnitude, 3-D expert weights, an LM head) goes to the model's own layers
    pytest.importorskip("peft")
    from tests.conftest import random_tiny_model

    tok = char_tokenizer
    if case == "gemma3":
        model, expected = lora(build("gemma3", tok)), ("layers", "model_type gemma3_text is not one of")
    elif case == "qwen3-moe-experts":
        base = tf.AutoModelForCausalLM.from_config(tf.Qwen3MoeConfig(
            **_common(len(tok)), head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
        model, expected = lora(base.eval()), ("layers", "layer 0's Qwen3MoeSparseMoeBlock: its router is a ")
    else:
        kw = {"qwen3": {}, "qwen3-dora": {"use_dora": True}, "qwen3-head": {"target_modules": ["q_proj", "lm_head"]}}
        model = lora(random_tiny_model(tok, num_hidden_layers=3), **kw[case])
        expected = {"qwen3": ("fast", None), "qwen3-dora": ("layers", "a LoRA variant (DoRA or another) at "),
                    "qwen3-head": ("layers", "its LM head is not a plain")}[case]
    kind, why = fd.path(model, 64)
    assert kind == expected[0] and (why is None if expected[1] is None
                                    else why.startswith(f"the hand-written step: {expected[1]}")), why
    made = spy(monkeypatch)
    ro = generate(model, encode(tok), sampling_params(tok, group_size=3, max_new_tokens=T, min_new_tokens=T),
                  generator=torch.Generator().manual_seed(0))
    assert type(made[0]) is (fd.FastDecoder if kind == "fast" else LayerDecoder) and not made[0].fallback
    with torch.no_grad():
        logp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
        with model.disable_adapter():
            base_logp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    torch.testing.assert_close(ro.logp, logp, rtol=1e-5, atol=1e-5)
    assert (base_logp - logp).abs().max() > 0.1  # the adapters matter: a step that dropped them would fail above


def test_adapters_dropped_would_fail_the_first_step_check(char_tokenizer, monkeypatch):
    # what the hand-written step did before it knew adapters (read each projection's base weight): the
    # rollout's first-step check catches it and the rollout goes on with Hugging Face's forward, exactly
    pytest.importorskip("peft")
    import gspo.models.adapters as adapters
    import gspo.models.fastmoe as fastmoe
    from tests.conftest import random_tiny_model

    tok = char_tokenizer
    model = lora(random_tiny_model(tok, num_hidden_layers=3))

    def base_only(m, x):
        base = getattr(m, "base_layer", m)
        return torch.nn.functional.linear(x, base.weight, base.bias)

    monkeypatch.setattr(fd, "lin", base_only)
    monkeypatch.setattr(fastmoe, "lin", base_only)
    monkeypatch.setattr(hfdecode, "_said", [])
    made = spy(monkeypatch)
    ro = generate(model, encode(tok), sampling_params(tok, group_size=2, max_new_tokens=8, min_new_tokens=8),
                  generator=torch.Generator().manual_seed(0))
    assert type(made[0]) is fd.FastDecoder and made[0].fallback
    with torch.no_grad():
        logp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    torch.testing.assert_close(ro.logp, logp, rtol=1e-5, atol=1e-5)
    assert adapters.lin is not base_only  # the module's own function is untouched


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_later_turns_go_on_from_the_kept_cache(char_tokenizer, monkeypatch, mode):
    # a second turn fed after the kept cache (rows selected, a chunk of new tokens) equals a full prefill of it;
    # static mode keeps its buffers (the graph reads them): the kept rows move to the front of its bucket
    tok = char_tokenizer
    model = build("olmo2", tok)
    rec = graphs.Recording()
    made = spy(monkeypatch, static_with(rec) if mode == "static" else lambda m, n: LayerDecoder(m, n))
    prompts = encode(tok, ["12+7=", "999-123=", "5+5="])
    out = []
    for keep in (False, True):
        sampler = PolicySampler(model, keep_cache=keep)
        first = sampler.sample(prompts, sampling_params(tok, group_size=1, max_new_tokens=6, min_new_tokens=6),
                               generator=torch.Generator().manual_seed(0), rows=(torch.arange(3), 3))
        rows = torch.tensor([2, 0])  # two episodes go on, in another order
        turn = [prompts[r] + first.completion_ids[r].tolist() + tok("=11+", add_special_tokens=False)["input_ids"]
                for r in rows.tolist()]
        out.append(sampler.sample(turn, sampling_params(tok, group_size=1, max_new_tokens=8, min_new_tokens=8),
                                  generator=torch.Generator().manual_seed(1), rows=(rows, 3)))
    assert len(made) == 3  # the kept cache's second turn made no decoder of its own
    assert not made[-1].fallback
    assert torch.equal(out[0].completion_ids, out[1].completion_ids)
    torch.testing.assert_close(out[0].logp, out[1].logp, rtol=1e-5, atol=1e-5)
    if mode == "static":
        assert made[-1].cols.rows == 4 and made[-1].real == 2  # the bucket of 3 rows, two kept


def test_a_replay_that_disagrees_with_the_eager_step_is_never_used(char_tokenizer, monkeypatch):
    # a graph that replays something else (here: stale by one step) is caught at its first replay, where the
    # eager step is computed beside it: the decoder goes on eagerly and the rollout is exact
    tok = char_tokenizer
    model = build("granite", tok)

    class Stale(graphs.Recording):
        def replay(self, graph):
            super().replay(graph)
            graph[1].add_(1.0)  # what an address gone stale would give: other logits

    monkeypatch.setattr(graphs, "_said", [])
    rec = Stale()
    made = spy(monkeypatch, static_with(rec))
    ro = generate(model, encode(tok), sampling_params(tok, group_size=2, max_new_tokens=10, min_new_tokens=10),
                  generator=torch.Generator().manual_seed(0))
    assert made[0].graphs.off and rec.replays == 1  # the one replay of the capture, never another
    assert graphs._said
    with torch.no_grad():
        logp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    torch.testing.assert_close(ro.logp, logp, rtol=1e-5, atol=1e-5)


def test_a_step_that_cannot_be_captured_decodes_eagerly(char_tokenizer, monkeypatch, capsys):
    tok = char_tokenizer
    model = build("phi3", tok)

    class Refuses(graphs.Recording):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(graphs, "_said", [])
    made = spy(monkeypatch, static_with(Refuses()))
    ro = generate(model, encode(tok), sampling_params(tok, group_size=2, max_new_tokens=10, min_new_tokens=10),
                  generator=torch.Generator().manual_seed(0))
    assert made[0].graphs.off
    assert "cuda graphs: the decode step could not be captured (operation not permitted when stream is " \
           "capturing); such rollouts decode eagerly (slower)" in capsys.readouterr().err
    with torch.no_grad():
        logp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    torch.testing.assert_close(ro.logp, logp, rtol=1e-5, atol=1e-5)


def test_where_graphs_serve_and_the_option_that_turns_them_off(char_tokenizer, monkeypatch):
    from gspo.models.tiny import tiny_moe_config
    from tests.conftest import random_tiny_model

    tok = char_tokenizer
    dense, gemma = random_tiny_model(tok), build("gemma3", tok)
    moe = tf.Qwen3MoeForCausalLM(tiny_moe_config(len(tok), num_hidden_layers=2)).eval()
    assert graphs.why_not(dense) == "the model is on cpu, not a CUDA device"
    from torch.distributed.fsdp import FSDPModule

    sharded = random_tiny_model(tok)
    layer = sharded.model.layers[0]
    layer.__class__ = type(f"FSDP{type(layer).__name__}", (FSDPModule, type(layer)), {})  # what fully_shard does
    assert graphs.why_not(sharded) == "an FSDP-sharded model (its hooks run at every module call, outside any graph)"
    monkeypatch.setattr(graphs, "why_not", lambda m: None if m is not moe else "an MoE model's expert dispatch "
                                                                                "depends on the data")
    # on a CUDA device (pretended): every model a graph can serve decodes over its own layers in graphs
    for model in (dense, gemma):
        assert fd.path(model, 64) == ("graphs", None)
        dec = fd.decoder(model, 64)
        assert type(dec) is LayerDecoder and dec.static and isinstance(dec.graphs, graphs.Runner)
    assert fd.describe(dense, 64) == "the compact decode step over the model's own layers, in CUDA graphs " \
                                     "(gspo.sampling.layerdecode)"
    assert fd.path(moe, 64) == ("fast", None)  # an MoE model keeps the hand-written step, eagerly
    # --cuda-graphs false: as without graphs (the why names the option only on a CUDA device)
    assert fd.path(dense, 64, cuda_graphs=False) == ("fast", None)
    assert fd.path(gemma, 64, cuda_graphs=False)[0] == "layers"
    assert type(fd.decoder(dense, 64, cuda_graphs=False)) is fd.FastDecoder


def test_buckets():
    # powers of two up to 32, then multiples of an eighth of the next power of two: 129 -> 256 / 8 = 32 -> 160
    assert [bucket(n) for n in (1, 2, 3, 5, 9, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    assert [bucket(n) for n in (33, 40, 41, 100, 128, 129, 256, 257)] == [40, 40, 48, 112, 128, 160, 256, 320]
    assert all(n <= bucket(n) < 2 * n if n <= 32 else n <= bucket(n) < n * 5 / 4 for n in range(2, 2000))
    assert len({bucket(n) for n in range(1, 513)}) == 6 + 4 * 4  # 22 shapes for up to 512 rows


def test_masks_by_hand():
    # 2 rows, 3 columns written (row 1's first is padding), a chunk of 2 tokens at columns 3 and 4, window 3:
    # query column q sees real j with j <= q and j > q - 3
    k = [torch.zeros((2, 1, 8, 4))]
    cols = Columns(k, [torch.zeros_like(k[0])], t=3, max_len=8)
    attn = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    m = cols.masks(attn, 2, {None, 3})
    full, slid = m[None].int(), m[3].int()
    assert full.shape == (2, 1, 2, 5)
    assert full[0, 0].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]  # q=3 sees 0..3; q=4 sees 0..4
    assert full[1, 0].tolist() == [[0, 1, 1, 1, 0], [0, 1, 1, 1, 1]]  # column 0 is padding
    assert slid[0, 0].tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]  # q=3: 1..3; q=4: 2..4
    # static mode: 4 rows (2 of padding, seeing column 0 only), the whole width, additive for eager attention
    st = Columns([torch.zeros((4, 1, 8, 4))], [torch.zeros((4, 1, 8, 4))], t=3, max_len=8, static=True)
    add = st.masks(attn, 1, {None}, dtype=torch.float32)[None]
    assert add.shape == (4, 1, 1, 8)
    low = torch.finfo(torch.float32).min
    assert add[0, 0, 0].tolist() == [0, 0, 0, 0] + [low] * 4
    assert add[3, 0, 0].tolist() == [0] + [low] * 7


@pytest.mark.slow  # trains (a process of its own)
def test_a_run_on_a_gemma3_directory_says_its_decode_and_trains(char_tokenizer, tmp_path):
    import json
    import subprocess
    import sys

    model = build("gemma3", char_tokenizer)
    model.config.max_position_embeddings = 256
    model.save_pretrained(tmp_path / "gemma3")
    char_tokenizer.save_pretrained(tmp_path / "gemma3")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gspo", "train", "--model", str(tmp_path / "gemma3"), "--steps", "2",
                           "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "12", "--eval-size", "8",
                           "--no-progress", "--output-dir", str(run)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "decode: the compact decode step over the model's own layers (gspo.sampling.layerdecode; the " \
           "hand-written step: model_type gemma3_text is not one of" in out
    assert "differ from Hugging Face's forward" not in out  # no rollout fell back
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum("time/step_seconds" in r for r in rows) == 2
