"""Tasks by name: ``make_task("maze", {"size": 6})`` builds a configured task.

``TASKS`` maps each name to its (task class, config class); options are the
config dataclass's fields. The multi-turn tasks (``maze_walk``, ``calculator``, ``cookbook_env``,
``verifiers_multiturn``) are tasks like the others, with an environment (`heterorl.tasks.environment`) that
answers the policy's turns (docs/ENVIRONMENTS.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from heterorl.config import TaskConfig
from heterorl.errors import TaskError
from heterorl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from heterorl.tasks.base import Problem, Task
from heterorl.tasks.calculator import CalculatorConfig, CalculatorTask
from heterorl.tasks.code import CodeConfig, CodeTask
from heterorl.tasks.cookbook_env import CookbookEnvConfig, CookbookEnvTask
from heterorl.tasks.jsonl import JsonlConfig, JsonlTask
from heterorl.tasks.maze import MazeConfig, MazeTask
from heterorl.tasks.maze_walk import MazeWalkConfig, MazeWalkTask
from heterorl.tasks.reasoning_gym import ReasoningGymConfig, ReasoningGymTask
from heterorl.tasks.rewards import CustomRewardTask, load_reward_fn
from heterorl.tasks.verifiers_env import VerifiersConfig, VerifiersTask
from heterorl.tasks.verifiers_multiturn import VerifiersMultiTurnConfig, VerifiersMultiTurnTask

TASKS: dict[str, tuple[type, type]] = {
    "maze": (MazeTask, MazeConfig),
    "arithmetic": (ArithmeticTask, ArithmeticConfig),
    "jsonl": (JsonlTask, JsonlConfig),
    "code": (CodeTask, CodeConfig),
    "reasoning_gym": (ReasoningGymTask, ReasoningGymConfig),
    "verifiers": (VerifiersTask, VerifiersConfig),
    "maze_walk": (MazeWalkTask, MazeWalkConfig),
    "calculator": (CalculatorTask, CalculatorConfig),
    "cookbook_env": (CookbookEnvTask, CookbookEnvConfig),
    "verifiers_multiturn": (VerifiersMultiTurnTask, VerifiersMultiTurnConfig),
}


def make_task(name: str, options: dict[str, Any] | None = None, reward_fn: str | None = None,
              reward_timeout_s: float | None = TaskConfig.reward_timeout_s,
              reward_weights: list[float] | None = None) -> Task:
    """Build task ``name`` from ``options`` (its config's fields).

    When ``reward_fn`` (``"package.module:function"``, or several comma-separated, summed with
    ``reward_weights``) is given, the task is wrapped in :class:`CustomRewardTask` and scored by those
    functions, each call limited to ``reward_timeout_s`` seconds (None: no limit); a task scored by a library
    (its class's ``scored_by_library``) is given the same limit for the library's calls (`GuardedScore`). Raises
    TaskError for an unknown task name, an unknown or missing option, or a
    bad reward function path.
    """
    tasks = TASKS
    if name not in tasks:
        raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(tasks))}")
    task_cls, config_cls = tasks[name]
    options = dict(options or {})
    fields = [f.name for f in dataclasses.fields(config_cls)]
    for key in options:
        if key not in fields:
            raise TaskError(f"unknown option {key!r} for task {name!r}; valid options: {', '.join(fields)}")
    required = [
        f.name
        for f in dataclasses.fields(config_cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [key for key in required if key not in options]
    if missing:
        raise TaskError(f"task {name!r} needs option(s) {', '.join(missing)}")
    if getattr(task_cls, "scored_by_library", False):  # its scorer is a library's call, bounded and counted
        task = task_cls(config_cls(**options), reward_timeout_s=reward_timeout_s)
    else:
        task = task_cls(config_cls(**options))
    if reward_fn is not None:
        if callable(getattr(task, "environment", None)):
            raise TaskError(f"task {name!r} is multi-turn: its environment scores each episode, so task.reward_fn "
                            "(which scores one completion's text) cannot replace it; leave task.reward_fn unset")
        fns = [load_reward_fn(spec.strip()) for spec in reward_fn.split(",")]
        task = CustomRewardTask(task, fns, reward_timeout_s, reward_weights)
    return task


def make_task_from(config: TaskConfig) -> Task:
    """`make_task` from a run config's ``task`` section (its name, options, reward function and timeout)."""
    weights = None if config.reward_weights is None else list(config.reward_weights)
    return make_task(config.name, dict(config.options), config.reward_fn, config.reward_timeout_s, weights)


__all__ = ["Problem", "Task", "TASKS", "make_task", "make_task_from"]
