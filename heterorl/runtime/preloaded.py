"""The processes `heterorl train` starts, forked from one that has already imported what they need.

A learner or a rollout worker spends most of its start-up importing: torch, transformers and the model's code
take about 3 CPU seconds in every process (measured: 13 of the 23 CPU seconds of a 4-step run with 2 workers on
2 cores went to imports). `heterorl train` therefore starts one server process (multiprocessing's forkserver)
that imports them once, and forks each learner and worker from it: the child runs `heterorl ROLE ARGS` as
the command would, in a session of its own, its output in its log, its command line set to that command (so
`ps` and `pgrep -f` see `heterorl rollout --worker-id worker-1 ...`, not the server's).

The server lives as long as the process that started it and leaves when it does. A child that needs a Python
of its own (a vLLM worker in its venv), a command prefix, several ranks (`torch.distributed.run`) or its own
GPUs (``CUDA_VISIBLE_DEVICES`` must be set before CUDA is first looked at) is started by exec as before;
``HETERORL_FORK_CHILDREN=0`` starts every child by exec (docs/RUNTIME.md, "How the processes start").
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

# imported once, in the server: what the learner and the workers import before their first step (the runtime,
# torch, transformers, the models of the shipped bases); a module that fails to import is left out
PRELOAD = ("heterorl.cli", "heterorl.runtime.launch", "heterorl.runtime.learner", "heterorl.runtime.worker",
           "heterorl.policies.tiny", "heterorl.policies.hf_folder", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.llama.modeling_llama")
SWITCH = "HETERORL_FORK_CHILDREN"  # "0": start every child by exec


def forking_enabled() -> bool:
    """Whether children may be forked from the preloaded server (Linux, and not switched off)."""
    return sys.platform == "linux" and os.environ.get(SWITCH, "1") != "0"


_context = None


def _server():
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        _context = context
    return _context


class ForkedChild:
    """`heterorl ARGV` forked from the preloaded server, with the face of the `subprocess.Popen` it replaces:
    ``pid``, ``args``, ``returncode``, `poll`, `wait`, `send_signal`, `terminate`, `kill`. Its exit status is
    the command's (negative: the signal that ended it)."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.args = ["heterorl", *argv]
        self._process = _server().Process(target=_run_command, args=(argv, str(log_path), env, os.getcwd()),
                                          name=" ".join(argv[:1]), daemon=False)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (a reaped pid may be another process's)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_command(argv: list[str], log_path: str, env: dict[str, str], cwd: str) -> None:
    """In the forked child: become `heterorl ARGV` started by exec in a session of its own, output unbuffered
    into ``log_path``, then run it; exit with its status, after the exit handlers a process that exits runs."""
    import atexit
    import io

    os.setsid()
    try:  # (before the environment changes: the title is written over the memory of argv and the environment)
        import setproctitle

        setproctitle.setproctitle(" ".join([sys.executable, "-m", "heterorl.cli", *argv]))
    except ImportError:  # (a dependency of the package; without it `ps` shows the server's command line)
        pass
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)  # as python -u
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True,
                                  errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["heterorl", *argv]
    from heterorl.cli import main

    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()  # (a forked child leaves by os._exit: what it registered would not run)
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)
