"""A weak judge, simulated: the confusion SmolLM2-135M-Instruct showed as a judge of arithmetic
(benchmarks/judge_agreement.py, docs/judges.md) applied to the exact answer, as a `--reward` of
`gspo train`, to measure what such a judge does to training at the cost of a table lookup.

    gspo train --reward exact_integer benchmarks/weak_judge.py:smollm2_like --reward-weights 0 1

A right answer is called right with probability 0.8 (SmolLM2 called 20 of 25 right answers right),
a wrong one with probability 0.72 (18 of 25 wrong answers): the verdict is drawn once per (prompt,
completion) from a hash, so a repeat gets the same verdict, as from a judge's cache. The first
reward, exact_integer at weight 0, stays the accuracy evaluation reports.
"""

from __future__ import annotations

import hashlib

from gspo.rewards.builtin import exact_integer
from gspo.tasks.scoring import completion_text

TRUE_POSITIVE, FALSE_POSITIVE = 0.8, 0.72  # P(judged right | right), P(judged right | wrong)


def _uniform(*parts: str) -> float:
    """A number in [0, 1) fixed by the text (not by Python's per-process hash seed)."""
    digest = hashlib.sha256("\x00".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def smollm2_like(completions, answer, prompts=None, **kwargs) -> list[float]:
    """1.0 or 0.0 per completion, drawn with SmolLM2's measured confusion given whether it is right."""
    out = []
    for i, (c, a) in enumerate(zip(completions, answer)):
        text = completion_text(c)
        p = TRUE_POSITIVE if exact_integer(text, a) == 1.0 else FALSE_POSITIVE
        out.append(1.0 if _uniform(str(prompts[i] if prompts else ""), text) < p else 0.0)
    return out
