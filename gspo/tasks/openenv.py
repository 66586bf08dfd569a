"""OpenEnv environments as gspo multi-turn environments: the model acts through one tool, `step`.

    from gspo.tasks.openenv import openenv_environment
    Env = openenv_environment(EchoEnvironment, EchoAction)            # in process: OpenEnv's server-side class
    Env = openenv_environment(lambda: EchoEnv(base_url=URL).sync(), EchoAction)   # a client of a served one
    gspo.Trainer(config, env=Env)          # or: --env my_envs.py:Env, with Env made so in that file

OpenEnv (openenv 0.10 / openenv-core 0.3) environments have `reset(seed=None, episode_id=None,
**kwargs)` and `step(action)`; an action is a pydantic model, and a step returns an observation
with `reward` and `done` (the server side's `Environment`) or a `StepResult(observation, reward,
done)` (a client's, `EnvClient.sync()` or `GenericEnvClient`). Both are taken, duck-typed: gspo
does not import openenv.

How an episode goes: `factory()` makes the episode's environment and `reset` gets the row's
columns its signature names (a `**kwargs` reset gets them all). The model sees one tool, `step`,
whose parameters are the action model's fields (its JSON schema); each call runs
`env.step(Action(**arguments))`, and the observation's fields (all but reward, done and
metadata), as JSON, come back as the tool's result; the step's reward adds to the turn's; `done`
ends the episode. A malformed call or an action the model cannot validate is an `error: ...`
observation (gspo.tasks.env.ToolEnvironment's rule); a model turn without a call ends the
episode as an answer, which the task's rewards (if any) score. `close()`, if the environment
has one, runs when the episode ends.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

from gspo.tasks.env import EnvError, Step, ToolEnvironment


def action_tool(action_cls) -> dict:
    """The `step` tool's schema: the action model's fields (pydantic's JSON schema, OpenEnv's
    `metadata` left out)."""
    try:
        schema = action_cls.model_json_schema()
    except AttributeError:
        raise EnvError(f"OpenEnv action {getattr(action_cls, '__name__', action_cls)!r}: expected a pydantic model "
                       "class (OpenEnv's Action)") from None
    props = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
    params = {"type": "object", "properties": props, "required": [k for k in schema.get("required", [])
                                                                   if k in props]}
    return {"type": "function", "function": {
        "name": "step", "description": schema.get("description") or f"Act in the environment ({action_cls.__name__}).",
        "parameters": params}}


def unpack(result) -> tuple[dict, float, bool]:
    """A step's or reset's result as (observation fields, reward, done): a client's StepResult
    (observation, reward, done) or a server-side Observation carrying reward and done itself."""
    obs = getattr(result, "observation", result) if hasattr(result, "done") and hasattr(result, "observation") \
        else result
    reward = getattr(result, "reward", None)
    done = bool(getattr(result, "done", False))
    if hasattr(obs, "model_dump"):
        fields = obs.model_dump()
    elif dataclasses.is_dataclass(obs):
        fields = dataclasses.asdict(obs)
    elif isinstance(obs, dict):
        fields = dict(obs)
    else:
        fields = {"observation": str(obs)}
    for k in ("reward", "done", "metadata"):
        fields.pop(k, None)
    return fields, float(reward or 0.0), done


def openenv_environment(factory, action_cls, name: str | None = None, action_as_dict: bool = False) -> type:
    """A gspo environment class running `factory()`'s OpenEnv environments (module docstring);
    `action_as_dict`: step gets the validated action as a dict (GenericEnvClient's actions)."""
    tool = action_tool(action_cls)
    label = name or getattr(factory, "__name__", "OpenEnv")

    class OpenEnvEnvironment(ToolEnvironment):
        __doc__ = f"OpenEnv environment {label}, through gspo.tasks.openenv."
        tools = [_Schema(tool)]

        def reset(self, example) -> None:
            self.env = factory()
            fields, _, _ = unpack(self.env.reset(**_accepted(self.env.reset, example.row())))
            self.first = fields

        def step(self, text: str) -> Step:
            calls = self.find_calls(text)
            if not calls:
                return Step(done=True)
            messages, reward, done, errors = [], 0.0, False, 0
            for raw in calls:
                out, r, d, ok = self._act(raw)
                messages.append({"role": "tool", "name": "step", "content": out})
                reward, done, errors = reward + r, done or d, errors + (not ok)
                if done:
                    break
            return Step(messages=messages, reward=reward, done=done, tool_calls=len(messages), tool_errors=errors)

        def _act(self, raw: str) -> tuple[str, float, bool, bool]:
            try:
                call = json.loads(raw)
                if call.get("name") != "step":
                    return f"error: unknown tool {call.get('name')!r} (tools: step)", 0.0, False, False
                args = call.get("arguments", {})
                action = action_cls(**(json.loads(args) if isinstance(args, str) else args))
                if action_as_dict:
                    action = action.model_dump(exclude={"metadata"})
            except Exception as e:  # not JSON, or an action the model's arguments do not validate
                return f"error: {type(e).__name__}: {e}".splitlines()[0], 0.0, False, False
            try:
                fields, reward, done = unpack(self.env.step(action))
            except Exception as e:  # the environment's failure is the model's observation, not the run's crash
                return f"error: {type(e).__name__}: {e}", 0.0, False, False
            return json.dumps(fields, default=str), reward, done, True

        def finish(self) -> float:
            close = getattr(self.env, "close", None)
            if callable(close):
                close()
            return 0.0

        def user_object(self):
            return self.env

    OpenEnvEnvironment.__name__ = OpenEnvEnvironment.__qualname__ = label
    return OpenEnvEnvironment


class _Schema:
    """A tool given by its JSON schema rather than a function (gspo.tasks.env.tool_schemas)."""

    def __init__(self, schema: dict):
        self.json_schema = schema
        self.__name__ = schema["function"]["name"]


def _accepted(fn, row: dict) -> dict:
    """The row's fields `fn` takes by name (all of them when it takes **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return row
    names = {p.name for p in params}
    return {k: v for k, v in row.items() if k in names}
