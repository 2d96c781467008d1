"""A learner port another process holds is refused at once, in one line naming the address and the fix, before
anything loads or is written (not after the model loads and the server waits out its start-up)."""

import json
import socket
from types import SimpleNamespace

import pytest

from heterorl.config import load_config
from heterorl.errors import HeteroRLError
from heterorl.runtime.launch import ENDPOINTS, refuse_busy_ports
from tests.conftest import run_cli


@pytest.fixture()
def ports():
    """Two adjacent ports, as `heterorl learner --bind` lays them out (the weights channel on the control port's
    successor): ``busy``, held by a listening socket, and ``free_below`` it, held by a socket bound with
    SO_REUSEADDR and not listening: no other process is given it, yet the learner's check (and ZeroMQ, which binds
    with SO_REUSEADDR) finds it free, so it can be the control port of a learner whose weights port is busy. No port
    is released before the test is done with it."""
    while True:
        below = socket.socket()
        below.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        below.bind(("127.0.0.1", 0))
        holder = socket.socket()
        try:
            holder.bind(("127.0.0.1", below.getsockname()[1] + 1))
        except OSError:
            below.close(), holder.close()
            continue
        with below, holder:
            holder.listen()
            yield SimpleNamespace(free_below=below.getsockname()[1], busy=holder.getsockname()[1])
        return


def _refused_before_loading(tmp_path, *args: str) -> str:
    """The one line of a refusal that came before the policy loads: the policy named does not exist, so a check
    made after loading it would have failed on that instead (no clock is read: the machine may be busy)."""
    result = run_cli(*args, "rl.steps=2", f"rl.base={tmp_path / 'no-such-policy'}",
                     f"logging.run_dir={tmp_path / 'run'}", timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "no-such-policy" not in result.stderr
    assert not (tmp_path / "run").exists()
    [line] = result.stderr.splitlines()
    return line


@pytest.mark.parametrize("channel", ["control", "weights"])
def test_learner_refuses_a_busy_port_at_once(tmp_path, ports, channel):
    bind = ports.busy if channel == "control" else ports.free_below  # (whose successor is busy)
    line = _refused_before_loading(tmp_path, "learner", "--config", "demo.yaml", "--bind", f"tcp://127.0.0.1:{bind}")
    assert line == (f"heterorl: error: tcp://127.0.0.1:{ports.busy} (the learner's {channel} channel) is in use by "
                    "another process: choose another port (--bind, or runtime.address; the weights channel takes "
                    "port + 1, and port 0 picks free ones) or stop the process that holds it")


def test_train_refuses_a_busy_runtime_address_at_once(tmp_path, ports):
    line = _refused_before_loading(tmp_path, "train", "--config", "demo.yaml",
                                   f"runtime.address=tcp://127.0.0.1:{ports.busy}")
    assert line.startswith(f"heterorl: error: tcp://127.0.0.1:{ports.busy} (the learner's control channel) is in use")


def test_ports_picked_at_bind_time_are_left_to_the_bind(tmp_path):
    cfg = load_config(None, [f"logging.run_dir={tmp_path}"])
    refuse_busy_ports(cfg, "tcp://127.0.0.1:0", resume=False)  # free ports are picked
    refuse_busy_ports(cfg, f"ipc://{tmp_path}/learner", resume=False)  # no port


def test_a_resumed_learner_checks_the_addresses_its_workers_dial(tmp_path, ports):
    cfg = load_config(None, [f"logging.run_dir={tmp_path}"])
    (tmp_path / ENDPOINTS).write_text(json.dumps({"control": f"tcp://127.0.0.1:{ports.free_below}",
                                                  "weights": f"tcp://127.0.0.1:{ports.busy}"}))
    refuse_busy_ports(cfg, "tcp://127.0.0.1:0", resume=False)
    with pytest.raises(HeteroRLError, match=f"tcp://127.0.0.1:{ports.busy} \\(the learner's weights channel\\)"):
        refuse_busy_ports(cfg, "tcp://127.0.0.1:0", resume=True)
