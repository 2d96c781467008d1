"""ZeroMQ transport between rollout workers and the learner.

Two channels, each owned by one background I/O thread per endpoint (ZeroMQ
sockets are never shared between threads; callers talk to the thread through
locked queues):

control + trajectories — learner ROUTER (bind ``tcp://HOST:PORT``) ↔ one DEALER per worker.
    Carries hello/ready, heartbeats both ways, trajectories up, acks down.
    Flow control is by credit: the learner grants each worker a cumulative
    ``credit_limit`` (trajectories it may have sent this session), which grows
    only as the learner's consumer takes that worker's trajectories out of the
    buffer. Buffered + in-flight trajectories per worker therefore never exceed
    ``credits_per_worker``: a slow learner slows its workers (``send`` blocks,
    with a timeout) instead of dropping data or growing memory. Credit limits
    are cumulative, so a lost ack costs nothing: the next one carries a newer
    limit. HWM ``control_hwm`` messages each way; ROUTER_MANDATORY so a send to
    a vanished worker is an error we count, not a silent drop.

weights — learner ROUTER (bind PORT+1 unless given) ↔ a DEALER per worker.
    Pull-based chunked transfer with credit (the ZeroMQ guide's file-transfer
    pattern): a ``weights_notice`` on the control channel says a version is
    out; the worker asks for the header of the newest version released to it,
    then keeps ``weights_pipeline`` chunk requests in flight. Each chunk has an
    XXH3-64 checksum; the header's byte and chunk counts guard the whole. A
    worker that joins late or misses notices always gets the newest whole
    version, never a diff. HWM ``weights_hwm``.

Liveness: both sides send heartbeats every ``heartbeat_interval_s``; a peer
silent for ``heartbeat_timeout_s`` is marked dead (learner: in the worker
registry; worker: it re-sends hello until a learner answers). Every blocking
call takes a timeout.

Security: CurveZMQ (encryption + an allow-list of worker public keys) whenever
a ``CurveConfig`` is given; without one, the learner refuses to bind a
non-loopback address unless ``allow_plaintext`` is set.

Delays: an optional per-link delay schedule (see ``heterorl.delay``) holds
trajectories on the worker before they are sent, and weight notices on the
learner before they are released to each worker.
"""

from __future__ import annotations

import heapq
import ipaddress
import itertools
import logging
import math
import os
import socket as pysocket
import sys
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from heterorl.errors import ConfigError, HeteroRLError
from heterorl.protocol import (
    DEFAULT_LIMITS, Ack, Bye, Heartbeat, Hello, Limits, Message, ProtocolError, Ready, Trajectory, TrajectoryBatch,
    WeightsChunk, WeightsHeader, WeightsNotice, WeightsRequest, decode, encode,
)
from heterorl.weights import PackedWeights, pack_state_dict, unpack_state_dict

log = logging.getLogger("heterorl.transport")

# (send_time_s, size_bytes) -> delivery_time_s, or None when the link drops the message
DelaySchedule = Callable[[float, int], "float | None"]


class TransportError(HeteroRLError):
    """A transport operation failed (timeout, refused handshake, closed endpoint)."""


class TransportTimeout(TransportError):
    """A blocking transport call ran out of time. ``done``: how many of its items it got through first (for
    ``send_many``: the trajectories queued or dropped by the delay link; resend from there)."""

    def __init__(self, message: str, done: int = 0) -> None:
        super().__init__(message)
        self.done = done


@dataclass
class TransportConfig:
    """Knobs shared by both ends. Times in seconds."""

    control_hwm: int = 1000  # messages queued per peer on the control channel
    weights_hwm: int = 64  # chunk messages queued per peer on the weights channel
    credits_per_worker: int = 256  # trajectories buffered + in flight per worker
    trajectory_batch: int = 32  # trajectories a worker packs into one message at most
    trajectory_linger_ms: float = 2.0  # a due trajectory waits at most this long for a batch to fill
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    hello_interval_s: float = 0.5
    weights_chunk_bytes: int = 4 * 2**20
    weights_pipeline: int = 8  # chunk requests in flight per fetch
    fetch_timeout_s: float = 30.0  # restart a weights fetch after this long without a chunk
    max_retained_versions: int = 64  # packed versions kept for workers whose release is still delayed
    dedup_window: int = 1_000_000  # trajectory ids remembered for duplicate detection
    max_workers: int = 1024  # registry size; a hello beyond it is refused (bounds memory under a hello flood)
    linger_ms: int = 1000
    allow_plaintext: bool = False  # plaintext on a non-loopback address

    def __post_init__(self) -> None:
        for name in ("control_hwm", "weights_hwm", "credits_per_worker", "trajectory_batch", "weights_chunk_bytes", "weights_pipeline",
                     "max_retained_versions", "dedup_window", "max_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"transport option {name}={getattr(self, name)} must be >= 1")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(f"heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed "
                              f"heartbeat_interval_s={self.heartbeat_interval_s}")


@dataclass
class CurveConfig:
    """CurveZMQ keys (files made by ``heterorl keys``).

    Learner: ``secret_key_file`` (its own ``*.key_secret``) and
    ``allowed_keys_dir`` (a folder of the workers' public ``*.key`` files).
    Worker: ``secret_key_file`` (its own) and ``server_key_file`` (the
    learner's public ``*.key``).
    """

    secret_key_file: str
    server_key_file: str | None = None
    allowed_keys_dir: str | None = None

    def keypair(self) -> tuple[bytes, bytes]:
        path = Path(self.secret_key_file)
        if not path.is_file():
            raise ConfigError(f"CURVE secret key file {path} not found; make one with `heterorl keys --name NAME`")
        public, secret = zmq.auth.load_certificate(str(path))
        if secret is None:
            raise ConfigError(f"{path} holds no secret key; pass the *.key_secret file, not the public *.key")
        return public, secret

    def server_public_key(self) -> bytes:
        if not self.server_key_file or not Path(self.server_key_file).is_file():
            raise ConfigError(f"the learner's public key file {self.server_key_file!r} is missing; copy the "
                              "learner's *.key file to the worker and pass it as server_key_file (--server-key)")
        public, _ = zmq.auth.load_certificate(self.server_key_file)
        return public


def make_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` (secret, mode 0600) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (directory / (name + suffix)).exists():
            raise ConfigError(f"{directory / (name + suffix)} exists; choose another --name or remove it")
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def _host_of(address: str) -> str:
    if "://" not in address:
        raise ConfigError(f"address {address!r} must look like tcp://HOST:PORT")
    scheme, rest = address.split("://", 1)
    if scheme in ("ipc", "inproc"):
        return "localhost"
    if scheme != "tcp":
        raise ConfigError(f"address {address!r}: only tcp://, ipc:// and inproc:// are supported")
    return rest.rsplit(":", 1)[0].strip("[]")


def is_loopback(address: str) -> bool:
    host = _host_of(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _require_security(address: str, curve: CurveConfig | None, config: TransportConfig) -> None:
    if curve is None and not is_loopback(address) and not config.allow_plaintext:
        raise ConfigError(
            f"refusing plaintext on {address}: give CURVE keys (`heterorl keys`, then --curve-secret/--allow-keys) "
            "or set allow_plaintext=True if this network is trusted"
        )


def _port_of(address: str) -> int:
    try:
        return int(address.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        raise ConfigError(f"address {address!r} has no numeric port") from None


def _socket(ctx: zmq.Context, kind: int, hwm: int, config: TransportConfig, limits: Limits) -> zmq.Socket:
    """A socket with the channel's high-water marks, linger and inbound size limit."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, config.linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_header_bytes + limits.max_chunk_bytes)
    return sock


def _receive(sock: zmq.Socket, handle, limit: int = 256) -> None:
    """Hand up to ``limit`` waiting messages to ``handle(sock, frames)`` without blocking."""
    for _ in range(limit):
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        handle(sock, frames)


class _SendBuffers:
    """Reusable buffers for outgoing trajectory batches. A fresh multi-megabyte array per message costs more
    in page faults than the copy into it (the allocator gives freed memory back to the system and faults it
    in again on the next message), so the worker keeps ``keep`` buffers and reuses each once ZeroMQ reports
    it is done with the frames viewing it."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.allocated = 0  # new buffers made (the rest of the messages reused one)
        self._free: list[np.ndarray] = []
        self._busy: list[tuple[np.ndarray, zmq.MessageTracker]] = []

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes``: a released one if it fits, else a new one."""
        self._free += [buffer for buffer, tracker in self._busy if tracker.done]
        self._busy = [(buffer, tracker) for buffer, tracker in self._busy if not tracker.done]
        for i in range(len(self._free) - 1, -1, -1):  # the most recently released first: the warmest in cache
            if len(self._free[i]) >= nbytes:
                return self._free.pop(i)
        if self._free and len(self._free) + len(self._busy) >= self.keep:
            self._free.pop(0)  # too small for today's batches: let it go
        self.allocated += 1
        return np.empty(max(1 << 16, 1 << (nbytes - 1).bit_length()), np.uint8)  # headroom for bigger batches

    def sent(self, buffer: np.ndarray, tracker: zmq.MessageTracker) -> None:
        if len(self._free) + len(self._busy) < self.keep:
            self._busy.append((buffer, tracker))

    def unused(self, buffer: np.ndarray) -> None:
        """``buffer`` was taken but nothing was sent from it."""
        if len(self._free) + len(self._busy) < self.keep:
            self._free.append(buffer)


def _send(sock: zmq.Socket, frames: list, stats: Counter, what: str) -> bool:
    """Non-blocking send; a full queue or a vanished peer is counted, never raised."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        return True
    except zmq.Again:
        stats[f"send_dropped/{what}"] += 1
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EHOSTUNREACH:
            raise
        stats[f"send_unreachable/{what}"] += 1
    return False


class _Wakeup:
    """A self-pipe the I/O thread polls next to its sockets, so another thread can wake it at once (a pipe is
    safe to write from any thread; a ZeroMQ socket is not)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def wake(self) -> None:
        try:
            os.write(self.write_fd, b"x")
        except (BlockingIOError, OSError):
            pass  # already pending (pipe full) or closed: the thread will wake anyway

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class _RateLimitedLog:
    """Log the first few rejections of each reason, then every 1,000th (a flood must not flood the log)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def __call__(self, reason: str, message: str) -> None:
        self.counts[reason] += 1
        n = self.counts[reason]
        if n <= 5 or n % 1000 == 0:
            log.warning("rejected message (%s, #%d): %s", reason, n, message)


# -- learner side -----------------------------------------------------------------------------------

@dataclass
class WorkerInfo:
    """The learner's view of one worker."""

    worker_id: str
    host: str
    pid: int
    routing_id: bytes
    public_key: str | None
    joined_at: float
    last_seen: float
    version_held: int = -1
    trajectories: int = 0  # accepted from this worker (all sessions)
    duplicates: int = 0
    buffered: int = 0  # accepted, not yet taken by the consumer
    received_session: int = 0  # trajectory messages received since its last hello
    released_version: int = -1  # newest weights version released to it (after the weights delay)
    alive: bool = True
    pending_notices: list = field(default_factory=list)  # heap of (due_time, version)
    acks: list = field(default_factory=list)
    rejects: list = field(default_factory=list)
    last_credit_sent: int = -1
    busy_s: float = 0.0  # the worker's cumulative seconds generating (from its heartbeats)
    idle_s: float = 0.0  # ... and waiting for credit, permits or weights
    groups_session: int = 0  # groups whose first trajectory arrived this session
    last_group_id: str = ""
    starts_granted_session: int = 0  # admission permits granted this session (cumulative)
    last_start_limit_sent: int = -2

    def credit_limit(self, window: int) -> int:
        return self.received_session + max(0, window - self.buffered)


class _Endpoint:
    """Context-manager support: ``with LearnerServer(...) as server:`` closes it on the way out."""

    def close(self, reason: str = "") -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LearnerServer(_Endpoint):
    """The learner's end: accepts trajectories, tracks workers, publishes weights. Thread-safe public API."""

    def __init__(self, address: str, config: TransportConfig | None = None, curve: CurveConfig | None = None,
                 limits: Limits = DEFAULT_LIMITS, weights_address: str | None = None,
                 weights_delay: Callable[[str], DelaySchedule | None] | None = None,
                 settings: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or TransportConfig()
        _require_security(address, curve, self.config)
        self.limits = limits
        self._curve = curve
        self._settings = dict(settings or {})
        self._clock = clock
        self._weights_delay = weights_delay
        self._delay_links: dict[str, DelaySchedule | None] = {}
        self._address = address
        self._weights_address = weights_address
        self._lock = threading.Condition()
        self._buffer: deque[Trajectory] = deque()
        self._workers: dict[str, WorkerInfo] = {}
        self._by_routing: dict[bytes, str] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._versions: OrderedDict[int, PackedWeights] = OrderedDict()
        self._retired: deque[PackedWeights] = deque(maxlen=2)  # dropped versions whose buffers publish reuses
        self._publish_times: dict[int, float] = {}
        self._newest = -1
        self._admission_cap: int | None = None  # total groups the fleet may start (None: no admission control)
        self._starts_granted_total = 0
        self._starts_ahead = 1
        self.stats: Counter = Counter()
        self._reject_log = _RateLimitedLog()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.control_endpoint = ""
        self.weights_endpoint = ""
        self._wakeup = _Wakeup()
        self._thread = threading.Thread(target=self._run, name="heterorl-learner-io", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error

    # -- public API (any thread) ------------------------------------------------------------------
    def get(self, max_items: int, timeout_s: float) -> list[Trajectory]:
        """Up to ``max_items`` trajectories in arrival order; waits up to ``timeout_s`` for the first one."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return []
                self._lock.wait(left)
            taken = [self._buffer.popleft() for _ in range(min(max_items, len(self._buffer)))]
            for sampler_id, count in Counter(traj.sampler_id for traj in taken).items():
                worker = self._workers.get(sampler_id)
                if worker is not None:
                    worker.buffered -= count
        if taken:
            self._wakeup.wake()  # the freed credits go out now, not at the next poll timeout
        return taken

    def buffered(self) -> int:
        with self._lock:
            return len(self._buffer)

    def publish(self, version: int, state: dict) -> None:
        """Make ``state`` available as ``version`` (strictly increasing); workers are notified after their delay.
        The tensors are copied once, into the buffer of a retired version when one is free."""
        with self._lock:
            if version <= self._newest:
                raise TransportError(f"weights version {version} is not newer than {self._newest}")
            spare = next((p for p in self._retired if not p.in_flight()), None)
            if spare is not None:
                self._retired.remove(spare)
        packed = pack_state_dict(state, version, self.config.weights_chunk_bytes,
                                 out=spare.buffer if spare is not None else None)
        with self._lock:
            if version <= self._newest:
                raise TransportError(f"weights version {version} is not newer than {self._newest}")
            self._versions[version] = packed
            self._newest = version
            now = self._clock()
            self._publish_times[version] = now
            for worker in self._workers.values():
                self._schedule_notice(worker, version, now, packed.header.total_bytes)
            self._trim_versions()

    def set_admission(self, cap: int | None, ahead: int = 1) -> None:
        """Admission control: the fleet may start at most ``cap`` groups in total (None: no limit); each worker
        holds at most ``ahead`` unused permits, so one fast worker cannot take every permit."""
        with self._lock:
            self._admission_cap, self._starts_ahead = cap, max(1, ahead)

    def admission_state(self) -> str:
        """One line on the admission permits (for a learner that waits long for data)."""
        with self._lock:
            if self._admission_cap is None:
                return "no admission control"
            held = ", ".join(f"{w.worker_id}{'' if w.alive else ' (dead)'} {w.groups_session}/"
                             f"{w.starts_granted_session}" for w in self._workers.values())
            return f"permits {self._starts_granted_total}/{self._admission_cap} granted; started/granted: {held}"

    def workers(self) -> list[WorkerInfo]:
        """A snapshot of the worker registry."""
        with self._lock:
            return [WorkerInfo(**{k: getattr(w, k) for k in WorkerInfo.__dataclass_fields__
                                  if k not in ("pending_notices", "acks", "rejects")})
                    for w in self._workers.values()]

    def close(self, reason: str = "learner closed") -> None:
        """Say bye to every live worker (they stop their loops) and stop the I/O thread."""
        self._bye_reason = reason
        self._stop.set()
        self._wakeup.wake()
        with self._lock:
            self._lock.notify_all()
        self._thread.join(timeout=10)

    # -- I/O thread -----------------------------------------------------------------------------
    def _bind(self, ctx: zmq.Context, address: str, hwm: int) -> tuple[zmq.Socket, str]:
        sock = _socket(ctx, zmq.ROUTER, hwm, self.config, self.limits)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self._curve is not None:
            public, secret = self._curve.keypair()
            sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        if address.endswith(":0"):
            port = sock.bind_to_random_port(address.rsplit(":", 1)[0])
            address = f"{address.rsplit(':', 1)[0]}:{port}"
        else:
            sock.bind(address)
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT) or address

    def _run(self) -> None:
        ctx = zmq.Context()
        auth = None
        sockets: list[zmq.Socket] = []
        try:
            if self._curve is not None:
                allowed = self._curve.allowed_keys_dir
                if not allowed or not Path(allowed).is_dir():
                    raise ConfigError(f"allowed_keys_dir {allowed!r} is not a folder of worker public keys "
                                      "(*.key files made by `heterorl keys`)")
                auth = ThreadAuthenticator(ctx, log=logging.getLogger("heterorl.auth"))
                auth.start()
                auth.configure_curve(domain="*", location=str(allowed))
            control, self.control_endpoint = self._bind(ctx, self._address, self.config.control_hwm)
            sockets.append(control)
            weights_address = self._weights_address or (
                f"{self._address.rsplit(':', 1)[0]}:{0 if self._address.endswith(':0') else _port_of(self._address) + 1}")
            weights, self.weights_endpoint = self._bind(ctx, weights_address, self.config.weights_hwm)
            sockets.append(weights)
        except BaseException as exc:  # surfaced to the constructor
            self._error = exc if isinstance(exc, HeteroRLError) else TransportError(
                f"cannot bind {self._address}: {exc}")
            for s in sockets:
                s.close(0)
            if auth is not None:
                auth.stop()
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        poller.register(weights, zmq.POLLIN)
        poller.register(self._wakeup.read_fd, zmq.POLLIN)
        last_beat = 0.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=50))
                if self._wakeup.read_fd in events:
                    self._wakeup.drain()
                if control in events:
                    _receive(control, self._on_control)
                if weights in events:
                    _receive(weights, self._on_weights)
                now = time.monotonic()
                beat = now - last_beat >= self.config.heartbeat_interval_s
                if beat:
                    last_beat = now
                self._housekeeping(control, now, beat)
        finally:
            bye = encode(Bye("learner", getattr(self, "_bye_reason", "learner closed")))
            for worker in list(self._workers.values()):
                if worker.alive:
                    _send(control, [worker.routing_id, *bye], self.stats, "bye")
            control.close(self.config.linger_ms)
            weights.close(self.config.linger_ms)
            if auth is not None:
                auth.stop()
            ctx.term()
            self._wakeup.close()

    def _reject(self, reason: str, message: str, worker: WorkerInfo | None = None, trajectory_id: str = "") -> None:
        self.stats["rejected"] += 1
        self.stats[f"rejected/{reason}"] += 1
        self._reject_log(reason, message)
        if worker is not None and trajectory_id:
            worker.rejects.append(f"{trajectory_id}: {message}"[:256])

    def _on_control(self, sock: zmq.Socket, frames: list) -> None:
        routing_id = frames[0].bytes
        self.stats["received"] += 1
        try:
            message = decode(frames[1:], self.limits)
        except ProtocolError as exc:
            worker_id = self._by_routing.get(routing_id)
            self._reject(exc.reason, f"from {worker_id or 'unknown peer'}: {exc}")
            return
        user_id = frames[1].get("User-Id") if self._curve is not None else None
        with self._lock:
            if isinstance(message, Hello):
                self._on_hello(sock, routing_id, message, user_id)
                return
            worker_id = self._by_routing.get(routing_id)
            worker = self._workers.get(worker_id) if worker_id else None
            if worker is None:
                self._reject("unknown_peer", f"{message.kind} from a peer that has not said hello")
                return
            worker.last_seen = time.monotonic()
            if not worker.alive:
                worker.alive = True
                log.info("worker %s is back", worker.worker_id)
            if isinstance(message, TrajectoryBatch):
                self._on_batch(worker, message.trajectories, time.time())
                self._lock.notify_all()
            elif isinstance(message, Trajectory):
                self._on_trajectory(worker, message, time.time())
                self._lock.notify_all()
            elif isinstance(message, Heartbeat):
                if message.sender_id != worker.worker_id:
                    self._reject("forged_id", f"heartbeat names {message.sender_id!r} on {worker.worker_id}'s link")
                    return
                worker.version_held = message.version_held
                worker.busy_s, worker.idle_s = message.busy_s, message.idle_s
            elif isinstance(message, Bye):
                worker.alive = False
                self._reclaim_starts(worker)
                log.info("worker %s left: %s", worker.worker_id, message.reason)
            else:
                self._reject("unexpected_kind", f"{message.kind} is not sent by workers", worker)

    def _on_hello(self, sock, routing_id: bytes, hello: Hello, user_id: str | None) -> None:
        worker = self._workers.get(hello.worker_id)
        now = time.monotonic()
        if worker is not None and user_id is not None and worker.public_key not in (None, user_id):
            self._reject("forged_id", f"worker id {hello.worker_id!r} belongs to another key")
            _send(sock, [routing_id, *encode(Bye("learner", "worker id taken by another key"))], self.stats, "bye")
            return
        if worker is None and len(self._workers) >= self.config.max_workers:
            self._reject("too_many_workers", f"hello from {hello.worker_id!r}: registry full ({self.config.max_workers})")
            return
        if worker is None:
            worker = WorkerInfo(worker_id=hello.worker_id, host=hello.host, pid=hello.pid, routing_id=routing_id,
                                public_key=user_id, joined_at=now, last_seen=now)
            self._workers[hello.worker_id] = worker
            log.info("worker %s joined from %s (pid %d)", hello.worker_id, hello.host, hello.pid)
        else:
            if worker.routing_id != routing_id:
                self._by_routing.pop(worker.routing_id, None)
                log.info("worker %s rejoined from %s (pid %d)", hello.worker_id, hello.host, hello.pid)
            self._reclaim_starts(worker)  # a new session: permits the old one never used go back to the fleet
            worker.routing_id, worker.host, worker.pid = routing_id, hello.host, hello.pid
        self._by_routing[routing_id] = hello.worker_id
        worker.last_seen, worker.alive, worker.version_held = now, True, hello.version_held
        worker.received_session = 0
        worker.groups_session = worker.starts_granted_session = 0
        worker.last_start_limit_sent = -2
        worker.pending_notices.clear()
        worker.released_version = self._newest  # a (re)joining worker gets the newest whole version
        worker.last_credit_sent = worker.credit_limit(self.config.credits_per_worker)
        ready = Ready(worker_id=hello.worker_id, credits=worker.last_credit_sent, newest_version=self._newest,
                      heartbeat_interval_s=self.config.heartbeat_interval_s,
                      settings={**self._settings, "weights_port": _port_of(self.weights_endpoint),
                                "start_limit": -1 if self._admission_cap is None else 0})
        _send(sock, [routing_id, *encode(ready)], self.stats, "ready")

    def _on_batch(self, worker: WorkerInfo, trajectories: list[Trajectory], received_at: float) -> None:
        """Take in a batch: in bulk when every member is new, within credit and the worker's own, else one by
        one (which names each refusal)."""
        ids = [traj.trajectory_id for traj in trajectories]
        if (worker.buffered + len(ids) > self.config.credits_per_worker or not self._seen.keys().isdisjoint(ids)
                or len(set(ids)) != len(ids) or any(traj.sampler_id != worker.worker_id for traj in trajectories)):
            for traj in trajectories:
                self._on_trajectory(worker, traj, received_at)
            return
        for traj in trajectories:
            traj.received_at = received_at
            if traj.group_id != worker.last_group_id:
                self._count_group(worker, traj.group_id)
        self._seen.update(dict.fromkeys(ids))
        while len(self._seen) > self.config.dedup_window:
            self._seen.popitem(last=False)
        self._buffer.extend(trajectories)
        worker.received_session += len(ids)
        worker.buffered += len(ids)
        worker.trajectories += len(ids)
        worker.acks += ids
        self.stats["accepted"] += len(ids)

    def _count_group(self, worker: WorkerInfo, group_id: str) -> None:
        """A worker sends each group's members back to back: a new group id is a new start (a re-sent duplicate
        is none, so callers count only new trajectories)."""
        worker.groups_session += 1
        worker.last_group_id = group_id
        if self._admission_cap is not None and worker.groups_session > worker.starts_granted_session:
            # started on a permit reclaimed since (the worker was thought dead): it counts all the same
            worker.starts_granted_session += 1
            self._starts_granted_total += 1

    def _on_trajectory(self, worker: WorkerInfo, traj: Trajectory, received_at: float) -> None:
        worker.received_session += 1
        if traj.sampler_id != worker.worker_id:
            self._reject("forged_id", f"trajectory names sampler {traj.sampler_id!r} on {worker.worker_id}'s link",
                         worker, traj.trajectory_id)
            return
        if traj.trajectory_id in self._seen:
            worker.duplicates += 1
            self.stats["duplicates"] += 1
            worker.acks.append(traj.trajectory_id)  # delivered once already: acknowledge, do not buffer again
            return
        if worker.buffered >= self.config.credits_per_worker:
            self._reject("no_credit", f"{worker.worker_id} sent beyond its credit", worker, traj.trajectory_id)
            return
        if traj.group_id != worker.last_group_id:
            self._count_group(worker, traj.group_id)
        traj.received_at = received_at
        self._seen[traj.trajectory_id] = None
        if len(self._seen) > self.config.dedup_window:
            self._seen.popitem(last=False)
        self._buffer.append(traj)
        worker.buffered += 1
        worker.trajectories += 1
        worker.acks.append(traj.trajectory_id)
        self.stats["accepted"] += 1

    def _on_weights(self, sock: zmq.Socket, frames: list) -> None:
        routing_id = frames[0].bytes
        try:
            request = decode(frames[1:], self.limits)
        except ProtocolError as exc:
            self._reject(exc.reason, f"on the weights channel: {exc}")
            return
        if not isinstance(request, WeightsRequest):
            self._reject("unexpected_kind", f"{request.kind} on the weights channel")
            return
        user_id = frames[1].get("User-Id") if self._curve is not None else None
        with self._lock:
            worker = self._workers.get(request.worker_id)
            if worker is None or (user_id is not None and worker.public_key not in (None, user_id)):
                self._reject("unknown_peer", f"weights request for unknown worker {request.worker_id!r}")
                return
            released = self._versions.get(worker.released_version)
            if released is None:
                return  # nothing released yet (the worker asks again on the next notice)
            packed = self._versions.get(request.version) if request.chunk >= 0 else None
            if packed is not None and request.chunk < packed.header.num_chunks:
                # under the lock: once tracked, publish will not reuse the buffer until ZeroMQ is done with it
                data = packed.chunk(request.chunk)
                chunk = WeightsChunk(version=packed.header.version, index=request.chunk,
                                     checksum=packed.chunk_checksum(request.chunk))
                frame = zmq.Frame(data, copy=False, track=True)
                packed.track(zmq.MessageTracker(frame))
        if packed is None or request.chunk >= packed.header.num_chunks:
            _send(sock, [routing_id, *encode(released.header)], self.stats, "weights_header")
            self.stats["weights/headers_sent"] += 1
            return
        header, _ = encode(chunk)
        if _send(sock, [routing_id, header, frame], self.stats, "weights_chunk"):
            self.stats["weights/bytes_sent"] += len(data)

    def _schedule_notice(self, worker: WorkerInfo, version: int, now: float, size: int) -> None:
        if worker.worker_id not in self._delay_links:
            self._delay_links[worker.worker_id] = self._weights_delay(worker.worker_id) if self._weights_delay else None
        link = self._delay_links[worker.worker_id]
        due = now if link is None else link(now, size)
        if due is None:
            self.stats["weights/notices_lost"] += 1
            return
        heapq.heappush(worker.pending_notices, (due, version))

    def _trim_versions(self) -> None:
        needed = {w.released_version for w in self._workers.values()}
        needed |= {v for w in self._workers.values() for _, v in w.pending_notices}
        while len(self._versions) > self.config.max_retained_versions:
            oldest = next(iter(self._versions))
            if oldest == self._newest:
                break
            if oldest in needed:
                self.stats["weights/retention_skips"] += 1
            self._retire(oldest)
        for v in [v for v in self._versions if v not in needed and v != self._newest]:
            self._retire(v)

    def _retire(self, version: int) -> None:
        self._retired.append(self._versions.pop(version))
        self._publish_times.pop(version, None)

    def _reclaim_starts(self, worker: WorkerInfo) -> None:
        """Return a dead or rejoining worker's unused admission permits to the fleet, so permits held by a
        worker that never comes back cannot stall the learner."""
        unused = worker.starts_granted_session - worker.groups_session
        if unused > 0:
            self._starts_granted_total -= unused
            worker.starts_granted_session = worker.groups_session

    def _grant_starts(self, worker: WorkerInfo) -> int:
        """The worker's cumulative start limit this session: −1 without admission control; else top its unused
        permits up to ``ahead`` while the fleet's total stays within the cap."""
        if self._admission_cap is None:
            return -1
        unused = worker.starts_granted_session - worker.groups_session
        grant = min(self._starts_ahead - unused, self._admission_cap - self._starts_granted_total)
        if grant > 0:
            worker.starts_granted_session += grant
            self._starts_granted_total += grant
        return worker.starts_granted_session

    def _housekeeping(self, sock: zmq.Socket, now: float, beat: bool) -> None:
        window = self.config.credits_per_worker
        clock_now = self._clock()
        outgoing = []
        with self._lock:
            for worker in self._workers.values():
                if worker.alive and now - worker.last_seen > self.config.heartbeat_timeout_s:
                    worker.alive = False
                    self._reclaim_starts(worker)
                    log.warning("worker %s silent for %.1f s: marked dead", worker.worker_id, now - worker.last_seen)
                released = False
                while worker.pending_notices and worker.pending_notices[0][0] <= clock_now:
                    _, version = heapq.heappop(worker.pending_notices)
                    if version in self._versions:
                        worker.released_version = max(worker.released_version, version)
                        released = True
                    else:  # dropped from retention: the next retained version stands in
                        newer = [v for v in self._versions if v > version]
                        if newer:
                            worker.released_version = max(worker.released_version, newer[0])
                            released = True
                if not worker.alive:
                    continue
                if released:
                    outgoing.append((worker.routing_id, WeightsNotice(worker.released_version)))
                limit = worker.credit_limit(window)
                start_limit = self._grant_starts(worker)
                if (worker.acks or worker.rejects or limit != worker.last_credit_sent
                        or start_limit != worker.last_start_limit_sent or beat):
                    outgoing.append((worker.routing_id, Ack(worker.acks, worker.rejects, limit, start_limit)))
                    worker.acks, worker.rejects, worker.last_credit_sent = [], [], limit
                    worker.last_start_limit_sent = start_limit
            if any(isinstance(m, WeightsNotice) for _, m in outgoing):
                self._trim_versions()  # released notices may free versions no worker can still be given
        for routing_id, message in outgoing:
            _send(sock, [routing_id, *encode(message)], self.stats, message.kind)


# -- worker side ----------------------------------------------------------------------------------

class WorkerClient(_Endpoint):
    """A rollout worker's end: handshake, heartbeats, credit-gated trajectory sends, weight fetches."""

    def __init__(self, address: str, worker_id: str, config: TransportConfig | None = None,
                 curve: CurveConfig | None = None, limits: Limits = DEFAULT_LIMITS,
                 trajectory_delay: DelaySchedule | None = None, clock: Callable[[], float] = time.monotonic,
                 version_held: int = -1) -> None:
        self.config = config or TransportConfig()
        if curve is None and not is_loopback(address) and not self.config.allow_plaintext:
            raise ConfigError(f"refusing plaintext to {address}: pass the learner's public key (--server-key) and "
                              "this worker's secret key (--curve-secret), or allow_plaintext=True on a trusted network")
        self.address = address
        self.worker_id = worker_id
        self.limits = limits
        self._curve = curve
        self._delay = trajectory_delay
        self._clock = clock
        self._lock = threading.Condition()
        self._outbox: list = []  # heap of (due_time, sequence, Trajectory); a reordering delay link may reorder
        self._latest_due = -math.inf  # the latest due time in the outbox (all are due once it has passed)
        self._in_hand = 0  # trajectories taken from the outbox by the I/O thread and not yet handed to the socket
        # used by the I/O thread only; enough buffers for every message the credit window lets be in flight
        self._send_buffers = _SendBuffers(keep=-(-self.config.credits_per_worker // self.config.trajectory_batch) + 2)
        self._sequence = itertools.count()
        self._sent_session = 0
        self._credit_limit = 0
        self._starts_session = 0
        self._start_limit = -1
        self.busy_s = 0.0  # reported in heartbeats; the rollout loop adds to them
        self.idle_s = 0.0
        self.finished = threading.Event()  # the learner said bye: the run is over
        self._ready: Ready | None = None
        self._version_held = version_held
        self._latest: tuple[int, dict] | None = None
        self._fetched_version = version_held
        self.learner_alive = False
        self.stats: Counter = Counter()
        self.rejections: deque[str] = deque(maxlen=100)
        self._stop = threading.Event()
        self._wakeup = _Wakeup()
        self._thread = threading.Thread(target=self._run, name=f"heterorl-worker-io-{worker_id}", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> Ready:
        """Block until the learner answers the hello; TransportTimeout after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._ready is None or not self.learner_alive:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout(f"no answer from the learner at {self.address} within {timeout_s} s; "
                                           "check the address, the port, the firewall and the CURVE keys")
                self._lock.wait(min(left, 0.1))
            return self._ready

    def send(self, trajectory: Trajectory, timeout_s: float) -> bool:
        """Queue ``trajectory`` once a credit is free (back-pressure); TransportTimeout after ``timeout_s``.

        Returns False when the trajectory delay link dropped it (simulated loss), True otherwise.
        """
        return self.send_many([trajectory], timeout_s) == 1

    def send_many(self, trajectories: Sequence[Trajectory], timeout_s: float) -> int:
        """Queue ``trajectories`` in order (a group, say), each once a credit is free; one lock round for all
        that credit allows at once, where ``send`` takes one per trajectory. TransportTimeout when ``timeout_s``
        passes with some not queued: its ``done`` counts those dealt with before it (resend the rest). Returns
        how many were queued: the rest were dropped by the trajectory delay link (simulated loss).
        """
        deadline = time.monotonic() + timeout_s
        queued, i, batch = 0, 0, self.config.trajectory_batch
        while i < len(trajectories):
            with self._lock:
                while not (self.learner_alive and self._sent_session < self._credit_limit):
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stop.is_set():
                        raise TransportTimeout(f"no credit from the learner within {timeout_s} s "
                                               f"(sent {self._sent_session} of {self._credit_limit} granted)", i)
                    self._lock.wait(min(left, 0.1))
                before = len(self._outbox)
                take = min(len(trajectories) - i, self._credit_limit - self._sent_session)
                now = self._clock()
                for trajectory in trajectories[i:i + take]:
                    due = now if self._delay is None else self._delay(now, trajectory.nbytes)
                    if due is None:
                        self.stats["delay/dropped"] += 1
                        continue
                    self._sent_session += 1
                    self._latest_due = max(self._latest_due, due)
                    heapq.heappush(self._outbox, (due, next(self._sequence), trajectory))
                    queued += 1
                pending = len(self._outbox)
            i += take
            if before == 0 < pending or pending // batch > before // batch:
                self._wakeup.wake()  # a full batch goes at once; a first one starts the linger clock
        return queued

    def acquire_starts(self, wanted: int, timeout_s: float) -> int:
        """How many of ``wanted`` groups may be started now (admission control); blocks up to ``timeout_s`` for
        at least one, returning 0 on timeout. Without admission control: ``wanted``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._start_limit < 0 and self.learner_alive:
                    return wanted
                free = self._start_limit - self._starts_session
                if free > 0 and self.learner_alive:
                    granted = min(wanted, free)
                    self._starts_session += granted
                    return granted
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return 0
                self._lock.wait(min(left, 0.1))

    @property
    def start_limit(self) -> int:
        """The admission limit in force: how many groups this session may start in all (-1: no admission
        control). It rides on the learner's acks, so it follows `LearnerServer.set_admission` a beat later."""
        with self._lock:
            return self._start_limit

    def set_trajectory_delay(self, schedule: DelaySchedule | None, clock: Callable[[], float] | None = None) -> None:
        """Install the delay link for trajectories (known once the learner's config arrives with ``ready``)."""
        with self._lock:
            self._delay = schedule
            if clock is not None:
                self._clock = clock

    def latest_weights(self) -> tuple[int, dict] | None:
        """The newest fetched (version, state dict) not yet taken, or None."""
        with self._lock:
            latest, self._latest = self._latest, None
            return latest

    def wait_weights(self, newer_than: int, timeout_s: float) -> tuple[int, dict] | None:
        """Block up to ``timeout_s`` for weights newer than ``newer_than``; None on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._latest is None or self._latest[0] <= newer_than:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(min(left, 0.1))
            latest, self._latest = self._latest, None
            return latest

    def set_version_held(self, version: int) -> None:
        with self._lock:
            self._version_held = version

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued trajectory has been handed to the socket."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._outbox or self._in_hand:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.1))
        return True

    def close(self, reason: str = "done") -> None:
        self._bye_reason = reason
        self._stop.set()
        self._wakeup.wake()
        self._thread.join(timeout=10)

    # -- I/O thread -----------------------------------------------------------------------------
    def _socket(self, ctx: zmq.Context, hwm: int) -> zmq.Socket:
        sock = _socket(ctx, zmq.DEALER, hwm, self.config, self.limits)
        if self._curve is not None:
            public, secret = self._curve.keypair()
            sock.curve_secretkey, sock.curve_publickey = secret, public
            sock.curve_serverkey = self._curve.server_public_key()
        return sock

    def _run(self) -> None:
        ctx = zmq.Context()
        control = self._socket(ctx, self.config.control_hwm)
        control.connect(self.address)
        weights: zmq.Socket | None = None
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        poller.register(self._wakeup.read_fd, zmq.POLLIN)
        fetch = _Fetch()
        last_hello = last_beat = 0.0
        last_heard = time.monotonic()
        try:
            while not self._stop.is_set():
                with self._lock:
                    due_in = self._outbox[0][0] - self._clock() if self._outbox else 1.0
                # sleep until a message, a wake-up (a full batch), the next due trajectory plus the linger, or 50 ms
                wait_ms = 1000 * max(0.0, due_in) / self._time_scale() + self.config.trajectory_linger_ms
                events = dict(poller.poll(timeout=min(50, int(wait_ms))))
                if self._wakeup.read_fd in events:
                    self._wakeup.drain()
                now = time.monotonic()
                if control in events:
                    for _ in range(256):
                        try:
                            frames = control.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        last_heard = now
                        message = self._decode(frames, "control")
                        if isinstance(message, Ready):
                            if weights is None:
                                host = self.address.rsplit(":", 1)[0]
                                weights = self._socket(ctx, self.config.weights_hwm)
                                weights.connect(f"{host}:{message.settings['weights_port']}")
                                poller.register(weights, zmq.POLLIN)
                            self._on_ready(message)
                            if message.newest_version > self._fetched_version:
                                fetch.start(weights, self, now)
                        elif isinstance(message, Ack):
                            self._on_ack(message)
                        elif isinstance(message, WeightsNotice):
                            if message.version > self._fetched_version and weights is not None:
                                fetch.start(weights, self, now)
                        elif isinstance(message, Bye):
                            log.info("learner said bye to %s: %s", self.worker_id, message.reason)
                            self.rejections.append(message.reason)
                            self.finished.set()
                            with self._lock:
                                self._lock.notify_all()
                if weights is not None and weights in events:
                    for _ in range(256):
                        try:
                            frames = weights.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        message = self._decode(frames, "weights")
                        if message is not None:
                            fetch.on_message(weights, self, message, now)
                if weights is not None:
                    fetch.check_timeout(weights, self, now)
                if self.learner_alive and now - last_heard > self.config.heartbeat_timeout_s:
                    log.warning("learner silent for %.1f s; saying hello again", now - last_heard)
                    with self._lock:
                        self.learner_alive = False
                if not self.learner_alive and now - last_hello >= self.config.hello_interval_s:
                    last_hello = now
                    hello = Hello(self.worker_id, pysocket.gethostname(), os.getpid(), self._version_held, time.time())
                    _send(control, encode(hello), self.stats, "hello")
                if self.learner_alive and now - last_beat >= self.config.heartbeat_interval_s:
                    last_beat = now
                    beat = Heartbeat(self.worker_id, self._version_held, time.time(), self.busy_s, self.idle_s)
                    _send(control, encode(beat), self.stats, "heartbeat")
                self._drain_outbox(control)
        finally:
            if self.learner_alive:
                _send(control, encode(Bye(self.worker_id, getattr(self, "_bye_reason", "closed"))), self.stats, "bye")
            control.close(self.config.linger_ms)
            if weights is not None:
                weights.close(0)
            ctx.term()
            self._wakeup.close()

    def _decode(self, frames, channel: str) -> Message | None:
        try:
            return decode(frames, self.limits)
        except ProtocolError as exc:
            self.stats[f"rejected/{exc.reason}"] += 1
            log.warning("bad message from the learner on the %s channel: %s", channel, exc)
            return None

    def _on_ready(self, ready: Ready) -> None:
        with self._lock:
            first = self._ready is None
            self._ready = ready
            self.learner_alive = True
            self._sent_session = len(self._outbox)  # a new session: credit counts restart from what is queued
            self._credit_limit = ready.credits
            self._starts_session, self._start_limit = 0, int(ready.settings.get("start_limit", -1))
            self._lock.notify_all()
        log.info("worker %s %s learner at %s", self.worker_id, "joined" if first else "rejoined", self.address)

    def _on_ack(self, ack: Ack) -> None:
        with self._lock:
            self.stats["acked"] += len(ack.accepted)
            self.stats["refused"] += len(ack.rejected)
            self.rejections.extend(ack.rejected)
            self._credit_limit = max(self._credit_limit, ack.credits)
            self._start_limit = ack.start_limit if ack.start_limit < 0 else max(self._start_limit, ack.start_limit)
            self._lock.notify_all()
        for reason in ack.rejected[:3]:
            log.warning("learner refused a trajectory: %s", reason)

    def _drain_outbox(self, control: zmq.Socket) -> None:
        """Send the due trajectories in messages of up to ``trajectory_batch``; a partial batch waits until its
        oldest member has been due for ``trajectory_linger_ms`` (a few ms of latency for far fewer messages).
        Messages are encoded and sent outside the lock, so ``send`` is not held up meanwhile."""
        now = self._clock()
        size = self.config.trajectory_batch
        linger = self.config.trajectory_linger_ms / 1000 * self._time_scale()
        with self._lock:
            if not self._outbox:
                return
            due = len(self._outbox) if self._latest_due <= now else sum(1 for item in self._outbox if item[0] <= now)
            if due < size and (not due or now - self._outbox[0][0] < linger):
                return
            batches = []
            while due:
                batches.append([heapq.heappop(self._outbox) for _ in range(min(due, size))])
                due -= len(batches[-1])
            if not self._outbox:
                self._latest_due = -math.inf
            self._in_hand = sum(len(batch) for batch in batches)
        try:
            for i, batch in enumerate(batches):
                if not self._send_batch(control, [item[2] for item in batch]):
                    with self._lock:  # HWM reached: keep them queued, try on the next loop
                        for item in itertools.chain.from_iterable(batches[i:]):
                            heapq.heappush(self._outbox, item)
                            self._latest_due = max(self._latest_due, item[0])
                    break
        finally:
            with self._lock:
                self._in_hand = 0
                self._lock.notify_all()

    def _send_batch(self, control: zmq.Socket, trajectories: list[Trajectory]) -> bool:
        """One ``trajectories`` message, its arrays sent without a copy from a reused buffer; False when the
        socket would block."""
        sent_at = time.time()
        for traj in trajectories:
            traj.sent_at = sent_at
        message = TrajectoryBatch(trajectories)
        buffer = self._send_buffers.take(message.payload_nbytes())
        header, *data = encode(message, out=buffer)
        frames = [zmq.Frame(frame, copy=False, track=True) for frame in data]
        try:
            control.send_multipart([header, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._send_buffers.unused(buffer)
            self.stats["send_blocked"] += 1
            return False
        self._send_buffers.sent(buffer, zmq.MessageTracker(*frames))
        self.stats["sent"] += len(trajectories)
        return True

    def _time_scale(self) -> float:
        """Delay-clock seconds per real second (a ScaledClock runs faster than real time)."""
        owner = getattr(self._clock, "__self__", None)
        return float(getattr(owner, "factor", 1.0))

    def _deliver_weights(self, version: int, state: dict) -> None:
        with self._lock:
            self._latest = (version, state)
            self._fetched_version = version
            self._lock.notify_all()


class _ReceiveBuffers:
    """The buffers of delivered weight versions, each reused for a later version of the same size once nothing
    views it any more. A fresh buffer costs a page fault per 4 KiB on its first write (about 25 ms per 100 MiB,
    as much as the copy into it); once the worker has loaded a version into its model and dropped the delivered
    tensors, that version's buffer takes the next one instead. Whether anything still views a buffer is read
    from its reference count: every tensor of a delivered state dict, and every view made of one, keeps it
    alive, so a buffer someone still uses is never overwritten. At most ``keep`` buffers are held for reuse: two
    by default, the peak a worker reaches anyway while it receives a version and still holds the previous one."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.allocated = 0  # fresh buffers made (the other versions were received into a reused one)
        self._kept: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        for i in range(len(self._kept)):
            # two references when only this list holds it: the list's and getrefcount's argument
            if len(self._kept[i]) == nbytes and sys.getrefcount(self._kept[i]) == 2:
                return self._kept.pop(i)
        self.allocated += 1
        return np.empty(nbytes, np.uint8)

    def reuse_later(self, buffer: np.ndarray) -> None:
        """``buffer`` was delivered (or its transfer abandoned): reuse it once nothing views it."""
        self._kept = [*self._kept, buffer][-self.keep:]


class _Fetch:
    """State of one pull-based weights transfer on a worker (header, then pipelined chunks)."""

    def __init__(self) -> None:
        self.buffers = _ReceiveBuffers()
        self.active = False
        self.header: WeightsHeader | None = None
        self.buffer: np.ndarray | None = None
        self.received: set[int] = set()
        self.next_chunk = 0
        self.last_progress = 0.0
        self.retry = False

    def start(self, sock: zmq.Socket, client: WorkerClient, now: float) -> None:
        if self.active and self.header is None:
            return  # a header request is already out
        if self.buffer is not None:  # an unfinished transfer: its buffer can take a later version
            self.buffers.reuse_later(self.buffer)
        self.active, self.header, self.buffer, self.received, self.next_chunk = True, None, None, set(), 0
        self.last_progress = now
        request = WeightsRequest(client.worker_id, have_version=client._fetched_version)
        _send(sock, encode(request), client.stats, "weights_request")

    def _request(self, sock, client: WorkerClient, index: int) -> None:
        request = WeightsRequest(client.worker_id, have_version=client._fetched_version,
                                 version=self.header.version, chunk=index)
        _send(sock, encode(request), client.stats, "weights_request")

    def on_message(self, sock, client: WorkerClient, message: Message, now: float) -> None:
        if isinstance(message, WeightsHeader):
            if message.version <= client._fetched_version:
                self.active = False  # nothing newer released to us yet
                return
            if self.buffer is not None:  # a transfer of an older version was under way: its buffer is free
                self.buffers.reuse_later(self.buffer)
                self.buffer = None  # (so that it can be taken right back)
            self.header, self.buffer, self.received = message, self.buffers.take(message.total_bytes), set()
            client.stats["weights/fresh_buffers"] = self.buffers.allocated
            self.last_progress = now
            self.next_chunk = min(client.config.weights_pipeline, message.num_chunks)
            for index in range(self.next_chunk):
                self._request(sock, client, index)
            if message.num_chunks == 0:
                self._finish(client)
        elif isinstance(message, WeightsChunk) and self.header is not None:
            if message.version != self.header.version or message.index in self.received:
                return
            start = message.index * self.header.chunk_bytes
            expected = min(self.header.chunk_bytes, self.header.total_bytes - start)
            if len(message.data) != expected:
                client.stats["rejected/chunk_length"] += 1
                return
            self.buffer[start:start + expected] = np.frombuffer(message.data, np.uint8)
            self.received.add(message.index)
            self.last_progress = now
            if self.next_chunk < self.header.num_chunks:
                self._request(sock, client, self.next_chunk)
                self.next_chunk += 1
            if len(self.received) == self.header.num_chunks:
                self._finish(client)

    def _finish(self, client: WorkerClient) -> None:
        header, buffer = self.header, self.buffer
        self.active, self.header, self.buffer = False, None, None
        try:
            state = unpack_state_dict(header, buffer)
        except ProtocolError as exc:
            client.stats["weights/checksum_failures"] += 1
            log.warning("weights version %d failed verification (%s); fetching again", header.version, exc)
            self.buffers.reuse_later(buffer)
            self.retry = True
            return
        client.stats["weights/versions_received"] += 1
        client._deliver_weights(header.version, state)
        self.buffers.reuse_later(buffer)

    def check_timeout(self, sock, client: WorkerClient, now: float) -> None:
        if self.retry:
            self.retry = False
            self.start(sock, client, now)
        elif self.active and now - self.last_progress > client.config.fetch_timeout_s:
            client.stats["weights/fetch_restarts"] += 1
            self.active = False
            self.start(sock, client, now)
