"""Verifiers: plain functions `(completion, answer) -> float` in [0, 1].

>>> exact_integer(" 415", "415")
1.0
>>> exact_integer("4150", "415")
0.0
>>> exact_integer("", "0")
0.0

Left out here: reward plumbing for user datasets (several weighted rewards, per-row columns).
"""

from __future__ import annotations


def exact_integer(completion: str, answer: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, spells the answer exactly."""
    return 1.0 if completion.strip() == answer.strip() and answer.strip() != "" else 0.0
