"""`heterorl train` forks its learner and workers from a server that imported torch and transformers once
(heterorl/runtime/preloaded.py): each child is the command it stands for, in a session of its own, its command
line that command's, its exit status the command's; what cannot be forked is started by exec."""

import os
import signal
import subprocess
from pathlib import Path

import pytest
import zmq

from heterorl.runtime.preloaded import SWITCH, ForkedChild
from heterorl.runtime.supervise import Child
from tests.conftest import wait_until


@pytest.fixture
def silent_learner():
    """An endpoint that takes connections and never answers: a worker started against it waits."""
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.bind("tcp://127.0.0.1:0")
    yield socket.getsockopt_string(zmq.LAST_ENDPOINT)
    socket.close(linger=0)
    context.term()


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_forked_worker_is_its_command_in_a_session_of_its_own_and_stops_as_one(tmp_path, silent_learner):
    child = Child("worker-0", ["rollout", "--connect", silent_learner, "--worker-id", "worker-0"],
                  tmp_path / "worker-0.log")
    try:
        assert isinstance(child.proc, ForkedChild)
        pid = child.proc.pid
        wait_until(lambda: f"-m heterorl.cli rollout --connect {silent_learner}" in _command_line(pid), 60,
                   lambda: f"the worker's command line, not {_command_line(pid)!r}")
        assert os.getsid(pid) == pid and child.proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            child.proc.wait(0.01)
        # found as the command it stands for, as a process started by exec would be
        found = subprocess.run(["pgrep", "-f", "worker-id worker-0"], capture_output=True, text=True).stdout
        assert str(pid) in found.split()
        os.kill(pid, signal.SIGKILL)
        assert child.proc.wait(60) == -signal.SIGKILL and child.proc.returncode == -signal.SIGKILL
    finally:
        child.stop()
    assert not _command_line(pid) or "heterorl.cli rollout" not in _command_line(pid)


def test_a_forked_commands_exit_status_and_output_are_its_own(tmp_path):
    log = tmp_path / "bad.log"
    log.write_text("an earlier line\n")
    child = Child("worker-1", ["no-such-command"], log)
    assert isinstance(child.proc, ForkedChild)
    assert child.proc.wait(60) == 2
    child.stop()
    text = log.read_text()
    assert text.startswith("an earlier line\n") and "invalid choice: 'no-such-command'" in text  # appended
    # nothing but the command's own output: no word of the module having been imported in the server first
    assert text.splitlines()[1].startswith("usage: heterorl"), text
    out, err = tmp_path / "out", tmp_path / "err"  # (stderr in a file of its own, as the tests' `run_cli` asks)
    assert ForkedChild(["no-such-command"], out, {}, err_path=err).wait(60) == 2
    assert out.read_text() == "" and err.read_text().startswith("usage: heterorl"), err.read_text()


def test_what_cannot_be_forked_is_started_by_exec(tmp_path, monkeypatch):
    vllm = Child("worker-3", ["no-such-command"], tmp_path / "vllm.log", forkable=False)
    assert isinstance(vllm.proc, subprocess.Popen) and vllm.proc.wait(60) == 2
    vllm.stop()
    monkeypatch.setenv(SWITCH, "0")
    switched_off = Child("worker-4", ["no-such-command"], tmp_path / "off.log")
    assert isinstance(switched_off.proc, subprocess.Popen) and switched_off.proc.wait(60) == 2
    switched_off.stop()
    assert "invalid choice" in (tmp_path / "off.log").read_text()
