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
`ctx` pointing the harness at the episode's base URL of the endpoint (gspo.agents.endpoint),
so every call the program makes is sampled by the policy and recorded token for token
(gspo.agents.runner), and the trace's reward is the episode's.

By id (`verifiers:ID`): verifiers imports the taskset's module (an installed package, or a
module on the Python path) and gspo builds its environment with `harness=null` and
`runtime=subprocess` (the chat loop in a local process: no sandbox account needed) unless
`--task-option harness=ID` / `runtime=docker|...` say otherwise, with `concurrency` (default 32)
episodes at a time (each starts processes); every other `--task-option KEY=VALUE` sets a field
of the taskset's config. The agent's `max_turns` is the run's
--max-turns (default 10). An `Env` object runs as it was configured.

Splits: the first `test_size` tasks (--eval-size; at most half of a finite taskset) are held out
for evaluation; training draws the others in an order seeded by the run's seed, a function of
(seed, step) alone: each epoch's order (a shuffle seeded by the name, the seed and the epoch)
is computed once and kept while the steps draw from it. An infinite taskset (`INFINITE =
True`, a generator) is read as far as the run needs.

The endpoint's key: the endpoint answers only requests with the run's secret as the bearer key
(the episode's client's `api_key`), and verifiers' harness reads its key from an environment
variable (`EvalClientConfig.api_key_var`): `GSPO_ENDPOINT_API_KEY_<digest of the secret>`, one
per secret (two runs in one process never share one), set while the secret's episodes run and
removed after the last (endpoint_key); a name holding `API_KEY`, which verifiers' subprocess
runtime keeps out of the processes it starts (the harness's program, tool servers).

Provisioning: verifiers' chat harness (`null`, `bash`) in the subprocess runtime is a script
that verifiers prepares with uv on first use: uv itself (`pip install --user uv` if missing),
then the script's packages (openai, mcp, httpx, ...) into a uv environment in uv's cache, from
the package index. Building the task (before step 1) checks it: provisioned, it is made ready
from uv's cache alone (`uv sync --offline`, about 0.1 s) and registered in verifiers' cache of
prepared scripts, so the run's episodes do not ask the index again (offline they would fail);
not provisioned and the index unreachable (no network), the task is refused in one line naming
what is missing and the command that provisions it (`provision()`, with network, once).

Across steps: the session and the episodes run on the agent's own event loop
(gspo.agents.runner); verifiers keeps one lock per harness script for the whole process
(`SubprocessRuntime._locks`), bound to the first loop that waits on it and taken again after a
failed preparation, so each session first drops the locks bound to another loop (another run's
in the process, or a loop left blocked): a setup failure in one step or run does not fail the
next ones. A session that opens while an earlier one is still closing (gspo.agents.runner
leaves a slow close in the background) serves a shallow copy of the environment: verifiers keeps
what it serves (the interception server, shared tool servers) on the Env object.

One trainable agent per episode: an episode whose environment ran several trainable agents (a
multi-agent `Env`) fails with a line, as does one whose trace ended in an error (its stop
condition and message; a provider error is the endpoint's refusal, e.g. --max-episode-tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import os
import random
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from gspo.config.checks import one_line
from gspo.tasks.data import Example
from gspo.tasks.env import AGENT_MAX_CALLS, EnvError

PREFIX = "verifiers:"
TASK_COLUMN = "verifiers_task"  # an Example's column: the index of its verifiers task
KEY_VAR = "GSPO_ENDPOINT_API_KEY"  # the API key's variable: KEY_VAR_<digest of the key>, one per endpoint secret
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


UV_INDEX = "https://pypi.org/simple"  # uv's package index unless UV_DEFAULT_INDEX / UV_INDEX_URL say otherwise
PROVISION = "python -c 'import gspo.agents.vfenv as v; v.provision()'"  # the harness provisioned, with network


def _chat_program() -> str:
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    return CHAT_PROGRAM_SOURCE


def _local_chat_harnesses(env) -> list[tuple[str, dict]]:
    """(harness id, its program's variables) of each of `env`'s agents whose harness is
    verifiers' chat program (`null`, `bash`: `setup` prepares CHAT_PROGRAM_SOURCE with uv) in
    the subprocess runtime: the harnesses verifiers provisions on this machine."""
    from verifiers.v1.harnesses.bash.harness import BashHarness
    from verifiers.v1.harnesses.null.harness import NullHarness
    from verifiers.v1.runtimes.subprocess import SubprocessConfig

    chat = {NullHarness.setup, BashHarness.setup}
    harnesses, specs = getattr(env, "_harnesses", None) or {}, getattr(env, "_agent_specs", None) or {}
    out = {}
    for name, spec in specs.items():
        harness = harnesses.get(name)
        if harness is not None and isinstance(spec.runtime, SubprocessConfig) and type(harness).setup in chat:
            out[harness.config.id] = dict(harness.config.resolved_env)
    return list(out.items())


def _uv() -> str | None:
    """The uv verifiers runs: in ~/.local/bin (where verifiers installs it), else on PATH."""
    return shutil.which("uv", path=os.pathsep.join([os.path.expanduser("~/.local/bin"), os.environ.get("PATH", "")]))


def _script_path() -> str:
    """Where verifiers' subprocess runtime keeps the chat program (content-addressed), as it names it."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    digest = hashlib.sha256(_chat_program().encode()).hexdigest()
    return f"{SubprocessRuntime.scripts_dir}/{digest}.py"


def _provision_offline(program_env: dict) -> str | None:
    """The chat program's uv environment made ready from what this machine has (`uv sync
    --offline`: uv's cache, no network) and registered in verifiers' per-process cache of
    prepared scripts, so its episodes run it without asking the package index again; else what
    is missing ("uv", "packages"). About 0.1 s; nothing once registered."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    path = _script_path()
    if path in SubprocessRuntime._interpreters:
        return None
    uv = _uv()
    if uv is None:
        return "uv"
    if not os.path.exists(path):  # written as verifiers writes it, so the environment is the one it would use
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(_chat_program())
        os.replace(tmp, path)
    env = {**{k: v for k, v in os.environ.items() if "API_KEY" not in k.upper()}, **program_env}
    try:
        sync = subprocess.run([uv, "sync", "--script", path, "-q", "--no-config", "--offline"], env=env,
                              capture_output=True, text=True, timeout=120)
        if sync.returncode != 0:
            scripts = subprocess.run([uv, "sync", "--help"], env=env, capture_output=True, text=True, timeout=30)
            return "packages" if "--script" in scripts.stdout else "uv"
        found = subprocess.run([uv, "python", "find", "--script", path, "--no-config"], env=env,
                               capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "packages"
    except OSError:  # it does not run
        return "uv"
    lines = found.stdout.strip().splitlines()
    if found.returncode != 0 or not lines:
        return "packages"
    SubprocessRuntime._interpreters[path] = lines[-1]
    return None


def _index_unreachable(program_env: dict) -> str | None:
    """Why uv's package index cannot be reached from here (the process's proxy settings; 3 s
    at most), else None."""
    merged = {**os.environ, **program_env}
    index = merged.get("UV_DEFAULT_INDEX") or merged.get("UV_INDEX_URL") or UV_INDEX
    if not index.startswith(("http://", "https://")):
        return None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler())  # the proxies of now
    try:
        opener.open(urllib.request.Request(index.rstrip("/") + "/uv/", method="HEAD"), timeout=3).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except Exception as e:
        reason = getattr(e, "reason", None) or e
        return f"{index}: {one_line(reason)}"
    return None


def check_provisioned(name: str, env) -> None:
    """EnvError, one line, before any step, when a harness of `env` that verifiers provisions
    on this machine (its chat program, in the subprocess runtime: uv, then the program's
    packages) is not provisioned and cannot be, uv's package index being unreachable; a
    provisioned one is made ready offline (_provision_offline)."""
    try:
        harnesses = _local_chat_harnesses(env)
    except ImportError:  # a verifiers without these harnesses: nothing to check
        return
    for harness, program_env in harnesses:
        try:
            missing = _provision_offline(program_env)
        except (ImportError, AttributeError):  # a verifiers whose runtime keeps its scripts otherwise
            return
        if missing is None:
            continue
        why = _index_unreachable(program_env)
        if why is None:
            continue  # verifiers provisions it from the index in the first episode
        what = ("uv (not on PATH nor in ~/.local/bin) and the program's packages" if missing == "uv"
                else "the program's packages in uv's cache")
        raise EnvError(f"task {name}: verifiers' {harness} harness is not provisioned on this machine and cannot be "
                       f"offline: its chat program needs {what} ({', '.join(_program_packages())}), and the package "
                       f"index is unreachable ({why}); provision it once with network: {PROVISION}")


def _program_packages() -> list[str]:
    """The chat program's packages, from its inline script metadata (PEP 723)."""
    for line in _chat_program().splitlines():
        if line.startswith("# dependencies = "):
            with contextlib.suppress(ValueError):
                return list(json.loads(line.split("=", 1)[1]))
    return ["its packages"]


def provision(program_env: dict | None = None) -> str:
    """verifiers' chat harness program (the `null` and `bash` harnesses' program) provisioned on
    this machine as its first episode would provision it, by verifiers itself: uv (with pip,
    into ~/.local/bin) if missing, then the program's packages, from the package index (network
    needed once; runs after it work offline). Returns (and prints) the program's interpreter."""
    vf()
    from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime

    async def prepare() -> str:
        runtime = SubprocessRuntime(SubprocessConfig())
        await runtime.start()
        try:
            return (await runtime.prepare_uv_script(_chat_program(), program_env or {}, activate=False))[0]
        finally:
            await runtime.stop()

    SubprocessRuntime._interpreters.pop(_script_path(), None)  # prepared again, from the index
    interpreter = asyncio.run(prepare())
    print(f"verifiers' chat harness program is provisioned: {interpreter}")
    return interpreter


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
        check_provisioned(self.name, self.env)
        self.default_env = agent_for(self)
        self._orders: dict = {}  # (seed, epoch) -> the training tasks in that epoch's order

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
            size = len(self._tasks) - self.test_size
            index = [self._epoch_order(seed, j // size)[j % size] for j in range(start, start + n)]
        return [self._example(i, f"{self.name} task {i}") for i in index]

    def _epoch_order(self, seed: int, epoch: int) -> list[int]:
        """The training tasks in epoch `epoch`'s order (a function of name, seed and epoch),
        shuffled once and kept while the steps draw from it (the last two epochs' orders are
        kept: a step may cross from one into the next)."""
        key = (seed, epoch)
        if key not in self._orders:
            order = list(range(self.test_size, len(self._tasks)))
            random.Random(f"verifiers-{self.name}-{seed}-{epoch}").shuffle(order)
            self._orders[key] = order
            while len(self._orders) > 2:
                del self._orders[next(iter(self._orders))]
        return self._orders[key]

    def env_for(self, max_turns: int):
        """The environment an episode runs in: the object given, else one built with the run's turn limit."""
        if self.given:
            return self.env
        if max_turns not in self._envs:
            agent = self.config.agent.model_copy(update={"max_turns": max_turns})
            self._envs[max_turns] = vf().load_environment(self.config.model_copy(update={"agent": agent}))
        return self._envs[max_turns]


def agent_for(source: VerifiersTask) -> type:
    """The agent (gspo.agents.runner) that plays `source`'s episodes: a class whose `session`
    holds the environment's serving resources for a rollout and whose `rollout` runs one episode."""

    class VerifiersAgent:
        env = None  # the environment of the latest session still open: its episodes run in it
        open_envs: list = []  # the environments of the sessions open, oldest first
        concurrency = source.concurrency

        @classmethod
        @contextlib.asynccontextmanager
        async def session(cls, limits):
            forget_other_loops_locks()
            env = source.env_for(limits.max_calls or AGENT_MAX_CALLS)
            if any(e is env for e in cls.open_envs):  # an earlier session still closing (gspo.agents.runner left
                env = copy.copy(env)  # it in the background): verifiers keeps what it serves on the Env object
            cls.open_envs.append(env)
            try:
                async with env.serving():
                    cls.env = env
                    yield
            finally:
                cls.open_envs = [e for e in cls.open_envs if e is not env]
                cls.env = cls.open_envs[-1] if cls.open_envs else None

        async def rollout(self, client, example) -> float:
            v = vf()
            task = source.task(example.columns[TASK_COLUMN])
            url = str(client.base_url).rstrip("/")
            with endpoint_key(client.api_key) as var:
                ctx = v.ModelContext(model="policy", client=v.EvalClientConfig(base_url=url, api_key_var=var))
                episode = await VerifiersAgent.env.run_episode(task, ctx)
            return episode_reward(episode)

    VerifiersAgent.__name__ = VerifiersAgent.__qualname__ = source.name
    return VerifiersAgent


_KEYS: dict[str, int] = {}  # a key's variable -> the episodes using it
_KEYS_LOCK = threading.Lock()


@contextlib.contextmanager
def endpoint_key(key: str | None):
    """The name of the process environment variable that holds `key` (the endpoint's secret,
    the episode's client's API key) while the episode runs: verifiers' harness reads its API key
    from a variable (`EvalClientConfig.api_key_var`). One variable per key (KEY_VAR and a digest
    of the key: two runs in one process, with two secrets, never share one), set while any
    episode with the key runs and removed after the last; its name holds `API_KEY`, which
    verifiers' subprocess runtime keeps out of the processes it starts (harness programs, tool
    servers). None for no key: verifiers sends "EMPTY"."""
    if not key:
        yield "GSPO_NO_ENDPOINT_API_KEY"
        return
    var = f"{KEY_VAR}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    with _KEYS_LOCK:
        _KEYS[var] = _KEYS.get(var, 0) + 1
        os.environ[var] = key
    try:
        yield var
    finally:
        with _KEYS_LOCK:
            _KEYS[var] -= 1
            if not _KEYS[var]:
                del _KEYS[var]
                os.environ.pop(var, None)


def forget_other_loops_locks() -> None:
    """verifiers' subprocess runtime keeps one asyncio.Lock per harness script for the whole
    process (`SubprocessRuntime._locks`, a class attribute), taken while it prepares the script
    with uv; a lock binds to the event loop that first waits on it, and a script whose
    preparation failed is prepared again under the same lock, so the episodes of any other
    loop that wait on it fail (`Lock ... is bound to a different event loop`). Called on the
    session's loop before its episodes: the locks bound to another loop are dropped (a fresh
    one is made when next needed; uv serialises its own environment's writes)."""
    try:
        from verifiers.v1.runtimes.subprocess import SubprocessRuntime
    except ImportError:
        return
    loop = asyncio.get_running_loop()
    locks = SubprocessRuntime.__dict__.get("_locks")
    if not isinstance(locks, dict):
        return
    for path, lock in list(locks.items()):
        if getattr(lock, "_loop", None) not in (None, loop):
            locks.pop(path, None)


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


__all__ = ["PREFIX", "VerifiersTask", "agent_for", "check_provisioned", "endpoint_key", "episode_reward",
           "is_verifiers", "is_verifiers_env", "provision"]
