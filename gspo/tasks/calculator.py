"""The `calculator` task: arithmetic beyond a tiny model's head, made easy by a calculator tool.

    gspo train --task calculator          # the task's model, tiny-tool; episodes of up to 3 turns

A problem is a chat prompt such as `37*48+12=` in one of four forms, `a*b`, `a*b+c`, `a*b-c`
and `(a+b)*c`, with two-digit numbers: products of two-digit numbers are beyond the built-in
models' arithmetic, and the `calculator` tool computes them exactly. An episode: the model
calls the tool (a Hermes-style `<tool_call>` in its chat template), reads the result in a tool
turn, and answers with the number alone. The default reward, `exact_integer`, scores the final
model turn: 1.0 when it spells the answer exactly (a turn that is still a tool call scores 0).

The environment is `CalculatorEnv`, a `gspo.tasks.env.ToolEnvironment` with the one tool; the
task names it (`default_env`), so `--env` is not needed. Splits are drawn as in the other
built-in tasks (gspo.tasks.base.DrawnSplits): a fixed 500-problem test split, training
problems a function of (seed, step) alone. The `form` column names each problem's form.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from typing import ClassVar

from gspo.tasks.base import DrawnSplits
from gspo.tasks.data import Example
from gspo.tasks.env import ToolEnvironment

FORMS = ("a*b", "a*b+c", "a*b-c", "(a+b)*c")
_OPS = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y}


def evaluate_expression(expression: str) -> int:
    """The value of an integer expression of + - * and parentheses; ValueError for anything else.

    >>> evaluate_expression("37*48+12"), evaluate_expression("(12+30)*-2")
    (1788, -84)
    """
    if len(expression) > 64:
        raise ValueError(f"expression longer than 64 characters ({len(expression)})")
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(f"{expression!r}: only integers, + - * and parentheses are allowed")

    return value(tree)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, -, * and parentheses.

    Args:
        expression: the expression to evaluate, e.g. "37*48+12"
    """
    return str(evaluate_expression(expression))


class CalculatorEnv(ToolEnvironment):
    """The calculator task's environment: one tool; the episode ends at the first model turn
    without a tool call (the answer)."""

    tools = [calculator]


def expression(form: str, a: int, b: int, c: int) -> str:
    """The problem's expression: the form with its numbers.

    >>> expression("(a+b)*c", 12, 30, 45)
    '(12+30)*45'
    """
    return form.replace("a", str(a)).replace("b", str(b)).replace("c", str(c))


@dataclass
class CalculatorTask(DrawnSplits):
    """Two-digit products, alone or with one more term, as chat prompts with a calculator tool."""

    STREAM: ClassVar[str] = "calculator"
    default_rewards: ClassVar[tuple[str, ...]] = ("exact_integer",)
    default_max_new_tokens: ClassVar[int] = 80  # per model turn: a tool call is about 70 tokens
    default_env: ClassVar[str] = "gspo.tasks.calculator:CalculatorEnv"
    default_max_turns: ClassVar[int] = 3
    default_model: ClassVar[str] = "tiny-tool"  # a chat model that knows the tool-call format
    default_steps: ClassVar[int] = 20  # episodes are ~10x an arithmetic answer; it learns in fewer steps

    split_seed: int = 0
    test_size: int = 500
    name: str = "calculator"

    def _draw(self, rng: random.Random, source: str) -> Example:
        form = rng.choice(FORMS)
        expr = expression(form, rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99))
        answer = str(evaluate_expression(expr))
        return Example([{"role": "user", "content": expr + "="}], answer, {"answer": answer, "form": form}, source)
