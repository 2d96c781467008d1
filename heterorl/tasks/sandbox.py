"""Running untrusted generated programs against unit tests, where the samples are (a rollout worker).

Each candidate program runs in its own fresh Python process (``python -I``), one process for all its tests.
What contains it:

- **Time.** A wall-clock limit: the parent kills the program's whole process group (it starts a new session),
  so children die too. A CPU-time limit (``RLIMIT_CPU``).
- **Memory.** An address-space limit (``RLIMIT_AS``); an allocation beyond it fails inside the program.
- **Output.** Its stdout and stderr are read up to ``output_bytes``, and the program is killed past that. Files
  it writes are capped by ``RLIMIT_FSIZE``, in a private temporary directory, its working directory, which is
  removed afterwards.
- **Processes.** ``RLIMIT_NPROC`` stops a fork bomb; fork, exec and subprocess are refused at once.
- **Network.** A new network namespace with no interface up, when the machine allows it (root, or
  unprivileged user namespaces).
- **The worker's files and keys.**
  - The program gets an empty environment: no key paths, no tokens.
  - When the worker runs as root, the program runs as ``nobody``, so files only their owner reads (0600 keys)
    stay closed to it.
  - Opening files outside its directory and Python's own is refused.

The in-process refusals are a tripwire, not the boundary: an audit hook (PEP 578) names what a program tried
(``socket``, ``open``, ``fork``, ``ctypes``), so the reward can count it. Native code can step around a hook;
the boundary is the OS's: rlimits, the process group, the namespace and the uid.

A program never sees a test's expected answer. The harness sends back only what the program returned or
printed for each input, and the parent compares. So a program that writes fake results can only fail.

`Sandbox.isolation` says what this machine gives; docs/TASKS.md has the whole list.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from heterorl.errors import TaskError

# why a program scored what it did (counted per reason by `Sandbox.stats`)
OK, WRONG, TIMEOUT, MEMORY, OUTPUT, CRASHED, SYNTAX = "ok", "wrong_answer", "timeout", "memory", "output_limit", \
    "crashed", "syntax_error"
FORBIDDEN = "forbidden"  # + ":" what it tried: socket, open, process, ctypes
FORBIDDEN_KINDS = ("socket", "open", "process", "ctypes")
_RESULT_PREFIX = "\x00heterorl-result "  # the harness's lines on its results pipe


@dataclass(frozen=True)
class SandboxLimits:
    """What one candidate program may use (all its tests together)."""

    wall_s: float = 5.0
    cpu_s: float = 4.0
    memory_mb: int = 512
    output_bytes: int = 64 * 1024
    file_bytes: int = 1 << 20
    processes: int = 64  # RLIMIT_NPROC for the sandbox's user (a backstop: fork is refused before it)

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "output_bytes", "file_bytes", "processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise TaskError(f"sandbox limit {name}={value!r}: give a number > 0")


@dataclass(frozen=True)
class TestCase:
    """One hidden test: call the program's function with ``args`` (``call`` mode), or feed ``stdin`` and read
    what it prints (``stdio`` mode); ``expected``: the reference solution's answer, never shown to the program."""

    __test__ = False  # not a pytest class, despite its name

    args: list = field(default_factory=list)
    stdin: str = ""
    expected: Any = None


@dataclass
class Outcome:
    """What one program scored: tests ``passed`` of ``total``, and why (``reason``: one of the constants above,
    ``forbidden:WHAT`` for a refused action)."""

    passed: int
    total: int
    reason: str
    seconds: float = 0.0
    detail: str = ""
    answers: dict = field(default_factory=dict, repr=False)  # test index -> what the program gave

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _harness() -> str:
    """The trusted code that runs first in the sandbox process (its source is passed with ``-c``)."""
    return (Path(__file__).parent / "sandbox_harness.py").read_text(encoding="utf-8")


class Sandbox:
    """Runs candidate programs against hidden tests under `SandboxLimits`, up to ``max_parallel`` processes at
    once; counts each outcome's reason in ``stats``. Thread-safe."""

    def __init__(self, limits: SandboxLimits | None = None, max_parallel: int = 2,
                 python: str = sys.executable) -> None:
        if not isinstance(max_parallel, int) or max_parallel < 1:
            raise TaskError(f"sandbox max_parallel={max_parallel!r}: give an integer >= 1")
        self.limits = limits or SandboxLimits()
        self.max_parallel = max_parallel
        self.python = python
        self.stats: Counter = Counter()  # programs run, by outcome reason (`counts` copies it)
        self.running = self.peak_running = 0  # programs running now, and the most at once
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="heterorl-sandbox")
        self._source = _harness()

    # -- public ----------------------------------------------------------------------------------------
    def run(self, program: str, tests: Sequence[TestCase], *, entry: str | None = None) -> Outcome:
        """Run ``program`` on every test: ``entry`` names the function to call (``call`` mode), None reads stdin
        and prints (``stdio`` mode)."""
        with self._lock:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
        outcome = None
        try:
            outcome = self._run(program, list(tests), entry)
            return outcome
        finally:
            with self._lock:
                self.running -= 1
                if outcome is not None:
                    self.stats[outcome.reason] += 1

    def counts(self) -> Counter:
        """A copy of ``stats``, taken while no program's outcome is being counted."""
        with self._lock:
            return Counter(self.stats)

    def run_many(self, jobs: Sequence[tuple[str, Sequence[TestCase], str | None]]) -> list[Outcome]:
        """`run` for each (program, tests, entry), ``max_parallel`` at a time; in the order given."""
        return list(self._pool.map(lambda job: self.run(job[0], job[1], entry=job[2]), jobs))

    def isolation(self) -> dict[str, bool]:
        """What this machine gives a program: ``network_namespace``, ``separate_user`` (runs as nobody)."""
        probe = self._run("def f():\n    import os\n    return [os.getuid(), os.readlink('/proc/self/ns/net')]",
                          [TestCase()], "f")
        uid, namespace = probe.answers.get(0) or [None, None]
        return {"network_namespace": namespace is not None and namespace != os.readlink("/proc/self/ns/net"),
                "separate_user": uid is not None and uid != os.getuid()}

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- one program -----------------------------------------------------------------------------------
    def _run(self, program: str, tests: list[TestCase], entry: str | None) -> Outcome:
        limits = self.limits
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="heterorl-sandbox-") as home:
            os.chmod(home, 0o777)  # (the program may run as nobody)
            job = json.dumps({
                "program": program, "entry": entry, "inputs": [[t.args, t.stdin] for t in tests], "home": home,
                "output_bytes": limits.output_bytes,
                "limits": {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "file_bytes": limits.file_bytes,
                           "processes": limits.processes}})
            try:
                proc = subprocess.Popen([self.python, "-I", "-S", "-c", self._source], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=home, env={},
                                        start_new_session=True)
            except OSError as exc:
                return Outcome(0, len(tests), CRASHED, detail=f"cannot start {self.python}: {exc}")
            output, killed = self._communicate(proc, job.encode())
        seconds = time.monotonic() - start
        return _judge(output, killed, proc.returncode, tests, seconds)

    def _communicate(self, proc: subprocess.Popen, job: bytes) -> tuple[bytes, str]:
        """Feed the job, read up to ``output_bytes`` (plus the results), kill the group at the wall-clock limit
        or past the output limit; (output, why it was killed or "")."""
        limits, chunks, size, killed = self.limits, [], 0, ""
        cap = limits.output_bytes + 64 * 1024  # (room for the results lines themselves)
        deadline = time.monotonic() + limits.wall_s

        def feed() -> None:
            try:
                proc.stdin.write(job)
                proc.stdin.close()
            except OSError:  # it exited before reading: its outcome says why
                pass

        threading.Thread(target=feed, daemon=True).start()
        timer = threading.Timer(limits.wall_s, _kill_group, (proc,))
        timer.start()
        try:
            while True:
                chunk = proc.stdout.read1(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > cap:
                    killed = OUTPUT
                    _kill_group(proc)
                    break
        finally:
            timer.cancel()
            proc.stdout.close()
            proc.wait()
            _kill_group(proc)  # whatever it left behind in its group
        if not killed and time.monotonic() >= deadline:
            killed = TIMEOUT
        return b"".join(chunks), killed


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _judge(output: bytes, killed: str, returncode: int, tests: list[TestCase], seconds: float) -> Outcome:
    """The outcome from the harness's result lines: each test's answer compared with the expected one here."""
    total = len(tests)
    answers, status, detail = {}, None, ""
    for line in output.decode("utf-8", "replace").split("\n"):
        if not line.startswith(_RESULT_PREFIX):
            continue
        try:
            record = json.loads(line[len(_RESULT_PREFIX):])
        except ValueError:
            continue
        if "status" in record and not (status or "").startswith(FORBIDDEN):  # (a refusal names the outcome)
            status, detail = str(record["status"]), str(record.get("detail", ""))[:500]
        elif isinstance(record.get("i"), int) and 0 <= record["i"] < total:
            answers.setdefault(record["i"], record.get("out"))
    passed = sum(1 for i, test in enumerate(tests) if i in answers and answers[i] == _canonical(test.expected))
    if status is not None and status.startswith(FORBIDDEN):
        # (a program that forges the line names no other reason: the reasons counted stay a short, known list)
        what = status[len(FORBIDDEN) + 1:]
        return Outcome(0, total, f"{FORBIDDEN}:{what if what in FORBIDDEN_KINDS else 'other'}", seconds, detail,
                       answers)
    if killed:
        return Outcome(0, total, killed, seconds, answers=answers)
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return Outcome(0, total, TIMEOUT, seconds, answers=answers)
    if status is None:
        return Outcome(0, total, CRASHED, seconds, f"exit code {returncode}", answers)
    if status in (MEMORY, SYNTAX, OUTPUT, CRASHED):
        return Outcome(0, total, status, seconds, detail, answers)
    if status not in (OK, WRONG):  # what the harness says once the tests ran; anything else the program forged
        return Outcome(0, total, CRASHED, seconds, f"unknown status {status[:60]!r}", answers)
    return Outcome(passed, total, OK if passed == total else WRONG, seconds, detail, answers)


def _canonical(value: Any) -> Any:
    """A value as it comes back through JSON (tuples become lists), for comparing answers."""
    return json.loads(json.dumps(value, default=repr))


__all__ = ["CRASHED", "FORBIDDEN", "MEMORY", "OK", "OUTPUT", "Outcome", "SYNTAX", "Sandbox", "SandboxLimits",
           "TIMEOUT", "TestCase", "WRONG"]
