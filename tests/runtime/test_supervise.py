"""`heterorl train` replaces a worker that dies (heterorl/runtime/supervise.py): started again after a back-off
that doubles with each failure in a row, within ``runtime.worker_restarts`` restarts an hour; given up with its
log tail once the budget is spent; the run fails only when every worker is given up. Real child processes, a
fake clock."""

import subprocess
import sys
from pathlib import Path

import pytest

from heterorl.errors import HeteroRLError
from heterorl.runtime.supervise import BACKOFF_S, RESTART_WINDOW_S, STEADY_S, WorkerFleet


class Exits:
    """A child that exits with ``code`` at once (``None``: one that runs until stopped)."""

    def __init__(self, name: str, code: int | None, log: Path, started: float) -> None:
        self.name, self.log_path, self.started = name, log, started
        log.write_text(f"{name} says goodbye\n")
        script = "import time; time.sleep(600)" if code is None else f"import sys; sys.exit({code})"
        self.proc = subprocess.Popen([sys.executable, "-c", script])
        if code is not None:
            self.proc.wait()

    def tail(self, lines: int = 30) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Plan:
    """Starts children by name, each start taking the next exit code of its plan; records what was said."""

    def __init__(self, tmp_path: Path, codes: dict[str, list[int | None]]) -> None:
        self.tmp_path, self.codes, self.now, self.said, self.started = tmp_path, codes, 0.0, [], []

    def start(self, name: str) -> Exits:
        self.started.append(name)
        return Exits(name, self.codes[name].pop(0), self.tmp_path / f"{name}.log", self.now)


def test_a_failed_worker_restarts_after_a_doubling_back_off_and_is_given_up_when_its_budget_is_spent(tmp_path):
    plan = Plan(tmp_path, {"worker-0": [1, 1, 1, None], "worker-1": [None]})
    fleet = WorkerFleet(plan.start, ["worker-0", "worker-1"], budget=2, say=plan.said.append)
    fleet.check(plan.now)  # worker-0 failed at once: a restart in BACKOFF_S
    assert "restarting it in 1 s (restart 1 of 2 this hour)" in plan.said[-1] and "goodbye" in plan.said[-1]
    plan.now = BACKOFF_S - 0.1
    fleet.check(plan.now)
    assert plan.started == ["worker-0", "worker-1"]  # not yet
    plan.now = BACKOFF_S
    fleet.check(plan.now)
    assert plan.started[-1] == "worker-0" and "worker-0 restarted" in plan.said[-1]
    fleet.check(plan.now)  # it failed again at once: the back-off doubles
    assert "restarting it in 2 s (restart 2 of 2 this hour)" in plan.said[-1]
    plan.now += 2 * BACKOFF_S
    fleet.check(plan.now)
    fleet.check(plan.now)  # and again: its budget is spent, it is given up; the other worker runs on
    assert "has used its 2 restart(s) of the last hour" in plan.said[-1] and "given up" in plan.said[-1]
    assert "the run goes on with 1 worker(s)" in plan.said[-1]
    assert fleet.restarts() == {"worker-0": 2}
    plan.now += 3 * RESTART_WINDOW_S  # given up is for good
    fleet.check(plan.now)
    assert plan.started.count("worker-0") == 3
    for child in fleet.children():
        child.stop()


def test_the_budget_counts_the_last_hour_and_a_steady_run_resets_the_back_off(tmp_path):
    plan = Plan(tmp_path, {"worker-0": [1, 1, 1, None]})
    fleet = WorkerFleet(plan.start, ["worker-0"], budget=1, say=plan.said.append)
    fleet.check(plan.now)
    plan.now = BACKOFF_S
    fleet.check(plan.now)  # restart 1 of 1 this hour
    plan.now = BACKOFF_S + RESTART_WINDOW_S + STEADY_S  # it ran steadily for over an hour, then failed
    fleet.check(plan.now)
    assert "restarting it in 1 s (restart 1 of 1 this hour)" in plan.said[-1]  # the hour before is forgotten
    plan.now += BACKOFF_S
    fleet.check(plan.now)  # restarted; it fails at once: nothing left of this hour's budget, the only worker
    with pytest.raises(HeteroRLError, match="every rollout worker has failed"):
        fleet.check(plan.now)


def test_no_restarts_means_a_failed_worker_leaves_the_fleet_at_once(tmp_path):
    plan = Plan(tmp_path, {"worker-0": [3], "worker-1": [0]})
    fleet = WorkerFleet(plan.start, ["worker-0", "worker-1"], budget=0, say=plan.said.append)
    fleet.check(plan.now)  # worker-1 exited 0: finished, not failed
    assert len(plan.said) == 1 and "worker-0 failed (exit 3)" in plan.said[0] and "given up" in plan.said[0]
    assert plan.started == ["worker-0", "worker-1"] and fleet.restarts() == {}


def test_a_child_runs_under_its_prefix_with_its_number_filled_in(tmp_path):
    from heterorl.config import load_config, worker_command_word
    from heterorl.runtime.supervise import Child

    cfg = load_config(None, ['runtime.worker_prefix=["env", "HETERORL_SITE=site-{number}", "{name}-is-ignored=1"]'])
    prefix = [worker_command_word(word, 2) for word in cfg.runtime.worker_prefix]
    assert prefix == ["env", "HETERORL_SITE=site-3", "worker-2-is-ignored=1"]
    # the prefix runs `heterorl` (here `env` sets a variable it does not read; its usage error still shows it ran)
    child = Child("worker-2", ["no-such-command"], tmp_path / "w.log", prefix=prefix)
    assert child.proc.wait(60) == 2
    child.stop()
    assert "invalid choice: 'no-such-command'" in (tmp_path / "w.log").read_text()


TREE = """
import os, signal, subprocess, sys, time
out = sys.argv[1]
# a child in this process group that ignores SIGTERM, and a grandchild in a session of its own that ignores it too
ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({!r}, 'w').close(); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", ignore.format(out + ".child")])
subprocess.Popen([sys.executable, "-c", ignore.format(out + ".orphan")], start_new_session=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the parent itself leaves at once, as `heterorl train` does
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError):
            pass
    return found


def test_stop_process_returns_only_when_its_whole_tree_is_gone_sessions_of_their_own_included(tmp_path):
    """The sweep's and `heterorl train`'s stop: SIGTERM to the process group; what ignores it, in the group or in a
    session of its own, is SIGKILLed after the timeout; and the call returns only when none of them is left."""
    import os
    import time

    from heterorl.runtime.supervise import stop_process

    out = str(tmp_path / "started")
    proc = subprocess.Popen([sys.executable, "-c", TREE, out], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (os.path.exists(out + ".child") and os.path.exists(out + ".orphan")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    descendants = _children_of(proc.pid)
    assert len(descendants) == 2
    assert stop_process(proc, timeout_s=1.0) == 0  # the parent left on SIGTERM; its children did not
    assert [pid for pid in descendants if _alive(pid)] == []
