"""Agent code as its author writes it: a rollout function that talks to the policy through an OpenAI client.

    async def rollout(client, example) -> float:           # my_agent.py
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.prompt}])
        ...                                                # more calls, tools, anything
        return 1.0 if answer_ok else 0.0

    gspo train --env my_agent.py:rollout --dataset rows.jsonl

An agent is an `async def` function `(client, example) -> reward`, or a class whose instances
(one per episode, made with no arguments) have such an `async def rollout(self, client,
example)`. `client` is an `openai.AsyncOpenAI` pointed at the endpoint over the policy
(gspo.agents.endpoint; its requests reach the endpoint in process, through an httpx
transport, while the loopback URL serves any other client), with the endpoint's secret as its
API key; `example` the episode's dataset row (gspo.tasks.data.Example: `.prompt`, `.answer`,
`.columns` the row's other fields). gspo runs it for each of the group's episodes, all at once,
each on an event loop of its own (run_agents), while the endpoint batches their calls.

The reward: a number (the episode's), or a list with one number per call (per-call rewards,
summed for the episode; with --turn-advantages each call's tokens get the reward from that
call on). The task's or --reward's rewards, if any, are added, scoring the text of the
episode's last call (gspo.sampling.produce.score_episodes; never a failed episode's).

Recorded token for token, in any call graph: the endpoint puts each call in a sequence
(gspo.agents.endpoint, Call graphs), and each sequence is a row: its first call's prompt, then
each call's sampled tokens (trained) and, between them, the tokens of what came back (tool
results, user turns: read, never trained). The episode's row is its first sequence; each later
one (concurrent or forked calls, sub-agents, an edited history) is a row of its own after the
batch's episodes (the Episodes' `more`), trained with its episode's advantage
(gspo.train.batch.prepare appends them; `agent/extra_sequences` counts them per episode).

Randomness: an episode's call k draws turn k's uniforms of the step at the episode's row, as
run_episodes draws turn k (`_Sampling`): the endpoint's batching, which depends on when calls
arrive, does not change what a call samples.

Faults never hang a step. An agent that raises, returns something that is not a reward,
outlives the episode deadline (--episode-timeout seconds) or blocks its event loop past it
fails its episode: one line on stderr naming the episode and the cause, reward 0, its tokens
left out of the update and the episode out of its group's baseline (`agent/failed_frac`). A
call after an episode ended gets an OpenAI-shaped 409 error and a line (`agent/late_calls`); a
request without the run's key a 401 (`agent/refused_requests`). The sampler failing behind the
endpoint is the run's fault: the episodes still running are cancelled and the step stops with
one line (EnvError).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import math
import numbers
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gspo.agents.endpoint import Call, Endpoint, Limits, in_process
from gspo.config.checks import one_line
from gspo.io.words import plural
from gspo.models.loading import unwrap
from gspo.models.sequences import Rollout, left_pad
from gspo.sampling.episodes import Episodes, lay_out, run_episodes
from gspo.tasks.env import EnvError, is_agent

MODEL_NAME = "policy"


def agent_name(agent) -> str:
    return getattr(agent, "__name__", None) or repr(agent)


@dataclass
class AgentStats:
    """What only agents count (gspo.train.steplog's agent/* metrics): per episode (B,), its
    sequences beyond the first; late calls and requests refused (no key) in all, episodes left
    behind still running. Which episodes failed, and the later sequences themselves, are the
    Episodes' (`failed`, `more`)."""

    extra_sequences: torch.Tensor
    late_calls: int = 0
    refused: int = 0
    left_behind: int = 0  # episodes cut at their deadline (now or earlier) still running in the background


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
    (gspo.agents.endpoint.in_process; None: over the socket); `broken()` an exception that ends
    every episode still running (the sampler behind the endpoint failed), else None; `key` the
    endpoint's secret, the clients' API key."""

    ended: Callable[[int], object] = lambda i: None
    transport: object = None
    broken: Callable[[], BaseException | None] = lambda: None
    key: str = "gspo"


GRACE = 0.5  # seconds past the deadline before an episode whose event loop does not answer is left behind


def run_agents(agent, examples: list, urls: list[str], limits: Limits,
               hooks: Hooks | None = None) -> list[tuple[list[float], str | None]]:
    """Each episode's agent run to its end within `limits.episode_timeout` seconds (0: none):
    (rewards, failure) per episode (`hooks`: Hooks).

    Where they run. Each episode runs on an event loop of its own, in a thread of its own (a
    pool kept for the process), so an agent that blocks its loop (time.sleep, a synchronous
    client, CPU-bound work) holds up only itself. An agent with a `session(limits)` (an async
    context manager) holds it around the rollout's episodes, all of which then run on the
    session's loop (what the session makes, locks and clients, belongs to it), one loop per agent
    kept for the run. One with a `concurrency` (an int) runs that many episodes at a time.

    Deadlines. The episode's coroutine is cancelled at the deadline; one whose loop is blocked
    past the deadline plus GRACE seconds fails then, and is left to finish in the background (its
    calls from then on are refused, 409), its thread out of the pool until it does."""
    timeout, hooks = limits.episode_timeout, hooks or Hooks()
    try:
        import openai
    except ImportError:
        raise EnvError(f"agent {agent_name(agent)}: needs the openai package (pip install 'gspo[agents]')") from None
    session = getattr(agent, "session", None)
    home = _home_loop(agent) if session is not None else None

    async def episode(i):
        kw = {"transport": hooks.transport} if hooks.transport is not None else {}
        async with openai.DefaultAsyncHttpxClient(timeout=timeout or None, **kw) as http:
            client = openai.AsyncOpenAI(base_url=urls[i], api_key=hooks.key, max_retries=0,
                                        timeout=timeout or None, http_client=http)
            try:
                fn = agent().rollout if isinstance(agent, type) else agent
                coro = _contained(fn(client, examples[i]))
                out = await (asyncio.wait_for(coro, timeout) if timeout else coro)
                return _rewards(out), None
            except asyncio.TimeoutError:
                return [0.0], f"ran over the episode deadline of {timeout:g} s (--episode-timeout)"
            except asyncio.CancelledError:  # its deadline, or the run's: the supervisor has said why
                raise
            except AgentExit as e:
                return [0.0], f"raised {e}"
            except BaseException as e:  # SystemExit, KeyboardInterrupt from agent code too: its loop must live on
                return [0.0], f"raised {_said(e)}"
            finally:
                if home is None:
                    await _cancel_left_behind()

    def start(i) -> tuple[concurrent.futures.Future, _Loop]:
        loop = home or _LOOPS.take()
        return loop.submit(episode(i) if home is not None else _released(episode(i), loop)), loop

    width = getattr(agent, "concurrency", None) or max(1, len(urls))
    if not (type(width) is int and width >= 1):
        raise EnvError(f"agent {agent_name(agent)}: concurrency must be an int >= 1 (got {width!r})")
    try:
        with _held(session, limits, home):
            return _supervise(start, len(urls), width, timeout, hooks, home)
    except EnvError:
        raise
    except Exception as e:  # the episodes' own faults are caught in episode(): this is the session's
        raise EnvError(f"agent {agent_name(agent)}: {type(e).__name__}: {one_line(e)}") from e


def _supervise(start, n: int, width: int, timeout: float, hooks: Hooks, home) -> list:
    """Episodes 0..n-1 started (`start(i)`: a concurrent Future and its _Loop) at most `width`
    at a time, each waited for until its deadline plus GRACE; (rewards, failure) of each."""
    out: list = [None] * n
    running: dict[int, tuple[concurrent.futures.Future, _Loop, float]] = {}
    nxt = 0
    while nxt < n or running:
        while nxt < n and len(running) < width:
            running[nxt] = (*start(nxt), time.monotonic() + timeout + GRACE if timeout else math.inf)
            nxt += 1
        soonest = min(deadline for _, _, deadline in running.values())
        concurrent.futures.wait([f for f, _, _ in running.values()], return_when=concurrent.futures.FIRST_COMPLETED,
                                timeout=max(0.0, min(0.1, soonest - time.monotonic())))
        broken, now = hooks.broken(), time.monotonic()
        late = [loop for fut, loop, deadline in running.values() if not fut.done() and now > deadline]
        blocked = _blocked(late) if late and broken is None else set()
        for i, (fut, loop, deadline) in list(running.items()):
            if fut.done():
                out[i] = fut.result() if not fut.cancelled() else ([0.0], "cancelled")
            elif broken is not None:
                fut.cancel()
                out[i] = [0.0], "cancelled: the sampler failed"
            elif now > deadline:
                out[i] = [0.0], _overdue(fut, loop in blocked, timeout, home is not None)
                loop.stuck = loop.stuck or loop in blocked
                if home is None:
                    _LOOPS.left_behind(loop)
            else:
                continue
            del running[i]
            hooks.ended(i)  # a call from now on is late
        if broken is not None:
            for i in range(nxt, n):
                out[i] = [0.0], "cancelled: the sampler failed"
                hooks.ended(i)
            break
    return out


def _blocked(loops: list, within: float = 0.05) -> set:
    """Of `loops` (_Loop), those that do not run a callback within `within` seconds: something blocks them."""
    ran = {}
    for loop in loops:
        ran[loop] = threading.Event()
        loop.loop.call_soon_threadsafe(ran[loop].set)
    end = time.monotonic() + within
    for event in ran.values():
        event.wait(max(0.0, end - time.monotonic()))
    return {loop for loop, event in ran.items() if not event.is_set()}


def _overdue(fut: concurrent.futures.Future, blocked: bool, timeout: float, shared: bool) -> str:
    """Why an episode is still running past its deadline and GRACE (cancelled at its deadline):
    its event loop is `blocked` (`shared`: the session's, every episode's of the agent), or the
    agent swallowed the cancellation. Cancelled again; it is left to finish in the background."""
    fut.cancel()  # lands when (if) its loop runs again
    if blocked and shared:
        return (f"ran past the episode deadline of {timeout:g} s (--episode-timeout) while the agent's event loop, "
                "which its session and every episode share, was blocked (by this episode or another: a synchronous "
                "call in async code); left to finish in the background")
    if not blocked:
        return (f"did not stop when cancelled at the episode deadline of {timeout:g} s (--episode-timeout): it "
                "caught asyncio.CancelledError and went on; left to finish in the background")
    return (f"blocked its event loop past the episode deadline of {timeout:g} s (--episode-timeout): a "
            "synchronous call in async code (time.sleep, a blocking client, CPU-bound work); left to finish in the "
            "background")


class AgentExit(Exception):
    """SystemExit or KeyboardInterrupt raised by agent code, as an ordinary exception: asyncio lets
    those two out of the event loop, which would end the loop's thread."""


async def _contained(coro):
    """`coro`, its SystemExit or KeyboardInterrupt raised as AgentExit."""
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as e:
        raise AgentExit(_said(e)) from None


def _said(e: BaseException) -> str:
    """An exception in one line: its type, and its message where it has one."""
    text = one_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def _released(coro, loop: _Loop):
    """`coro` run on `loop`, which goes back to the pool when it has truly ended (not when its
    Future is cancelled: an episode left behind still runs there)."""
    try:
        return await coro
    finally:
        _LOOPS.give_back(loop)


async def _cancel_left_behind() -> None:
    """The tasks an episode left running on its loop (its own loop: nothing else runs there
    until it has ended), cancelled, so the next episode on the loop starts clean."""
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in left:
        t.cancel()
    if left:
        await asyncio.wait(left, timeout=1.0)


class _Loop:
    """An event loop running forever in a daemon thread of its own: `submit(coro)` -> a
    concurrent Future. `stuck`: an episode of it was left behind blocked."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.stuck = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        while not self.loop.is_closed():
            try:
                self.loop.run_forever()
                return  # stopped (its agent is gone)
            except BaseException:  # noqa: S110 (a SystemExit a task let out: its task holds it; the loop goes on)
                continue

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)



class _LoopPool:
    """The episodes' loops, kept for the process: one episode on a loop at a time; a loop comes
    back once its episode's coroutine has ended (a blocked one, when it unblocks). `behind`:
    episodes left behind at their deadline, still running."""

    def __init__(self):
        self.idle: list[_Loop] = []
        self.made = 0
        self.behind: set[_Loop] = set()
        self.lock = threading.Lock()

    def take(self) -> _Loop:
        with self.lock:
            if self.idle:
                return self.idle.pop()
            self.made += 1
            return _Loop(f"gspo-agent-{self.made}")

    def give_back(self, loop: _Loop) -> None:
        with self.lock:
            self.behind.discard(loop)
            self.idle.append(loop)

    def left_behind(self, loop: _Loop) -> None:
        with self.lock:
            self.behind.add(loop)


_LOOPS = _LoopPool()
_HOMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # agent -> the _Loop its session and episodes run on


def _home_loop(agent) -> _Loop:
    """The loop an agent with a session runs on, kept across rollouts while the agent lives (its
    session's objects stay bound to one loop; the loop stops once the agent is gone); a new one,
    said in a line, when an episode left the last one blocked."""
    home = _HOMES.get(agent)
    if home is not None and home.stuck:
        if not _blocked([home], GRACE):
            home.stuck = False
        else:
            print(f"gspo: agent {agent_name(agent)}: its event loop is still blocked by an episode left behind; "
                  "this rollout runs on a new one", file=sys.stderr)
            home = None
    if home is None:
        home = _HOMES[agent] = _Loop(f"gspo-agent-{agent_name(agent)}")
        weakref.finalize(agent, home.loop.call_soon_threadsafe, home.loop.stop)
    return home


@contextlib.contextmanager
def _held(session, limits: Limits, home: _Loop | None):
    """The agent's session entered on its loop for the duration (none: nothing); its exit
    waited for, within a bound."""
    if session is None:
        yield
        return
    entered, leave = concurrent.futures.Future(), asyncio.Event()

    async def hold():
        async with session(limits):
            entered.set_result(None)
            await leave.wait()

    held = home.submit(hold())
    held.add_done_callback(lambda f: entered.done() or entered.set_exception(
        f.exception() or RuntimeError("the session ended before it was entered")))
    entered.result()  # the session's own error, raised here
    try:
        yield
    finally:
        home.loop.call_soon_threadsafe(leave.set)
        try:  # a loop an episode left blocked closes the session when it unblocks
            held.result(timeout=SESSION_EXIT if not home.stuck else 0.0)
        except concurrent.futures.TimeoutError:
            if not home.stuck:
                print(f"gspo: the agent's session did not close within {SESSION_EXIT:g} s; left closing in the "
                      "background", file=sys.stderr)


SESSION_EXIT = 120.0  # seconds a session's exit may take (its servers stopping)


def httpx_of_openai():
    """The httpx module the installed openai client is built on (`httpx2` from openai 3, else `httpx`)."""
    import openai

    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    return sys.modules[base.__module__.split(".")[0]]


def _rewards(out) -> list[float]:
    """The agent's return value as rewards (module docstring); ValueError otherwise."""
    values = out if isinstance(out, (list, tuple)) else [out]
    if not values or not all(_number(v) for v in values):
        raise ValueError(f"returned {out!r}; expected a reward (a number) or a list of one per call")
    rewards = [float(v) for v in values]
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"returned {out!r}; a reward must be finite")
    return rewards


def _number(v) -> bool:
    """A reward value: a real number (numpy's and a one-element tensor's too), not a bool or a string."""
    if isinstance(v, (bool, str, bytes)):
        return False
    if isinstance(v, (int, float)):
        return True
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and not v.is_complex() and v.dtype != torch.bool
    return isinstance(v, numbers.Real)


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
    vocab, context = model_limits(sampler, tokenizer)
    limits = Limits(params.max_new_tokens, params.stop_token_ids, spec.max_turns, spec.max_tokens,
                    episode_timeout=spec.timeout, vocab_size=vocab, max_context=context)
    endpoint = Endpoint(sample, tokenizer, MODEL_NAME, limits).start()
    try:
        urls = [endpoint.open_episode(b) for b in range(B)]
        calls = {}
        hooks = Hooks(ended=lambda b: calls.setdefault(b, endpoint.close_episode(b)),
                      transport=in_process(endpoint, httpx_of_openai()), broken=sample.failure, key=endpoint.secret)
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
    if endpoint.refused:
        print(f"gspo: agent {name}: the endpoint refused {plural(endpoint.refused, 'request')} without the run's "
              "key (401; nothing of them recorded): a process other than the run's agents called it", file=sys.stderr)
    ro, ep = assemble(results, tokenizer, G, len(endpoint.late_calls))
    ep.agent.refused = endpoint.refused
    ep.agent.left_behind = len(_LOOPS.behind)  # this process's, this rollout's and earlier ones'
    return ro, ep


def model_limits(sampler, tokenizer) -> tuple[int, int]:
    """(vocabulary size, longest context) of the model a sampler samples: the input embedding's
    rows (else the config's vocab_size, else the tokenizer's), and a vLLM engine's max_model_len
    (else the config's max_position_embeddings; 0: unknown)."""
    model = getattr(sampler, "model", None)
    config = getattr(unwrap(model), "config", None) if model is not None else None
    vocab = getattr(sampler, "vocab_size", 0) or 0
    if not vocab and model is not None and callable(getattr(model, "get_input_embeddings", None)):
        vocab = int(getattr(model.get_input_embeddings(), "num_embeddings", 0) or 0)
    vocab = vocab or int(getattr(config, "vocab_size", 0) or 0) or len(tokenizer)
    context = getattr(sampler, "max_model_len", 0) or int(getattr(config, "max_position_embeddings", 0) or 0)
    return vocab, context


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


def sequences(calls: list[Call]) -> list[tuple[list[int], list[Call]]]:
    """The episode's answered calls (in the order they began) as its sequences, in the order
    they began: (the episode's call numbers of its calls, its calls) each. The endpoint decided
    each call's sequence (gspo.agents.endpoint, Call graphs): each call of a sequence continues
    the one before it; a call numbered k is the episode's k-th answered call (its per-call
    reward's index)."""
    out: dict[int, tuple[list[int], list[Call]]] = {}
    for k, call in enumerate(calls):
        numbers, seq = out.setdefault(call.sequence, ([], []))
        numbers.append(k)
        seq.append(call)
    return list(out.values())


def _segments(calls: list[Call], train: bool, numbers: list[int]) -> list:
    """(ids, log-probs or None, call number) after the first prompt: each call's sampled tokens
    and the tokens between (what came back, never trained, numbered as the call before them);
    `train` False: all of them untrained; `numbers`: the episode's call number of each call."""
    out, before = [], len(calls[0].prompt_ids)
    for k, call in enumerate(calls):
        if k:
            out.append((call.prompt_ids[before:], None, numbers[k - 1]))
        out.append((call.completion_ids, call.logprobs if train else None, numbers[k]))
        before = len(call.prompt_ids) + len(call.completion_ids)
    return out


def assemble(results: list[AgentResult], tokenizer, G: int, late: int) -> tuple[Rollout, Episodes]:
    """The episodes laid out as run_episodes lays them (a failed one's tokens untrained), each
    one's first sequence its row; the later sequences of those that did not fail laid out with
    them, after them, and kept as the Episodes' `more` (gspo.sampling.episodes)."""
    pad, B = tokenizer.pad_token_id, len(results)
    split = [sequences(r.calls) for r in results]
    seqs = [s[0][1] if s else [] for s in split]
    later = [(b, k, calls) for b, (s, r) in enumerate(zip(split, results)) if r.failure is None for k, calls in s[1:]]
    segs = [_segments(s[0][1], r.failure is None, s[0][0]) if s else [] for s, r in zip(split, results)]
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
    ro, more = every.map(lambda t: t[:B]), (every.map(lambda t: t[B:]) if later else None)
    finals = [r.calls[-1].completion_ids if r.calls else [] for r in results]  # the episode's last call: scored
    tool_calls = [sum(len((c.reply or {}).get("tool_calls") or []) for c in r.calls) for r in results]
    ep = Episodes(final_texts=tokenizer.batch_decode(finals, skip_special_tokens=True), final_ids=finals,
                  transcripts=[tokenizer.decode([t for i, _, _ in row for t in i]) for row in segs[:B]],
                  turn_index=turn_index[:B], turn_rewards=[r.rewards for r in results],
                  turns=torch.tensor([len(r.calls) for r in results]), tool_calls=torch.tensor(tool_calls),
                  tool_errors=torch.zeros(B, dtype=torch.long), turn_limit=torch.zeros(B, dtype=torch.bool),
                  agent=AgentStats(extra_sequences=torch.tensor([max(len(s) - 1, 0) for s in split]),
                                   late_calls=late),
                  failed=torch.tensor([r.failure is not None for r in results]), more=more,
                  more_of=torch.tensor([b for b, _, _ in later]) if later else None,
                  more_turn_index=turn_index[B:] if later else None)
    return ro, ep
