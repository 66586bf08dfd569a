"""Inputs gspo.sampling.vllm_server's client was not built for: a server's answer that would silently
corrupt a training batch. Each xfail(strict) test fails today and passes once the client refuses
the answer (a ServerError) instead of building a Rollout from it."""

import pytest
import torch

from gspo.sampling.rollout import SamplingParams
from gspo.sampling.vllm_server import Server, ServerError
from tests.fakevllm import FakeVLLM
from tests.test_server_client import Policy, no_weight_conversions, sampler_for  # noqa: F401

PROMPTS = [[1, 2, 3], [4, 5]]
PARAMS = SamplingParams(group_size=2, max_new_tokens=5, stop_token_ids=(0,), pad_token_id=0)


@pytest.fixture
def fake():
    with FakeVLLM() as f:
        yield f


def tamper(fake, edit):
    """The fake's completion answers, changed by edit(choices) -> choices."""
    original = fake._complete

    def _complete(body):
        answer = original(body)
        if body.get("ignore_eos"):  # the sync check's request: left alone
            return answer
        answer["choices"] = edit(answer["choices"])
        return answer

    fake._complete = _complete


def sample(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, vocab_size=fake.vocab)  # the model's vocabulary, known
    try:
        sampler.sync(Policy(), version=0)
        return sampler.sample(PROMPTS, PARAMS, generator=torch.Generator().manual_seed(0))
    finally:
        sampler.close()


def set_logp(value):
    def edit(choices):
        choices[0]["logprobs"]["token_logprobs"][0] = value
        return choices
    return edit


def test_a_nan_logprob_is_refused(fake, tmp_path):
    tamper(fake, set_logp(float("nan")))
    with pytest.raises(ServerError):
        sample(fake, tmp_path)


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_an_infinite_logprob_is_refused(fake, tmp_path, value):
    tamper(fake, set_logp(value))
    with pytest.raises(ServerError):
        sample(fake, tmp_path)


def test_a_positive_logprob_is_refused(fake, tmp_path):
    tamper(fake, set_logp(3.0))
    with pytest.raises(ServerError):
        sample(fake, tmp_path)


def set_token(value):
    def edit(choices):
        choices[0]["token_ids"][0] = value
        return choices
    return edit


def test_a_negative_token_id_is_refused(fake, tmp_path):
    tamper(fake, set_token(-1))
    with pytest.raises(ServerError):
        sample(fake, tmp_path)


def test_a_token_id_past_the_vocabulary_is_refused(fake, tmp_path):
    tamper(fake, set_token(10**9))
    with pytest.raises(ServerError):
        sample(fake, tmp_path)


def test_more_tokens_than_max_tokens_is_refused(fake, tmp_path):
    def edit(choices):
        choices[0]["token_ids"] += [7, 7, 7]
        choices[0]["logprobs"]["token_logprobs"] += [-0.1, -0.1, -0.1]
        return choices
    tamper(fake, edit)
    with pytest.raises(ServerError):
        sample(fake, tmp_path)


def test_duplicate_choice_indices_are_refused(fake, tmp_path):
    def edit(choices):
        choices[1] = dict(choices[0])
        return choices
    tamper(fake, edit)
    with pytest.raises(ServerError):
        sample(fake, tmp_path)


def test_choices_without_an_index_are_refused(fake, tmp_path):
    def edit(choices):
        for c in choices:
            del c["index"]
        return choices
    tamper(fake, edit)
    with pytest.raises(ServerError):
        sample(fake, tmp_path)


def test_an_aborted_completion_is_refused(fake, tmp_path):
    def edit(choices):
        c = choices[0]
        c["token_ids"], c["logprobs"]["token_logprobs"] = c["token_ids"][:2], c["logprobs"]["token_logprobs"][:2]
        c["finish_reason"] = "abort"
        return choices
    tamper(fake, edit)
    with pytest.raises(ServerError):
        sample(fake, tmp_path)


def test_a_stop_without_a_stop_token_is_refused(fake, tmp_path):
    def edit(choices):
        c = choices[0]
        keep = [t for t in c["token_ids"] if t != 0][:2]
        assert len(keep) == 2
        c["token_ids"], c["logprobs"]["token_logprobs"] = keep, [-0.5, -0.5]
        c["finish_reason"] = "stop"
        return choices
    tamper(fake, edit)
    with pytest.raises(ServerError):
        sample(fake, tmp_path)


def test_two_trainers_interleaving_pushes_is_caught(fake, tmp_path):
    a = sampler_for([Server(fake.url)], tmp_path / "A")
    b = sampler_for([Server(fake.url)], tmp_path / "B")
    b.run_id = "other"
    original = fake._answer

    def answer(method, route, body):
        out = original(method, route, body)
        if route == "/collective_rpc" and "/A/" in body["kwargs"]["weights_path"] + "/" and not b.tag:
            b.sync(Policy(), version=0)  # the other trainer's whole sync, between A's reload and A's tag
        return out

    fake._answer = answer
    try:
        with pytest.raises(ServerError):
            a.sync(Policy(), version=0)
            assert fake.reloads[-1].endswith("other-1")  # the server holds B's weights
            a.sample(PROMPTS, PARAMS, generator=torch.Generator().manual_seed(0))
    finally:
        a.close()
        b.close()
