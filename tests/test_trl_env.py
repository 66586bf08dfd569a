"""TRL's environment_factory environments through gspo (gspo.agents.trlenv), against TRL 1.16's convention:
reset(**row) -> None | str appended to the prompt, every other public method a tool (schema from its
hints and docstring), async tools awaited, get_reward() once per episode with weight 1, reward
functions given `environments=`, one instance per rollout."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gspo
from gspo.agents.trlenv import tool_methods, trl_environment
from gspo.config import ConfigError
from gspo.models.loading import load_policy
from gspo.sampling.episodes import EpisodeSpec, run_episodes
from gspo.sampling.rollout import PolicySampler, encode_prompts, sampling_params
from gspo.tasks.calculator import evaluate_expression
from gspo.tasks.data import Example
from gspo.tasks.env import EnvError, tool_schemas

MADE = []  # every instance the factory made, in order


class CalculatorToolEnv:
    """As a TRL user writes it for GRPOTrainer(environment_factory=CalculatorToolEnv)."""

    def __init__(self):
        self.calls, self.row = [], None
        MADE.append(self)

    def reset(self, **kwargs) -> str | None:
        self.row = kwargs
        return kwargs.get("hint")

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression of integers with +, -, * and parentheses.

        Args:
            expression: the expression to evaluate, e.g. "37*48+12"
        """
        self.calls.append(expression)
        return str(evaluate_expression(expression))

    def get_reward(self) -> float:
        return 0.5 * len(self.calls)

    def _helper(self):  # private: not a tool
        return None


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_policy("tiny-tool")


def calc_examples(n, hint=None):
    out = []
    for i in range(n):
        expr = f"{12 + i}*{34 + i}"
        cols = {"answer": str(evaluate_expression(expr)), "form": "a*b", **({"hint": hint} if hint else {})}
        out.append(Example([{"role": "user", "content": expr + "="}], cols["answer"], cols, f"row {i}"))
    return out


def test_tools_are_the_public_methods_and_render_as_trl_renders_them(tiny):
    _, tok = tiny
    env = trl_environment(CalculatorToolEnv)
    assert [f.__name__ for f in env.tools] == ["calculator"]  # not reset, get_reward or _helper
    prompt = [{"role": "user", "content": "12*34="}]
    # TRL: apply_chat_template(conversation, tools=<the bound methods>): transformers makes their schemas
    trl_text = tok.apply_chat_template(prompt, tools=tool_methods(CalculatorToolEnv()), add_generation_prompt=True,
                                       tokenize=False)
    ours = encode_prompts(tok, [prompt], tools=tool_schemas(list(env.tools)))[0]
    assert tok.decode(ours) == trl_text and trl_text.startswith("<|im_start|>system\ntools: calculator(expression)")


def test_episodes_reset_on_the_row_call_their_own_instance_and_get_their_reward(tiny):
    model, tok = tiny
    MADE.clear()
    env = trl_environment(CalculatorToolEnv)
    stop = (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
    params = sampling_params(tok, stop=stop, group_size=4, max_new_tokens=80, temperature=0.0)
    examples = calc_examples(2)
    ro, ep = run_episodes(PolicySampler(model), tok, examples, EpisodeSpec(env, max_turns=3), params)
    episodes = MADE[1:]  # the first is trl_environment's probe (TRL makes one too, at __init__)
    assert len(episodes) == 8 and ep.envs == episodes  # one instance per rollout, given to the rewards
    for b, inst in enumerate(episodes):
        ex = examples[b // 4]
        assert inst.row == {"prompt": ex.prompt, "answer": ex.answer, "form": "a*b"}  # the whole row
        # the greedy tiny-tool calls the tool with the problem: on this instance, once
        assert inst.calls == [ex.prompt[0]["content"].rstrip("=")]
        assert sum(ep.turn_rewards[b]) == 0.5 * len(inst.calls)  # get_reward(), weight 1, once
    text = ep.transcripts[0]
    assert "<tool_response>" + str(evaluate_expression("12*34")) + "</tool_response>" in text


def test_a_string_from_reset_is_appended_to_the_prompt(tiny):
    model, tok = tiny
    env = trl_environment(CalculatorToolEnv)
    params = sampling_params(tok, group_size=2, max_new_tokens=4, temperature=0.0)
    ro, _ = run_episodes(PolicySampler(model), tok, calc_examples(1, hint=" use the tool."), EpisodeSpec(env), params)
    for b in range(2):
        prompt = tok.decode(ro.prompt_ids[b][ro.prompt_mask[b].bool()])
        assert "12*34= use the tool.<|im_end|>" in prompt


def test_reset_states_the_task_in_an_empty_prompt_as_trl_joins_it(tiny):
    # TRL (grpo_trainer.py): `prompt[-1]["content"] + observation`, no separator, its stand-in prompt for an
    # environment that owns the task `[{"role": "user", "content": ""}]`: the message is reset's string alone
    model, tok = tiny
    env = trl_environment(CalculatorToolEnv)
    params = sampling_params(tok, group_size=2, max_new_tokens=4, temperature=0.0)
    rows = [Example([{"role": "user", "content": content}], None, {"hint": "12*34="}, "row 0") for content in ("", "x")]
    ro, _ = run_episodes(PolicySampler(model), tok, rows, EpisodeSpec(env), params)
    seen = [tok.decode(ro.prompt_ids[b][ro.prompt_mask[b].bool()]) for b in (0, 2)]
    head, tail = "<|im_start|>system\ntools: calculator(expression)<|im_end|>\n<|im_start|>user\n", \
        "<|im_end|>\n<|im_start|>assistant\n"
    assert seen == [head + "12*34=" + tail, head + "x12*34=" + tail]


def test_refused_in_one_line():
    class NoDoc:
        def reset(self, **kw):
            return None

        def tool(self, x: int) -> int:
            return x

    with pytest.raises(EnvError, match=r"^environment_factory NoDoc: 'tool'.*docstring"):
        trl_environment(NoDoc)
    with pytest.raises(EnvError, match="a dict of factories"):
        trl_environment({"calc": CalculatorToolEnv})
    with pytest.raises(ConfigError, match="env and environment_factory: pass one"):
        gspo.Trainer(env=CalculatorToolEnv, environment_factory=CalculatorToolEnv)


@pytest.mark.slow  # trains
def test_the_trainer_takes_environment_factory_and_rewards_get_environments(tmp_path):
    seen = []

    def reward_func(environments, completions, **kwargs):  # TRL's pattern (examples/grpo_echo)
        seen.append(list(environments))
        return [float(len(e.calls) > 0) for e in environments]

    cfg = gspo.TrainConfig(task="calculator", steps=1, prompts_per_step=2, group_size=2, max_new_tokens=80,
                           eval_size=4, progress=False, output_dir=str(tmp_path / "run"))
    summary = gspo.Trainer(cfg, environment_factory=CalculatorToolEnv, reward_funcs=[reward_func]).train()
    assert summary["plan"]["env"] == "CalculatorToolEnv"
    assert all(isinstance(e, CalculatorToolEnv) for batch in seen for e in batch) and len(seen[0]) == 4
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/env/mean" in row and "reward/reward_func/mean" in row


@pytest.mark.slow  # starts a process
def test_gspo_train_env_names_a_trl_class(tmp_path):
    f = tmp_path / "trl_env.py"
    f.write_text(Path(__file__).read_text().split("MADE = []")[0].split('"""', 2)[2]
                 + "MADE = []\n\n" + _source_of_class())
    cmd = [sys.executable, "-m", "gspo", "train", "--task", "calculator", "--env", f"{f}:CalculatorToolEnv",
           "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "0", "--no-progress",
           "--output-dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "env CalculatorToolEnv (up to 3 turns)" in p.stdout + p.stderr


def _source_of_class() -> str:
    src = Path(__file__).read_text()
    start = src.index("class CalculatorToolEnv:")
    return src[start:src.index("@pytest.fixture")]
