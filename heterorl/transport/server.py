"""The learner's end of the transport: `LearnerServer`, a thin I/O loop and thread-safe facade over four rooms,
each in its own module:

- `registry` (`WorkerRegistry`, `WorkerInfo`): who is connected, alive, allowed (CURVE keys, revocation);
- `intake` (`Intake`): trajectories in under credit, checked, assembled into whole groups (`groups`:
  `GroupAssembler`) and queued for the learner's consumer (`get_groups`, `get`);
- `admission` (`Admission`): how many groups the fleet may start, each worker's share of the permits;
- `release` (`WeightsRelease`): the versions published, each worker's notices after its weights link's delay,
  the answers to weights requests;

and `membership` (`Membership`), a worker joining, timing out and leaving, which touches all four.

Dependencies point one way: this module → `membership` → `intake` → `admission` → `registry`, and `membership`
→ `release` → `registry`; `intake` also uses `groups`, and `registry` none of the others. The I/O thread owns
both sockets and sends everything (the rooms return what is to be sent); one lock, a `threading.Condition`,
guards every room, and the public methods take it. Channels, credit, bounds and refusals: docs/TRANSPORT.md and
docs/RELIABILITY.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from heterorl.config import TransportConfig
from heterorl.errors import ConfigError, HeteroRLError
from heterorl.transport.admission import Admission
from heterorl.transport.intake import Intake
from heterorl.transport.membership import REVOKED, Membership, refusal
from heterorl.transport.protocol import (
    BYE_LEARNER_STOPPING,
    DEFAULT_LIMITS,
    Ack,
    Bye,
    Heartbeat,
    Hello,
    Limits,
    Message,
    ProtocolError,
    Trajectory,
    TrajectoryBatch,
    TrajectoryContract,
    WeightsNotice,
    WeightsRequest,
    decode,
    encode,
)
from heterorl.transport.registry import Rejections, WorkerInfo, WorkerRegistry
from heterorl.transport.sockets import (
    CurveConfig,
    Endpoint,
    TransportError,
    Wakeup,
    make_socket,
    port_of,
    receive_waiting,
    require_security,
    send_frames,
)
from heterorl.transport.throttle import PeerThrottle, Verdict
from heterorl.transport.weights.release import WeightsRelease
from heterorl.transport.weights.store import WeightsStore

log = logging.getLogger("heterorl.transport")


def bind_router(ctx: zmq.Context, address: str, hwm: int, config: TransportConfig, limits: Limits,
                curve: CurveConfig | None) -> tuple[zmq.Socket, str]:
    """A ROUTER bound to ``address`` (port 0: any free one), ROUTER_MANDATORY so that a send to a vanished
    worker is an error we count, not a silent drop; CURVE server when keys are given. Returns it and the
    endpoint it bound."""
    sock = make_socket(ctx, zmq.ROUTER, hwm, config, limits)
    try:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if curve is not None:
            public, secret = curve.keypair()
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


class LearnerServer(Endpoint):
    """The learner's end: accepts trajectories, tracks workers, publishes weights. Thread-safe public API."""

    def __init__(self, address: str, config: TransportConfig | None = None, curve: CurveConfig | None = None,
                 limits: Limits = DEFAULT_LIMITS, weights_address: str | None = None,
                 weights_delay: Callable[[str], Any] | None = None,
                 settings: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic,
                 contract: TrajectoryContract | None = None, published_before: int = -1,
                 shard_ranks: int = 1, shard_ports: list[int] | None = None,
                 model_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        """``contract``: what every trajectory must satisfy to be buffered (`set_contract`); None checks only
        that frames are well formed. ``published_before``: the newest version an earlier learner of this run
        published (a resumed learner's, docs/RELIABILITY.md "Crash and resume"): workers may hold it, so the
        contract takes trajectories stamped up to it before this server publishes anything, and `publish` goes
        above it. An incomplete group is dropped ``config.group_timeout_s`` after its first member arrived.
        ``weights_delay``: `WeightsRelease.schedule_notice`; ``clock``: the delays' clock.
        ``shard_ranks`` > 1: a sharded learner whose ranks each send their own slices
        (heterorl.transport.weights.shards); rank r's weights channel is at ``shard_ports[r - 1]`` (the port it
        bound, on this host), and every worker is told so when it joins; a worker may then declare the slices it
        wants (its hello's ``layout``), checked against ``model_shapes``."""
        self.config = config or TransportConfig()
        self.config.validate()
        require_security(address, curve, self.config, (
            f"refusing plaintext on {address}: give CURVE keys (`heterorl keys`, then --curve-secret/--allow-keys) "
            "or set allow_plaintext=True if this network is trusted"))
        self.limits = limits
        self._curve = curve
        self._settings = dict(settings or {})
        self._clock = clock
        self._address = address
        self._weights_address = weights_address
        self._lock = threading.Condition()  # guards every room below
        self.stats: Counter = Counter()
        self._reject = Rejections(self.stats)
        self._registry = WorkerRegistry(self.config, self.stats, curve.allowed_keys_dir if curve else None)
        self._admission = Admission(self._registry, self.config, self.stats)
        self._intake = Intake(self.config, self.stats, self._registry, self._admission, self._reject, contract)
        self._release = WeightsRelease(self.config, self.stats, self._registry, published_before, weights_delay,
                                      shard_ranks, shard_ports, model_shapes)
        self._throttle = PeerThrottle(self.config.max_refusals_per_s, self.config.throttle_s,
                                      self.config.throttles_before_disconnect)
        self._membership = Membership(self.config, self._registry, self._intake, self._admission, self._release,
                                     self._reject, self._throttle)
        self._stop, self._ready = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self.control_endpoint = self.weights_endpoint = ""
        self._wakeup = Wakeup()
        self._thread = threading.Thread(target=self._run, name="heterorl-learner-io", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error

    # -- public API (any thread) ------------------------------------------------------------------
    def get_groups(self, max_items: int, timeout_s: float) -> list[list[Trajectory]]:
        """Whole groups in the order they completed, of up to ``max_items`` trajectories in all (the first one
        even if larger); waits up to ``timeout_s`` for the first one. Taking them frees their senders' credit."""
        return self._wait_for(lambda: self._intake.pop_groups(max_items), timeout_s)

    def get(self, max_items: int, timeout_s: float) -> list[Trajectory]:
        """Up to ``max_items`` trajectories, in the order their groups completed (a group's members together; one
        cut at ``max_items`` comes first in the next call); waits up to ``timeout_s`` for the first one."""
        return self._wait_for(lambda: self._intake.pop(max_items), timeout_s)

    def _wait_for(self, pop: Callable[[], list], timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self._intake.queued:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return []
                self._lock.wait(left)
            taken = pop()
        if taken:
            self._wakeup.wake()  # the freed credits go out now, not at the next poll timeout
        return taken

    def buffered(self) -> int:
        """Trajectories accepted and not yet taken: queued, or held until their group is complete."""
        with self._lock:
            return self._intake.held

    @property
    def store(self) -> WeightsStore:
        """The whole-model versions published (`WeightsStore`)."""
        return self._release.store

    @property
    def stores(self) -> dict[str, WeightsStore]:
        """By layout key: a sharded learner's packs for workers that declared their own slices ("": `store`)."""
        return self._release.stores

    @property
    def shard_ports(self) -> list[int]:
        """A sharded learner's other ranks' weights ports (told to workers in ``ready``)."""
        return self._release.shard_ports

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
            return self._release.layouts()

    def publish_layout(self, key: str, version: int, state: dict, dtype: torch.dtype | None = None,
                       describe: Callable | None = None) -> None:
        """A sharded learner's pack of ``version`` for the workers of layout ``key``; publish it before the
        whole-model pack of the same version (`publish`, which notifies every worker)."""
        with self._lock:
            store = self._release.layout_store(key)
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
            self._release.add(version, packed, step, self._clock())

    def needed_versions(self) -> set[int]:
        """The versions a worker may still be given: released to it, or noticed and due, or waiting for its
        link (a sharded learner's other ranks keep their slices of these)."""
        with self._lock:
            return self._release.needed()

    def set_contract(self, contract: TrajectoryContract | None) -> None:
        """From now on, refuse every trajectory that breaks ``contract`` (None: check only the wire format)."""
        with self._lock:
            self._intake.contract = contract

    def set_admission(self, cap: int | None, ahead: int = 1, max_lag: int | None = None) -> None:
        """Admission control (`Admission`): at most ``cap`` groups started in all (None: no limit), ``ahead``
        unused permits per worker, none while its weights lag by more than ``max_lag`` versions (None: any)."""
        with self._lock:
            self._admission.set(cap, ahead, max_lag)

    def advise_local_threads(self, threads: int) -> None:
        """Advise the workers on this machine (their hello named its host) to use ``threads`` torch threads, in
        their next acks (`heterorl train` shares one machine's cores: heterorl.runtime.cores)."""
        with self._lock:
            self._admission.local_threads = threads

    def permits_left(self) -> int | None:
        """Groups the fleet may still start under admission control: permits not yet granted plus those its live
        workers hold unused — by their heartbeats' count of permits used, which includes groups still on their
        way (None: no admission control). 0 while the learner waits: the pace holds it back."""
        with self._lock:
            return self._admission.permits_left(time.monotonic())

    def admission_state(self) -> str:
        """One line on the admission permits (for a learner that waits long for data)."""
        with self._lock:
            return self._admission.state_line(time.monotonic())

    def workers(self) -> list[WorkerInfo]:
        """A snapshot of the worker registry."""
        with self._lock:
            return self._registry.snapshot(self._intake.groups.open_bytes)

    def reward_outcomes(self) -> dict[str, int]:
        """The programs the workers' rewards ran, by outcome (the code task's sandbox: ok, wrong_answer, timeout,
        forbidden:socket, ...), over every worker this server has known, as their latest heartbeats said."""
        with self._lock:
            return self._registry.reward_outcomes()

    def fleet_totals(self) -> dict[str, float]:
        """Over every worker this server has known, those removed from the registry included: trajectories
        accepted, duplicates, seconds generating (busy_s) and waiting (idle_s)."""
        with self._lock:
            return self._registry.fleet_totals()

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
    def _open(self, ctx: zmq.Context) -> tuple[ThreadAuthenticator | None, zmq.Socket, zmq.Socket]:
        """Start CURVE authentication (when keys are given) and bind both channels; on failure, undo and raise."""
        auth, sockets = None, []
        try:
            if self._curve is not None:
                allowed = self._curve.allowed_keys_dir
                if not allowed or not Path(allowed).is_dir():
                    raise ConfigError(f"allowed_keys_dir {allowed!r} is not a folder of worker public keys "
                                      "(*.key files made by `heterorl keys`)")
                auth = self._registry.auth = ThreadAuthenticator(ctx, log=logging.getLogger("heterorl.auth"))
                auth.start()
                self._registry.reload_keys()
            # control + trajectories: ROUTER ↔ a DEALER per worker; hello/ready, heartbeats, trajectories up, acks
            # (credit) down. HWM control_hwm messages each way; a worker silent for heartbeat_timeout_s is dead.
            control, self.control_endpoint = bind_router(ctx, self._address, self.config.control_hwm, self.config,
                                                         self.limits, self._curve)
            sockets.append(control)
            # weights: ROUTER (PORT+1 unless given) ↔ a DEALER per worker; header and chunk requests up, one reply
            # each down. HWM weights_hwm messages; the worker restarts a fetch after fetch_timeout_s without a chunk.
            host = self._address.rsplit(":", 1)[0]
            weights_address = self._weights_address or (
                f"{host}:{0 if self._address.endswith(':0') else port_of(self._address) + 1}")
            weights, self.weights_endpoint = bind_router(ctx, weights_address, self.config.weights_hwm, self.config,
                                                         self.limits, self._curve)
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
            for worker in list(self._registry.workers.values()):
                if worker.alive:
                    send_frames(control, [worker.routing_id, *bye], self.stats, "bye")
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
                receive_waiting(control, self._on_control)
            if weights in events:
                receive_waiting(weights, self._on_weights)
            now = time.monotonic()
            beat = now - last_beat >= self.config.heartbeat_interval_s
            if beat:
                last_beat = now
            self._housekeeping(control, now, beat)

    def _on_control(self, sock: zmq.Socket, frames: list) -> None:
        """A control message: discarded unread while its connection is throttled; else handled, and its refusals
        counted against its connection (`PeerThrottle`), which may throttle it (`Membership.throttled`)."""
        routing_id, now = frames[0].bytes, time.monotonic()
        self.stats["received"] += 1
        if self._throttle.discards(routing_id, now):
            self.stats["throttled/discarded"] += 1
            return
        refused = self.stats["rejected"]
        try:
            self._handle_control(sock, routing_id, frames)
        finally:
            verdict = self._throttle.count(routing_id, self.stats["rejected"] - refused, now)
            if verdict is not Verdict.OK:
                self.stats[f"throttled/{verdict.value}"] += 1
                with self._lock:
                    bye = self._membership.throttled(routing_id, verdict, now)
                if bye is not None:
                    self._send(sock, routing_id, bye)

    def _handle_control(self, sock: zmq.Socket, routing_id: bytes, frames: list) -> None:
        try:
            message = decode(frames[1:], self.limits)
        except ProtocolError as exc:
            worker_id = self._registry.by_routing.get(routing_id)
            self._reject(exc.reason, f"from {worker_id or 'unknown peer'}: {exc}")
            return
        user_id = frames[1].get("User-Id") if self._curve is not None else None
        with self._lock:
            if not self._registry.key_allowed(user_id):
                self._reject("revoked_key", f"{message.kind} from a key no longer in the allowed folder")
                if isinstance(message, Hello):
                    self._send(sock, routing_id, refusal(REVOKED))
                return
            if isinstance(message, Hello):
                answer = self._membership.hello(routing_id, message, user_id, time.monotonic(), self._settings,
                                               port_of(self.weights_endpoint))
                self._send(sock, routing_id, answer)
                return
            worker = self._registry.of_connection(routing_id)
            if worker is None:
                self._reject("unknown_peer", f"{message.kind} from a peer that has not said hello")
                return
            now = worker.last_seen = time.monotonic()
            if not worker.alive:
                worker.alive = True
                self._registry.events("back", "worker %s is back", worker.worker_id)
            if isinstance(message, (TrajectoryBatch, Trajectory)):
                batch = message if isinstance(message, TrajectoryBatch) else TrajectoryBatch([message])
                self._intake.take_batch(worker, batch, time.time(), now, self.store.newest)
                self._lock.notify_all()
            elif isinstance(message, Heartbeat):
                if message.sender_id != worker.worker_id:
                    self._reject("forged_id", f"heartbeat names {message.sender_id!r} on {worker.worker_id}'s link")
                    return
                self._registry.heartbeat(worker, message)
            elif isinstance(message, Bye):
                self._membership.left(worker, message.failed, message.reason)
            else:
                self._reject("unexpected_kind", f"{message.kind} is not sent by workers", worker)

    def _on_weights(self, sock: zmq.Socket, frames: list) -> None:
        routing_id = frames[0].bytes
        try:
            request = decode(frames[1:], self.limits)
        except ProtocolError as exc:
            return self._reject(exc.reason, f"on the weights channel: {exc}")
        if not isinstance(request, WeightsRequest):
            return self._reject("unexpected_kind", f"{request.kind} on the weights channel")
        user_id = frames[1].get("User-Id") if self._curve is not None else None
        with self._lock:
            worker = self._registry.workers.get(request.worker_id)
            if worker is None or not (self._registry.owns(worker, user_id) and self._registry.key_allowed(user_id)):
                self._reject("unknown_peer", f"weights request for unknown worker {request.worker_id!r}")
                return
            if not self._release.in_session(worker, request.session):
                self._reject("wrong_session", f"weights request for {request.worker_id!r} without the token of its "
                             "current session (a connection that is not its session's)")
                return
            reply = self._release.reply(request, worker)
        if reply is not None:
            frames, carried = reply
            if send_frames(sock, [routing_id, *frames], self.stats, "weights_chunk" if carried else "weights_header"):
                self.stats["weights/bytes_sent"] += carried

    def _housekeeping(self, sock: zmq.Socket, now: float, beat: bool) -> None:
        """Revoke removed keys, time out workers and their incomplete groups, release due notices, and send each
        live worker what it is owed: notices, and an ack when it has acks, refusals, new credit or permits (or
        on the heartbeat)."""
        clock_now = self._clock()
        outgoing = []
        with self._lock:
            if self._registry.keys_due(now) and self._registry.reload_keys():
                for routing_id, message in self._membership.revoke():
                    self._send(sock, routing_id, message)
            live = []
            for worker in list(self._registry.workers.values()):
                if not self._membership.check_alive(worker, now):
                    continue
                released = self._release.release_due(worker, clock_now)
                if not worker.alive:
                    continue
                if released:
                    outgoing.append((worker.routing_id, self._release.notice(worker)))
                live.append(worker)
            self._admission.grant_all(now, self._intake.waits_on_learner)
            for worker in live:
                limit = self._intake.credit_limit(worker, now)
                start_limit = self._admission.limit_of(worker)
                if (worker.acks or worker.rejects or limit != worker.last_credit_sent
                        or start_limit != worker.last_start_limit_sent or beat):
                    outgoing.append((worker.routing_id, Ack(worker.acks, worker.rejects, limit, start_limit,
                                                            self._admission.threads_for(worker))))
                    worker.acks, worker.rejects, worker.last_credit_sent = [], [], limit
                    worker.last_start_limit_sent = start_limit
            if any(isinstance(m, WeightsNotice) for _, m in outgoing):
                self._release.trim()  # released notices may free versions no worker can still be given
        for routing_id, message in outgoing:
            self._send(sock, routing_id, message)

    def _send(self, sock: zmq.Socket, routing_id: bytes, message: Message) -> None:
        send_frames(sock, [routing_id, *encode(message)], self.stats, message.kind)
