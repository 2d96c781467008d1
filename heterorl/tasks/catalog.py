"""`heterorl tasks`: every task a run can name — heterorl's own (`TASKS`) with their options, those installed
packages declare (the ``heterorl.tasks`` entry points), and the datasets of reasoning-gym
(``task.name=reasoning_gym``) — and ``--show NAME`` for one of them (a name, an entry point or an import path
``pkg.mod:Class``), with an example problem and a command that runs it."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import sys
import textwrap
from typing import Any, TextIO

from heterorl.errors import TaskError
from heterorl.tasks import TASKS, installed_tasks, make_task, task_classes
from heterorl.tasks.reasoning_gym import INSTALL_HINT, dataset_options, datasets_available


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def task_options(name: str) -> dict[str, Any]:
    """A task's options and their defaults (its config dataclass's fields)."""
    return {f.name: _default(f) for f in dataclasses.fields(task_classes(name)[1])}


def summary_line(cls: type) -> str:
    """The first sentence of a class's docstring (else of its module's)."""
    doc = cls.__doc__ or getattr(sys.modules.get(cls.__module__), "__doc__", None) or ""
    doc = " ".join(doc.replace("`", "").split())
    return doc.split(". ")[0].rstrip(".") if doc else ""


def reasoning_gym_names() -> list[str] | None:
    """reasoning-gym's dataset names, sorted; None when it is not installed."""
    try:
        return sorted(datasets_available())
    except TaskError:
        return None


def catalog() -> dict[str, Any]:
    """What `heterorl tasks --json` prints: heterorl's tasks (summary, options) and reasoning-gym's datasets."""
    return {"tasks": {name: {"summary": summary_line(cls), "options": task_options(name)}
                      for name, (cls, _) in TASKS.items()},
            "reasoning_gym": reasoning_gym_names()}


def _columns(names: list[str], width: int) -> str:
    cell = max(len(n) for n in names) + 2
    per_line = max(1, (width - 2) // cell)
    lines = [names[i:i + per_line] for i in range(0, len(names), per_line)]
    return "\n".join("  " + "".join(n.ljust(cell) for n in line).rstrip() for line in lines)


def print_catalog(out: TextIO | None = None) -> None:
    out = out or sys.stdout  # looked up per call: a default bound at import outlives a replaced stdout
    width = min(120, shutil.get_terminal_size((100, 20)).columns)
    print("heterorl's tasks (task.name=NAME, task.options.OPTION=VALUE; `heterorl tasks --show NAME`):", file=out)
    for name, (cls, _) in TASKS.items():
        print(f"  {name:<14} {summary_line(cls)}", file=out)
        options = ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in task_options(name).items())
        print(textwrap.fill(options, width, initial_indent=" " * 17, subsequent_indent=" " * 17), file=out)
    installed = installed_tasks()
    if installed:
        print("\ninstalled packages' tasks (the heterorl.tasks entry points; task.name=NAME):", file=out)
        for name, entry in sorted(installed.items()):
            print(f"  {name:<14} {entry.value}", file=out)
    print("\na task of your own: task.name=package.module:Class (importable: installed, or on PYTHONPATH, in every "
          "process of the run); docs/TASKS.md, 'A task of your own'", file=out)
    names = reasoning_gym_names()
    print(file=out)
    if names is None:
        print(f"reasoning-gym's datasets: not installed ({INSTALL_HINT})", file=out)
        return
    print(f"reasoning-gym's datasets ({len(names)}; task.name=reasoning_gym task.options.dataset=NAME, or a mixture "
          "task.options.datasets={NAME: WEIGHT, ...}):", file=out)
    print(_columns(names, width), file=out)


def show(name: str, out: TextIO | None = None) -> None:
    """One task's options, or one reasoning-gym dataset's, with an example problem and its demonstration."""
    out = out or sys.stdout
    if name in TASKS or ":" in name or name in installed_tasks():
        cls, _ = task_classes(name)  # TaskError naming the fix for a path that does not import or lacks the contract
        print(f"{name}: {summary_line(cls)}", file=out)
        print("options (defaults):", file=out)
        for key, value in task_options(name).items():
            print(f"  {key}: {json.dumps(value, default=str)}", file=out)
        _example(name, out)
        return
    names = reasoning_gym_names()
    if names is None:
        raise TaskError(f"no heterorl task {name!r} (known: {', '.join(TASKS)}); reasoning-gym, which may have it "
                        f"as a dataset, is not installed ({INSTALL_HINT})")
    options = dataset_options(name)  # TaskError naming close matches when there is no such dataset
    print(f"reasoning-gym dataset {name} (task.name=reasoning_gym task.options.dataset={name})", file=out)
    print("options (task.options.config; defaults):", file=out)
    for key, value in options.items():
        print(f"  {key}: {json.dumps(value, default=str)}", file=out)
    task = make_task("reasoning_gym", {"dataset": name, "eval_size": 1, "size": 1000})
    problem = task.sample_train(random.Random(0))
    print("an example (answer_format answer_tag):", file=out)
    print(textwrap.indent(f"prompt: {problem.prompt}\ndemonstration: {task.demonstration(problem)}", "  "), file=out)


# the options an example of a task sets beyond its defaults (one of its datasets), and the options a task needs
# that no example can fill in for you (your data, your environment), as a command line shows them
EXAMPLE_OPTIONS = {"reasoning_gym": {"dataset": "basic_arithmetic"}}
YOURS = {"jsonl": "task.options.path=data.jsonl   (rows {\"prompt\": ..., \"answer\": ...}; docs/TASKS.md)",
         "verifiers": "task.options.env=my_envs.arith:load_taskset   (docs/TASKS.md, verifiers)",
         "verifiers_multiturn": "task.options.env=...   (docs/ENVIRONMENTS.md, environments of other libraries)",
         "cookbook_env": "task.options.source=package.module:name   (docs/ENVIRONMENTS.md, tinker-cookbook)"}


def _example(name: str, out: TextIO) -> None:
    """An example problem of task ``name`` with its demonstration, and a command line that runs it; when the task
    cannot be built without your data or environment, the options it needs and a command that names them."""
    from heterorl.tasks.environment import is_multi_turn

    options = EXAMPLE_OPTIONS.get(name, {})
    try:
        task = make_task(name, options)
        problem = task.sample_train(random.Random(0))
        demonstration = task.demonstration(problem)
    except Exception as err:  # a task whose defaults need data, a library or a server: say what it needs
        print(f"an example needs its options set: {err}", file=out)
        if name in YOURS:
            print(f"run it: heterorl rl task.name={name} {YOURS[name]}", file=out)
        return
    if is_multi_turn(task):
        demonstration = " | ".join(demonstration)
    print("an example:", file=out)
    print(textwrap.indent(f"prompt: {problem.prompt}\ndemonstration: {demonstration}", "  "), file=out)
    given = "".join(f" task.options.{k}={v}" for k, v in options.items())
    print(f"run it: heterorl rl task.name={name}{given} rl.base=smollm2 rl.steps=20   (or a tiny base of its own "
          f"first: heterorl sft task.name={name}{given})", file=out)


def tasks_command(show_name: str | None = None, as_json: bool = False) -> int:
    """`heterorl tasks [--show NAME] [--json]`."""
    if as_json:
        print(json.dumps(catalog(), indent=2, default=str))
    elif show_name:
        show(show_name)
    else:
        print_catalog()
    return 0
