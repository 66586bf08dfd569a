"""Words for messages: counts that agree with their nouns, the closest name to a mistyped one. A
leaf module (it imports nothing of gspo), so that any module may say "1 reward" or "did you mean"
without climbing the import floors."""

from __future__ import annotations

import difflib


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """The count and its noun, agreeing (`nouns`: an irregular plural).

    >>> plural(1, "step"), plural(2, "step"), plural(0, "process", "processes")
    ('1 step', '2 steps', '0 processes')
    """
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def closest(name: str, candidates) -> str | None:
    """The one of `candidates` closest to `name`, if any is close (difflib's ratio >= 0.6)."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(name: str, candidates, shown=str) -> str:
    """'; did you mean steps?' when `name` is close to one of `candidates`, else ''.

    >>> did_you_mean("step", ["steps", "seed"]), did_you_mean("xyz", ["steps"])
    ('; did you mean steps?', '')
    """
    best = closest(name, candidates)
    return "" if best is None else f"; did you mean {shown(best)}?"
