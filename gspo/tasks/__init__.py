"""Built-in tasks, by name. A task yields training problems per step, a fixed test split, and
a verifier reward in [0, 1]."""

from __future__ import annotations

from gspo.tasks.arithmetic import ArithmeticTask, Problem

TASKS = {
    "arithmetic": lambda: ArithmeticTask(max_digits=3, ops="+-", name="arithmetic"),
    "addition": lambda: ArithmeticTask(max_digits=3, ops="+", name="addition"),
}


def get_task(name: str):
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    return TASKS[name]()


__all__ = ["TASKS", "ArithmeticTask", "Problem", "get_task"]
