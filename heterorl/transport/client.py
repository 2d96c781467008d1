"""A rollout worker's end of the transport: `WorkerClient` says hello until the learner answers, sends heartbeats,
sends trajectories as credit allows and fetches weights; its I/O thread owns both of the worker's sockets.

Trajectories wait in an outbox (a `DelayQueue`) until their trajectories link delivers them (at once without a
delay link), then go out in messages of up to ``trajectory_batch``, written into reused buffers
(`_SendBuffers`). Weights are pulled chunk by chunk (`_Fetch`) into reused buffers (`_ReceiveBuffers`).
"""

from __future__ import annotations

import logging
import os
import socket as pysocket
import sys
import threading
import time
from collections import Counter, deque
from typing import Callable, Sequence

import numpy as np
import zmq

from heterorl.config import TransportConfig
from heterorl.delay.queue import DelayQueue
from heterorl.transport.deltas import Layout, apply_steps, same_layout, tensor_checksums
from heterorl.transport.protocol import (
    DEFAULT_LIMITS,
    Ack,
    Bye,
    Heartbeat,
    Hello,
    Limits,
    Message,
    ProtocolError,
    Ready,
    Trajectory,
    TrajectoryBatch,
    WeightsChunk,
    WeightsHeader,
    WeightsNotice,
    WeightsRequest,
    decode,
    encode,
)
from heterorl.transport.reshard import Assembler, DestLayout, Piece, ReshardError, layout_key, local
from heterorl.transport.sockets import (
    CurveConfig,
    DelaySchedule,
    TransportError,
    TransportTimeout,
    _Endpoint,
    _receive,
    _require_security,
    _send,
    _socket,
    _Wakeup,
)
from heterorl.transport.weights import unpack_state_dict

log = logging.getLogger("heterorl.transport")


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


class WorkerClient(_Endpoint):
    """A rollout worker's end: handshake, heartbeats, credit-gated trajectory sends, weight fetches."""

    def __init__(self, address: str, worker_id: str, config: TransportConfig | None = None,
                 curve: CurveConfig | None = None, limits: Limits = DEFAULT_LIMITS,
                 trajectory_delay: DelaySchedule | None = None, clock: Callable[[], float] = time.monotonic,
                 version_held: int = -1, engine: str = "torch", layout: DestLayout | None = None) -> None:
        """``layout``: the slices of each tensor this worker wants from a sharded learner (a tensor-parallel
        engine's rank, `heterorl.transport.reshard.DestLayout`); None: the whole model. A learner that cannot
        send them refuses the worker with the reason (``refused``)."""
        self.config = config or TransportConfig()
        self.config.validate()
        _require_security(address, curve, self.config, (
            f"refusing plaintext to {address}: pass the learner's public key (--server-key) and "
            "this worker's secret key (--curve-secret), or allow_plaintext=True on a trusted network"))
        self.address = address
        self.worker_id = worker_id
        self.engine = engine  # named in each hello: the learner splits its metrics by engine
        self.layout = layout or DestLayout()
        self.layout_key = layout_key(self.layout)  # named in each weights request
        self.limits = limits
        self._curve = curve
        self._delay = trajectory_delay
        self._clock = clock
        self._lock = threading.Condition()
        self._outbox: DelayQueue[Trajectory] = DelayQueue()  # a reordering delay link may reorder
        self._in_hand = 0  # trajectories taken from the outbox by the I/O thread and not yet handed to the socket
        self._sent_session = 0
        self._credit_limit = 0
        self._starts_session = 0
        self._start_limit = -1
        self._starts_said = 0  # the permits used as the latest heartbeat said
        self.advised_threads = 0  # torch threads the learner advises (a worker on its machine; 0: no advice)
        self.busy_s = 0.0  # reported in heartbeats; the rollout loop adds to them
        self.idle_s = 0.0
        # `Heartbeat.reward_outcomes`, told within 50 ms of a change: give it a new dict, never change it in place
        self.reward_outcomes = self._outcomes_said = {}
        self.finished = threading.Event()  # the learner said the run is over (or refused this worker: `refused`)
        self.refused: str | None = None  # the learner's reason when it refused this worker
        self.busy: str | None = None  # the learner's reason when it last could not take this worker (BYE_BUSY)
        self._ready: Ready | None = None
        self._version_held = version_held
        self._latest: tuple[int, dict] | None = None
        self._fetched_version = version_held
        self.learner_alive = False
        self.stats: Counter = Counter()
        self.rejections: deque[str] = deque(maxlen=100)
        self._stop = threading.Event()
        self._wakeup = _Wakeup()
        # the I/O thread's own (no other thread touches them): enough send buffers for every message the credit
        # window lets be in flight, its sockets, its weights fetch, the last time it heard the learner
        self._send_buffers = _SendBuffers(keep=-(-self.config.credits_per_worker // self.config.trajectory_batch) + 2)
        self._ctx: zmq.Context | None = None
        self._poller = zmq.Poller()
        self._weights: zmq.Socket | None = None
        self._fetch = _Fetch()
        self._shards: _Shards | None = None  # a sharded learner's other ranks (Ready names their weights ports)
        self._now = self._last_heard = self._dialled_at = time.monotonic()  # _now: when the I/O loop last woke up
        self._last_hello = self._last_beat = 0.0
        self._handlers: dict[str, Callable] = {Ready.kind: self._on_ready, Ack.kind: self._on_ack,
                                               WeightsNotice.kind: self._on_notice, Bye.kind: self._on_bye}
        self._thread = threading.Thread(target=self._run, name=f"heterorl-worker-io-{worker_id}", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> Ready:
        """Block until the learner answers the hello; TransportTimeout after ``timeout_s``, TransportError when
        it refuses this worker."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._ready is None or not self.learner_alive:
                if self.refused:
                    raise TransportError(f"the learner at {self.address} refused worker {self.worker_id}: "
                                         f"{self.refused}")
                left = deadline - time.monotonic()
                if left <= 0 and self.busy:
                    raise TransportTimeout(f"the learner at {self.address} could not take worker {self.worker_id} "
                                           f"within {timeout_s} s: {self.busy}")
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
                    self._outbox.put(due, trajectory)
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
                    self._wakeup.wake()  # the next heartbeat says so: the learner can grant more
                    return granted
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return 0
                self._lock.wait(min(left, 0.1))

    def return_starts(self, count: int) -> None:
        """Give back ``count`` admission permits taken by `acquire_starts` for groups that will never reach the
        learner (every completion empty, or dropped by the trajectory delay link): the learner counts a group
        started when it arrives, so the permit is still free in its books, and now in this worker's too."""
        with self._lock:
            self._starts_session = max(0, self._starts_session - count)
            self._lock.notify_all()

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
    def _connect(self, address: str, hwm: int) -> zmq.Socket:
        """A DEALER connected to one of the learner's ROUTERs (its CURVE client when keys are given), polled by
        the I/O loop. Control + trajectories: HWM control_hwm; hello resent every hello_interval_s until a ready
        answers, the learner taken for gone after heartbeat_timeout_s of silence. Weights: HWM weights_hwm; a
        fetch restarts after fetch_timeout_s without a chunk."""
        sock = _socket(self._ctx, zmq.DEALER, hwm, self.config, self.limits)
        if self._curve is not None:
            public, secret = self._curve.keypair()
            sock.curve_secretkey, sock.curve_publickey = secret, public
            sock.curve_serverkey = self._curve.server_public_key()
        sock.connect(address)
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def _run(self) -> None:
        self._ctx = zmq.Context()
        control = self._connect(self.address, self.config.control_hwm)
        self._poller.register(self._wakeup.read_fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                with self._lock:
                    due_at = self._outbox.next_due_time()
                    due_in = due_at - self._clock() if due_at is not None else 1.0
                # sleep until a message, a wake-up (a full batch), the next due trajectory plus the linger, or 50 ms
                wait_ms = 1000 * max(0.0, due_in) / self._time_scale() + self.config.trajectory_linger_ms
                events = dict(self._poller.poll(timeout=min(50, int(wait_ms))))
                if self._wakeup.read_fd in events:
                    self._wakeup.drain()
                self._now = now = time.monotonic()
                if control in events:
                    _receive(control, self._on_control)
                weights = self._weights
                if weights is not None and weights in events:
                    _receive(weights, self._on_weights)
                if weights is not None:
                    self._fetch.check_timeout(weights, self, now)
                if self._shards is not None:
                    self._shards.poll(self, events, now)
                control = self._keep_alive(control, now)
                self._drain_outbox(control)
        finally:
            if self.learner_alive:
                _send(control, encode(Bye(self.worker_id, getattr(self, "_bye_reason", "closed"))), self.stats, "bye")
            control.close(self.config.linger_ms)
            if self._weights is not None:
                self._weights.close(0)
            if self._shards is not None:
                self._shards.close()
            self._ctx.term()
            self._wakeup.close()

    def _keep_alive(self, control: zmq.Socket, now: float) -> zmq.Socket:
        """Hello while the learner is not known to be there; heartbeats while it is; nothing once it ended the
        run or refused this worker. Returns the control socket: with CURVE, a new one after
        ``heartbeat_timeout_s`` without an answer, as a connection the learner's authenticator refused (a key it
        did not allow yet, or no longer) is not tried again by ZeroMQ."""
        if self.finished.is_set():
            return control
        if (self._curve is not None and not self.learner_alive
                and min(now - self._last_heard, now - self._dialled_at) > self.config.heartbeat_timeout_s):
            self._poller.unregister(control)
            control.close(0)
            control = self._connect(self.address, self.config.control_hwm)
            self._dialled_at = now
            self.stats["redialled"] += 1
        if self.learner_alive and now - self._last_heard > self.config.heartbeat_timeout_s:
            log.warning("learner silent for %.1f s; saying hello again", now - self._last_heard)
            with self._lock:
                self.learner_alive = False
        if not self.learner_alive and now - self._last_hello >= self.config.hello_interval_s:
            self._last_hello = now
            hello = Hello(self.worker_id, pysocket.gethostname(), os.getpid(), self._version_held, time.time(),
                          self.engine, self.layout.to_dict())
            _send(control, encode(hello), self.stats, "hello")
        started = self._starts_session  # permits used: said at once (within 50 ms), the learner grants more
        outcomes = self.reward_outcomes
        if self.learner_alive and (now - self._last_beat >= self.config.heartbeat_interval_s or (
                (started != self._starts_said or outcomes is not self._outcomes_said)
                and now - self._last_beat >= 0.05)):
            self._last_beat, self._starts_said, self._outcomes_said = now, started, outcomes
            beat = Heartbeat(self.worker_id, self._version_held, time.time(), self.busy_s, self.idle_s, started,
                             outcomes)
            _send(control, encode(beat), self.stats, "heartbeat")
        return control

    def _decode(self, frames, channel: str) -> Message | None:
        try:
            return decode(frames, self.limits)
        except ProtocolError as exc:
            self.stats[f"rejected/{exc.reason}"] += 1
            log.warning("bad message from the learner on the %s channel: %s", channel, exc)
            return None

    def _on_control(self, sock: zmq.Socket, frames: list) -> None:
        """One message on the control channel, handed to the handler of its kind (others are ignored)."""
        self._last_heard = self._now
        message = self._decode(frames, "control")
        handler = self._handlers.get(message.kind) if message is not None else None
        if handler is not None:
            handler(message)

    def _on_weights(self, sock: zmq.Socket, frames: list) -> None:
        message = self._decode(frames, "weights")
        if message is not None:
            self._fetch.on_message(sock, self, message, self._now)
        elif self._fetch.active:  # a corrupted chunk: fetch the version again, whole
            self._fetch.resync(sock, self, self._now)

    def _join_shards(self, host: str, ports: list[int]) -> None:
        """A sharded learner's other ranks (heterorl.transport.shards) are at ``ports`` of ``host``: connect to them,
        or, when a restarted learner's ranks bound other ports, drop the old sockets (and the slices being
        gathered) and connect to the new ones."""
        if ports == (self._shards.ports if self._shards is not None else []):
            return
        if self._shards is not None:
            for sock in self._shards.sockets.values():
                self._poller.unregister(sock)
            self._shards.close()
            self._shards = None
        self._fetch.deliver = None
        if ports:
            self._shards = _Shards(self, [self._connect(f"{host}:{port}", self.config.weights_hwm) for port in ports],
                                   ports)
            self._fetch.deliver = self._shards.part_of(0)

    def _on_ready(self, ready: Ready) -> None:
        host = self.address.rsplit(":", 1)[0]
        if self._weights is None:
            self._weights = self._connect(f"{host}:{ready.settings['weights_port']}", self.config.weights_hwm)
        self._join_shards(host, [int(p) for p in str(ready.settings.get("shard_ports") or "").split(",")
                                 if p.isdigit()])
        with self._lock:
            first = self._ready is None
            self._ready = ready
            self.learner_alive = True
            self.busy = None
            self._sent_session = len(self._outbox)  # a new session: credit counts restart from what is queued
            self._credit_limit = ready.credits
            self._starts_session, self._start_limit = 0, int(ready.settings.get("start_limit", -1))
            self._lock.notify_all()
        log.info("worker %s %s learner at %s", self.worker_id, "joined" if first else "rejoined", self.address)
        if ready.newest_version > self._fetched_version:
            self._fetch.start(self._weights, self, self._now)

    def _on_ack(self, ack: Ack) -> None:
        with self._lock:
            self.stats["acked"] += len(ack.accepted)
            self.stats["refused"] += len(ack.rejected)
            self.rejections.extend(ack.rejected)
            self._credit_limit = max(self._credit_limit, ack.credits)
            self._start_limit = ack.start_limit if ack.start_limit < 0 else max(self._start_limit, ack.start_limit)
            self.advised_threads = ack.threads
            self._lock.notify_all()
        for reason in ack.rejected[:3]:
            log.warning("learner refused a trajectory: %s", reason)

    def _on_notice(self, notice: WeightsNotice) -> None:
        if notice.version > self._fetched_version and self._weights is not None:
            self._fetch.start(self._weights, self, self._now)

    def _on_bye(self, bye: Bye) -> None:
        """The run is over (leave), this worker is refused (stop), the learner cannot take it now (busy: hello
        again after ``hello_interval_s``), or the learner is stopping before the end of the run: then it is taken
        for gone and hello goes out again at once, so a restarted learner gets this worker back (the rollout
        worker gives up after ``runtime.learner_timeout_s``)."""
        if bye.busy and self.busy is None:
            log.warning("the learner cannot take %s now (it will keep asking): %s", self.worker_id, bye.reason)
        elif not bye.busy:
            log.info("learner said bye to %s: %s", self.worker_id, bye.reason)
        self.rejections.append(bye.reason)
        with self._lock:
            if bye.busy:
                self.busy = bye.reason
                self.learner_alive = False
            elif bye.ends_run or bye.refuses:
                self.refused = bye.reason if bye.refuses else None
                self.finished.set()
            else:
                self.learner_alive = False
                self._last_hello = 0.0  # hello at once: a restarted learner answers it
            self._lock.notify_all()

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
            due = self._outbox.count_due(now)
            if due < size and (not due or now - self._outbox.next_due_time() < linger):
                return
            held = self._outbox.pop_due(now)
            batches = [held[start:start + size] for start in range(0, len(held), size)]
            self._in_hand = len(held)
        try:
            for i, batch in enumerate(batches):
                if not self._send_batch(control, [entry[2] for entry in batch]):
                    with self._lock:  # HWM reached: keep them queued, try on the next loop
                        self._outbox.restore([entry for unsent in batches[i:] for entry in unsent])
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


class AdapterWeights(dict):
    """A LoRA learner's version as delivered: the adapter's tensors (a dict, by base-model name), and in
    ``adapter`` what they belong to ({base, rank, alpha, targets}: the header's); the worker merges them into its
    base or loads them beside it (heterorl.training.lora)."""

    def __init__(self, tensors: dict, adapter: dict) -> None:
        super().__init__(tensors)
        self.adapter = dict(adapter)


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

    def prepare(self, nbytes: int) -> None:
        """Have a buffer of ``nbytes`` ready, its pages faulted in now (a whole version just arrived: the first
        delta after it is rebuilt into this one without that cost)."""
        if not any(len(b) == nbytes for b in self._kept):
            self.allocated += 1
            buffer = np.empty(nbytes, np.uint8)
            buffer.fill(0)
            self.reuse_later(buffer)

    def reuse_later(self, buffer: np.ndarray) -> None:
        """``buffer`` was delivered (or its transfer abandoned): reuse it once nothing views it."""
        self._kept = [*self._kept, buffer][-self.keep:]


RESYNC_BACKOFF_S = 0.5  # the second resync in a row waits this long before it asks, each later one twice as long
RESYNC_BACKOFF_MAX_S = 30.0  # ... up to this


class _Fetch:
    """State of one pull-based weights transfer on a worker (header, then pipelined chunks), and the verified
    bytes of the version it holds (``held``: the base of the deltas it asks for, `heterorl.transport.deltas`).
    Anything doubtful (a corrupted chunk, a delta from a version it does not hold, a payload that does not
    decode, rebuilt tensors whose checksums differ) is counted under ``weights/rejected/<reason>`` and answered
    by a full resync (``weights/resyncs``); the worker samples with the weights it has meanwhile. A resync that
    follows another with no version verified between them waits first (`RESYNC_BACKOFF_S`, doubling;
    ``weights/resync_backoffs``), so a link that corrupts every transfer is not asked again at full speed."""

    def __init__(self) -> None:
        self.buffers = _ReceiveBuffers()
        self.active = False
        self.header: WeightsHeader | None = None
        self.buffer: np.ndarray | None = None
        self.held: tuple[WeightsHeader, np.ndarray] | None = None
        self.received: set[int] = set()
        self.next_chunk = 0
        self.last_progress = 0.0
        # a sharded learner's slices: the version to fetch from this rank (-1: the newest released), and who
        # takes a verified version (None: the client, as the whole model)
        self.want = -1
        self.deliver: Callable[[WeightsHeader, dict, float], None] | None = None
        self.failures = 0  # resyncs since the last version verified
        self.resume_at = 0.0  # backing off: no request before then
        self.deferred: int | None = None  # the version a start held back by the back-off wants (`check_timeout`)

    def start(self, sock: zmq.Socket, client: WorkerClient, now: float, want: int = -1) -> None:
        if now < self.resume_at:
            self.deferred = want  # asked for when the back-off is over
            return
        self.deferred = None
        if self.active and self.header is None and want == self.want:
            return  # a header request is already out
        self._drop_transfer()
        self.active, self.header, self.received, self.next_chunk, self.want = True, None, set(), 0, want
        self.last_progress = now
        base = self.held[0].version if self.held is not None and client.config.weights_deltas else -1
        request = WeightsRequest(client.worker_id, have_version=client._fetched_version, version=want,
                                 delta_base=base, layout=client.layout_key)
        _send(sock, encode(request), client.stats, "weights_request")

    def resync(self, sock, client: WorkerClient, now: float, reason: str | None = None) -> None:
        """Forget the held bytes and fetch the newest version whole."""
        if reason is not None:
            client.stats[f"weights/rejected/{reason}"] += 1
        client.stats["weights/resyncs"] += 1
        self._drop_transfer()
        self.held, self.active, self.header = None, False, None
        self.failures += 1
        if self.failures > 1:
            wait = min(RESYNC_BACKOFF_S * 2 ** (self.failures - 2), RESYNC_BACKOFF_MAX_S)
            self.resume_at = now + wait
            client.stats["weights/resync_backoffs"] += 1
            log.warning("%d resyncs in a row failed verification; asking again in %.1f s", self.failures - 1, wait)
        self.start(sock, client, now, self.want)

    def _drop_transfer(self) -> None:
        """An unfinished transfer's buffer can take a later version."""
        if self.buffer is not None and (self.header is None or not self.header.is_delta):
            self.buffers.reuse_later(self.buffer)
        self.buffer = None

    def _request(self, sock, client: WorkerClient, index: int) -> None:
        request = WeightsRequest(client.worker_id, have_version=client._fetched_version,
                                 version=self.header.version, chunk=index, delta_base=self.header.base_version,
                                 layout=client.layout_key)
        _send(sock, encode(request), client.stats, "weights_request")

    def _on_header(self, sock, client: WorkerClient, message: WeightsHeader, now: float) -> None:
        if self.want >= 0 and message.version != self.want:
            self.active = False  # this rank has not published it yet (or no longer keeps it): `_Shards` asks again
            client.stats["weights/shard_not_ready"] += 1
            return
        if message.version <= client._fetched_version:
            self.active = False  # nothing newer released to us yet
            return
        if self.deliver is not None and self.held is not None and self.held[0].version == message.version:
            self.active = False  # held already (a sharded learner's rank asked again): hand it over as it is
            self.deliver(self.held[0], unpack_state_dict(self.held[0], self.held[1]), now)
            return
        if message.is_delta and (self.held is None or self.held[0].version != message.base_version
                                 or not same_layout(self.held[0], message)):
            log.warning("weights version %d came as a delta from version %d, which this worker does not hold; "
                        "fetching it whole", message.version, message.base_version)
            self.resync(sock, client, now, "delta_base")
            return
        self._drop_transfer()  # (a transfer of an older version was under way: its buffer is free)
        self.header, self.received = message, set()
        self.buffer = (np.empty(message.payload_bytes, np.uint8) if message.is_delta
                       else self.buffers.take(message.total_bytes))
        client.stats["weights/fresh_buffers"] = self.buffers.allocated
        self.last_progress = now
        self.next_chunk = min(client.config.weights_pipeline, message.num_chunks)
        for index in range(self.next_chunk):
            self._request(sock, client, index)
        if message.num_chunks == 0:
            self._finish(sock, client, now)

    def on_message(self, sock, client: WorkerClient, message: Message, now: float) -> None:
        if isinstance(message, WeightsHeader):
            self._on_header(sock, client, message, now)
        elif isinstance(message, WeightsChunk) and self.header is not None:
            if message.version != self.header.version or message.index in self.received:
                return
            start = message.index * self.header.chunk_bytes
            expected = min(self.header.chunk_bytes, self.header.transfer_bytes - start)
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
                self._finish(sock, client, now)

    def _rebuild(self, header: WeightsHeader, payload: np.ndarray) -> np.ndarray:
        """The version's packed bytes: the payload itself, or the held bytes with the payload's steps applied;
        checked against the header's per-tensor checksums (`ProtocolError` if anything is off)."""
        layout = Layout.of(header)
        if not header.is_delta:
            if len(payload) != header.total_bytes:
                raise ProtocolError("total_bytes", f"received {len(payload)} bytes, header says "
                                    f"{header.total_bytes}", "length_mismatch")
            if header.checksums and tensor_checksums(layout, payload) != header.checksums:
                raise ProtocolError("checksums", "a tensor does not match its checksum", "checksum")
            return payload
        out = self.buffers.take(header.total_bytes)
        try:
            apply_steps(layout, self.held[1], header.base_version, payload, header.version, out, header.checksums)
        except ProtocolError:
            self.buffers.reuse_later(out)
            raise
        return out

    def _finish(self, sock, client: WorkerClient, now: float) -> None:
        header, payload = self.header, self.buffer
        self.active, self.header, self.buffer = False, None, None
        try:
            buffer = self._rebuild(header, payload)
            state = unpack_state_dict(header, buffer)
        except ProtocolError as exc:
            client.stats["weights/checksum_failures"] += 1
            log.warning("weights version %d failed verification (%s); fetching it whole", header.version, exc)
            if not header.is_delta:
                self.buffers.reuse_later(payload)
            self.resync(sock, client, now, exc.reason)
            return
        self.failures = 0
        client.stats["weights/fresh_buffers"] = self.buffers.allocated
        client.stats["weights/versions_received"] += 1
        client.stats["weights/deltas_applied" if header.is_delta else "weights/full_received"] += 1
        client.stats["weights/bytes_received"] += header.transfer_bytes
        if self.held is not None:
            self.buffers.reuse_later(self.held[1])
        # the bytes of the version stay as the next delta's base; without deltas the buffer is reused once free
        self.held = (header, buffer) if client.config.weights_deltas else None
        if self.held is None:
            self.buffers.reuse_later(buffer)
        if self.deliver is not None:
            self.deliver(header, state, now)
        elif header.shard:  # slices of a sharded learner, where the whole model was expected: never loaded
            client.stats["weights/rejected/shard"] += 1
            log.warning("weights version %d came as one rank's slices, but the learner named no other ranks; "
                        "not loading it", header.version)
        else:
            client._deliver_weights(header.version, AdapterWeights(state, header.adapter) if header.adapter else state)
        if self.held is not None and not header.is_delta:
            self.buffers.prepare(header.total_bytes)

    def check_timeout(self, sock, client: WorkerClient, now: float) -> None:
        """The I/O loop's turn: give up a transfer silent for ``fetch_timeout_s``; start one the back-off held."""
        if self.active and now - self.last_progress > client.config.fetch_timeout_s:
            client.stats["weights/fetch_restarts"] += 1
            self.active = False
        if self.deferred is not None and now >= self.resume_at:
            self.start(sock, client, now, self.deferred)

SHARD_RETRY_S = 0.05  # how soon a worker asks a rank again for a version it has not published yet


class _Shards:
    """A sharded learner's fan-out on the worker (heterorl.transport.shards): rank 0's fetch (the weights channel)
    names the version released to this worker; every other rank is asked for that same version on its own
    socket, and the version is delivered once every rank's verified slices of it are placed by an
    all-or-nothing `reshard.Assembler`. A newer version from rank 0 replaces the one being gathered (its slices
    are dropped): a worker never loads a mix of two versions. A rank that does not answer within
    ``fetch_timeout_s`` is counted (``weights/shard_timeouts/RANK``) and asked again; meanwhile the worker keeps
    the version it has. Slices that do not fit (a wrong shape or offset, two ranks claiming one element, one
    missing) are counted under ``weights/rejected/<reason>`` and every rank's version fetched whole again."""

    def __init__(self, client: WorkerClient, sockets: list[zmq.Socket], ports: list[int]) -> None:
        self.sockets = {rank: sock for rank, sock in enumerate(sockets, start=1)}
        self.ports = list(ports)
        self.fetches = {rank: _Fetch() for rank in self.sockets}
        for rank, fetch in self.fetches.items():
            fetch.deliver = self.part_of(rank)
        self.world = len(sockets) + 1
        self.target = -1
        self.parts: dict[int, tuple[WeightsHeader, dict]] = {}
        self.retry_at: dict[int, float] = {}
        self._client = client

    def part_of(self, rank: int) -> Callable[[WeightsHeader, dict, float], None]:
        return lambda header, state, now: self.on_part(rank, header, state, now)

    def on_part(self, rank: int, header: WeightsHeader, state: dict, now: float) -> None:
        client = self._client
        if header.version < self.target or header.version <= client._fetched_version:
            return  # a slice of a version given up on, or delivered already
        if header.shard != [rank, self.world]:
            client.stats["weights/rejected/shard"] += 1
            log.warning("learner rank %d sent slices marked %s, not [%d, %d]", rank, header.shard, rank, self.world)
            return
        if header.version > self.target:  # (only rank 0's can be: the others are asked for the target)
            self.target, self.parts = header.version, {}
            for other in self.fetches:
                self.retry_at[other] = now  # ask now
        self.parts[rank] = (header, state)
        if len(self.parts) == self.world:
            self._deliver(now)

    def poll(self, client: WorkerClient, events: dict, now: float) -> None:
        """The I/O loop's turn: take the ranks' replies, ask again where a rank's slices are due."""
        for rank, sock in self.sockets.items():
            fetch = self.fetches[rank]
            if sock in events:
                _receive(sock, lambda s, frames, f=fetch: self._on_frames(s, f, frames, now))
            if fetch.active and now - fetch.last_progress > client.config.fetch_timeout_s:
                client.stats[f"weights/shard_timeouts/{rank}"] += 1
                log.warning("learner rank %d sent nothing of version %d for %.0f s; the worker keeps version %d",
                            rank, self.target, client.config.fetch_timeout_s, client._fetched_version)
                fetch.active = False
            if (self.target > client._fetched_version and rank not in self.parts and not fetch.active
                    and now >= self.retry_at.get(rank, 0.0)):
                self.retry_at[rank] = now + SHARD_RETRY_S
                fetch.start(sock, client, now, self.target)

    def _on_frames(self, sock, fetch: _Fetch, frames: list, now: float) -> None:
        message = self._client._decode(frames, "weights")
        if message is not None:
            fetch.on_message(sock, self._client, message, now)
        elif fetch.active:
            fetch.resync(sock, self._client, now)

    def _deliver(self, now: float) -> None:
        client, version = self._client, self.target
        try:
            state = assemble(version, [self.parts[rank] for rank in range(self.world)], client.layout)
        except ReshardError as exc:
            client.stats[f"weights/rejected/{exc.reason}"] += 1
            log.warning("the slices of weights version %d do not fit together (%s); fetching them whole", version,
                        exc)
            self.parts = {}
            client._fetch.resync(client._weights, client, now)
            for rank, fetch in self.fetches.items():
                fetch.held = None
            return
        client.stats["weights/shard_versions_assembled"] += 1
        self.parts = {}
        client._deliver_weights(version, state)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(0)


def assemble(version: int, parts: list[tuple[WeightsHeader, dict]], layout: DestLayout | None = None) -> dict:
    """The state dict of ``version`` from every rank's (header, slices), placed by a `reshard.Assembler`
    (`ReshardError` when they do not tile every tensor exactly once): whole tensors, or the worker's own slices
    of them (``layout``); tied names share one tensor."""
    layout = layout or DestLayout()
    shapes, dtypes, aliases = {}, {}, {}
    for header, state in parts:
        for name, full in zip(header.names, header.full_shapes):
            if shapes.setdefault(name, tuple(full)) != tuple(full):
                raise ReshardError(f"ranks disagree on the shape of {name!r}: {shapes[name]} and {tuple(full)}",
                                   "shape")
            dtypes[name] = state[name].dtype
        aliases.update(dict(header.aliases))
    assembler = Assembler(version, shapes, layout, dtypes)
    for rank, (header, state) in enumerate(parts):
        for name, box in zip(header.names, header.boxes):
            box = tuple((start, stop) for start, stop in box)
            wanted = layout.box(name, shapes[name])
            if any(start < low or stop > high for (start, stop), (low, high) in zip(box, wanted)):
                raise ReshardError(f"rank {rank} sent {name!r} at {box}, outside this worker's {wanted}", "offset")
            piece = Piece(name, rank, "", box, tuple((0, stop - start) for start, stop in box),
                          local(box, wanted), tuple(state[name].shape))
            assembler.add(version, piece, state[name])
    whole = assembler.tensors()
    for alias, source in aliases.items():
        if source in whole:
            whole[alias] = whole[source]
    return whole
