"""More attacks on partial rollouts (gspo.sampling.vllm_server's Gate, ServerSampler.sync / .sample / .close
with partial=True), against the fake vLLM server (tests/fakevllm.py). Written by a breaker who did not write
the code: each defect it found was an xfail(strict=True) test, which failed before its fix.

As in tests/test_server_partial.py: the sampler's first sync is version 0 (the fake's reload 1), the next
version 1 (reload 2) ...: a token of version v was sampled by generation v + 1 (`generation_of`).
"""

import http.client
import json
import threading
import time

import pytest
import torch

from gspo.sampling.rollout import SamplingParams
from gspo.sampling.vllm_server import Deadlines, Server, ServerError
from tests.fakevllm import FakeVLLM, Request, generation_of, token_logp
from tests.test_server_client import Policy, no_weight_conversions, sampler_for  # noqa: F401
from tests.test_server_partial import (
    checked,
    generating,
    sample_in_thread,
    sampling,
    tokens_and_versions,
)

PARAMS = SamplingParams(group_size=2, max_new_tokens=30, stop_token_ids=(), pad_token_id=0)


@pytest.fixture
def fake():
    with FakeVLLM(token_seconds=0.02) as f:
        yield f


# --- two servers: prompt i on server i mod 2 ---------------------------------------------------------


def test_two_servers_one_mid_generation_one_idle_then_a_sync_during_the_continuation(tmp_path):
    """Server a generates slowly; server b answered (length) before the first sync. The first sync aborts a's
    generations; the second lands while their continuations (not the first round) are under way on a."""
    with FakeVLLM(token_seconds=0.02) as a, FakeVLLM(token_seconds=0.0) as b:
        sampler = sampler_for([Server(a.url), Server(b.url)], tmp_path, partial=True, vocab_size=a.vocab)
        policy = Policy()
        try:
            sampler.sync(policy, version=0)
            thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3], [4, 5]])
            generating(a)
            assert len(sampling(b)) == 1 and not b._running  # b's prompt is answered already
            sampler.sync(policy, version=1)
            end = time.monotonic() + 5
            while len(sampling(a)) < 2 and time.monotonic() < end:
                time.sleep(0.002)
            generating(a, tokens=2)  # a continuation under way
            sampler.sync(policy, version=2)
            thread.join(10)
        finally:
            sampler.close()
    assert "error" not in out, out.get("error")
    rows = tokens_and_versions(out["ro"])
    checked(rows)
    assert all(len(r) == 30 for r in rows)
    assert [{v for *_, v in r} for r in rows[2:]] == [{0}, {0}]  # b's prompt: wholly version 0, never continued
    assert any({v for *_, v in r} == {0, 1, 2} for r in rows[:2]), [[v for *_, v in r] for r in rows]
    assert all(b["prompt"][:3] == [1, 2, 3] for b in sampling(a))  # continuations stay on prompt 0's server
    assert len(sampling(b)) == 1


def test_two_servers_a_request_held_by_the_paused_slow_server_is_asked_again_there(tmp_path):
    """Server b is slow to look at requests (0.3 s before it starts one): the sync pauses it while b's request
    is still on its way, b holds it; a is mid-generation. b's request is cut after the grace and asked again,
    on b, under the new version."""
    with FakeVLLM(token_seconds=0.02) as a, FakeVLLM(token_seconds=0.01) as b:
        sampler = sampler_for([Server(a.url), Server(b.url)], tmp_path, partial=True, vocab_size=a.vocab)
        policy = Policy()
        try:
            sampler.sync(policy, version=0)
            b.delay = {"/v1/completions": 0.4}
            thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3], [4, 5]],
                                           params=SamplingParams(group_size=2, max_new_tokens=20,
                                                                 stop_token_ids=(), pad_token_id=0))
            generating(a)
            t0 = time.monotonic()
            sampler.sync(policy, version=1)
            took = time.monotonic() - t0
            b.delay = {}
            thread.join(10)
        finally:
            sampler.close()
    assert "error" not in out, out.get("error")
    rows = tokens_and_versions(out["ro"])
    checked(rows)
    assert [{v for *_, v in r} for r in rows[2:]] == [{1}, {1}]  # b's: wholly sampled again after the sync
    assert took < 1.0, took
    # the cut request (n=2), then each of its completions asked again from nothing (n=1), on b
    assert [(x["prompt"], x["n"]) for x in sampling(b)] == [([4, 5], 2), ([4, 5], 1), ([4, 5], 1)]


def test_a_sync_whose_pause_times_out_on_one_server_fails_and_the_next_sync_recovers(tmp_path):
    """b's /pause answers after the sync's deadline: the sync fails (a's generations were aborted: the sample
    raises, nothing mislabelled); the next sync works, and so does a sample after it."""
    with FakeVLLM(token_seconds=0.02) as a, FakeVLLM(token_seconds=0.02) as b:
        sampler = sampler_for([Server(a.url), Server(b.url)], tmp_path, partial=True, vocab_size=a.vocab,
                              deadlines=Deadlines(request=2.0, sync=0.6, start=2.0))
        policy = Policy()
        try:
            sampler.sync(policy, version=0)
            thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3], [4, 5]])
            generating(a)
            b.delay = {"/pause": 0.9}
            with pytest.raises(ServerError, match=r"the weight sync did not finish within 0.6 s \(--vllm-server-sync"):
                sampler.sync(policy, version=1)  # b's /pause, cut by the sync's deadline
            thread.join(10)
            time.sleep(0.5)  # b's late /pause has run by now (after the failed sync's /resume)
            b.delay = {}
            sampler.sync(policy, version=2)
            ro = sampler.sample([[6]], SamplingParams(group_size=1, max_new_tokens=3, stop_token_ids=(),
                                                      pad_token_id=0), generator=torch.Generator().manual_seed(0))
        finally:
            sampler.close()
    if "ro" in out:
        checked(tokens_and_versions(out["ro"]))
    else:
        assert isinstance(out["error"], ServerError), out
    assert ro.versions.tolist() == [[2, 2, 2]]


def test_a_pause_past_the_sync_deadline_names_the_sync_deadline(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab,
                          deadlines=Deadlines(request=2.0, sync=0.5, start=2.0))
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        fake.delay = {"/pause": 0.8}
        with pytest.raises(ServerError) as e:
            sampler.sync(policy, version=1)
    finally:
        fake.delay = {}
        sampler.close()
    assert "the weight sync did not finish within 0.5 s (--vllm-server-sync-timeout)" in str(e.value), str(e.value)


# --- unknown and repeated versions ---------------------------------------------------------------------


def test_a_generation_begun_at_an_unknown_version_and_continued_at_a_known_one(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    try:
        sampler.sync(policy)  # version unknown (None): rollout(..., version=None)
        thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3]])
        generating(fake)
        sampler.sync(policy, version=1)
        thread.join(10)
    finally:
        sampler.close()
    assert "error" not in out, repr(out.get("error"))
    ro = out["ro"]
    if ro.versions is not None:  # a token labelled with a known version was sampled by it
        for r in tokens_and_versions(ro):
            assert all(v < 0 or generation_of(t, lp) == v + 1 for t, lp, v in r), r


def test_a_generation_begun_at_a_known_version_and_continued_at_an_unknown_one(fake, tmp_path):
    """The reverse: version 0, then a sync without a version. The rollout must not claim the new tokens are
    version 0 (versions None, or the unknown part not labelled as a known version)."""
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3]])
        generating(fake)
        sampler.sync(policy)
        thread.join(10)
    finally:
        sampler.close()
    assert "error" not in out, repr(out.get("error"))
    ro = out["ro"]
    if ro.versions is not None:
        for r in tokens_and_versions(ro):
            assert all(v != 0 or generation_of(t, lp) == 1 for t, lp, v in r)


def test_the_same_version_synced_again_during_a_sample_does_not_disturb_it(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3]])
        generating(fake)
        start = len(fake.requests)
        sampler.sync(policy, version=0)  # held: no push, no pause
        sampler.sync(policy, version=0)
        thread.join(10)
    finally:
        sampler.close()
    assert "error" not in out, out.get("error")
    assert not any(r.route == "/pause" for r in fake.requests[start:])
    rows = tokens_and_versions(out["ro"])
    checked(rows)
    assert {v for r in rows for *_, v in r} == {0} and len(sampling(fake)) == 1


def test_a_server_restarted_mid_sample_and_resynced_at_the_same_version_is_caught(fake, tmp_path):
    """A restart (the fake's tag back to "default") while a round is under way, and a sync of the same version
    (the push skipped elsewhere, done on the restarted server): the round's tokens are not taken as version 0."""
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3]])
        generating(fake)
        fake.weight_version = "default"
        sampler.sync(policy, version=0)
        thread.join(10)
    finally:
        sampler.close()
    assert isinstance(out.get("error"), ServerError) and "weights changed during the rollout" in str(out["error"])


# --- continuations: budgets, min_new_tokens, stop tokens ------------------------------------------------


class Scripted(FakeVLLM):
    """A fake whose first sample answer is `script` (token ids, finish_reason per choice), as if a sync of
    `sampler` to version 1 aborted it; its answers to continuations are `more` (one per request, in order)
    where given."""

    script = None
    more = None
    sampler = None

    def _complete(self, body):
        if body.get("ignore_eos"):
            return super()._complete(body)
        if self.script is not None:
            script, self.script = self.script, None
            self.sampler.gate.close()
            self.sampler.gate.open(1)
            return self._choices(script)
        if self.more:
            return self._choices([self.more.pop(0)])
        return super()._complete(body)

    @staticmethod
    def _choices(script):
        return {"choices": [{"index": i, "text": "", "finish_reason": why, "token_ids": ids,
                             "logprobs": {"token_logprobs": [token_logp(t) for t in ids]}}
                            for i, (ids, why) in enumerate(script)]}


def scripted_sample(tmp_path, script, params, more=None):
    with Scripted() as fake:
        sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
        fake.sampler = sampler
        try:
            sampler.sync(Policy(), version=0)
            fake.script, fake.more = script, more
            try:
                ro = sampler.sample([[1, 2]], params, generator=torch.Generator().manual_seed(0))
            except ServerError as e:
                ro = e
        finally:
            sampler.close()
        return ro, sampling(fake)[1:]


def test_min_new_tokens_is_what_is_left_of_it_across_an_abort(tmp_path):
    params = SamplingParams(group_size=2, max_new_tokens=8, min_new_tokens=5, stop_token_ids=(7,), pad_token_id=0)
    # aborted after 2 tokens; aborted at a stop token before min_new_tokens (not an end: continued)
    ro, more = scripted_sample(tmp_path, [([3, 4], "abort"), ([3, 7], "abort")], params)
    assert not isinstance(ro, Exception), ro
    assert sorted((b["prompt"], b["max_tokens"], b["min_tokens"], b["n"]) for b in more) == \
        [([1, 2, 3, 4], 6, 3, 1), ([1, 2, 3, 7], 6, 3, 1)], more


def test_min_new_tokens_already_met_at_an_abort_on_a_stop_token_ends_it(tmp_path):
    params = SamplingParams(group_size=1, max_new_tokens=8, min_new_tokens=2, stop_token_ids=(7,), pad_token_id=0)
    ro, more = scripted_sample(tmp_path, [([3, 7], "abort")], params)
    assert more == [] and ro.lengths.tolist() == [2] and ro.truncated.tolist() == [False]


def test_a_continuation_answered_with_more_tokens_than_the_budget_left_is_refused(tmp_path):
    params = SamplingParams(group_size=1, max_new_tokens=6, stop_token_ids=(), pad_token_id=0)
    ro, more = scripted_sample(tmp_path, [([3, 4, 5, 6], "abort")], params, more=[([1, 2, 3], "length")])
    assert [b["max_tokens"] for b in more] == [2]
    assert isinstance(ro, ServerError) and "longer (3 tokens) than the 2 asked for" in str(ro), ro


def test_a_continuation_that_says_stop_without_a_stop_token_is_refused(tmp_path):
    params = SamplingParams(group_size=1, max_new_tokens=6, stop_token_ids=(7,), pad_token_id=0)
    ro, more = scripted_sample(tmp_path, [([3, 4], "abort")], params, more=[([1], "stop")])
    assert isinstance(ro, ServerError) and "does not end with a stop token" in str(ro), ro


def test_a_continuation_aborted_again_with_no_sync_is_refused(tmp_path):
    """The first part was aborted by this run's sync; the continuation comes back aborted with no sync of this
    run under way (another client paused the server): refused, not continued forever."""
    params = SamplingParams(group_size=1, max_new_tokens=6, stop_token_ids=(), pad_token_id=0)
    ro, more = scripted_sample(tmp_path, [([3, 4], "abort")], params, more=[([5], "abort")])
    assert isinstance(ro, ServerError) and "no weight sync of this run was under way" in str(ro), ro


# --- an answer in transit when the grace ends -------------------------------------------------------------


class SlowWire(FakeVLLM):
    """A fake whose sample answers (not the sync check's) go over the wire slowly: `wire` seconds from the
    first byte of the body to the last, after the whole completion was computed."""

    wire = 0.0

    def _handle(self, h, method):
        if h.path != "/v1/completions" or not self.wire:
            return super()._handle(h, method)
        h.close_connection = True
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        body = json.loads(raw)
        with self._lock:
            self.requests.append(Request(h.path, method, body, dict(h.headers), time.monotonic()))
        answer = self._complete(body)
        data = json.dumps(answer).encode()
        if body.get("ignore_eos"):
            return self._send_raw(h, 200, data, "application/json")
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            step = max(1, len(data) // 10)
            for i in range(0, len(data), step):
                h.wfile.write(data[i:i + step])
                h.wfile.flush()
                time.sleep(self.wire / 10)
        except OSError:
            pass


@pytest.mark.parametrize("wire", [0.1, 0.8], ids=["in-before-the-cut", "cut-in-transit"])
def test_an_answer_in_transit_when_the_sync_comes_is_taken_whole_or_asked_again_never_mislabelled(tmp_path, wire):
    """The answer was computed (version 0) before the sync; its bytes are still arriving when the sync pauses.
    Arrived within Gate.GRACE: taken, version 0. Not arrived: cut, asked again, version 1. Never version-0
    tokens labelled 1 or the reverse."""
    with SlowWire(token_seconds=0.0) as fake:
        sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
        policy = Policy()
        try:
            sampler.sync(policy, version=0)
            fake.wire = wire
            thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3]], params=SamplingParams(
                group_size=2, max_new_tokens=20, stop_token_ids=(), pad_token_id=0))
            end = time.monotonic() + 5
            while not sampling(fake) and time.monotonic() < end:
                time.sleep(0.002)
            time.sleep(0.02)  # computed; the bytes are on the wire
            sampler.sync(policy, version=1)
            fake.wire = 0.0
            thread.join(10)
        finally:
            sampler.close()
    assert "error" not in out, out.get("error")
    rows = tokens_and_versions(out["ro"])
    checked(rows)
    assert {v for r in rows for *_, v in r} == ({0} if wire < Gate_grace() else {1})


def Gate_grace():
    from gspo.sampling.vllm_server import Gate

    return Gate.GRACE


# --- ticket and socket races, and close() ------------------------------------------------------------------


def test_a_cut_between_the_connect_and_the_ticket_attach_is_asked_again(fake, tmp_path, monkeypatch):
    """The sync cuts while a request's connect is slow (its ticket taken, no socket yet): the request must not
    reach the paused server; it is asked again after the sync, version 1."""
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    slow = threading.Event()
    original = http.client.HTTPConnection.connect

    def slow_connect(self):
        if threading.current_thread().name.startswith("gspo-vllm-server") and not slow.is_set():
            slow.set()
            time.sleep(0.5)  # past the sync's grace: cut before its socket exists
        return original(self)

    try:
        sampler.sync(policy, version=0)
        monkeypatch.setattr(http.client.HTTPConnection, "connect", slow_connect)
        thread, out = sample_in_thread(sampler, prompts=[[3]], params=SamplingParams(
            group_size=1, max_new_tokens=5, stop_token_ids=(), pad_token_id=0))
        slow.wait(5)
        sampler.sync(policy, version=1)
        thread.join(10)
    finally:
        sampler.close()
    assert "error" not in out, out.get("error")
    rows = tokens_and_versions(out["ro"])
    checked(rows)
    assert [v for *_, v in rows[0]] == [1] * 5
    assert len(sampling(fake)) == 1  # the cut one never reached the server


def test_a_sync_that_ends_after_close_does_not_reopen_the_sampler(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    sampler.sync(policy, version=0)
    fake.delay = {"/collective_rpc": 0.4}
    errors = []
    t = threading.Thread(target=lambda: _catch(errors, sampler.sync, policy, 1))
    t.start()
    end = time.monotonic() + 5
    while not fake.asked("/collective_rpc")[1:] and time.monotonic() < end:
        time.sleep(0.002)
    sampler.close()  # the run ends while the trainer's thread syncs
    t.join(5)
    fake.delay = {}
    try:
        with pytest.raises(ServerError, match="the sampler was closed"):
            sampler.sample([[6]], SamplingParams(group_size=1, max_new_tokens=3, stop_token_ids=(), pad_token_id=0),
                           generator=torch.Generator().manual_seed(0))
    finally:
        sampler.close()


def _catch(errors, f, *args):
    try:
        f(*args)
    except BaseException as e:  # noqa: BLE001
        errors.append(e)


def test_a_request_that_takes_its_ticket_just_after_close_is_not_sent(fake, tmp_path):
    fake.token_seconds = 0.2  # 30 tokens: 6 s a completion
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab,
                          deadlines=Deadlines(request=8.0, sync=10.0, start=2.0))
    sampler.sync(Policy(), version=0)
    gate, original = sampler.gate, sampler.gate.ticket
    late = threading.Event()

    def ticket():
        if not late.is_set():
            late.set()
            time.sleep(0.3)  # the pool thread is preempted between the round's start and its ticket
        return original()

    gate.ticket = ticket
    thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3]])
    late.wait(5)
    t0 = time.monotonic()
    sampler.close()
    thread.join(2.5)
    alive = thread.is_alive()
    sampler.gate.cut()  # (let the thread go, for the next tests)
    fake.close()
    thread.join(10)
    assert not alive, "the sampling thread outlived close() by 2.5 s"
    assert out["ended"] - t0 < 1.0 and isinstance(out.get("error"), ServerError), out
    assert not sampling(fake), "a request went out after close()"


def test_close_during_a_round_larger_than_the_pool_says_the_sampler_was_closed(fake, tmp_path):
    """80 prompts: 64 requests under way, 16 queued in the pool when close() comes."""
    fake.token_seconds = 0.2
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab,
                          deadlines=Deadlines(request=8.0, sync=10.0, start=2.0))
    sampler.sync(Policy(), version=0)
    params = SamplingParams(group_size=1, max_new_tokens=10, stop_token_ids=(), pad_token_id=0)
    thread, out = sample_in_thread(sampler, prompts=[[1 + i % 5, 2] for i in range(80)], params=params)
    generating(fake, tokens=1)
    t0 = time.monotonic()
    sampler.close()
    thread.join(3)
    assert not thread.is_alive() and out["ended"] - t0 < 1.0
    assert isinstance(out.get("error"), ServerError) and "the sampler was closed" in str(out["error"]), \
        repr(out.get("error"))


def test_no_sampler_thread_outlives_close(fake, tmp_path):
    fake.token_seconds = 0.2
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab,
                          deadlines=Deadlines(request=8.0, sync=10.0, start=2.0))
    sampler.sync(Policy(), version=0)
    thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3], [4, 5]])
    generating(fake, tokens=1)
    sampler.close()
    thread.join(3)
    end = time.monotonic() + 1.0
    while time.monotonic() < end and [t for t in threading.enumerate() if t.name.startswith("gspo-vllm-server")]:
        time.sleep(0.02)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gspo-vllm-server")]


def test_a_sample_after_close_raises_and_starts_no_threads(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    sampler.sync(Policy(), version=0)
    sampler.close()
    with pytest.raises(ServerError, match="the sampler was closed"):
        sampler.sample([[6]], SamplingParams(group_size=1, max_new_tokens=3, stop_token_ids=(), pad_token_id=0),
                       generator=torch.Generator().manual_seed(0))
    assert sampler._pool is None and not sampling(fake)
