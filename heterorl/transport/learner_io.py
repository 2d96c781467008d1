"""The learner's I/O thread (`LearnerIO`): it binds both channels of the learner's end, takes in what arrives —
reads each control message into its peer's queue (`PeerInbox`: one budget of bytes and work per peer) and hands
them, fairly, to their rooms; answers each weights request — and, at least every 50 ms, sends each live worker
what the rooms say it is owed (acks, credit, permits, weights notices); on close, a bye to every live worker, and
at the end of the run a wait (bounded) for each one's answer. It owns both sockets and is the only
one to send (the rooms return what is to be sent), and it takes the rooms' lock (`Rooms`) around every room it
touches. `LearnerServer` starts it and is the API the learner calls.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import zmq

from heterorl.config import TransportConfig
from heterorl.errors import ConfigError, HeteroRLError
from heterorl.transport.handshakes import HandshakeMonitor, RateLimitedLog, RefusalLoggingAuthenticator
from heterorl.transport.inbound import PROBATION, DiscardPace, PeerInbox, peer_budget_bytes
from heterorl.transport.membership import REVOKED, refusal
from heterorl.transport.protocol import (
    BYE_LEARNER_STOPPING,
    BYE_RUN_FINISHED,
    Ack,
    Bye,
    Heartbeat,
    Hello,
    Limits,
    Message,
    ProtocolError,
    Trajectory,
    TrajectoryBatch,
    WeightsNotice,
    WeightsRequest,
    decode,
    encode,
)
from heterorl.transport.rooms import Rooms
from heterorl.transport.sockets import (
    CurveConfig,
    TransportError,
    Wakeup,
    make_socket,
    port_of,
    receive_waiting,
    send_frames,
)
from heterorl.transport.throttle import Verdict

log = logging.getLogger("heterorl.transport")
READ_AT_ONCE = 4096  # control messages moved into the inbox per read (ZeroMQ holds at most control_hwm per peer)
HANDLE_SLICE_S = 0.05  # the inbox is handled this long at most between two rounds of housekeeping
PACE_CHECK_EVERY = 32  # reads between two looks at the time reading dropped messages took (`DiscardPace`)
CUT_AFTER_S = 0.2  # a disconnected peer's TCP connection is cut this long after its bye was sent


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


def hold_connection(frame: zmq.Frame) -> socket.socket | None:
    """The TCP connection ``frame`` came on, held by a duplicate of its descriptor (ZeroMQ's ``SRCFD``), to cut
    (`cut`) once what is queued for it has gone out: held, the connection stays the same one whatever ZeroMQ
    does with its own descriptor meanwhile. None when there is none (not TCP, or already gone)."""
    try:
        return socket.socket(fileno=os.dup(frame.get(zmq.SRCFD)))
    except (zmq.ZMQError, OSError, ValueError):
        return None


def cut(connection: socket.socket) -> None:
    """Shut the held connection down (ZeroMQ sees it end and drops what it still queues of it) and let it go."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # (gone already)
    connection.close()


class WeightsRequests:
    """The weights channel's requests at the learner's end, answered by `LearnerIO`'s thread (it owns the socket):
    checked against the worker's session, charged to the peer's work budget in the same `PeerInbox` as its
    control messages, and answered from the weights release room."""

    def __init__(self, rooms: Rooms, inbox: PeerInbox, limits: Limits, curve: CurveConfig | None) -> None:
        self._rooms, self._inbox, self.limits, self._curve = rooms, inbox, limits, curve
        self.stats = rooms.stats

    def on_request(self, sock: zmq.Socket, frames: list) -> None:
        """A weights request, answered at once (it is small, and the bytes of the replies in flight are bounded
        where they are made); its CPU time is charged to its peer (its CURVE key, else the worker it names), and
        it is dropped unanswered while that peer's work budget is spent (the worker asks again)."""
        start = time.thread_time()
        user_id = frames[1].get("User-Id") if self._curve is not None else None
        peer = "key:" + (user_id or "") if self._curve is not None else PROBATION
        try:
            peer = self._answer(sock, peer, user_id, frames)
        finally:
            self._inbox.charge(peer, time.thread_time() - start, time.monotonic())

    def _answer(self, sock: zmq.Socket, peer: str, user_id: str | None, frames: list) -> str:
        """`on_request`'s work; returns the peer charged for it."""
        rooms = self._rooms
        routing_id = frames[0].bytes
        try:
            request = decode(frames[1:], self.limits)
        except ProtocolError as exc:
            rooms.reject(exc.reason, f"on the weights channel: {exc}")
            return peer
        if not isinstance(request, WeightsRequest):
            rooms.reject("unexpected_kind", f"{request.kind} on the weights channel")
            return peer
        if self._curve is None:
            peer = "id:" + request.worker_id
        if not self._inbox.may_work(peer, time.monotonic()):
            self.stats["inbound/dropped"] += 1
            self.stats["inbound/dropped/weights_over_budget"] += 1
            return peer
        with rooms.lock:
            worker = rooms.registry.workers.get(request.worker_id)
            if worker is None or not (rooms.registry.owns(worker, user_id) and rooms.registry.key_allowed(user_id)):
                rooms.reject("unknown_peer", f"weights request for unknown worker {request.worker_id!r}")
                return peer
            if not rooms.release.in_session(worker, request.session):
                rooms.reject("wrong_session", f"weights request for {request.worker_id!r} without the token of its "
                             "current session (a connection that is not its session's)")
                return peer
            reply = rooms.release.reply(request, worker)
        if reply is not None:
            frames, carried = reply
            if send_frames(sock, [routing_id, *frames], self.stats, "weights_chunk" if carried else "weights_header"):
                self.stats["weights/bytes_sent"] += carried
        return peer


class LearnerIO:
    """The I/O thread of one `LearnerServer` (see the module): `start` binds and starts it, `close` stops it;
    the weights channel's requests are `WeightsRequests`'."""

    def __init__(self, rooms: Rooms, address: str, weights_address: str | None, config: TransportConfig,
                 limits: Limits, curve: CurveConfig | None, settings: dict[str, Any],
                 clock: Callable[[], float]) -> None:
        """``settings``: the run's, told to each worker that joins; ``clock``: the weights links' delays' clock.
        The other arguments are `LearnerServer`'s."""
        self._rooms, self.config, self.limits = rooms, config, limits
        self._address, self._weights_address = address, weights_address
        self._curve, self._settings, self._clock = curve, settings, clock
        self.stats = rooms.stats
        self._stop, self._ready = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._bye_reason = BYE_LEARNER_STOPPING
        self._answered: set[str] = set()  # the workers whose bye has arrived (`_await_answers`)
        self._refusals = RateLimitedLog(log)  # refused handshakes, a line per cause every 10 s (`handshakes.py`)
        self._handshakes: HandshakeMonitor | None = None
        self.control_endpoint = self.weights_endpoint = ""
        self._wakeup = Wakeup()
        self._cuts: list[tuple[float, socket.socket]] = []  # connections to cut, and when (`_count_refusals`)
        self.peer_bytes = peer_budget_bytes(config, rooms.intake.contract, limits)
        self._inbox = PeerInbox(self.peer_bytes, max(self.peer_bytes, config.inbound_bytes), config.peer_work_s_per_s,
                                config.peer_work_burst_s)
        self._pace = DiscardPace(config.discard_read_s_per_s, config.discard_read_burst_s)
        self._weights_requests = WeightsRequests(rooms, self._inbox, limits, curve)
        self._thread = threading.Thread(target=self._run, name="heterorl-learner-io", daemon=True)

    def start(self) -> None:
        """Bind both channels and serve them on the thread; the bind's error, if any, is raised here."""
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Run the loop now, not at the next poll timeout (credits freed, for one)."""
        self._wakeup.wake()

    def close(self, reason: str) -> None:
        """Say bye with ``reason`` to every live worker, wake whoever waits on the rooms, and stop the thread
        (at the end of the run, once the workers answered: `_await_answers`)."""
        self._bye_reason = reason
        self._stop.set()
        self._wakeup.wake()
        with self._rooms.lock:
            self._rooms.lock.notify_all()
        self._thread.join(timeout=10 + self.config.end_of_run_wait_s)

    # -- the thread -----------------------------------------------------------------------------
    def _open(self, ctx: zmq.Context) -> tuple[RefusalLoggingAuthenticator | None, zmq.Socket, zmq.Socket]:
        """Start CURVE authentication (when keys are given) and bind both channels; on failure, undo and raise."""
        auth, sockets = None, []
        try:
            if self._curve is not None:
                allowed = self._curve.allowed_keys_dir
                if not allowed or not Path(allowed).is_dir():
                    raise ConfigError(f"allowed_keys_dir {allowed!r} is not a folder of worker public keys "
                                      "(*.key files made by `heterorl keys`)")
                auth = self._rooms.registry.auth = RefusalLoggingAuthenticator(ctx, self._refusals, allowed)
                auth.start()
                self._rooms.registry.reload_keys()
            # control + trajectories: ROUTER ↔ a DEALER per worker; hello/ready, heartbeats, trajectories up, acks
            # (credit) down. HWM control_hwm messages each way; a worker silent for heartbeat_timeout_s is dead.
            control, self.control_endpoint = bind_router(ctx, self._address, self.config.control_hwm, self.config,
                                                         self.limits, self._curve)
            sockets.append(control)
            self._handshakes = HandshakeMonitor(control, "learner")  # refused handshakes, logged (`_on_handshakes`)
            # weights: ROUTER (PORT+1 unless given) ↔ a DEALER per worker; header and chunk requests up, one reply
            # each down. HWM weights_hwm messages; the worker restarts a fetch after fetch_timeout_s without a chunk.
            host = self._address.rsplit(":", 1)[0]
            weights_address = self._weights_address or (
                f"{host}:{0 if self._address.endswith(':0') else port_of(self._address) + 1}")
            weights, self.weights_endpoint = bind_router(ctx, weights_address, self.config.weights_hwm, self.config,
                                                         self.limits, self._curve)
            return auth, control, weights
        except BaseException:
            if self._handshakes is not None:
                self._handshakes.close()
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
            bye = encode(Bye("learner", self._bye_reason))
            told = set()
            for worker in list(self._rooms.registry.workers.values()):
                if worker.alive:
                    send_frames(control, [worker.routing_id, *bye], self.stats, "bye")
                    told.add(worker.worker_id)
            if self._bye_reason == BYE_RUN_FINISHED and told:
                self._await_answers(control, told)
            for _, held in self._cuts:
                cut(held)
            self._handshakes.close()
            control.close(self.config.linger_ms)
            weights.close(self.config.linger_ms)
            if auth is not None:
                auth.stop()
            ctx.term()
            self._wakeup.close()

    def _serve(self, control: zmq.Socket, weights: zmq.Socket) -> None:
        """Until closed: take in what arrives (waking at least every 50 ms), then send acks, credit and notices."""
        poller, paused_poller = zmq.Poller(), zmq.Poller()  # (the second while reading is paused: `DiscardPace`)
        poller.register(control, zmq.POLLIN)
        for polled in (weights, self._wakeup.read_fd, self._handshakes.socket):
            poller.register(polled, zmq.POLLIN)
            paused_poller.register(polled, zmq.POLLIN)
        last_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            wait, paused = self._inbox.wait_s(now), self._pace.paused_s(now)
            wait = min(0.05, 0.05 if wait is None else wait, paused or 0.05)
            events = dict((paused_poller if paused else poller).poll(timeout=math.ceil(wait * 1000)))
            if self._wakeup.read_fd in events:
                self._wakeup.drain()
            if self._handshakes.socket in events:
                self._on_handshakes()
            if control in events:
                self._read_control(control)
            if weights in events:
                receive_waiting(weights, self._weights_requests.on_request)
            self._handle_inbox(control)
            now = time.monotonic()
            beat = now - last_beat >= self.config.heartbeat_interval_s
            if beat:
                last_beat = now
            self._housekeeping(control, now, beat)

    def _await_answers(self, control: zmq.Socket, told: set[str]) -> None:
        """Keep the control channel open until each worker in ``told`` has answered the end of the run with its
        own bye, at most ``end_of_run_wait_s``: closed sooner, a bye still being retransmitted by TCP on a lossy
        link would be lost, and its worker would wait ``runtime.learner_timeout_s`` for a learner that is gone.
        What arrives meanwhile is handled as ever (trajectories taken in, refusals counted)."""
        deadline = time.monotonic() + self.config.end_of_run_wait_s
        while not told <= self._answered and time.monotonic() < deadline:
            paused = self._pace.paused_s(time.monotonic())
            if paused:  # (reading dropped messages used its time: `DiscardPace`)
                time.sleep(min(0.05, paused))
            elif control.poll(timeout=50):
                self._read_control(control)
            self._handle_inbox(control)
        unanswered = told - self._answered
        self.stats["end_of_run/answered"] += len(told) - len(unanswered)
        if unanswered:
            self.stats["end_of_run/unanswered"] += len(unanswered)
            log.warning("%d worker(s) did not answer the end of the run within transport.end_of_run_wait_s "
                        "(%g s): %s; each waits runtime.learner_timeout_s for the learner unless it heard the bye",
                        len(unanswered), self.config.end_of_run_wait_s, ", ".join(sorted(unanswered)[:10]))

    def _on_handshakes(self) -> None:
        """Handshakes ZeroMQ refused: counted, and logged (rate-limited) with their cause; a refused key is
        logged by the authenticator, which knows the key and the address."""
        for event, cause in self._handshakes.read():
            self.stats["handshakes_refused"] += 1
            if event != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refusals.warning(cause, f"refused a handshake on {self.control_endpoint}: {cause}")

    # -- control messages: read into the inbox, handled from it ---------------------------------
    def _peer_of(self, routing_id: bytes, frames: list) -> str:
        """Who answers for a message (`PeerInbox`): its CURVE key, else its connection's registered worker id,
        else `PROBATION`."""
        if self._curve is not None:
            return "key:" + (frames[-1].get("User-Id") or "")
        worker_id = self._rooms.registry.by_routing.get(routing_id)  # (one dict read: no lock needed)
        return PROBATION if worker_id is None else "id:" + worker_id

    def _read_control(self, sock: zmq.Socket) -> None:
        """Move the control messages waiting in ZeroMQ into their peers' queues, without decoding them: those of
        a throttled connection are discarded, and what a peer's budget has no room for is dropped (`_dropped`)."""
        now, start, read = time.monotonic(), time.thread_time(), Counter()
        left, received, wasted = self._pace.left_s(now), 0, 0  # wasted: discarded or dropped as read
        while received < READ_AT_ONCE and left > 0:
            if wasted and not received % PACE_CHECK_EVERY and (time.thread_time() - start) * wasted / received >= left:
                break  # (reading what is dropped used the time it may: the rest waits, `DiscardPace`)
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            received += 1
            self.stats["received"] += 1
            routing_id = frames[0].bytes
            if self._rooms.throttle.discards(routing_id, now):
                self.stats["throttled/discarded"] += 1
                wasted += 1
                continue
            size, peer = sum(len(frame) for frame in frames[1:]), self._peer_of(routing_id, frames)
            read[peer] += 1
            for dropped_peer, (dropped_id, dropped_frames, dropped_size), reason in self._inbox.add(
                    peer, (routing_id, frames, size), size, now, routing_id):
                wasted += dropped_frames is frames
                self._dropped(sock, dropped_peer, dropped_id, dropped_frames, dropped_size, reason, now)
        if received:  # the reads' CPU time, shared by the messages read: each peer's to it, the dropped' to the pace
            cost = (time.thread_time() - start) / received
            for peer, count in read.items():
                self._inbox.charge(peer, cost * count, now)
            if wasted:
                self._pace.spend(cost * wasted, now)
                self.stats["inbound/dropped_read_s"] += cost * wasted
                if self._pace.left_s(now) <= 0:
                    self.stats["inbound/read_paused"] += 1

    def _handle_inbox(self, sock: zmq.Socket) -> None:
        """Handle queued control messages, the next one always the fairest (`PeerInbox.next`), for at most
        `HANDLE_SLICE_S`; each one's CPU time is charged to its peer. ZeroMQ is read again between messages, so
        its queues stay short while an expensive message is handled."""
        deadline = time.monotonic() + HANDLE_SLICE_S
        while (now := time.monotonic()) < deadline:
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._read_control(sock)
            taken = self._inbox.next(now)
            if taken is None:
                return
            peer, (routing_id, frames, _) = taken
            if self._rooms.throttle.discards(routing_id, now):  # (throttled since it was read)
                self.stats["throttled/discarded"] += 1
                continue
            start = time.thread_time()
            self._on_control(sock, peer, routing_id, frames)
            self._inbox.charge(peer, time.thread_time() - start, time.monotonic())

    def _dropped(self, sock: zmq.Socket, peer: str, routing_id: bytes, frames: list, size: int, reason: str,
                 now: float) -> None:
        """A message of ``peer`` dropped unread for ``reason`` (`PeerInbox.add`): counted, logged, told to its
        worker (rate-limited), and counted as a refusal of its connection (a connection that floods past its
        peer's budget is throttled, then cut: `_count_refusals`)."""
        self.stats["inbound/dropped"] += 1
        self.stats[f"inbound/dropped/{reason}"] += 1
        self.stats["inbound/dropped_bytes"] += size
        if self._inbox.may_tell(peer, now):  # (told, and logged, at most once a second: a flood is not formatted)
            text = f"{reason}: a message of {size} bytes was dropped unread: {self._drop_cause(peer, reason)}"
            self._refusals.warning(f"inbound/{reason}", f"{peer}: {text}")
            self._tell(sock, routing_id, text, refuse=reason == "too_large")
        self._count_refusals(sock, routing_id, frames, 1, now)

    def _drop_cause(self, peer: str, reason: str) -> str:
        return {"too_large": "it is larger than the learner takes from one peer (transport.peer_inbound_bytes, "
                             f"{self.peer_bytes} bytes): send fewer trajectories per message "
                             "(transport.trajectory_batch)",
                "over_budget": f"the learner holds {self._inbox.queued_of(peer)} bytes of this peer's messages not "
                               f"yet handled (transport.peer_inbound_bytes, {self.peer_bytes}): wait for its acks",
                "inbound_full": "the learner holds transport.inbound_bytes of all peers' messages not yet handled, "
                                "this peer's the most",
                "work_spent": "this peer's messages used the I/O thread's time it may use "
                              "(transport.peer_work_s_per_s): send less often"}[reason]

    def _tell(self, sock: zmq.Socket, routing_id: bytes, text: str, refuse: bool) -> None:
        """Tell the peer on ``routing_id`` why something it sent was not taken: its worker in its next ack. A
        connection that has not said hello is told only what would never pass (``refuse``), with a refusal (a
        rollout worker stops and says why): what a moment's load refused (its hello dropped while the queue
        of connections on probation was full, say) it sends again."""
        with self._rooms.lock:
            worker = self._rooms.registry.of_connection(routing_id)
            if worker is not None:
                worker.rejects.append(text[:256])
                return
        if refuse:
            self._send(sock, routing_id, refusal(f"the learner refused a message it sent: {text}"[:512]))

    def _on_control(self, sock: zmq.Socket, peer: str, routing_id: bytes, frames: list) -> None:
        """A control message from ``peer``, handled; its refusals counted against its connection
        (`PeerThrottle`), which may throttle it (`Membership.throttled`)."""
        now = time.monotonic()
        refused = self.stats["rejected"]
        try:
            self._handle_control(sock, peer, routing_id, frames)
        finally:
            self._count_refusals(sock, routing_id, frames, self.stats["rejected"] - refused, now)

    def _count_refusals(self, sock: zmq.Socket, routing_id: bytes, frames: list, refusals: int, now: float) -> None:
        """Count ``refusals`` (refused or dropped messages) against connection ``routing_id`` (`PeerThrottle`):
        throttled, its worker is told; disconnected, its worker leaves the registry and its TCP connection is
        cut, so what it still sends stops costing this thread a read (it may dial again: a new connection starts
        on probation, and a hello under a banned id or key is answered busy)."""
        rooms = self._rooms
        verdict = rooms.throttle.count(routing_id, refusals, now)
        if verdict is Verdict.OK:
            return
        self.stats[f"throttled/{verdict.value}"] += 1
        with rooms.lock:
            bye = rooms.membership.throttled(routing_id, verdict, now)
        if bye is not None:
            self._send(sock, routing_id, bye)
        if verdict is Verdict.DISCONNECT and (held := hold_connection(frames[-1])) is not None:
            self._cuts.append((now + CUT_AFTER_S, held))  # (after its bye has gone out: `_housekeeping`)

    def _handle_control(self, sock: zmq.Socket, peer: str, routing_id: bytes, frames: list) -> None:
        rooms = self._rooms
        if len(frames) > 2 and routing_id not in rooms.registry.by_routing:
            # a connection that has not said hello may send only a hello (one frame): the rest is refused unread
            rooms.reject("unknown_peer", "a message of several frames from a peer that has not said hello")
            return
        try:
            message = decode(frames[1:], self.limits)
        except ProtocolError as exc:  # counted, and told (rate-limited): an honest sender with a bug learns why
            worker_id = rooms.registry.by_routing.get(routing_id)
            rooms.reject(exc.reason, f"from {worker_id or 'unknown peer'}: {exc}")
            if self._inbox.may_tell(peer, time.monotonic()):
                self._tell(sock, routing_id, f"refused_at_decode: {exc.reason}: {exc}", refuse=True)
            return
        user_id = frames[1].get("User-Id") if self._curve is not None else None
        with rooms.lock:
            if not rooms.registry.key_allowed(user_id):
                rooms.reject("revoked_key", f"{message.kind} from a key no longer in the allowed folder")
                if isinstance(message, Hello):
                    self._send(sock, routing_id, refusal(REVOKED))
                return
            if isinstance(message, Hello):
                answer = rooms.membership.hello(routing_id, message, user_id, time.monotonic(), self._settings,
                                                port_of(self.weights_endpoint))
                if answer is not None:
                    self._send(sock, routing_id, answer)
                return
            worker = rooms.registry.of_connection(routing_id)
            if worker is None:
                rooms.reject("unknown_peer", f"{message.kind} from a peer that has not said hello")
                return
            now = worker.last_seen = time.monotonic()
            if not worker.alive:
                worker.alive = True
                rooms.registry.events("back", "worker %s is back", worker.worker_id)
            if isinstance(message, (TrajectoryBatch, Trajectory)):
                batch = message if isinstance(message, TrajectoryBatch) else TrajectoryBatch([message])
                rooms.intake.take_batch(worker, batch, time.time(), now, rooms.release.store.newest)
                rooms.lock.notify_all()
            elif isinstance(message, Heartbeat):
                if message.sender_id != worker.worker_id:
                    rooms.reject("forged_id", f"heartbeat names {message.sender_id!r} on {worker.worker_id}'s link")
                    return
                rooms.registry.heartbeat(worker, message, now)
            elif isinstance(message, Bye):
                rooms.membership.left(worker, message.failed, message.reason)
                self._answered.add(worker.worker_id)
            else:
                rooms.reject("unexpected_kind", f"{message.kind} is not sent by workers", worker)

    def _housekeeping(self, sock: zmq.Socket, now: float, beat: bool) -> None:
        """Revoke removed keys, time out workers and their incomplete groups, release due notices, and send each
        live worker what it is owed: notices, and an ack when it has acks, refusals, new credit or permits (or
        on the heartbeat)."""
        rooms = self._rooms
        clock_now = self._clock()
        outgoing = []
        while self._cuts and self._cuts[0][0] <= now:
            cut(self._cuts.pop(0)[1])
            self.stats["throttled/connections_cut"] += 1
        with rooms.lock:
            if rooms.registry.keys_due(now) and rooms.registry.reload_keys():
                for routing_id, message in rooms.membership.revoke():
                    self._send(sock, routing_id, message)
            live = []
            for worker in list(rooms.registry.workers.values()):
                if not rooms.membership.check_alive(worker, now):
                    continue
                released = rooms.release.release_due(worker, clock_now)
                if not worker.alive:
                    continue
                if released:
                    outgoing.append((worker.routing_id, rooms.release.notice(worker)))
                live.append(worker)
            rooms.admission.grant_all(now, rooms.intake.waits_on_learner)
            for worker in live:
                limit = rooms.intake.credit_limit(worker, now)
                start_limit = rooms.admission.limit_of(worker)
                if (worker.acks or worker.rejects or limit != worker.last_credit_sent
                        or start_limit != worker.last_start_limit_sent or beat):
                    outgoing.append((worker.routing_id, Ack(worker.acks, worker.rejects, limit, start_limit,
                                                            rooms.admission.threads_for(worker))))
                    worker.acks, worker.rejects, worker.last_credit_sent = [], [], limit
                    worker.last_start_limit_sent = start_limit
            if any(isinstance(m, WeightsNotice) for _, m in outgoing):
                rooms.release.trim()  # released notices may free versions no worker can still be given
            if beat:  # replies ZeroMQ let go of (sent, or dropped with a connection that went) are counted out
                rooms.release.in_flight.settle_all()
        for routing_id, message in outgoing:
            self._send(sock, routing_id, message)

    def _send(self, sock: zmq.Socket, routing_id: bytes, message: Message) -> None:
        send_frames(sock, [routing_id, *encode(message)], self.stats, message.kind)
