"""A built-in arithmetic reasoning task with graded difficulty, so response lengths have a real long tail.

A problem chains `k` operations (+, -, *) on integers; harder problems have more operations and larger operands,
so a model that works step by step writes longer answers for them. Difficulty is drawn with geometrically
decaying weights: most problems are easy, a few are hard — the long tail TLT is about. Deterministic from a
seed. The model must end with the answer as \\boxed{N}.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tlt.errors import TltError
from tlt.tasks.example import TaskExample

INSTRUCTION = ("Compute the value of the expression below. Work step by step, one operation per line, then give "
               "the final answer as \\boxed{{N}}.\n\nExpression: {expression}")


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    min_operations: int = 1     # easiest problems
    max_operations: int = 6     # hardest problems
    decay: float = 0.6          # weight of difficulty k is decay ** (k - min_operations): few hard problems
    max_operand: int = 20       # operands of the easiest problems are in [1, max_operand]
    operand_growth: float = 1.6  # each extra operation multiplies the operand range by this

    def __post_init__(self):
        if not 1 <= self.min_operations <= self.max_operations:
            raise TltError(f"need 1 <= min_operations <= max_operations, got {self.min_operations}, "
                           f"{self.max_operations}")
        if not 0 < self.decay <= 1 or self.max_operand < 2 or self.operand_growth < 1:
            raise TltError("decay must be in (0, 1], max_operand >= 2 and operand_growth >= 1")


class ArithmeticTask:
    def __init__(self, config: ArithmeticTaskConfig = ArithmeticTaskConfig()):
        self.config = config

    def difficulty_weights(self) -> dict[int, float]:
        cfg = self.config
        return {k: cfg.decay ** (k - cfg.min_operations) for k in range(cfg.min_operations, cfg.max_operations + 1)}

    def sample(self, count: int, seed: int) -> list[TaskExample]:
        rng = random.Random(seed)
        weights = self.difficulty_weights()
        levels = rng.choices(list(weights), weights=list(weights.values()), k=count)
        return [self.problem(level, rng) for level in levels]

    def operand_limit(self, operations: int) -> int:
        cfg = self.config
        return max(2, round(cfg.max_operand * cfg.operand_growth ** (operations - cfg.min_operations)))

    def problem(self, operations: int, rng: random.Random) -> TaskExample:
        limit = self.operand_limit(operations)
        value = rng.randint(1, limit)
        expression = str(value)
        for _ in range(operations):
            op = rng.choice("+-*")
            operand = rng.randint(1, limit if op != "*" else max(2, limit // 4))
            expression = f"({expression} {op} {operand})" if op != "*" else f"{expression} * {operand}"
            value = value + operand if op == "+" else value - operand if op == "-" else value * operand
        expression = _strip_outer(expression)
        assert eval(expression) == value  # noqa: S307 — our own generated digits and operators only
        return TaskExample(INSTRUCTION.format(expression=expression), str(value),
                           {"operations": operations, "expression": expression})

    def longest_problem(self) -> TaskExample:
        """The longest text `sample` can draw: the most operations, each an addition (its parentheses make it
        longer than a product, whose operand is also smaller) of the largest operand, from the largest start.
        The run checks it against the context before step 1: a sample of prompts misses the rare long ones, and
        one drawn hours in stopped the run (QA)."""
        operations = self.config.max_operations
        limit = self.operand_limit(operations)
        expression = str(limit)
        for _ in range(operations):
            expression = f"({expression} + {limit})"
        expression = _strip_outer(expression)
        return TaskExample(INSTRUCTION.format(expression=expression), str(limit * (operations + 1)),
                           {"operations": operations, "expression": expression})


def _strip_outer(expression: str) -> str:
    if expression.startswith("(") and expression.endswith(")"):
        depth = 0
        for index, char in enumerate(expression):
            depth += char == "("
            depth -= char == ")"
            if depth == 0 and index < len(expression) - 1:
                return expression
        return expression[1:-1]
    return expression
