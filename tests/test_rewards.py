"""Rewards: built-ins by table, math-verify cases, user rewards, weights, misbehaving rewards, TRL's
calling convention (TRL's documented reward functions, verbatim), and rewards that score nothing."""

import math
import re

import pytest

from gspo.rewards.builtin import (
    Reward,
    apply_rewards,
    exact_match,
    format_reward,
    length_penalty,
    load_reward,
    load_rewards,
    math_verify,
    numeric_match,
    score_completions,
)
from gspo.tasks.data import Example
from gspo.tasks.scoring import RewardError

# a GSM8K answer column: the worked solution, the final answer after "####"
GSM8K = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
         "Natalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72")


@pytest.mark.parametrize("completion,answer,expected", [
    ("Paris", "Paris", 1.0), ("  Paris\n", "Paris", 1.0), ("paris", "Paris", 0.0), ("Paris.", "Paris", 0.0),
    ("42", 42, 1.0), ("42.0", 42, 0.0), ("", "", 0.0), ("x", None, 0.0),
    ("72", GSM8K, 0.0),  # exact_match compares the whole answer: a worked solution is not "72"
])
def test_exact_match(completion, answer, expected):
    assert exact_match([completion], answer=[answer]) == [expected]


@pytest.mark.parametrize("completion,answer,expected", [
    ("The answer is 42", "42", 1.0), ("42.0", 42, 1.0), ("1,250", "1250", 1.0), ("total: 3.5.", 3.5, 1.0),
    ("41 then 42", "42", 1.0), ("42 then 41", "42", 0.0), ("-7", "-7", 1.0), ("1e3", 1000, 1.0),
    ("no number", "1", 0.0), ("5", "five", 0.0),
    # relative tolerance 1e-6: 0.30000001 is 3.3e-8 away (match), 0.3001 is 3.3e-4 away (no match)
    ("0.30000001", 0.3, 1.0), ("0.3001", 0.3, 0.0),
    # GSM8K: the gold answer is what follows the last "####" (72), not the solution's other numbers
    ("She sold 72 clips.", GSM8K, 1.0), ("#### 72", GSM8K, 1.0), ("24", GSM8K, 0.0), ("1 #### 2 #### 3", "#### 3", 1.0),
])
def test_numeric_match(completion, answer, expected):
    assert numeric_match([completion], answer=[answer]) == [expected]


MATH_CASES = [
    (r"The answer is $\boxed{\frac{1}{2}}$", "0.5", 1.0),
    (r"$\frac{2}{4}$", r"\frac{1}{2}", 1.0),
    ("so x = 3", "3", 1.0),
    (r"\boxed{3}", "4", 0.0),
    (r"$\sqrt{4}$", "2", 1.0),
    (r"$\boxed{2\pi}$", r"2\pi", 1.0),
    ("I don't know", "7", 0.0),
    (r"$\boxed{(1, 2)}$", "(1,2)", 1.0),
    (r"$x^2 + 2x + 1$", "(x+1)^2", 1.0),
    (r"So she sold $\boxed{72}$ clips.", GSM8K, 1.0),  # the part after "####"
    (r"$\boxed{24}$", GSM8K, 0.0),
]


@pytest.mark.parametrize("completion,answer,expected", MATH_CASES)
def test_math_verify_table(completion, answer, expected):
    assert math_verify([completion], answer=[answer]) == [expected]


def test_format_and_length():
    f = format_reward(r"<think>.*?</think>\s*<answer>.*?</answer>")
    assert f(["<think>hmm</think> <answer>4</answer>", "<answer>4</answer>",
              "<think>a\nb</think><answer>4</answer>"]) == [1.0, 0.0, 1.0]
    # 2 of 8 tokens -> -0.25; 8 of 8 -> -1; more is capped at -1
    assert length_penalty(8)(["", "", ""],
                             completion_ids=[[1, 2], list(range(8)), list(range(20))]) == [-0.25, -1.0, -1.0]


def test_chat_completions_reach_rewards_as_messages():
    ex = Example([{"role": "user", "content": "2+2?"}], "4", {"answer": "4", "topic": "math"}, "d.jsonl line 1")
    seen = {}

    def spy(completions, **kw):
        seen.update(kw, completions=completions)
        return [1.0] * len(completions)

    from gspo.rewards.builtin import Reward

    total, per = score_completions([Reward("spy", spy), Reward("exact_match", exact_match)], [ex], ["4", "5"],
                                   [[1], [2]], 2)
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    assert seen["topic"] == ["math", "math"] and seen["answer"] == ["4", "4"]
    assert seen["prompts"] == [ex.prompt, ex.prompt] and seen["completion_ids"] == [[1], [2]]
    assert per == {"spy": [1.0, 1.0], "exact_match": [1.0, 0.0]}
    assert total == [2.0, 1.0]


def test_user_rewards_from_file_and_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(completions, **kw):\n    return [1.0 / (1 + len(c)) for c in completions]\n"
        "NOT_CALLABLE = 3\n")
    r = load_reward(f"{tmp_path / 'my_rewards.py'}:brevity")
    assert r.name == "brevity" and r.fn(["", "abc"]) == [1.0, 0.25]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:brevity").fn(["a"]) == [0.5]
    cases = {
        "nope": "unknown reward 'nope'",
        f"{tmp_path / 'missing.py'}:f": "no such file",
        f"{tmp_path / 'my_rewards.py'}:absent": "has no function 'absent'",
        f"{tmp_path / 'my_rewards.py'}:NOT_CALLABLE": "has no function 'NOT_CALLABLE'",
        "no_such_module_xyz:f": "cannot import module 'no_such_module_xyz'",
    }
    for spec, msg in cases.items():
        with pytest.raises(RewardError, match=msg):
            load_reward(spec)


def test_weights_and_names():
    rs = load_rewards(["exact_match", "length", "exact_match"], [1.0, 0.5, 2.0], max_new_tokens=4)
    assert [r.name for r in rs] == ["exact_match_0", "length", "exact_match_2"]
    # completion "4" (1 token of 4) with answer "4": 1·1 + 0.5·(-0.25) + 2·1 = 2.875
    total, per = apply_rewards(rs, ["4"], {"answer": ["4"], "completion_ids": [[7]]}, ["row 1"])
    assert total == [2.875] and per["length"] == [-0.25]
    with pytest.raises(RewardError, match="2 weights for 1 reward;"):
        load_rewards(["exact_match"], [1.0, 2.0])


def _bad(kind):
    def fn(completions, answer, **kw):
        if kind == "raise":
            return [1.0 / (len(c) - 3) for c in completions]  # ZeroDivisionError on a 3-char completion
        if kind == "short":
            return [1.0] * (len(completions) - 1)
        if kind == "nan":
            return [float("nan") if c == "bad" else 1.0 for c in completions]
        if kind == "none":
            return None
        return ["high" if c == "bad" else 1.0 for c in completions]
    fn.__name__ = f"bad_{kind}"
    return fn


@pytest.mark.parametrize("kind,msg", [
    ("raise", "reward 'bad_raise' raised ZeroDivisionError: float division by zero on data.jsonl line 2"),
    ("short", "reward 'bad_short' returned 2 values for 3 completions"),
    ("nan", "reward 'bad_nan' returned nan for data.jsonl line 2; expected a finite number"),
    ("none", "reward 'bad_none' returned NoneType for 3 completions"),
    ("str", "reward 'bad_str' returned 'high' (str) for data.jsonl line 2; expected a number"),
])
def test_misbehaving_rewards_name_reward_and_row(kind, msg):
    from gspo.rewards.builtin import Reward

    comps = ["good", "bad", "fine"]
    with pytest.raises(RewardError) as e:
        apply_rewards([Reward(f"bad_{kind}", _bad(kind))], comps, {"answer": ["a", "b", "c"]},
                      ["data.jsonl line 1", "data.jsonl line 2", "data.jsonl line 3"])
    assert msg in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_none_rewards_are_left_out_of_the_weighted_sum():
    # TRL's convention: a reward returns None where it does not apply. Row 1: 1.0·1.0 + 0.5·0.4 = 1.2;
    # row 2: the second reward does not apply -> 1.0·0.0 only = 0.0; row 3: neither applies -> 0.0
    rewards = [Reward("a", lambda completions, **kw: [1.0, 0.0, None]),
               Reward("b", lambda completions, **kw: [0.4, None, None], weight=0.5)]
    total, per = apply_rewards(rewards, ["x", "y", "z"], {}, ["r1", "r2", "r3"])
    assert total == pytest.approx([1.2, 0.0, 0.0])
    assert per["a"][:2] == [1.0, 0.0] and math.isnan(per["a"][2]) and math.isnan(per["b"][1])


@pytest.mark.parametrize("value,kind", [(True, "bool"), ("1.0", "str"), (float("nan"), None)])
def test_rewards_returning_bools_strings_or_nan_are_refused(value, kind):
    r = Reward("flaky", lambda completions, **kw: [value])
    with pytest.raises(RewardError) as e:
        apply_rewards([r], ["x"], {}, ["data.jsonl line 3"])
    msg = str(e.value)
    assert msg.startswith("reward 'flaky' returned") and "data.jsonl line 3" in msg
    assert (f"({kind})" in msg) if kind else "expected a finite number" in msg


# ----------------------------------------------------------------------------------------------
# TRL's calling convention: rewards are called by keyword; TRL's documented functions, verbatim
# ----------------------------------------------------------------------------------------------

def reward_func(completion_ids, **kwargs):  # TRL docs, "Example 1: Reward longer completions"
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


def format_reward_func(completions, **kwargs):  # TRL docs, "Example 2" (conversational)
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def boxed_reward_func(completions, ground_truth, **kwargs):  # TRL docs, "Example 3" (named reward_func there)
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


ideal_length = 50


def reward_len(completions, **kwargs):  # TRL's GRPO + LoRA notebook
    return [-abs(ideal_length - len(completion)) for completion in completions]


def exact(prompts, completions, answer, **kw):  # prompts first: "got multiple values for argument 'prompts'" before
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def test_trl_reward_functions_work_unchanged():
    ex = Example(r"Solve $2x + 3 = 7$.", "2", {"answer": "2", "ground_truth": "2"}, "d.jsonl line 1")
    rewards = [Reward(f.__name__, f) for f in (reward_func, boxed_reward_func, reward_len, exact)]
    comps = [r" The solution is \boxed{2}.", "2"]
    total, per = score_completions(rewards, [ex], comps, [[6303, 13], [304, 279, 12884, 13]], group_size=2)
    assert per["reward_func"] == [2.0, 4.0]  # token counts
    assert per["boxed_reward_func"] == [1.0, 0.0]  # ground_truth is a column
    assert per["reward_len"] == [-(50 - 27), -(50 - 1)]  # 27 and 1 characters
    assert per["exact"] == [0.0, 1.0]
    # row 1: 2 + 1 - 23 + 0 = -20; row 2: 4 + 0 - 49 + 1 = -44
    assert total == [-20.0, -44.0]
    chat = Example([{"role": "user", "content": "What is the result of (1 + 2) * 4?"}], "12", {}, "c.jsonl line 1")
    texts = ["<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think>"
             "<answer>(1 + 2) * 4 = 12</answer>",
             "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."]
    _, per = score_completions([Reward("format", format_reward_func)], [chat], texts, [[1], [2]], group_size=2)
    assert per["format"] == [1.0, 0.0]  # completion[0]["content"]: conversational completions are messages


def test_rewards_get_the_keywords_trl_passes():
    seen = {}

    def spy(**kw):
        seen.update(kw)
        return [1.0]

    ex = Example("p", "a", {"answer": "a", "level": "hard"}, "d.jsonl line 1")
    from gspo.rewards.builtin import TrainerState

    score_completions([Reward("spy", spy)], [ex], ["c"], [[5]], group_size=1, trainer_state=TrainerState(3, 10))
    assert set(seen) == {"prompts", "completions", "completion_ids", "trainer_state", "answer", "level"}
    assert seen["trainer_state"].global_step == 3 and seen["trainer_state"].max_steps == 10
    assert seen["prompts"] == ["p"] and seen["completions"] == ["c"] and seen["completion_ids"] == [[5]]


def test_completions_first_under_another_name_still_works():
    # gspo's older convention called rewards with the completions first, whatever the parameter's name
    r = Reward("first", lambda comps, **kw: [float(len(c)) for c in comps])
    assert apply_rewards([r], ["ab", "c"], {"prompts": ["p", "q"]}, ["r1", "r2"]) == ([2.0, 1.0], {"first": [2.0, 1.0]})


@pytest.mark.parametrize("fn,msg", [
    (lambda prompts, completions, ground_truth, **kw: [1.0], "missing a required argument: 'ground_truth'"),
    (lambda completions, answer: [1.0], "got an unexpected keyword argument"),
])
def test_a_signature_that_does_not_fit_names_the_argument_not_a_row(fn, msg):
    with pytest.raises(RewardError) as e:
        apply_rewards([Reward("strict", fn)], ["x"], {"prompts": ["p"], "completion_ids": [[1]], "answer": ["1"],
                                                      "level": ["easy"]}, ["data.jsonl line 1"])
    text = str(e.value)
    assert text.startswith("reward 'strict' cannot be called with the arguments rewards get: " + msg), text
    assert "the dataset columns answer, level;" in text and "line 1" not in text and "\n" not in text


def test_a_type_error_inside_a_reward_still_names_the_row():
    def inside(completions, **kw):
        return [len(c) + "!" for c in completions]  # TypeError raised by the body, not by the call

    with pytest.raises(RewardError, match=r"reward 'inside' raised TypeError: .* on data.jsonl line 1"):
        apply_rewards([Reward("inside", inside)], ["x"], {}, ["data.jsonl line 1"])


# ----------------------------------------------------------------------------------------------
# A first reward that scores nothing: no accuracy, never 0%
# ----------------------------------------------------------------------------------------------

def _evaluate(model, tokenizer, fn):
    from gspo.tasks import get_task
    from gspo.train.evaluation import EvalOptions, evaluate

    task = get_task("arithmetic")
    return task.test_set(6), evaluate(model, tokenizer, task, [Reward("picky", fn)],
                                      EvalOptions(n=6, k=2, max_new_tokens=2))


def test_a_reward_that_returns_none_everywhere_reports_no_accuracy(tiny_random, char_tokenizer):
    _, out = _evaluate(tiny_random, char_tokenizer, lambda completions, **kw: [None] * len(completions))
    assert out["accuracy"] is None and out["n_scored"] == 0 and out["n"] == 6
    assert out["sample_accuracy"] is None and out["pass@2"] == 0.0 and out["reward"] == 0.0


def test_accuracy_is_over_the_rows_the_reward_scored(tiny_random, char_tokenizer):
    def picky(completions, answer, **kw):  # scores even answers only: 1.0 when divisible by 4
        return [None if int(a) % 2 else float(int(a) % 4 == 0) for a in answer]

    rows, out = _evaluate(tiny_random, char_tokenizer, picky)
    answers = [int(ex.answer) for ex in rows]
    even, by_four = sum(a % 2 == 0 for a in answers), sum(a % 4 == 0 for a in answers)
    assert 0 < even < 6  # the test set mixes scored and unscored rows
    # accuracy = (rows divisible by 4) / (even rows), not / 6
    assert out["n_scored"] == even and out["accuracy"] == pytest.approx(by_four / even, rel=1e-12)
    assert out["sample_accuracy"] == pytest.approx(by_four / even, rel=1e-12)  # the same rows, k=2 samples each


def test_compare_and_plot_take_an_evaluation_without_accuracy(tmp_path):
    """A run whose reward scored no held-out completion has accuracy None: the comparison's
    best/after and the plotted curve skip it instead of failing on None."""
    import json

    from gspo.lab.compare import summarise
    from gspo.lab.plot import load_series

    evals = [{"step": 0, "accuracy": 0.25, "n": 4}, {"step": 5, "accuracy": 0.75, "n": 4},
             {"step": 10, "accuracy": None, "n": 4, "n_scored": 0}]
    (tmp_path / "summary.json").write_text(json.dumps({"evals": evals, "eval_before": evals[0], "eval_after": evals[2],
                                                       "wall_seconds": 1.0}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    s = summarise(tmp_path)
    assert (s["accuracy"], s["accuracy_before"], s["accuracy_best"], s["diverged"]) == (None, 0.25, 0.75, False)
    assert load_series(tmp_path, "eval/accuracy") == ([0, 5], [0.25, 0.75])


def test_the_summary_line_says_n_a_not_zero(capsys):
    from gspo.cli import _print_summary

    none = {"accuracy": None, "n": 6, "n_scored": 0, "metric": "x", "binary": True}
    base = {"algorithm": "gspo", "task": "d.jsonl", "steps": 2, "wall_seconds": 3.0, "final_checkpoint": None}
    _print_summary({**base, "eval_before": none, "eval_after": none})
    assert capsys.readouterr().out == ("gspo on d.jsonl: held-out greedy accuracy: n/a (the reward 'x' returned None "
                                       "for every evaluated completion) in 3s\n")
    _print_summary({**base, "eval_before": none, "eval_after": {**none, "accuracy": 0.25, "n_scored": 4}})
    assert capsys.readouterr().out == ("gspo on d.jsonl: held-out greedy accuracy: n/a -> 25.0% (the reward 'x' "
                                       "returned None for every evaluated completion before training) in 3s\n")


# ----------------------------------------------------------------------------------------------
# A reward that fails mid-run says how to resume
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("fail_from", [1, 0])
def test_a_reward_failing_mid_run_says_how_to_resume(tmp_path, fail_from):
    import gspo

    def flaky(completions, trainer_state, **kw):  # a grader that breaks once `fail_from` steps are done
        if trainer_state.global_step >= fail_from:
            raise ConnectionError("grader down")
        return [0.0] * len(completions)

    run = tmp_path / "run"
    cfg = gspo.TrainConfig(steps=2, save_every=1, prompts_per_step=2, group_size=2, max_new_tokens=2, eval_size=0,
                           output_dir=str(run), progress=False)
    with pytest.raises(RewardError) as e:
        gspo.Trainer(cfg, reward_funcs=[flaky]).train()
    msg = str(e.value)
    assert msg.startswith("reward 'flaky' raised ConnectionError: grader down on ") and "\n" not in msg
    if fail_from:  # step 1 was checkpointed: the run directory stays, and the message says how to go on
        assert msg.endswith(f"; fix it and continue with: gspo train --resume {run}")
        assert (run / "checkpoints" / "step-000001").is_dir()
    else:  # a false start: nothing to resume, nothing left behind
        assert "--resume" not in msg and not run.exists()
