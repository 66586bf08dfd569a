"""Multi-digit arithmetic: a verifiable task small enough to train on a CPU in minutes.

A problem is a prompt such as "347+68=" whose answer is "415"; operands are uniform in
[0, 10^max_digits). The completion is scored by exact match of the integer it spells (see
`gspo.rewards.exact_integer`), so the reward is 1.0 or 0.0.

Splits: the test split is a fixed set of distinct problems drawn from `split_seed` (the same
for every run, so a run's seed never moves problems between train and test). Training
problems are drawn from everything else as a function of (run seed, step) alone, so a
resumed run sees exactly the prompts an uninterrupted one would.

Left out: carries/borrows curricula and chain-of-thought formats; the built-in model answers
directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from gspo.rewards import exact_integer


@dataclass(frozen=True)
class Problem:
    prompt: str  # e.g. "347+68="
    answer: str  # e.g. "415"


@dataclass
class ArithmeticTask:
    """Sums and differences of non-negative integers with 1 to `max_digits` digits."""

    max_digits: int = 3
    ops: str = "+-"
    split_seed: int = 0
    test_size: int = 1000
    name: str = "arithmetic"
    _test: list[Problem] = field(default_factory=list, init=False, repr=False)
    _test_prompts: set[str] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self):
        rng = random.Random(f"arithmetic-test-{self.split_seed}")
        seen: set[str] = set()
        while len(self._test) < self.test_size:
            p = self._draw(rng)
            if p.prompt not in seen:
                seen.add(p.prompt)
                self._test.append(p)
        self._test_prompts = seen

    def _draw(self, rng: random.Random) -> Problem:
        a = rng.randrange(10**self.max_digits)
        b = rng.randrange(10**self.max_digits)
        op = rng.choice(self.ops)
        if op == "-" and b > a:
            a, b = b, a  # results stay non-negative
        value = a + b if op == "+" else a - b
        return Problem(f"{a}{op}{b}=", str(value))

    def train_batch(self, step: int, n: int, seed: int = 0) -> list[Problem]:
        """The `n` training problems of `step`: a function of (seed, step) only; never a test problem."""
        rng = random.Random(f"arithmetic-train-{self.split_seed}-{seed}-{step}")
        out: list[Problem] = []
        while len(out) < n:
            p = self._draw(rng)
            if p.prompt not in self._test_prompts:
                out.append(p)
        return out

    def test_set(self, n: int | None = None) -> list[Problem]:
        return self._test[: n or len(self._test)]

    def reward(self, completion: str, problem: Problem) -> float:
        return exact_integer(completion, problem.answer)
