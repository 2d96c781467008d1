"""Tasks by name: ``make_task("maze", {"size": 6})`` builds a configured task.

``TASKS`` maps each name to its (task class, config class); options are the
config dataclass's fields. The multi-turn tasks (``maze_walk``, ``calculator``, ``cookbook_env``,
``verifiers_multiturn``) are tasks like the others, with an environment (`heterorl.tasks.environment`) that
answers the policy's turns (docs/ENVIRONMENTS.md).

A task of your own is named like a built-in one wherever a task is named (`task_classes`): by import path,
``task.name=my_pkg.envs:GuessTask``, or by the name an installed package gives it in the ``heterorl.tasks``
entry-point group. Every process of a run (the learner, each worker, on any host) imports it the same way, so it
must be importable there (installed, or on ``PYTHONPATH``). Its options are its config dataclass's fields: the
class's ``config_class`` attribute, else the annotated type of its constructor's first parameter; a class whose
constructor takes no config has no options (docs/TASKS.md, "A task of your own").
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from importlib.metadata import entry_points
from typing import Any

from heterorl.config import TaskConfig
from heterorl.errors import TaskError
from heterorl.import_paths import import_object
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


ENTRY_POINT_GROUP = "heterorl.tasks"  # installed packages name their tasks here: name = "package.module:Class"
# the methods of the task contract a class must have (and reward, or environment for multi-turn; its ``name``, a
# class attribute or one its constructor sets, is checked on the task made)
CONTRACT = ("alphabet", "sample_train", "eval_problems", "demonstration")


@dataclasses.dataclass
class NoOptions:
    """The options of a task whose constructor takes no config: none."""


def installed_tasks() -> dict[str, Any]:
    """The tasks installed packages declare in the ``heterorl.tasks`` entry-point group, by name (entry points,
    not yet loaded)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def config_class_of(task_cls: type) -> type:
    """The options dataclass of ``task_cls``: its ``config_class`` attribute, else the annotated type of its
    constructor's first parameter (``X``, ``X | None`` or ``Optional[X]``), else `NoOptions`. TaskError when what
    it names is not a dataclass."""
    found = getattr(task_cls, "config_class", None)
    if found is None:
        params = [p for p in inspect.signature(task_cls).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not params:
            return NoOptions
        try:
            hints = typing.get_type_hints(task_cls.__init__)
        except Exception:  # an annotation that does not resolve names no class
            hints = {}
        found = hints.get(params[0].name)
        options = [a for a in typing.get_args(found) if a is not type(None)]
        if len(options) == 1:  # X | None, Optional[X]
            found = options[0]
        if found is None:
            raise TaskError(f"task class {task_cls.__qualname__}: its constructor takes {params[0].name!r} but does "
                            "not say its type; annotate it with the options dataclass, or set the class attribute "
                            "config_class = YourConfig")
    if not (isinstance(found, type) and dataclasses.is_dataclass(found)):
        raise TaskError(f"task class {task_cls.__qualname__}: its options class {found!r} is not a dataclass; make "
                        "it one (@dataclasses.dataclass): its fields are the task's options (task.options.FIELD)")
    return found


def _checked(name: str, task_cls: Any) -> type:
    """``task_cls`` if it is a class with the task contract (`Task`, or `EpisodeTask` for multi-turn); else a
    TaskError naming what is missing."""
    if not isinstance(task_cls, type):
        raise TaskError(f"task {name!r} names a {type(task_cls).__name__}, not a class; name the task class "
                        "(see docs/TASKS.md, 'A task of your own')")
    from heterorl.tasks.environment import Environment

    if issubclass(task_cls, Environment):
        raise TaskError(f"task {name!r} names an Environment; name the task that makes it (a class with "
                        "environment(problem), sample_train, eval_problems, demonstration and name: "
                        "docs/ENVIRONMENTS.md)")
    missing = [m for m in CONTRACT if not hasattr(task_cls, m)]
    if not (hasattr(task_cls, "reward") or hasattr(task_cls, "environment")):
        missing.append("reward (or environment, for a multi-turn task)")
    if missing:
        raise TaskError(f"task {name!r} ({task_cls.__module__}.{task_cls.__qualname__}) lacks {', '.join(missing)} "
                        "of the task contract (heterorl.tasks.base.Task; docs/TASKS.md, 'A task of your own')")
    return task_cls


def task_classes(name: str) -> tuple[type, type]:
    """(task class, options dataclass) of the task ``name``: a built-in one (`TASKS`), an import path
    ``"package.module:Class"``, or a name in the ``heterorl.tasks`` entry-point group. TaskError naming the fix
    otherwise."""
    if name in TASKS:
        return TASKS[name]
    if ":" in name:
        task_cls = import_object(name, "task.name", "a task class (docs/TASKS.md, 'A task of your own')")
    else:
        installed = installed_tasks()
        if name not in installed:
            extra = f"; installed: {', '.join(sorted(installed))}" if installed else ""
            raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}{extra}; a task of your "
                            "own is named by its import path, task.name=package.module:Class (on PYTHONPATH or "
                            "installed), or by an entry point in the heterorl.tasks group")
        try:
            task_cls = installed[name].load()
        except Exception as err:
            raise TaskError(f"task {name!r}: loading its entry point {installed[name].value!r} failed: "
                            f"{type(err).__name__}: {err}") from err
    task_cls = _checked(name, task_cls)
    return task_cls, config_class_of(task_cls)


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
    task_cls, config_cls = task_classes(name)
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
    elif config_cls is NoOptions:
        task = task_cls()
    else:
        task = task_cls(config_cls(**options))
    if not isinstance(getattr(task, "name", None), str):
        raise TaskError(f"task {name!r} ({task_cls.__qualname__}) has no name: give the class a name attribute, "
                        "name = \"mytask\" (it names the task in logs and metrics)")
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


__all__ = ["ENTRY_POINT_GROUP", "NoOptions", "Problem", "Task", "TASKS", "config_class_of", "installed_tasks",
           "make_task", "make_task_from", "task_classes"]
