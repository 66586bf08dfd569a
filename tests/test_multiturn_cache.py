"""Multi-turn rollouts that keep each episode's KV cache between turns (gspo.sampling.turncache): the same
episodes as prefilling every turn's conversation whole, for only the new tokens' cost."""

import pytest
import torch

import gspo.sampling.episodes as episodes_module
import gspo.sampling.fastdecode as fd
import gspo.sampling.rollout as rollout_module
from gspo.models.loading import load_policy
from gspo.models.logprobs import token_logprobs
from gspo.models.moe import Routing
from gspo.sampling.episodes import Draws, EpisodeSpec, run_episodes
from gspo.sampling.rollout import PolicySampler, sampling_params, stop_token_ids
from gspo.tasks.calculator import CalculatorEnv, CalculatorTask
from gspo.tasks.data import Example
from gspo.tasks.env import Environment, Step


class Again(Environment):
    """Answers every model turn with the user message "again"; never done (max_turns ends it)."""

    def reset(self, example):
        pass

    def step(self, text):
        return Step([{"role": "user", "content": "again"}])


class Sums(Environment):
    """For tiny-moe's character vocabulary: a new sum to answer after each turn; done after three."""

    def reset(self, example):
        self.k = 0

    def step(self, text):
        self.k += 1
        return Step([{"role": "user", "content": f"{self.k}+{len(text)}="}], reward=0.5, done=self.k == 3)


@pytest.fixture(scope="module")
def tool_model():
    return load_policy("tiny-tool")


@pytest.fixture(scope="module")
def moe_model():
    model, tok = load_policy("tiny-moe")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # characters of its vocabulary only
    return model, tok


def recording(monkeypatch) -> list:
    """Every decoder call of the rollouts that follow, as (call, real tokens fed): "prefill", "chunk"
    (a later turn's tokens fed after the kept cache) or "step"; "sample" marks each `sample`."""
    calls = []
    make = fd.decoder

    def decoder(model, max_len, **kw):
        dec = make(model, max_len, **kw)
        prefill, step = dec.prefill, dec.step

        def recorded_prefill(ids, attn, pos):
            calls.append(("prefill", int(attn.sum())))
            return prefill(ids, attn, pos)

        def recorded_step(ids, attn, pos):
            chunk = ids.dim() == 2
            calls.append(("chunk", int(attn[:, -ids.shape[1]:].sum())) if chunk else ("step", ids.shape[0]))
            return step(ids, attn, pos)

        dec.prefill, dec.step = recorded_prefill, recorded_step
        return dec

    sample = PolicySampler.sample

    def marked(self, *a, **kw):
        calls.append(("sample", 0))
        return sample(self, *a, **kw)

    monkeypatch.setattr(rollout_module, "decoder", decoder)
    monkeypatch.setattr(PolicySampler, "sample", marked)
    return calls


def per_sample(calls: list) -> list[list]:
    """The recorded calls split by `sample`."""
    out = []
    for call in calls:
        if call[0] == "sample":
            out.append([])
        else:
            out[-1].append(call)
    return out


def episodes(model, tok, examples, spec, params, keep, routing=None):
    sampler = PolicySampler(model, keep_cache=keep, **({} if routing is None else {"routing": routing}))
    draws = Draws(generator_for=lambda turn: torch.Generator().manual_seed(10 + turn))
    out = run_episodes(sampler, tok, examples, spec, params, draws)
    sampler.end_rollout()
    return out


def assert_same_episodes(a, b):
    (ro_a, ep_a), (ro_b, ep_b) = a, b
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "env_mask", "lengths", "truncated"):
        assert torch.equal(getattr(ro_a, name), getattr(ro_b, name)), name
    torch.testing.assert_close(ro_a.logp, ro_b.logp, rtol=1e-5, atol=1e-5)
    assert ep_a.final_ids == ep_b.final_ids and ep_a.final_texts == ep_b.final_texts
    assert ep_a.transcripts == ep_b.transcripts and ep_a.turn_rewards == ep_b.turn_rewards
    for name in ("turn_index", "turns", "tool_calls", "tool_errors", "turn_limit"):
        assert torch.equal(getattr(ep_a, name), getattr(ep_b, name)), name


def tool_case(tok, model, case):
    examples = CalculatorTask().train_batch(1, 3, 0)
    params = sampling_params(tok, stop=stop_token_ids(tok, model), group_size=4, max_new_tokens=80)
    spec = {"calculator": EpisodeSpec(CalculatorEnv, max_turns=3),
            # cut mid tool call: what the rows sampled after the string stays in the cache, masked out
            "stop-string": EpisodeSpec(Again, max_turns=3, stop_strings=('"arguments"',)),
            "budget": EpisodeSpec(Again, max_turns=3, max_tokens=150)}[case]
    return examples, spec, params


@pytest.mark.slow  # 3 s
@pytest.mark.parametrize("decode", ["fast", "hf"])
@pytest.mark.parametrize("case", ["calculator", "stop-string", "budget", "moe"])
def test_a_kept_cache_samples_the_episodes_a_full_prefill_does(tool_model, moe_model, monkeypatch, case, decode):
    # same seed, same weights: the kept cache (later turns feed only their new tokens) and the
    # full prefill of every turn's conversation give the same tokens, masks and episodes, and
    # log-probs to float rounding; with holes in the cache (finished rows' pads, turns cut by a
    # stop string or the token budget), on both decoders, and on an MoE model with its routing
    if decode == "hf":
        monkeypatch.setattr(fd, "path", lambda model, max_len, **kw: ("hf", "test"))
    routing = None
    if case == "moe":
        model, tok = moe_model
        examples = [Example([{"role": "user", "content": f"{a}+{b}="}], str(a + b), {}, "")
                    for a, b in [(12, 7), (40, 2), (5, 5)]]
        spec, params = EpisodeSpec(Sums, max_turns=3), sampling_params(tok, stop=stop_token_ids(tok, model),
                                                                       group_size=3, max_new_tokens=8)
        routing = Routing(model)
    else:
        model, tok = tool_model
        examples, spec, params = tool_case(tok, model, case)
    calls, cut = recording(monkeypatch), []
    stop_strings = episodes_module.cut_at_stop_strings

    def cutting(ro, tokenizer, strings):  # how many sampled tokens a stop string cut, per turn
        before = ro.lengths.clone()
        out = stop_strings(ro, tokenizer, strings)
        cut.append(int((before - out.lengths).max()))
        return out

    monkeypatch.setattr(episodes_module, "cut_at_stop_strings", cutting)
    full = episodes(model, tok, examples, spec, params, False, routing)
    n_full = len(per_sample(calls))
    kept = episodes(model, tok, examples, spec, params, True, routing)
    if routing is not None:
        routing.remove()
    assert_same_episodes(full, kept)
    turns = per_sample(calls)[n_full:]
    assert len(turns) == n_full >= 2 and int(kept[1].turns.max()) >= 2
    assert turns[0][0][0] == "prefill"  # turn 0 prefills its prompts, later turns feed a chunk
    assert all(turn[0][0] == "chunk" and "prefill" not in {k for k, _ in turn} for turn in turns[1:])
    if case == "stop-string":  # turns went on after tokens a stop string cut: fed, then masked out
        assert max(cut[n_full:-1]) >= 2


@pytest.mark.slow  # 2 s
def test_later_turns_feed_only_the_last_sampled_token_and_the_observation(tool_model, monkeypatch):
    # Again's observation after a turn that ended with <|im_end|> is 25 tokens:
    #   \n <|im_start|> u s e r \n a g a i n <|im_end|> \n <|im_start|> a s s i s t a n t \n
    #   1 + 1 + 4 + 1 + 5 + 1 + 1 + 1 + 9 + 1 = 25
    # so a later turn feeds 1 + 25 = 26 tokens per episode still running (the turn's last sampled
    # token, <|im_end|>, was never fed), whatever the conversation's length so far
    model, tok = tool_model
    examples = CalculatorTask().train_batch(2, 3, 0)
    params = sampling_params(tok, stop=stop_token_ids(tok, model), group_size=4, max_new_tokens=80)
    spec = EpisodeSpec(Again, max_turns=3)
    calls = recording(monkeypatch)
    full = episodes(model, tok, examples, spec, params, False)
    n = len(per_sample(calls))
    ro, ep = kept = episodes(model, tok, examples, spec, params, True)
    assert_same_episodes(full, kept)
    re_prefilled, turns = per_sample(calls)[:n], per_sample(calls)[n:]
    assert len(turns) == 3
    for k in (1, 2):
        running = int((ep.turns > k).sum())  # episodes that sampled turn k
        assert running > 0
        chunks = [fed for kind, fed in turns[k] if kind == "chunk"]
        assert chunks == [26 * running]
        # the full prefill fed every running episode's whole conversation instead
        full_prefill = [fed for kind, fed in re_prefilled[k] if kind == "prefill"]
        assert full_prefill[0] >= 26 * running + running * int(ro.prompt_mask.sum(1).min())


def test_recorded_logprobs_equal_a_recomputation_with_a_kept_cache(tool_model):
    # the later turns' log-probs (decoded after a chunk fed onto a cache with holes) equal one
    # forward pass over each whole episode, on its model tokens (the rollout tests' 1e-5)
    model, tok = tool_model
    examples, spec, params = tool_case(tok, model, "stop-string")
    ro, ep = episodes(model, tok, examples, spec, params, True)
    assert int(ep.turns.max()) >= 2
    with torch.no_grad():
        logp, _ = token_logprobs(model, ro, temperature=1.0)
    on = ro.completion_mask > 0
    later = on & (ep.turn_index > 0)
    assert later.sum() > 0
    torch.testing.assert_close(logp[on], ro.logp[on], rtol=1e-5, atol=1e-5)


def test_end_rollout_drops_the_cache_and_rows_not_kept_are_prefilled(tool_model, monkeypatch):
    model, tok = tool_model
    prompts = [tok("<|im_start|>user\n12*34=<|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False)["input_ids"],
               tok("<|im_start|>user\n5*6=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]]
    params = sampling_params(tok, stop=stop_token_ids(tok, model), group_size=2, max_new_tokens=12)
    later = sampling_params(tok, stop=stop_token_ids(tok, model), group_size=1, max_new_tokens=12)
    obs = tok("<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n",
              add_special_tokens=False)["input_ids"]

    def two_turns(sampler, between=lambda s: None, rows=(1, 3)):
        first = sampler.sample(prompts, params, generator=torch.Generator().manual_seed(0), rows=(0, 4))
        between(sampler)
        turn = [prompts[b // 2] + first.completion_ids[b, :int(first.lengths[b])].tolist() + obs for b in rows]
        return sampler.sample(turn, later, generator=torch.Generator().manual_seed(1), rows=(torch.tensor(rows), 4))

    def moved(sampler):
        with torch.no_grad():
            next(sampler.model.parameters()).mul_(1.0)

    calls = recording(monkeypatch)
    reference = two_turns(PolicySampler(model, keep_cache=False))
    sampler = PolicySampler(model)
    for between, rows, resumed in [(lambda s: None, (1, 3), True),
                                   (lambda s: s.end_rollout(), (1, 3), False),  # dropped: a full prefill
                                   (lambda s: s.sync(model), (1, 3), False),
                                   (moved, (1, 3), False)]:  # an in-place update of the weights
        del calls[:]
        ro = two_turns(sampler, between, rows)
        kinds = [kind for kind, _ in per_sample(calls)[1]]
        assert (kinds[0] == "chunk") is resumed and ("prefill" in kinds) is not resumed
        for name in ("completion_ids", "lengths", "prompt_ids"):
            assert torch.equal(getattr(ro, name), getattr(reference, name))
        torch.testing.assert_close(ro.logp, reference.logp, rtol=1e-5, atol=1e-5)
        assert sampler.turns.kept is not None
        sampler.end_rollout()
        assert sampler.turns.kept is None
    # rows the kept cache does not hold (row 5: the batch had rows 0-3), or a prompt that does
    # not extend its row's first prompt (row 1's is prompt 0): a full prefill, the right answer
    fresh = PolicySampler(model, keep_cache=False)
    for rows, turn in [((5,), [prompts[0] + obs]), ((1,), [prompts[1] + obs])]:
        del calls[:]
        sampler.sample(prompts, params, generator=torch.Generator().manual_seed(0), rows=(0, 4))
        args = (turn, later)
        kw = dict(rows=(torch.tensor(rows), 6))
        ro = sampler.sample(*args, generator=torch.Generator().manual_seed(1), **kw)
        assert [kind for kind, _ in per_sample(calls)[1]][0] == "prefill"
        expected = fresh.sample(*args, generator=torch.Generator().manual_seed(1), **kw)
        assert torch.equal(ro.completion_ids, expected.completion_ids)


def test_a_chunk_before_any_decode_step_is_checked_against_hugging_face(tool_model, monkeypatch):
    # turn 0 stops after one token (no decode step: the compact step is not checked yet); the
    # next turn's chunk is then computed both ways, the rollout's check, and the result is exact
    model, tok = tool_model
    made = []
    make = fd.decoder
    monkeypatch.setattr(rollout_module, "decoder", lambda m, n, **kw: made.append(make(m, n, **kw)) or made[-1])
    prompt = tok("<|im_start|>user\n12*34=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    one = sampling_params(tok, group_size=2, max_new_tokens=1)
    later = sampling_params(tok, group_size=1, max_new_tokens=6)
    out = []
    for keep in (False, True):
        sampler = PolicySampler(model, keep_cache=keep)
        first = sampler.sample([prompt], one, generator=torch.Generator().manual_seed(0), rows=(0, 2))
        turn = [prompt + first.completion_ids[b].tolist() + tok("5+5=" * 15, add_special_tokens=False)["input_ids"]
                for b in range(2)]  # a chunk wider than the cache's columns so far: it grows enough at once
        out.append(sampler.sample(turn, later, generator=torch.Generator().manual_seed(1), rows=(torch.arange(2), 2)))
    assert isinstance(made[-1], fd.FastDecoder) and made[-1].checked and not made[-1].fallback
    assert len(made) == 3  # the kept cache's second turn made no decoder of its own
    assert torch.equal(out[0].completion_ids, out[1].completion_ids)
    torch.testing.assert_close(out[0].logp, out[1].logp, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # trains
def test_an_environment_that_raises_mid_rollout_leaves_no_kept_cache(monkeypatch):
    from gspo.config import TrainConfig
    from gspo.sampling.produce import rollout
    from gspo.tasks.env import EnvError
    from gspo.train.resolve import resolve
    from gspo.train.run import build_run

    run = build_run(resolve(TrainConfig(task="calculator", prompts_per_step=2, group_size=2, output_dir="-",
                                        progress=False)))
    def turn_then_raise(sampler, tokenizer, examples, spec, params, draws):
        sampler.sample([[1, 2, 3]], params, generator=torch.Generator().manual_seed(0), rows=(0, params.group_size))
        assert sampler.turns.kept is not None  # turn 0 kept its cache for turn 1
        raise EnvError("env CalculatorEnv: step on row 0 raised RuntimeError: boom")

    run.play = turn_then_raise  # who plays the run's episodes (gspo.sampling.episodes.run_episodes)
    with pytest.raises(EnvError, match="boom"):
        rollout(run, run.task.train_batch(1, 2, seed=0), 1)
    assert run.sampler.turns.kept is None  # dropped by end_rollout on the way out
