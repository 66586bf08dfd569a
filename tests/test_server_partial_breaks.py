"""Attacks on partial rollouts and the sampling thread (gspo.sampling.vllm_server's Gate, ServerSampler.sync
and .sample with partial=True, gspo.sampling.pipeline.ServerPipeline), against the fake vLLM server
(tests/fakevllm.py), and a real one where marked. Each defect these tests found failed before its fix
(they were written as xfail(strict=True) by a breaker who did not write the code).

As in tests/test_server_partial.py: the sampler's first sync is version 0 (the fake's reload 1), the
next version 1 (reload 2) ...: a token of version v was sampled by generation v + 1 (`generation_of`).
"""

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch

import gspo
from gspo.sampling.rollout import SamplingParams
from gspo.sampling.vllm_server import Deadlines, Server, ServerError
from tests.fakevllm import FakeVLLM
from tests.test_server_client import Policy, no_weight_conversions, sampler_for  # noqa: F401
from tests.test_server_partial import (
    checked,
    generating,
    sample_in_thread,
    tokens_and_versions,
)

PROMPTS = [[1, 2, 3], [4, 5]]
PARAMS = SamplingParams(group_size=2, max_new_tokens=30, stop_token_ids=(), pad_token_id=0)
TINY = Path(gspo.__file__).parent / "assets" / "tiny"


@pytest.fixture
def fake():
    with FakeVLLM(token_seconds=0.02) as f:
        yield f


# --- a request on its way when the servers pause ---------------------------------------------------


@pytest.mark.parametrize("partial", [True, False], ids=["abort", "wait"])
def test_a_request_still_on_its_way_when_the_sync_pauses_does_not_deadlock_the_sync(fake, tmp_path, partial):
    """vLLM queues a request that arrives while it is paused (any pause mode: 'All pause modes queue new adds',
    vllm/v1/engine/core.py pause_scheduler) until /resume, as the fake does. The sampler enters the gate, then
    sends its request; the request takes a moment to reach the engine (the network, the API server's
    tokenisation and queueing: here the fake's 0.3 s delay before it looks at the request). A sync in that
    window pauses the server (nothing under way: /pause returns at once), then waits in gate.drain for the
    sample, whose request waits for the /resume that comes only after the drain."""
    fake.delay = {"/v1/completions": 0.3}
    fake.token_seconds = 0.002
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=partial, vocab_size=fake.vocab,
                          deadlines=Deadlines(request=1.5, sync=10.0, start=2.0))
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3]])
        end = time.monotonic() + 5
        while not fake.asked("/v1/completions") and time.monotonic() < end:
            time.sleep(0.002)  # the request has left the sampler (it is in the fake's delay)
        t0 = time.monotonic()
        error = None
        try:
            sampler.sync(policy, version=1)
        except ServerError as e:
            error = e
        took = time.monotonic() - t0
        thread.join(10)
    finally:
        sampler.close()
    # before the fix: the sync and the sample waited for each other until a deadline (--vllm-server-timeout, 300 s by
    # default) cuts one of them: the sample's request (ServerError: no answer ... within 1.5 s) or the sync
    assert error is None and "error" not in out, (took, error, out.get("error"))
    assert took < 1.0, (took, [(r.path, round(r.time - t0, 2)) for r in fake.requests if r.time > t0 - 0.2][:12])
    checked(tokens_and_versions(out["ro"]))



@pytest.mark.parametrize("partial", [True, False], ids=["abort", "wait"])
def test_a_sync_during_a_round_of_more_than_64_prompts_does_not_deadlock(fake, tmp_path, partial):
    """No network delay needed: ServerSampler maps a round's prompts over a pool of 64 threads, so with
    --prompts-per-step > 64 (per server pool, whatever the number of servers) the later prompts' requests
    leave only as earlier ones end, which a sync's /pause makes them do (abort) or waits for (wait)."""
    fake.token_seconds = 0.01
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=partial, vocab_size=fake.vocab,
                          deadlines=Deadlines(request=1.5, sync=10.0, start=2.0))
    params = SamplingParams(group_size=1, max_new_tokens=10, stop_token_ids=(), pad_token_id=0)
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        thread, out = sample_in_thread(sampler, prompts=[[1 + i % 5, 2] for i in range(80)], params=params)
        generating(fake, tokens=2)
        t0 = time.monotonic()
        error = None
        try:
            sampler.sync(policy, version=1)
        except ServerError as e:
            error = e
        took = time.monotonic() - t0
        thread.join(10)
    finally:
        sampler.close()
    assert error is None and "error" not in out, (took, error, out.get("error"))
    assert took < 1.0, took
    checked(tokens_and_versions(out["ro"]))



def test_two_syncs_during_one_generation_label_its_tokens_0_1_2(fake, tmp_path):
    """A generation aborted twice (versions 0, 1 and 2 in one row): every token keeps its own version."""
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3]])
        generating(fake)
        sampler.sync(policy, version=1)
        time.sleep(0.05)
        generating(fake)  # the continuation under way
        sampler.sync(policy, version=2)
        thread.join(30)
    finally:
        sampler.close()
    rows = tokens_and_versions(out["ro"])
    checked(rows)
    assert any({v for *_, v in r} == {0, 1, 2} for r in rows), [[v for *_, v in r] for r in rows]
    assert all(len(r) == 30 for r in rows)


class Scripted(FakeVLLM):
    """A fake whose first (non-check) completion answer is `script`: (token ids, finish_reason) per choice, as
    if a sync of `sampler` (to version 1) aborted them."""

    script = None
    sampler = None

    def _complete(self, body):
        if self.script is not None and not body.get("ignore_eos"):
            script, self.script = self.script, None
            self.sampler.gate.close()  # a sync began (and ended) while the request was under way
            self.sampler.gate.open(1)
            return {"choices": [{"index": i, "text": "", "finish_reason": why, "token_ids": ids,
                                 "logprobs": {"token_logprobs": [-0.1 * (t % 7 + 1) for t in ids]}}
                                for i, (ids, why) in enumerate(script)]}
        return super()._complete(body)


def test_aborts_at_the_edges_continue_exactly_what_is_left(tmp_path):
    """Aborted with no token, with the whole budget, just after a stop token; next to a completion that ended."""
    with Scripted() as fake:
        sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
        fake.sampler = sampler
        try:
            sampler.sync(Policy(), version=0)
            params = SamplingParams(group_size=4, max_new_tokens=4, stop_token_ids=(7,), pad_token_id=0)
            fake.script = [([], "abort"), ([3, 4, 5, 6], "abort"), ([3, 7], "abort"), ([9, 9, 9, 9], "length")]
            start = len(fake.asked("/v1/completions"))
            ro = sampler.sample([[1, 2]], params, generator=torch.Generator().manual_seed(0))
        finally:
            sampler.close()
    more = [r.body for r in fake.asked("/v1/completions")[start + 1:]]
    # only the completion aborted with no token is continued: the whole prompt, the whole budget, n = 1
    assert [(b["prompt"], b["n"], b["max_tokens"]) for b in more] == [([1, 2], 1, 4)], more
    assert ro.lengths.tolist() == [4, 4, 2, 4]
    assert ro.truncated.tolist() == [True, True, False, True]  # the whole budget is the length limit; 7 ended one
    assert ro.versions[0].tolist() == [1, 1, 1, 1] and ro.versions[1].tolist() == [0, 0, 0, 0]
    assert ro.versions[2].tolist() == [0, 0, -1, -1] and ro.versions[3].tolist() == [0, 0, 0, 0]


def test_a_sample_across_a_failed_sync_raises_or_keeps_its_tokens_versions(tmp_path):
    with FakeVLLM(token_seconds=0.02) as a, FakeVLLM(token_seconds=0.02) as b:
        sampler = sampler_for([Server(a.url), Server(b.url)], tmp_path, partial=True, vocab_size=a.vocab)
        policy = Policy()
        try:
            sampler.sync(policy, version=0)
            thread, out = sample_in_thread(sampler)
            generating(a)
            sampler.sync(policy, version=1)  # a good sync: the rows span versions 0 and 1
            time.sleep(0.05)
            generating(a)
            b.status = {"/pause": 500}  # the next one fails midway: server a paused (aborted), b refused
            with pytest.raises(ServerError, match="/pause answered 500"):
                sampler.sync(policy, version=2)
            b.status = {}
            thread.join(30)
        finally:
            sampler.close()
    if "error" in out:
        return  # a clear error: fine
    ro = out["ro"]
    assert ro.versions is not None, "the rollout lost every token's version"
    checked(tokens_and_versions(ro))


# --- the sampling thread (ServerPipeline) -------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A run built against a fake serving the tiny model (its tokenizer, task and rewards: what produce needs);
    the sync check is off (the fake's log-probs are not the model's). ~10 s of imports and loading: the tests
    that use it are slow-marked."""
    from gspo.config import TrainConfig
    from gspo.train.run import build_run

    with FakeVLLM(model=str(TINY), vocab=20) as f:
        cfg = TrainConfig(model=str(TINY), rollout_engine="vllm-server", vllm_server_url=(f.url,), max_staleness=1,
                          partial_rollouts=True, vllm_check_weight_sync=False, prompts_per_step=2, group_size=2,
                          max_new_tokens=8, eval_size=0, output_dir=str(tmp_path_factory.mktemp("r") / "run"),
                          steps=4, progress=False)
        run = build_run(cfg)
        run.sampler.close()
    return run


def side_on(run, sampler, **cfg):
    """The built run's sampling side with `sampler` (and these async_rl options) in place of its own."""
    from gspo.sampling.produce import SamplingSide

    c = dataclasses.replace(run.cfg, async_rl=dataclasses.replace(run.cfg.async_rl, **cfg)) if cfg else run.cfg
    fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(SamplingSide)}
    return SamplingSide(**{**fields, "sampler": sampler, "cfg": c})


def tiny_fake(**kw):
    return FakeVLLM(model=str(TINY), vocab=20, **kw)


@pytest.mark.slow
def test_closing_the_pipeline_ends_the_sampling_under_way(built, tmp_path):
    from gspo.sampling.pipeline import ServerPipeline

    with tiny_fake() as fake:
        sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=20,
                              deadlines=Deadlines(request=4.0, sync=10.0, start=2.0))
        pipeline = ServerPipeline(side_on(built, sampler))
        try:
            fake.delay = {"/v1/completions": 3.0}  # a long generation (a big batch on a busy server)
            pipeline.sync_seconds = 0.0  # (take() sets it)
            pipeline.request(1, 0)  # sync, then batch 1 in the sampling thread
            end = time.monotonic() + 5
            while not fake.asked("/v1/completions") and time.monotonic() < end:
                time.sleep(0.01)
            t0 = time.monotonic()
            pipeline.close()  # the trainer failed (or a second Ctrl-C): what the trainer's `finally` does
            sampler.close()
            threads = [t for t in threading.enumerate() if t.name.startswith(("gspo-sampling", "gspo-vllm-server"))]
            for t in threads:
                t.join(5)
            took = time.monotonic() - t0
        finally:
            fake.delay = {}
    # the interpreter joins these threads at exit (concurrent.futures' atexit hook): they must end promptly
    assert took < 1.0, f"the sampling threads outlived close() by {took:.1f} s"
