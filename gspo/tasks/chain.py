"""Counting up in steps: long, verifiable answers where an error can occur at any step.

A problem `a(+d)=` asks to add `d` to `a` again and again until the total reaches 1000, writing
every step (a uniform in 10..599, d in 50..99):

    prompt      347(+68)=
    reference   347+68=415 415+68=483 483+68=551 ... 959+68=1027     (one step per addition)
    answer      1027                                                 (the `answer` column)

The reward `chain_answer` checks only the *last number* of the completion against the first
total of 1000 or more (1.0 or 0.0): the answer is checked at the end, the steps are free. A
step written wrong carries its error into every later step, so a longer chain has more places
to go wrong. Answers run from 55 to 217 characters (5 to 20 steps; one token per character
with the built-in character tokenizer, plus EOS), and `n_steps` is a column of every example
so that results can be binned by length (`length_bin`).

Every step depends only on the step before it and on `d`, which each step repeats: a small
model learns the method from local context alone. Splits as in `gspo.tasks.arithmetic`: the
test split is a fixed set of distinct problems drawn from `split_seed`; training problems are
a function of (run seed, step) alone and never a test problem.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import ClassVar

from gspo.tasks.base import DrawnSplits
from gspo.tasks.data import Example
from gspo.tasks.scoring import per_completion

TARGET = 1000  # count up until the total reaches it
START, STEP = (10, 599), (50, 99)  # a and d are uniform in these ranges (inclusive)
# bins of chain length (number of steps) for studies that split results by answer length
LENGTH_BINS = ((5, 6), (7, 8), (9, 11), (12, 20))

_PROMPT = re.compile(r"(\d+)\(\+(\d+)\)=")
_DIGITS = re.compile(r"\d+")


def parse_prompt(prompt: str) -> tuple[int, int]:
    """The start `a` and step `d` of a chain prompt.

    >>> parse_prompt("347(+68)=")
    (347, 68)
    """
    m = _PROMPT.fullmatch(prompt)
    if m is None:
        raise ValueError(f"not a chain prompt: {prompt!r}")
    return int(m[1]), int(m[2])


def reference_steps(a: int, d: int, target: int = TARGET) -> str:
    """The correct completion: every step `total+d=new` until the total reaches `target`.

    >>> reference_steps(840, 65)
    '840+65=905 905+65=970 970+65=1035'
    """
    steps, total = [], a
    while total < target:
        steps.append(f"{total}+{d}={total + d}")
        total += d
    return " ".join(steps)


def last_number(text: str) -> int | None:
    """The last run of digits in `text` (None when there is none).

    >>> last_number("840+65=905 905+65=970"), last_number(" 1035 "), last_number("none")
    (970, 1035, None)
    """
    found = _DIGITS.findall(text)
    return int(found[-1]) if found else None


def _chain_answer(completion: str, answer=None, **_) -> float:
    """1.0 when the last number of the completion is the final total; the steps before it are not checked.

    >>> _chain_answer("840+65=905 905+65=970 970+65=1035", answer="1035")
    1.0
    >>> _chain_answer("840+65=895 895+65=960 960+65=1025", answer="1035")  # forgot a carry at step 1
    0.0
    >>> _chain_answer("840+65=895 895+65=970 970+65=1035", answer="1035")  # wrong steps, right total
    1.0
    """
    if answer is None:
        return 0.0
    guess = last_number(completion)
    return 1.0 if guess is not None and str(guess) == str(answer).strip() else 0.0


# batched, TRL-style: chain_answer(completions, answer=[...], **columns) -> list[float]
chain_answer = per_completion(_chain_answer)


def length_bin(n_steps: int, bins=LENGTH_BINS) -> str:
    """The label of the length bin holding a chain of `n_steps` steps.

    >>> length_bin(5), length_bin(8), length_bin(20)
    ('5-6', '7-8', '12-20')
    """
    for lo, hi in bins:
        if lo <= n_steps <= hi:
            return f"{lo}-{hi}"
    raise ValueError(f"n_steps {n_steps} is in no bin of {bins}")


def problem(a: int, d: int, source: str) -> Example:
    total = a + d * -(-(TARGET - a) // d)  # the first a + k·d >= TARGET
    return Example(f"{a}(+{d})=", str(total), {"answer": str(total), "n_steps": (total - a) // d}, source)


@dataclass
class ChainTask(DrawnSplits):
    """Count up from `a` in steps of `d` until the total reaches 1000, every step written out."""

    STREAM: ClassVar[str] = "chain"  # seeds its test and training streams

    split_seed: int = 0
    test_size: int = 500
    name: str = "chain"
    default_rewards: tuple[str, ...] = ("gspo.tasks.chain:chain_answer",)
    # the longest reference (20 steps of 10-11 characters) is 217 characters, + EOS
    default_max_new_tokens: int = 240
    default_model: ClassVar[str] = "tiny-long"  # warm-started on chains; tiny never saw one

    def _draw(self, rng: random.Random, source: str) -> Example:
        return problem(rng.randint(*START), rng.randint(*STEP), source)
