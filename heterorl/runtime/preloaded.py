"""The processes `heterorl train` starts, forked from one that has already imported what they need.

A learner or a rollout worker spends most of its start-up importing: torch, transformers and the model's code
take about 3 CPU seconds in every process (measured: 13 of the 23 CPU seconds of a 4-step run with 2 workers on
2 cores went to imports). `heterorl train` therefore starts one server process (`python -m
heterorl.runtime.preloaded`) that imports them once, and forks each learner and worker from it: the child runs
`heterorl ROLE ARGS` as that command would run, in a session of its own, its output unbuffered in its log, with
the environment and working folder it was given, its command line set to that command (so that `ps` and
`pgrep -f` see `... -m heterorl.cli rollout --worker-id worker-1 ...`, not the server's).

The server answers on its stdin and stdout, one JSON line each way: a request ``{"argv", "log", "env", "cwd"}``
(and ``"err"``: a file of its own for the child's stderr, which otherwise goes to its log too) is answered
``{"pid": N}`` (or ``{"error": ...}``), and each child's end ``{"exited": N, "status": S}``, the status as
`subprocess.Popen.returncode` gives it (negative: the signal that ended it). It is single-threaded, so
that a fork copies no lock another thread holds, and it leaves when its stdin closes: when the process that
started it exits, however it exits.

A child that needs a Python of its own (a vLLM worker in its venv), a command prefix, several ranks
(`torch.distributed.run`) or its own GPUs (``CUDA_VISIBLE_DEVICES`` must be set before CUDA is first looked at)
is started by exec as before; ``HETERORL_FORK_CHILDREN=0`` starts every child by exec (docs/RUNTIME.md, "How the
processes start").
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

# imported once, in the server: what the learner and the workers import before their first step (the runtime,
# torch, transformers, the models of the shipped bases); a module that fails to import is left out
PRELOAD = ("heterorl.cli", "heterorl.runtime.launch", "heterorl.runtime.learner", "heterorl.runtime.worker",
           "heterorl.policies.tiny", "heterorl.policies.hf_folder", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.llama.modeling_llama")
SWITCH = "HETERORL_FORK_CHILDREN"  # "0": start every child by exec
REAP_EVERY_S = 0.05  # the server looks for children that ended this often while no request comes
GONE = 255  # the status of a child whose server died before it could tell (its status is lost with the server)


def forking_enabled() -> bool:
    """Whether children may be forked from the preloaded server (Linux, and not switched off)."""
    return sys.platform == "linux" and os.environ.get(SWITCH, "1") != "0"


class PreloadedServer:
    """The launcher's end of the server: `start` forks a child, `status` and `wait_for` give its exit status."""

    _shared: PreloadedServer | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> PreloadedServer:
        """This process's server, started on first use (one per process: it serves every child it starts)."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared._dead:
                cls._shared = cls()
            return cls._shared

    def __init__(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])  # the heterorl this process runs, first
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root,
                                                                         os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen([sys.executable, "-m", "heterorl.runtime.preloaded"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
                                      bufsize=1)
        self._changed = threading.Condition()
        self._answers: list[dict] = []
        self._statuses: dict[int, int] = {}
        self._dead = False
        self._request_lock = threading.Lock()
        threading.Thread(target=self._read, name="preloaded-server", daemon=True).start()
        atexit.register(self.close)

    def close(self, timeout_s: float = 5.0) -> None:
        """Let the server go (it leaves when its stdin closes) and reap it; the children it forked live on."""
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def start(self, argv: list[str], log_path: Path, env: dict[str, str], cwd: str,
              err_path: Path | None = None) -> int:
        """Fork `heterorl ARGV` from the server, its output appended to ``log_path`` (its stderr to ``err_path``
        when given); its pid. OSError when the server cannot."""
        with self._request_lock:
            try:
                self._proc.stdin.write(json.dumps({"argv": argv, "log": str(log_path), "env": env, "cwd": cwd,
                                                   "err": str(err_path or log_path)}) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise OSError(f"the preloaded server is gone ({exc})") from exc
            with self._changed:
                self._changed.wait_for(lambda: self._answers or self._dead)
                if not self._answers:
                    raise OSError("the preloaded server exited before it forked the child")
                answer = self._answers.pop(0)
        if "pid" not in answer:
            raise OSError(f"the preloaded server could not fork the child: {answer.get('error')}")
        return answer["pid"]

    def status(self, pid: int) -> int | None:
        """``pid``'s exit status once it has ended (`GONE` when the server died first and it is gone), else None."""
        with self._changed:
            if pid in self._statuses:
                return self._statuses[pid]
            if self._dead and not _alive(pid):
                return GONE
            return None

    def wait_for(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._statuses or self._dead, timeout)
        return self.status(pid)

    def _read(self) -> None:
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    self._statuses[message["exited"]] = message["status"]
                else:  # (a new child's pid may be an earlier child's: its status, told before, is not the new one's)
                    self._statuses.pop(message.get("pid"), None)
                    self._answers.append(message)
                self._changed.notify_all()
        with self._changed:
            self._dead = True
            self._changed.notify_all()


class ForkedChild:
    """`heterorl ARGV` forked from the preloaded server, with the face of the `subprocess.Popen` it replaces:
    ``pid``, ``args``, ``returncode``, `poll`, `wait`, `send_signal`, `terminate`, `kill`."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str], cwd: str | Path | None = None,
                 err_path: Path | None = None) -> None:
        self.args = [sys.executable, "-m", "heterorl.cli", *argv]
        self._server = PreloadedServer.shared()
        self.pid = self._server.start(argv, log_path, env, str(cwd or os.getcwd()), err_path)

    @property
    def returncode(self) -> int | None:
        return self._server.status(self.pid)

    def poll(self) -> int | None:
        return self._server.status(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        status = self._server.wait_for(self.pid, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return status

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (once it has ended, its pid may be another process's)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


# --- the server -------------------------------------------------------------------------------------------------

def serve() -> None:
    """The server's loop: preload, then fork a child per request and tell each child's end, until stdin closes."""
    import importlib
    import selectors

    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is its launcher's to handle
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (a child imports what it needs itself)
            pass
    requests, answers = sys.stdin.buffer, os.fdopen(sys.stdout.fileno(), "w", buffering=1, closefd=False)
    selector = selectors.DefaultSelector()
    selector.register(requests.fileno(), selectors.EVENT_READ)
    pending = b""
    while True:
        for child, status in _reaped():
            answers.write(json.dumps({"exited": child, "status": status}) + "\n")
        if not selector.select(REAP_EVERY_S):
            continue
        chunk = os.read(requests.fileno(), 1 << 20)
        if not chunk:
            return  # its launcher is gone
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                request = json.loads(line)
                pid = os.fork()
            except (ValueError, OSError) as exc:
                answers.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
                continue
            if pid == 0:
                selector.close()
                signal.signal(signal.SIGINT, interrupt)
                os._exit(_run_command(request["argv"], request["log"], request.get("err", request["log"]),
                                      request["env"], request["cwd"]))
            answers.write(json.dumps({"pid": pid}) + "\n")


def _reaped() -> list[tuple[int, int]]:
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


def _run_command(argv: list[str], log_path: str, err_path: str, env: dict[str, str], cwd: str) -> int:
    """In the forked child: become `heterorl ARGV` started by exec in a session of its own, output unbuffered
    into ``log_path`` (its stderr into ``err_path``), then run it; its exit status, after the exit handlers a
    process that exits runs."""
    import atexit
    import io
    import runpy
    import traceback

    os.setsid()
    try:  # (before the environment changes: the title is written over the memory of argv and the environment)
        import setproctitle

        setproctitle.setproctitle(" ".join([sys.executable, "-m", "heterorl.cli", *argv]))
    except ImportError:  # (a dependency of the package; without it `ps` shows the server's command line)
        pass
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    err = log if err_path == log_path else os.open(err_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for source, target in ((null, 0), (log, 1), (err, 2)):
        os.dup2(source, target)
    for fd in {null, log, err}:
        os.close(fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)  # as python -u
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True,
                                  errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [sys.executable, *argv]
    # as `python -m heterorl.cli ARGV` runs it: the module preloaded is not that `__main__` (runpy would warn that
    # it was imported first, and a later `import heterorl.cli` gets a module of its own, as after exec)
    sys.modules.pop("heterorl.cli", None)
    try:
        runpy.run_module("heterorl.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (as Python reports an uncaught exception, and exits 1)
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # (the child leaves by os._exit: what it registered would not run otherwise)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


if __name__ == "__main__":
    serve()
