"""Rewards: built-ins by table, math-verify cases, user rewards, weights, and misbehaving rewards."""

import math

import pytest

from gspo.data import Example
from gspo.rewards import (Reward, RewardError, apply_rewards, exact_match, format_reward, length_penalty, load_reward,
                          load_rewards, math_verify, numeric_match, score_completions)


@pytest.mark.parametrize("completion,answer,expected", [
    ("Paris", "Paris", 1.0), ("  Paris\n", "Paris", 1.0), ("paris", "Paris", 0.0), ("Paris.", "Paris", 0.0),
    ("42", 42, 1.0), ("42.0", 42, 0.0), ("", "", 0.0), ("x", None, 0.0),
])
def test_exact_match(completion, answer, expected):
    assert exact_match([completion], answer=[answer]) == [expected]


@pytest.mark.parametrize("completion,answer,expected", [
    ("The answer is 42", "42", 1.0), ("42.0", 42, 1.0), ("1,250", "1250", 1.0), ("total: 3.5.", 3.5, 1.0),
    ("41 then 42", "42", 1.0), ("42 then 41", "42", 0.0), ("-7", "-7", 1.0), ("1e3", 1000, 1.0),
    ("no number", "1", 0.0), ("5", "five", 0.0),
    # relative tolerance 1e-6: 0.30000001 is 3.3e-8 away (match), 0.3001 is 3.3e-4 away (no match)
    ("0.30000001", 0.3, 1.0), ("0.3001", 0.3, 0.0),
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
]


@pytest.mark.parametrize("completion,answer,expected", MATH_CASES)
def test_math_verify_table(completion, answer, expected):
    assert math_verify([completion], answer=[answer]) == [expected]


def test_format_and_length():
    f = format_reward(r"<think>.*?</think>\s*<answer>.*?</answer>")
    assert f(["<think>hmm</think> <answer>4</answer>", "<answer>4</answer>", "<think>a\nb</think><answer>4</answer>"]) == [1.0, 0.0, 1.0]
    # 2 of 8 tokens -> -0.25; 8 of 8 -> -1; more is capped at -1
    assert length_penalty(8)(["", "", ""], completion_ids=[[1, 2], list(range(8)), list(range(20))]) == [-0.25, -1.0, -1.0]


def test_chat_completions_reach_rewards_as_messages():
    ex = Example([{"role": "user", "content": "2+2?"}], "4", {"answer": "4", "topic": "math"}, "d.jsonl line 1")
    seen = {}

    def spy(completions, **kw):
        seen.update(kw, completions=completions)
        return [1.0] * len(completions)

    from gspo.rewards import Reward

    total, per = score_completions([Reward("spy", spy), Reward("exact_match", exact_match)], [ex], ["4", "5"], [[1], [2]], 2)
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
    with pytest.raises(RewardError, match="2 weights for 1 rewards"):
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
    from gspo.rewards import Reward

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
