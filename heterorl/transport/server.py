"""The learner's end of the transport: `LearnerServer` takes in trajectories under credit, keeps the worker
registry (`WorkerInfo`) and publishes weights; its I/O thread owns both of the learner's sockets.

Flow control is by credit: the learner grants each worker a cumulative ``credit_limit`` (trajectories it may have
sent this session), which grows only as the learner's consumer takes that worker's trajectories out of the
buffer. Buffered + in-flight trajectories per worker therefore never exceed ``credits_per_worker``: a slow learner
slows its workers instead of dropping data or growing memory. Credit limits are cumulative, so a lost ack costs
nothing: the next one carries a newer limit.

A group's members are held, on their worker's credit, until the group is complete; only whole groups reach the
learner's queue. Each worker's incomplete groups are bounded (``open_groups_per_worker``, their bytes by
``open_group_bytes_per_worker``) and dropped after ``group_timeout_s``; ids are namespaced by their worker
(`Trajectory.key`), so no peer can make the learner take another worker's ids for duplicates. The registry
forgets a worker silent for ``worker_expiry_s`` (or the one silent longest, when full and a new worker says
hello); the allowed CURVE keys are re-read every ``keys_reload_s``, and a removed key's workers are refused at
once (docs/RELIABILITY.md).

Weights are pulled: a ``weights_notice`` on the control channel (held back per worker by its weights link, in a
`DelayQueue`) says a version is out; the worker asks for the header of the newest version released to it, then
for its chunks. A worker that joins late or misses notices always gets the newest whole version, never a diff.
"""

from __future__ import annotations

import logging
import socket as pysocket
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from heterorl.config import TransportConfig
from heterorl.delay.queue import DelayQueue
from heterorl.errors import ConfigError, HeteroRLError
from heterorl.transport.protocol import (
    BYE_BUSY,
    BYE_LEARNER_STOPPING,
    BYE_REFUSED,
    DEFAULT_LIMITS,
    Ack,
    Bye,
    Heartbeat,
    Hello,
    Limits,
    ProtocolError,
    Ready,
    Trajectory,
    TrajectoryBatch,
    TrajectoryContract,
    WeightsNotice,
    WeightsRequest,
    decode,
    encode,
)
from heterorl.transport.reshard import DestLayout, ReshardError, layout_key
from heterorl.transport.sockets import (
    CurveConfig,
    TransportError,
    _Endpoint,
    _port_of,
    _receive,
    _require_security,
    _send,
    _socket,
    _Wakeup,
)
from heterorl.transport.store import WeightsStore

log = logging.getLogger("heterorl.transport")

GROUP_REJECTED = "group_rejected"  # the reason a member is refused for when another member of its group was refused
_POISONED_GROUPS_KEPT = 64  # per worker: a worker sends a group's members back to back, so a few recent ones suffice
_HOST = pysocket.gethostname()  # a worker whose hello names this host shares the learner's machine
_TOTALS = ("trajectories", "duplicates", "busy_s", "idle_s")  # per-worker counters `fleet_totals` sums


class _RateLimitedLog:
    """Log the first few events of each reason, then every 1,000th (a flood must not flood the log)."""

    def __init__(self, what: str = "rejected message", level: int = logging.WARNING) -> None:
        self.counts: Counter = Counter()
        self.what, self.level = what, level

    def __call__(self, reason: str, message: str) -> None:
        self.counts[reason] += 1
        n = self.counts[reason]
        if n <= 5 or n % 1000 == 0:
            log.log(self.level, "%s (%s, #%d): %s", self.what, reason, n, message)


@dataclass
class _OpenGroup:
    """The members of one of a worker's groups that arrived so far (the group is incomplete)."""

    size: int
    first_s: float  # when its first member arrived (time.monotonic)
    members: list = field(default_factory=list)
    nbytes: int = 0


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
    engine: str = "torch"  # its sampling engine, as its latest hello said
    layout: dict = field(default_factory=dict)  # the slices it wants of a sharded learner's versions ({}: whole)
    layout_key: str = ""  # `reshard.layout_key` of it
    failed: bool = False  # it left with a bye saying it failed (BYE_WORKER_FAILED): it will not come back
    trajectories: int = 0  # accepted from this worker (all sessions)
    duplicates: int = 0
    buffered: int = 0  # accepted, not yet taken by the consumer
    received_session: int = 0  # trajectory messages received since its last hello
    released_version: int = -1  # newest weights version released to it (after the weights delay)
    noticed_version: int = -1  # the newest version whose notice was scheduled: its next costs the steps since
    waiting_version: int = -1  # the newest version published while its bandwidth-limited link was busy
    alive: bool = True
    pending_notices: DelayQueue[int] = field(default_factory=DelayQueue)  # versions, due when their notice arrives
    acks: list = field(default_factory=list)
    rejects: list = field(default_factory=list)
    last_credit_sent: int = -1
    busy_s: float = 0.0  # the worker's cumulative seconds generating (from its heartbeats)
    busy_base: float = 0.0  # busy_s when this session began: its start rate counts the busy seconds since
    idle_s: float = 0.0  # ... and waiting for credit, permits or weights
    groups_session: int = 0  # groups whose first trajectory arrived this session
    reward_outcomes: dict = field(default_factory=dict)  # its process's programs run by outcome (heartbeats)
    outcomes_before: Counter = field(default_factory=Counter)  # ... and its earlier processes' under this id
    last_group_id: str = ""
    starts_granted_session: int = 0  # admission permits granted this session (cumulative)
    starts_reported: int = -1  # permits it has used this session, as its latest heartbeat said (-1: none said)
    last_start_limit_sent: int = -2
    poisoned_groups: OrderedDict = field(default_factory=OrderedDict)  # recent group ids with a rejected member
    open_groups: OrderedDict = field(default_factory=OrderedDict)  # group id → _OpenGroup, oldest first
    open_bytes: int = 0  # the bytes of the members held in open_groups
    rate_tokens: float = 0.0  # transport.max_trajectories_per_s: trajectories it may still send (a token bucket)
    rate_refilled: float = 0.0

    def start_rate(self) -> float | None:
        """Groups this session started per second of generating: the worker's measured speed (None until it
        has generated for half a second)."""
        busy = self.busy_s - self.busy_base
        return self.groups_session / busy if busy > 0.5 and self.groups_session else None

    def credit_limit(self, window: int, rate_room: float = float("inf")) -> int:
        return self.received_session + int(max(0, min(window - self.buffered, rate_room)))


def permit_share(rate: float | None, fleet: tuple[float, int] | None, ahead: int) -> int:
    """The unused admission permits a worker of speed ``rate`` may hold, ``fleet`` being (the live workers'
    summed speeds, their number): ``ahead`` each until every live worker's speed is measured (``fleet`` None);
    then the fleet's ``ahead`` × workers shared in proportion to their speeds (at least 1), so that a slow worker
    starts no more groups than it finishes while a fast one would (and its groups stay as fresh)."""
    if fleet is None or rate is None:
        return ahead
    total, workers = fleet
    return max(1, round(ahead * workers * rate / total))


class LearnerServer(_Endpoint):
    """The learner's end: accepts trajectories, tracks workers, publishes weights. Thread-safe public API."""

    def __init__(self, address: str, config: TransportConfig | None = None, curve: CurveConfig | None = None,
                 limits: Limits = DEFAULT_LIMITS, weights_address: str | None = None,
                 weights_delay: Callable[[str], Any] | None = None,
                 settings: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic,
                 contract: TrajectoryContract | None = None, published_before: int = -1,
                 group_timeout_s: float = 600.0, shard_ranks: int = 1, shard_ports: list[int] | None = None,
                 model_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        """``contract``: what every trajectory must satisfy to be buffered (`set_contract`); None checks only
        that frames are well formed. ``published_before``: the newest version an earlier learner of this run
        published (a resumed learner's, docs/RELIABILITY.md "Crash and resume"): workers may hold it, so the
        contract takes trajectories stamped up to it before this server publishes anything, and `publish` goes
        above it. ``group_timeout_s``: an incomplete group is dropped this long after its first member arrived
        (the learner passes ``buffer.partial_group_timeout_s``). ``weights_delay``: `_schedule_notice`.
        ``shard_ranks`` > 1: a sharded learner whose ranks each send their own slices (heterorl.transport.shards);
        rank r's weights channel is at ``shard_ports[r - 1]`` (the port it bound, on this host), and every worker
        is told so when it joins; a worker may then declare the slices it wants (its hello's ``layout``), checked
        against ``model_shapes``."""
        self.config = config or TransportConfig()
        self.config.validate()
        _require_security(address, curve, self.config, (
            f"refusing plaintext on {address}: give CURVE keys (`heterorl keys`, then --curve-secret/--allow-keys) "
            "or set allow_plaintext=True if this network is trusted"))
        self.limits = limits
        self._contract, self._curve = contract, curve
        self._settings = dict(settings or {})
        self._clock = clock
        self._weights_delay = weights_delay
        self._delay_links: dict[str, Any] = {}  # worker id → its weights link (`_schedule_notice`)
        self._address = address
        self._weights_address = weights_address
        self._lock = threading.Condition()
        self._buffer: deque[Trajectory] = deque()
        self._workers: dict[str, WorkerInfo] = {}
        self._by_routing: dict[bytes, str] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()  # `Trajectory.key`s taken (dedup_window newest)
        self._group_timeout_s = group_timeout_s
        self._held = 0  # members held in the workers' open groups
        self._departed: Counter = Counter()  # `_TOTALS` of the workers removed from the registry
        self._departed_outcomes: Counter = Counter()  # and their `reward_outcomes`
        self._auth: ThreadAuthenticator | None = None
        self._allowed_keys: set[str] | None = None  # z85 public keys allowed in (CURVE only)
        self._keys_signature, self._keys_checked = None, 0.0  # (the allowed keys' files, when last read)
        self.stats: Counter = Counter()
        self._init_weights(published_before, shard_ranks, shard_ports, model_shapes)
        self._admission_cap: int | None = None  # total groups the fleet may start (None: no admission control)
        self._starts_granted_total = 0
        self._starts_refused = 0  # groups started on a permit and refused whole: they widen the admission cap
        self._starts_ahead, self._local_threads = 1, 0  # permits a worker may hold; threads advised (0: none)
        self._reject_log = _RateLimitedLog()
        self._removal_log = _RateLimitedLog("worker removed from the registry", logging.INFO)
        self._stop, self._ready = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self.control_endpoint = self.weights_endpoint = ""
        self._wakeup = _Wakeup()
        self._thread = threading.Thread(target=self._run, name="heterorl-learner-io", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error

    def _init_weights(self, published_before: int, shard_ranks: int, shard_ports: list[int] | None,
                      model_shapes: dict | None) -> None:
        # the versions published (the newest: the contract's version bound; a resumed learner's starts above the
        # newest an earlier learner of this run published), their delta chain
        self.store = WeightsStore(self.config, self.stats, newest=published_before)
        # a sharded learner's packs for workers that declared their own slices, by `reshard.layout_key`
        self.stores: dict[str, WeightsStore] = {"": self.store}
        self._model_shapes = dict(model_shapes) if model_shapes else None  # what a worker's layout must fit
        self._publish_times: dict[int, float] = {}
        if len(shard_ports or []) != shard_ranks - 1:
            raise ValueError(f"a learner of {shard_ranks} ranks that each send their own slices needs the weights "
                             f"ports of ranks 1..{shard_ranks - 1} (shard_ports), not {shard_ports}")
        self.shard_ports = list(shard_ports or [])  # a sharded learner's other ranks' weights ports (told in Ready)

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
                if worker is not None:  # (not one removed from the registry since, whose id came back)
                    worker.buffered = max(0, worker.buffered - count)
        if taken:
            self._wakeup.wake()  # the freed credits go out now, not at the next poll timeout
        return taken

    def buffered(self) -> int:
        """Trajectories accepted and not yet taken: queued, or held until their group is complete."""
        with self._lock:
            return len(self._buffer) + self._held

    @property
    def last_step(self):
        """The newest version's step from the one before it (`EncodedStep`), or None."""
        return self.store.last_step

    @property
    def weights_dtype(self) -> str:
        """The dtype of the published versions' floating-point tensors."""
        return self.store.weights_dtype

    def layouts(self) -> dict[str, dict]:
        """{key: layout} of the live workers that declared their own slices (a sharded learner packs each)."""
        with self._lock:
            return {w.layout_key: w.layout for w in self._workers.values() if w.layout_key and w.alive}

    def publish_layout(self, key: str, version: int, state: dict, dtype: torch.dtype | None = None,
                       describe: Callable | None = None) -> None:
        """A sharded learner's pack of ``version`` for the workers of layout ``key``; publish it before the
        whole-model pack of the same version (`publish`, which notifies every worker)."""
        with self._lock:
            store = self.stores.setdefault(key, WeightsStore(self.config, Counter()))
            spare, previous = store.begin(version)
        packed, step = store.pack(state, version, spare, previous, dtype, describe)
        with self._lock:
            store.add(version, packed, step)

    def publish(self, version: int, state: dict, dtype: torch.dtype | None = None,
                describe: Callable | None = None) -> None:
        """Make ``state`` available as ``version`` (strictly increasing), its floating-point tensors cast to
        ``dtype`` (the workers' inference dtype; None: as they are); workers are notified after their delay.
        The tensors are copied once, into the buffer of a retired version when one is free; with
        ``transport.weights_deltas`` the step from the previous version is encoded here too (`last_step`).
        ``describe(header)``: what a sharded learner's rank 0 adds to the header (`WeightsStore.pack`)."""
        with self._lock:
            spare, previous = self.store.begin(version)
        packed, step = self.store.pack(state, version, spare, previous, dtype, describe)
        with self._lock:
            self.store.add(version, packed, step)
            now = self._clock()
            self._publish_times[version] = now
            for worker in self._workers.values():
                self._schedule_notice(worker, version, now, packed.header.total_bytes)
            self._trim_versions()

    def set_contract(self, contract: TrajectoryContract | None) -> None:
        """From now on, refuse every trajectory that breaks ``contract`` (None: check only the wire format)."""
        with self._lock:
            self._contract = contract

    def set_admission(self, cap: int | None, ahead: int = 1) -> None:
        """Admission control: the fleet may start at most ``cap`` groups in total (None: no limit); each worker
        holds at most ``ahead`` unused permits, so one fast worker cannot take every permit."""
        with self._lock:
            self._admission_cap, self._starts_ahead = cap, max(1, ahead)

    def advise_local_threads(self, threads: int) -> None:
        """Advise the workers on this machine (their hello named its host) to use ``threads`` torch threads, in
        their next acks (`heterorl train` shares one machine's cores: heterorl.runtime.cores)."""
        with self._lock:
            self._local_threads = threads

    def permits_left(self) -> int | None:
        """Groups the fleet may still start under admission control: permits not yet granted plus those its live
        workers hold unused — by their heartbeats' count of permits used, which includes groups still on their
        way (None: no admission control). 0 while the learner waits: the pace holds it back."""
        with self._lock:
            if self._admission_cap is None:
                return None
            pool = self._admission_cap + self._starts_refused - self._starts_granted_total
            held = sum(max(0, w.starts_granted_session - self._permits_used(w)) for w in self._workers.values()
                       if w.alive)
            return max(0, pool) + held

    def _permits_used(self, worker: WorkerInfo) -> int:
        """The admission permits ``worker`` has used this session: its groups arrived, or, as its heartbeats say,
        more (groups still on their way) — believed up to 4 × ``ahead`` beyond those arrived, so a worker that
        claims permits it never uses holds a bounded number of them back from the fleet."""
        reported = min(worker.starts_reported, worker.groups_session + 4 * self._starts_ahead,
                       worker.starts_granted_session)
        return max(worker.groups_session, reported)

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
                                  if k not in ("pending_notices", "acks", "rejects", "poisoned_groups", "open_groups")})
                    for w in self._workers.values()]

    def reward_outcomes(self) -> dict[str, int]:
        """The programs the workers' rewards ran, by outcome (the code task's sandbox: ok, wrong_answer, timeout,
        forbidden:socket, ...), over every worker this server has known, as their latest heartbeats said."""
        with self._lock:
            totals = Counter(self._departed_outcomes)
            for worker in self._workers.values():
                totals.update(worker.outcomes_before)
                totals.update(worker.reward_outcomes)
            return dict(sorted(totals.items()))

    def fleet_totals(self) -> dict[str, float]:
        """Over every worker this server has known, those removed from the registry included: trajectories
        accepted, duplicates, seconds generating (busy_s) and waiting (idle_s)."""
        with self._lock:
            totals = Counter(self._departed)
            for worker in self._workers.values():
                for name in _TOTALS:
                    totals[name] += getattr(worker, name)
            return {name: totals[name] for name in _TOTALS}

    def close(self, reason: str = BYE_LEARNER_STOPPING) -> None:
        """Say bye to every live worker with ``reason`` and stop the I/O thread. `BYE_RUN_FINISHED` ends the
        workers' loops; any other reason (the default) tells them this learner is stopping before the run is
        over, and they keep saying hello until a restarted learner answers."""
        self._bye_reason = reason
        self._stop.set()
        self._wakeup.wake()
        with self._lock:
            self._lock.notify_all()
        self._thread.join(timeout=10)

    # -- I/O thread -----------------------------------------------------------------------------
    def _bind(self, ctx: zmq.Context, address: str, hwm: int) -> tuple[zmq.Socket, str]:
        """A ROUTER bound to ``address`` (port 0: any free one), ROUTER_MANDATORY so that a send to a vanished
        worker is an error we count, not a silent drop; CURVE server when keys are given."""
        sock = _socket(ctx, zmq.ROUTER, hwm, self.config, self.limits)
        try:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if self._curve is not None:
                public, secret = self._curve.keypair()
                sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
            if address.endswith(":0"):
                port = sock.bind_to_random_port(address.rsplit(":", 1)[0])
                address = f"{address.rsplit(':', 1)[0]}:{port}"
            else:
                sock.bind(address)
        except BaseException as exc:
            sock.close(0)  # left open, it would hold up ctx.term() in `_run`, and the constructor with it
            if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EADDRINUSE:
                raise TransportError(f"{address} is in use by another process: choose another port (the weights "
                                     "channel takes the control port + 1) or stop the process that holds it") from None
            raise
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT) or address

    def _open(self, ctx: zmq.Context) -> tuple[ThreadAuthenticator | None, zmq.Socket, zmq.Socket]:
        """Start CURVE authentication (when keys are given) and bind both channels; on failure, undo and raise."""
        auth, sockets = None, []
        try:
            if self._curve is not None:
                allowed = self._curve.allowed_keys_dir
                if not allowed or not Path(allowed).is_dir():
                    raise ConfigError(f"allowed_keys_dir {allowed!r} is not a folder of worker public keys "
                                      "(*.key files made by `heterorl keys`)")
                auth = self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("heterorl.auth"))
                auth.start()
                self._reload_keys()
            # control + trajectories: ROUTER ↔ a DEALER per worker; hello/ready, heartbeats, trajectories up, acks
            # (credit) down. HWM control_hwm messages each way; a worker silent for heartbeat_timeout_s is dead.
            control, self.control_endpoint = self._bind(ctx, self._address, self.config.control_hwm)
            sockets.append(control)
            # weights: ROUTER (PORT+1 unless given) ↔ a DEALER per worker; header and chunk requests up, one reply
            # each down. HWM weights_hwm messages; the worker restarts a fetch after fetch_timeout_s without a chunk.
            weights_address = self._weights_address or (
                f"{self._address.rsplit(':', 1)[0]}:{0 if self._address.endswith(':0') else _port_of(self._address) + 1}")
            weights, self.weights_endpoint = self._bind(ctx, weights_address, self.config.weights_hwm)
            return auth, control, weights
        except BaseException:
            for s in sockets:
                s.close(0)
            if auth is not None:
                auth.stop()
            raise

    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            auth, control, weights = self._open(ctx)
        except BaseException as exc:  # surfaced to the constructor
            self._error = exc if isinstance(exc, HeteroRLError) else TransportError(
                f"cannot bind {self._address}: {exc}")
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(control, weights)
        finally:
            bye = encode(Bye("learner", getattr(self, "_bye_reason", BYE_LEARNER_STOPPING)))
            for worker in list(self._workers.values()):
                if worker.alive:
                    _send(control, [worker.routing_id, *bye], self.stats, "bye")
            control.close(self.config.linger_ms)
            weights.close(self.config.linger_ms)
            if auth is not None:
                auth.stop()
            ctx.term()
            self._wakeup.close()

    def _serve(self, control: zmq.Socket, weights: zmq.Socket) -> None:
        """Until closed: take in what arrives (waking at least every 50 ms), then send acks, credit and notices."""
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        poller.register(weights, zmq.POLLIN)
        poller.register(self._wakeup.read_fd, zmq.POLLIN)
        last_beat = 0.0
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

    def _reject(self, reason: str, message: str, worker: WorkerInfo | None = None, trajectory_id: str = "") -> None:
        self.stats["rejected"] += 1
        self.stats[f"rejected/{reason}"] += 1
        self._reject_log(reason, message)
        if worker is not None and trajectory_id:
            worker.rejects.append(f"{trajectory_id}: {reason}: {message}"[:256])

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
            if user_id is not None and user_id not in self._allowed_keys:
                self._reject("revoked_key", f"{message.kind} from a key no longer in the allowed folder")
                if isinstance(message, Hello):
                    self._refuse(sock, routing_id, "this worker's key was removed from the learner's allowed keys")
                return
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
            if isinstance(message, (TrajectoryBatch, Trajectory)):
                batch = message if isinstance(message, TrajectoryBatch) else TrajectoryBatch([message])
                self._on_batch(worker, batch, time.time())
                self._lock.notify_all()
            elif isinstance(message, Heartbeat):
                if message.sender_id != worker.worker_id:
                    self._reject("forged_id", f"heartbeat names {message.sender_id!r} on {worker.worker_id}'s link")
                    return
                worker.version_held = message.version_held
                if message.busy_s < worker.busy_s:  # a new process under the same id: its clock starts at 0
                    worker.busy_base = 0.0
                worker.busy_s, worker.idle_s = message.busy_s, message.idle_s
                worker.starts_reported = message.groups_started
                self._take_outcomes(worker, message.reward_outcomes)
            elif isinstance(message, Bye):
                worker.alive, worker.failed = False, message.failed
                self._reclaim_starts(worker)
                log.info("worker %s left: %s", worker.worker_id, message.reason)
            else:
                self._reject("unexpected_kind", f"{message.kind} is not sent by workers", worker)

    def _on_hello(self, sock, routing_id: bytes, hello: Hello, user_id: str | None) -> None:
        worker = self._workers.get(hello.worker_id)
        now = time.monotonic()
        if worker is not None and user_id is not None and worker.public_key not in (None, user_id):
            self._reject("forged_id", f"worker id {hello.worker_id!r} belongs to another key")
            self._refuse(sock, routing_id, "worker id taken by another key")
            return
        previous = self._by_routing.get(routing_id)
        if previous is not None and previous != hello.worker_id:  # one connection, one worker
            self._evict(self._workers[previous], f"its connection said hello as {hello.worker_id!r}", "replaced")
        refusal = self._layout_refusal(hello)
        if refusal is not None:
            self._reject("bad_layout", f"hello from {hello.worker_id!r}: {refusal}")
            self._refuse(sock, routing_id, refusal)
            return
        if worker is None and len(self._workers) >= self.config.max_workers and not self._make_room():
            self._reject("registry_full", f"hello from {hello.worker_id!r}: {len(self._workers)} live workers")
            busy = Bye("learner", f"{BYE_BUSY}the learner's registry is full ({len(self._workers)} live workers, "
                       "transport.max_workers); a place frees when a worker has been silent for "
                       f"transport.heartbeat_timeout_s ({self.config.heartbeat_timeout_s:g} s)")
            _send(sock, [routing_id, *encode(busy)], self.stats, "bye")
            return
        if worker is None:
            worker = WorkerInfo(worker_id=hello.worker_id, host=hello.host, pid=hello.pid, routing_id=routing_id,
                                public_key=user_id, joined_at=now, last_seen=now,
                                rate_tokens=self.config.credits_per_worker, rate_refilled=now)
            self._workers[hello.worker_id] = worker
            log.info("worker %s joined from %s (pid %d)", hello.worker_id, hello.host, hello.pid)
        else:
            if worker.routing_id != routing_id:
                self._by_routing.pop(worker.routing_id, None)
                log.info("worker %s rejoined from %s (pid %d)", hello.worker_id, hello.host, hello.pid)
            self._reclaim_starts(worker)  # a new session: permits the old one never used go back to the fleet
            for group_id in list(worker.open_groups):  # its earlier life will not complete them
                self._discard_open(worker, group_id, "group_abandoned", "its worker said hello again")
            worker.routing_id, worker.host, worker.pid = routing_id, hello.host, hello.pid
        self._by_routing[routing_id] = hello.worker_id
        worker.last_seen, worker.alive, worker.version_held = now, True, hello.version_held
        worker.engine, worker.failed = hello.engine, False
        worker.layout, worker.layout_key = hello.layout, layout_key(DestLayout.from_dict(hello.layout))
        worker.received_session = 0
        worker.groups_session = worker.starts_granted_session = 0
        worker.busy_base, worker.starts_reported = worker.busy_s, -1
        worker.last_start_limit_sent = -2
        worker.pending_notices.clear()
        # a (re)joining worker gets the newest version this server holds at once (none before its first publish):
        # its link's next transfer is the steps from there
        worker.released_version = max(self.store.versions, default=-1)
        worker.noticed_version, worker.waiting_version = worker.released_version, -1
        worker.last_credit_sent = self._credit_limit(worker, now)
        ready = Ready(worker_id=hello.worker_id, credits=worker.last_credit_sent,
                      newest_version=worker.released_version,
                      heartbeat_interval_s=self.config.heartbeat_interval_s,
                      settings={**self._settings, "weights_port": _port_of(self.weights_endpoint),
                                "start_limit": -1 if self._admission_cap is None else 0,
                                **({"shard_ports": ",".join(map(str, self.shard_ports))} if self.shard_ports else {})})
        _send(sock, [routing_id, *encode(ready)], self.stats, "ready")

    def _layout_refusal(self, hello: Hello) -> str | None:
        """Why the slices ``hello`` asks for cannot be sent (None: they can, or it asks for the whole model)."""
        if not hello.layout:
            return None
        if not self.shard_ports or self._model_shapes is None:
            return "the learner is not sharded: it sends whole versions only (declare no layout)"
        try:
            DestLayout.from_dict(hello.layout).validate(self._model_shapes)
        except ReshardError as exc:
            return f"its layout does not fit the model: {exc}"
        return None

    def _refuse(self, sock: zmq.Socket, routing_id: bytes, why: str) -> None:
        """Tell a peer it may not join (`BYE_REFUSED`): a rollout worker stops with ``why``."""
        _send(sock, [routing_id, *encode(Bye("learner", f"{BYE_REFUSED}{why}"))], self.stats, "bye")

    def _make_room(self) -> bool:
        """Registry full: remove the worker silent longest among those taken for dead; False when all live."""
        dead = [w for w in self._workers.values() if not w.alive]
        if not dead:
            return False
        oldest = min(dead, key=lambda w: w.last_seen)
        self._evict(oldest, f"the registry is full and it has been silent for "
                            f"{time.monotonic() - oldest.last_seen:.0f} s", "made_room")
        return True

    def _evict(self, worker: WorkerInfo, why: str, reason: str) -> None:
        """Remove ``worker`` from the registry: its incomplete groups are dropped, its unused permits go back
        to the fleet, its counters into `fleet_totals`; its id is free again (and no longer bound to its key)."""
        for group_id in list(worker.open_groups):
            self._discard_open(worker, group_id, "worker_removed", why)
        self._reclaim_starts(worker)
        for name in _TOTALS:
            self._departed[name] += getattr(worker, name)
        self._departed_outcomes.update(worker.outcomes_before)
        self._departed_outcomes.update(worker.reward_outcomes)
        del self._workers[worker.worker_id]
        if self._by_routing.get(worker.routing_id) == worker.worker_id:
            del self._by_routing[worker.routing_id]
        self._delay_links.pop(worker.worker_id, None)
        self.stats["workers_removed"] += 1
        self.stats[f"workers_removed/{reason}"] += 1
        self._removal_log(reason, f"{worker.worker_id}: {why}")

    def _credit_limit(self, worker: WorkerInfo, now: float) -> int:
        """The worker's cumulative credit: room in its window, and in its rate bucket when rates are limited."""
        window = self.config.credits_per_worker
        if not self.config.max_trajectories_per_s:
            return worker.credit_limit(window)
        return worker.credit_limit(window, self._rate_room(worker, now))

    def _rate_room(self, worker: WorkerInfo, now: float) -> float:
        """Trajectories ``worker`` may send now under ``max_trajectories_per_s`` (a bucket of
        ``credits_per_worker``, refilled at that rate)."""
        worker.rate_tokens = min(float(self.config.credits_per_worker), worker.rate_tokens
                                 + self.config.max_trajectories_per_s * max(0.0, now - worker.rate_refilled))
        worker.rate_refilled = now
        return worker.rate_tokens

    def _on_batch(self, worker: WorkerInfo, batch: TrajectoryBatch, received_at: float) -> None:
        """Take in a batch: its checks in bulk when every member is new, within credit (and rate), the worker's
        own and within the contract, else one by one (which names each refusal)."""
        trajectories = batch.trajectories
        keys = [traj.key for traj in trajectories]
        breaches = self._breaches(worker, batch)
        if (breaches or worker.buffered + len(keys) > self.config.credits_per_worker
                or not self._seen.keys().isdisjoint(keys) or len(set(keys)) != len(keys)
                or any(traj.sampler_id != worker.worker_id for traj in trajectories)
                or (self.config.max_trajectories_per_s and self._rate_room(worker, time.monotonic()) < len(keys))):
            for index, traj in enumerate(trajectories):
                self._on_trajectory(worker, traj, received_at, breaches.get(index))
            return
        worker.received_session += len(keys)
        for traj, key in zip(trajectories, keys):
            traj.received_at = received_at
            self._take(worker, traj, key)

    def _breaches(self, worker: WorkerInfo, batch: TrajectoryBatch) -> dict[int, tuple[str, str]]:
        """{index: (reason, message)} of the members of ``batch`` to refuse: those that break the contract, and
        every member of a group one of whose members was refused (such a group can never be trained whole, so
        its other members must not wait in the buffer for it). {} in the common case, at the cost of a few
        comparisons."""
        found = {}
        if self._contract is not None:
            found = {b.index: (b.reason, b.message) for b in self._contract.breaches(batch, self.store.newest)}
        if not found and not worker.poisoned_groups:
            return found
        poisoned = worker.poisoned_groups
        for index in found:
            poisoned[batch.trajectories[index].group_id] = None
        for index, traj in enumerate(batch.trajectories):
            if index not in found and traj.group_id in poisoned:
                found[index] = (GROUP_REJECTED, f"group {traj.group_id} has a member that was rejected")
        while len(poisoned) > _POISONED_GROUPS_KEPT:
            poisoned.popitem(last=False)
        return found

    def _count_group(self, worker: WorkerInfo, group_id: str) -> None:
        """A worker sends each group's members back to back: a new group id is a new start (a re-sent duplicate
        is none, so callers count only new trajectories)."""
        worker.groups_session += 1
        worker.last_group_id = group_id
        if self._admission_cap is not None and worker.groups_session > worker.starts_granted_session:
            # started on a permit reclaimed since (the worker was thought dead): it counts all the same
            worker.starts_granted_session += 1
            self._starts_granted_total += 1

    def _on_trajectory(self, worker: WorkerInfo, traj: Trajectory, received_at: float,
                       breach: tuple[str, str] | None = None) -> None:
        """Take in one trajectory, or refuse it: forged, beyond credit or rate, or ``breach`` = (reason, message)
        of the contract it breaks. A duplicate is acknowledged again and taken once."""
        worker.received_session += 1
        if traj.sampler_id != worker.worker_id:
            self._reject("forged_id", f"trajectory names sampler {traj.sampler_id!r} on {worker.worker_id}'s link",
                         worker, traj.trajectory_id)
            return
        key = traj.key
        if key in self._seen:
            worker.duplicates += 1
            self.stats["duplicates"] += 1
            worker.acks.append(traj.trajectory_id)  # delivered once already: acknowledge, do not take again
            return
        if breach is not None:
            reason, message = breach
            self._refuse_member(worker, traj, reason, f"{message} (from {worker.worker_id})")
            return
        if worker.buffered >= self.config.credits_per_worker:
            self._reject("no_credit", f"{worker.worker_id} sent beyond its credit", worker, traj.trajectory_id)
            return
        if self.config.max_trajectories_per_s and self._rate_room(worker, time.monotonic()) < 1:
            self._reject("rate_limited", f"{worker.worker_id} sent beyond transport.max_trajectories_per_s "
                         f"({self.config.max_trajectories_per_s:g})", worker, traj.trajectory_id)
            return
        traj.received_at = received_at
        self._take(worker, traj, key)

    def _take(self, worker: WorkerInfo, traj: Trajectory, key: str) -> None:
        """Accept ``traj`` (new, within credit and the contract): hold it with the members of its group that
        arrived before it, and queue the group for the learner when it is complete; or refuse it, with its
        group, when it would take its worker past its bounds on incomplete groups."""
        groups, config = worker.open_groups, self.config
        group = groups.get(traj.group_id)
        nbytes = traj.nbytes
        if traj.group_size > 1 and (group is None or group.size != traj.group_size
                                    or worker.open_bytes + nbytes > config.open_group_bytes_per_worker):
            refusal = self._open_group_refusal(worker, traj, group, nbytes)
            if refusal is not None:
                self._refuse_member(worker, traj, *refusal)
                return
        if traj.group_id != worker.last_group_id:
            self._count_group(worker, traj.group_id)
        self._seen[key] = None
        if len(self._seen) > config.dedup_window:
            self._seen.popitem(last=False)
        worker.buffered += 1
        worker.trajectories += 1
        worker.acks.append(traj.trajectory_id)
        self.stats["accepted"] += 1
        if config.max_trajectories_per_s:
            worker.rate_tokens -= 1
        if traj.group_size == 1:
            self._buffer.append(traj)
            return
        if group is None:
            group = groups[traj.group_id] = _OpenGroup(traj.group_size, time.monotonic())
        group.members.append(traj)
        group.nbytes += nbytes
        worker.open_bytes += nbytes
        self._held += 1
        if len(group.members) == group.size:
            del groups[traj.group_id]
            worker.open_bytes -= group.nbytes
            self._held -= group.size
            self._buffer.extend(group.members)

    def _open_group_refusal(self, worker: WorkerInfo, traj: Trajectory, group: _OpenGroup | None,
                            nbytes: int) -> tuple[str, str] | None:
        """(reason, message) when holding ``traj`` would break a bound on ``worker``'s incomplete groups."""
        config = self.config
        if worker.poisoned_groups and traj.group_id in worker.poisoned_groups:
            return GROUP_REJECTED, f"group {traj.group_id} has a member that was rejected"
        if group is None and len(worker.open_groups) >= config.open_groups_per_worker:
            return "open_groups_bound", (
                f"{worker.worker_id} already has {len(worker.open_groups)} incomplete groups at the learner "
                f"(transport.open_groups_per_worker); send each group's members together")
        if group is not None and group.size != traj.group_size:
            return "group_inconsistent", (f"group {traj.group_id} has group_size {group.size}, this member "
                                          f"{traj.group_size}")
        if worker.open_bytes + nbytes > config.open_group_bytes_per_worker:
            return "open_bytes_bound", (
                f"{worker.worker_id}'s incomplete groups would hold {worker.open_bytes + nbytes} bytes > "
                f"{config.open_group_bytes_per_worker} (transport.open_group_bytes_per_worker)")
        return None

    def _refuse_member(self, worker: WorkerInfo, traj: Trajectory, reason: str, message: str) -> None:
        """Refuse ``traj`` and, with it, its group: the members held so far are dropped, later ones refused
        (`GROUP_REJECTED`). A refused group still counts as a group its worker started (an admission permit),
        and widens the fleet's admission cap by one, as it will never be trained."""
        poisoned = worker.poisoned_groups
        poisoned[traj.group_id] = None
        while len(poisoned) > _POISONED_GROUPS_KEPT:
            poisoned.popitem(last=False)
        if traj.group_id in worker.open_groups:
            self._discard_open(worker, traj.group_id, GROUP_REJECTED, f"its member {traj.trajectory_id} was refused")
        elif traj.group_id != worker.last_group_id:
            self._count_group(worker, traj.group_id)
            self._starts_refused += 1
        self._reject(reason, message, worker, traj.trajectory_id)

    def _discard_open(self, worker: WorkerInfo, group_id: str, reason: str, why: str) -> None:
        """Drop ``worker``'s incomplete group ``group_id``: its members free their credit and are never trained
        (counted in ``stats["dropped_groups/<reason>"]`` and told to the worker)."""
        group = worker.open_groups.pop(group_id)
        worker.open_bytes -= group.nbytes
        self._held -= len(group.members)
        worker.buffered = max(0, worker.buffered - len(group.members))
        self._starts_refused += 1  # started (and counted), never trained: the admission cap widens
        self.stats["dropped_groups"] += 1
        self.stats[f"dropped_groups/{reason}"] += 1
        self.stats["dropped_trajectories"] += len(group.members)
        worker.rejects.append(f"{group_id}: {reason}: {len(group.members)} of its {group.size} members dropped "
                              f"unused: {why}"[:256])

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
            if worker is None or (user_id is not None and (worker.public_key not in (None, user_id)
                                                           or user_id not in self._allowed_keys)):
                self._reject("unknown_peer", f"weights request for unknown worker {request.worker_id!r}")
                return
            store = self.stores.get(worker.layout_key)
            released = store.versions.get(worker.released_version) if store is not None else None
            if released is None:
                return  # nothing released yet (the worker asks again on the next notice)
            frames, carried = store.reply(request, released)
        if _send(sock, [routing_id, *frames], self.stats, "weights_chunk" if carried else "weights_header"):
            self.stats["weights/bytes_sent"] += carried

    def _schedule_notice(self, worker: WorkerInfo, version: int, now: float, size: int) -> None:
        """Hold back the notice of ``version`` (``size`` bytes whole) by the worker's weights link: a
        `DelaySchedule`, or an object with one as ``schedule`` (a `heterorl.delay.DelayLink`). What the link
        carries is the steps since the version noticed before, where those are kept, else the whole version. A
        link that says when it is ``free_at`` (a bandwidth limit) sends one version at a time: one published
        while it transmits waits (`_send_waiting`), replacing any older one waiting, as a worker fetches only
        the newest version released to it."""
        if worker.worker_id not in self._delay_links:
            self._delay_links[worker.worker_id] = self._weights_delay(worker.worker_id) if self._weights_delay else None
        link = self._delay_links[worker.worker_id]
        if link is None:
            worker.noticed_version = version
            worker.pending_notices.put(now, version)
            return
        free_at = getattr(link, "free_at", None)
        if free_at is not None and now < free_at:
            self.stats["weights/link_skipped"] += worker.waiting_version >= 0  # an older one waited: never sent
            worker.waiting_version = version
            return
        steps = (self.store.chain.bytes_between(worker.noticed_version, version) if self.config.weights_deltas
                 else None)
        carried = size if steps is None else steps
        self.stats["weights/link_transfers"] += 1
        self.stats["weights/link_bytes"] += carried
        due = getattr(link, "schedule", link)(now, carried)
        if due is None:
            self.stats["weights/notices_lost"] += 1
            return
        worker.noticed_version = version
        worker.pending_notices.put(due, version)

    def _send_waiting(self, worker: WorkerInfo, clock_now: float) -> None:
        """Once the worker's link has finished transmitting, send the version that waited for it then."""
        link = self._delay_links.get(worker.worker_id)
        free_at = getattr(link, "free_at", None)
        if worker.waiting_version < 0 or free_at is None or clock_now < free_at:
            return
        version, worker.waiting_version = worker.waiting_version, -1
        packed = self.store.versions.get(version) or self.store.versions[self.store.newest]
        self._schedule_notice(worker, packed.header.version, free_at, packed.header.total_bytes)

    def needed_versions(self) -> set[int]:
        """The versions a worker may still be given: released to it, or noticed and due, or waiting for its
        link (a sharded learner's other ranks keep their slices of these)."""
        with self._lock:
            return self._needed()

    def _needed(self) -> set[int]:
        needed = {w.released_version for w in self._workers.values()}
        needed |= {v for w in self._workers.values() for v in w.pending_notices}
        return needed | {w.waiting_version for w in self._workers.values()}

    def _trim_versions(self) -> None:
        needed = self._needed()
        for key, store in self.stores.items():
            for version in store.trim(needed):
                if not key:
                    self._publish_times.pop(version, None)
        kept = {w.layout_key for w in self._workers.values()}
        for key in [key for key in self.stores if key not in kept and key]:
            del self.stores[key]  # no worker of that layout is left: its packs (its newest one too) go

    @staticmethod
    def _take_outcomes(worker: WorkerInfo, outcomes: dict[str, int]) -> None:
        """A heartbeat's counts, cumulative over the worker's process: lower ones come from a new process under the
        same id, so the previous process's counts are kept aside."""
        if any(outcomes.get(name, 0) < count for name, count in worker.reward_outcomes.items()):
            worker.outcomes_before.update(worker.reward_outcomes)
        worker.reward_outcomes = outcomes

    def _reclaim_starts(self, worker: WorkerInfo) -> None:
        """Return a dead or rejoining worker's unused admission permits to the fleet, so permits held by a
        worker that never comes back cannot stall the learner."""
        unused = worker.starts_granted_session - worker.groups_session
        if unused > 0:
            self._starts_granted_total -= unused
            worker.starts_granted_session = worker.groups_session

    def _fleet_rate(self) -> tuple[float, int] | None:
        """The live workers' summed `WorkerInfo.start_rate` and their number; None while one of them is
        unmeasured (or only one is alive: nothing to share)."""
        rates = [w.start_rate() for w in self._workers.values() if w.alive]
        return None if len(rates) < 2 or None in rates else (sum(rates), len(rates))

    def _ahead_of(self, worker: WorkerInfo, fleet_rate: tuple[float, int] | None) -> int:
        return permit_share(worker.start_rate(), fleet_rate, self._starts_ahead)

    def _grant_starts(self, worker: WorkerInfo, fleet_rate: tuple[float, int] | None = None) -> int:
        """The worker's cumulative start limit this session: −1 without admission control; else top its unused
        permits up to its share (`_ahead_of`) while the fleet's total stays within the cap."""
        if self._admission_cap is None:
            return -1
        # groups started on their way count as used (by its heartbeats), so a link's latency does not cap its rate
        unused = worker.starts_granted_session - self._permits_used(worker)
        grant = min(self._ahead_of(worker, fleet_rate) - unused,
                    self._admission_cap + self._starts_refused - self._starts_granted_total)
        if grant > 0:
            worker.starts_granted_session += grant
            self._starts_granted_total += grant
        return worker.starts_granted_session

    def _release_notices(self, worker: WorkerInfo, clock_now: float) -> bool:
        """Release the versions whose notices are due; True when the worker's released version moved."""
        self._send_waiting(worker, clock_now)
        released = False
        for _, _, version in worker.pending_notices.pop_due(clock_now):
            if version in self.store.versions:
                worker.released_version = max(worker.released_version, version)
                released = True
            else:  # dropped from retention: the next retained version stands in
                newer = [v for v in self.store.versions if v > version]
                if newer:
                    worker.released_version = max(worker.released_version, newer[0])
                    released = True
        return released

    def _housekeeping(self, sock: zmq.Socket, now: float, beat: bool) -> None:
        clock_now = self._clock()
        outgoing = []
        with self._lock:
            if self._auth is not None and now - self._keys_checked >= self.config.keys_reload_s:
                self._keys_checked = now
                if self._reload_keys():
                    self._revoke(sock)
            fleet_rate = self._fleet_rate() if self._admission_cap is not None else None
            for worker in list(self._workers.values()):
                if not self._check_alive(worker, now):
                    continue
                released = self._release_notices(worker, clock_now)
                if not worker.alive:
                    continue
                if released:
                    outgoing.append((worker.routing_id, WeightsNotice(worker.released_version)))
                limit = self._credit_limit(worker, now)
                start_limit = self._grant_starts(worker, fleet_rate)
                if (worker.acks or worker.rejects or limit != worker.last_credit_sent
                        or start_limit != worker.last_start_limit_sent or beat):
                    threads = self._local_threads if worker.host == _HOST else 0
                    outgoing.append((worker.routing_id, Ack(worker.acks, worker.rejects, limit, start_limit,
                                                            threads)))
                    worker.acks, worker.rejects, worker.last_credit_sent = [], [], limit
                    worker.last_start_limit_sent = start_limit
            if any(isinstance(m, WeightsNotice) for _, m in outgoing):
                self._trim_versions()  # released notices may free versions no worker can still be given
        for routing_id, message in outgoing:
            _send(sock, [routing_id, *encode(message)], self.stats, message.kind)

    def _check_alive(self, worker: WorkerInfo, now: float) -> bool:
        """Time out what ``worker`` holds: itself (dead after ``heartbeat_timeout_s`` of silence, removed from
        the registry after ``worker_expiry_s``) and its incomplete groups (after ``group_timeout_s``). False
        when it was removed."""
        silent = now - worker.last_seen
        if worker.alive and silent > self.config.heartbeat_timeout_s:
            worker.alive = False
            self._reclaim_starts(worker)
            log.warning("worker %s silent for %.1f s: marked dead", worker.worker_id, silent)
        if not worker.alive and silent > self.config.worker_expiry_s:
            self._evict(worker, f"silent for {silent:.0f} s (transport.worker_expiry_s)", "expired")
            return False
        groups = worker.open_groups
        while groups:
            group_id, group = next(iter(groups.items()))
            if now - group.first_s <= self._group_timeout_s:
                break
            self._discard_open(worker, group_id, "group_expired", f"incomplete after {self._group_timeout_s:g} s "
                               "(buffer.partial_group_timeout_s)")
        return True

    def _reload_keys(self) -> bool:
        """(Re)read the allowed-keys folder when its *.key files changed: the authenticator then refuses new
        connections by a removed key, and `_allowed_keys` the live ones (`_revoke`). A folder that cannot be
        read leaves the keys read last in force (the authenticator logs why). True when the keys changed."""
        folder = Path(self._curve.allowed_keys_dir)
        try:
            signature = sorted((path.name, path.stat().st_mtime_ns, path.stat().st_size)
                               for path in folder.glob("*.key"))
        except OSError:
            signature = None
        if signature == self._keys_signature and self._allowed_keys is not None:
            return False
        self._keys_signature = signature
        self._auth.configure_curve(domain="*", location=str(folder))
        keys = {key.decode("ascii") for key in self._auth.certs.get("*", {})}
        changed = keys != self._allowed_keys
        self._allowed_keys = keys
        return changed

    def _revoke(self, sock: zmq.Socket) -> None:
        """Refuse, and remove from the registry, every worker whose key is no longer allowed."""
        for worker in [w for w in self._workers.values() if w.public_key not in self._allowed_keys]:
            self.stats["revoked"] += 1
            if worker.alive:
                self._refuse(sock, worker.routing_id, "this worker's key was removed from the learner's allowed keys")
            self._evict(worker, "its key was removed from the allowed keys", "revoked")
