"""Words for messages, agreeing with their counts: a leaf module (it imports nothing of gspo), so
that any module may say "1 reward" without climbing the import floors."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """The count and its noun, agreeing (`nouns`: an irregular plural).

    >>> plural(1, "step"), plural(2, "step"), plural(0, "process", "processes")
    ('1 step', '2 steps', '0 processes')
    """
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"
