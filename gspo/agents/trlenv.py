"""TRL's `environment_factory` environments, run unchanged as gspo multi-turn environments.

    class EchoEnv:                                   # as a TRL 1.16 user writes it for GRPOTrainer
        def reset(self, **row) -> str | None: ...    # the dataset row; a string is appended to the prompt
        def echo(self, message: str) -> str:         # every other public method is a tool
            '''Echo a message.

            Args:
                message: what to echo
            '''
        def get_reward(self) -> float: ...           # optional: the episode's reward, once it ended

    gspo.Trainer(config, environment_factory=EchoEnv)       # or: gspo train --env echo_env.py:EchoEnv

TRL's convention (trl/trainer/grpo_trainer.py, 1.16): `environment_factory()` makes an instance
per rollout; `reset(**row)` gets the whole dataset row (`prompt` and every column) and may return
a string appended to the last user message; every other public method (no leading `_`) is a tool,
its JSON schema from its type hints and docstring (transformers' `get_json_schema`, which needs
each argument described under `Args:`), offered to the chat template as `tools=`; a tool's
result goes back as `{"role": "tool", "name": ..., "content": str(result)}`, an exception or an
unknown tool as an error there; async tools are awaited; `get_reward()`, when defined, is
called once per finished episode and adds to the reward with weight 1 (logged as
`reward/env`); reward functions get the episode's instances as `environments=`. TRL's turn
limit `max_tool_calling_iterations` is gspo's `--max-turns`.

gspo's side (gspo.tasks.env.ToolEnvironment): tool calls are Hermes-style `<tool_call>` blocks
(Qwen2.5/Qwen3 templates, TRL's parser for them); a model turn without one ends the episode.
Not carried over: a dict of factories keyed by an `environment` column (refused in one line),
and TRL's pool that reuses instances across batches (gspo makes one per episode: `reset` is
still called first).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json

from gspo.tasks.env import EnvError, Step, ToolEnvironment, is_trl_environment, load_env, tool_schemas

RESERVED = ("reset", "get_reward")


def adapted(spec):
    """--env's value (a name, a class, an agent, or None) with a TRL environment class made a
    gspo environment (trl_environment); anything else as it came."""
    cls = load_env(spec) if isinstance(spec, str) else spec  # a file is run once: its class goes on
    return trl_environment(cls) if is_trl_environment(cls) else cls


def tool_methods(instance) -> list:
    """The instance's tools as TRL finds them: public functions of its class but reset and
    get_reward, bound to it; an async one wrapped to run to its end (its name and docstring kept)."""
    out = []
    for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction):
        if name.startswith("_") or name in RESERVED:
            continue
        method = getattr(instance, name)
        if inspect.iscoroutinefunction(method):
            method = functools.wraps(method)(functools.partial(_run_async, method))
        out.append(method)
    return out


def _call_name(raw: str) -> str:
    try:
        return str(json.loads(raw)["name"])
    except (ValueError, KeyError, TypeError):
        return ""


def _run_async(method, **kwargs):
    return asyncio.run(method(**kwargs))


def trl_environment(factory) -> type:
    """A gspo environment class (gspo.tasks.env) running `factory`'s environments (module docstring)."""
    if isinstance(factory, dict):
        raise EnvError("environment_factory: a dict of factories (one per `environment` column value) is not "
                       "supported yet; pass one factory")
    name = getattr(factory, "__name__", type(factory).__name__)
    try:
        probe = factory()
    except Exception as e:
        raise EnvError(f"environment_factory {name}: calling it raised {type(e).__name__}: {e}") from None
    if not callable(getattr(probe, "reset", None)):
        raise EnvError(f"environment_factory {name}: its instances need a reset(**row) method (TRL's convention)")
    tools = tool_methods(probe)
    try:
        tool_schemas(tools)
    except EnvError as e:
        raise EnvError(f"environment_factory {name}: {str(e).removeprefix('tool ')}") from None

    class TRLEnvironment(ToolEnvironment):
        __doc__ = f"TRL environment {name}, through gspo.agents.trlenv."

        def reset(self, example) -> None:
            self.env = factory()
            self.tools = tool_methods(self.env)  # the episode's own instance answers its tool calls
            out = self.env.reset(**example.row())
            if out is not None and not isinstance(out, str):
                raise EnvError(f"reset returned {type(out).__name__}; TRL's reset returns None or a string")
            self.prompt_suffix = out

        def step(self, text: str) -> Step:
            step = super().step(text)
            for message, raw in zip(step.messages, self.find_calls(text)):  # TRL names each result's tool
                message["name"] = _call_name(raw)
            return step

        def finish(self) -> float:
            get_reward = getattr(self.env, "get_reward", None)
            return float(get_reward()) if callable(get_reward) else 0.0

        def user_object(self):
            return self.env

    TRLEnvironment.__name__ = TRLEnvironment.__qualname__ = name
    TRLEnvironment.tools = tools  # the probe's: their schemas go to the chat template
    return TRLEnvironment
