"""The task contract: problems, their prompts, and the reward that scores a completion.

Rewards run where the samples are (on the rollout worker), so a task is a pure
function of (problem, completion text) with no model or socket in sight.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from heterorl.errors import TaskError

MAX_EVAL_REDRAWS = 1_000


@dataclass(frozen=True)
class Problem:
    """One prompt and what is needed to score completions of it.

    ``answer`` is the reference the reward compares against (a number for
    arithmetic, the demonstration path for a maze); ``data`` carries any
    task-specific structure (the maze grid, say) and must be plain Python
    values so a problem can travel in a message.
    """

    problem_id: str
    prompt: str
    answer: str
    data: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    """What every task provides. Implementations live in ``heterorl.tasks.*``."""

    name: str

    def alphabet(self) -> str:
        """Every character a prompt or a completion of this task may contain (for char-level tokenizers)."""

    def sample_train(self, rng: random.Random) -> Problem:
        """Draw one training problem. Never returns a problem of the held-out eval set."""

    def eval_problems(self) -> list[Problem]:
        """The fixed held-out evaluation set (same list for the same task config)."""

    def demonstration(self, problem: Problem) -> str:
        """A correct completion, used as SFT data (without the end-of-sequence token)."""

    def reward(self, problem: Problem, completion: str) -> float:
        """Score one completion (decoded text, end-of-sequence token removed) in [0, 1]."""


class GeneratedTask:
    """Shared by procedurally generated tasks: a seeded held-out eval set, and
    training draws that never hit it. Subclasses set ``config`` (with
    ``eval_size`` and ``eval_seed``), define ``generate(rng)`` and
    ``redraw_hint`` (what to change when training problems run out)."""

    redraw_hint = "lower eval_size so training problems remain"

    def __init__(self, config) -> None:
        self.config = config
        self._eval: list[Problem] | None = None
        self._eval_prompts: set[str] = set()

    def generate(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def eval_problems(self) -> list[Problem]:
        """``eval_size`` problems drawn from ``Random(eval_seed)``, duplicates dropped; cached."""
        if self._eval is None:
            rng = random.Random(self.config.eval_seed)
            problems: dict[str, Problem] = {}
            for _ in range(self.config.eval_size):
                problem = self.generate(rng)
                problems.setdefault(problem.prompt, problem)
            self._eval = list(problems.values())
            self._eval_prompts = set(problems)
        return list(self._eval)

    def sample_train(self, rng: random.Random) -> Problem:
        """A fresh problem whose prompt is not in the eval set."""
        self.eval_problems()
        for _ in range(MAX_EVAL_REDRAWS):
            problem = self.generate(rng)
            if problem.prompt not in self._eval_prompts:
                return problem
        raise TaskError(
            f"{MAX_EVAL_REDRAWS} {self.name} draws in a row were all in the eval set; {self.redraw_hint}"
        )


class FixedRows:
    """Shared by tasks read from a fixed set of rows (a file, a verifiers taskset): subclasses fill ``_train``,
    ``_eval`` (disjoint in prompt) and ``_alphabet``."""

    _train: list[Problem]
    _eval: list[Problem]
    _alphabet: str

    def alphabet(self) -> str:
        return self._alphabet

    def sample_train(self, rng: random.Random) -> Problem:
        """A uniformly drawn training row (never one whose prompt is in the eval set)."""
        return rng.choice(self._train)

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)


def check_split_options(task: str, config, counts: tuple[str, ...] = ("eval_size",)) -> None:
    """The held-out split's options of a task read from fixed rows (`held_out_split`): ``eval_fraction`` in
    (0, 1), each of ``counts`` an integer >= 1 or null, ``split_seed`` an integer; TaskError naming the option."""
    fraction = config.eval_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise TaskError(f"{task} option eval_fraction={fraction!r} must be a number in (0, 1)")
    for key in counts:
        value = getattr(config, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TaskError(f"{task} option {key}={value!r} must be an integer >= 1 or null")
    if isinstance(config.split_seed, bool) or not isinstance(config.split_seed, int):
        raise TaskError(f"{task} option split_seed={config.split_seed!r} must be an integer")


def held_out_split(problems: list[Problem], eval_size: int | None, eval_fraction: float, seed: int, what: str,
                   instead: str, by_prompt: bool = True) -> tuple[list[Problem], list[Problem]]:
    """(train, eval): ``eval_size`` problems (else ``eval_fraction`` of them, at least one) held out by a shuffle
    with ``random.Random(seed)``, and the rest; with ``by_prompt``, training rows whose prompt repeats a held-out
    one are dropped too (without: rows are told apart by their ids, as environments whose episodes differ behind
    one prompt are). TaskError naming ``what`` (and ``instead``, what else to give) when nothing would be left."""
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    n_eval = eval_size or max(1, int(eval_fraction * len(problems)))
    if n_eval >= len(problems):
        raise TaskError(f"{what}: an eval set of {n_eval} leaves no training rows of {len(problems)}; lower "
                        f"eval_size or eval_fraction, or {instead}")
    held_out = [problems[i] for i in order[:n_eval]]
    prompts = {p.prompt for p in held_out} if by_prompt else set()
    train = [problems[i] for i in order[n_eval:] if problems[i].prompt not in prompts]
    if not train:
        raise TaskError(f"{what}: every training row repeats a held-out prompt")
    return train, held_out
