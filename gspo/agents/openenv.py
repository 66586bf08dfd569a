"""OpenEnv environments as gspo multi-turn environments: the model acts through one tool, `step`.

    from gspo.agents.openenv import openenv_environment
    Env = openenv_environment(EchoEnvironment, EchoAction)            # in process: OpenEnv's server-side class
    Env = openenv_environment(lambda: EchoEnv(base_url=URL).sync(), EchoAction)   # a client of a served one
    gspo.Trainer(config, env=Env)          # or: --env my_envs.py:Env, with Env made so in that file

OpenEnv (openenv 0.10 / openenv-core 0.3) environments have `reset(seed=None, episode_id=None,
**kwargs)` and `step(action)`; an action is a pydantic model, and a step returns an observation
with `reward` and `done` (the server side's `Environment`) or a `StepResult(observation, reward,
done)` (a client's, `EnvClient.sync()` or `GenericEnvClient`). Both are taken, duck-typed: gspo
does not import openenv.

How an episode goes: `factory()` makes the episode's environment and `reset` gets the row's
columns its signature names (a `**kwargs` reset gets them all). Its observation is the start of
the conversation: rendered as text (`reset_message`), it is appended to the prompt's last
message (or to a plain-text prompt), after a blank line, or is that message's whole content when
the row's is empty (`[{"role": "user", "content": ""}]`, TRL's own stand-in prompt when the
environment states the task). The text is the observation's fields that are set (all but
reward, done and metadata, and those that are None): none, nothing is added (the prompt is the
row's, shared by its group); one string field (reasoning-gym's `question`), that string; else
those fields as JSON, as a step's result is shown. `reset_text=fn` replaces that rule: fn gets
the observation's fields (a dict) and returns the text, or None for none (TextArena's games:
`lambda obs: obs["prompt"]`). This is TRL's mechanism (gspo.agents.trlenv: the string its
`reset` returns is appended to the last message, `prompt_suffix`), but TRL's string is the
user's own and joined verbatim, where this text is gspo's and set off by a blank line. Such
episodes are sampled one prompt each: an environment that draws its own task may give each
episode of a group a different one (a `seed` column for `reset` keeps a group on one task).

The model sees one tool, `step`, whose parameters are the action model's fields (its JSON
schema); each call runs `env.step(Action(**arguments))`, and the observation's fields (all but
reward, done and metadata), as JSON, come back as the tool's result; the step's reward adds to
the turn's; `done` ends the episode. A malformed call or an action the model cannot validate is
an `error: ...` observation (gspo.tasks.env.ToolEnvironment's rule); a model turn without a call
ends the episode as an answer, which the task's rewards (if any) score. `close()`, if the
environment has one, runs when the episode ends. Reset's own reward and done are not read.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

from gspo.tasks.env import EnvError, Step, ToolEnvironment

BLANK_LINE = "\n\n"  # between the row's prompt and the reset observation's text


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


def reset_message(fields: dict) -> str | None:
    """The reset observation's fields (`unpack`'s) as the text the model reads first: those set
    (not None); none: None; a single string: itself; else their JSON, as a step's result is shown."""
    shown = {k: v for k, v in fields.items() if v is not None}
    if not shown:
        return None
    (only, *more) = shown.values()
    return only if not more and isinstance(only, str) else json.dumps(shown, default=str)


def prompt_suffix(prompt, text: str | None) -> str | None:
    """What follows the prompt's last message (or its text) so that `text` ends it: a blank line
    first, unless that message is empty (then `text` is the whole message) or ends so already."""
    if not text:
        return None
    last = prompt[-1].get("content") if isinstance(prompt, list) and prompt else prompt
    last = last if isinstance(last, str) else ""
    if not last.strip():
        return text
    ends = len(last) - len(last.rstrip("\n"))
    return BLANK_LINE[min(ends, 2):] + text


def openenv_environment(factory, action_cls, name: str | None = None, action_as_dict: bool = False,
                        reset_text=None) -> type:
    """A gspo environment class running `factory()`'s OpenEnv environments (module docstring);
    `action_as_dict`: step gets the validated action as a dict (GenericEnvClient's actions);
    `reset_text`: reset's observation fields (a dict) -> the model's first text (reset_message)."""
    tool = action_tool(action_cls)
    render = reset_text or reset_message
    label = name or getattr(factory, "__name__", "OpenEnv")

    class OpenEnvEnvironment(ToolEnvironment):
        __doc__ = f"OpenEnv environment {label}, through gspo.agents.openenv."
        tools = [_Schema(tool)]

        def reset(self, example) -> None:
            self.env = factory()
            fields, _, _ = unpack(self.env.reset(**_accepted(self.env.reset, example.row())))
            self.first = fields  # the reset observation's fields
            self.prompt_suffix = prompt_suffix(example.prompt, _text(render, fields))  # gspo.sampling.episodes reads it

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


def _text(render, fields: dict) -> str | None:
    """The reset observation's text by `render` (reset_message or the user's reset_text), checked."""
    text = render(fields)
    if text is not None and not isinstance(text, str):
        raise EnvError(f"reset_text returned {type(text).__name__}; expected a string or None")
    return text


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
