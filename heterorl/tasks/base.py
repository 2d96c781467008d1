"""The task contract: problems, their prompts, and the reward that scores a completion.

Rewards run where the samples are (on the rollout worker), so a task is a pure
function of (problem, completion text) with no model or socket in sight.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


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
