"""Example user rewards for `gspo train --reward examples/rewards.py:<name>`.

A reward is batched and TRL-compatible: it gets the completions and, as keyword arguments,
every dataset column (one value per completion), and returns one float per completion.
"""


def digit_credit(completions, answer, **kwargs):
    """Partial credit: the share of the answer's digits right, aligned from the right.

    >>> digit_credit(["415", "405", "15", "x"], answer=["415", "415", "415", "415"])
    [1.0, 0.6666666666666666, 0.6666666666666666, 0.0]
    """
    out = []
    for completion, gold in zip(completions, answer):
        guess, gold = completion.strip()[::-1], str(gold)[::-1]
        right = sum(1 for g, a in zip(guess, gold) if g == a)
        out.append(right / max(len(gold), len(guess), 1))
    return out


def level_bonus(completions, answer, level, **kwargs):
    """A reward that reads an extra dataset column (`level`): correct hard problems pay double."""
    return [(2.0 if lv == "hard" else 1.0) * float(c.strip() == str(a)) for c, a, lv in zip(completions, answer, level)]
