"""Integer arithmetic: prompt ``"123+456="``, completion ``"#### 579"`` (GSM8K style) or exactly ``"579"``."""

from __future__ import annotations

import random
from dataclasses import dataclass

from heterorl.errors import TaskError
from heterorl.tasks.answers import answers_match, extract_hash_answer
from heterorl.tasks.base import GeneratedTask, Problem

OPERATORS = "+-*"
ANSWER_FORMATS = ("hash", "digits")


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

    ``answer_format`` is how a completion answers: ``hash`` (GSM8K style, the
    number after the last ``####`` counts, anything may come before it) or
    ``digits`` (the completion is exactly the result and then end-of-sequence:
    nothing before it, nothing after it, so a sample that runs out of tokens
    scores 0).
    """

    digits: int = 3
    ops: str = "+"
    eval_size: int = 512
    eval_seed: int = 54321
    answer_format: str = "hash"

    def __post_init__(self) -> None:
        _require_int("digits", self.digits, 1)
        _require_int("eval_size", self.eval_size, 1)
        _require_int("eval_seed", self.eval_seed)
        if not isinstance(self.ops, str) or not self.ops or set(self.ops) - set(OPERATORS):
            raise TaskError(f"arithmetic option ops={self.ops!r} must be a non-empty string of {OPERATORS!r}")
        if len(set(self.ops)) != len(self.ops):
            raise TaskError(f"arithmetic option ops={self.ops!r} repeats an operator; list each once")
        if self.answer_format not in ANSWER_FORMATS:
            raise TaskError(f"arithmetic option answer_format={self.answer_format!r} must be one of "
                            f"{', '.join(ANSWER_FORMATS)}")


def _evaluate(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


class ArithmeticTask(GeneratedTask):
    """``a<op>b=`` problems; reward 1.0 iff the completion's answer equals the result (see ``answer_format``)."""

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
        if self.config.answer_format == "digits":
            return problem.answer
        return f"#### {problem.answer}"

    def reward(self, problem: Problem, completion: str) -> float:
        if self.config.answer_format == "digits":
            # the completion's text has its end-of-sequence token removed; a longer text or one that was cut
            # at max_tokens (necessarily longer than the answer when max_tokens exceeds its length) differs
            return 1.0 if completion == problem.answer else 0.0
        predicted = extract_hash_answer(completion)
        return 1.0 if predicted is not None and answers_match(predicted, problem.answer) else 0.0
