"""Tasks: where prompts come from, and which rewards score them by default.

A task has `train_batch(step, n, seed) -> list[Example]` (a function of its arguments alone,
so a resumed run sees the same prompts), `test_set(n) -> list[Example]` (fixed), and
`default_rewards` / `default_max_new_tokens`. Built-in tasks are named here (`arithmetic`,
`addition`, `chain` with long answers, and `calculator`, multi-turn with a tool), and any of
reasoning-gym's generators as `reasoning_gym:NAME` (gspo.tasks.gym), any verifiers taskset as
`verifiers:ID` (built by gspo.agents.side, the agents' room); a user's dataset
(a file, a directory, a Hugging Face Hub id, or rows in memory) becomes a `gspo.tasks.data.DatasetTask`.

The room also holds what tasks stand on: their rows (gspo.tasks.data: Example, your own datasets),
the environments of multi-turn tasks (gspo.tasks.env) and what every reward shares
(gspo.tasks.scoring). May import: gspo.config, gspo.io.
"""

from __future__ import annotations

from gspo.config import Data
from gspo.tasks.arithmetic import ArithmeticTask
from gspo.tasks.base import DrawnSplits
from gspo.tasks.calculator import CalculatorTask
from gspo.tasks.chain import ChainTask
from gspo.tasks.gym import GymTask, is_gym, parse_options

TASKS = {
    "arithmetic": lambda: ArithmeticTask(max_digits=3, ops="+-", name="arithmetic"),
    "addition": lambda: ArithmeticTask(max_digits=3, ops="+", name="addition"),
    "chain": lambda: ChainTask(),  # long answers: counting up to 1000 in steps, every step written out
    "calculator": lambda: CalculatorTask(),  # multi-turn: a calculator tool for two-digit products
}


def get_task(name: str, options: tuple[str, ...] = (), test_size: int = 500, answer_from: str = "tag"):
    """A built-in task by name, reasoning-gym's (`reasoning_gym:NAME`, with its KEY=VALUE options
    and the rule its verifier's answer is taken by). A verifiers environment's (`verifiers:TASKSET_ID`)
    is built by gspo.agents.side.task_for."""
    if is_gym(name):
        return GymTask.from_spec(name, parse_options(options), test_size=test_size, answer_from=answer_from)
    if name.startswith("verifiers:"):  # a task whose episodes an agent plays: built by that room
        raise ValueError(f"task {name!r}: a verifiers taskset is built by gspo.agents.side.task_for")
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    return TASKS[name]()


# rewards that compare a completion with the answer column
NEEDS_ANSWER = {"exact_match", "exact_integer", "numeric_match", "math_verify"}


def build_task(data: Data, rewards: tuple = (), eval_size: int = 500, *, train_rows=None, eval_rows=None):
    """The built-in task `data.task`, or a DatasetTask over `data.dataset` (a file, a dataset
    directory, a Hub dataset id with its `data.dataset_config`; validated row by row).
    rewards: the run's reward specs (empty: the dataset's default; an answer column is required
    when one compares with it). eval_size: rows held out for evaluation (gspo.tasks.data).
    train_rows / eval_rows: in-memory rows that replace data.dataset / data.eval_dataset."""
    dataset = train_rows if train_rows is not None else data.dataset
    if dataset is None:
        return get_task(data.task, data.task_options, eval_size, data.answer_from)
    from gspo.tasks.data import DatasetTask, load_dataset_task

    names = rewards or DatasetTask.default_rewards
    return load_dataset_task(dataset, data, eval_path=eval_rows if eval_rows is not None else data.eval_dataset,
                             eval_size=eval_size, require_answer=any(r in NEEDS_ANSWER for r in names))


__all__ = ["TASKS", "ArithmeticTask", "CalculatorTask", "ChainTask", "DrawnSplits", "GymTask",
           "build_task", "get_task", "is_gym"]
