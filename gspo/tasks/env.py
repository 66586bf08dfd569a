"""Environments for multi-turn episodes: what answers the model between its turns.

    gspo train --task calculator                                  # the task names its environment
    gspo train --dataset rows.jsonl --env my_env.py:SearchEnv --max-turns 4

An environment is a class with a no-argument constructor; gspo makes one per episode:

    class Environment:
        tools = []                                  # plain functions the model may call (optional)
        concurrency = 1                             # >1: that many episodes' steps at once, in threads
        def reset(self, example) -> None: ...       # the episode's dataset row (a gspo.tasks.data.Example)
        def step(self, text: str) -> Step: ...      # the model's turn, decoded -> what comes back
        def finish(self) -> float: ...              # optional: once the episode ended, added to its reward

`Step(messages, reward, done)`: the messages appended to the conversation (role "tool" or
"user"; rendered by the chat template into environment tokens, which the model reads but is
never trained on), the turn's reward (added to the episode's reward and, with
`--turn-advantages`, credited to the turns before it), and whether the episode is over.

`ToolEnvironment` is the common case: its `step` runs the tool calls in the model's turn
(Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of
Qwen2.5/Qwen3 chat templates) and returns each result as a tool message; a turn without a tool
call ends the episode (it is the answer). A tool that raises, an unknown tool, or a call that
is not JSON becomes an observation starting with `error:`, never a crash, and counts as a tool
error, as does a call over the class's `tool_timeout` seconds. Tools are plain Python
functions with type hints and a docstring with an `Args:` section: they reach the chat
template's `tools=` argument as JSON schemas (`transformers.utils.get_json_schema`), the
Hugging Face convention.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
AGENT_MAX_CALLS = 10  # an agent's calls per episode at most, without --max-turns


def is_trl_environment(obj) -> bool:
    """A TRL `environment_factory` class (gspo.agents.trlenv): `reset` and no `step`."""
    return (isinstance(obj, type) and callable(getattr(obj, "reset", None))
            and not callable(getattr(obj, "step", None)))


def is_agent(obj) -> bool:
    """Agent code (gspo.agents.runner) rather than an environment: an `async def` function, or a
    class with an `async def rollout`."""
    if inspect.iscoroutinefunction(obj):
        return True
    return isinstance(obj, type) and inspect.iscoroutinefunction(getattr(obj, "rollout", None))


class EnvError(ValueError):
    """An environment that cannot be loaded or misbehaved; one line naming it."""


@dataclass
class Step:
    """What the environment returns for one model turn."""

    messages: list[dict] = field(default_factory=list)  # appended to the conversation: {"role", "content"}
    reward: float = 0.0  # this turn's reward
    done: bool = False  # the episode ends here
    tool_calls: int = 0  # tool calls in the model's turn (for the metrics)
    tool_errors: int = 0  # of which failed (unparsable, unknown tool, or the tool raised)


class Environment:
    """Base class: override `step` (and `reset` to read the dataset row). `concurrency` > 1
    lets up to that many episodes' steps of a turn run at once, in threads: for a step that
    waits on I/O (a web search, a sandbox), when the class is safe to run so."""

    tools: list = []
    concurrency: int = 1

    def reset(self, example) -> None:
        self.example = example

    def step(self, text: str) -> Step:
        raise NotImplementedError


class ToolEnvironment(Environment):
    """Runs the tool calls of each model turn; a turn with none ends the episode. Another
    template's call format: override `find_calls` (the JSON text of each call in a turn).
    `tool_timeout` (seconds): a call that runs longer becomes an error observation and the
    episode goes on (the call runs in a thread, left to finish on its own); None: no limit."""

    tool_timeout: float | None = None

    def find_calls(self, text: str) -> list[str]:
        return TOOL_CALL.findall(text)

    def step(self, text: str) -> Step:
        calls = self.find_calls(text)
        if not calls:
            return Step(done=True)
        results = [self.call(raw) for raw in calls]
        return Step(messages=[{"role": "tool", "content": out} for out, _ in results], tool_calls=len(calls),
                    tool_errors=sum(not ok for _, ok in results))

    def call(self, raw: str) -> tuple[str, bool]:
        """Run one tool call's JSON text: (the observation, whether it succeeded)."""
        try:
            call = json.loads(raw)
            name, args = call["name"], call.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                raise TypeError("arguments must be an object")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return f"error: the tool call is not valid JSON with a name and arguments ({type(e).__name__})", False
        tools = {fn.__name__: fn for fn in self.tools}
        if name not in tools:
            return f"error: unknown tool {name!r} (tools: {', '.join(tools)})", False
        try:
            return str(_call(tools[name], args, self.tool_timeout)), True
        except Exception as e:  # a tool's failure is the model's observation, not the run's crash
            return f"error: {type(e).__name__}: {e}", False


def _call(fn, args: dict, timeout: float | None):
    """fn(**args), or TimeoutError after `timeout` seconds (fn's thread is left to finish)."""
    if timeout is None:
        return fn(**args)
    box = {}

    def run():
        try:
            box["out"] = fn(**args)
        except BaseException as e:  # handed to the caller's thread
            box["err"] = e

    worker = threading.Thread(target=run, name=f"gspo-tool-{fn.__name__}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError(f"the tool ran over {timeout:g} s")
    if "err" in box:
        raise box["err"]
    return box["out"]


def tool_schemas(tools: list) -> list[dict] | None:
    """The tools as the JSON schemas chat templates take (`tools=`); None without tools."""
    if not tools:
        return None
    from transformers.utils import get_json_schema

    schemas = []
    for fn in tools:
        if hasattr(fn, "json_schema"):  # a tool given by its schema (gspo.agents.openenv's `step`)
            schemas.append(fn.json_schema)
            continue
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:
            raise EnvError(f"tool {getattr(fn, '__name__', fn)!r}: {e} (a tool needs type hints and a docstring "
                           f"with an Args: section)") from None
    return schemas


def load_env(spec: str):
    """The environment class named by `path/to/file.py:Name` or `package.module:Name`."""
    if ":" not in spec:
        raise EnvError(f"env {spec!r}: expected path/to/file.py:ClassName or package.module:ClassName")
    target, _, attr = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise EnvError(f"env {spec!r}: no such file {path}")
            module_spec = importlib.util.spec_from_file_location(f"gspo_env_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"env {spec!r}: importing {target} failed: {type(e).__name__}: {e}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise EnvError(f"env {spec!r}: {target} has no {attr!r}")
    if is_agent(cls) or is_trl_environment(cls):
        return cls
    if not callable(getattr(cls, "step", None)):
        raise EnvError(f"env {spec!r}: {attr} has no step(text) method (nor is it an agent, an async def "
                       f"rollout(client, example) function or a class with one, or a TRL environment with reset)")
    tool_schemas(list(getattr(cls, "tools", []) or []))  # the tools' schemas can be made
    return cls


def observation_text(tokenizer, messages: list[dict], tools: list | None, model_stopped: str | None) -> str:
    """The text that follows a model turn in the conversation when `messages` come back: the
    chat template's closing of the assistant turn (less the stop token the model itself
    sampled, `model_stopped`), the messages, and the opening of the next assistant turn.

    Rendered by difference, so any template works: a stand-in conversation with and without
    the messages, the shared prefix dropped (earlier turns are never re-rendered: the
    conversation is the tokens the model sampled and these, token in, token out).
    """
    kw = dict(tokenize=False, tools=tools)
    head = tokenizer.apply_chat_template([{"role": "user", "content": "U"}], add_generation_prompt=True, **kw) + "A"
    full = tokenizer.apply_chat_template([{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"},
                                          *messages], add_generation_prompt=True, **kw)
    if not full.startswith(head):
        raise EnvError("the chat template renders an earlier turn differently once more turns follow; "
                       "multi-turn episodes need a template whose rendering only grows")
    tail = full[len(head):]
    if model_stopped and tail.startswith(model_stopped):
        tail = tail[len(model_stopped):]
    return tail


def episode_env(spec, task, max_turns: int | None, tokenizer) -> tuple[type | None, int]:
    """The run's environment class and turn limit: `spec` (--env, or the class itself), else
    the task's own (`default_env`, `default_max_turns`); (None, 1) for single-turn completions."""
    spec = spec or getattr(task, "default_env", None)
    if spec is None:
        if max_turns not in (None, 1):
            raise EnvError(f"max_turns: {max_turns} turns need an environment to answer between them (--env)")
        return None, 1
    cls = load_env(spec) if isinstance(spec, str) else spec
    if is_agent(cls):  # its calls choose their own format: chat (the template renders them) or plain completions
        _check_concurrency(cls)
        return cls, max_turns or AGENT_MAX_CALLS
    if not getattr(tokenizer, "chat_template", None):
        raise EnvError(f"env {getattr(spec, '__name__', spec)}: multi-turn episodes need a tokenizer "
                       f"with a chat template (the environment's messages are rendered by it); this model's has none")
    if not (isinstance(cls, type) and callable(getattr(cls, "step", None))):
        raise EnvError(f"env: expected an environment class with a step(text) method, got {cls!r}")
    _check_concurrency(cls)
    timeout = getattr(cls, "tool_timeout", None)
    if timeout is not None and not (type(timeout) in (int, float) and timeout > 0):
        raise EnvError(f"env {cls.__name__}: tool_timeout must be None or seconds > 0 (got {timeout!r})")
    return cls, max_turns or getattr(task, "default_max_turns", 4)


def _check_concurrency(cls) -> None:
    """`concurrency`, where a class (an environment's, an agent's) sets it: an int >= 1."""
    value = getattr(cls, "concurrency", 1)
    if not (type(value) is int and value >= 1):
        raise EnvError(f"env {cls.__name__}: concurrency must be an int >= 1 (got {value!r})")
