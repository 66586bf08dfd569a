"""Multi-digit arithmetic: a verifiable task small enough to train on a CPU in minutes.

A problem is a prompt such as "347+68=" whose answer is "415"; operands are uniform in
[0, 10^max_digits). The default reward is `exact_integer` (1.0 when the completion spells
the answer exactly, else 0.0).

Splits: the test split is a fixed set of distinct problems drawn from `split_seed` (the same
for every run, so a run's seed never moves problems between train and test). Training
problems are drawn from everything else as a function of (run seed, step) alone, so a
resumed run sees exactly the prompts an uninterrupted one would.

Left out: carries/borrows curricula and chain-of-thought formats; the built-in model answers
directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from gspo.tasks.base import DrawnSplits
from gspo.tasks.data import Example


def problem(prompt: str, answer: str, source: str) -> Example:
    return Example(prompt, answer, {"answer": answer}, source)


@dataclass
class ArithmeticTask(DrawnSplits):
    """Sums and differences of non-negative integers with 1 to `max_digits` digits."""

    STREAM: ClassVar[str] = "arithmetic"  # seeds its test and training streams

    max_digits: int = 3
    ops: str = "+-"
    split_seed: int = 0
    test_size: int = 1000
    name: str = "arithmetic"
    default_rewards: tuple[str, ...] = ("exact_integer",)
    default_max_new_tokens: int = 8

    def _draw(self, rng: random.Random, source: str) -> Example:
        a = rng.randrange(10**self.max_digits)
        b = rng.randrange(10**self.max_digits)
        op = rng.choice(self.ops)
        if op == "-" and b > a:
            a, b = b, a  # results stay non-negative
        value = a + b if op == "+" else a - b
        return problem(f"{a}{op}{b}=", str(value), source)
