"""What every reward shares: its error, the text of a completion, a per-completion function made batched.

    from gspo.tasks.scoring import RewardError, completion_text, per_completion

gspo.rewards.builtin (verifiable rewards by name, user functions) and gspo.rewards.model (learned reward
models) both raise RewardError and read completions with completion_text; the tasks' own rewards
(gspo.tasks) are per_completion functions. gspo.rewards.builtin re-exports all three. `Scored` holds a
scored rollout's rows (gspo.sampling.produce makes them, gspo.train.batch.prepare reads them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

RewardFn = Callable[..., list]


class RewardError(ValueError):
    """A reward function misbehaved; the message names the reward and the dataset row."""


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the content of a list of chat messages.

    >>> completion_text("42")
    '42'
    >>> completion_text([{"role": "assistant", "content": "42"}])
    '42'
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def per_completion(fn: Callable[..., float]) -> RewardFn:
    """Make a batched reward from `fn(completion_text, **row) -> float`."""

    @functools.wraps(fn)
    def batched(completions: list, trainer_state=None, **columns) -> list[float]:
        keys = list(columns)  # one value per completion each; trainer_state is not a column
        return [fn(completion_text(c), **{k: columns[k][i] for k in keys}) for i, c in enumerate(completions)]

    batched.per_completion = fn
    return batched


@dataclass
class Scored:
    """A scored rollout's rows, as gspo.sampling.produce leaves them."""

    rewards: Tensor  # (B,) weighted sum of all rewards
    parts: dict  # name -> (B,) each reward's values
    examples: list  # (B / G,) the prompts' Examples
    completions: list[str]  # (B,) decoded completions
    episodes: object | None = None  # multi-turn: the gspo.sampling.episodes.Episodes
