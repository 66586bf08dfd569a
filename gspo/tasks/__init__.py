"""Tasks: where prompts come from, and which rewards score them by default.

A task has `train_batch(step, n, seed) -> list[Example]` (a function of its arguments alone,
so a resumed run sees the same prompts), `test_set(n) -> list[Example]` (fixed), and
`default_rewards` / `default_max_new_tokens`. Built-in tasks are named here (`arithmetic`,
`addition`, `chain` with long answers, and `calculator`, multi-turn with a tool); a user's dataset
(a file, a directory, a Hugging Face Hub id, or rows in memory) becomes a `gspo.data.DatasetTask`.
"""

from __future__ import annotations

from gspo.tasks.arithmetic import ArithmeticTask
from gspo.tasks.base import DrawnSplits
from gspo.tasks.calculator import CalculatorTask
from gspo.tasks.chain import ChainTask

TASKS = {
    "arithmetic": lambda: ArithmeticTask(max_digits=3, ops="+-", name="arithmetic"),
    "addition": lambda: ArithmeticTask(max_digits=3, ops="+", name="addition"),
    "chain": lambda: ChainTask(),  # long answers: counting up to 1000 in steps, every step written out
    "calculator": lambda: CalculatorTask(),  # multi-turn: a calculator tool for two-digit products
}


def get_task(name: str):
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    return TASKS[name]()


# rewards that compare a completion with the answer column
NEEDS_ANSWER = {"exact_match", "exact_integer", "numeric_match", "math_verify"}


def build_task(*, task: str, dataset: str | None, dataset_split: str = "train", eval_dataset: str | None = None,
               eval_split: str | None = None, prompt_column: str = "prompt", answer_column: str = "answer",
               eval_size: int = 500, rewards: tuple[str, ...] = (), dataset_config: str | None = None):
    """The built-in task `task`, or a DatasetTask over `dataset` (a file, a dataset directory, a
    Hub dataset id with its `dataset_config`, or in-memory rows; validated row by row)."""
    if dataset is None:
        return get_task(task)
    from gspo.data import DatasetTask, load_dataset_task

    names = rewards or DatasetTask.default_rewards
    return load_dataset_task(dataset, prompt_column=prompt_column, answer_column=answer_column, split=dataset_split,
                             eval_path=eval_dataset, eval_split=eval_split, eval_size=eval_size,
                             require_answer=any(r in NEEDS_ANSWER for r in names), config=dataset_config)


__all__ = ["TASKS", "ArithmeticTask", "CalculatorTask", "ChainTask", "DrawnSplits", "build_task", "get_task"]
