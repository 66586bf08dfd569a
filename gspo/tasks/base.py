"""What the built-in tasks share: fixed splits of problems drawn from a seeded stream.

A task class sets `STREAM` (the name its random streams are seeded by), has `split_seed` and
`test_size` fields and a `_draw(rng, source) -> Example`; `DrawnSplits` gives it
`test_set(n)` (a fixed list of `test_size` distinct problems drawn from `split_seed`, the same
for every run) and `train_batch(step, n, seed)` (a function of (seed, step) alone, never a
test problem), so that a resumed run sees exactly the prompts an uninterrupted one would.

`Task` is what every task is to the rest of gspo (built-in, reasoning-gym's, a dataset's, a
user's own). Also here: `SystemPrompt(task, text)`, any task with a system message before every prompt
(`--system-prompt`).
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import ClassVar, Protocol

from gspo.tasks.data import Example


class Task(Protocol):
    """A source of prompts: what a run reads of its task."""

    name: str
    default_rewards: tuple[str, ...]  # the rewards a run uses when --reward is not given
    default_max_new_tokens: int

    def train_batch(self, step: int, n: int, seed: int = 0) -> list[Example]:
        """`n` rows for training step `step` (1-based): a function of (seed, step) alone."""
        ...

    def test_set(self, n: int | None = None) -> list[Example]:
        """The first `n` held-out rows (all of them for None): the same for every run."""
        ...


class DrawnSplits:
    STREAM: ClassVar[str]
    split_seed: int
    test_size: int
    name: str

    def _draw(self, rng: random.Random, source: str) -> Example:
        raise NotImplementedError

    def __post_init__(self):
        rng = random.Random(f"{self.STREAM}-test-{self.split_seed}")
        self._test: list[Example] = []
        self._test_prompts: set[str] = set()
        while len(self._test) < self.test_size:
            p = self._draw(rng, f"{self.name} test problem {len(self._test) + 1}")
            if _key(p) not in self._test_prompts:
                self._test_prompts.add(_key(p))
                self._test.append(p)

    def train_batch(self, step: int, n: int, seed: int = 0) -> list[Example]:
        """The `n` training problems of `step`: a function of (seed, step) only; never a test problem."""
        rng = random.Random(f"{self.STREAM}-train-{self.split_seed}-{seed}-{step}")
        out: list[Example] = []
        while len(out) < n:
            p = self._draw(rng, f"{self.name} step {step} problem {len(out) + 1}")
            if _key(p) not in self._test_prompts:
                out.append(p)
        return out

    def test_set(self, n: int | None = None) -> list[Example]:
        return self._test[: n or len(self._test)]


def _key(example: Example) -> str:
    """A problem's identity: its prompt (chat messages as JSON)."""
    return example.prompt if isinstance(example.prompt, str) else json.dumps(example.prompt)


def with_system(prompt: str | list[dict], text: str) -> list[dict]:
    """`prompt` as chat messages that open with the system message `text`: a string becomes the
    user's turn after it; chat messages get it first unless their first message is a system one.

    >>> with_system("2+2=", "Be brief.")
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': '2+2='}]
    >>> with_system([{"role": "system", "content": "Mine."}, {"role": "user", "content": "Hi"}], "Be brief.")[0]
    {'role': 'system', 'content': 'Mine.'}
    """
    system = {"role": "system", "content": text}
    if isinstance(prompt, str):
        return [system, {"role": "user", "content": prompt}]
    return list(prompt) if prompt and prompt[0].get("role") == "system" else [system, *prompt]


class SystemPrompt:
    """`task` with the system message `text` before every prompt (`--system-prompt`), in
    training and evaluation alike. Each Example keeps its answer, columns and source, so the
    rewards score it as before; every other attribute (default_rewards, default_max_new_tokens,
    notes, name, default_model, ...) is the wrapped task's.

        task = SystemPrompt(get_task("arithmetic"), "Answer with the number only.")
        task.test_set(1)[0].prompt   # [{'role': 'system', ...}, {'role': 'user', 'content': '...'}]
    """

    def __init__(self, task, text: str, default: bool = False, plain: bool = False):
        self.task = task
        self.text = text
        self.default = default  # the task's own (reasoning-gym's answer format), not --system-prompt
        self.plain = plain  # as plain text: for a tokenizer without a chat template (`for_tokenizer`)

    def _rewrite(self, examples: list[Example]) -> list[Example]:
        if self.plain:
            return [dataclasses.replace(ex, prompt=f"{self.text}\n\n{ex.prompt}\n") for ex in examples]
        return [dataclasses.replace(ex, prompt=with_system(ex.prompt, self.text)) for ex in examples]

    def train_batch(self, step: int, n: int, seed: int = 0) -> list[Example]:
        return self._rewrite(self.task.train_batch(step, n, seed))

    def test_set(self, n: int | None = None) -> list[Example]:
        return self._rewrite(self.task.test_set(n))

    def __getattr__(self, name: str):
        if name == "task":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.task, name)


def for_tokenizer(task, tokenizer):
    """`task` as `tokenizer` can read it: a task's own system prompt (not --system-prompt) on a
    tokenizer without a chat template becomes plain text before each prompt (the instructions, a
    blank line, the question, a newline); the run says so (`prompt_note`). Anything else as it is."""
    if (isinstance(task, SystemPrompt) and task.default and not task.plain
            and not getattr(tokenizer, "chat_template", None)):
        return SystemPrompt(task.task, task.text, default=True, plain=True)
    return task


def prompt_note(task, model: str) -> list[str]:
    """The run's line when `for_tokenizer` made prompts plain text."""
    if isinstance(task, SystemPrompt) and task.plain:
        return [f"prompts: plain text, the tokenizer of {model} has no chat template: the task's instructions, a "
                "blank line, then the question"]
    return []

