"""The processes `heterorl train` starts, and the supervision of its rollout workers: a worker that exits
abnormally is started again after a back-off, within a budget of restarts per hour (``runtime.worker_restarts``);
one that spends its budget is given up with its log tail, and the run goes on with the others (docs/RUNTIME.md,
"A worker that dies is replaced")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from heterorl.errors import HeteroRLError
from heterorl.runtime.preloaded import ForkedChild, forking_enabled

RESTART_WINDOW_S = 3600.0  # runtime.worker_restarts counts the restarts within this window
BACKOFF_S, MAX_BACKOFF_S = 1.0, 60.0  # before the k-th restart in a row: BACKOFF_S × 2^(k−1), at most MAX_BACKOFF_S
STEADY_S = 60.0  # a worker that ran this long before it failed starts its back-off over


class Child:
    """One process of the run (`heterorl <argv>`, under the command ``prefix`` when one is given), in its own
    session, its output appended to ``log_path``: forked from the preloaded server (`preloaded.ForkedChild`)
    when it is ``forkable`` (a vLLM worker is not: vLLM starts processes of its own) and runs this Python, one
    rank, no prefix and no GPUs of its own; otherwise started by exec."""

    def __init__(self, name: str, argv: list[str], log_path: Path, ranks: int = 1,
                 python: str = sys.executable, devices: str = "", prefix: list[str] | None = None,
                 forkable: bool = True) -> None:
        self.name, self.log_path = name, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
        if devices:  # runtime.learner_devices / worker_devices: the GPUs this process sees
            env["CUDA_VISIBLE_DEVICES"] = devices
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
        self.started = time.monotonic()
        if forkable and python == sys.executable and ranks == 1 and not (prefix or devices) and forking_enabled():
            try:
                self.proc = ForkedChild(argv, log_path, env)
                return
            except OSError as exc:
                print(f"heterorl train: {name} is started by exec: {exc}", file=sys.stderr, flush=True)
        command = [*(prefix or []), python, *launcher, "-m", "heterorl.cli", *argv]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout_s: float = 10.0, first: signal.Signals = signal.SIGTERM) -> None:
        stop_process(self.proc, timeout_s, first=first)
        self._log.close()


def stop_process(proc: subprocess.Popen, timeout_s: float, gone_within_s: float = 10.0,
                 first: signal.Signals = signal.SIGTERM) -> int:
    """Stop ``proc`` and every process it started: ``first`` (SIGTERM; SIGINT passes on a Ctrl-C) to its process
    group (each process heterorl starts leads a session of its own, so the group is the process and what it
    forked), so that it checkpoints or says goodbye and leaves; after ``timeout_s`` SIGKILL to the group and to
    every descendant seen meanwhile (those that started sessions of their own too). Returns ``proc``'s exit status
    once every one of them is gone, or raises HeteroRLError naming the survivors ``gone_within_s`` after the
    SIGKILL."""
    leads_group = _group_of(proc.pid) == proc.pid
    seen = _Descendants(proc.pid)
    seen.look()
    if proc.poll() is None:
        _signal(proc, leads_group, first)
    deadline, orphans_told = time.monotonic() + timeout_s, False
    while time.monotonic() < deadline:
        if proc.poll() is None:
            seen.look()  # while it lives: an orphan's parent is no longer this process
        elif not seen.alive():
            return proc.returncode
        elif not orphans_told:  # it left processes behind: they get the same SIGTERM, in the same time
            orphans_told = True
            for pid in seen.alive():
                _kill(pid, signal.SIGTERM)
        time.sleep(0.05)
    _signal(proc, leads_group, signal.SIGKILL)
    for pid in seen.alive():
        _kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + gone_within_s
    while proc.poll() is None or seen.alive():
        if time.monotonic() > deadline:
            raise HeteroRLError(f"pid {proc.pid} or the processes it started ({sorted(seen.alive())}) outlived "
                                f"SIGKILL by {gone_within_s:g} s (in uninterruptible sleep?)")
        time.sleep(0.05)
    return proc.returncode


def _signal(proc: subprocess.Popen, whole_group: bool, sig: signal.Signals) -> None:
    """``sig`` to ``proc`` (its group when it leads one) while it is not reaped: a reaped pid may be another's."""
    if proc.poll() is None:
        _kill(proc.pid, sig, group=whole_group)


def _kill(pid: int, sig: signal.Signals, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # gone already (or its pid reused by another user's process: not ours to signal)


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent pid, process group, start time in clock ticks) of a live process, from /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name, in parentheses, may hold spaces
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


class _Descendants:
    """Every process seen below ``root`` or in its process group, each known by (pid, start time) so that a pid
    the kernel reuses for another process is not taken for it. Zombies count as gone (their parent, or init,
    reaps them)."""

    def __init__(self, root: int) -> None:
        self.root, self.known = root, {}

    def look(self) -> None:
        table = {}
        for entry in Path("/proc").glob("[0-9]*"):
            stat = _stat(int(entry.name))
            if stat is not None:
                table[int(entry.name)] = stat
        parents, grew = {self.root, *self.known}, True
        while grew:  # until no new child is found (a child's pid may be lower than its parent's)
            grew = False
            for pid, (_, parent, group, started) in table.items():
                if pid not in parents and (parent in parents or group == self.root):
                    self.known.setdefault(pid, started)
                    parents.add(pid)
                    grew = True

    def alive(self) -> list[int]:
        living = []
        for pid, started in self.known.items():
            stat = _stat(pid)
            if stat is not None and stat[3] == started and stat[0] != "Z":
                living.append(pid)
        return living


@dataclass
class _Supervised:
    child: Child
    restarts: deque = field(default_factory=deque)  # when it was restarted (monotonic), within the window
    failures_in_row: int = 0
    restart_at: float | None = None  # a restart is due then (None: none pending)
    given_up: bool = False
    total_restarts: int = 0


class WorkerFleet:
    """The rollout workers of a run. `check` (every half second) notices a worker that exited abnormally and
    starts it again after ``BACKOFF_S`` × 2^(k−1) (k: failures in a row, a run of ``STEADY_S`` resets it), while
    fewer than ``budget`` restarts of it fell in the last hour; otherwise it is given up, its log tail printed.
    HeteroRLError when every worker is given up. A worker that exits 0 has finished (the learner said so)."""

    def __init__(self, start: Callable[[str], Child], names: list[str], budget: int,
                 say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> None:
        self._start, self.budget, self._say = start, budget, say
        self.workers = {name: _Supervised(start(name)) for name in names}

    def children(self) -> list[Child]:
        return [w.child for w in self.workers.values()]

    def restarts(self) -> dict[str, int]:
        """Restarts of each worker restarted at least once (the run summary's ``worker_restarts``)."""
        return {name: w.total_restarts for name, w in self.workers.items() if w.total_restarts}

    def check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for name, worker in self.workers.items():
            if worker.given_up:
                continue
            if worker.restart_at is not None:
                if now >= worker.restart_at:
                    self._restart(name, worker, now)
                continue
            code = worker.child.proc.poll()
            if code in (None, 0):
                continue
            self._failed(name, worker, code, now)
        if all(w.given_up for w in self.workers.values()):
            last = max(self.workers.values(), key=lambda w: w.child.started)
            raise HeteroRLError(f"every rollout worker has failed and been given up; the last, {last.child.name}, "
                                f"log {last.child.log_path}:\n{last.child.tail()}")

    def _failed(self, name: str, worker: _Supervised, code: int, now: float) -> None:
        ran_s = now - worker.child.started
        worker.failures_in_row = 1 if ran_s >= STEADY_S else worker.failures_in_row + 1
        while worker.restarts and now - worker.restarts[0] > RESTART_WINDOW_S:
            worker.restarts.popleft()
        how = f"exit {code}" if code > 0 else f"killed by {_signal_name(-code)}"
        if len(worker.restarts) >= self.budget:
            worker.given_up = True
            left = sum(not w.given_up for w in self.workers.values())
            self._say(f"heterorl train: {name} failed ({how}) after {ran_s:.0f} s and has used its "
                      f"{self.budget} restart(s) of the last hour (runtime.worker_restarts): given up; the run goes "
                      f"on with {left} worker(s). Its log {worker.child.log_path}:\n{worker.child.tail(10)}")
            return
        delay = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (worker.failures_in_row - 1))
        worker.restart_at = now + delay
        self._say(f"heterorl train: {name} failed ({how}) after {ran_s:.0f} s; restarting it in {delay:.0f} s "
                  f"(restart {len(worker.restarts) + 1} of {self.budget} this hour). Its log "
                  f"{worker.child.log_path}:\n{worker.child.tail(5)}")

    def _restart(self, name: str, worker: _Supervised, now: float) -> None:
        worker.child.stop()
        worker.child = self._start(name)
        worker.restarts.append(now)
        worker.restart_at = None
        worker.total_restarts += 1
        self._say(f"heterorl train: {name} restarted (pid {worker.child.proc.pid})")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
