"""A task of your own, named by import path (``task.name=pkg.mod:Class``) or by an entry point, wherever a task is
named: the checks that refuse a class without the contract, and the documented example (docs/ENVIRONMENTS.md, "Your
environment in a run") run as written by `heterorl tasks --show`, `sft`, `rl` and `train` with two workers."""

import io
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from heterorl.errors import TaskError
from heterorl.tasks import TASKS, NoOptions, config_class_of, make_task, task_classes
from heterorl.tasks.catalog import print_catalog, show
from heterorl.tasks.maze import MazeConfig, MazeTask
from tests.conftest import ENV, REPO

DOC = REPO / "docs" / "ENVIRONMENTS.md"


def documented_module() -> str:
    """The ``guess_env.py`` of docs/ENVIRONMENTS.md: the python block of its section "Your environment in a run"
    that defines ``GuessTask``."""
    section = DOC.read_text().split("## Your environment in a run", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    found = [b for b in blocks if "class GuessTask" in b]
    assert len(found) == 1, "docs/ENVIRONMENTS.md: the section's guess_env.py block is gone"
    return found[0]


@pytest.fixture
def guess_env(tmp_path, monkeypatch):
    """The documented module written to a folder on ``sys.path`` (and on PYTHONPATH for processes)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "guess_env.py").write_text(documented_module())
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop("guess_env", None)


@dataclass
class Sizes:
    n: int = 3


class Annotated:
    name = "annotated"

    def __init__(self, config: "Sizes | None" = None) -> None:
        self.config = config

    def alphabet(self):
        return "ab"

    def sample_train(self, rng):
        raise NotImplementedError

    def eval_problems(self):
        return []

    def demonstration(self, problem):
        return "a"

    def reward(self, problem, completion):
        return 0.0


class NoConfig(Annotated):
    def __init__(self) -> None:
        self.config = None


class NamedInInit(NoConfig):
    name = None

    def __init__(self) -> None:
        self.name, self.config = "set-in-init", None


class Nameless(NamedInInit):
    def __init__(self) -> None:
        self.config = None


class NotATask:
    name = "not"

    def sample_train(self, rng):
        raise NotImplementedError


class Untyped(Annotated):
    def __init__(self, config) -> None:
        self.config = config


def test_a_class_by_import_path_gets_its_options_from_its_config_class_or_its_constructor(guess_env):
    cls, config = task_classes("guess_env:GuessTask")
    assert cls.__name__ == "GuessTask" and config.__name__ == "GuessConfig"
    task = make_task("guess_env:GuessTask", {"max_number": 7, "eval_size": 4})
    assert task.config.max_number == 7 and len(task.eval_problems()) <= 4
    with pytest.raises(TaskError, match="unknown option 'size'.*max_number"):
        make_task("guess_env:GuessTask", {"size": 4})
    assert config_class_of(Annotated) is Sizes and config_class_of(NoConfig) is NoOptions
    assert config_class_of(MazeTask) is MazeConfig
    assert make_task(f"{__name__}:NoConfig").config is None
    assert make_task(f"{__name__}:NamedInInit").name == "set-in-init"
    with pytest.raises(TaskError, match="has no name: give the class a name attribute"):
        make_task(f"{__name__}:Nameless")
    assert task_classes("maze") == (MazeTask, MazeConfig)


@pytest.mark.parametrize("name, message", [
    ("guess_env:Guess", "names an Environment; name the task that makes it"),
    ("guess_env:GuessConfig", "lacks alphabet, sample_train"),
    (f"{__name__}:NotATask", "lacks alphabet, eval_problems, demonstration, reward"),
    (f"{__name__}:Untyped", "does not say its type"),
    ("guess_env:random", "is a module, not callable; name a task class"),
    ("no_such_module_here:Task", "cannot import module 'no_such_module_here'"),
    ("guess_env:Nope", "has no attribute 'Nope'"),
    ("guess", "a task of your own is named by its import path"),
])
def test_a_name_that_is_no_task_is_refused_naming_the_fix(guess_env, name, message):
    with pytest.raises(TaskError, match=re.escape(message)):
        task_classes(name)


def test_an_installed_package_names_its_task_by_entry_point(guess_env, tmp_path, monkeypatch):
    dist = tmp_path / "mine" / "guess_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: guess-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[heterorl.tasks]\nguess = guess_env:GuessTask\n")
    cls, config = task_classes("guess")
    assert cls.__name__ == "GuessTask" and config.__name__ == "GuessConfig"
    out = io.StringIO()
    print_catalog(out)
    assert re.search(r"guess\s+guess_env:GuessTask", out.getvalue()), out.getvalue()


def _cli(*args: str, folder: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(folder), str(REPO)]))
    return subprocess.run([sys.executable, "-m", "heterorl.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


SMALL = ["task.options.eval_size=8", "rollout.max_turns=4", "rollout.max_tokens=2", "rollout.group_size=4",
         "policy.tiny.hidden_size=32", "policy.tiny.num_layers=1", "policy.tiny.num_heads=2",
         "policy.tiny.num_kv_heads=2", "policy.tiny.intermediate_size=64", "logging.progress=false"]


@pytest.mark.slow
def test_the_documented_example_runs_under_tasks_sft_rl_train_with_two_workers_and_sweep(guess_env, tmp_path):
    name = "task.name=guess_env:GuessTask"
    out = _cli("tasks", "--show", "guess_env:GuessTask", folder=guess_env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "max_number: 9" in out.stdout and "an example:" in out.stdout and "run it: heterorl rl" in out.stdout
    out = _cli("sft", name, *SMALL, "sft.steps=4", "sft.eval_every=4", "sft.batch_size=8", "sft.output=base",
               "logging.run_dir=sft", folder=guess_env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "base" / "config.json").exists()
    out = _cli("rl", name, *SMALL, "rl.base=base", "rl.steps=2", "rl.prompts_per_step=4", "rl.eval_every=2",
               "logging.run_dir=rl", folder=guess_env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads((tmp_path / "rl" / "summary.json").read_text())["steps"] == 2
    assert out.stdout.startswith("heterorl rl: task guess_env:GuessTask, base base, loss gepo, 2 steps x 4 prompts "
                                 "x 4; synchronous in one process, no delay"), out.stdout[:300]
    out = _cli("train", name, *SMALL, "rl.base=base", "rl.steps=2", "rl.prompts_per_step=4", "rl.eval_every=2",
               "runtime.workers=2", "runtime.groups_per_call=2", "delay.up.kind=none", "delay.down.kind=none",
               "logging.run_dir=train", folder=guess_env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("heterorl train: task guess_env:GuessTask, base base, loss gepo, 2 steps x 4 "
                                 "prompts x 4; async, 2 workers, delay none"), out.stdout[:300]
    run = tmp_path / "train"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["rollouts"]["trained"] > 0, summary["rollouts"]
    assert set(summary["reward_outcomes"]) <= {"episode:done", "episode:max_turns", "episode:budget"}
    for worker in ("worker-0", "worker-1"):  # each process imported the task by its path
        assert "task guess," in (run / "logs" / f"{worker}.log").read_text()
    # and a sweep's cells, each a process of its own
    (tmp_path / "run.yaml").write_text(
        "task: {name: 'guess_env:GuessTask', options: {eval_size: 8}}\n"
        "rollout: {max_turns: 4, max_tokens: 2, group_size: 4}\n"
        "policy: {tiny: {hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 2, intermediate_size: 64}}\n"
        "rl: {base: base, steps: 2, prompts_per_step: 4, eval_every: 2}\nlogging: {progress: false}\n")
    (tmp_path / "sweep.yaml").write_text(
        "name: guess\nconfig: run.yaml\nmode: simulated\nparallel: 1\nthreads_per_cell: 1\n"
        "losses: {gepo: {loss.name: gepo}, grpo: {loss.name: grpo}}\ndelays: [lag0]\nseeds: [0]\n")
    out = _cli("sweep", "sweep.yaml", "--out", "sweep", folder=guess_env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    cells = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "sweep" / "cells").glob("*/summary.json")}
    assert sorted(cells) == ["gepo__dlag0__s0", "grpo__dlag0__s0"] and all(c["steps"] == 2 for c in cells.values())


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_show_gives_every_task_an_example_and_a_command_or_what_it_needs(name):
    """Once only reasoning-gym's datasets had an example; a task whose defaults name no data (a file, an environment
    of another library) says which options it needs instead."""
    out = io.StringIO()
    show(name, out)
    text = out.getvalue()
    assert "options (defaults):" in text
    assert f"run it: heterorl rl task.name={name} " in text, text
    if name in ("jsonl", "verifiers", "verifiers_multiturn", "cookbook_env"):  # your data or environment
        assert "an example needs its options set:" in text, text
    else:  # their defaults (reasoning_gym: one of its datasets) draw problems
        assert "an example:" in text and "demonstration: " in text, text
