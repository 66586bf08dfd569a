"""Rollout: recorded log-probs, layout, stopping, sampling options."""

import pytest
import torch

from gspo.models.logprobs import completion_logprobs
from gspo.models.sequences import left_pad, position_ids_from_mask
from gspo.sampling.rollout import generate, sample_token, sampling_params


def _uniforms(n: int, seed: int) -> torch.Tensor:
    """(n,) the uniforms sample_token draws with, from a seeded generator."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))

PROMPTS = ["12+7=", "999-123=", "5+5=", "40+2="]


def encode(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


def test_recorded_logprobs_equal_recomputation(tiny_random, char_tokenizer):
    # fp32: the log-probs recorded while sampling (KV cache, one token at a time) equal one
    # full forward pass over prompt + completion, to 1e-5
    tok = char_tokenizer
    g = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.7):
        ro = generate(tiny_random, encode(tok, PROMPTS),
                      sampling_params(tok, group_size=3, max_new_tokens=6, temperature=temperature), generator=g)
        with torch.no_grad():
            logp = completion_logprobs(tiny_random, ro.input_ids, ro.attention_mask, ro.completion_mask,
                                       temperature=temperature)
        assert ro.completion_mask.sum() > 0
        torch.testing.assert_close(logp, ro.logp, rtol=1e-5, atol=1e-5)
        assert (ro.logp[ro.completion_mask == 0] == 0).all()


def test_group_layout_and_shapes(tiny_random, char_tokenizer):
    tok = char_tokenizer
    g = torch.Generator().manual_seed(1)
    ro = generate(tiny_random, encode(tok, PROMPTS), sampling_params(tok, group_size=4, max_new_tokens=5), generator=g)
    B = len(PROMPTS) * 4
    assert ro.prompt_ids.shape[0] == B and ro.completion_ids.shape[0] == B
    assert ro.completion_ids.shape[1] <= 5
    # rows b and b' hold the same prompt exactly when b // G == b' // G
    texts = tok.batch_decode(ro.prompt_ids, skip_special_tokens=True)
    assert texts == [p for p in PROMPTS for _ in range(4)]
    assert torch.equal(ro.lengths, ro.completion_mask.sum(1).long())


def test_stops_at_eos_and_flags_truncation(char_tokenizer):
    # A model whose only output is EOS from the 2nd completion token on: bias the LM head.
    from tests.conftest import random_tiny_model

    tok = char_tokenizer
    model = random_tiny_model(tok)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # tied with embeddings: fine for this test
    ro = generate(model, encode(tok, PROMPTS), sampling_params(tok, group_size=2, max_new_tokens=3, temperature=0.0))
    # all logits equal: argmax picks token 0 (<pad>) forever, never EOS -> truncated at 3
    assert ro.truncated.all() and (ro.lengths == 3).all()

    eos = tok.eos_token_id
    g = torch.Generator().manual_seed(0)
    logits = torch.full((2, len(tok)), -1e4)
    logits[:, eos] = 0.0
    tokens, lp = sample_token(logits, 1.0, 1.0, torch.rand(len(logits), generator=g))
    assert (tokens == eos).all() and torch.allclose(lp, torch.zeros(2), atol=1e-6)


def test_eos_ends_rows_independently(tiny_random, char_tokenizer):
    tok = char_tokenizer
    g = torch.Generator().manual_seed(3)
    ro = generate(tiny_random, encode(tok, PROMPTS * 4), sampling_params(tok, group_size=4, max_new_tokens=8),
                  generator=g)
    for b in range(ro.completion_ids.shape[0]):
        L = int(ro.lengths[b])
        row = ro.completion_ids[b]
        if not ro.truncated[b]:
            assert row[L - 1] == tok.eos_token_id  # EOS is the last completion token
            assert (row[:L - 1] != tok.eos_token_id).all()
        assert (row[L:] == tok.pad_token_id).all()


def test_left_padding_changes_nothing(tiny_random, char_tokenizer):
    # A prompt's greedy completion and its log-probs are the same alone and in a padded batch.
    tok = char_tokenizer
    prompts = encode(tok, PROMPTS)
    batch = generate(tiny_random, prompts, sampling_params(tok, group_size=1, max_new_tokens=5, temperature=0.0))
    for i, p in enumerate(prompts):
        alone = generate(tiny_random, [p], sampling_params(tok, group_size=1, max_new_tokens=5, temperature=0.0))
        L = int(alone.lengths[0])
        assert torch.equal(batch.completion_ids[i, :L], alone.completion_ids[0, :L])
        torch.testing.assert_close(batch.logp[i, :L], alone.logp[0, :L], rtol=1e-5, atol=1e-5)


def test_sampling_is_seeded(tiny_random, char_tokenizer):
    tok = char_tokenizer

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return generate(tiny_random, encode(tok, PROMPTS), sampling_params(tok, group_size=4, max_new_tokens=6),
                        generator=g).completion_ids

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))


def test_top_p_keeps_the_nucleus_only():
    # probabilities 0.5, 0.3, 0.15, 0.05; top_p = 0.7 keeps {0.5, 0.3} (0.5 < 0.7 <= 0.8)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    tokens, lp = sample_token(logits, 1.0, 0.7, torch.rand(len(logits), generator=g))
    assert set(tokens.tolist()) == {0, 1}
    # the recorded log-prob is the untruncated one (log 0.5 or log 0.3), as in recomputation
    expected = torch.log(torch.tensor([0.5, 0.3]))[tokens]
    torch.testing.assert_close(lp, expected)
    # frequencies follow the renormalised nucleus 0.5/0.8 = 0.625 (binomial sd ≈ 0.0077)
    assert abs((tokens == 0).float().mean().item() - 0.625) < 0.03


def test_greedy_picks_argmax_and_records_tau1_logprob():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    tokens, lp = sample_token(logits, 0.0, 1.0, None)
    assert tokens.tolist() == [1]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[:, 1])


def test_left_pad_and_positions():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert position_ids_from_mask(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_scales_training_logprobs(tiny_random, char_tokenizer, temperature):
    # the training log-probs use the sampling temperature: log softmax(logits / τ)
    tok = char_tokenizer
    ro = generate(tiny_random, encode(tok, PROMPTS[:1]),
                  sampling_params(tok, group_size=1, max_new_tokens=3, temperature=0.0))
    with torch.no_grad():
        lp = completion_logprobs(tiny_random, ro.input_ids, ro.attention_mask, ro.completion_mask,
                                 temperature=temperature)
        logits = tiny_random(input_ids=ro.input_ids).logits[0, -ro.completion_ids.shape[1] - 1:-1]
        ref = torch.log_softmax(logits / temperature, -1).gather(-1, ro.completion_ids[0][:, None]).squeeze(-1)
    torch.testing.assert_close(lp[0], ref * ro.completion_mask[0], rtol=1e-5, atol=1e-5)


def test_min_new_tokens_fixes_the_length(tiny_random, char_tokenizer):
    # EOS banned for all 5 steps: every completion is exactly 5 tokens, none ends in EOS, and
    # the recorded log-probs are still those of the unmasked distribution (= recomputation)
    tok = char_tokenizer
    with torch.no_grad():  # make EOS the most likely token everywhere
        tiny_random.lm_head.weight[tok.eos_token_id] += 5.0
    g = torch.Generator().manual_seed(0)
    ro = generate(tiny_random, encode(tok, PROMPTS),
                  sampling_params(tok, group_size=2, max_new_tokens=5, min_new_tokens=5), generator=g)
    assert (ro.lengths == 5).all() and ro.truncated.all()
    assert not (ro.completion_ids == tok.eos_token_id).any()
    with torch.no_grad():
        logp = completion_logprobs(tiny_random, ro.input_ids, ro.attention_mask, ro.completion_mask)
    torch.testing.assert_close(logp, ro.logp, rtol=1e-5, atol=1e-5)
    free = generate(tiny_random, encode(tok, PROMPTS), sampling_params(tok, group_size=2, max_new_tokens=5),
                    generator=g)
    assert (free.lengths < 5).any()  # without the ban, EOS does get drawn


def test_split_batches_sample_the_same_tokens(tiny_random, char_tokenizer):
    # the batch of 4 prompts x 2 samples = rows 0..7, sampled at once, or as rows 0..3 and
    # 4..7 in two calls (two processes): every row draws the same uniforms, so the tokens match
    tok = char_tokenizer
    prompts = encode(tok, PROMPTS)
    params = sampling_params(tok, group_size=2, max_new_tokens=6)
    whole = generate(tiny_random, prompts, params, generator=torch.Generator().manual_seed(7))
    first = generate(tiny_random, prompts[:2], params, generator=torch.Generator().manual_seed(7), rows=(0, 8))
    second = generate(tiny_random, prompts[2:], params, generator=torch.Generator().manual_seed(7), rows=(4, 8))
    for part, rows in ((first, slice(0, 4)), (second, slice(4, 8))):
        T = part.completion_ids.shape[1]
        assert torch.equal(part.completion_ids, whole.completion_ids[rows, :T])
        assert torch.equal(part.lengths, whole.lengths[rows])
        torch.testing.assert_close(part.logp, whole.logp[rows, :T], rtol=1e-5, atol=1e-5)
    # and a different seed samples differently
    other = generate(tiny_random, prompts, params, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(other.completion_ids, whole.completion_ids)


def test_inverse_cdf_sampling_frequencies_and_logprobs():
    # p = [0.1, 0.2, 0.3, 0.4]; 20,000 draws: each frequency within 0.015 of p (binomial sd <= 0.0035)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = (torch.log(probs) + 3.0).repeat(20000, 1)  # a shift changes nothing
    tokens, lp = sample_token(logits, 1.0, 1.0, _uniforms(20000, 0))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert (freq - probs).abs().max() < 0.015, freq
    torch.testing.assert_close(lp, torch.log(probs)[tokens], rtol=1e-6, atol=1e-6)
    # temperature 2: p ∝ p^(1/2) = [0.316, 0.447, 0.548, 0.632] / 1.943
    t2 = probs.sqrt() / probs.sqrt().sum()
    tokens, lp = sample_token(logits, 2.0, 1.0, _uniforms(20000, 1))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert (freq - t2).abs().max() < 0.015, freq
    torch.testing.assert_close(lp, torch.log(t2)[tokens], rtol=1e-5, atol=1e-6)
    # a banned token is never drawn, and the others keep their relative frequencies
    tokens, lp = sample_token(logits, 1.0, 1.0, _uniforms(20000, 2), banned=(3,))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert freq[3] == 0 and (freq[:3] - probs[:3] / 0.6).abs().max() < 0.015
    torch.testing.assert_close(lp, torch.log(probs)[tokens], rtol=1e-6, atol=1e-6)  # unmasked log-probs


def _qwen_like_chat_model(path):
    """A chat model as Qwen2.5 ships: the tokenizer's EOS is <|endoftext|>, the chat template
    closes turns with <|im_end|>, and generation_config.eos_token_id lists both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from tests.conftest import build_chat_model

    build_chat_model(path)  # tokenizer: <pad>=0, <|im_end|>=1, <unk>=2, <|im_start|>=3, then printable chars
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"eos_token": "<|endoftext|>"})
    tok.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tok))
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    model.generation_config = GenerationConfig(eos_token_id=[eot, im_end], pad_token_id=tok.pad_token_id)
    with torch.no_grad():  # make <|im_end|> the likely next token everywhere
        model.lm_head.weight[im_end] += 8.0 * model.model.norm.weight.sign() / model.lm_head.weight.shape[1] ** 0.5
    model.save_pretrained(path)
    return path, im_end, eot


def test_stop_tokens_union_of_tokenizer_generation_config_and_user(tmp_path):
    from gspo.models.loading import load_policy
    from gspo.sampling.rollout import stop_token_ids

    path, im_end, eot = _qwen_like_chat_model(tmp_path / "m")
    model, tok = load_policy(str(path))
    assert tok.eos_token_id == eot != im_end
    assert stop_token_ids(tok) == (eot,)  # what gspo stopped on before: completions ran past <|im_end|>
    stops = stop_token_ids(tok, model)
    assert set(stops) == {eot, im_end}
    assert stop_token_ids(tok, model, ("x",)) == (*stops, tok.convert_tokens_to_ids("x"))
    with pytest.raises(ValueError, match="stop_token: '<nope>' is not a token"):
        stop_token_ids(tok, model, ("<nope>",))
    from gspo.sampling.rollout import encode_prompts

    prompts = encode_prompts(tok, [[{"role": "user", "content": "hi"}]])
    g = torch.Generator().manual_seed(0)
    ro = generate(model, prompts, sampling_params(tok, stop=stops, group_size=8, max_new_tokens=12), generator=g)
    ended = ro.completion_ids[torch.arange(8), ro.lengths - 1]
    assert (ended[~ro.truncated] == im_end).any()  # <|im_end|> ends completions ...
    for row, n in zip(ro.completion_ids, ro.lengths):  # ... and nothing runs past a stop token
        assert not any(t in stops for t in row[: int(n) - 1].tolist())
    # min_new_tokens bans every stop token, not only the tokenizer's EOS
    ro = generate(model, prompts, sampling_params(tok, stop=stops, group_size=8, max_new_tokens=4, min_new_tokens=4),
                  generator=g)
    assert (ro.lengths == 4).all() and not torch.isin(ro.completion_ids[:, :3], torch.tensor(stops)).any()


def test_evaluation_stops_on_the_same_set(tmp_path):
    from gspo.models.loading import load_policy
    from gspo.rewards.builtin import Reward
    from gspo.tasks.data import Example
    from gspo.train.evaluation import EvalOptions, evaluate

    path, im_end, eot = _qwen_like_chat_model(tmp_path / "m")
    model, tok = load_policy(str(path))
    seen = []

    def record(completions, completion_ids, **kw):
        seen.extend(completion_ids)
        return [0.0] * len(completions)

    class Task:
        def test_set(self, n=None):
            return [Example([{"role": "user", "content": "hi"}], "1", {}, "row 1")]

    evaluate(model, tok, Task(), [Reward("r", record)], EvalOptions(n=1, k=4, max_new_tokens=12))
    assert any(ids and ids[-1] == im_end for ids in seen)  # greedy and sampled completions end at <|im_end|>
    assert all(t not in (im_end, eot) for ids in seen for t in ids[:-1])


def test_pass_at_k_draws_on_the_cpu_whatever_the_model_device(tiny_random, char_tokenizer, monkeypatch):
    # the sampler draws its uniforms on the CPU; a generator made on the model's device (cuda)
    # made pass@k raise on a GPU. Pretend the model lives on cuda and catch the generator made.
    import gspo.train.evaluation as ev
    from gspo.rewards.builtin import load_rewards
    from gspo.tasks import get_task

    made = []
    real = torch.Generator

    def spy(*a, **kw):
        made.append(kw.get("device", a[0] if a else "cpu"))
        return real(*a, **kw) if str(made[-1]) == "cpu" else real()

    class OnCuda:
        device = torch.device("cuda", 0)

    monkeypatch.setattr(ev.torch, "Generator", spy)
    monkeypatch.setattr(ev, "next", lambda it, *d: OnCuda(), raising=False)  # what evaluation sees of the model
    ev.evaluate(tiny_random, char_tokenizer, get_task("arithmetic"), load_rewards(["exact_integer"], None),
                ev.EvalOptions(n=4, k=2))
    assert made and all(str(d) == "cpu" for d in made)


def test_kv_cache_grows_with_what_is_generated(char_tokenizer, monkeypatch):
    # a model that ends every completion at once, asked for up to 1000 new tokens: the fast
    # decoder's cache holds the prompt + one block of columns, not prompt + 1000 for every row
    import gspo.sampling.fastdecode as fd
    import gspo.sampling.rollout as rollout_module
    from tests.conftest import random_tiny_model

    tok = char_tokenizer
    model = random_tiny_model(tok)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] += 50.0 * model.model.norm.weight.sign()
    made = []

    def spy(m, max_len, **kw):
        made.append(fd.decoder(m, max_len, **kw))
        return made[-1]

    monkeypatch.setattr(rollout_module, "decoder", spy)
    ro = generate(model, encode(tok, PROMPTS),
                  sampling_params(tok, group_size=4, max_new_tokens=1000, min_new_tokens=3),
                  generator=torch.Generator().manual_seed(0))
    assert isinstance(made[0], fd.FastDecoder) and not made[0].fallback
    P = ro.prompt_ids.shape[1]
    assert int(ro.lengths.max()) < 20  # 3 banned steps, then EOS soon
    assert made[0].cols.capacity == P + fd.BLOCK < P + 1000
    # and it doubles when a rollout does run long (the recorded log-probs stay exact)
    long = generate(model, encode(tok, PROMPTS[:1]), sampling_params(tok, group_size=1, max_new_tokens=150,
                                                                      min_new_tokens=150))
    assert made[-1].cols.capacity >= long.prompt_ids.shape[1] + 150 > P + fd.BLOCK
    from gspo.models.logprobs import completion_logprobs

    with torch.no_grad():
        lp = completion_logprobs(model, long.input_ids, long.attention_mask, long.completion_mask)
    torch.testing.assert_close(lp, long.logp, rtol=1e-4, atol=1e-4)


def test_top_k_draws_only_the_k_most_likely_and_records_the_full_logprob():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    tokens, lp = sample_token(logits, 1.0, 1.0, _uniforms(4000, 0), top_k=2)
    assert set(tokens.tolist()) == {0, 1}  # only the two most likely
    full = torch.log_softmax(logits[0], -1)
    torch.testing.assert_close(lp, full[tokens])  # the log-prob of the whole distribution, as top-p does
    # within the top 2, the frequencies keep their ratio e^3 : e^2 -> 0.731 of draws are token 0
    assert abs(float((tokens == 0).float().mean()) - 0.7311) < 0.03


def test_stop_strings_cut_the_completion_after_the_token_that_completes_them(char_tokenizer):
    from gspo.models.sequences import Rollout
    from gspo.sampling.rollout import cut_at_stop_strings

    tok = char_tokenizer
    texts = ["12+34=56", "7=8", "999"]
    ids = [tok(t)["input_ids"] for t in texts]
    T = max(map(len, ids))
    comp = torch.tensor([i + [tok.pad_token_id] * (T - len(i)) for i in ids])
    lengths = torch.tensor([len(i) for i in ids])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    ro = Rollout(torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.long), comp, mask, -mask, lengths,
                 torch.tensor([True, True, True]), 1)
    ro = cut_at_stop_strings(ro, tok, ("4=", "=8"))
    # "12+34=56": "4=" completes at the 6th token -> 6 tokens kept; "7=8": "=8" at the 3rd -> 3; "999": none
    assert ro.lengths.tolist() == [6, 3, 3] and ro.truncated.tolist() == [False, False, True]
    assert tok.decode(ro.completion_ids[0][:6]) == "12+34=" and (ro.completion_ids[0, 6:] == tok.pad_token_id).all()
    assert ro.completion_mask.sum(1).tolist() == [6, 3, 3] and (ro.logp[0, 6:] == 0).all()


def test_prompts_keep_their_last_max_length_tokens(char_tokenizer):
    from gspo.sampling.rollout import encode_prompts

    # "12345+6=" keeps its last 4 tokens "5+6="; "1+2=" is 4 tokens long already
    assert encode_prompts(char_tokenizer, ["12345+6=", "1+2="], max_length=4) == \
        [char_tokenizer("5+6=")["input_ids"], char_tokenizer("1+2=")["input_ids"]]
