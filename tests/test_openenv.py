"""OpenEnv environments through gspo (gspo.tasks.openenv): OpenEnv's server-side shape (reset/step
returning an Observation that carries reward and done, pydantic actions) and its client shape
(StepResult(observation, reward, done)), defined here as OpenEnv's template writes them."""

import json
from dataclasses import dataclass

import pytest
from pydantic import BaseModel

import gspo
from gspo.tasks.data import Example
from gspo.tasks.env import tool_schemas
from gspo.tasks.openenv import openenv_environment


class GuessAction(BaseModel):  # openenv.core.env_server.types.Action: a pydantic model (metadata: dict)
    """Guess the hidden number."""

    guess: int
    metadata: dict = {}


class GuessObservation(BaseModel):  # openenv's Observation: done, reward, metadata, and the env's fields
    feedback: str = ""
    done: bool = False
    reward: float | None = None
    metadata: dict = {}


CLOSED = []


class GuessEnvironment:  # the server-side Environment: reset(seed, episode_id, **kw), step(action), state
    def reset(self, seed=None, episode_id=None, target=None):
        self.target, self.steps = int(target), 0
        return GuessObservation(feedback="guess a number from 1 to 99")

    def step(self, action: GuessAction, timeout_s=None):
        self.steps += 1
        if action.guess == self.target:
            return GuessObservation(feedback="correct", done=True, reward=1.0)
        return GuessObservation(feedback="higher" if action.guess < self.target else "lower", reward=-0.1)

    def close(self):
        CLOSED.append(self)


@dataclass
class StepResult:  # openenv.core.client_types.StepResult
    observation: dict
    reward: float | None = None
    done: bool = False


class GuessClient:  # a client's sync API: reset(**kw) / step(action) -> StepResult
    def __init__(self):
        self.server = GuessEnvironment()

    def reset(self, **kwargs):
        obs = self.server.reset(target=kwargs["target"])
        return StepResult({"feedback": obs.feedback})

    def step(self, action):
        obs = self.server.step(action)
        return StepResult({"feedback": obs.feedback}, obs.reward, obs.done)


def call(guess) -> str:
    return "<tool_call>" + json.dumps({"name": "step", "arguments": {"guess": guess}}) + "</tool_call>"


@pytest.mark.parametrize("factory", [GuessEnvironment, GuessClient])
def test_the_model_acts_through_the_step_tool(factory):
    Env = openenv_environment(factory, GuessAction)
    (schema,) = tool_schemas(list(Env.tools))
    assert schema["function"]["name"] == "step"
    assert schema["function"]["parameters"] == {"type": "object", "properties": {
        "guess": {"title": "Guess", "type": "integer"}}, "required": ["guess"]}  # metadata left out
    env = Env()
    env.reset(Example("?", None, {"target": 42}, "row 0"))
    s = env.step("let me try " + call(50))
    assert s.messages == [{"role": "tool", "name": "step", "content": '{"feedback": "lower"}'}]
    assert s.reward == pytest.approx(-0.1) and not s.done and s.tool_calls == 1 and s.tool_errors == 0
    s = env.step(call(42))
    assert json.loads(s.messages[0]["content"]) == {"feedback": "correct"} and s.reward == 1.0 and s.done
    bad = env.step(call("forty"))  # the action does not validate: an observation, not a crash
    assert bad.messages[0]["content"].startswith("error: ValidationError") and bad.tool_errors == 1
    other = env.step('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>')
    assert other.messages[0]["content"] == "error: unknown tool 'calculator' (tools: step)"
    assert env.step("the answer is 42").done  # no call: the model's answer ends the episode


def test_an_openenv_environment_trains_and_closes_its_episodes(tmp_path):
    CLOSED.clear()

    class Target(GuessEnvironment):
        def reset(self, seed=None, episode_id=None, answer=None):  # the row's answer column, by name
            return super().reset(target=answer)

    Env = openenv_environment(Target, GuessAction, name="Guess")
    cfg = gspo.TrainConfig(task="calculator", steps=1, prompts_per_step=2, group_size=2, max_new_tokens=60,
                           max_turns=2, eval_size=0, progress=False, output_dir=str(tmp_path / "run"))
    summary = gspo.Trainer(cfg, env=Env).train()
    assert summary["plan"]["env"] == "Guess"
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["episode/turns"] >= 1.0 and "reward/env/mean" in row
    assert len(CLOSED) == 4  # every episode's environment closed once it ended


def test_the_real_openenv_in_process_and_served_on_loopback():
    # with openenv-core installed (not a dev dependency: 55 packages, gradio among them), OpenEnv's own
    # Environment, Action and Observation, in process and behind its server (create_app, uvicorn, the /ws session)
    # through its GenericEnvClient. Run here with `pip install --target /tmp/oe openenv-core==0.3.0` and
    # PYTHONPATH=/tmp/oe (docs/agents.md)
    pytest.importorskip("openenv.core.env_server.http_server")
    uvicorn = pytest.importorskip("uvicorn")
    import socket
    import threading
    import time

    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from openenv.core.generic_client import GenericEnvClient

    class Guess(Action):
        guess: int

    class Feedback(Observation):
        feedback: str = ""

    class Server(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state, self.target = State(step_count=0), 42

        def reset(self, seed=None, episode_id=None, target=None, **kw):
            self.target = int(target or 42)
            return Feedback(feedback="guess", reward=0.0)

        def step(self, action, timeout_s=None, **kw):
            if action.guess == self.target:
                return Feedback(feedback="correct", done=True, reward=1.0)
            return Feedback(feedback="higher" if action.guess < self.target else "lower", reward=-0.1)

        @property
        def state(self):
            return self._state

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    server = uvicorn.Server(uvicorn.Config(create_app(Server, Guess, Feedback, env_name="guess", max_concurrent_envs=4),
                                           host="127.0.0.1", port=port, log_level="critical"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    try:
        for Env in (openenv_environment(Server, Guess),
                    openenv_environment(lambda: GenericEnvClient(base_url=f"http://127.0.0.1:{port}").sync(), Guess,
                                        action_as_dict=True)):
            env = Env()
            env.reset(Example("?", None, {"target": 7}, "row 0"))
            assert json.loads(env.step(call(50)).messages[0]["content"]) == {"feedback": "lower"}
            last = env.step(call(7))
            assert last.done and last.reward == 1.0
            env.finish()
    finally:
        server.should_exit = True
