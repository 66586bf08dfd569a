"""Multi-turn episodes: environments, tools, the episode layout, masks, per-turn advantages, runs."""

import json
import math
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from gspo.algo.advantages import group_advantages, turn_advantages
from gspo.config import TrainConfig
from gspo.io.files import read_jsonl
from gspo.models.loading import load_policy
from gspo.models.logprobs import token_logprobs
from gspo.models.sequences import Rollout, left_pad
from gspo.models.tiny import build_chat_tokenizer
from gspo.sampling.episodes import Draws, EpisodeSpec, run_episodes
from gspo.sampling.rollout import PolicySampler, sampling_params, stop_token_ids
from gspo.tasks.calculator import CalculatorEnv, CalculatorTask, calculator
from gspo.tasks.env import (
    EnvError,
    Environment,
    Step,
    ToolEnvironment,
    episode_env,
    load_env,
    observation_text,
    tool_schemas,
)
from gspo.train import checkpoint as ckpt
from gspo.train.steplog import episode_metrics

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37*48+12"}}</tool_call>'
MODEL = os.environ.get("GSPO_TEST_TOOL_MODEL", "tiny-tool")
FAST = ["--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8", "--no-progress", "--steps", "2"]


class ScriptedSampler:
    """A Sampler that answers turn k of every episode with `turns[k]` (log-prob -0.5 a token)."""

    def __init__(self, tokenizer, turns):
        self.tok, self.turns, self.calls = tokenizer, turns, 0

    def sync(self, policy, version=None):
        pass

    def sample(self, prompts, params, *, generator=None, rows=None):
        ids = self.tok(self.turns[self.calls], add_special_tokens=False)["input_ids"]
        self.calls += 1
        G, n = params.group_size, len(ids)
        p_ids, p_mask = left_pad(prompts, self.tok.pad_token_id)
        B = len(prompts) * G
        return Rollout(p_ids.repeat_interleave(G, 0), p_mask.repeat_interleave(G, 0), torch.tensor([ids] * B),
                       torch.ones(B, n), torch.full((B, n), -0.5), torch.full((B,), n),
                       torch.zeros(B, dtype=torch.bool), G)


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def tool_model():
    return load_policy(MODEL)


def test_scripted_episode_is_the_chat_templates_conversation(tok):
    # two turns: a tool call, then the answer; the episode's tokens are exactly the chat
    # template's rendering of the whole conversation, model tokens and environment tokens
    # marked apart, log-probs recorded for the model's only
    ex = CalculatorTask().test_set(1)[0]
    ex.prompt = [{"role": "user", "content": "37*48+12="}]
    ex.answer = "1788"
    sampler = ScriptedSampler(tok, [CALL + "<|im_end|>", "1788<|im_end|>"])
    params = sampling_params(tok, group_size=2, max_new_tokens=80)
    ro, ep = run_episodes(sampler, tok, [ex], EpisodeSpec(CalculatorEnv, max_turns=3), params)
    messages = [ex.prompt[0],
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "calculator", "arguments": {"expression": "37*48+12"}}}]},
                {"role": "tool", "content": "1788"}, {"role": "assistant", "content": "1788"}]
    expected = tok.apply_chat_template(messages, tools=tool_schemas([calculator]), tokenize=False)
    expected = expected[:-1]  # the template's "\n" after the last <|im_end|>: the model never writes it
    for b in range(2):
        n = int(ro.lengths[b])
        seen = torch.cat([ro.prompt_ids[b][ro.prompt_mask[b] > 0], ro.completion_ids[b, :n]]).tolist()
        assert tok.decode(seen) == expected
        model = tok.decode(ro.completion_ids[b][ro.completion_mask[b] > 0].tolist())
        env = tok.decode(ro.completion_ids[b][ro.env_mask[b] > 0].tolist())
        assert model == CALL + "<|im_end|>" + "1788<|im_end|>"
        assert env == "\n<|im_start|>tool\n<tool_response>1788</tool_response><|im_end|>\n<|im_start|>assistant\n"
        assert (ro.completion_mask[b] * ro.env_mask[b]).sum() == 0  # a token is the model's or the env's
        assert (ro.logp[b][ro.completion_mask[b] > 0] == -0.5).all() and (ro.logp[b][ro.env_mask[b] > 0] == 0).all()
    assert ep.final_texts == ["1788", "1788"] and ep.turns.tolist() == [2, 2] and ep.tool_calls.tolist() == [1, 1]
    assert ep.turn_index[0][ro.completion_mask[0] > 0].unique().tolist() == [0, 1]
    assert sampler.calls == 2 and not ro.truncated.any()


def test_observation_text_closes_the_turn_and_opens_the_next(tok):
    schemas = tool_schemas([calculator])
    msgs = [{"role": "tool", "content": "5"}]
    tail = "\n<|im_start|>tool\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert observation_text(tok, msgs, schemas, "<|im_end|>") == tail
    assert observation_text(tok, msgs, schemas, None) == "<|im_end|>" + tail  # a turn cut short is closed for it


def test_tool_errors_become_observations():
    def div(a: int, b: int) -> str:
        """Divide.

        Args:
            a: numerator
            b: denominator
        """
        return str(a // b)

    env = ToolEnvironment()
    env.tools = [div]
    step = env.step('<tool_call>{"name": "div", "arguments": {"a": 7, "b": 2}}</tool_call>'
                    '<tool_call>{"name": "div", "arguments": {"a": 1, "b": 0}}</tool_call>'
                    '<tool_call>{"name": "mul", "arguments": {}}</tool_call><tool_call>{not json</tool_call>')
    contents = [m["content"] for m in step.messages]
    assert contents[0] == "3"
    assert contents[1] == "error: ZeroDivisionError: integer division or modulo by zero"
    assert contents[2] == "error: unknown tool 'mul' (tools: div)"
    assert contents[3].startswith("error: the tool call is not valid JSON")
    assert (step.tool_calls, step.tool_errors, step.done) == (4, 3, False)
    assert env.step("42").done  # no tool call: the answer ends the episode


def test_a_tool_over_its_timeout_is_an_error_observation():
    release = threading.Event()

    def wait(seconds: float) -> str:
        """Wait, or return early when released.

        Args:
            seconds: how long
        """
        release.wait(seconds)
        return "waited"

    def fail() -> str:
        """Fail."""
        raise RuntimeError("no")

    env = ToolEnvironment()
    env.tools, env.tool_timeout = [wait, fail], 0.2
    try:
        step = env.step('<tool_call>{"name": "wait", "arguments": {"seconds": 60}}</tool_call>'
                        '<tool_call>{"name": "wait", "arguments": {"seconds": 0}}</tool_call>'
                        '<tool_call>{"name": "fail", "arguments": {}}</tool_call>')
    finally:
        release.set()  # the timed-out call's thread ends
    assert [m["content"] for m in step.messages] == ["error: TimeoutError: the tool ran over 0.2 s", "waited",
                                                     "error: RuntimeError: no"]  # raised in its thread, said alike
    assert (step.tool_calls, step.tool_errors) == (3, 2)


class SlowEnv(Environment):
    """A step that waits (I/O-like), reports its thread, and answers with the episode's row."""

    concurrency = 8
    threads: set = set()

    def reset(self, example):
        self.k = 0

    def step(self, text):
        SlowEnv.threads.add(threading.current_thread().name)
        time.sleep(0.05)
        self.k += 1
        return Step([{"role": "user", "content": f"{text[:3]} again"}], reward=0.5 * self.k, done=self.k == 2)


class SequentialSlowEnv(SlowEnv):
    concurrency = 1


def test_concurrent_steps_give_the_sequential_episodes(tok):
    # 8 episodes' steps at once in threads give exactly the episodes that one after another give
    ex = CalculatorTask().test_set(1)[0]
    params = sampling_params(tok, group_size=8, max_new_tokens=80)
    out = {}
    for env_cls in (SequentialSlowEnv, SlowEnv):
        SlowEnv.threads = set()
        sampler = ScriptedSampler(tok, ["12<|im_end|>", "34<|im_end|>"])
        out[env_cls] = run_episodes(sampler, tok, [ex], EpisodeSpec(env_cls, max_turns=3), params), SlowEnv.threads
    (ro_a, ep_a), threads_a = out[SequentialSlowEnv]
    (ro_b, ep_b), threads_b = out[SlowEnv]
    assert threads_a == {"MainThread"} and len(threads_b) > 1 and "MainThread" not in threads_b
    assert torch.equal(ro_a.completion_ids, ro_b.completion_ids) and torch.equal(ro_a.env_mask, ro_b.env_mask)
    assert ep_a.transcripts == ep_b.transcripts and ep_a.turn_rewards == ep_b.turn_rewards == [[0.5, 1.0]] * 8
    assert "12 again" in ep_b.transcripts[0]


def test_concurrency_and_tool_timeout_are_checked(tok):
    task = CalculatorTask()
    for attrs, message in [({"concurrency": 0}, "env Bad: concurrency must be an int >= 1 (got 0)"),
                           ({"concurrency": 2.5}, "env Bad: concurrency must be an int >= 1 (got 2.5)"),
                           ({"tool_timeout": -1}, "env Bad: tool_timeout must be None or seconds > 0 (got -1)")]:
        with pytest.raises(EnvError) as e:
            episode_env(type("Bad", (ToolEnvironment,), attrs), task, 3, tok)
        assert str(e.value) == message
    ok = type("Ok", (ToolEnvironment,), {"concurrency": 4, "tool_timeout": 0.5})
    assert episode_env(ok, task, 3, tok) == (ok, 3)


def test_load_env_errors_are_one_line(tmp_path):
    with pytest.raises(EnvError, match="no such file"):
        load_env(str(tmp_path / "nope.py") + ":Env")
    (tmp_path / "e.py").write_text("class NotAnEnv:\n    pass\n\ndef f(x):\n    return x\n\n"
                                   "from gspo.tasks.env import ToolEnvironment\n"
                                   "class Bad(ToolEnvironment):\n    tools = [f]\n")
    with pytest.raises(EnvError, match="has no step"):
        load_env(f"{tmp_path / 'e.py'}:NotAnEnv")
    with pytest.raises(EnvError, match="has no 'Missing'"):
        load_env(f"{tmp_path / 'e.py'}:Missing")
    with pytest.raises(EnvError, match="tool 'f'.*type hints"):
        load_env(f"{tmp_path / 'e.py'}:Bad")
    with pytest.raises(EnvError, match="expected path"):
        load_env("no_colon")


def test_calculator_tool_and_task():
    assert calculator("37*48+12") == "1788" and calculator("(12+30)*45") == "1890"
    with pytest.raises(ValueError, match="only integers"):
        calculator("2**100")
    task = CalculatorTask()
    test = task.test_set()
    assert len(test) == 500 and len({json.dumps(e.prompt) for e in test}) == 500
    train = task.train_batch(3, 64, seed=0)
    assert not {json.dumps(e.prompt) for e in train} & {json.dumps(e.prompt) for e in test}
    assert train == task.train_batch(3, 64, seed=0) and train != task.train_batch(4, 64, seed=0)
    assert {e.columns["form"] for e in test} == {"a*b", "a*b+c", "a*b-c", "(a+b)*c"}
    for e in test[:50]:
        assert calculator(e.prompt[0]["content"][:-1]) == e.answer


class Guess(Environment):
    """docs/multiturn.md's Guess, its target fixed at 34: -0.1 a wrong guess, 1 and done when right."""

    def reset(self, example):
        self.target = 34

    def step(self, text):
        guess = int(text) if text.strip().isdigit() else -1
        if guess == self.target:
            return Step(reward=1.0, done=True)
        return Step([{"role": "user", "content": "higher" if guess < self.target else "lower"}], reward=-0.1)


def test_evaluation_reward_adds_the_environments_turn_rewards(tok, monkeypatch):
    # two episodes, each guessing 12, 20 (wrong: -0.1 each), then 34 (right: +1, done):
    #   environment's reward  -0.1 - 0.1 + 1.0        = 0.8
    #   final turn "34": is_34 = 1 (weight 1), length = len("34") / 10 = 0.2 (weight 0.5)
    #   episode reward        1 * 1 + 0.5 * 0.2 + 0.8 = 1.9, as training's score gives it
    from gspo.rewards.builtin import Reward
    from gspo.sampling.produce import score
    from gspo.tasks.scoring import per_completion
    from gspo.train import evaluation

    rewards = [Reward("is_34", per_completion(lambda c, **_: float(c == "34"))),
               Reward("length", per_completion(lambda c, **_: len(c) / 10), weight=0.5)]
    turns = ["12<|im_end|>", "20<|im_end|>", "34<|im_end|>"]
    monkeypatch.setattr(evaluation, "PolicySampler", lambda model: ScriptedSampler(tok, turns))
    options = evaluation.EvalOptions(n=2, max_new_tokens=16, stop=stop_token_ids(tok),
                                     episode=EpisodeSpec(Guess, max_turns=3))
    res = evaluation.evaluate(None, tok, CalculatorTask(), rewards, options)
    assert res["accuracy"] == 1.0 and res["n_scored"] == 2  # the first reward's verdict on the final turn
    assert res["reward_env"] == pytest.approx(0.8, rel=1e-6)
    assert res["reward"] == pytest.approx(1.9, rel=1e-6)
    # the same episodes scored as a training step scores them
    examples = CalculatorTask().test_set(2)
    _, ep = run_episodes(ScriptedSampler(tok, turns), tok, examples, EpisodeSpec(Guess, max_turns=3),
                         sampling_params(tok, group_size=1, max_new_tokens=16))
    total, parts = score(rewards, examples, ep.final_texts, ep.final_ids, 1, ep)
    assert res["reward"] == pytest.approx(total.mean().item(), rel=1e-6)
    assert res["reward_env"] == pytest.approx(sum(parts["env"]) / 2, rel=1e-6)
    # without an environment there is no reward_env
    assert "reward_env" not in evaluation._result(dict.fromkeys(("acc", "scored", "total", "env", "nonbinary"), 0.0),
                                                  n=1, k=0, metric="is_34")


def test_turn_advantages_by_hand():
    # one group of two episodes. A: env rewards 0.5 (turn 1) and 0 (turn 2), final reward 1:
    # R_A = (1.5, 1.0); B: one turn, env 0.5, final 0: R_B = (0.5, 0). Baseline mean(1.5, 0.5) = 1,
    # std = sqrt((0.5² + 0.5²) / 1) = 0.70711: Â_A = (0.5/0.70711, 0/0.70711) = (0.70711, 0),
    # Â_B,1 = -0.5/0.70711 = -0.70711 (B's second column is never used)
    returns = torch.tensor([[1.5, 1.0], [0.5, 0.0]])
    adv = turn_advantages(returns, 2)
    assert adv[0].tolist() == pytest.approx([0.70711, 0.0], abs=1e-5)
    assert adv[1, 0].item() == pytest.approx(-0.70711, abs=1e-5)
    # rewards only at the end: every turn gets the episode's advantage
    final = torch.tensor([1.0, 0.0, 0.0, 1.0])
    per_turn = turn_advantages(final[:, None].expand(4, 3), 2)
    assert torch.equal(per_turn.float(), group_advantages(final, 2)[:, None].expand(4, 3))
    assert (turn_advantages(torch.ones(2, 3), 2) == 0).all()  # equal episode rewards: no signal


class CountingEnv(Environment):
    """Answers every turn with a user message; reward 0.25 per turn; done after two turns."""

    def reset(self, example):
        self.k = 0

    def step(self, text):
        self.k += 1
        return Step([{"role": "user", "content": f"again {self.k}"}], reward=0.25 * self.k, done=self.k == 2)


def test_an_episode_ended_by_the_turn_limit_is_flagged_not_truncated(tok):
    # CountingEnv is done after its second turn: with max_turns 1 the limit ends the episodes
    # (turn_limit), with 2 the environment does; neither is truncated (every turn ended)
    ex = CalculatorTask().test_set(1)[0]
    params = sampling_params(tok, group_size=2, max_new_tokens=80)
    for max_turns, limited in [(1, True), (2, False)]:
        sampler = ScriptedSampler(tok, ["12<|im_end|>", "34<|im_end|>"])
        ro, ep = run_episodes(sampler, tok, [ex], EpisodeSpec(CountingEnv, max_turns=max_turns), params)
        assert ep.turns.tolist() == [max_turns] * 2 and ep.turn_limit.tolist() == [limited] * 2
        assert not ro.truncated.any()
        batch = SimpleNamespace(episodes=ep, rollout=ro, episode_of=None)
        m = episode_metrics(batch, max_turns, SimpleNamespace(gather=lambda t: t))
        assert m["episode/turn_limit_frac"] == float(limited) and m["episode/turns"] == max_turns
        assert m["episode/turn_1_reward"] == 0.25 and m.get("episode/turn_2_reward") == (None if limited else 0.5)


def test_recomputed_logprobs_equal_the_sampled_ones_over_episodes(tool_model, tok):
    # the context of every turn (prompt, earlier turns, observations) is laid out for training
    # exactly as it was sampled: recomputed log-probs of the model's tokens equal the recorded
    # ones, so on-policy ratios are 1 (float rounding only), over two-turn episodes
    model, tokenizer = tool_model
    examples = CalculatorTask().test_set(4)
    params = sampling_params(tokenizer, group_size=4, max_new_tokens=80)
    gen = torch.Generator().manual_seed(0)
    ro, ep = run_episodes(PolicySampler(model), tokenizer, examples, EpisodeSpec(CountingEnv, max_turns=3), params,
                          Draws(generator_for=lambda turn: gen))
    assert (ep.turns == 2).sum() >= 8 and ro.env_mask.sum() > 0
    logp, _ = token_logprobs(model, ro, temperature=1.0)
    on = ro.completion_mask > 0
    # the single-turn rollout tests' tolerance: cached decoding and one full forward round apart
    # by ~1e-7 per token (the odd token ~2e-5 on AVX-512); hiding one observation token from the
    # context moves the later log-probs by ~2 nats (median, measured)
    torch.testing.assert_close(logp[on], ro.logp[on], rtol=1e-5, atol=1e-5)
    assert (logp[~on] == 0).all()
    ratio = torch.exp(((logp - ro.logp) * ro.completion_mask).sum(1) / ro.completion_mask.sum(1))
    assert (ratio - 1).abs().max() < 1e-5
    assert ep.turn_rewards[0][:2] == [0.25, 0.5] or ro.truncated[0]


def _batch(tmp_path, **kw):
    from gspo.sampling.produce import rollout, score
    from gspo.tasks.scoring import Scored
    from gspo.train.batch import prepare
    from gspo.train.run import build_run

    cfg = TrainConfig(task="calculator", model=MODEL, prompts_per_step=4, group_size=4, num_minibatches=1,
                      output_dir=str(tmp_path / "run"), progress=False, **kw)
    run = build_run(cfg)
    examples = run.task.train_batch(1, 4, 0)
    ro, texts, ids, ep = rollout(run, examples, 1)
    rewards, parts = score(run.rewards, examples, texts, ids, 4, ep)
    return run, prepare(run, ro, Scored(rewards=rewards, parts=parts, examples=examples, completions=texts,
                                        episodes=ep))


@pytest.mark.slow  # 2 s
@pytest.mark.parametrize("algorithm", ["gspo", "grpo", "gspo_token"])
def test_environment_tokens_never_reach_the_loss(tmp_path, algorithm):
    # huge log-prob changes on environment tokens, new and old, leave the loss, every metric
    # and every gradient exactly as they were
    from gspo.train.trainer import Totals, minibatch_loss

    run, batch = _batch(tmp_path, algorithm=algorithm, old_logp="recompute", env="tests/test_multiturn.py:CountingEnv")
    env = batch.rollout.env_mask > 0
    assert env.any()
    idx = torch.arange(16)
    total = Totals(16.0, float(batch.rollout.completion_mask.sum()))

    def loss_and_grads():
        run.policy.zero_grad()
        loss, _, metrics = minibatch_loss(run, batch, idx, total)
        loss.backward()
        return loss.item(), metrics, {n: p.grad.clone() for n, p in run.policy.named_parameters() if p.grad is not None}

    with torch.no_grad():  # off-policy, so that ratios move and clip
        batch.old_logp += 0.5 * torch.randn(batch.old_logp.shape, generator=torch.Generator().manual_seed(0))
        batch.old_logp *= batch.rollout.completion_mask
    base = loss_and_grads()
    forward = run.train_model.forward

    def shifted(mb, **kw):  # the training forward's log-probs, +80 on every environment token
        logp, hidden, entropy = forward(mb, **kw)
        return logp + 80.0 * mb.env_mask, hidden, entropy

    run.train_model.forward = shifted
    batch.old_logp = batch.old_logp - 80.0 * env
    batch.rollout.logp = batch.rollout.logp + 50.0 * env
    after = loss_and_grads()
    assert after[0] == base[0] and base[1]["clip/frac"] > 0
    assert {k: float(v) for k, v in after[1].items()} == {k: float(v) for k, v in base[1].items()}
    assert after[2].keys() == base[2].keys() and all(torch.equal(after[2][n], base[2][n]) for n in base[2])


class RewardPerTurnEnv(CountingEnv):
    """CountingEnv with a reward of 1 in the first turn for a tool call, else 0."""

    def step(self, text):
        step = super().step(text)
        step.reward = float("<tool_call>" in text) if self.k == 1 else 0.0
        return step


def test_turn_advantages_in_the_batch(tmp_path):
    env_file = tmp_path / "env.py"
    env_file.write_text("from tests.test_multiturn import RewardPerTurnEnv\n")
    run, batch = _batch(tmp_path, algorithm="gspo_token", turn_advantages=True, env=f"{env_file}:RewardPerTurnEnv")
    ep, ro = batch.episodes, batch.rollout
    final = batch.rewards.double() - ep.env_reward.double()
    to_go = final[:, None] + ep.rewards_to_go(run.max_turns)
    per_turn = turn_advantages(to_go, 4)
    assert batch.advantages.shape == ro.completion_mask.shape
    for b in range(16):
        for k in range(int(ep.turns[b])):
            cols = (ep.turn_index[b] == k) & (ro.completion_mask[b] > 0)
            assert torch.allclose(batch.advantages[b][cols], per_turn[b, k].float().expand(int(cols.sum())))
    assert (batch.advantages[ep.turn_index < 0] == 0).all()
    differ = [(b, k) for b in range(16) for k in range(1, int(ep.turns[b]))
              if abs(per_turn[b, k] - per_turn[b, 0]) > 1e-6]
    assert differ, "a first-turn reward must make the turns' advantages differ"


def test_ppo_gae_runs_over_the_models_tokens_only(tmp_path):
    from gspo.algo.advantages import gae

    run, batch = _batch(tmp_path, algorithm="ppo", env="tests/test_multiturn.py:CountingEnv")
    ro = batch.rollout
    assert (batch.advantages[ro.env_mask > 0] == 0).all() and (batch.returns[ro.env_mask > 0] == 0).all()
    b = int(torch.argmax(ro.env_mask.sum(1)))  # an episode with environment tokens between turns
    on = ro.completion_mask[b] > 0
    n = int(on.sum())
    adv, ret = gae(batch.rewards[b:b + 1], batch.old_values[b:b + 1, on], torch.ones(1, n), gamma=1.0, lam=0.95)
    # the last model token's return is the episode's reward (γ = 1, terminal), whatever env tokens follow
    assert batch.returns[b, on][-1].item() == pytest.approx(batch.rewards[b].item(), abs=1e-6)
    assert torch.allclose(batch.returns[b, on], ret[0], atol=1e-6)


def _train(*args):
    from gspo.cli import main

    return main(["train", *args])


@pytest.mark.slow  # trains
def test_user_environment_file_with_a_raising_tool(tmp_path, capsys):
    env_file = tmp_path / "broken_env.py"
    env_file.write_text(
        "from gspo.tasks.env import ToolEnvironment\n\n"
        "def calculator(expression: str) -> str:\n"
        "    \"\"\"Always fails.\n\n    Args:\n        expression: ignored\n    \"\"\"\n"
        "    raise RuntimeError('the calculator is broken')\n\n"
        "class BrokenCalculator(ToolEnvironment):\n    tools = [calculator]\n")
    out = tmp_path / "run"
    assert _train("--task", "calculator", "--model", MODEL, "--env", f"{env_file}:BrokenCalculator",
                  *FAST, "--samples-per-step", "16", "--output-dir", str(out)) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(r["episode/tool_calls"] > 0 and r["episode/tool_error_rate"] == 1.0 for r in rows)
    samples = read_jsonl(out / "samples.jsonl")
    # (tiny-tool's character vocabulary has no capitals: "RuntimeError" reads "<unk>untime<unk>rror")
    assert any("<tool_response>error: <unk>untime<unk>rror: the calculator is broken</tool_response>" in s["episode"]
               for s in samples)


@pytest.mark.parametrize("args,message", [
    (["--task", "arithmetic", "--max-turns", "3"], "max_turns: 3 turns need an environment"),
    (["--task", "calculator", "--model", "tiny"],
     "task calculator: prompts are chat messages but the tokenizer of tiny has no chat template"),
    (["--task", "calculator", "--model", MODEL, "--turn-advantages"], "turn_advantages: needs a token-level"),
    (["--task", "calculator", "--model", MODEL, "--env", "nowhere.py:Env"], "no such file nowhere.py"),
])
def test_bad_multi_turn_options_are_one_line_errors(tmp_path, capsys, args, message):
    assert _train(*args, *FAST, "--output-dir", str(tmp_path / "run")) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # trains
def test_a_raising_environment_is_one_line(tmp_path, capsys):
    env_file = tmp_path / "e.py"
    env_file.write_text("from gspo.tasks.env import Environment\nclass Crash(Environment):\n"
                        "    def step(self, text):\n        raise KeyError('state')\n")
    assert _train("--task", "calculator", "--model", MODEL, "--env", f"{env_file}:Crash", *FAST,
                  "--output-dir", str(tmp_path / "run")) != 0
    err = capsys.readouterr().err.strip()
    assert "env Crash: step on calculator test problem 1 raised KeyError: 'state'" in err  # the evaluation's first row
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
def test_multi_turn_run_resumed_mid_run_matches_an_uninterrupted_one(tmp_path):
    args = ["--task", "calculator", "--model", MODEL, *FAST[:-2], "--save-every", "1"]
    assert _train(*args, "--steps", "3", "--output-dir", str(tmp_path / "full")) == 0
    assert _train(*args, "--steps", "2", "--output-dir", str(tmp_path / "part")) == 0
    assert _train("--resume", str(tmp_path / "part"), "--steps", "3") == 0
    a, b = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("full", "part"))
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert drop(a) == drop(b) and len(a) == 3 and a[0]["episode/turns"] > 1
    from safetensors.torch import load_file

    wa, wb = (load_file(ckpt.latest_checkpoint(tmp_path / d) / "model.safetensors") for d in ("full", "part"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_multi_turn_two_processes_match_one(tmp_path):
    from tests.test_distributed import assert_same_metrics, assert_same_weights, metrics, one_process, torchrun, weights

    args = ["--task", "calculator", "--model", MODEL, "--prompts-per-step", "8", "--group-size", "4",
            "--eval-size", "16", "--no-progress", "--steps", "2", "--save-every", "0"]
    r1 = one_process(*args, "--output-dir", str(tmp_path / "one"))
    assert r1.returncode == 0, r1.stderr
    r2 = torchrun(*args, "--output-dir", str(tmp_path / "two"))
    assert r2.returncode == 0, r2.stderr[-3000:]
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert a[0]["episode/turns"] > 1 and not math.isnan(a[0]["episode/env_tokens"])
    assert_same_metrics(a, b)
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "two"))


@pytest.mark.slow  # starts a process
def test_cli_help_lists_the_multi_turn_options():
    out = subprocess.run([sys.executable, "-m", "gspo", "train", "--help"], capture_output=True, text=True).stdout
    for flag in ("--env", "--max-turns", "--max-episode-tokens", "--turn-advantages"):
        assert flag in out
