"""A rollout worker's end of the transport: `WorkerClient` says hello until the learner answers, sends heartbeats,
sends trajectories as credit allows and fetches weights; its I/O thread owns all of the worker's sockets.

The control session (hello, ready, heartbeats, acks with credit and admission permits, bye) is this module's;
trajectories wait in an `outbox.Outbox` until they are due and go out in batches; weights are pulled by a
`receiver.WeightsReceiver` (`fetch.WeightsFetch`; a sharded learner's slices gathered by `receiver.ShardedFetch`).
"""

from __future__ import annotations

import logging
import os
import socket as pysocket
import threading
import time
from collections import Counter, deque
from typing import Callable, Sequence

import zmq

from heterorl.addresses import parse_host_port
from heterorl.config import TransportConfig
from heterorl.delay.clock import Clock, RealClock
from heterorl.transport.client.outbox import Outbox, SendBuffers
from heterorl.transport.client.receiver import WeightsReceiver
from heterorl.transport.handshakes import HandshakeMonitor
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
    WeightsNotice,
    decode,
    encode,
)
from heterorl.transport.sockets import (
    ADDRESS_EXAMPLE,
    CurveConfig,
    DelaySchedule,
    Endpoint,
    TransportError,
    TransportTimeout,
    Wakeup,
    make_socket,
    receive_waiting,
    require_security,
    send_frames,
)
from heterorl.transport.weights.reshard import DestLayout, layout_key

log = logging.getLogger("heterorl.transport")


class WorkerClient(Endpoint):
    """A rollout worker's end: handshake, heartbeats, credit-gated trajectory sends, weight fetches."""

    def __init__(self, address: str, worker_id: str, config: TransportConfig | None = None,
                 curve: CurveConfig | None = None, limits: Limits = DEFAULT_LIMITS,
                 trajectory_delay: DelaySchedule | None = None, clock: Clock | None = None,
                 version_held: int = -1, engine: str = "torch", layout: DestLayout | None = None) -> None:
        """``layout``: the slices of each tensor this worker wants from a sharded learner (a tensor-parallel
        engine's rank, `heterorl.transport.weights.reshard.DestLayout`); None: the whole model. A learner that cannot
        send them refuses the worker with the reason (``refused``)."""
        self.config = config or TransportConfig()
        self.config.validate()
        require_security(address, curve, self.config, (
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
        self._clock: Clock = clock or RealClock()  # the trajectory delay link's clock (`heterorl.delay.clock`)
        self._lock = threading.Condition()
        self._sent_session = self._credit_limit = self._starts_session = 0
        self.sessions = 0  # the sessions the learner has started for this worker (a join, then each rejoin)
        self._start_limit = -1
        self._starts_said = 0  # the permits used as the latest heartbeat said
        self.advised_threads = 0  # torch threads the learner advises (a worker on its machine; 0: no advice)
        self.busy_s = self.idle_s = 0.0  # reported in heartbeats; the rollout loop adds to them
        # `Heartbeat.reward_outcomes`, told within 50 ms of a change: give it a new dict, never change it in place
        self.reward_outcomes = self._outcomes_said = {}
        self._answered_end, self.handshake_refused, self._handshakes = False, "", None  # `_run`, `handshakes.py`
        self.finished = threading.Event()  # the learner said the run is over (or refused this worker: `refused`)
        self.refused: str | None = None  # the learner's reason when it refused this worker
        self.busy: str | None = None  # the learner's reason when it last could not take this worker (BYE_BUSY)
        self._ready: Ready | None = None
        self._version_held = version_held
        self._latest: tuple[int, dict] | None = None  # the newest version delivered and not yet taken
        self._published_at: dict[int, float] = {}  # version → when the learner published it (its notices said)
        self.arrivals = WeightsArrivals()  # how long versions took from publish to delivered (heartbeats say it)
        self.learner_alive = False
        self.stats: Counter = Counter()
        self.rejections: deque[str] = deque(maxlen=100)
        self._stop = threading.Event()
        self._wakeup = Wakeup()
        # the trajectories queued and not yet sent (under the lock), and enough send buffers for every message the
        # credit window lets be in flight
        self._send_buffers = SendBuffers(keep=-(-self.config.credits_per_worker // self.config.trajectory_batch) + 2)
        self._outbox = Outbox(self.config, self.stats, self._lock, self._send_buffers)
        # the I/O thread's own (no other thread touches them): its sockets, its weights side, the last time it
        # heard the learner
        self._ctx: zmq.Context | None = None
        self._poller = zmq.Poller()
        self._receiver = WeightsReceiver(worker_id, self.config, self.layout, self.layout_key, version_held,
                                         self.stats, self._connect, self._poller, self._decode, self._deliver_weights)
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
                if left <= 0 and self.handshake_refused:
                    raise TransportTimeout(f"the learner at {self.address} refused the handshake of worker "
                                           f"{self.worker_id} for {timeout_s} s: {self.handshake_refused}")
                if left <= 0:
                    raise TransportTimeout(f"no answer from the learner at {self.address} within {timeout_s} s, "
                                           "and no handshake refused: check the address, the port and the "
                                           "firewall (a learner that refuses a handshake logs its cause: a key it "
                                           "does not allow, a wrong --server-key, plaintext against CURVE)")
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
                before = len(self._outbox.queue)
                take = min(len(trajectories) - i, self._credit_limit - self._sent_session)
                now = self._clock.now()
                for trajectory in trajectories[i:i + take]:
                    due = now if self._delay is None else self._delay(now, trajectory.nbytes)
                    if due is None:
                        self.stats["delay/dropped"] += 1
                        continue
                    self._sent_session += 1
                    self._outbox.queue.put(due, trajectory)
                    queued += 1
                pending = len(self._outbox.queue)
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

    def set_trajectory_delay(self, schedule: DelaySchedule | None, clock: Clock | None = None) -> None:
        """Install the delay link for trajectories and the clock it runs on (known once the learner's config
        arrives with ``ready``)."""
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
            while self._outbox.queue or self._outbox.in_hand:
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
        sock = make_socket(self._ctx, zmq.DEALER, hwm, self.config, self.limits)
        if self._curve is not None:
            public, secret = self._curve.keypair()
            sock.curve_secretkey, sock.curve_publickey = secret, public
            sock.curve_serverkey = self._curve.server_public_key()
        sock.connect(address)
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def _watch_handshakes(self, control: zmq.Socket) -> None:
        """Read ZeroMQ's handshake failures on ``control`` (its monitor polled with the sockets): the latest's cause
        is ``handshake_refused``, which `wait_ready`'s timeout names. (``_answered_end``: this worker's bye
        answered the learner's end of the run.)"""
        self._handshakes = HandshakeMonitor(control, "worker" if self._curve is not None else "plaintext worker")
        self._poller.register(self._handshakes.socket, zmq.POLLIN)

    def _unwatch_handshakes(self) -> None:
        self._poller.unregister(self._handshakes.socket)
        self._handshakes.close()

    def _run(self) -> None:
        self._ctx = zmq.Context()
        control = self._connect(self.address, self.config.control_hwm)
        self._watch_handshakes(control)
        self._poller.register(self._wakeup.read_fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                with self._lock:
                    due_at = self._outbox.queue.next_due_time()
                    due_in = due_at - self._clock.now() if due_at is not None else 1.0
                # sleep until a message, a wake-up (a full batch), the next due trajectory plus the linger, or 50 ms
                wait_ms = 1000 * max(0.0, due_in) / self._clock.factor + self.config.trajectory_linger_ms
                events = dict(self._poller.poll(timeout=min(50, int(wait_ms))))
                if self._wakeup.read_fd in events:
                    self._wakeup.drain()
                if self._handshakes.socket in events:
                    for _, cause in self._handshakes.read():
                        self.stats["handshakes_refused"] += 1
                        self.handshake_refused = cause
                self._now = now = time.monotonic()
                if control in events:
                    receive_waiting(control, self._on_control)
                self._receiver.poll(events, now)
                control = self._keep_alive(control, now)
                self._outbox.send_due(control, self._clock.now(), self._clock.factor)
        finally:
            if self.learner_alive and not self._answered_end:
                bye = Bye(self.worker_id, getattr(self, "_bye_reason", "closed"))
                send_frames(control, encode(bye), self.stats, "bye")
            self._unwatch_handshakes()
            control.close(self.config.linger_ms)
            self._receiver.close()
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
            self._unwatch_handshakes()
            control.close(0)
            control = self._connect(self.address, self.config.control_hwm)
            self._watch_handshakes(control)
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
            send_frames(control, encode(hello), self.stats, "hello")
        started = self._starts_session  # permits used: said at once (within 50 ms), the learner grants more
        outcomes = self.reward_outcomes
        if self.learner_alive and (now - self._last_beat >= self.config.heartbeat_interval_s or (
                (started != self._starts_said or outcomes is not self._outcomes_said)
                and now - self._last_beat >= 0.05)):
            self._last_beat, self._starts_said, self._outcomes_said = now, started, outcomes
            arrivals = self.arrivals
            beat = Heartbeat(self.worker_id, self._version_held, time.time(), self.busy_s, self.idle_s, started,
                             outcomes, arrivals.count, arrivals.total_s, arrivals.max_s)
            send_frames(control, encode(beat), self.stats, "heartbeat")
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
        if isinstance(message, Bye) and message.ends_run and not self._answered_end:
            # answered at once, before the bye is handled (who waits on `finished` sees it counted): the learner keeps
            # its end open until this arrives (`LearnerIO._await_answers`), lest its own bye be cut off on a lossy link
            self._answered_end = True
            if send_frames(sock, encode(Bye(self.worker_id, "done: the run is over")), self.stats, "bye"):
                self.stats["end_of_run/answered"] += 1
        handler = self._handlers.get(message.kind) if message is not None else None
        if handler is not None:
            handler(message)

    def _on_ready(self, ready: Ready) -> None:
        session = str(ready.settings.get("weights_session", ""))
        if session and session == self._receiver.fetch.session and self.learner_alive:
            self.stats["ready_repeated"] += 1  # the answer to a hello sent again before the first was answered:
            return  # the session this worker is in already (`Membership.hello`)
        host = parse_host_port(self.address, "the learner's address", ADDRESS_EXAMPLE)[0]
        self._receiver.join(f"tcp://{host}", ready.settings)
        self._receiver.fetch.new_session(session)
        with self._lock:
            first = self._ready is None
            self._ready = ready
            self.learner_alive = True
            self.handshake_refused = ""  # (a key allowed since, for one)
            self.busy = None
            self._sent_session = len(self._outbox.queue)  # a new session: credit counts restart from what is queued
            self._credit_limit = ready.credits
            self._starts_session, self._start_limit = 0, int(ready.settings.get("start_limit", -1))
            self.sessions += 1
            self._lock.notify_all()
        log.info("worker %s %s learner at %s", self.worker_id, "joined" if first else "rejoined", self.address)
        self._receiver.offer(ready.newest_version, self._now)

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
            log.warning("the learner refused: %s", reason)

    def _on_notice(self, notice: WeightsNotice) -> None:
        if notice.published_at > 0:
            self._published_at[notice.version] = notice.published_at
            for version in sorted(self._published_at)[:-8]:  # (the newest few: only newer ones are fetched)
                del self._published_at[version]
        self._receiver.offer(notice.version, self._now)

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

    def _deliver_weights(self, version: int, state: dict) -> None:
        published = self._published_at.pop(version, 0.0)
        if published > 0:
            self.arrivals.add(time.time() - published)
        with self._lock:
            self._latest = (version, state)
            self._lock.notify_all()


class WeightsArrivals:
    """The seconds from the learner's publish of a version until this worker had it whole and verified, over the
    versions whose notice said when they were published (by the two hosts' wall clocks: their offset is in it)."""

    def __init__(self) -> None:
        self.count, self.total_s, self.max_s = 0, 0.0, 0.0

    def add(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.count, self.total_s, self.max_s = self.count + 1, self.total_s + seconds, max(self.max_s, seconds)
