"""OpenEnv environments through gspo (gspo.agents.openenv): OpenEnv's server-side shape (reset/step
returning an Observation that carries reward and done, pydantic actions) and its client shape
(StepResult(observation, reward, done)), defined here as OpenEnv's template writes them."""

import json
import re
from dataclasses import dataclass

import pytest
import torch
from pydantic import BaseModel

import gspo
from gspo.agents.openenv import openenv_environment
from gspo.models.loading import load_policy
from gspo.models.sequences import Rollout, left_pad
from gspo.sampling.episodes import EpisodeSpec, run_episodes, start_env
from gspo.sampling.rollout import PolicySampler, sampling_params
from gspo.tasks.data import Example
from gspo.tasks.env import EnvError, tool_schemas


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


@pytest.mark.slow  # trains
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


# ------------------------------------------------------------------------------------------------
# The reset observation reaches the model: the task stated only at reset
# ------------------------------------------------------------------------------------------------


class SayAction(BaseModel):
    """Say the number."""

    n: int
    metadata: dict = {}


class SayObservation(BaseModel):  # reset sets `task`, a step sets `result` (reasoning-gym's shape: None when unset)
    task: str | None = None
    result: str | None = None
    done: bool = False
    reward: float | None = None
    metadata: dict = {}


class SayTheNumber:  # server shape: the target comes from the seed, and only reset's observation tells it
    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target, self.said = 10 + int(seed), []
        return SayObservation(task=f"call step with n {self.target}", reward=0.0)

    def step(self, action: SayAction, timeout_s=None):
        self.said.append(action.n)
        won = action.n == self.target
        return SayObservation(result="right" if won else "wrong", done=won, reward=float(won))


class SayTheNumberClient:  # client shape: StepResult(observation as a dict, reward, done)
    def __init__(self):
        self.server = SayTheNumber()

    def reset(self, **kwargs):
        return StepResult(self.server.reset(**kwargs).model_dump(exclude={"reward", "done", "metadata"}), 0.0)

    def step(self, action):
        obs = self.server.step(action)
        return StepResult(obs.model_dump(exclude={"reward", "done", "metadata"}), obs.reward, obs.done)

    @property
    def target(self):
        return self.server.target


class ReadingSampler:
    """A Sampler whose model reads its prompt: it calls `step` with the number the prompt states
    (`call step with n N`), or answers `none` when there is none; records every prompt it got."""

    def __init__(self, tokenizer):
        self.tok, self.prompts = tokenizer, []

    def sync(self, policy, version=None):
        pass

    def sample(self, prompts, params, *, generator=None, rows=None):
        G, turns = params.group_size, []
        for ids in prompts:
            self.prompts.append(list(ids))
            said = re.findall(r"call step with n (\d+)", self.tok.decode(ids))
            turn = call_n(int(said[-1])) if said else "none"
            turns += [self.tok(turn, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]] * G
        p_ids, p_mask = left_pad(prompts, self.tok.pad_token_id)
        c_ids, c_mask = left_pad([t[::-1] for t in turns], self.tok.pad_token_id)  # right-padded, once flipped
        B = len(turns)
        return Rollout(p_ids.repeat_interleave(G, 0), p_mask.repeat_interleave(G, 0), c_ids.flip(1),
                       c_mask.flip(1).float(), -0.5 * c_mask.flip(1).float(),
                       torch.tensor([len(t) for t in turns]), torch.zeros(B, dtype=torch.bool), G)


def call_n(n) -> str:
    return "<tool_call>" + json.dumps({"name": "step", "arguments": {"n": n}}) + "</tool_call>"


@pytest.fixture(scope="module")
def tiny_tool():
    torch.manual_seed(0)
    return load_policy("tiny-tool")


def chat(content: str) -> str:
    """The tiny-tool template's rendering of a one-user-message prompt with the `step` tool."""
    return ("<|im_start|>system\ntools: step(n)<|im_end|>\n<|im_start|>user\n" + content
            + "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("factory", [SayTheNumber, SayTheNumberClient])
@pytest.mark.parametrize("prompt, seen", [
    ([{"role": "user", "content": ""}], chat("call step with n {t}")),  # the task is stated only at reset
    ([{"role": "user", "content": "play:"}], chat("play:\n\ncall step with n {t}")),  # after a blank line
    ("", "call step with n {t}"),  # a plain-text prompt: the text, no chat template
    ("play:\n", "play:\n\ncall step with n {t}"),
])
def test_the_reset_observation_is_the_first_message_the_model_reads(tiny_tool, factory, prompt, seen):
    _, tok = tiny_tool
    Env = openenv_environment(factory, SayAction)
    examples = [Example(prompt, None, {"seed": s}, f"row {s}") for s in (3, 5)]
    sampler = ReadingSampler(tok)
    params = sampling_params(tok, stop=(tok.eos_token_id,), group_size=2, max_new_tokens=80)
    ro, ep = run_episodes(sampler, tok, examples, EpisodeSpec(Env, max_turns=2), params)
    expected = [seen.format(t=10 + s) for s in (3, 5) for _ in range(2)]  # each episode's, its row's task
    for b in range(4):
        ids = ro.prompt_ids[b][ro.prompt_mask[b].bool()].tolist()
        assert tok.decode(ids) == expected[b]
        assert ids == tok(expected[b], add_special_tokens=False)["input_ids"]  # token for token
    assert sampler.prompts == [ro.prompt_ids[b][ro.prompt_mask[b].bool()].tolist() for b in range(4)]
    # the model read the task and played it: one call with the row's number, won, the episode over
    assert [e.target for e in ep.envs] == [13, 13, 15, 15]
    assert [sum(r) for r in ep.turn_rewards] == [1.0] * 4 and ep.turns.tolist() == [1] * 4
    assert ep.tool_calls.tolist() == [1] * 4 and not ep.turn_limit.any()


def test_the_policy_samples_its_first_turn_after_the_observation(tiny_tool):
    model, tok = tiny_tool
    Env = openenv_environment(SayTheNumber, SayAction)
    params = sampling_params(tok, group_size=2, max_new_tokens=8, temperature=0.0)
    ro, _ = run_episodes(PolicySampler(model), tok, [Example([{"role": "user", "content": ""}], None, {"seed": 7},
                                                             "row 0")], EpisodeSpec(Env), params)
    want = tok(chat("call step with n 17"), add_special_tokens=False)["input_ids"]
    assert [ro.prompt_ids[b][ro.prompt_mask[b].bool()].tolist() for b in range(2)] == [want, want]


def test_an_observation_with_nothing_to_say_leaves_the_prompt_the_rows(tiny_tool):
    _, tok = tiny_tool

    class Ready(BaseModel):  # echo's reset today: an Observation with no fields of its own
        done: bool = False
        reward: float | None = None
        metadata: dict = {}

    class Echo(SayTheNumber):
        def reset(self, seed=None, episode_id=None, **kwargs):
            super().reset(seed)
            return Ready(reward=0.0, metadata={"status": "ready", "message": "echo environment ready"})

    Env = openenv_environment(Echo, SayAction)
    row = Example([{"role": "user", "content": "call step with n 13"}], None, {"seed": 3}, "row 0")
    env = Env()
    env.reset(row)
    assert getattr(env, "prompt_suffix", None) is None
    sampler = ReadingSampler(tok)
    params = sampling_params(tok, stop=(tok.eos_token_id,), group_size=2, max_new_tokens=80)
    run_episodes(sampler, tok, [row], EpisodeSpec(Env), params)
    assert len(sampler.prompts) == 1  # the group shares its prompt: sampled once, G completions
    assert tok.decode(sampler.prompts[0]) == chat("call step with n 13")


def test_how_a_reset_observation_reads():
    from gspo.agents.openenv import prompt_suffix, reset_message

    assert reset_message({}) is None
    assert reset_message({"question": None, "score": None}) is None
    assert reset_message({"question": "what is 2+2?", "score": None, "correct_answer": None}) == "what is 2+2?"
    assert reset_message({"feedback": ""}) == ""  # nothing to say: no suffix (prompt_suffix below)
    board = {"board": "x.o", "moves": 3, "hint": None}  # several fields: JSON, as a step's result is shown
    assert reset_message(board) == '{"board": "x.o", "moves": 3}'
    assert reset_message({"count": 3}) == '{"count": 3}'  # one field, not a string: JSON too
    assert prompt_suffix([{"role": "user", "content": ""}], "task") == "task"
    assert prompt_suffix([{"role": "system", "content": "s"}, {"role": "user", "content": "go"}], "task") == "\n\ntask"
    assert prompt_suffix("go\n", "task") == "\ntask" and prompt_suffix("go\n\n", "task") == "task"
    assert prompt_suffix("go", "") is None and prompt_suffix("go", None) is None


def test_reset_text_chooses_the_text():
    class Arena(BaseModel):  # TextArena's observation: `prompt` and the game's messages
        prompt: str
        messages: list = []
        current_player_id: int = 0
        done: bool = False
        reward: float | None = None
        metadata: dict = {}

    class Wordle:
        def reset(self, seed=None, episode_id=None):
            return Arena(prompt="guess the word", messages=[{"sender_id": -1, "content": "guess the word"}])

    row = Example([{"role": "user", "content": ""}], None, {}, "row 0")
    env = openenv_environment(Wordle, SayAction)()
    env.reset(row)  # several fields: their JSON
    assert json.loads(env.prompt_suffix) == {"prompt": "guess the word", "current_player_id": 0,
                                              "messages": [{"sender_id": -1, "content": "guess the word"}]}
    env = openenv_environment(Wordle, SayAction, reset_text=lambda obs: obs["prompt"])()
    env.reset(row)
    assert env.prompt_suffix == "guess the word"
    env = openenv_environment(Wordle, SayAction, reset_text=lambda obs: None)()
    env.reset(row)
    assert env.prompt_suffix is None
    Bad = openenv_environment(Wordle, SayAction, reset_text=lambda obs: obs["messages"])
    with pytest.raises(EnvError, match=r"^env Wordle: reset on row 0 raised EnvError: reset_text returned list"):
        start_env(Bad, row)


@pytest.mark.slow  # trains
def test_a_dataset_whose_rows_are_seeds_trains_on_the_tasks_reset_states(tmp_path):
    # the prompt is TRL's stand-in for an environment that states the task: an empty user message
    rows = tmp_path / "seeds.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": ""}], "seed": s}) + "\n"
                            for s in range(4)))
    seen = []

    def won(environments, **kwargs):  # TRL's pattern: the reward reads the episodes' environments
        seen.extend(environments)
        return [float(bool(e.said) and e.said[-1] == e.target) for e in environments]

    cfg = gspo.TrainConfig(model="tiny-tool", steps=1, prompts_per_step=2, group_size=2, max_new_tokens=40,
                           max_turns=2, eval_size=0, progress=False, output_dir=str(tmp_path / "run"))
    summary = gspo.Trainer(cfg, train_dataset=str(rows), env=openenv_environment(SayTheNumber, SayAction,
                                                                                name="Say"),
                           reward_funcs=[won]).train()
    assert summary["plan"]["env"] == "Say"
    assert len(seen) == 4 and {e.target for e in seen} <= {10, 11, 12, 13}
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["episode/turns"] >= 1.0 and "reward/won/mean" in row
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    said = [s["prompt"] for s in samples]  # what the model saw: the task its episode's reset stated
    assert len(said) == 4 and said == [chat(f"call step with n {e.target}") for e in seen]
