"""A test network on one machine: separate hosts (network namespaces) with their own addresses, joined to the
learner's host by one link each, with real bandwidth limits, latency, jitter, loss and partitions, and helpers
to run `heterorl learner` / `heterorl rollout` on a host (docs/NETLAB.md).

Topology: the host ``learner`` holds the address `LEARNER_ADDRESS` (10.200.0.1); host ``worker-K`` (K = 1 …
workers) holds 10.201.K.2 and reaches the learner over its own link (10.201.K.0/30). Each link's shape
(`LinkShape`) is set per direction: ``down`` is from the learner to the worker (weights), ``up`` the other way
(trajectories). Bandwidth is the kernel's ``tbf`` on each end's egress; delay, jitter and loss are ``netem``
where the kernel has it (backend ``netem``: the link is a veth pair), else the userspace wire
(`heterorl.netlab.wire`, backend ``wire``: the link is a TAP pair). A partition (`cut`) takes both ends of a
link down, in the kernel; `heal` brings them up again.

Everything the lab makes — namespaces, devices, the wire, the processes it ran — goes when it closes, whatever
happened; namespaces left by a lab whose process died are removed by the next lab. Requires root, ``ip`` and
``tc`` (Debian: ``iproute2``); `missing` names what is absent.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

LEARNER_ADDRESS = "10.200.0.1"
PREFIX = "hrl"  # namespace names: hrl<pid>-<host>
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class LinkShape:
    """One direction of a link: latency ``delay_ms`` ± ``jitter_ms`` (uniform), ``loss`` (probability per
    packet), ``rate_mbit`` (None: unlimited)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    rate_mbit: float | None = None

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or not 0 <= self.loss <= 1:
            raise ValueError(f"a link shape needs delay_ms, jitter_ms >= 0 and loss in [0, 1] (got {self})")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0 or None (got {self.rate_mbit})")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


def missing() -> str | None:
    """What this machine lacks for a lab (None: nothing): root, ``ip``, ``tc``, network namespaces."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, devices and qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network lab needs `{tool}` (Debian: apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    if not os.path.exists("/dev/net/tun") and not has_netem():
        return "the kernel has neither netem nor /dev/net/tun (the userspace wire's TAP devices)"
    return None


def has_netem() -> bool:
    """Whether this kernel has the ``netem`` qdisc (tried on a scratch namespace's loopback)."""
    probe = f"{PREFIX}{os.getpid()}-netem"
    if _run("ip", "netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        return _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                    "1ms", check=False).returncode == 0
    finally:
        _run("ip", "netns", "del", probe, check=False)


def remove_stale() -> None:
    """Delete the namespaces of labs whose process is gone (a test killed before it could tear down)."""
    listed = _run("ip", "netns", "list", check=False).stdout.split()
    for name in listed:
        if not name.startswith(PREFIX) or "-" not in name:
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            _kill_namespace(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(name: str) -> None:
    """Kill every process in namespace ``name``, then delete it (its devices go with it)."""
    pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", name, check=False)


class NetLab:
    """``workers`` worker hosts and the learner's host, each link shaped ``shape`` both ways (see the module);
    ``sysctls`` set on every host (per network namespace, e.g. ``{"net.ipv4.tcp_slow_start_after_idle": "0"}``).
    Use as a context manager; `close` tears everything down."""

    def __init__(self, workers: int, shape: LinkShape = LinkShape(), *, backend: str = "auto",
                 seed: int = 0, sysctls: dict[str, str] | None = None) -> None:
        if workers < 1 or workers > 250:
            raise ValueError(f"a lab has 1 to 250 worker hosts (got {workers})")
        if backend not in ("auto", "netem", "wire"):
            raise ValueError(f"backend must be auto, netem or wire (got {backend!r})")
        self.workers, self.seed = workers, seed
        self.backend = ("netem" if has_netem() else "wire") if backend == "auto" else backend
        self.tag = f"{PREFIX}{os.getpid()}"
        self.processes: list[subprocess.Popen] = []
        self.shapes: dict[tuple[int, str], LinkShape] = {}
        self._wire: subprocess.Popen | None = None
        self._made: list[str] = []
        self._initial = shape
        self.sysctls = dict(sysctls or {})

    # -- names ----------------------------------------------------------------------------------
    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def hosts(self) -> list[str]:
        return ["learner", *(f"worker-{k}" for k in range(1, self.workers + 1))]

    def address(self, host: str) -> str:
        """The address ``host`` is reached at."""
        if host == "learner":
            return LEARNER_ADDRESS
        return f"10.201.{self._link(host)}.2"

    def _link(self, host: str) -> int:
        if not host.startswith("worker-") or not host[7:].isdigit() or not 1 <= int(host[7:]) <= self.workers:
            raise ValueError(f"no host {host!r} in this lab (hosts: {', '.join(self.hosts())})")
        return int(host[7:])

    def _devices(self, link: int) -> tuple[str, str]:
        """The link's device names: the learner's end, the worker's end (at most 15 bytes)."""
        stem = f"h{os.getpid() % 10**6}l{link}"
        return f"{stem}a", f"{stem}b"

    # -- building -------------------------------------------------------------------------------
    def __enter__(self) -> NetLab:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        why = missing()
        if why is not None:
            raise RuntimeError(why)
        remove_stale()
        for host in self.hosts():
            name = self.namespace(host)
            _run("ip", "netns", "add", name)
            self._made.append(name)
            self._ip(host, "link", "set", "lo", "up")
            for key, value in self.sysctls.items():
                _run("ip", "netns", "exec", name, "sysctl", "-q", "-w", f"{key}={value}")
        self._ip("learner", "addr", "add", f"{LEARNER_ADDRESS}/32", "dev", "lo")
        links = range(1, self.workers + 1)
        if self.backend == "wire":
            names = [name for k in links for name in self._devices(k)]
            self._wire = subprocess.Popen([sys.executable, "-m", "heterorl.netlab.wire", *names],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            line = self._wire.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"the network lab's wire did not start (said {line!r})")
        for k in links:
            learner_end, worker_end = self._devices(k)
            if self.backend == "netem":
                _run("ip", "link", "add", learner_end, "type", "veth", "peer", "name", worker_end)
            _run("ip", "link", "set", learner_end, "netns", self.namespace("learner"))
            _run("ip", "link", "set", worker_end, "netns", self.namespace(f"worker-{k}"))
            self._ip("learner", "addr", "add", f"10.201.{k}.1/30", "dev", learner_end)
            self._ip(f"worker-{k}", "addr", "add", f"10.201.{k}.2/30", "dev", worker_end)
            self.heal(f"worker-{k}")
            self.shape(f"worker-{k}", self._initial)

    def _ip(self, host: str, *argv: str) -> None:
        _run("ip", "-n", self.namespace(host), *argv)

    def _tc(self, host: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", self.namespace(host), "tc", *argv, check=check)

    # -- links ----------------------------------------------------------------------------------
    def shape(self, worker: str, shape: LinkShape, direction: str = "both") -> None:
        """Set the link of ``worker``'s host to ``shape`` in ``direction`` (down: learner → worker; up; both),
        while processes run."""
        if direction not in ("down", "up", "both"):
            raise ValueError(f"direction must be down, up or both (got {direction!r})")
        link = self._link(worker)
        learner_end, worker_end = self._devices(link)
        for way in (("down", "up") if direction == "both" else (direction,)):
            host, device = ("learner", learner_end) if way == "down" else (worker, worker_end)
            self._tc(host, "qdisc", "del", "dev", device, "root", check=False)
            parent = ["root"]
            if shape.rate_mbit is not None:  # tbf: a burst of 10 ms at the rate (at least 2 full frames)
                burst = max(3200, int(shape.rate_mbit * 1e6 / 8 * 0.01))
                self._tc(host, "qdisc", "add", "dev", device, "root", "handle", "1:", "tbf", "rate",
                         f"{shape.rate_mbit}mbit", "burst", str(burst), "latency", "200ms")
                parent = ["parent", "1:1"]
            if self.backend == "netem" and (shape.delay_ms or shape.jitter_ms or shape.loss):
                self._tc(host, "qdisc", "add", "dev", device, *parent, "handle", "10:", "netem", "delay",
                         f"{shape.delay_ms}ms", f"{shape.jitter_ms}ms", "loss", f"{shape.loss * 100}%")
            elif self.backend == "wire":
                self._command({"link": link - 1, "direction": way, "delay_ms": shape.delay_ms,
                               "jitter_ms": shape.jitter_ms, "loss": shape.loss})
            self.shapes[(link, way)] = shape

    def _command(self, command: dict) -> dict:
        assert self._wire is not None and self._wire.stdin is not None and self._wire.stdout is not None
        self._wire.stdin.write(json.dumps(command) + "\n")
        self._wire.stdin.flush()
        answer = json.loads(self._wire.stdout.readline())
        if "error" in answer:
            raise RuntimeError(f"the wire refused {command}: {answer['error']}")
        return answer

    def cut(self, worker: str) -> None:
        """Partition ``worker``'s host from the learner's: both ends of its link down (in flight is lost)."""
        learner_end, worker_end = self._devices(self._link(worker))
        self._ip("learner", "link", "set", learner_end, "down")
        self._ip(worker, "link", "set", worker_end, "down")

    def heal(self, worker: str) -> None:
        """Bring ``worker``'s link up again, with its route to the learner."""
        link = self._link(worker)
        learner_end, worker_end = self._devices(link)
        self._ip("learner", "link", "set", learner_end, "up")
        self._ip(worker, "link", "set", worker_end, "up")
        self._ip(worker, "route", "replace", f"{LEARNER_ADDRESS}/32", "via", f"10.201.{link}.1", "dev", worker_end)

    def wire_stats(self) -> list[dict[str, list[int]]]:
        """Frames [carried, dropped] per link and direction (the wire backend; netem keeps its own)."""
        if self._wire is None:
            return []
        return self._command({"stats": True})["stats"]

    def wire_cpu_s(self) -> float:
        """CPU seconds the userspace wire has used (0 with netem): a cost the real network does not put on
        the hosts' cores, which on a small machine the lab's processes share with it."""
        if self._wire is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self._wire.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    @contextlib.contextmanager
    def inside(self, host: str):
        """The calling thread in ``host``'s network namespace: sockets it makes meanwhile stay there (the
        namespace is the thread's, so other threads are not moved)."""
        if host != "learner":
            self._link(host)
        libc = ctypes.CDLL(None, use_errno=True)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.namespace(host)}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"cannot enter the namespace of {host!r}")
            try:
                yield
            finally:
                if libc.setns(home, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "cannot return to the thread's own network namespace")
        finally:
            os.close(target)
            os.close(home)

    # -- processes ------------------------------------------------------------------------------
    def run(self, host: str, argv: list[str], log: Path | None = None, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (its own process group; output to ``log``); killed when the lab closes."""
        if host != "learner":
            self._link(host)
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        if log is not None:
            out.close()  # the child holds its own copy
        self.processes.append(proc)
        return proc

    def kill_host(self, host: str) -> None:
        """Kill every process on ``host`` at once (a host that dies), leaving its namespace and address."""
        for pid in _run("ip", "netns", "pids", self.namespace(host), check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def close(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.processes:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self._made):
            _kill_namespace(name)
        self._made.clear()
        if self._wire is not None:
            try:
                if self._wire.stdin is not None:
                    self._wire.stdin.close()
                self._wire.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self._wire.kill()
                self._wire.wait()
            self._wire = None

    def with_shape(self, **changes) -> LinkShape:
        """The initial shape with ``changes`` (e.g. ``lab.with_shape(rate_mbit=10)``)."""
        return replace(self._initial, **changes)
