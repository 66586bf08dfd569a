"""An environment class written for TRL's `GRPOTrainer(environment_factory=...)`, run unchanged:

    gspo train --task calculator --env examples/agents/calculator_env.py:CalculatorToolEnv

Every public method but `reset` and `get_reward` is a tool; `get_reward` is added to the episode's
reward (docs/agents.md, "TRL's environment_factory environments").
"""


class CalculatorToolEnv:
    def reset(self, **row) -> str | None:
        self.calls = 0
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression of integers with +, -, * and parentheses.

        Args:
            expression: the expression, e.g. "37*48+12"
        """
        self.calls += 1
        if not expression or set(expression) - set("0123456789+-*() "):
            raise ValueError(f"not an integer expression: {expression!r}")
        return str(eval(expression, {"__builtins__": {}}))  # only digits, operators and parentheses reach here

    def get_reward(self) -> float:
        return 0.1 * (self.calls > 0)
