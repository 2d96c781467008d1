"""Running untrusted generated programs against unit tests, where the samples are (a rollout worker).

Each candidate program runs in a fresh Python process (``python -I -S``), one process for all its tests, in a
jail the kernel makes (`heterorl.tasks.jail`, through nsjail): its own PID, mount, network, IPC and UTS
namespaces, a uid of its own, a read-only view of the interpreter and its libraries, a private size-capped
tmpfs, a cgroup bounding the whole program's memory, processes and CPU, and a seccomp filter refusing the
syscalls no test program needs (namespaces, mounts, keyrings, io_uring, BPF, ptrace ...). The parent kills the jail
whole at the wall-clock limit, whatever happened to any pipe; the wall clock starts once the harness runs, and a
program whose process did not start within its own start-up deadline is `not_started`, not `timeout`. At most as
many programs run at once as this process has cores: more would only make correct programs time out.

Inside, the harness (`sandbox_harness`) is a supervisor and the program its forked child: the program's
answers reach the parent only through the supervisor, which checks each one, over a pipe the program does not
hold; what the program prints is captured apart, bounded, and never parsed. The parent compares the answers
with the expected ones, which never reach the program, by value and type. An audit hook in the program is a
tripwire that names what it tried (sockets, processes, ctypes, files outside), so that the reward can count
it; the boundary is the jail. Every other reason comes from the parent's or the supervisor's measurements
(`sandbox_judge.judge`): the clocks, the bytes counted, the program's wait status and CPU time, and its
cgroup's memory counters, which the parent reads when the supervisor has said how the program ended.

Where the jail cannot be had (`jail.jail_support` says what is missing), the weak sandbox
(``isolation="weak"``) runs the same harness with rlimits, its own session, a network namespace and the
``nobody`` user where it may: the audit hook is then the only wall between a program and much of the machine.
The code task refuses it unless ``allow_weak_sandbox`` is set. docs/TASKS.md says what is isolated by what.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import queue
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from heterorl.errors import TaskError
from heterorl.tasks.jail import Jail, SandboxUnavailable, jail_support
from heterorl.tasks.sandbox_judge import (
    CRASHED,
    FORBIDDEN,
    MEMORY,
    NOT_STARTED,
    OK,
    OUTPUT,
    SYNTAX,
    TIMEOUT,
    WRONG,
    Outcome,
    TestCase,
    judge,
)

log = logging.getLogger(__name__)
ISOLATIONS = ("nsjail", "weak")
KILL_GRACE_S = 5.0  # how long a jail's nsjail may take to exit after its program was killed
REPORT_ROOM = 64 * 1024  # results' bytes beyond the answers' limit (their framing, the status lines)


class SandboxError(TaskError):
    """The sandbox itself failed (not the program): e.g. nsjail could not build a jail. Never a score."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one candidate program may use, all its processes and tests together: ``wall_s`` wall-clock and
    ``cpu_s`` CPU seconds (per process, on one core's worth of CPU per second for the whole program),
    ``memory_mb`` (the whole program's, its cgroup's; in the weak sandbox, each process's address space),
    ``output_bytes`` of stdout+stderr (and of answers), ``file_bytes`` per file, ``tmp_mb`` for all its files,
    ``processes`` (threads count).
    ``start_s`` is the sandbox's, not the program's: how long its process may take to start (the jail and the
    interpreter, until the harness's first line), apart from ``wall_s``, which runs from then; a program whose
    process did not start in time scores 0 as `NOT_STARTED` (a machine too busy), never as `TIMEOUT`."""

    wall_s: float = 5.0
    cpu_s: float = 4.0
    memory_mb: int = 512
    output_bytes: int = 64 * 1024
    file_bytes: int = 1 << 20
    tmp_mb: int = 16
    processes: int = 16
    start_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "output_bytes", "file_bytes", "tmp_mb", "processes", "start_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise TaskError(f"sandbox limit {name}={value!r}: give a number > 0")


@dataclass
class Collected:
    """What came back from one program's process: the results pipe, its own output (bounded), why the parent
    killed it ("" when it ended by itself), the exit code of what the parent started, and whether the
    program's cgroup counted its memory limit hit (read once the supervisor said how the program ended; never,
    in the weak sandbox)."""

    results: bytes = b""
    output: bytes = b""
    killed: str = ""
    returncode: int | None = None
    memory_limit_hit: bool = False


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; a container's CPU quota is not read)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on this platform)
        return os.cpu_count() or 1


@functools.cache
def _warn_capped(requested: int, cores: int) -> None:
    """Said once per process for each value asked for."""
    log.warning("sandbox max_parallel=%d is more than the %d cores this process may use: %d programs run at once "
                "(more would share the cores, and correct programs would run out of their wall clock and score "
                "`timeout`, as if they hung); set max_parallel (the code task's option) to at most %d", requested,
                cores, cores, cores)


def _harness() -> str:
    """The trusted code that runs first in the sandbox process (its source is passed with ``-c``)."""
    return (Path(__file__).parent / "sandbox_harness.py").read_text(encoding="utf-8")


class Sandbox:
    """Runs candidate programs against hidden tests under `SandboxLimits`, up to ``max_parallel`` at once (at
    most `usable_cores`: more is cut down to that, with a warning), each in a jail (``isolation="nsjail"``, the
    default; `SandboxUnavailable` names what this machine lacks) or the weak sandbox (``"weak"``); counts each
    outcome's reason in ``stats``. ``seccomp=False`` leaves the jail's seccomp filter out (only to measure what
    it costs: ``heterorl bench sandbox --seccomp both``). Thread-safe."""

    def __init__(self, limits: SandboxLimits | None = None, max_parallel: int = 2,
                 python: str = sys.executable, isolation: str = "nsjail", *, seccomp: bool = True) -> None:
        if not isinstance(max_parallel, int) or max_parallel < 1:
            raise TaskError(f"sandbox max_parallel={max_parallel!r}: give an integer >= 1")
        if isolation not in ISOLATIONS:
            raise TaskError(f"sandbox isolation={isolation!r}: give one of {', '.join(ISOLATIONS)}")
        cores = usable_cores()
        if max_parallel > cores:
            _warn_capped(max_parallel, cores)
            max_parallel = cores
        self.limits = limits or SandboxLimits()
        self.max_parallel = max_parallel
        self.python = python
        self.isolation_kind = isolation
        self.jail = None
        if isolation == "nsjail":
            lim = self.limits
            self.jail = Jail(jail_support(), python, max_parallel, memory_mb=lim.memory_mb, processes=lim.processes,
                             cpu_s=lim.cpu_s, file_bytes=lim.file_bytes, tmp_mb=lim.tmp_mb,
                             wall_s=lim.start_s + lim.wall_s, seccomp=seccomp)  # (its backstop: both)
        self.stats: Counter = Counter()  # programs run, by outcome reason (`counts` copies it)
        self.running = self.peak_running = 0  # programs running now, and the most at once
        self._lock = threading.Lock()
        self._slots: queue.Queue = queue.Queue()
        for slot in range(max_parallel):
            self._slots.put(slot)
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="heterorl-sandbox")
        self._source = _harness()

    # -- public ----------------------------------------------------------------------------------------
    def run(self, program: str, tests: Sequence[TestCase], *, entry: str | None = None) -> Outcome:
        """Run ``program`` on every test: ``entry`` names the function to call (``call`` mode), None reads stdin
        and prints (``stdio`` mode). Waits for a free slot (at most ``max_parallel`` programs run at once)."""
        slot = self._slots.get()
        with self._lock:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
        outcome = None
        try:
            outcome = self._run(slot, program, list(tests), entry)
            return outcome
        finally:
            with self._lock:
                self.running -= 1
                if outcome is not None:
                    self.stats[outcome.reason] += 1
            self._slots.put(slot)

    def counts(self) -> Counter:
        """A copy of ``stats``, taken while no program's outcome is being counted."""
        with self._lock:
            return Counter(self.stats)

    def run_many(self, jobs: Sequence[tuple[str, Sequence[TestCase], str | None]]) -> list[Outcome]:
        """`run` for each (program, tests, entry), ``max_parallel`` at a time; in the order given. Afterwards,
        checks that nothing of any program is left (`leftovers`); what is, is killed, logged and counted as
        ``leftover`` in ``stats``."""
        outcomes = list(self._pool.map(lambda job: self.run(job[0], job[1], entry=job[2]), jobs))
        left = self._check_idle_slots(clean=True)
        if left:
            log.warning("the sandbox found %d things left after a batch, now removed: %s", len(left), left[:5])
            with self._lock:
                self.stats["leftover"] += len(left)
        return outcomes

    def leftovers(self) -> list[str]:
        """What any program left behind and is still there: processes running as the uid of a slot where no
        program runs now, and cgroups of such slots (files are in each jail's tmpfs, gone with it). The weak
        sandbox cannot tell: always []."""
        return self._check_idle_slots(clean=False)

    def _check_idle_slots(self, clean: bool) -> list[str]:
        """`leftovers`, with the idle slots held meanwhile (no program starts in one being checked); ``clean``:
        kill and remove what is found."""
        if self.jail is None:
            return []
        idle = []
        while True:
            try:
                idle.append(self._slots.get_nowait())
            except queue.Empty:
                break
        try:
            left = self.jail.strays(idle) + [group for slot in idle for group in self.jail.cgroups_of(slot)]
            if left and clean:
                for slot in idle:
                    self.jail.kill_uid(slot)
                    self.jail.clean(slot)
            return left
        finally:
            for slot in idle:
                self._slots.put(slot)

    def isolation(self) -> dict[str, bool | str]:
        """What this machine gives a program, seen from inside one: ``kind`` (nsjail or weak), and whether it
        has its own ``network_namespace``, ``pid_namespace`` (it sees no process but its own and the
        harness's), ``filesystem`` (no host folder but Python's and its libraries), and runs as a
        ``separate_user``."""
        probe = self.run("def f():\n    import os\n    return [os.getuid(), os.readlink('/proc/self/ns/net'), "
                         "os.readlink('/proc/self/ns/pid'), [p for p in os.listdir('/proc') if p.isdigit()], "
                         "sorted(os.listdir('/'))]", [TestCase()],
                         entry="f")
        uid, net, pid, visible, top = probe.answers.get(0) or [None] * 5
        return {"kind": self.isolation_kind,
                "network_namespace": net is not None and net != os.readlink("/proc/self/ns/net"),
                "pid_namespace": pid is not None and pid != os.readlink("/proc/self/ns/pid") and len(visible) <= 3,
                "filesystem": top is not None and "etc" not in top and "home" not in top,
                "separate_user": uid is not None and uid != os.getuid()}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.jail is not None:
            self.jail.close()

    # -- one program -----------------------------------------------------------------------------------
    def _run(self, slot: int, program: str, tests: list[TestCase], entry: str | None) -> Outcome:
        start = time.monotonic()
        home = (contextlib.nullcontext("/tmp") if self.jail is not None  # (the jail's own tmpfs)
                else tempfile.TemporaryDirectory(prefix="heterorl-sandbox-"))
        with home as directory:
            collected = self._start_and_collect(slot, directory, program, tests, entry)
        seconds = time.monotonic() - start
        if self.jail is not None and not collected.killed and b'"started"' not in collected.results:
            raise SandboxError(f"the jail did not start (nsjail exit code {collected.returncode}): "
                               f"{collected.output[-600:].decode('utf-8', 'replace')}")
        return judge(collected.results, collected.output, collected.killed, collected.returncode, tests, seconds,
                     memory_limit_hit=collected.memory_limit_hit)

    def _start_and_collect(self, slot: int, home: str, program: str, tests: list[TestCase],
                           entry: str | None) -> Collected:
        limits = self.limits
        results_read, results_write = os.pipe()
        job = {"program": program, "entry": entry, "inputs": [[t.args, t.stdin] for t in tests],
               "output_bytes": limits.output_bytes, "report_bytes": limits.output_bytes + REPORT_ROOM // 2,
               "results_fd": results_write, "jailed": self.jail is not None,
               "home": home,
               "limits": {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "file_bytes": limits.file_bytes,
                          "processes": limits.processes}}
        if self.jail is not None:
            command, cwd = self.jail.command(slot, results_write, self._source), "/"
        else:
            os.chmod(home, 0o777)  # (the program may run as nobody)
            command, cwd = [self.python, "-I", "-S", "-c", self._source], home
        try:
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    cwd=cwd, env={}, start_new_session=True, pass_fds=(results_write,))
        except OSError as exc:
            os.close(results_read)
            raise SandboxError(f"cannot start {command[0]}: {exc}") from exc
        finally:
            os.close(results_write)
        try:
            return self._collect(slot, proc, json.dumps(job).encode(), results_read)
        finally:
            os.close(results_read)
            if self.jail is not None:
                self.jail.clean(slot)

    def _collect(self, slot: int, proc: subprocess.Popen, job: bytes, results_read: int) -> Collected:
        """Feed the job; read the results pipe and the program's output (each bounded) until the supervisor's
        last line (how the program ended), the process's end or its time running out, whichever is first (a
        pipe held open by a descendant never makes this wait longer); kill the whole program then. After the
        last line, in a jail, the program's cgroup's memory counters are read (its supervisor waits, so that
        the cgroup is still there) and what output is waiting is read. Its time: ``start_s`` until the
        harness's first line on the results pipe (else `NOT_STARTED`), then ``wall_s`` (else `TIMEOUT`)."""
        limits, got = self.limits, Collected()
        caps = {"results": limits.output_bytes + REPORT_ROOM, "output": limits.output_bytes}
        deadline, started, last_line = time.monotonic() + limits.start_s, False, _LastLine()
        threading.Thread(target=_feed, args=(proc, job), daemon=True).start()
        chunks = {"results": [], "output": []}
        sizes = {"results": 0, "output": 0}
        selector = selectors.DefaultSelector()
        os.set_blocking(proc.stdout.fileno(), False)
        os.set_blocking(results_read, False)
        selector.register(proc.stdout.fileno(), selectors.EVENT_READ, "output")
        selector.register(results_read, selectors.EVENT_READ, "results")
        open_streams = 2

        def take(stream: str, chunk: bytes) -> None:
            sizes[stream] += len(chunk)
            if sizes[stream] > caps[stream]:
                got.killed = OUTPUT if stream == "output" else CRASHED
            else:
                chunks[stream].append(chunk)

        try:
            while open_streams and not got.killed and not last_line.seen:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    got.killed = TIMEOUT if started else NOT_STARTED
                    break
                if proc.poll() is not None and not selector.select(0):
                    break  # (it ended, and nothing more is waiting: a descendant may hold a pipe, unread)
                for key, _ in selector.select(min(remaining, 0.1)):
                    chunk = _read_now(key.fd)
                    if chunk is None:
                        continue
                    if not chunk:
                        selector.unregister(key.fd)
                        open_streams -= 1
                        continue
                    if key.data == "results" and not started:  # (the harness's "started": the program's
                        started, deadline = True, time.monotonic() + limits.wall_s  # code cannot write here)
                    take(key.data, chunk)
                    if got.killed:
                        break
                    if key.data == "results":
                        last_line.feed(chunk)
            if last_line.seen and not got.killed:
                if self.jail is not None:
                    got.memory_limit_hit = self.jail.memory_limit_hit(slot)
                while not got.killed and (chunk := _read_now(proc.stdout.fileno())):
                    take("output", chunk)
        finally:
            selector.close()
            self._kill(slot, proc, started)
            proc.stdout.close()
        got.returncode = proc.returncode
        got.results, got.output = b"".join(chunks["results"]), b"".join(chunks["output"])
        return got

    def _kill(self, slot: int, proc: subprocess.Popen, started: bool) -> None:
        """The whole program: in a jail, every process of its cgroup (`Jail.kill`), after which its nsjail exits
        by itself (or, past ``KILL_GRACE_S``, is killed; at once when the harness never ``started`` and the
        cgroup held nothing: nsjail is still making the jail, and its death kills what it made); the weak
        sandbox's session. Then the process the parent started is reaped."""
        if self.jail is not None and proc.poll() is None and (self.jail.kill(slot) or started):
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


class _LastLine:
    """Watches the results pipe for the supervisor's last line, ``{"end": ...}``, whole. Results are JSON lines
    (a newline is only ever a line break), so only the first bytes of each line are kept."""

    START = b'{"end": '

    def __init__(self) -> None:
        self.head, self.seen = b"", False

    def feed(self, chunk: bytes) -> None:
        *ended, rest = chunk.split(b"\n")
        for piece in ended:
            self.seen = self.seen or (self.head + piece[:len(self.START)]).startswith(self.START)
            self.head = b""
        self.head = (self.head + rest[:len(self.START)])[:len(self.START)]


def _read_now(fd: int) -> bytes | None:
    """What a non-blocking pipe holds now (b"": closed; None: nothing yet)."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None


def _feed(proc: subprocess.Popen, job: bytes) -> None:
    try:
        proc.stdin.write(job)
        proc.stdin.close()
    except (OSError, ValueError):  # it exited before reading: its outcome says why
        pass


def describe_unavailable(allow_weak: bool) -> str | None:
    """None when the jail can run here; else what is missing, and (``allow_weak``) that the weak sandbox will
    run instead, or (not) how to allow it."""
    support = jail_support()
    if support.available:
        return None
    if allow_weak:
        return (f"{support.explain()}. code.allow_weak_sandbox=true: generated programs run in the WEAK sandbox, "
                "where only Python's audit hook stands between a program and much of this machine")
    return f"{support.explain()}. To run the code task without it, set code.allow_weak_sandbox=true (unsafe)"


__all__ = ["CRASHED", "FORBIDDEN", "ISOLATIONS", "MEMORY", "NOT_STARTED", "OK", "OUTPUT", "SYNTAX", "Collected",
           "Outcome", "Sandbox", "SandboxError", "SandboxLimits", "SandboxUnavailable", "TIMEOUT", "TestCase", "WRONG",
           "describe_unavailable", "usable_cores"]
