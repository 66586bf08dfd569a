"""Agents: the OpenAI-compatible endpoint over the policy (gspo.agents.endpoint) and agent code
run through it (gspo.agents.runner), token for token.

The model is the built-in tiny-tool (a Qwen-style chat template). The endpoint tests use a fake
sampler whose tokens are known; the episode tests the real sampler, and check the recorded row
against what the responses carried and against the policy's own log-probs.
"""

import asyncio
import json
import math
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from gspo.agents.endpoint import Endpoint, Limits
from gspo.agents.runner import run_agent_episodes
from gspo.models.loading import load_policy
from gspo.sampling.episodes import Draws, EpisodeSpec
from gspo.sampling.rollout import PolicySampler, sampling_params
from gspo.tasks.data import Example

pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, tok = load_policy("tiny-tool")
    return model, tok


class FakeSampler:
    """Samples `text` (cut to max_tokens) for every prompt and records each batch."""

    def __init__(self, tok, text="ok", end=True):
        self.tok, self.batches = tok, []
        self.ids = tok(text, add_special_tokens=False)["input_ids"] + ([tok.convert_tokens_to_ids("<|im_end|>")]
                                                                       if end else [])

    def __call__(self, prompts, max_tokens, rows):
        self.batches.append((list(prompts), max_tokens, list(rows)))
        ids = self.ids[:max_tokens]
        return [(ids, [-0.5] * len(ids), len(ids) < len(self.ids)) for _ in prompts]


KEY = "the-runs-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def endpoint_for(tok, sampler, **kw):
    stop = (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
    return Endpoint(sampler, tok, "policy", Limits(kw.pop("max_new_tokens", 16), stop, **kw), secret=KEY).start()


def post(url, route, body, key=KEY):
    r = httpx.post(f"{url}/{route}", json=body, timeout=30, headers={"Authorization": f"Bearer {key}"} if key else {})
    return r.status_code, r.json()


def rendered(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_chat_call_returns_the_sampled_tokens_and_openai_fields(tiny):
    _, tok = tiny
    fake = FakeSampler(tok, "42")
    ep = endpoint_for(tok, fake)
    try:
        url = ep.open_episode(3)
        models = httpx.get(f"{url}/models", headers=AUTH).json()
        assert models["data"][0]["id"] == "policy" and models["object"] == "list"
        messages = [{"role": "user", "content": "2+40="}]
        status, r = post(url, "chat/completions", {"model": "policy", "messages": messages, "logprobs": True})
        assert status == 200, r
        assert r["object"] == "chat.completion" and r["model"] == "policy"
        choice = r["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": "42"}  # <|im_end|> sampled, not in the text
        assert choice["finish_reason"] == "stop"
        assert choice["token_ids"] == fake.ids and r["prompt_token_ids"] == rendered(tok, messages)
        assert [c["logprob"] for c in choice["logprobs"]["content"]] == [-0.5] * len(fake.ids)
        assert r["usage"] == {"prompt_tokens": len(r["prompt_token_ids"]), "completion_tokens": len(fake.ids),
                              "total_tokens": len(r["prompt_token_ids"]) + len(fake.ids)}
        assert fake.batches[0][2] == [3]  # the episode's row
    finally:
        ep.stop()


@pytest.mark.slow  # 2 s
def test_a_streamed_call_is_sampled_whole_and_sent_as_events_over_either_transport(tiny):
    import openai

    from gspo.agents.endpoint import in_process
    from gspo.agents.runner import httpx_of_openai

    _, tok = tiny
    fake = FakeSampler(tok, "42")
    ep = endpoint_for(tok, fake)
    try:
        messages = [{"role": "user", "content": "2+40="}]
        raw = httpx.post(f"{ep.open_episode(0)}/chat/completions", timeout=30, headers=AUTH,
                         json={"messages": messages, "stream": True, "stream_options": {"include_usage": True}})
        assert raw.headers["content-type"] == "text/event-stream"
        events = [line[len("data: "):] for line in raw.text.split("\n\n") if line]
        assert events[-1] == "[DONE]" and len(events) == 4  # the message, the finish reason, the usage, [DONE]
        first, last, usage = (json.loads(e) for e in events[:3])
        assert first["object"] == "chat.completion.chunk"
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": "42"}
        assert first["choices"][0]["token_ids"] == fake.ids and first["prompt_token_ids"] == rendered(tok, messages)
        assert last["choices"][0]["finish_reason"] == "stop" and usage["usage"]["completion_tokens"] == len(fake.ids)

        async def streamed(url, transport):  # the OpenAI client reads it as any stream, in process too
            kw = {"http_client": openai.DefaultAsyncHttpxClient(transport=transport)} if transport else {}
            client = openai.AsyncOpenAI(base_url=url, api_key=KEY, **kw)
            stream = await client.chat.completions.create(model="policy", messages=messages, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        assert asyncio.run(streamed(ep.open_episode(1), None)) == "42"
        assert asyncio.run(streamed(ep.open_episode(2), in_process(ep, httpx_of_openai()))) == "42"
        assert [len(ep.close_episode(k)) for k in (0, 1, 2)] == [1, 1, 1]  # each recorded whole, once
    finally:
        ep.stop()


def test_a_call_extending_the_last_keeps_its_sampled_tokens_and_an_edit_starts_anew(tiny):
    _, tok = tiny
    fake = FakeSampler(tok, "42")
    ep = endpoint_for(tok, fake)
    try:
        url = ep.open_episode(0)
        first = [{"role": "user", "content": "2+40="}]
        _, r1 = post(url, "chat/completions", {"messages": first})
        reply = r1["choices"][0]["message"]
        second = first + [reply, {"role": "user", "content": "and 1 more"}]
        _, r2 = post(url, "chat/completions", {"messages": second})
        # the prompt is the first prompt, the tokens sampled (never re-tokenised), then the new turn's tokens:
        # "\n<|im_start|>user\nand 1 more<|im_end|>\n<|im_start|>assistant\n" after the sampled <|im_end|>
        before = r1["prompt_token_ids"] + r1["choices"][0]["token_ids"]
        assert r2["prompt_token_ids"][:len(before)] == before
        tail = tok.decode(r2["prompt_token_ids"][len(before):])
        assert tail == "\n<|im_start|>user\nand 1 more<|im_end|>\n<|im_start|>assistant\n"
        edited = first + [{"role": "assistant", "content": "41"}, {"role": "user", "content": "and 1 more"}]
        _, r3 = post(url, "chat/completions", {"messages": edited})
        assert r3["prompt_token_ids"] == rendered(tok, edited)
        calls = ep.close_episode(0)
        assert [c.extends for c in calls] == [False, True, False]
    finally:
        ep.stop()


def test_the_token_budget_counts_from_each_sequences_own_first_prompt(tiny):
    # --max-episode-tokens bounds a row: the tokens after its sequence's first prompt. An edited
    # history starts a row of its own (a later sequence), whose budget starts at its own prompt.
    _, tok = tiny
    ep = endpoint_for(tok, FakeSampler(tok, "42"), max_episode_tokens=60)
    try:
        url = ep.open_episode(0)
        first = [{"role": "user", "content": "2+40="}]
        _, r1 = post(url, "chat/completions", {"messages": first})
        long = first + [r1["choices"][0]["message"], {"role": "user", "content": "x " * 40}]
        code, r2 = post(url, "chat/completions", {"messages": long})  # 3 sampled + ~90 new > 60
        assert code == 400 and r2["error"]["code"] == "episode_budget"
        edited = [{"role": "user", "content": "a longer question: " + "y " * 40}]  # ~95 tokens more than `first`
        _, r3 = post(url, "chat/completions", {"messages": edited})
        more = edited + [r3["choices"][0]["message"], {"role": "user", "content": "ok?"}]
        code, r4 = post(url, "chat/completions", {"messages": more})
        grown = len(r4["prompt_token_ids"]) - len(r3["prompt_token_ids"])  # its row's tokens so far
        assert grown < 60 < len(r4["prompt_token_ids"]) - len(r1["prompt_token_ids"])
        assert code == 200 and r4["choices"][0]["token_ids"] == r1["choices"][0]["token_ids"]
        assert [c.extends for c in ep.close_episode(0)] == [False, False, True]
    finally:
        ep.stop()


def test_errors_are_openai_shaped_and_a_late_call_is_refused(tiny):
    _, tok = tiny
    ep = endpoint_for(tok, FakeSampler(tok), max_calls=2)
    try:
        url = ep.open_episode(1)
        msgs = [{"role": "user", "content": "hi"}]
        cases = [({"messages": msgs, "n": 2}, 400, "n"), ({"messages": msgs, "stream": "yes"}, 400, "stream"),
                 ({"messages": []}, 400, "messages"), ({"messages": msgs, "max_tokens": 0}, 400, "max_tokens")]
        for body, status, param in cases:
            got, r = post(url, "chat/completions", body)
            assert got == status and r["error"]["param"] == param and r["error"]["type"] == "invalid_request_error"
            assert set(r["error"]) == {"message", "type", "param", "code"}
        assert httpx.post(f"{url}/chat/completions", content=b"{not json", timeout=10, headers=AUTH).status_code == 400
        assert post(url.replace("/e/1/", "/e/9/"), "chat/completions", {"messages": msgs})[0] == 404
        assert post(url, "chat/completions", {"messages": msgs})[0] == 200
        assert post(url, "completions", {"prompt": "hi"})[0] == 200
        got, r = post(url, "chat/completions", {"messages": msgs})  # a third call: over max_calls (--max-turns)
        assert got == 400 and r["error"]["code"] == "turn_limit"
        ep.close_episode(1)
        got, r = post(url, "chat/completions", {"messages": msgs})
        assert got == 409 and r["error"]["code"] == "episode_ended"
        assert ep.late_calls == ["episode 1: POST /v1/chat/completions after its episode ended (refused)"]
    finally:
        ep.stop()


def test_concurrent_calls_are_sampled_in_one_batch(tiny):
    _, tok = tiny
    fake = FakeSampler(tok)
    ep = endpoint_for(tok, fake, window=0.2)
    try:
        urls = [ep.open_episode(b) for b in range(6)]
        threads = [threading.Thread(target=post, args=(u, "chat/completions",
                                                       {"messages": [{"role": "user", "content": f"q{b}"}]}))
                   for b, u in enumerate(urls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(ep.batches) == 6 and max(ep.batches) > 1  # 6 requests, not 6 sampler calls
        assert sorted(r for _, _, rows in fake.batches for r in rows) == list(range(6))
    finally:
        ep.stop()


def test_max_tokens_only_lowers_the_runs_cap_and_a_cut_is_length(tiny):
    _, tok = tiny
    fake = FakeSampler(tok, "abcdef")
    ep = endpoint_for(tok, fake, max_new_tokens=4)
    try:
        url = ep.open_episode(0)
        _, r = post(url, "chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100})
        assert len(r["choices"][0]["token_ids"]) == 4 and r["choices"][0]["finish_reason"] == "length"
        _, r = post(url, "completions", {"prompt": "x", "max_tokens": 2})
        assert r["choices"][0]["text"] == "ab" and r["choices"][0]["finish_reason"] == "length"
    finally:
        ep.stop()


# ------------------------------------------------------------------------------------------------
# episodes: the real sampler
# ------------------------------------------------------------------------------------------------

def episodes(tiny, agent, n=2, G=2, timeout=30.0, max_new_tokens=6):
    model, tok = tiny
    stop = (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
    params = sampling_params(tok, stop=stop, group_size=G, max_new_tokens=max_new_tokens)
    examples = [Example(prompt=f"{i}+1=", answer=str(i + 1), source=f"row {i}") for i in range(n)]
    spec = EpisodeSpec(agent, max_turns=4, timeout=timeout)
    return run_agent_episodes(PolicySampler(model), tok, examples, spec, params, Draws())


def test_an_agents_calls_are_recorded_token_for_token(tiny):
    model, tok = tiny
    seen = {}

    async def agent(client, example):
        msgs = [{"role": "user", "content": example.prompt}]
        r1 = await client.chat.completions.create(model="policy", messages=msgs, logprobs=True)
        msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
        r2 = await client.chat.completions.create(model="policy", messages=msgs, logprobs=True)
        key = str(client.base_url)
        seen[key] = [(r.prompt_token_ids, r.choices[0].token_ids, [c.logprob for c in r.choices[0].logprobs.content])
                     for r in (r1, r2)]
        return 1.0 if example.answer in r2.choices[0].message.content else 0.25

    ro, ep = episodes(tiny, agent)
    assert len(seen) == 4 and ep.failed.sum() == 0 and ep.agent.extra_sequences.sum() == 0
    for b in range(4):
        (p1, c1, l1), (p2, c2, l2) = _by_row(seen, b)
        prompt = ro.prompt_ids[b][ro.prompt_mask[b].bool()].tolist()
        assert prompt == p1
        n = int(ro.lengths[b])
        row = ro.completion_ids[b, :n].tolist()
        between = p2[len(p1) + len(c1):]
        assert row == c1 + between + c2  # the first call's tokens, what came back, the second call's
        model_cols = ro.completion_mask[b, :n].tolist()
        assert model_cols == [1.0] * len(c1) + [0.0] * len(between) + [1.0] * len(c2)
        assert ro.env_mask[b, :n].tolist() == [0.0] * len(c1) + [1.0] * len(between) + [0.0] * len(c2)
        assert ro.logp[b, :n][ro.completion_mask[b, :n].bool()].tolist() == pytest.approx(l1 + l2, abs=1e-6)
        # the recorded log-probs are the policy's: a teacher-forced forward over the row gives them back
        ids = torch.tensor([p1 + row])
        with torch.no_grad():
            logits = model(ids).logits.float().log_softmax(-1)[0, len(p1) - 1:-1]
        forward = logits.gather(-1, torch.tensor(row)[:, None])[:, 0]
        on = ro.completion_mask[b, :n].bool()
        assert forward[on].tolist() == pytest.approx(ro.logp[b, :n][on].tolist(), abs=1e-4)
    assert ep.turns.tolist() == [2, 2, 2, 2]


def _by_row(seen: dict, b: int):
    (key,) = [k for k in seen if k.rstrip("/").endswith(f"/e/{b}/v1")]
    return seen[key]


def test_faults_fail_their_episode_in_one_line_and_the_rest_train(tiny, capsys):
    late = {}

    async def agent(client, example):
        b = int(str(client.base_url).rstrip("/").split("/")[-2])
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
        if b == 0:
            raise ValueError("the tool server is down")
        if b == 1:
            await asyncio.sleep(5)  # over the 1 s deadline
        if b == 2:  # a call after its episode ended, from a thread the agent left behind
            url = str(client.base_url).rstrip("/")
            threading.Thread(target=lambda: late.update(r=post(url, "chat/completions",
                                                                {"messages": [{"role": "user", "content": "x"}]},
                                                                key=client.api_key)),
                             daemon=True).start()
            return [1.0, 2.0]  # two per-call rewards for one call
        await asyncio.sleep(0.5)  # episode 3 outlives 2's return, so the endpoint is up for the late call
        return 0.5 if r.choices else 0.0

    t0 = time.perf_counter()
    ro, ep = episodes(tiny, agent, timeout=1.0)
    assert time.perf_counter() - t0 < 15  # the sleeping agent was cut at its deadline
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if line.startswith("gspo: agent agent:")]
    assert any("episode 0 (row 0) raised ValueError: the tool server is down: failed, reward 0" in x for x in lines)
    assert any("episode 1 (row 0) ran over the episode deadline of 1 s (--episode-timeout): failed" in x
               for x in lines)
    assert any("episode 2 (row 1) returned 2 per-call rewards for 1 calls: failed" in x for x in lines)
    assert ep.failed.tolist() == [True, True, True, False]
    assert [r for r in ep.turn_rewards] == [[0.0], [0.0], [0.0], [0.5]]
    assert ro.completion_mask[:3].sum() == 0 and ro.completion_mask[3].sum() > 0  # failed: read, never trained
    assert late["r"][0] == 409 and late["r"][1]["error"]["code"] == "episode_ended"
    assert ep.agent.late_calls == 1


@pytest.mark.slow  # starts a process
def test_gspo_train_runs_an_agent_file_and_says_so(tmp_path):
    import subprocess

    agent = tmp_path / "my_agent.py"
    agent.write_text(
        "async def rollout(client, example):\n"
        "    r = await client.chat.completions.create(model='policy', messages=[{'role': 'user', "
        "'content': example.prompt}])\n"
        "    return float(example.answer in r.choices[0].message.content)\n")
    cmd = [sys.executable, "-m", "gspo", "train", "--model", "tiny-tool", "--task", "arithmetic", "--env",
           f"{agent}:rollout", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens",
           "6", "--eval-size", "0", "--no-progress", "--output-dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "agent rollout() over an OpenAI endpoint on 127.0.0.1 (up to 10 calls an episode, deadline 300 s)" \
        in p.stdout + p.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[-1]["agent/failed_frac"] == 0.0 and rows[-1]["episode/turns"] == 1.0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["plan"]["agent"] == {"timeout": 300.0} and summary["plan"]["env"] == "rollout"
    bad = subprocess.run(cmd[:-1] + [str(tmp_path / "run2"), "--rollout-workers", "1"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1] == (
        "gspo train: error: env rollout (an agent): --rollout-workers: not yet (the endpoint runs in the "
        "trainer's process)")
    assert not (tmp_path / "run2" / "metrics.jsonl").exists()


@pytest.mark.slow  # trains
def test_the_python_api_takes_the_function_itself(tmp_path):
    import gspo

    async def rollout(client, example):
        r = await client.completions.create(model="policy", prompt=example.prompt, max_tokens=4)
        return float(r.choices[0].text.strip() == str(example.answer))

    cfg = gspo.TrainConfig(model="tiny-tool", task="arithmetic", steps=1, prompts_per_step=2, group_size=2,
                           max_new_tokens=4, eval_size=0, progress=False, output_dir=str(tmp_path / "run"))
    summary = gspo.Trainer(cfg, env=rollout).train()
    assert summary["plan"]["agent"] == {"timeout": 300.0} and summary["plan"]["env"] == "rollout"
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["agent/failed_frac"] == 0.0 and row["episode/env_tokens"] == 0.0  # one completions call each


def test_an_agents_session_holds_its_episodes_and_concurrency_bounds_them(tiny):
    import contextlib

    from gspo.tasks.env import EnvError, episode_env

    log, live = [], {"now": 0, "most": 0}

    class Bounded:
        concurrency = 2  # of the 4 episodes, two at a time

        @classmethod
        @contextlib.asynccontextmanager
        async def session(cls, limits):
            log.append(("enter", limits.max_calls))
            yield
            log.append(("exit", live["now"]))

        async def rollout(self, client, example):
            live["now"] += 1
            live["most"] = max(live["most"], live["now"])
            log.append("episode")
            await asyncio.sleep(0.2)
            r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
            live["now"] -= 1
            return 1.0 if r.choices else 0.0

    ro, ep = episodes(tiny, Bounded)
    assert ep.failed.tolist() == [False] * 4
    # the session opened before any episode (with the run's --max-turns, 4) and closed after all of them
    assert log[0] == ("enter", 4) and log[1:-1] == ["episode"] * 4 and log[-1] == ("exit", 0)
    assert live["most"] == 2
    Bounded.concurrency = 0
    with pytest.raises(EnvError, match=r"env Bounded: concurrency must be an int >= 1 \(got 0\)"):
        episode_env(Bounded, None, None, tiny[1])


EDITING_AGENT = '''
async def rollout(client, example):
    """Three calls; the second drops the first answer (an edited history), the third extends the second."""
    j = int(str(client.base_url).rstrip("/").split("/")[-2]) % 2  # the episode's place in its group
    r1 = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.prompt}])
    again = [{"role": "user", "content": "again: " + example.prompt}]
    r2 = await client.chat.completions.create(model="policy", messages=again)
    again += [r2.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    r3 = await client.chat.completions.create(model="policy", messages=again)
    return [0.0, float(j), 0.0]  # per call: the episode's reward is j
'''


@pytest.mark.slow  # trains
@pytest.mark.parametrize("algorithm,turn_advantages", [("gspo", False), ("grpo", True), ("ppo", False)])
def test_an_edited_history_is_a_row_of_its_own_trained_with_its_episodes_advantage(tmp_path, algorithm,
                                                                                      turn_advantages):
    from gspo.config import TrainConfig
    from gspo.sampling.produce import rollout, score
    from gspo.tasks.scoring import Scored
    from gspo.train.batch import prepare
    from gspo.train.run import build_run
    from gspo.train.steplog import step_row
    from gspo.train.trainer import step_generator, update

    (tmp_path / "editing_agent.py").write_text(EDITING_AGENT)
    cfg = TrainConfig(model="tiny-tool", task="arithmetic", env=f"{tmp_path / 'editing_agent.py'}:rollout",
                      algorithm=algorithm, turn_advantages=turn_advantages, prompts_per_step=2, group_size=2,
                      max_new_tokens=6, num_minibatches=2, output_dir=str(tmp_path / "run"), progress=False)
    run = build_run(cfg)
    examples = run.task.train_batch(1, 2, 0)
    ro, texts, ids, ep = rollout(run, examples, 1)
    assert ep.agent.extra_sequences.tolist() == [1, 1, 1, 1] and ep.turns.tolist() == [3, 3, 3, 3]
    rewards, parts = score(run.rewards, examples, texts, ids, 2, ep)
    assert rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    batch = prepare(run, ro, Scored(rewards=rewards, parts=parts, examples=examples, completions=texts, episodes=ep))
    b = batch.rollout
    assert b.prompt_ids.shape[0] == 8 and batch.episode_of.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    for e in range(4):  # the episode's row: its first call; its later one: the second call, a user turn, the third
        assert b.env_mask[e].sum() == 0 and b.completion_mask[e].sum() > 0
        model_cols, env_cols = b.completion_mask[4 + e], b.env_mask[4 + e]
        assert env_cols.sum() > 0 and model_cols.sum() > 0 and (model_cols * env_cols).sum() == 0
        on = model_cols.bool()
        assert (b.logp[4 + e][on] < 0).all() and (b.logp[4 + e][~on] == 0).all()  # the recorded log-probs
    turn = ep.more_turn_index  # (4, T): the extra rows' calls are the episode's second and third (1 and 2)
    assert set(turn[b.completion_mask[4:].bool()].tolist()) == {1, 2}
    adv = batch.advantages
    # the group's episode rewards (0, 1): mean 0.5, sample std 0.7071, so (j - 0.5) / 0.7071 = -/+ 0.7071
    if algorithm == "gspo":
        assert adv.tolist() == pytest.approx([-0.7071, 0.7071] * 4, abs=1e-3)  # rows 4..7: their episode's
    elif turn_advantages:  # rewards to go per call (0 + j + 0, j + 0, 0) less the group's 0.5, over 0.7071
        want = {(j, k): ((j if k < 2 else 0) - 0.5) / 0.7071 for j in (0, 1) for k in (0, 1, 2)}
        for r in range(8):
            e, on = r % 4, b.completion_mask[r].bool()
            calls = ep.turn_index[e] if r < 4 else turn[e]
            got = {int(k): float(a) for k, a in zip(calls[on], adv[r][on])}
            assert got == pytest.approx({k: want[(e % 2, k)] for k in got}, abs=1e-3)
        assert set(got) == {1, 2}  # the later sequence holds calls 1 (+0.7071 for j = 1) and 2 (-0.7071)
    else:  # PPO: GAE over each row's own values, with its episode's reward at its end
        assert adv.shape == b.completion_mask.shape and (adv[4:] * b.completion_mask[4:]).abs().sum() > 0
    history = update(run, batch, step_generator(0, 1, "minibatches"))  # 8 rows in 2 minibatches of 4
    assert len(history) == 2 and all(math.isfinite(h["policy/entropy"]) and h["grad_norm"] > 0 for h in history)
    row = step_row(run, 1, batch, history)
    tokens = [float(b.completion_mask[e].sum() + b.completion_mask[4 + e].sum()) for e in range(4)]
    assert row["agent/extra_sequences"] == 1.0 and row["episode/model_tokens"] == pytest.approx(sum(tokens) / 4)
    assert row["completion/mean_length"] == pytest.approx(float(b.lengths[:4].float().mean()))


def test_a_sampler_that_fails_stops_the_step_in_one_line_without_waiting_out_the_deadline(tiny):
    # the engine's fault, not the agents': an agent that retries a failing endpoint (as verifiers'
    # harness does) once waited out its 300 s deadline, and the step trained on failed episodes
    from gspo.tasks.env import EnvError

    _, tok = tiny

    class Broken:
        def sample(self, *args, **kwargs):
            raise RuntimeError("Check failed: thread_num\n(2 vs. 1)")

    async def agent(client, example):
        while True:
            try:
                await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
            except Exception:
                await asyncio.sleep(0.05)

    stop = (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
    params = sampling_params(tok, stop=stop, group_size=2, max_new_tokens=4)
    examples = [Example(prompt="1+1=", answer="2")]
    t0 = time.perf_counter()
    with pytest.raises(EnvError) as e:
        run_agent_episodes(Broken(), tok, examples, EpisodeSpec(agent, max_turns=4, timeout=60.0), params, Draws())
    assert time.perf_counter() - t0 < 10
    assert str(e.value) == ("agent agent: the sampler behind the endpoint failed: RuntimeError: Check failed: "
                            "thread_num (2 vs. 1)")


def _counting(sample, seen: list):
    """`sample`, appending each call's number of prompts to `seen`."""
    return lambda prompts, *a, **kw: seen.append(len(prompts)) or sample(prompts, *a, **kw)


@pytest.mark.slow  # waits for its batch windows
def test_what_a_call_samples_depends_on_its_episode_and_call_not_on_its_batch(tiny):
    # call k of episode b draws turn k's uniforms at row b (as run_episodes draws turn k): the same
    # tokens whether the episodes' calls were batched together or one by one (an agent that waits)
    model, tok = tiny

    def agent_waiting(pause):
        async def agent(client, example):
            b = int(str(client.base_url).rstrip("/").split("/")[-2])
            msgs = [{"role": "user", "content": example.prompt}]
            for _ in range(2):
                await asyncio.sleep(pause * b)  # pause > 0: each episode's call comes alone
                r = await client.chat.completions.create(model="policy", messages=msgs)
                msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
            return 0.0
        return agent

    stop = (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
    params = sampling_params(tok, stop=stop, group_size=4, max_new_tokens=8)
    examples = [Example(prompt="3+4=", answer="7")]
    draws = Draws(generator_for=lambda k: torch.Generator().manual_seed(100 + k))
    runs = []
    for pause in (0.0, 0.3):
        sampler, seen = PolicySampler(model), []
        sampler.sample = _counting(sampler.sample, seen)
        torch.manual_seed(pause * 1000)  # the global generator differs between the two runs
        ro, _ = run_agent_episodes(sampler, tok, examples, EpisodeSpec(agent_waiting(pause), max_turns=4, timeout=60.0),
                                   params, draws)
        runs.append((ro, seen))
    (a, batched), (b, alone) = runs
    assert max(batched) == 4 and max(alone) == 1  # 2 batches of 4 calls, then 8 calls of 1
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    assert len({tuple(r[:3].tolist()) for r in a.completion_ids}) > 1  # the four episodes sampled differently


@pytest.mark.slow  # starts a process
def test_an_agent_run_with_staleness_and_a_correction_resumes_to_the_uninterrupted_run(tmp_path):
    # item 6 of the agents issue: checkpoints, the in-process asynchronous pipeline (--max-staleness)
    # and a mismatch correction (--rollout-is) with agent rollouts. The checkpoint at step 1 holds the
    # batch sampled ahead (agent episodes, extra rows and all); a resume from it ends where the
    # uninterrupted run did, metric for metric and weight for weight
    from tests.test_async import _truncated_copy, gspo, same, same_weights
    from tests.test_distributed import metrics, weights

    (tmp_path / "editing_agent.py").write_text(EDITING_AGENT)  # rewards 0 and 1 in each group; an edited history
    run = tmp_path / "a"
    r = gspo("--model", "tiny-tool", "--task", "arithmetic", "--env", f"{tmp_path / 'editing_agent.py'}:rollout",
             "--steps", "3", "--save-every", "1", "--max-staleness", "1", "--rollout-is", "token",
             "--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "0",
             "--no-progress", "--seed", "5", "--output-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "agent rollout() over an OpenAI endpoint" in r.stdout
    cut = _truncated_copy(run, tmp_path / "b", 1)
    r = gspo("--resume", str(cut))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = metrics(run), metrics(cut)
    assert [x["step"] for x in b] == [1, 2, 3] and [x["async/staleness_max"] for x in a] == [0, 1, 1]
    assert all(x["agent/extra_sequences"] == 1.0 and x["grad_norm"] > 0 and "is/weight_mean" in x for x in a)
    same(a, b, ignore=("async/trainer_idle_seconds", "async/sample_seconds", "async/worker_idle_seconds",
                       "async/overlap", "async/weight_sync_seconds", "async/ready_batches"))
    same_weights(weights(run), weights(cut))
