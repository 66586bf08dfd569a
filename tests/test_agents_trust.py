"""Agents you can trust: agent code written elsewhere, against the endpoint and the trainer.

Each test is an agent shape or an input the endpoint was not built for: concurrent and forked
calls, a sub-agent inside an episode, a process that is not the run's, token ids past the
vocabulary, an episode that fails, an agent that blocks its event loop. The row test is
model-level: every trained token's recorded log-prob equals a teacher-forced forward of the row
(the policy's, in float32), so a token laid into a context it was not sampled in shows as a
gap of nats, not of 1e-6; and the run-time integrity check (gspo.sampling.integrity) passes.
"""

import asyncio
import json
import math
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from gspo.agents.endpoint import Endpoint, Limits
from gspo.agents.runner import assemble, run_agent_episodes
from gspo.models.loading import load_policy
from gspo.sampling.episodes import Draws, EpisodeSpec
from gspo.sampling.integrity import Receipts, Recorded, check_rows
from gspo.sampling.rollout import PolicySampler, sampling_params
from gspo.tasks.data import Example

pytest.importorskip("openai")

KEY = "the-runs-secret"


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_policy("tiny-tool")


class Slow:
    """A fake sampler: `text`'s tokens for every prompt, after `pause` seconds; records each batch."""

    def __init__(self, tok, text="ok", pause=0.0):
        self.ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        self.pause, self.batches = pause, []

    def __call__(self, prompts, max_tokens, rows):
        self.batches.append([list(p) for p in prompts])
        time.sleep(self.pause)
        return [(self.ids[:max_tokens], [-0.5] * len(self.ids[:max_tokens]), False) for _ in prompts]


def endpoint(tok, sampler, **kw):
    stop = (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
    return Endpoint(sampler, tok, "policy", Limits(16, stop, **kw), secret=KEY).start()


def post(url, route, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    r = httpx.post(f"{url}/{route}", json=body, timeout=30, headers=headers)
    return r.status_code, r.json()


def at_once(*calls):
    """Run the calls (thunks) concurrently in threads; their results in order."""
    out = [None] * len(calls)

    def run(i):
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# ------------------------------------------------------------------------------------------------
# the endpoint: call graphs, limits, keys, bad requests (a fake sampler)
# ------------------------------------------------------------------------------------------------

def test_continuations_of_one_answered_call_fork_and_each_row_is_its_own_context(tiny):
    # best-of-n after an answer: two calls extend call 0 at once. One continues its sequence; the
    # other starts a sequence of its own whose prompt holds call 0's tokens as context. Before, both
    # were laid into one row, the second's tokens after the first's (a context never sampled in).
    _, tok = tiny
    ep = endpoint(tok, Slow(tok, "42", pause=0.2), window=0.5)
    try:
        url = ep.open_episode(0)
        first = [{"role": "user", "content": "2+40="}]
        _, r0 = post(url, "chat/completions", {"messages": first})
        follow = first + [r0["choices"][0]["message"], {"role": "user", "content": "sure?"}]
        (s1, r1), (s2, r2) = at_once(lambda: post(url, "chat/completions", {"messages": follow}),
                                     lambda: post(url, "chat/completions", {"messages": follow}))
        assert s1 == s2 == 200
        calls = ep.close_episode(0)
        assert [c.parent for c in calls] == [None, 0, 0]
        assert sorted(c.extends for c in calls[1:]) == [False, True]  # one continues call 0, one forks
        assert len({c.sequence for c in calls}) == 2
        ro, epi = assemble([_result(calls)], tok, 1, 0)
        rows = _rows(ro, epi)  # each row: its prompt then its tokens, as the loss reads it
        for c in calls:  # every call's prompt + completion is a prefix of exactly the row it is trained in
            whole = c.prompt_ids + c.completion_ids
            assert sum(r[:len(whole)] == whole for r in rows) >= 1
        assert len(rows) == 2
    finally:
        ep.stop()


def test_the_turn_limit_counts_calls_in_flight(tiny):
    # --max-turns 3 and an agent that sends 5 calls at once: 3 are sampled, 2 refused. Before, the
    # limit was read outside the lock against finished calls: all 5 went through.
    _, tok = tiny
    fake = Slow(tok, pause=0.3)
    ep = endpoint(tok, fake, max_calls=3, window=0.5)
    try:
        url = ep.open_episode(0)
        got = at_once(*[lambda j=j: post(url, "chat/completions", {"messages": [{"role": "user", "content": f"q{j}"}]})
                        for j in range(5)])
        assert sorted(s for s, _ in got) == [200, 200, 200, 400, 400]
        assert {r["error"]["code"] for s, r in got if s == 400} == {"turn_limit"}
        assert len(ep.close_episode(0)) == 3 and sum(len(b) for b in fake.batches) == 3
    finally:
        ep.stop()


FOREIGN = r'''
import json, sys, urllib.request, urllib.error
url, key = sys.argv[1], sys.argv[2] or None
req = urllib.request.Request(url + "/chat/completions", method="POST",
                             data=json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
                             headers={"Content-Type": "application/json",
                                      **({"Authorization": "Bearer " + key} if key else {})})
try:
    with urllib.request.urlopen(req, timeout=30) as r:
        print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
'''


@pytest.mark.slow  # starts a process
def test_a_process_without_the_runs_key_is_refused_and_leaves_no_trace(tiny, tmp_path):
    # another local process (no key, a wrong key, a key one character off) posts to an episode's URL
    # while it runs: 401, nothing sampled, nothing recorded. Before, it got 200 and its call was trained.
    _, tok = tiny
    fake = Slow(tok)
    ep = endpoint(tok, fake)
    script = tmp_path / "foreign.py"
    script.write_text(FOREIGN)
    try:
        url = ep.open_episode(0)
        assert post(url, "chat/completions", {"messages": [{"role": "user", "content": "mine"}]})[0] == 200
        for key in ("", "gspo", KEY[:-1] + "X"):
            out = subprocess.run([sys.executable, str(script), url, key], capture_output=True, text=True, timeout=60)
            status, body = out.stdout.split(" ", 1)
            assert status == "401" and json.loads(body)["error"]["code"] == "invalid_api_key", out.stdout
        assert httpx.get(f"{url}/models", timeout=10).status_code == 401
        assert ep.refused == 4 and len(fake.batches) == 1
        calls = ep.close_episode(0)
        assert len(calls) == 1 and tok.decode(calls[0].prompt_ids).count("mine") == 1
    finally:
        ep.stop()


def test_idle_connections_and_a_malformed_request_cost_a_bounded_thread_and_no_traceback(tiny, monkeypatch, capsys):
    # a local process that opens connections and sends nothing held a thread each, for ever (3,000
    # connections: 3,000 threads after the step); `Content-Length: abc` printed a traceback
    import socket

    from gspo.agents import endpoint as ep_module

    _, tok = tiny
    monkeypatch.setattr(ep_module, "IDLE_SECONDS", 0.5)
    monkeypatch.setattr(ep_module, "MAX_CONNECTIONS", 4)
    ep = endpoint(tok, Slow(tok))
    try:
        url = ep.open_episode(0)
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", ep.port)) for _ in range(10)]
        time.sleep(0.2)
        assert threading.active_count() - before <= 4  # at most MAX_CONNECTIONS handler threads
        end = time.monotonic() + 10
        while threading.active_count() > before and time.monotonic() < end:  # past IDLE_SECONDS: closed
            time.sleep(0.1)
        assert threading.active_count() <= before
        for s in idle:
            s.close()
        for key in (None, KEY):
            raw = socket.create_connection(("127.0.0.1", ep.port))
            auth = f"Authorization: Bearer {key}\r\n" if key else ""
            raw.sendall(f"POST /e/0/v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: abc\r\n\r\n".encode())
            assert raw.recv(4096).split(b" ")[1] == (b"401" if key is None else b"400")
            raw.close()
        assert post(url, "completions", {"prompt": "1+1="})[0] == 200  # the endpoint serves on
        assert "Traceback" not in capsys.readouterr().err
    finally:
        ep.stop()


@pytest.mark.slow  # waits for its batch window
def test_bad_token_ids_and_an_overlong_prompt_get_400_while_the_other_calls_go_on(tiny):
    # a request with an id past the vocabulary reached the sampler and failed the whole step
    # (IndexError); now it is that request's 400, as is a prompt past the model's context
    _, tok = tiny
    fake = Slow(tok, pause=0.2)
    ep = endpoint(tok, fake, vocab_size=60, max_context=64, window=0.5)
    try:
        urls = [ep.open_episode(b) for b in range(4)]
        good = tok("1+1=", add_special_tokens=False)["input_ids"]
        got = at_once(lambda: post(urls[0], "completions", {"prompt": good + [60]}),
                      lambda: post(urls[1], "completions", {"prompt": [-1] + good}),
                      lambda: post(urls[2], "completions", {"prompt": good * 40}),
                      lambda: post(urls[3], "completions", {"prompt": good}))
        assert [s for s, _ in got] == [400, 400, 400, 200]
        assert [r["error"]["code"] for _, r in got[:3]] == ["invalid_token_id", "invalid_token_id",
                                                           "context_length_exceeded"]
        assert "token id 60 is not in the model's vocabulary (0 <= id < 60)" in got[0][1]["error"]["message"]
        assert fake.batches == [[good]]  # only the good prompt reached the sampler
        _, r = post(urls[3], "completions", {"prompt": good * 15})  # 60 of 64: the completion cut to fit
        assert len(r["choices"][0]["token_ids"]) <= 64 - len(good * 15)
    finally:
        ep.stop()


def test_request_fields_are_checked_by_type_not_by_truthiness(tiny):
    # max_completion_tokens 0 fell through to max_tokens (0 is falsy); n=True and stream=1 passed as 1
    _, tok = tiny
    fake = Slow(tok)
    ep = endpoint(tok, fake)
    try:
        url = ep.open_episode(0)
        msgs = [{"role": "user", "content": "hi"}]
        for extra, param in (({"max_completion_tokens": 0, "max_tokens": 4}, "max_completion_tokens"),
                             ({"n": True}, "n"), ({"stream": 1}, "stream"), ({"max_tokens": 2.0}, "max_tokens")):
            status, r = post(url, "chat/completions", {"messages": msgs, **extra})
            assert (status, r["error"]["param"]) == (400, param)
        assert not fake.batches
    finally:
        ep.stop()


def test_a_reward_may_be_any_real_number_type():
    import numpy as np

    from gspo.agents.runner import _rewards

    assert _rewards(np.float32(0.5)) == [0.5] and _rewards([np.int64(1), torch.tensor(2.0)]) == [1.0, 2.0]
    for bad in (True, "1", torch.tensor([1.0, 2.0]), float("nan"), []):
        with pytest.raises(ValueError):
            _rewards(bad)


@pytest.mark.slow  # waits out its timeouts
def test_a_call_its_caller_gave_up_on_is_not_recorded_and_a_retry_continues_the_sequence(tiny):
    from gspo.agents.endpoint import in_process
    from gspo.agents.runner import httpx_of_openai

    _, tok = tiny
    ep = endpoint(tok, Slow(tok, "42", pause=0.5))
    transport = in_process(ep, httpx_of_openai())

    async def agent(url):
        import openai

        client = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0,
                                    http_client=openai.DefaultAsyncHttpxClient(transport=transport))
        msgs = [{"role": "user", "content": "2+40="}]
        r = await client.chat.completions.create(model="policy", messages=msgs)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        with pytest.raises(asyncio.TimeoutError):  # the agent's own timeout: it gives up on this call
            await asyncio.wait_for(client.chat.completions.create(model="policy", messages=msgs), 0.1)
        await client.chat.completions.create(model="policy", messages=msgs)  # the retry

    try:
        url = ep.open_episode(0)
        asyncio.run(agent(url))
        calls = ep.close_episode(0)
        assert len(calls) == 2 and calls[1].extends and calls[1].parent == 0  # the retry joined the sequence
    finally:
        ep.stop()


# ------------------------------------------------------------------------------------------------
# episodes on the real sampler: any call graph is laid out token-exact
# ------------------------------------------------------------------------------------------------

async def gather_agent(client, example):
    """An answer, then best-of-3 continuations of it at once (asyncio.gather)."""
    msgs = [{"role": "user", "content": example.prompt}]
    r = await client.chat.completions.create(model="policy", messages=msgs)
    follow = msgs + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    await asyncio.gather(*[client.chat.completions.create(model="policy", messages=follow) for _ in range(3)])
    return 1.0


async def fork_agent(client, example):
    """One answer, then a critique and a retry of it at once, then each continued once more."""
    msgs = [{"role": "user", "content": example.prompt}]
    r = await client.chat.completions.create(model="policy", messages=msgs)
    base = msgs + [r.choices[0].message.model_dump(exclude_none=True)]

    async def branch(text):
        m = base + [{"role": "user", "content": text}]
        r1 = await client.chat.completions.create(model="policy", messages=m)
        m += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
        await client.chat.completions.create(model="policy", messages=m)

    await asyncio.gather(branch("critique it"), branch("try again"))
    return 1.0


async def nested_agent(client, example):
    """A planner whose tool is a sub-agent with a conversation of its own, interleaved with it."""
    plan = [{"role": "user", "content": "plan: " + example.prompt}]
    r = await client.chat.completions.create(model="policy", messages=plan)
    sub = [{"role": "system", "content": "you are a solver"}, {"role": "user", "content": example.prompt}]
    s = await client.chat.completions.create(model="policy", messages=sub)
    sub += [s.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "check"}]
    plan += [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "sub-agent says hi"}]
    await asyncio.gather(client.chat.completions.create(model="policy", messages=plan),  # the planner goes on
                         client.chat.completions.create(model="policy", messages=sub))  # next to its sub-agent
    return 1.0


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


async def tool_loop_agent(client, example):
    """A tool loop (OpenAI tool messages): after each tool result, the next step and a check of it
    are asked at once, and the loop goes on from the step."""
    msgs = [{"role": "user", "content": example.prompt}]
    r = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
    for _ in range(2):
        msg = r.choices[0].message
        msgs += [msg.model_dump(exclude_none=True)]
        msgs += ([{"role": "tool", "tool_call_id": c.id, "content": "3"} for c in msg.tool_calls] if msg.tool_calls
                 else [{"role": "user", "content": "use the tool"}])
        r, _ = await asyncio.gather(
            client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS),
            client.chat.completions.create(model="policy", messages=msgs + [{"role": "user", "content": "check"}]))
    return 1.0


async def completions_agent(client, example):
    """Plain completions on token ids: a prompt, then two continuations of it at once."""
    r = await client.completions.create(model="policy", prompt=example.prompt, max_tokens=4)
    p = r.model_extra["prompt_token_ids"] + r.choices[0].model_extra["token_ids"] + [5, 6]  # vLLM's token fields
    await asyncio.gather(*[client.completions.create(model="policy", prompt=p, max_tokens=4) for _ in range(2)])
    return 1.0


@pytest.mark.parametrize("agent", [gather_agent, fork_agent, nested_agent, tool_loop_agent, completions_agent])
def test_every_row_of_any_call_graph_is_what_the_policy_sampled_in_that_context(tiny, agent):
    # a teacher-forced forward of every row gives back the recorded log-prob of each trained token
    # (float32): a token laid after another call's tokens (the old layout of concurrent calls) is off
    # by nats there; and the integrity check against the sampler's receipts finds no breach
    model, tok = tiny
    receipts = Receipts()
    ro, ep = _episodes(Recorded(PolicySampler(model), receipts), tok, agent)
    assert not ep.failed.any()
    rows = ep.with_more(ro)[0]
    assert rows.prompt_ids.shape[0] > ro.prompt_ids.shape[0]  # concurrent calls: later sequences
    assert check_rows(rows, receipts) == ([], rows.prompt_ids.shape[0])
    gap = _forward_gap(model, rows)
    assert gap < 1e-4, gap


def test_the_check_finds_a_row_laid_out_the_old_way(tiny, monkeypatch):
    # the endpoint's old rule (every call after the first extends the row, in completion order) laid
    # the gather agent's calls into one row: the check names the row and the column
    from gspo.agents import runner
    from gspo.sampling.integrity import NOT_DRAWN

    def old_sequences(calls):
        return [(list(range(len(calls))), list(calls))]

    model, tok = tiny
    monkeypatch.setattr(runner, "sequences", old_sequences)
    receipts = Receipts()
    ro, _ = _episodes(Recorded(PolicySampler(model), receipts), tok, gather_agent)
    breaches, checked = check_rows(ro, receipts)
    assert checked == 4 and len(breaches) == 4 and {b.why for b in breaches} == {NOT_DRAWN}
    assert _forward_gap(model, ro) > 0.1  # and the policy's own forward disagrees by far more than 1e-4


# ------------------------------------------------------------------------------------------------
# faults: blocking agents, failed episodes
# ------------------------------------------------------------------------------------------------

def test_an_agent_that_raises_systemexit_fails_at_once_and_its_thread_lives_on(tiny, capsys):
    # asyncio lets SystemExit and KeyboardInterrupt out of the event loop: the episode's thread died,
    # the step waited out the deadline and called it "blocked", and a traceback was printed
    model, tok = tiny

    async def agent(client, example):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.prompt}])
        b = int(str(client.base_url).rstrip("/").split("/")[-2])
        if b == 0:
            raise SystemExit(3)
        if b == 1:
            raise KeyboardInterrupt
        return 1.0

    for _ in range(2):  # the same threads serve the next rollout
        t0 = time.perf_counter()
        _, ep = _episodes(PolicySampler(model), tok, agent, timeout=20.0)
        assert time.perf_counter() - t0 < 10
        assert ep.failed.tolist() == [True, True, False, False]
        err = capsys.readouterr().err
        assert "episode 0 (row 0) raised SystemExit: 3: failed" in err and "Traceback" not in err
        assert "episode 1 (row 0) raised KeyboardInterrupt: failed" in err


@pytest.mark.slow  # waits out its deadlines
def test_agents_that_block_their_event_loop_end_at_the_deadline_in_one_line_each(tiny, capsys):
    # time.sleep and a CPU-bound loop in async code: before, a 1 s deadline let a 2-episode step run
    # 11-13 s (the episodes one after another on one loop) and printed a thread traceback
    model, tok = tiny

    async def agent(client, example):
        b = int(str(client.base_url).rstrip("/").split("/")[-2])
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.prompt}])
        if b == 0:
            time.sleep(8)  # a synchronous client
        elif b == 1:
            await asyncio.sleep(0.2)  # the others have their answers (it holds the GIL while it spins)
            end = time.monotonic() + 5
            while time.monotonic() < end:  # CPU-bound work (it holds the GIL: the others share it meanwhile)
                pass
        elif b == 2:  # an agent that swallows its cancellation (for a while)
            end = time.monotonic() + 6
            while time.monotonic() < end:
                try:
                    await asyncio.sleep(end - time.monotonic())
                except asyncio.CancelledError:
                    pass
        return 1.0

    async def quick(client, example):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.prompt}])
        return 1.0

    _episodes(PolicySampler(model), tok, quick)  # the first call of a process warms the sampler up
    capsys.readouterr()
    t0 = time.perf_counter()
    # a 2.5 s deadline: the quick episode 3 has its answer in time on a loaded 2-core machine too
    ro, ep = _episodes(PolicySampler(model), tok, agent, timeout=2.5)
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert took < 2.5 + 3.0, took  # the deadline, its grace (0.5 s) and the step's own work (before: 8 s and more)
    assert ep.failed.tolist() == [True, True, True, False]
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 3 and all("blocked its event loop past the episode deadline of 2.5 s" in x for x in lines[:2])
    assert "episode 2 (row 1) did not stop when cancelled at the episode deadline of 2.5 s" in lines[2]
    assert "Traceback" not in err and "Event loop is closed" not in err


@pytest.mark.slow  # waits out deadlines: 10 s
def test_an_episode_left_behind_does_not_touch_the_next_episodes_on_its_thread(tiny):
    # an episode cut at its deadline runs on in the background until it returns; its thread (and
    # event loop) went back to the pool at once, so the next step's episodes ran beside it there and
    # its clean-up cancelled them ("cancelled: failed" in the next test of the same process)
    model, tok = tiny

    async def stubborn(client, example):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.prompt}])
        time.sleep(2.5)  # blocks its loop past the deadline: cancelled when it wakes, its clean-up runs then
        return 1.0

    async def patient(client, example):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.prompt}])
        await asyncio.sleep(2)  # the episodes left behind wake meanwhile
        return 1.0

    _episodes(PolicySampler(model), tok, patient)  # the first call of a process warms the sampler up
    _, first = _episodes(PolicySampler(model), tok, stubborn, timeout=1.0)
    assert first.failed.all()
    _, second = _episodes(PolicySampler(model), tok, patient, timeout=30.0)
    assert not second.failed.any()


@pytest.mark.slow  # trains
def test_failed_episodes_earn_nothing_and_leave_their_groups_baseline(tmp_path):
    # an episode that raises after a call was scored by the task's rewards (reward 1.0 in
    # samples.jsonl, reward/mean 1.0 at failed_frac 0.5) and sat in its group's baseline
    import gspo

    scored = []

    def answer_reward(completions, answer, **kw):
        scored.extend(completions)
        return [1.0 for _ in completions]

    async def rollout(client, example):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.prompt}])
        b = int(str(client.base_url).rstrip("/").split("/")[-2])
        if b in (0, 4, 5):  # group 0 (rows 0-3) keeps 3 survivors, group 1 (rows 4-7) 2, group 2 (rows 8-11) 4
            raise ConnectionError("the sandbox died")
        if b == 9:
            raise ConnectionError("the sandbox died again")  # group 2 then keeps 3
        return [float(b % 4 >= 2)]  # agent rewards 0, 0, 1, 1 in each group

    cfg = gspo.TrainConfig(model="tiny-tool", task="arithmetic", steps=1, prompts_per_step=3, group_size=4,
                           max_new_tokens=6, eval_size=0, progress=False, num_minibatches=1,
                           output_dir=str(tmp_path / "run"), samples_per_step=12)
    gspo.Trainer(cfg, env=rollout, reward_funcs=[answer_reward]).train()
    assert len(scored) == 8  # the 4 failed episodes were never scored
    rows = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [r["failed"] for r in rows] == [b in (0, 4, 5, 9) for b in range(12)]
    assert [r["reward"] for r in rows] == [0.0 if b in (0, 4, 5, 9) else 1.0 + float(b % 4 >= 2) for b in range(12)]
    # group 0: survivors 1, 2, 3 with rewards 1, 2, 2: mean 5/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2)
    # = sqrt(1/3) = 0.57735, advantages -1.1547, +0.57735, +0.57735; the failed episode 0 gets 0
    adv = [r["advantage"] for r in rows]
    assert adv[:4] == pytest.approx([0.0, -1.1547, 0.57735, 0.57735], abs=1e-4)
    # group 1: survivors 6, 7 (rewards 2, 2): no spread, 0; group 2: survivors 8, 10, 11 (1, 2, 2): as group 0
    assert adv[4:8] == [0.0] * 4 and adv[8:] == pytest.approx([-1.1547, 0.0, 0.57735, 0.57735], abs=1e-4)
    (metrics,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["agent/failed_frac"] == pytest.approx(4 / 12) and metrics["agent/groups_dropped"] == 0
    # reward/mean over the 8 survivors: (1 + 2 + 2) + (2 + 2) + (1 + 2 + 2) = 14 / 8
    assert metrics["reward/mean"] == pytest.approx(14 / 8)
    assert metrics["reward/answer_reward/mean"] == 1.0 and metrics["integrity/breaches"] == 0


def test_a_group_left_with_one_survivor_is_out_of_the_loss(tiny):
    from gspo.train.batch import baseless_groups, without_baseline

    model, tok = tiny

    async def rollout(client, example):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.prompt}])
        if int(str(client.base_url).rstrip("/").split("/")[-2]) in (0, 1, 2):
            raise RuntimeError("down")
        return 1.0

    ro, ep = _episodes(PolicySampler(model), tok, rollout, n=2, G=4)
    # group 0 (rows 0-3) keeps only row 3: no baseline, out of the loss; group 1 is whole
    assert without_baseline(ep, 4).tolist() == [False, False, False, True] + [False] * 4
    assert baseless_groups(ep, 4) == 1


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _episodes(sampler, tok, agent, n=2, G=2, timeout=30.0):
    stop = (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
    params = sampling_params(tok, stop=stop, group_size=G, max_new_tokens=6)
    examples = [Example(prompt=f"{i}+1=", answer=str(i + 1), source=f"row {i}") for i in range(n)]
    return run_agent_episodes(sampler, tok, examples, EpisodeSpec(agent, max_turns=8, timeout=timeout), params,
                              Draws(generator_for=lambda k: torch.Generator().manual_seed(7 + k)))


def _result(calls):
    from gspo.agents.runner import AgentResult

    return AgentResult(calls, [1.0])


def _rows(ro, ep):
    rows = ep.with_more(ro)[0]
    out = []
    for b in range(rows.prompt_ids.shape[0]):
        prompt = rows.prompt_ids[b][rows.prompt_mask[b] > 0].tolist()
        out.append(prompt + rows.completion_ids[b, :int(rows.lengths[b])].tolist())
    return out


@torch.no_grad()
def _forward_gap(model, ro) -> float:
    """The largest |recorded log-prob − the model's log-prob given the row's own context| over the
    trained tokens of every row."""
    worst = 0.0
    for b in range(ro.prompt_ids.shape[0]):
        prompt = ro.prompt_ids[b][ro.prompt_mask[b] > 0].tolist()
        n = int(ro.lengths[b])
        row = ro.completion_ids[b, :n].tolist()
        on = ro.completion_mask[b, :n].bool()
        if not on.any():
            continue
        logits = model(torch.tensor([prompt + row])).logits.float().log_softmax(-1)[0, len(prompt) - 1:-1]
        forward = logits.gather(-1, torch.tensor(row)[:, None])[:, 0]
        worst = max(worst, float((forward[on] - ro.logp[b, :n][on]).abs().max()))
    return worst if math.isfinite(worst) else float("inf")
