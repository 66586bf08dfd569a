"""Generations that span a weight sync (--partial-rollouts) and sampling while the trainer trains,
against the fake vLLM server (tests/fakevllm.py): the sampler's gate, per-token versions, the
continuations' requests, and the faults.

The fake generates one token per `token_seconds`; each reload of its weights is a new generation,
and a token's log-prob says which generation sampled it (`generation_of`). The sampler's first
sync is version 0 (the fake's reload 1), the next version 1 (reload 2): a token of version v was
sampled by generation v + 1, and each test checks every token's recorded version against that.
"""

import threading
import time

import pytest
import torch

from gspo.sampling.rollout import SamplingParams
from gspo.sampling.vllm_server import Deadlines, Gate, Server, ServerError
from tests.fakevllm import FakeVLLM, generation_of
from tests.test_server_client import Policy, no_weight_conversions, sampler_for  # noqa: F401

PROMPTS = [[1, 2, 3], [4, 5]]
# no stop token: every completion runs its 30 tokens (30 x 0.02 s = 0.6 s a choice), long enough to be caught
PARAMS = SamplingParams(group_size=2, max_new_tokens=30, stop_token_ids=(), pad_token_id=0)


@pytest.fixture
def fake():
    with FakeVLLM(token_seconds=0.02) as f:
        yield f


def generating(fake, tokens: int = 3, timeout: float = 10.0) -> None:
    """Wait until a completion is under way on the fake and has made a few tokens."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if fake._running and fake.asked("/v1/completions") and \
                time.monotonic() - fake.asked("/v1/completions")[-1].time > tokens * fake.token_seconds:
            return
        time.sleep(0.005)
    raise AssertionError("no completion under way on the fake")


def sample_in_thread(sampler, prompts=PROMPTS, params=PARAMS):
    out = {}

    def go():
        try:
            out["ro"] = sampler.sample(prompts, params, generator=torch.Generator().manual_seed(0))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out["error"] = e
        out["ended"] = time.monotonic()

    t = threading.Thread(target=go)
    t.start()
    return t, out


def checked(rows):
    """Every token's recorded version is the one whose weights sampled it (generation = version + 1)."""
    for r in rows:
        assert [generation_of(t, lp) for t, lp, _ in r] == [v + 1 for _, _, v in r], r


def sampling(fake):
    """The bodies of the fake's completion requests from samples (not the sync check's)."""
    return [r.body for r in fake.asked("/v1/completions") if not r.body.get("ignore_eos")]


def tokens_and_versions(ro):
    """(token, log-prob, version) of every completion token, row by row."""
    rows = []
    for b in range(ro.completion_ids.shape[0]):
        n = int(ro.lengths[b])
        rows.append(list(zip(ro.completion_ids[b, :n].tolist(), ro.logp[b, :n].tolist(), ro.versions[b, :n].tolist())))
    return rows


def test_a_partial_sync_aborts_and_every_token_keeps_the_version_that_sampled_it(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    try:
        sampler.sync(policy, version=0)  # reload 1
        thread, out = sample_in_thread(sampler)
        generating(fake)
        with torch.no_grad():
            policy.layer.weight.add_(0.5)  # the next version's weights
        t0 = time.monotonic()
        sampler.sync(policy, version=1)  # reload 2, while the generations run
        synced = time.monotonic()
        thread.join(30)
        assert "error" not in out, out.get("error")
        ro = out["ro"]
    finally:
        sampler.close()
    # the sync did not wait for the generations: 2 prompts x 2 choices x 30 tokens x 0.02 s = 1.2 s a prompt
    assert synced - t0 < 0.6 * 30 * fake.token_seconds * 2, synced - t0
    assert "/pause?mode=abort" in [r.path for r in fake.requests]
    rows = tokens_and_versions(ro)
    assert all(len(r) == 30 for r in rows)  # each completion ran its whole budget, across the sync
    versions = {v for r in rows for _, _, v in r}
    assert versions == {0, 1}, versions
    for r in rows:  # the version each token records is the one whose weights sampled it: generation = version + 1
        assert [generation_of(t, lp) for t, lp, _ in r] == [v + 1 for _, _, v in r]
        vs = [v for _, _, v in r]
        assert vs == sorted(vs)  # a generation moves forward in versions, never back
    assert sampler.continued >= 1
    assert not ro.truncated.logical_not().any()  # every row ended by the length limit (no stop token asked)


def test_a_continuation_is_the_prompt_and_the_tokens_so_far_with_what_is_left_of_the_budget(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        thread, out = sample_in_thread(sampler, prompts=[[1, 2, 3]])
        generating(fake)
        sampler.sync(policy, version=1)
        thread.join(30)
        ro = out["ro"]
    finally:
        sampler.close()
    first, *more = sampling(fake)
    assert first["prompt"] == [1, 2, 3] and first["n"] == 2 and first["max_tokens"] == 30
    assert more, "no continuation was asked for"
    seeds = set()
    for body in more:  # one per aborted choice: n = 1, the tokens it had as the prompt's tail, the budget left
        assert body["n"] == 1
        done = len(body["prompt"]) - 3
        assert body["prompt"][:3] == [1, 2, 3] and body["max_tokens"] == 30 - done
        # its row: the tokens it was given are the row's first `done`, all version 0, the rest version 1
        assert any(ro.completion_ids[b, :done].tolist() == body["prompt"][3:] and ro.versions[b, done:].eq(1).all()
                   and ro.versions[b, :done].eq(0).all() for b in range(2))
        seeds.add(body["seed"])
    assert first["seed"] not in seeds  # a continuation draws fresh uniforms, not the first part's again


def test_without_partial_rollouts_a_sync_waits_for_the_generations_under_way(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, vocab_size=fake.vocab)
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        thread, out = sample_in_thread(sampler)
        generating(fake)
        sampler.sync(policy, version=1)
        synced = time.monotonic()
        thread.join(30)
        ro = out["ro"]
    finally:
        sampler.close()
    assert out["ended"] <= synced  # the sample ended (verified under version 0) before the push
    assert "/pause?mode=wait" in [r.path for r in fake.requests]
    rows = tokens_and_versions(ro)
    assert {v for r in rows for _, _, v in r} == {0}
    assert all(generation_of(t, lp) == 1 for r in rows for t, lp, _ in r)


def test_a_sample_that_starts_during_a_sync_samples_the_new_weights(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        sampler.gate.close()  # a sync under way (as sync() does first)
        thread, out = sample_in_thread(sampler, prompts=[[7]])
        time.sleep(0.2)
        assert "ro" not in out and not fake.asked("/v1/completions")  # it waits at the gate
        sampler.gate.open(0)
        sampler.sync(policy, version=1)  # (the push itself)
        thread.join(30)
        assert {v for r in tokens_and_versions(out["ro"]) for _, _, v in r} <= {0, 1}
    finally:
        sampler.close()


def test_an_abort_by_another_client_is_a_server_error(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    try:
        sampler.sync(Policy(), version=0)
        thread, out = sample_in_thread(sampler)
        generating(fake)
        Server(fake.url).call("/pause?mode=abort", {}, timeout=5)  # not this run's sync
        Server(fake.url).call("/resume", {}, timeout=5)
        thread.join(30)
    finally:
        sampler.close()
    e = out.get("error")
    assert isinstance(e, ServerError) and "aborted a generation while no weight sync of this run was under way" in \
        str(e) and "\n" not in str(e), e


def test_an_abort_without_partial_rollouts_is_still_refused(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, vocab_size=fake.vocab)
    try:
        sampler.sync(Policy(), version=0)
        thread, out = sample_in_thread(sampler)
        generating(fake)
        Server(fake.url).call("/pause?mode=abort", {}, timeout=5)
        Server(fake.url).call("/resume", {}, timeout=5)
        thread.join(30)
    finally:
        sampler.close()
    assert isinstance(out.get("error"), ServerError) and "finish_reason 'abort'" in str(out["error"])


def test_a_restart_between_the_parts_of_a_generation_is_caught(fake, tmp_path):
    """The server restarts after the sync that aborted a generation and before its continuation: the
    continuation would sample the restarted server's own weights; the check after it sees the tag."""
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        thread, out = sample_in_thread(sampler)
        generating(fake)
        original = sampler._push_to

        def push_then_restart(*args):
            original(*args)
            fake.weight_version = "default"  # restarted right after the push, with its checkpoint's weights

        sampler._push_to = push_then_restart
        sampler.check = None
        sampler.sync(policy, version=1)
        thread.join(30)
    finally:
        sampler.close()
    assert isinstance(out.get("error"), ServerError) and "weights changed during the rollout" in str(out["error"])


def test_the_gate_orders_samples_and_syncs():
    gate = Gate()
    gate.open(3)
    assert gate.enter(1.0) == (3, 0)
    gate.close()  # a sync waits for the sample under way
    ended = []
    t = threading.Thread(target=lambda: (gate.drain(5.0), ended.append(time.monotonic())))
    t.start()
    time.sleep(0.1)
    assert not ended
    left = time.monotonic()
    gate.leave()
    t.join(5)
    assert ended and ended[0] >= left
    with pytest.raises(ServerError, match=r"within 0.2 s .*while a sample waited"):
        gate.enter(0.2)  # closed: a sample waits for the sync, boundedly
    gate.open(4)
    assert gate.enter(1.0) == (4, 1)  # the new version, and one sync begun
    gate.close()
    with pytest.raises(ServerError, match=r"did not end within 0.1 s"):
        gate.drain(0.1)  # a sample that never ends: the sync gives up at its deadline


def test_a_sync_cannot_wait_forever_for_a_generation(fake, tmp_path):
    """A generation that outlives the request deadline: the sample fails at its deadline and the
    sync, waiting for it, goes on (wait mode)."""
    sampler = sampler_for([Server(fake.url)], tmp_path, vocab_size=fake.vocab,
                          deadlines=Deadlines(request=0.5, sync=10.0, start=2.0))
    try:
        sampler.sync(Policy(), version=0)
        thread, out = sample_in_thread(sampler)  # 1.2 s a prompt: past the 0.5 s request deadline
        generating(fake)
        t0 = time.monotonic()
        sampler.sync(Policy(), version=1)
        assert time.monotonic() - t0 < 0.5 + 10.0
        thread.join(30)
    finally:
        sampler.close()
    assert isinstance(out.get("error"), ServerError) and "0.5 s" in str(out["error"])


@pytest.mark.parametrize("options, message", [
    ({"max_staleness": 1}, "partial_rollouts: continues generations across a weight sync on vLLM servers: give "
                           "--rollout-engine vllm-server"),
    ({"rollout_engine": "vllm-server"}, "partial_rollouts: needs --max-staleness >= 1"),
    ({"rollout_engine": "vllm-server", "max_staleness": 1, "task": "calculator", "model": "tiny-tool"},
     "partial_rollouts: cannot be combined with multi-turn episodes or agents yet"),
])
def test_partial_rollouts_are_refused_where_no_generation_can_span_a_sync(options, message):
    from gspo.config import ConfigError, TrainConfig
    from gspo.train.resolve import resolve

    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        resolve(TrainConfig(partial_rollouts=True, **options))
    resolve(TrainConfig(partial_rollouts=True, rollout_engine="vllm-server", max_staleness=1))  # and this one runs


@pytest.mark.parametrize("partial", [False, True])
def test_a_batch_larger_than_the_request_pool_keeps_every_tokens_version(fake, tmp_path, partial):
    """70 prompts, 64 requests at a time: when the sync comes, 6 have not been sent. They must not
    go out after the pause (the paused server would hold them, and answer them under the new
    weights): a sync keeps them from starting, and they are asked after it, under version 1."""
    fake.token_seconds = 0.005
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=partial, vocab_size=fake.vocab)
    policy = Policy()
    prompts = [[1 + i % 40, 2] for i in range(70)]
    params = SamplingParams(group_size=1, max_new_tokens=60, stop_token_ids=(), pad_token_id=0)  # 0.3 s a request
    try:
        sampler.sync(policy, version=0)
        thread, out = sample_in_thread(sampler, prompts, params)
        generating(fake, tokens=4)  # the first 64 under way, 6 waiting for a free thread
        sampler.sync(policy, version=1)
        thread.join(60)
        assert "error" not in out, out.get("error")
        ro = out["ro"]
    finally:
        sampler.close()
    rows = tokens_and_versions(ro)
    assert all(len(r) == 60 for r in rows)
    assert {v for r in rows for _, _, v in r} == {0, 1}  # some rows sampled before the sync, some after
    for r in rows:
        assert [generation_of(t, lp) for t, lp, _ in r] == [v + 1 for _, _, v in r]


@pytest.mark.parametrize("partial", [True, False])
def test_a_request_on_its_way_when_a_sync_begins_is_answered_by_one_version(fake, tmp_path, partial):
    """The race a gate alone leaves: a request's ticket taken just before the sync closed the gate,
    its bytes sent a moment later. With --partial-rollouts the sync pauses at once, the paused server
    holds the late request (vLLM queues what arrives while paused, and would answer it under the new
    weights): the sync cuts it after Gate.GRACE and the sample asks again under the new version.
    Without, the sync lets this run's requests end before it pauses: answered under the old one."""
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=partial, vocab_size=fake.vocab)
    policy = Policy()
    server = Server(fake.url)
    sampler.servers = [server]
    original = Server.call
    slow = threading.Event()

    def late_call(self, path, body=None, **kw):
        if path == "/v1/completions" and not slow.is_set() and kw.get("ticket") is not None:
            slow.set()
            time.sleep(0.4)  # the ticket is taken; the bytes go out after the sync's pause
        return original(self, path, body, **kw)

    try:
        sampler.sync(policy, version=0)
        server.call = late_call.__get__(server)
        thread, out = sample_in_thread(sampler, prompts=[[3]], params=SamplingParams(
            group_size=1, max_new_tokens=5, stop_token_ids=(), pad_token_id=0))
        while not slow.is_set():
            time.sleep(0.001)
        t0 = time.monotonic()
        sampler.sync(policy, version=1)  # pauses while the request sleeps; it arrives paused, and is held
        took = time.monotonic() - t0
        thread.join(30)
        assert "error" not in out, out.get("error")
    finally:
        sampler.close()
    rows = tokens_and_versions(out["ro"])
    version = 1 if partial else 0  # asked again after the sync, or answered before it: marked so
    assert [v for _, _, v in rows[0]] == [version] * 5
    assert [generation_of(t, lp) for t, lp, _ in rows[0]] == [version + 1] * 5
    assert took < 1.5  # cut after the grace, or waited for: not held to the request deadline (2 s)
    # partial: cut before it connected (its ticket), so only the second asking reached the server
    assert len(sampling(fake)) == 1


def test_a_failed_sync_stops_the_samples_waiting_for_it(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab)
    policy = Policy()
    try:
        sampler.sync(policy, version=0)
        thread, out = sample_in_thread(sampler)
        generating(fake)
        fake.status["/collective_rpc"] = 500  # the push fails
        with pytest.raises(ServerError, match="/collective_rpc"):
            sampler.sync(policy, version=1)
        thread.join(30)
    finally:
        sampler.close()
    e = out.get("error")  # the aborted generations are not continued on weights nobody knows
    assert isinstance(e, ServerError) and "a weight sync failed" in str(e) and "\n" not in str(e), e


def test_closing_the_sampler_ends_a_sampling_threads_requests_at_once(fake, tmp_path):
    """A run that stops (an error in the trainer's thread) closes the sampler: a request under way in
    the sampling thread ends then, not at its deadline (the interpreter joins that thread at exit)."""
    fake.token_seconds = 0.2  # 30 tokens: 6 s a completion, past nothing here but the test's patience
    sampler = sampler_for([Server(fake.url)], tmp_path, partial=True, vocab_size=fake.vocab,
                          deadlines=Deadlines(request=60.0, sync=10.0, start=2.0))
    sampler.sync(Policy(), version=0)
    thread, out = sample_in_thread(sampler)
    generating(fake, tokens=1)
    t0 = time.monotonic()
    sampler.close()
    thread.join(10)
    assert not thread.is_alive() and out["ended"] - t0 < 2.0, out
    assert isinstance(out.get("error"), ServerError) and "the sampler was closed" in str(out["error"])
