"""Arithmetic with a calculator tool: the policy may call the tool, then answers.

The prompt is an expression, ``"=?"`` and a newline: ``"23*47+18=?\\n"``. Each turn the policy writes either

- a tool call, ``<calc>EXPR</calc>`` as the whole turn (surrounding whitespace ignored), answered with
  ``"\\n=VALUE\\n"`` (``"\\n=1099\\n"``), with ``"\\n=error\\n"`` when EXPR is not an expression the calculator
  takes (`calculate`), or with ``"\\n=limit\\n"`` once ``max_calls`` calls have been answered; or
- anything else, its final answer: reward 1.0 iff the answer (stripped) is the exact result, else 0, and the
  episode ends.

Every turn counts: an episode has at most ``max_calls + 2`` turns, and a tool call as the last of them ends the
episode with reward 0.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from heterorl.errors import TaskError
from heterorl.tasks.base import GeneratedTask, Problem
from heterorl.tasks.environment import Environment, StepResult

OPERATORS = "+-*"
DIGITS = "0123456789"
MAX_EXPRESSION_CHARS = 64
MAX_NUMBER_DIGITS = 12
MAX_NESTING = 16  # parentheses inside parentheses
CALL = re.compile(r"<calc>(.*)</calc>", re.DOTALL)
ERROR_ANSWER, LIMIT_ANSWER = "\n=error\n", "\n=limit\n"


class ExpressionError(ValueError):
    """An expression the calculator does not take: malformed, or past one of its bounds."""


class _Parser:
    """Recursive descent over one expression; ``pos`` is the next character to read."""

    def __init__(self, text: str) -> None:
        self.text, self.pos, self.depth = text, 0, 0

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expr(self) -> int:
        value = self.term()
        while self.peek() in ("+", "-"):
            operator = self.peek()
            self.pos += 1
            right = self.term()
            value = value + right if operator == "+" else value - right
        return value

    def term(self) -> int:
        value = self.factor()
        while self.peek() == "*":
            self.pos += 1
            value *= self.factor()
        return value

    def factor(self) -> int:
        char = self.peek()
        if char == "-":
            self.pos += 1
            return -self.factor()
        if char == "(":
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise ExpressionError(f"parentheses nested more than {MAX_NESTING} deep")
            self.pos += 1
            value = self.expr()
            if self.peek() != ")":
                raise ExpressionError(f"')' expected at {self.pos}")
            self.pos += 1
            self.depth -= 1
            return value
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in DIGITS:  # not str.isdigit, which takes '²'
            self.pos += 1
        if self.pos == start:
            raise ExpressionError(f"a number, '-' or '(' expected at {start}")
        if self.pos - start > MAX_NUMBER_DIGITS:
            raise ExpressionError(f"a number of more than {MAX_NUMBER_DIGITS} digits at {start}")
        return int(self.text[start:self.pos])


def calculate(expression: str) -> int:
    """The value of ``expression``, read without eval: integers, ``+ - *`` (``*`` binds tighter, all
    left-associative), unary minus and parentheses, no spaces::

        expr   := term (("+" | "-") term)*
        term   := factor ("*" factor)*
        factor := "-" factor | "(" expr ")" | digit+

    `ExpressionError` when it does not parse, is longer than 64 characters, holds a number of more than 12 digits
    or nests parentheses more than 16 deep.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"{len(expression)} characters, more than {MAX_EXPRESSION_CHARS}")
    parser = _Parser(expression)
    value = parser.expr()
    if parser.pos != len(expression):
        raise ExpressionError(f"unexpected {expression[parser.pos]!r} at {parser.pos}")
    return value


def tool_answer(expression: str) -> str:
    """The calculator's answer to ``expression``: ``"\\n=VALUE\\n"``, or ``"\\n=error\\n"``."""
    try:
        return f"\n={calculate(expression)}\n"
    except ExpressionError:
        return ERROR_ANSWER


def calculator_problem(expression: str) -> Problem:
    """The problem of ``expression`` (one `calculate` takes): prompt ``"EXPRESSION=?\\n"``, answer its value."""
    return Problem(problem_id=f"calculator-{expression}", prompt=f"{expression}=?\n",
                   answer=str(calculate(expression)), data={"expression": expression})


def _require_int(name: str, value: object, minimum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TaskError(f"calculator option {name}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise TaskError(f"calculator option {name}={value!r} must be >= {minimum}")


@dataclass(frozen=True)
class CalculatorConfig:
    """Problem and episode settings.

    A problem is ``terms`` numbers uniform in ``[0, 10**digits - 1]`` joined by operators drawn uniformly from the
    distinct characters of ``ops`` (any of ``+-*``), e.g. ``23*47+18``; the expression must fit the calculator
    (at most 64 characters, numbers of at most 12 digits). ``max_calls`` is the number of tool calls answered in
    an episode. The eval set is ``eval_size`` problems drawn from ``random.Random(eval_seed)``, duplicates
    dropped.
    """

    digits: int = 2
    ops: str = "+-*"
    terms: int = 3
    max_calls: int = 2
    eval_size: int = 256
    eval_seed: int = 24680

    def __post_init__(self) -> None:
        _require_int("digits", self.digits, 1)
        _require_int("terms", self.terms, 2)
        _require_int("max_calls", self.max_calls, 1)
        _require_int("eval_size", self.eval_size, 1)
        _require_int("eval_seed", self.eval_seed)
        if not isinstance(self.ops, str) or not self.ops or set(self.ops) - set(OPERATORS):
            raise TaskError(f"calculator option ops={self.ops!r} must be a non-empty string of {OPERATORS!r}")
        if len(set(self.ops)) != len(self.ops):
            raise TaskError(f"calculator option ops={self.ops!r} repeats an operator; list each once")
        if self.digits > MAX_NUMBER_DIGITS or self.terms * (self.digits + 1) - 1 > MAX_EXPRESSION_CHARS:
            raise TaskError(f"calculator options digits={self.digits}, terms={self.terms} make expressions the "
                            f"calculator does not take (numbers of at most {MAX_NUMBER_DIGITS} digits, at most "
                            f"{MAX_EXPRESSION_CHARS} characters); lower digits or terms")


class Calculator(Environment):
    """One episode of one problem with the calculator tool (see the module's docstring)."""

    def __init__(self, max_calls: int = 2) -> None:
        self.max_calls = max_calls

    def reset(self, problem: Problem) -> str:
        self.answer, self.turns, self.calls = problem.answer, 0, 0
        return problem.prompt

    def step(self, action: str) -> StepResult:
        self.turns += 1
        turn = action.strip()
        call = CALL.fullmatch(turn)
        if call is None:
            return StepResult(reward=1.0 if turn == self.answer else 0.0, done=True)
        if self.turns >= self.max_calls + 2:
            return StepResult(reward=0.0, done=True)
        if self.calls >= self.max_calls:
            return StepResult(LIMIT_ANSWER)
        self.calls += 1
        return StepResult(tool_answer(call.group(1)))


class CalculatorTask(GeneratedTask):
    """Arithmetic expressions answered with the help of a calculator tool; reward 1.0 iff the final answer is the
    exact result.

    ``demonstration`` calls the tool on the whole expression, then answers with its value.
    """

    name = "calculator"

    redraw_hint = "raise digits or terms, or lower eval_size, so training problems remain"

    def __init__(self, config: CalculatorConfig | None = None) -> None:
        super().__init__(config or CalculatorConfig())

    def alphabet(self) -> str:
        return "0123456789+-*()=?\n<>/acelimort"

    def generate(self, rng: random.Random) -> Problem:
        """Draw one problem (eval problems included)."""
        high = 10**self.config.digits - 1
        expression = str(rng.randint(0, high))
        for _ in range(self.config.terms - 1):
            expression += rng.choice(self.config.ops) + str(rng.randint(0, high))
        return calculator_problem(expression)

    def environment(self, problem: Problem) -> Calculator:
        return Calculator(self.config.max_calls)

    def demonstration(self, problem: Problem) -> list[str]:
        return [f"<calc>{problem.data['expression']}</calc>", problem.answer]

    def reward(self, problem: Problem, completion: str) -> float:
        raise TaskError("calculator is scored by its environment, turn by turn (task.environment(problem)); "
                        "a single completion has no reward")
