"""The README and docs/ stay true to the code: every command, benchmark, packaged config and module is named
where a reader looks for it, every relative link leads to a file, and the README's loop is Python whose imports
exist. Fast: it reads files and builds the argparse parser, nothing runs."""

import argparse
import ast
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from heterorl.cli import build_parser
from heterorl.config import packaged
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
COMMAND_LIST = "## The command line"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """{name: its parser} of the parser's subcommands."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def benchmarks() -> list[str]:
    """The names `heterorl bench` accepts."""
    (what,) = [a for a in subcommands(build_parser())["bench"]._actions if a.dest == "what"]
    return list(what.choices)


def command_list() -> list[str]:
    """The lines of the fenced block in README.md's command list section."""
    text = README.read_text()
    assert COMMAND_LIST in text, f"README.md lost its {COMMAND_LIST!r} section"
    section = text.split(COMMAND_LIST, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block, f"no ``` block in README.md's {COMMAND_LIST!r} section"
    return block.group(1).splitlines()


def listed(prefix: str) -> set[str]:
    """The words that follow ``prefix`` at the start of a line of the command list."""
    return {m.group(1) for line in command_list() if (m := re.match(re.escape(prefix) + r"(\S+)", line))}


def named(name: str, text: str) -> bool:
    """Whether ``name`` occurs in ``text`` as a whole path: not inside a longer name or path."""
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w/-])", text) is not None


def module_paths() -> list[str]:
    """Every module of gepo/ and heterorl/ by its path from the repository root, as docs/ARCHITECTURE.md names
    them: a module by its file (heterorl/transport/server.py), a package by its folder (heterorl/transport/)."""
    paths = []
    for package in ("gepo", "heterorl"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if "__pycache__" not in relative.parts:
                paths.append(f"{relative.parent.as_posix()}/" if path.name == "__init__.py" else relative.as_posix())
    return paths


def without_code(text: str) -> str:
    """Markdown without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def test_the_readme_lists_every_command():
    commands = set(subcommands(build_parser()))
    assert {"demo", "train", "serve", "bench"} <= commands  # the parser is read right
    missing = sorted(commands - listed("heterorl "))
    assert not missing, (f"README.md's command list ({COMMAND_LIST!r}) lacks a line starting "
                         f"{', '.join('heterorl ' + m for m in missing)}: add one per command, with what it does")


def test_the_readme_lists_every_benchmark():
    names = benchmarks()
    assert "engine" in names
    missing = sorted(set(names) - listed("heterorl bench "))
    assert not missing, (f"README.md's command list ({COMMAND_LIST!r}) lacks a line starting "
                         f"{', '.join('heterorl bench ' + m for m in missing)}: add one per benchmark")


def test_every_packaged_config_is_named_in_the_docs():
    text = "\n".join(page.read_text() for page in PAGES)
    configs = sorted(p.name for p in (ROOT / "heterorl" / "configs").glob("*.yaml"))
    assert "demo.yaml" in configs
    missing = [name for name in configs if not named(name, text)]
    assert not missing, (f"packaged configs named in neither README.md nor docs/: {', '.join(missing)}; "
                         "docs/COMMANDS.md lists them")


def test_every_module_is_in_the_architecture_page():
    text = (DOCS / "ARCHITECTURE.md").read_text()
    paths = module_paths()
    assert "heterorl/cli.py" in paths and "gepo/" in paths
    missing = [path for path in paths if not named(path, text)]
    assert not missing, ("docs/ARCHITECTURE.md (\"## Modules\") does not name " + ", ".join(missing)
                         + ": add a line each, its path and what it holds")


def test_named_checks_whole_paths():
    assert named("heterorl/cli.py", "`heterorl/cli.py` argparse")
    assert not named("heterorl/", "heterorl/cli.py")  # a package's folder is not named by its modules' paths
    assert named("heterorl/", "heterorl/   the package")
    assert not named("maze_rl.yaml", "maze4_rl.yaml and my_maze_rl.yaml")


def test_relative_links_lead_to_files():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text())):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} → {target}")
    assert not broken, "links to files that do not exist: " + "; ".join(broken)


def test_the_readme_loop_is_python_against_the_real_api():
    (block,) = [b for b in python_blocks(README) if "forward_backward" in b]
    tree = ast.parse(block)
    imported = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names]
    assert ("heterorl.training.session", "TrainingClient") in imported
    for module, name in imported:
        assert hasattr(importlib.import_module(module), name), f"README.md's loop imports {name} from {module}"
    client = importlib.import_module("heterorl.training.session").TrainingClient
    for primitive in ("forward_backward", "optim_step", "save_weights_and_get_sampling_client"):
        assert primitive in block and hasattr(client, primitive), primitive


def test_the_readme_loop_runs_and_prints_its_rewards_and_held_out_success_before_and_after(tmp_path):
    """The README's loop as a reader runs it, in a process of its own, shortened (2 steps, 16 held-out problems):
    it prints the held-out success before, each step's mean reward and the success after, and no load bar."""
    (block,) = [b for b in python_blocks(README) if "forward_backward" in b]
    short = block.replace("range(20)", "range(2)").replace("eval_problems()[:128]", "eval_problems()[:16]")
    assert short.count("range(2)") == 1 and "[:16]" in short, "the README loop's step count or eval size moved"
    (tmp_path / "loop.py").write_text(short)
    out = subprocess.run([sys.executable, "loop.py"], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["held-out success before", "step 1", "step 2",
                                                     "held-out success after"], out.stdout
    assert all(0 <= float(line.rsplit(" ", 1)[1]) <= 1 for line in lines)
    assert "Loading weights" not in out.stderr  # (a shipped policy loads without transformers' bar)


RUNNABLE = re.compile(r"<!-- runnable(?::([^>]*))? -->\n```(?:bash|sh)\n(.*?)```", re.S)
DATA_ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(1, 7) for b in range(1, 5)]


def runnable_blocks() -> list[tuple[str, list[str]]]:
    """Every shell block of the README and docs/ marked ``<!-- runnable[: key=value ...] -->``: (where, its heterorl
    command lines, continuation lines joined, comments dropped, the marker's overrides appended to those of
    sft, rl, train and sweep)."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in RUNNABLE.finditer(text):
            overrides = (match.group(1) or "").split()
            lines = match.group(2).replace("\\\n", " ").splitlines()
            commands = []
            for line in lines:
                words = shlex.split(line, comments=True)
                if words[:1] == ["heterorl"]:
                    takes = words[1] in ("sft", "rl", "train", "sweep")
                    commands.append([*words[1:], *(overrides if takes else [])])
            where = f"{page.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}"
            blocks.append((where, commands))
    return blocks


def test_runnable_blocks_are_marked():
    blocks = runnable_blocks()
    assert len(blocks) >= 5 and all(commands for _, commands in blocks), blocks


@pytest.mark.parametrize("where, commands", runnable_blocks(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_runnable_block_of_the_docs_runs_as_written(where, commands, tmp_path):
    """The block's heterorl commands, one after another, in a folder that holds what the docs' examples name:
    ``my_run.yaml`` (the packaged demo.yaml) and ``data.jsonl`` (additions); each must exit 0 without a
    traceback."""
    (tmp_path / "my_run.yaml").write_text(packaged("demo.yaml").read_text())
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in DATA_ROWS))
    for command in commands:
        out = run_cli(*command, cwd=tmp_path, timeout=600)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (where, command, out.stderr[-3000:])


def test_python_blocks_in_the_docs_parse():
    for page in PAGES:
        for block in python_blocks(page):
            try:
                ast.parse(block)
            except SyntaxError as exc:
                raise AssertionError(f"{page.relative_to(ROOT)}: a ```python block does not parse: {exc}") from None
