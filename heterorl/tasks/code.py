"""Writing small Python programs, scored by hidden unit tests run in a sandbox (`heterorl.tasks.sandbox`).

A problem is a statement and a function signature (or a stdin/stdout format), drawn from generated families
of integer and string functions with their own constants (``sum of the elements divisible by 3``, ``shift each
letter by 5``). Its hidden tests are inputs drawn for it, answered by the family's reference solution here;
the prompt never shows them. The reward is the fraction of tests the program passes (``reward: fraction``) or
1 only when it passes all (``all``). A completion may wrap its code in a ```python fence; the first fenced
block is run, else the whole completion. A fifth of every family's variants is held out (`held_out`, by the
prompt's digest): the eval set is drawn from them, and training never is.

``demonstration`` gives the reference solution's source, so a small model can be given a warm start by SFT.
"""

from __future__ import annotations

import logging
import random
import re
import sys
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from heterorl.errors import TaskError
from heterorl.tasks.base import MAX_EVAL_REDRAWS, GeneratedTask, Problem
from heterorl.tasks.sandbox import Outcome, Sandbox, SandboxLimits, SandboxUnavailable, TestCase, describe_unavailable

log = logging.getLogger(__name__)
REWARDS = ("fraction", "all")
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


@dataclass(frozen=True)
class CodeConfig:
    """Problem and sandbox settings: ``tests`` hidden tests per problem; ``reward`` ``fraction`` or ``all``;
    ``families`` the families to draw from (empty: all of `FAMILIES`); ``max_parallel`` programs run at once (at
    most the cores: `Sandbox` cuts it down, with a warning); the limits of each program (`SandboxLimits`);
    ``allow_weak_sandbox``: where the jail cannot run (not root, no nsjail, no cgroups), run programs in the weak
    sandbox instead of refusing to start (unsafe: only Python's audit hook stands between a program and much of
    the machine)."""

    tests: int = 8
    reward: str = "fraction"
    families: tuple = ()
    eval_size: int = 64
    eval_seed: int = 4242
    max_parallel: int = 2
    wall_s: float = 5.0
    cpu_s: float = 4.0
    memory_mb: int = 512
    output_bytes: int = 65536
    allow_weak_sandbox: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.tests, int) or isinstance(self.tests, bool) or self.tests < 1:
            raise TaskError(f"code option tests={self.tests!r} must be an integer >= 1")
        if self.reward not in REWARDS:
            raise TaskError(f"code option reward={self.reward!r} must be one of {', '.join(REWARDS)}")
        unknown = sorted(set(self.families) - set(FAMILIES))
        if unknown:
            raise TaskError(f"code option families: unknown {unknown}; known: {', '.join(sorted(FAMILIES))}")
        for name in ("eval_size", "max_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TaskError(f"code option {name}={value!r} must be an integer >= 1")
        if not isinstance(self.allow_weak_sandbox, bool):
            raise TaskError(f"code option allow_weak_sandbox={self.allow_weak_sandbox!r} must be true or false")
        SandboxLimits(wall_s=self.wall_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb, output_bytes=self.output_bytes)


@dataclass(frozen=True)
class Family:
    """A kind of problem: ``make(rng)`` gives (statement, entry function or None for stdin/stdout, reference
    solution source); ``inputs(rng)`` one test's (args, stdin)."""

    make: Callable
    inputs: Callable


def _ints(rng: random.Random, n: int = 0) -> list[int]:
    return [rng.randint(-20, 40) for _ in range(n or rng.randint(0, 8))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeilmnorstu") for _ in range(rng.randint(1, 7)))


def _sentence(rng: random.Random) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(1, 5)))


def _sum_divisible(rng):
    k = rng.randint(2, 9)
    return (f"Write a Python function `sum_divisible(xs)` that returns the sum of the integers in the list `xs` "
            f"that are divisible by {k}.", "sum_divisible",
            f"def sum_divisible(xs):\n    return sum(x for x in xs if x % {k} == 0)\n")


def _count_above(rng):
    t = rng.randint(0, 30)
    return (f"Write a Python function `count_above(xs)` that returns how many integers in the list `xs` are "
            f"greater than {t}.", "count_above", f"def count_above(xs):\n    return sum(1 for x in xs if x > {t})\n")


def _scale_add(rng):
    a, b = rng.randint(2, 9), rng.randint(1, 20)
    return (f"Write a Python function `scale_add(x)` that returns {a} times the integer `x` plus {b}.", "scale_add",
            f"def scale_add(x):\n    return {a} * x + {b}\n")


def _count_char(rng):
    c = rng.choice("abcdeilmnorstu")
    return (f"Write a Python function `count_char(s)` that returns how many times the letter '{c}' appears in the "
            "string `s`.", "count_char", f"def count_char(s):\n    return s.count('{c}')\n")


def _repeat_join(rng):
    k = rng.randint(2, 4)
    sep = rng.choice("-+,:")
    return (f"Write a Python function `repeat_join(s)` that returns the string `s` repeated {k} times, joined by "
            f"'{sep}'.", "repeat_join", f"def repeat_join(s):\n    return '{sep}'.join([s] * {k})\n")


def _shift_letters(rng):
    k = rng.randint(1, 25)
    return (f"Write a Python function `shift_letters(s)` that shifts each lowercase letter of the string `s` {k} "
            "places forward in the alphabet, wrapping from z to a, and leaves other characters as they are.",
            "shift_letters",
            "def shift_letters(s):\n    return ''.join(chr((ord(c) - 97 + "
            f"{k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)\n")


def _reverse_words(rng):
    sep = rng.choice(" ,;:-+_/|")
    upper = rng.random() < 0.5
    return (f"Write a Python function `reverse_words(s)` that returns the words of the string `s` (separated by "
            f"single spaces) in reverse order{', in upper case,' if upper else ''} joined by '{sep}'.",
            "reverse_words", f"def reverse_words(s):\n    return '{sep}'.join(s.split(' ')[::-1])"
            f"{'.upper()' if upper else ''}\n")


def _digit_sum(rng):
    m, c = rng.randint(2, 9), rng.randint(0, 9)
    return (f"Write a Python function `digit_sum(n)` that returns the sum of the decimal digits of the "
            f"non-negative integer `n`, multiplied by {m}, plus {c}.", "digit_sum",
            f"def digit_sum(n):\n    return {m} * sum(int(d) for d in str(n)) + {c}\n")


def _stdin_multiply(rng):
    a = rng.randint(2, 9)
    word, op = rng.choice((("sum", "+"), ("difference (the first minus the second)", "-"), ("product", "*")))
    return (f"Write a Python program that reads two integers, one per line, from standard input and prints their "
            f"{word} times {a}.", None, f"a = int(input())\nb = int(input())\nprint((a {op} b) * {a})\n")


FAMILIES: dict[str, Family] = {
    "sum_divisible": Family(_sum_divisible, lambda rng: ([_ints(rng)], "")),
    "count_above": Family(_count_above, lambda rng: ([_ints(rng)], "")),
    "scale_add": Family(_scale_add, lambda rng: ([rng.randint(-50, 50)], "")),
    "count_char": Family(_count_char, lambda rng: ([_sentence(rng)], "")),
    "repeat_join": Family(_repeat_join, lambda rng: ([_word(rng)], "")),
    "shift_letters": Family(_shift_letters, lambda rng: ([_sentence(rng)], "")),
    "reverse_words": Family(_reverse_words, lambda rng: ([_sentence(rng)], "")),
    "digit_sum": Family(_digit_sum, lambda rng: ([rng.randint(0, 99999)], "")),
    "stdin_multiply": Family(_stdin_multiply,
                             lambda rng: ([], f"{rng.randint(-99, 99)}\n{rng.randint(-99, 99)}\n")),
}


def reference_answers(source: str, entry: str | None, inputs: list[tuple[list, str]]) -> list:
    """The reference solution's answers (trusted code, run here): return values, or printed text."""
    import contextlib
    import io

    if entry is not None:  # defined once, called per test
        namespace: dict = {}
        exec(source, namespace)
        return [namespace[entry](*args) for args, _ in inputs]
    answers = []
    for _, stdin in inputs:  # a program runs whole for each test's input
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            lines = iter(stdin.splitlines())
            exec(source, {"input": lambda *_: next(lines)})
        answers.append(out.getvalue().strip())
    return answers


def held_out(prompt: str) -> bool:
    """Whether a problem belongs to the held-out fifth (by its prompt's CRC-32): never drawn for training."""
    return zlib.crc32(prompt.encode()) % 5 == 0


def program_of(completion: str) -> str:
    """The code of a completion: its first ```python fenced block, else all of it."""
    fenced = _FENCE.search(completion)
    return fenced.group(1) if fenced else completion


class CodeTask(GeneratedTask):
    """Generated programming problems; reward: hidden tests passed, run in a `Sandbox` (``stats``: why each
    program scored what it did)."""

    outcomes_kind = "programs"  # what its reward outcomes count (`rewards.outcomes_kind`)

    name = "code"
    redraw_hint = "lower eval_size or allow more families so that training problems remain"

    def __init__(self, config: CodeConfig) -> None:
        super().__init__(config)
        self.families = sorted(config.families or FAMILIES)
        self._sandbox: Sandbox | None = None
        self.isolation = "nsjail"
        problem = describe_unavailable(config.allow_weak_sandbox)  # (checked at start, before any program)
        if problem and not config.allow_weak_sandbox:
            raise SandboxUnavailable(problem)
        if problem:
            self.isolation = "weak"
            log.warning("!!! %s", problem)
            print(f"heterorl: WARNING: {problem}", file=sys.stderr, flush=True)

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:  # (started on first use: a task made only to read its config starts nothing)
            c = self.config
            self._sandbox = Sandbox(SandboxLimits(wall_s=c.wall_s, cpu_s=c.cpu_s, memory_mb=c.memory_mb,
                                                  output_bytes=c.output_bytes), c.max_parallel,
                                    isolation=self.isolation)
        return self._sandbox

    def use_sandbox(self, sandbox: Sandbox) -> None:
        """Score with ``sandbox`` from now on (e.g. a benchmark comparing isolations)."""
        self._sandbox = sandbox

    @property
    def stats(self) -> Counter:
        """Programs run, by outcome reason (ok, wrong_answer, timeout, memory, output_limit, forbidden:WHAT...)."""
        return self._sandbox.counts() if self._sandbox is not None else Counter()

    def alphabet(self) -> str:
        return "".join(chr(c) for c in range(32, 127)) + "\n"

    def generate(self, rng: random.Random) -> Problem:
        family = self.families[rng.randrange(len(self.families))]
        statement, entry, source = FAMILIES[family].make(rng)
        inputs = [FAMILIES[family].inputs(rng) for _ in range(self.config.tests)]
        answers = reference_answers(source, entry, inputs)
        tests = [{"args": args, "stdin": stdin, "expected": answer} for (args, stdin), answer in zip(inputs, answers)]
        prompt = statement + "\n"
        return Problem(problem_id=f"{family}-{zlib.crc32(prompt.encode()):08x}", prompt=prompt, answer=source,
                       data={"family": family, "entry": entry, "tests": tests})

    def eval_problems(self) -> list[Problem]:
        """``eval_size`` distinct held-out problems (a fifth of every family's variants, by their prompt's
        digest: `held_out`), drawn from ``Random(eval_seed)``; cached."""
        if self._eval is None:
            rng, problems = random.Random(self.config.eval_seed), {}
            for _ in range(100 * self.config.eval_size):
                problem = self.generate(rng)
                if held_out(problem.prompt):
                    problems.setdefault(problem.prompt, problem)
                    if len(problems) == self.config.eval_size:
                        break
            self._eval = list(problems.values())
        return list(self._eval)

    def sample_train(self, rng: random.Random) -> Problem:
        """A problem whose prompt is not held out: no variant of the eval set is ever drawn for training."""
        for _ in range(MAX_EVAL_REDRAWS):
            problem = self.generate(rng)
            if not held_out(problem.prompt):
                return problem
        raise TaskError(f"{MAX_EVAL_REDRAWS} code draws in a row were held-out problems; {self.redraw_hint}")

    def demonstration(self, problem: Problem) -> str:
        return problem.answer

    def _score(self, outcome: Outcome) -> float:
        if self.config.reward == "all":
            return 1.0 if outcome.total and outcome.passed == outcome.total else 0.0
        return outcome.fraction

    @staticmethod
    def _job(problem: Problem, completion: str) -> tuple[str, list[TestCase], str | None]:
        tests = [TestCase(args=t["args"], stdin=t["stdin"], expected=t["expected"]) for t in problem.data["tests"]]
        return program_of(completion), tests, problem.data["entry"]

    def reward(self, problem: Problem, completion: str) -> float:
        program, tests, entry = self._job(problem, completion)
        return self._score(self.sandbox.run(program, tests, entry=entry))

    def reward_batch(self, problems: list[Problem], completions: list[str]) -> list[float]:
        """`reward` of each (problem, completion), ``max_parallel`` programs at a time."""
        outcomes = self.sandbox.run_many([self._job(p, c) for p, c in zip(problems, completions)])
        return [self._score(o) for o in outcomes]


__all__ = ["CodeConfig", "CodeTask", "FAMILIES", "held_out", "program_of", "reference_answers"]
