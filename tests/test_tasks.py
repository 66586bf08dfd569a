"""Built-in task: deterministic, disjoint splits; the verifier reward."""

import pytest

from gspo.rewards.builtin import exact_integer
from gspo.tasks import get_task


def test_splits_are_deterministic_and_disjoint():
    a, b = get_task("arithmetic"), get_task("arithmetic")
    assert a.test_set() == b.test_set()
    assert len({p.prompt for p in a.test_set()}) == len(a.test_set())
    test_prompts = {p.prompt for p in a.test_set()}
    for step in range(1, 50):
        batch = a.train_batch(step, 64, seed=3)
        assert batch == b.train_batch(step, 64, seed=3)  # a function of (seed, step) alone
        assert not test_prompts & {p.prompt for p in batch}
    assert a.train_batch(1, 64, seed=3) != a.train_batch(2, 64, seed=3)
    assert a.train_batch(1, 64, seed=3) != a.train_batch(1, 64, seed=4)


def test_problems_are_correct():
    for p in get_task("arithmetic").train_batch(0, 500):
        expr = p.prompt.rstrip("=")
        assert str(eval(expr)) == p.answer  # noqa: S307 - digits and one operator
        assert int(p.answer) >= 0
    assert all("+" in p.prompt for p in get_task("addition").test_set())


@pytest.mark.parametrize("completion,answer,reward", [
    ("415", "415", 1.0),
    (" 415 ", "415", 1.0),
    ("415\n", "415", 1.0),
    ("4150", "415", 0.0),
    ("41", "415", 0.0),
    ("", "415", 0.0),
    ("-5", "-5", 1.0),
    ("0415", "415", 0.0),  # the exact spelling is asked for
    ("", "", 0.0),
])
def test_exact_integer_reward(completion, answer, reward):
    assert exact_integer(completion, answer) == reward


def test_unknown_task():
    with pytest.raises(ValueError, match="arithmetic"):
        get_task("chess")
