"""User-supplied reward functions, named by an import path like ``"mypkg.scoring:reward"``.

A reward function is called as ``reward_fn(prompt, completion, answer)``
with three strings (the problem's prompt, the decoded completion without the
end-of-sequence token, the problem's reference answer) and returns a finite
real number (bool, int or float; the task contract expects [0, 1]).
"""

from __future__ import annotations

import importlib
import math
import numbers
import random
from typing import Callable

from heterorl.errors import TaskError
from heterorl.tasks.base import Problem, Task

RewardFn = Callable[[str, str, str], float]


def _describe(fn: object) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}:{qualname}" if module else qualname


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``"package.module:function"`` and return the function.

    Raises TaskError when the spec has no ``:``, the module cannot be
    imported, it has no such attribute, or the attribute is not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"reward function {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise TaskError(
            f"reward function {spec!r}: cannot import module {module_name!r} ({err}); "
            "check the name and that it is on PYTHONPATH"
        ) from err
    except Exception as err:
        raise TaskError(
            f"reward function {spec!r}: importing module {module_name!r} raised "
            f"{type(err).__name__}: {err}"
        ) from err
    if not hasattr(module, attr):
        raise TaskError(f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise TaskError(
            f"reward function {spec!r}: {attr!r} is a {type(fn).__name__}, not a function; "
            "name a callable (prompt, completion, answer) -> float"
        )
    return fn


class CustomRewardTask:
    """``base`` with its reward replaced by ``reward_fn(prompt, completion, answer) -> float``.

    Everything else (problems, eval set, demonstrations, alphabet) is the
    base task's. The function's result must be a finite real number; anything
    else, or an exception inside it, raises TaskError naming the function.
    """

    def __init__(self, base: Task, reward_fn: RewardFn) -> None:
        if not callable(reward_fn):
            raise TaskError(f"reward_fn {reward_fn!r} is not callable; pass a (prompt, completion, answer) -> float")
        self.base = base
        self.reward_fn = reward_fn
        self.name = base.name

    def alphabet(self) -> str:
        return self.base.alphabet()

    def sample_train(self, rng: random.Random) -> Problem:
        return self.base.sample_train(rng)

    def eval_problems(self) -> list[Problem]:
        return self.base.eval_problems()

    def demonstration(self, problem: Problem) -> str:
        return self.base.demonstration(problem)

    def reward(self, problem: Problem, completion: str) -> float:
        name = _describe(self.reward_fn)
        try:
            value = self.reward_fn(problem.prompt, completion, problem.answer)
        except Exception as err:
            raise TaskError(
                f"reward function {name} raised {type(err).__name__}: {err} "
                f"(problem {problem.problem_id!r})"
            ) from err
        if not isinstance(value, numbers.Real):
            raise TaskError(f"reward function {name} returned {value!r} ({type(value).__name__}); return a float")
        value = float(value)
        if not math.isfinite(value):
            raise TaskError(f"reward function {name} returned {value}; return a finite float")
        return value
