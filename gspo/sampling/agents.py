"""Agent code as its author writes it: a rollout function that talks to the policy through an OpenAI client.

    async def rollout(client, example) -> float:           # my_agent.py
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.prompt}])
        ...                                                # more calls, tools, anything
        return 1.0 if answer_ok else 0.0

    gspo train --env my_agent.py:rollout --dataset rows.jsonl

An agent is an `async def` function `(client, example) -> reward`, or a class whose instances
(one per episode, made with no arguments) have such an `async def rollout(self, client,
example)`. `client` is an `openai.AsyncOpenAI` pointed at the endpoint over the policy
(gspo.sampling.endpoint; its requests reach the endpoint in process, through an httpx
transport, while the loopback URL serves any other client), `example` the episode's dataset
row (gspo.tasks.data.Example: `.prompt`, `.answer`, `.columns` the row's other fields). gspo
runs it for each of the group's episodes, all concurrently in one event loop, while the
endpoint batches their calls.

The reward: a number (the episode's), or a list with one number per call (per-call rewards,
summed for the episode; with --turn-advantages each call's tokens get the reward from that
call on). The task's or --reward's rewards, if any, are added, scoring the last call's text.

Recorded token for token: the row of an episode is its first call's prompt, then each call's
sampled tokens (trained) and, between them, the tokens of what came back (tool results, user
turns: read, never trained). Calls whose messages extend the previous call (gspo.sampling.endpoint)
form that one sequence. A call with another history (the agent edited or dropped earlier
messages) starts a new sequence: the episode's row is its first sequence, and each later one is
a row of its own after the batch's episodes (`AgentStats.extra`), trained with its episode's
advantage (gspo.train.batch.prepare appends them; `agent/extra_sequences` counts them per episode).

Randomness: an episode's call k draws turn k's uniforms of the step at the episode's row, as
run_episodes draws turn k (`_Sampling`): the endpoint's batching, which depends on when calls
arrive, does not change what a call samples.

Faults never hang a step. An agent that raises, returns something that is not a reward, or
outlives the episode deadline (--episode-timeout seconds) fails its episode: one line on stderr
naming the episode and the cause, reward 0, its tokens left out of the update (`agent/failed_frac`).
A call after an episode ended gets an OpenAI-shaped 409 error and a line (`agent/late_calls`).
The sampler failing behind the endpoint is the run's fault: the episodes still running are
cancelled and the step stops with one line (EnvError).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gspo.config.checks import one_line
from gspo.models.sequences import Rollout, left_pad
from gspo.sampling.endpoint import Call, Endpoint, Limits, in_process
from gspo.sampling.episodes import Episodes, lay_out, run_episodes
from gspo.tasks.env import EnvError, is_agent

MODEL_NAME = "policy"


def agent_name(agent) -> str:
    return getattr(agent, "__name__", None) or repr(agent)


@dataclass
class AgentStats:
    """Per episode (B,): failed, and its sequences beyond the first; late calls in all; the later
    sequences of the episodes that did not fail, laid out as E rows of the episodes' width
    (`extra`, None: none), the episode of each (E,) and the call each column belongs to (E, T)."""

    failed: torch.Tensor
    extra_sequences: torch.Tensor
    late_calls: int = 0
    extra: Rollout | None = None
    extra_of: torch.Tensor | None = None
    extra_turn_index: torch.Tensor | None = None


@dataclass
class AgentResult:
    """One episode: its calls, its reward(s), and why it failed (None: it did not)."""

    calls: list[Call]
    rewards: list[float]
    failure: str | None = None


@dataclass
class Hooks:
    """What run_agents tells its caller and asks it: `ended(i)` as soon as episode i's agent
    returned, failed or ran out of time; `transport` the clients' httpx transport
    (gspo.sampling.endpoint.in_process; None: over the socket); `broken()` an exception that ends
    every episode still running (the sampler behind the endpoint failed), else None."""

    ended: Callable[[int], object] = lambda i: None
    transport: object = None
    broken: Callable[[], BaseException | None] = lambda: None


def run_agents(agent, examples: list, urls: list[str], limits: Limits,
               hooks: Hooks | None = None) -> list[tuple[list[float], str | None]]:
    """Each episode's agent run to its end in one event loop, within `limits.episode_timeout`
    seconds (0: none): (rewards, failure) per episode (`hooks`: Hooks). An agent with a
    `session(limits)` (an async context manager) holds it around the rollout's episodes; one with
    a `concurrency` (an int) runs that many episodes at a time."""
    timeout, hooks = limits.episode_timeout, hooks or Hooks()
    try:
        import openai
    except ImportError:
        raise EnvError(f"agent {agent_name(agent)}: needs the openai package (pip install 'gspo[agents]')") from None

    async def one(i, example, url, http, gate):
        async with gate:  # the agent's `concurrency`: its episodes past that many wait their turn, deadline unstarted
            return await run_one(i, example, url, http)

    async def run_one(i, example, url, http):
        client = openai.AsyncOpenAI(base_url=url, api_key="gspo", max_retries=0, timeout=timeout or None,
                                    http_client=http)
        try:
            fn = agent().rollout if isinstance(agent, type) else agent
            coro = fn(client, example)
            out = await (asyncio.wait_for(coro, timeout) if timeout else coro)
            return _rewards(out), None
        except asyncio.TimeoutError:
            return [0.0], f"ran over the episode deadline of {timeout:g} s (--episode-timeout)"
        except Exception as e:
            return [0.0], f"raised {type(e).__name__}: {e}"
        finally:
            hooks.ended(i)  # a call from now on is late

    async def every():
        # one HTTP client for every episode: making one each (its TLS context) took 50 ms an episode
        kw = {"transport": hooks.transport} if hooks.transport is not None else {}
        session = getattr(agent, "session", None)
        async with (session(limits) if session is not None else contextlib.nullcontext()), \
                openai.DefaultAsyncHttpxClient(timeout=timeout or None, **kw) as http:
            gate = asyncio.Semaphore(getattr(agent, "concurrency", None) or max(1, len(urls)))
            tasks = [asyncio.ensure_future(one(i, ex, url, http, gate))
                     for i, (ex, url) in enumerate(zip(examples, urls))]
            return await _unless_broken(tasks, hooks.broken)

    try:
        return asyncio.run(every())
    except Exception as e:  # the episodes' own faults are caught in one(): this is the session's or the client's
        raise EnvError(f"agent {agent_name(agent)}: {type(e).__name__}: {e}") from e


async def _unless_broken(tasks: list, broken) -> list:
    """The tasks' results once all are done; if `broken()` says so first, the ones still running
    are cancelled and fail (an agent whose harness retries a failing endpoint would otherwise
    wait out its deadline)."""
    pending = tasks
    while pending:
        _, pending = await asyncio.wait(pending, timeout=0.1)
        if pending and broken() is not None:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            break
    return [t.result() if not t.cancelled() else ([0.0], "cancelled: the sampler failed") for t in tasks]


def httpx_of_openai():
    """The httpx module the installed openai client is built on (`httpx2` from openai 3, else `httpx`)."""
    import openai

    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    return sys.modules[base.__module__.split(".")[0]]


def _rewards(out) -> list[float]:
    """The agent's return value as rewards (module docstring); ValueError otherwise."""
    values = out if isinstance(out, (list, tuple)) else [out]
    if not values or not all(isinstance(v, (int, float)) for v in values):
        raise ValueError(f"returned {out!r}; expected a reward (a number) or a list of one per call")
    rewards = [float(v) for v in values]
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"returned {out!r}; a reward must be finite")
    return rewards


def play(sampler, tokenizer, examples: list, spec, params, draws) -> tuple[Rollout, Episodes]:
    """The episodes of `spec.env`: an agent's (run_agent_episodes), else an environment's
    (gspo.sampling.episodes.run_episodes)."""
    if is_agent(spec.env):
        return run_agent_episodes(sampler, tokenizer, examples, spec, params, draws)
    return run_episodes(sampler, tokenizer, examples, spec, params, draws)


def run_agent_episodes(sampler, tokenizer, examples: list, spec, params, draws) -> tuple[Rollout, object]:
    """`params.group_size` episodes per example of the agent `spec.env` (module docstring), as
    run_episodes lays multi-turn episodes out: (Rollout, Episodes)."""
    G, agent = params.group_size, spec.env
    B = len(examples) * G
    offset, total = draws.rows or (0, B)

    sample = _Sampling(sampler, params, draws, (offset, total))
    limits = Limits(params.max_new_tokens, params.stop_token_ids, spec.max_turns, spec.max_tokens,
                    episode_timeout=spec.timeout)
    endpoint = Endpoint(sample, tokenizer, MODEL_NAME, limits).start()
    try:
        urls = [endpoint.open_episode(b) for b in range(B)]
        calls = {}
        hooks = Hooks(ended=lambda b: calls.setdefault(b, endpoint.close_episode(b)),
                      transport=in_process(endpoint, httpx_of_openai()), broken=sample.failure)
        outcomes = run_agents(agent, [examples[b // G] for b in range(B)], urls, limits, hooks)
        if (e := sample.failure()) is not None:  # the engine's fault, not the agents': nothing trains on it
            raise EnvError(f"agent {agent_name(agent)}: the sampler behind the endpoint failed: "
                           f"{type(e).__name__}: {one_line(e)}")
        results = [AgentResult(calls[b], *outcomes[b]) for b in range(B)]
    finally:
        endpoint.stop()
    name = agent_name(agent)
    for b, r in enumerate(results):
        if r.failure is None and not r.calls:
            r.failure = "made no call to the endpoint"
        if r.failure is None and len(r.rewards) > 1 and len(r.rewards) != len(r.calls):
            r.failure = f"returned {len(r.rewards)} per-call rewards for {len(r.calls)} calls"
        if r.failure is not None:
            src = examples[b // G].source or f"row {offset + b}"
            print(f"gspo: agent {name}: episode {offset + b} ({src}) {r.failure}: failed, reward 0", file=sys.stderr)
            r.rewards = [0.0]
    for line in endpoint.late_calls:
        print(f"gspo: agent {name}: {line}", file=sys.stderr)
    return assemble(results, tokenizer, G, len(endpoint.late_calls))


class _Sampling:
    """The endpoint's `sample(prompts, max_tokens, rows)` over a run's sampler, on the endpoint's
    thread: with the run's torch thread count (a new thread has OpenMP's default, and vLLM's CPU
    attention refuses a count other than the one its metadata was built with); each episode's
    call k drawn from turn k's generator at the episode's row (`draws`, as run_episodes draws turn
    k), so what a call samples depends on the step, the episode and the call, not on which other
    calls were batched with it; the first exception kept (`failure()`), then raised to the callers."""

    def __init__(self, sampler, params, draws, rows: tuple[int, int]):
        self.sampler, self.params, self.draws, (self.offset, self.total) = sampler, params, draws, rows
        self.threads, self.calls, self.failed = torch.get_num_threads(), {}, []

    def failure(self) -> BaseException | None:
        return self.failed[0] if self.failed else None

    def __call__(self, prompts: list, max_tokens: int, rows: list[int]) -> list:
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        ks = []
        for r in rows:  # the episodes' call numbers
            ks.append(self.calls.get(r, 0))
            self.calls[r] = ks[-1] + 1
        params = dataclasses.replace(self.params, group_size=1, max_new_tokens=max_tokens)
        out = [None] * len(prompts)
        try:
            for k in sorted(set(ks)):  # one sampler call per call number (one in all when the episodes go in step)
                idx = [j for j, kj in enumerate(ks) if kj == k]
                ro = self.sampler.sample([prompts[j] for j in idx], params, generator=self.draws.generator_for(k),
                                         rows=(torch.tensor([self.offset + rows[j] for j in idx]), self.total))
                for i, j in enumerate(idx):
                    n = int(ro.lengths[i])
                    out[j] = (ro.completion_ids[i, :n].tolist(), ro.logp[i, :n].tolist(), bool(ro.truncated[i]))
        except Exception as e:  # the callers get a 500; run_agent_episodes stops the step
            self.failed.append(e)
            raise
        return out


def sequences(calls: list[Call]) -> list[tuple[int, list[Call]]]:
    """The episode's calls as sequences, (index of its first call, its calls) each: a call that
    extends the previous one joins its sequence, any other starts a new one."""
    out = []
    for k, call in enumerate(calls):
        if k == 0 or not call.extends:
            out.append((k, []))
        out[-1][1].append(call)
    return out


def _segments(calls: list[Call], train: bool, first: int = 0) -> list:
    """(ids, log-probs or None, call index) after the first prompt: each call's sampled tokens and
    the tokens between (what came back, never trained); `train` False: all of them untrained.
    `first`: the episode's index of the sequence's first call."""
    out, before = [], len(calls[0].prompt_ids)
    for k, call in enumerate(calls):
        if k:
            out.append((call.prompt_ids[before:], None, first + k - 1))
        out.append((call.completion_ids, call.logprobs if train else None, first + k))
        before = len(call.prompt_ids) + len(call.completion_ids)
    return out


def assemble(results: list[AgentResult], tokenizer, G: int, late: int) -> tuple[Rollout, Episodes]:
    """The episodes laid out as run_episodes lays them (a failed one's tokens untrained), each
    one's first sequence its row; the later sequences of those that did not fail laid out with
    them, after them, and kept in the episodes' AgentStats.extra."""
    pad, B = tokenizer.pad_token_id, len(results)
    split = [sequences(r.calls) for r in results]
    seqs = [s[0][1] if s else [] for s in split]
    later = [(b, k, calls) for b, (s, r) in enumerate(zip(split, results)) if r.failure is None for k, calls in s[1:]]
    segs = [_segments(s, r.failure is None) if s else [] for s, r in zip(seqs, results)]
    segs += [_segments(calls, True, k) for _, k, calls in later]
    ids, model, env, logp, turn_index = lay_out(segs, pad)
    prompt_ids, prompt_mask = left_pad([s[0].prompt_ids if s else [pad] for s in seqs]
                                       + [calls[0].prompt_ids for _, _, calls in later], pad, torch.device("cpu"))
    if any(not s for s in seqs):  # an episode without a call: an empty prompt, one masked pad
        prompt_mask[[b for b, s in enumerate(seqs) if not s]] = 0
    lengths = torch.tensor([sum(len(i) for i, _, _ in row) for row in segs])
    last = [s[-1] if s else None for s in seqs] + [calls[-1] for _, _, calls in later]
    truncated = torch.tensor([bool(c is not None and c.truncated) for c in last])
    every = Rollout(prompt_ids, prompt_mask, ids, model, logp, lengths, truncated, G, None, env)
    ro, extra = every.map(lambda t: t[:B]), (every.map(lambda t: t[B:]) if later else None)
    finals = [c.completion_ids if c is not None else [] for c in last[:B]]
    tool_calls = [sum(len((c.reply or {}).get("tool_calls") or []) for c in r.calls) for r in results]
    ep = Episodes(final_texts=tokenizer.batch_decode(finals, skip_special_tokens=True), final_ids=finals,
                  transcripts=[tokenizer.decode([t for i, _, _ in row for t in i]) for row in segs[:B]],
                  turn_index=turn_index[:B], turn_rewards=[r.rewards for r in results],
                  turns=torch.tensor([len(r.calls) for r in results]), tool_calls=torch.tensor(tool_calls),
                  tool_errors=torch.zeros(B, dtype=torch.long), turn_limit=torch.zeros(B, dtype=torch.bool),
                  agent=AgentStats(failed=torch.tensor([r.failure is not None for r in results]),
                                   extra_sequences=torch.tensor([max(len(s) - 1, 0) for s in split]), late_calls=late,
                                   extra=extra, extra_of=torch.tensor([b for b, _, _ in later]) if later else None,
                                   extra_turn_index=turn_index[B:] if later else None))
    return ro, ep


def with_extra_sequences(ro: Rollout, episodes: Episodes | None) -> tuple[Rollout, torch.Tensor | None]:
    """`ro` (B episodes) with the agents' later sequences (AgentStats.extra, E rows) appended, on
    its device, and the episode of each of the B + E rows; (ro, None) when there are none."""
    stats = episodes.agent if episodes is not None else None
    if stats is None or stats.extra is None:
        return ro, None
    B, dev = ro.prompt_ids.shape[0], ro.prompt_ids.device
    extra = stats.extra.map(lambda t: t.to(dev))
    both = {f.name: torch.cat([getattr(ro, f.name), getattr(extra, f.name)]) for f in dataclasses.fields(Rollout)
            if isinstance(getattr(ro, f.name), torch.Tensor)}
    return dataclasses.replace(ro, **both), torch.cat([torch.arange(B), stats.extra_of])
