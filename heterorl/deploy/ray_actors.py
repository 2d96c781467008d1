"""The Ray actors of `heterorl train --launcher ray`: each holds one process of the run on the node Ray placed it
on — a learner rank (`LearnerRank`) or a rollout worker (`RolloutWorker`) — started as on one machine
(``python -m heterorl.cli learner|rollout ...``), its output appended to its log in the run dir on that node.

The process dies with its actor (``PR_SET_PDEATHSIG``): an actor that Ray kills, or whose node is lost, leaves
nothing behind. A rollout worker's actor exits when its process fails, so that Ray's own restart policy
(``max_restarts``) brings it back, on any node with room, under the same worker id: the learner takes it back in
with its newest weights. Imported on the nodes, where Ray is installed; nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

from heterorl.addresses import parse_host_port
from heterorl.files import write_atomically
from heterorl.runtime.supervise import stop_process

READ_LIMIT = 4 * 2**20  # bytes one `read` returns at most (the driver reads on from where it stopped)
LISTENING = "learner listening on "  # the line a learner prints once bound (heterorl.runtime.launch)
_PR_SET_PDEATHSIG = 1


def _write_private(path: Path, text: str) -> None:
    """``text`` into ``path`` (mode 0600, its folder 0700), whole or not at all: written under another name, then
    renamed (a learner re-reading its allowed keys never reads half a key)."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as f:
        f.write(text)
    os.replace(partial, path)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it (the actor's main thread) exits."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class RunProcess:
    """What both actors share: the node, the run dir there, the keys written on it, and one child process.

    ``spec``: ``run_dir`` (absolute), ``cwd`` (the driver's; used where it exists on this node), ``env`` (the
    driver's WANDB_/HF_/... variables), ``marker`` (a file the driver wrote into the run dir: seen here, the run
    dir is shared and the driver reads its files itself), ``files`` (run dir path -> text: what the process reads
    there, written on this node when it does not share the driver's run dir), ``keys`` (file name -> text: the
    CurveZMQ keys this process needs, written into a private folder on this node)."""

    def __init__(self, name: str, spec: dict) -> None:
        self.name, self.spec = name, spec
        self.run_dir = Path(spec["run_dir"])
        context = ray.get_runtime_context()
        self.node = {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(),
                     "hostname": socket.gethostname()}
        self.restarted = context.was_current_actor_reconstructed
        self.started_at = time.time()
        self.shared = (self.run_dir / spec["marker"]).is_file()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if not self.shared:  # the driver wrote them into its own run dir
            for relative, text in spec.get("files", {}).items():
                write_atomically(self.run_dir / relative, text.encode())
        self.log_path = self.run_dir / "logs" / f"{name}.log"
        self.keys_dir = self._write_keys(spec.get("keys") or {})
        self.proc: subprocess.Popen | None = None
        self.stopping = ""

    def _write_keys(self, keys: dict[str, str]) -> Path | None:
        if not keys:
            return None
        folder = Path(tempfile.mkdtemp(prefix="heterorl-keys-"))  # mode 0700
        for file_name, text in keys.items():
            _write_private(folder / file_name, text)
        return folder

    def _start(self, argv: list[str], *, python: str | None = None, prefix: list[str] | None = None,
               env: dict[str, str] | None = None) -> None:
        cwd = self.spec["cwd"] if os.path.isdir(self.spec["cwd"]) else None
        environment = {**os.environ, **self.spec["env"], "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true",
                       **(env or {})}
        with self.log_path.open("ab") as log:
            again = " again (Ray restarted its actor)" if self.restarted else ""
            log.write(f"--- {self.name} started{again} on {self.node['hostname']} ({self.node['ip']}, Ray node "
                      f"{self.node['node_id'][:12]})\n".encode())
            log.flush()
            self.log_offset = log.tell()
            self.proc = subprocess.Popen([*(prefix or []), python or sys.executable, "-m", "heterorl.cli", *argv],
                                         stdout=log, stderr=subprocess.STDOUT, env=environment, cwd=cwd,
                                         start_new_session=True, preexec_fn=_die_with_parent)

    def key_path(self, file_name: str) -> str:
        return str(self.keys_dir / file_name)

    def status(self) -> dict:
        """Where it runs, since when, and its process's exit status (None: running)."""
        return {**self.node, "pid": self.proc.pid if self.proc else None, "started_at": self.started_at,
                "restarted": self.restarted, "shared": self.shared, "stopping": self.stopping,
                "exit": self.proc.poll() if self.proc else None}

    def read(self, relative: str, offset: int = 0) -> bytes:
        """Bytes of a file of the run dir on this node from ``offset`` (at most `READ_LIMIT`; empty when it does
        not exist): how the driver gathers logs and metrics from a node that does not share its run dir."""
        path = (self.run_dir / relative).resolve()
        if not path.is_relative_to(self.run_dir.resolve()):
            raise ValueError(f"{relative} is outside the run dir")
        try:
            with path.open("rb") as f:
                f.seek(offset)
                return f.read(READ_LIMIT)
        except FileNotFoundError:
            return b""

    def stop(self, reason: str, timeout_s: float = 10.0) -> int | None:
        """SIGTERM to the process (a learner checkpoints and leaves), SIGKILL after ``timeout_s``; the reason is
        written to its log first. Returns its exit status."""
        self.stopping = reason
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with self.log_path.open("ab") as log:
                log.write(f"--- heterorl train stops {self.name}: {reason}\n".encode())
        return stop_process(self.proc, timeout_s)


class LearnerRank(RunProcess):
    """One rank of the learner. With several ranks, rank 0's actor hosts the ranks' rendezvous store (a TCPStore
    on a free port of its node, `host_store`) and every rank's process joins it as a client, as processes under
    torchrun join its agent's store."""

    def __init__(self, name: str, spec: dict, rank: int, world: int) -> None:
        super().__init__(name, spec)
        self.rank, self.world, self._store = rank, world, None
        if self.keys_dir:  # (empty when every worker's key comes later, by `allow`)
            (self.keys_dir / "allowed").mkdir(mode=0o700, exist_ok=True)

    def allow(self, name: str, public_key: str) -> None:
        """Let worker ``name`` in: its public key written into the allowed-keys folder, which the learner re-reads
        every ``transport.keys_reload_s`` (a worker refused until then dials again: `WorkerClient._keep_alive`)."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"worker name {name!r} is not a plain file name")
        _write_private(self.keys_dir / "allowed" / f"{name}.key", public_key)

    def host_store(self) -> tuple[str, int]:
        from torch.distributed import TCPStore

        self._store = TCPStore(self.node["ip"], 0, self.world, is_master=True, wait_for_workers=False)
        return self.node["ip"], self._store.port

    def start(self, argv: list[str], store: tuple[str, int] | None) -> None:
        env = {}
        if self.world > 1:
            env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": "0",
                   "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": store[0], "MASTER_PORT": str(store[1]),
                   "TORCHELASTIC_USE_AGENT_STORE": "True"}
        keys = ["--curve-secret", self.key_path("learner.key_secret"), "--allow-keys", self.key_path("allowed")] \
            if self.keys_dir else []
        self._start([*argv, *keys], env=env)

    def endpoint(self, timeout_s: float) -> str:
        """The control address rank 0 listens on, with its host made the node's address when it bound every
        interface. RuntimeError with the log tail when it exits first or does not listen in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.log_path.open("rb") as f:
                f.seek(self.log_offset)
                for line in f.read().decode(errors="replace").splitlines():
                    if line.startswith(LISTENING):
                        address = line.split()[3]
                        host, port = parse_host_port(address, "the address the learner printed", "tcp://127.0.0.1:5555")
                        if host in ("*", "0.0.0.0", "[::]", "::"):
                            address = f"tcp://{self.node['ip']}:{port}"
                        return address
            if self.proc.poll() is not None:
                raise RuntimeError(f"the learner exited with status {self.proc.returncode} before listening:\n"
                                   f"{self.tail()}")
            time.sleep(0.1)
        raise RuntimeError(f"the learner did not listen within {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class RolloutWorker(RunProcess):
    """A rollout worker, started when the actor is (and again when Ray restarts it). When its process fails the
    actor's process exits, for Ray to restart it; when it exits 0 (the learner said the run is over) the actor
    stays, finished."""

    def __init__(self, name: str, spec: dict, argv: list[str], python: str | None, prefix: list[str]) -> None:
        super().__init__(name, spec)
        if python is not None and not Path(python).is_file():
            raise RuntimeError(f"{name}: its engine's Python {python} does not exist on {self.node['hostname']}: "
                               "runtime.vllm_python must name a Python with vLLM and heterorl on every worker node")
        keys = ["--curve-secret", self.key_path(f"{name}.key_secret"), "--server-key", self.key_path("learner.key")] \
            if self.keys_dir else []
        self._start([*argv, *keys], python=python, prefix=prefix)
        threading.Thread(target=self._exit_with_process, name="watch", daemon=True).start()

    def _exit_with_process(self) -> None:
        code = self.proc.wait()
        if code != 0 and not self.stopping:
            with self.log_path.open("ab") as log:
                log.write(f"--- {self.name} exited with status {code}: its actor exits for Ray to restart it\n"
                          .encode())
            os._exit(1)
