"""gspo's calculator task written as a verifiers 0.4 taskset: the problems, a `calculator` tool
(served over MCP by verifiers) and the reward, in verifiers' own classes. Nothing here imports
gspo's training code but the problems themselves (gspo.tasks.calculator), so that the held-out
set is the built-in task's.

    PYTHONPATH=$PWD/examples/verifiers gspo train --task verifiers:gspo-calculator --model tiny-tool \\
        --max-new-tokens 80 --max-turns 3

verifiers finds the taskset by its id: `gspo-calculator` is this module, `gspo_calculator`, on the
Python path (an installed package works the same way). Its tool server runs in a process of its
own, in another working directory, which imports this module too: hence PYTHONPATH, and an
absolute one.
"""

import ast
import itertools

import verifiers.v1 as vf

OPS = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y}


def evaluate(expression: str) -> int:
    """An integer expression of + - * and parentheses; ValueError for anything else."""
    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"{expression!r}: only integers, + - * and parentheses are allowed")

    if len(expression) > 64:
        raise ValueError("expression longer than 64 characters")
    return value(ast.parse(expression.strip(), mode="eval").body)


class CalculatorToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is `calculator`, unprefixed

    @vf.tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression of integers with +, -, * and parentheses.

        Args:
            expression: the expression to evaluate, e.g. "37*48+12"
        """
        return str(evaluate(expression))


class CalculatorData(vf.TaskData):
    answer: str


class CalculatorProblem(vf.Task[CalculatorData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)


class CalculatorConfig(vf.TasksetConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalculatorTaskset(vf.Taskset[CalculatorProblem, CalculatorConfig]):
    INFINITE = True

    @classmethod
    def toolsets(cls, config: CalculatorConfig) -> list[vf.Toolset]:
        """One tool server for every episode (a task's own toolsets start one per episode)."""
        return [CalculatorToolset(config.tools)]

    def load(self):
        """The built-in task's 500 test problems first (gspo holds out the first --eval-size), then
        its training problems, 256 a block."""
        from gspo.tasks.calculator import CalculatorTask  # here: the tool server's process needs none of gspo

        source = CalculatorTask()
        blocks = (source.train_batch(k, 256) for k in itertools.count(1))
        problems = itertools.chain(source.test_set(), itertools.chain.from_iterable(blocks))
        for i, ex in enumerate(problems):
            yield CalculatorProblem(CalculatorData(idx=i, prompt=ex.prompt[0]["content"], answer=ex.answer),
                                    self.config.task)


__all__ = ["CalculatorTaskset"]

if __name__ == "__main__":
    CalculatorToolset.run()
