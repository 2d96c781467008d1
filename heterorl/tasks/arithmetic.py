"""Integer arithmetic answered GSM8K style: prompt ``"123+456="``, completion ``"#### 579"``."""

from __future__ import annotations

import random
from dataclasses import dataclass

from heterorl.errors import TaskError
from heterorl.tasks.answers import answers_match, extract_hash_answer
from heterorl.tasks.base import GeneratedTask, Problem

OPERATORS = "+-*"


def _require_int(name: str, value: object, minimum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TaskError(f"arithmetic option {name}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise TaskError(f"arithmetic option {name}={value!r} must be >= {minimum}")


@dataclass(frozen=True)
class ArithmeticConfig:
    """Problem settings.

    Operands are uniform in ``[0, 10**digits - 1]``; the operator is drawn
    uniformly from the distinct characters of ``ops`` (any of ``+-*``). The
    eval set is ``eval_size`` problems drawn from ``random.Random(eval_seed)``,
    duplicates dropped.
    """

    digits: int = 3
    ops: str = "+"
    eval_size: int = 512
    eval_seed: int = 54321

    def __post_init__(self) -> None:
        _require_int("digits", self.digits, 1)
        _require_int("eval_size", self.eval_size, 1)
        _require_int("eval_seed", self.eval_seed)
        if not isinstance(self.ops, str) or not self.ops or set(self.ops) - set(OPERATORS):
            raise TaskError(f"arithmetic option ops={self.ops!r} must be a non-empty string of {OPERATORS!r}")
        if len(set(self.ops)) != len(self.ops):
            raise TaskError(f"arithmetic option ops={self.ops!r} repeats an operator; list each once")


def _evaluate(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


class ArithmeticTask(GeneratedTask):
    """``a<op>b=`` problems; reward 1.0 iff the number after the last ``####`` equals the result."""

    name = "arithmetic"

    redraw_hint = "raise digits or lower eval_size so training problems remain"

    def __init__(self, config: ArithmeticConfig | None = None) -> None:
        super().__init__(config or ArithmeticConfig())

    def alphabet(self) -> str:
        return "0123456789+-*= #,\n"

    def generate(self, rng: random.Random) -> Problem:
        """Draw one problem (eval problems included)."""
        high = 10**self.config.digits - 1
        a, b = rng.randint(0, high), rng.randint(0, high)
        op = rng.choice(self.config.ops)
        prompt = f"{a}{op}{b}="
        return Problem(problem_id=f"arithmetic-{a}{op}{b}", prompt=prompt, answer=str(_evaluate(a, op, b)))

    def demonstration(self, problem: Problem) -> str:
        return f"#### {problem.answer}"

    def reward(self, problem: Problem, completion: str) -> float:
        predicted = extract_hash_answer(completion)
        return 1.0 if predicted is not None and answers_match(predicted, problem.answer) else 0.0
