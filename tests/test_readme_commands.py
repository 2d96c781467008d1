"""Every command of the README's command list runs through the real entry point (`heterorl.cli.main`, and the
installed `heterorl` script for the demo): the demo for a few steps, the others with their cheapest real
arguments or `--dry-run` where a run would be long. A parser change that breaks a command fails here; a command
added to the README without a case here fails too (`test_every_readme_command_has_a_case`)."""

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import gepo
from heterorl.cli import BENCHMARKS, main
from tests.conftest import ENV, REPO


def readme_commands() -> list[str]:
    """The command words of the README's "The command line" block: `demo`, `train`, `bench engine`, ..."""
    block = re.search(r"## The command line\n\n```\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    commands = []
    for line in block.splitlines():
        words = line.split()
        if words[:1] == ["heterorl"]:
            commands.append(" ".join(words[1:3]) if words[1] == "bench" else words[1])
    return commands


def _heterorl(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed console script (the entry point a user runs), as a process."""
    script = Path(sys.executable).with_name("heterorl")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "heterorl.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout)


def _in_process(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's --help and its errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out + out.err


SWEEP = REPO / "experiments" / "configs" / "add3_long.yaml"  # 15 cells to resolve
COMMITTED_SWEEP = REPO / "experiments" / "results" / "add3_long"  # the smallest committed sweep (15 cells)


def case_demo(tmp_path, capsys):
    run = _heterorl("demo", "rl.steps=2", "rl.eval_every=2", "task.options.eval_size=32", "runtime.checkpoint_every=2",
                    f"logging.run_dir={tmp_path / 'demo'}", "logging.wandb_mode=disabled", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^SFT base\s+\d\.\d+", run.stdout, re.M) and "after RL (async, gepo)" in run.stdout, run.stdout
    assert (tmp_path / "demo" / "summary.json").is_file()


def case_train(tmp_path, capsys):
    code, out = _in_process(capsys, "train", "--dry-run", "--mode", "sync", "--workers", "4")
    assert code == 0 and "mode: sync" in out and "workers: 4" in out, out
    code, out = _in_process(capsys, "train", "--address", "auto", "--dry-run")
    assert code == 2 and "add --launcher ray" in out, out


def case_learner(tmp_path, capsys):
    code, out = _in_process(capsys, "learner", "--bind", "tcp://127.0.0.1:0", "--dry-run")
    assert code == 0 and "runtime:" in out, out


def case_rollout(tmp_path, capsys):
    import socket

    with socket.socket() as silent:  # a port that accepts and never answers: the worker gives up, saying why
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        run = _heterorl("rollout", "--connect", f"tcp://127.0.0.1:{port}", "--connect-timeout", "1", cwd=tmp_path,
                        timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert f"127.0.0.1:{port}" in run.stderr, run.stderr


def case_serve(tmp_path, capsys):
    script = Path(sys.executable).with_name("heterorl")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "heterorl.cli"]
    proc = subprocess.Popen([*command, "serve", "--bind", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=tmp_path)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving training sessions on http://127.0.0.1:"):
                break
        assert lines and lines[-1].startswith("serving training sessions on"), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and "heterorl serve stopped" in rest, rest
    finally:
        proc.kill()
        proc.wait()


def case_deploy(tmp_path, capsys):
    for target, written in (("slurm", "job.sbatch"), ("k8s", "manifests.yaml")):
        code, out = _in_process(capsys, "deploy", target, "demo.yaml", "--out", str(tmp_path / target))
        assert code == 0 and (tmp_path / target / written).is_file(), out


def case_keys(tmp_path, capsys):
    code, out = _in_process(capsys, "keys", "--name", "worker-a", "--out", str(tmp_path))
    assert code == 0 and (tmp_path / "worker-a.key").is_file() and (tmp_path / "worker-a.key_secret").is_file(), out
    code, out = _in_process(capsys, "keys", "revoke", "--name", "worker-a", "--allow-keys", str(tmp_path))
    assert code == 0 and not (tmp_path / "worker-a.key").exists() and "revoked worker-a" in out, out


def case_tasks(tmp_path, capsys):
    code, out = _in_process(capsys, "tasks")
    assert code == 0 and "arithmetic" in out and "maze" in out, out
    code, out = _in_process(capsys, "tasks", "--show", "maze")
    assert code == 0 and "size" in out, out


def case_losses(tmp_path, capsys):
    code, out = _in_process(capsys, "losses")
    assert code == 0 and out.count("\n") == len(gepo.loss_names()), out
    for name in gepo.loss_names():  # one line each: the name, then its docstring's first paragraph
        assert re.search(rf"^{name} +{re.escape(gepo.get_loss(name).description)}$", out, re.M), name
    code, out = _in_process(capsys, "losses", "--show", "dppo_tv")
    assert code == 0 and "M_it = 1[p_it − q_it > δ_high]" in out and "  delta_high: 0.15" in out, out
    code, out = _in_process(capsys, "losses", "--show", "nope")
    assert code == 2 and "invalid choice: 'nope'" in out, out


def case_sft(tmp_path, capsys):
    code, out = _in_process(capsys, "sft", "--dry-run", "sft.steps=3")
    assert code == 0 and "steps: 3" in out, out


def case_rl(tmp_path, capsys):
    code, out = _in_process(capsys, "rl", "--dry-run", "rl.steps=3")
    assert code == 0 and "steps: 3" in out, out


def case_sweep(tmp_path, capsys):
    code, out = _in_process(capsys, "sweep", str(SWEEP), "--dry-run", "--out", str(tmp_path / "sweep"))
    assert code == 0 and out.rstrip().endswith("every config resolves"), out


def case_report(tmp_path, capsys):
    code, out = _in_process(capsys, "report", str(COMMITTED_SWEEP), "--out", str(tmp_path / "report"))
    assert code == 0 and (tmp_path / "report" / "summary.md").is_file(), out


def case_compare(tmp_path, capsys):
    code, out = _in_process(capsys, "compare", "--losses", "gepo,grpo", "--delay", "lag8", "--dry-run",
                            "--out", str(tmp_path / "compare"))
    assert code == 0 and out.rstrip().endswith("every config resolves") and "gepo__dlag0__s0" in out, out


def case_bench(name: str):
    def run(tmp_path, capsys):  # the benchmark's own parser (a run takes minutes: tests/bench runs each small)
        code, out = _in_process(capsys, "bench", name, "--help")
        assert code == 0 and f"heterorl bench {name}" in out.replace("\n", " "), out

    return run


CASES = {"demo": case_demo, "train": case_train, "learner": case_learner, "rollout": case_rollout,
         "serve": case_serve, "deploy": case_deploy, "keys": case_keys, "tasks": case_tasks, "losses": case_losses,
         "sft": case_sft, "rl": case_rl, "sweep": case_sweep, "report": case_report, "compare": case_compare,
         **{f"bench {name}": case_bench(name) for name in BENCHMARKS}}


def test_every_readme_command_has_a_case():
    commands = readme_commands()
    assert len(commands) > 20, commands  # the block was found and read
    assert [c for c in commands if c not in CASES] == [], "README commands with no case in this file"
    assert [c for c in CASES if c not in commands] == [], "cases for commands the README does not list"


@pytest.mark.parametrize("command", readme_commands())
def test_a_readme_command_runs_through_the_real_entry_point(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a command writes by default (runs/...) lands here
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    CASES[command](tmp_path, capsys)
