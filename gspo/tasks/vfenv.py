"""verifiers environments (verifiers >= 0.4, its `verifiers.v1` stack) as gspo tasks: their
tasks are the prompts, their programs play the episodes through the endpoint over the policy,
their rewards score them.

    gspo train --task verifiers:reverse-text --model Qwen/Qwen2.5-0.5B-Instruct     # an installed taskset, by id
    gspo train --task verifiers:my-tasks --task-option split=train --task-option harness=null

    env = vf.load_environment(config)                                                # or an Env object
    gspo.Trainer(model=..., env=env).train()

A verifiers environment (`vf.Env`, a `SingleAgentEnv` for a plain taskset) brings three things:
a taskset (`Taskset.load()`: its `Task`s, each `TaskData` with a prompt), a harness (the agent
program that talks to a model through an OpenAI-compatible API: `null` is the plain chat loop,
with the task's `@vf.tool`s served over MCP), and the task's `@vf.reward`s (`Trace.reward`, the
weighted sum). gspo runs the environment's own `run_episode(task, ctx)` for each episode, with
`ctx` pointing the harness at the episode's base URL of the endpoint (gspo.sampling.endpoint),
so every call the program makes is sampled by the policy and recorded token for token
(gspo.sampling.agents), and the trace's reward is the episode's.

By id (`verifiers:ID`): verifiers imports the taskset's module (an installed package, or a
module on the Python path) and gspo builds its environment with `harness=null` and
`runtime=subprocess` (the chat loop in a local process: no sandbox account needed) unless
`--task-option harness=ID` / `runtime=docker|...` say otherwise, with `concurrency` (default 32)
episodes at a time (each starts processes); every other `--task-option KEY=VALUE` sets a field
of the taskset's config. The agent's `max_turns` is the run's
--max-turns (default 10). An `Env` object runs as it was configured.

Splits: the first `test_size` tasks (--eval-size; at most half of a finite taskset) are held out
for evaluation; training draws the others in an order seeded by the run's seed, a function of
(seed, step) alone. An infinite taskset (`INFINITE = True`, a generator) is read as far as the
run needs.

One trainable agent per episode: an episode whose environment ran several trainable agents (a
multi-agent `Env`) fails with a line, as does one whose trace ended in an error (its stop
condition and message; a provider error is the endpoint's refusal, e.g. --max-episode-tokens).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field

from gspo.config.checks import one_line
from gspo.tasks.data import Example
from gspo.tasks.env import AGENT_MAX_CALLS, EnvError

PREFIX = "verifiers:"
TASK_COLUMN = "verifiers_task"  # an Example's column: the index of its verifiers task
KEY_VAR = "GSPO_ENDPOINT_KEY"  # the API key's variable (unset: verifiers sends "EMPTY"; the endpoint takes any)
GSPO_OPTIONS = ("harness", "runtime", "concurrency")
CONCURRENCY = 32  # episodes at a time: each starts processes (the harness's program, task-scoped tool servers)


def is_verifiers(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def is_verifiers_env(obj) -> bool:
    """A verifiers `Env` object (verifiers.v1)."""
    return type(obj).__module__.startswith("verifiers.") and callable(getattr(obj, "run_episode", None)) \
        and hasattr(obj, "taskset")


def vf():
    """verifiers.v1, or one line saying how to install it."""
    try:
        import verifiers.v1 as v1
    except ImportError:
        raise EnvError("verifiers environments need the verifiers package, 0.4 or newer "
                       "(pip install 'gspo[verifiers]')") from None
    return v1


def env_config(taskset_id: str, options: dict, max_turns: int):
    """The EnvConfig of taskset `taskset_id` as gspo runs it by id (module docstring)."""
    v = vf()
    from verifiers.v1.utils.loaders import taskset_config_type

    try:
        fields = taskset_config_type(taskset_id).model_fields
    except Exception as e:
        raise EnvError(f"task {PREFIX}{taskset_id}: verifiers cannot load this taskset: {type(e).__name__}: "
                       f"{one_line(e)}") from None
    unknown = sorted(k for k in options if k not in fields and k not in GSPO_OPTIONS)
    if unknown:
        known = ", ".join(sorted(set(fields) - {"id"}) + list(GSPO_OPTIONS))
        raise EnvError(f"task {PREFIX}{taskset_id}: no option {', '.join(unknown)} (its options: {known})")
    taskset = {"id": taskset_id, **{k: v for k, v in options.items() if k not in GSPO_OPTIONS}}
    agent = {"harness": {"id": options.get("harness", "null")},
             "runtime": {"type": options.get("runtime", "subprocess")}, "max_turns": max_turns}
    try:
        return v.resolve_env_config({"taskset": taskset, "agent": agent})
    except Exception as e:
        raise EnvError(f"task {PREFIX}{taskset_id}: {type(e).__name__}: {one_line(e)}") from None


@dataclass
class VerifiersTask:
    """A verifiers environment as a gspo task (module docstring): `default_env` plays its episodes."""

    name: str
    env: object = None  # the Env object, else built from `config` for each run's turn limit
    config: object = None
    test_size: int = 500
    default_rewards: tuple = ()  # the environment's own rewards: the agent returns them
    default_max_new_tokens: int = 256
    concurrency: int = CONCURRENCY
    notes: list = field(default_factory=list)

    @classmethod
    def from_spec(cls, spec: str, options: dict | None = None, *, test_size: int = 500) -> VerifiersTask:
        taskset_id, options = spec[len(PREFIX):], options or {}
        config = env_config(taskset_id, options, AGENT_MAX_CALLS)
        return cls(name=spec, config=config, test_size=test_size, concurrency=options.get("concurrency", CONCURRENCY))

    @classmethod
    def from_env(cls, env, *, test_size: int = 500) -> VerifiersTask:
        return cls(name=f"{PREFIX}{env.config.taskset.id}", env=env, config=env.config, test_size=test_size)

    def __post_init__(self):
        v = vf()
        self._envs = {}
        self.given = self.env is not None
        if self.env is None:
            try:
                self.env = v.load_environment(self.config)
            except Exception as e:
                raise EnvError(f"task {self.name}: verifiers cannot build its environment: {type(e).__name__}: "
                               f"{one_line(e)}") from None
        self._source = iter(self.env.taskset.load())
        self._tasks: list = []
        self.infinite = bool(getattr(self.env.taskset, "INFINITE", False))
        if not self.infinite:
            self._tasks = list(self._source)
            if len(self._tasks) < 2:
                raise EnvError(f"task {self.name}: its taskset has {len(self._tasks)} task(s); gspo needs two or more "
                               "(one to train on, one to evaluate)")
            held = min(self.test_size, len(self._tasks) // 2)
            if held < self.test_size:
                self.notes.append(f"{self.name}: {len(self._tasks)} tasks; {held} held out for evaluation "
                                  f"(--eval-size {self.test_size} would leave none to train on)")
            self.test_size = held
        self.default_env = agent_for(self)

    def task(self, i: int):
        """The i-th task of the taskset (read on as far as i in an infinite one)."""
        while len(self._tasks) <= i:
            self._tasks.append(next(self._source))
        return self._tasks[i]

    def _example(self, i: int, source: str) -> Example:
        data = self.task(i).data
        prompt = data.prompt if isinstance(data.prompt, str) else [
            m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in (data.prompt or [])]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if data.system_prompt:
            messages = [{"role": "system", "content": data.system_prompt}, *messages]
        return Example(messages, getattr(data, "answer", None), {TASK_COLUMN: i}, source)

    def test_set(self, n: int | None = None) -> list[Example]:
        k = min(n or self.test_size, self.test_size)
        return [self._example(i, f"{self.name} task {i}") for i in range(k)]

    def train_batch(self, step: int, n: int, seed: int = 0) -> list[Example]:
        """Training tasks of `step`: a function of (seed, step) alone, never a held-out one."""
        start = (step - 1) * n
        if self.infinite:
            index = [self.test_size + start + j for j in range(n)]
        else:
            train = list(range(self.test_size, len(self._tasks)))
            out = []
            for j in range(start, start + n):
                epoch, k = divmod(j, len(train))
                order = train[:]
                random.Random(f"verifiers-{self.name}-{seed}-{epoch}").shuffle(order)
                out.append(order[k])
            index = out
        return [self._example(i, f"{self.name} task {i}") for i in index]

    def env_for(self, max_turns: int):
        """The environment an episode runs in: the object given, else one built with the run's turn limit."""
        if self.given:
            return self.env
        if max_turns not in self._envs:
            agent = self.config.agent.model_copy(update={"max_turns": max_turns})
            self._envs[max_turns] = vf().load_environment(self.config.model_copy(update={"agent": agent}))
        return self._envs[max_turns]


def agent_for(source: VerifiersTask) -> type:
    """The agent (gspo.sampling.agents) that plays `source`'s episodes: a class whose `session`
    holds the environment's serving resources for a rollout and whose `rollout` runs one episode."""

    class VerifiersAgent:
        env = None
        concurrency = source.concurrency

        @classmethod
        @contextlib.asynccontextmanager
        async def session(cls, limits):
            env = source.env_for(limits.max_calls or AGENT_MAX_CALLS)
            async with env.serving():
                cls.env = env
                try:
                    yield
                finally:
                    cls.env = None

        async def rollout(self, client, example) -> float:
            v = vf()
            task = source.task(example.columns[TASK_COLUMN])
            url = str(client.base_url).rstrip("/")
            ctx = v.ModelContext(model="policy", client=v.EvalClientConfig(base_url=url, api_key_var=KEY_VAR))
            episode = await VerifiersAgent.env.run_episode(task, ctx)
            return episode_reward(episode)

    VerifiersAgent.__name__ = VerifiersAgent.__qualname__ = source.name
    return VerifiersAgent


def episode_reward(episode) -> float:
    """The reward of a finished verifiers episode: its one trainable trace's; RuntimeError (one
    line) for an episode that failed, or ran more than one trainable agent."""
    if episode.errors:
        raise RuntimeError(f"the environment failed: {_error(episode.errors[0])}")
    traces = [t for t in episode.traces if getattr(t, "trainable", True) and getattr(t.agent, "trainable", True)]
    if len(traces) != 1:
        raise RuntimeError(f"the episode ran {len(traces)} trainable agents; gspo trains one agent per episode")
    (trace,) = traces
    if not trace.ok:
        why = _error(trace.errors[0]) if trace.errors else "no error given"
        raise RuntimeError(f"the agent's trace ended in {trace.stop_condition}: {why}")
    return float(trace.reward)


def _error(e) -> str:
    """A verifiers `Error` (its type and message) on one line, at most 400 characters."""
    return f"{e.type}: {' '.join(e.message.split())}"[:400]


__all__ = ["PREFIX", "VerifiersTask", "agent_for", "episode_reward", "is_verifiers", "is_verifiers_env"]
