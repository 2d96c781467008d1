"""A worker's membership across the rooms of the learner's end: joining (a hello answered with ``ready``, or
refused), rejoining, timing out and leaving the registry. Each event touches every room — the registry's entry,
the incomplete groups it held (`Intake`), its admission permits (`Admission`), its weights link and notices
(`WeightsRelease`) — so it is decided here, once, above them. What is to be sent is returned; the server's I/O
thread sends it. Not thread-safe: the server's lock guards every call.
"""

from __future__ import annotations

import logging
from typing import Any

from heterorl.config import TransportConfig
from heterorl.transport.admission import Admission
from heterorl.transport.intake import Intake
from heterorl.transport.protocol import BYE_BUSY, BYE_REFUSED, Bye, Hello, Message, Ready
from heterorl.transport.registry import Rejections, WorkerInfo, WorkerRegistry
from heterorl.transport.throttle import PeerThrottle, Verdict
from heterorl.transport.weights.release import WeightsRelease

REVOKED = "this worker's key was removed from the learner's allowed keys"


def refusal(why: str) -> Bye:
    """Tells a peer it may not join (`BYE_REFUSED`): a rollout worker stops with ``why``."""
    return Bye("learner", f"{BYE_REFUSED}{why}")


class Membership:
    """Joins and departures over the four rooms."""

    def __init__(self, config: TransportConfig, registry: WorkerRegistry, intake: Intake, admission: Admission,
                 release: WeightsRelease, reject: Rejections, throttle: PeerThrottle) -> None:
        self.config, self.registry, self.intake = config, registry, intake
        self.admission, self.release, self._reject, self.throttle = admission, release, reject, throttle

    def hello(self, routing_id: bytes, hello: Hello, user_id: str | None, now: float, settings: dict[str, Any],
              weights_port: int) -> Message | None:
        """The answer to ``hello`` on connection ``routing_id`` (signed by CURVE key ``user_id``): ``ready`` with
        ``settings`` (the run's) and the learner's weights ports, a refusal (its id is another key's, its layout
        does not fit) or busy (the registry is full of live workers, or the CURVE key holds ``max_ids_per_key`` live
        ids); None for a hello repeated within half a ``hello_interval_s`` of its ready (a flood of them is answered
        once). One connection is one worker: an entry under another id on it is replaced."""
        registry = self.registry
        banned_s = self.throttle.banned_for([hello.worker_id, user_id or ""], now)
        if banned_s:
            self._reject("banned", f"hello from {hello.worker_id!r}, disconnected for its refusals")
            return Bye("learner", f"{BYE_BUSY}this worker was disconnected for the rate of its refused messages; "
                       f"say hello in {banned_s:.0f} s")
        worker = registry.workers.get(hello.worker_id)
        if worker is not None and not registry.owns(worker, user_id):
            self._reject("forged_id", f"worker id {hello.worker_id!r} belongs to another key")
            return refusal("worker id taken by another key")
        if (worker is not None and worker.alive and worker.routing_id == routing_id and not worker.heard_in_session
                and worker.pid == hello.pid):
            # a hello sent again before the answer to the first arrived (a link slower than hello_interval_s, a
            # connection still being set up): the same session's ready again, not a rejoin
            registry.stats["hellos_repeated"] += 1
            worker.last_seen = now
            if now - worker.ready_at < self.config.hello_interval_s / 2:  # (answered a moment ago: once is enough)
                registry.stats["hellos_repeated/unanswered"] += 1
                return None
            return self._ready(worker, settings, weights_port, now)
        previous = registry.by_routing.get(routing_id)
        if previous is not None and previous != hello.worker_id:
            self.evict(registry.workers[previous], f"its connection said hello as {hello.worker_id!r}", "replaced")
        if worker is None and user_id is not None and not self._key_has_room(user_id, now):
            n = len(registry.ids_of_key(user_id))
            self._reject("key_full", f"hello from {hello.worker_id!r}: its key holds {n} live worker ids")
            return Bye("learner", f"{BYE_BUSY}this worker's key already holds {n} live worker ids "
                       f"(transport.max_ids_per_key); a place frees when one of them has been silent for "
                       f"transport.heartbeat_timeout_s ({self.config.heartbeat_timeout_s:g} s)")
        why = self.release.layout_refusal(hello.layout)
        if why is not None:
            self._reject("bad_layout", f"hello from {hello.worker_id!r}: {why}")
            return refusal(why)
        if worker is None and registry.full() and not self._make_room(now):
            self._reject("registry_full", f"hello from {hello.worker_id!r}: {len(registry.workers)} live workers")
            return Bye("learner", f"{BYE_BUSY}the learner's registry is full ({len(registry.workers)} live workers, "
                       "transport.max_workers); a place frees when a worker has been silent for "
                       f"transport.heartbeat_timeout_s ({self.config.heartbeat_timeout_s:g} s)")
        if worker is not None:  # a new session: what the old one held goes back
            self.admission.reclaim(worker)  # permits it never used, to the fleet
            self.intake.drop_groups(worker, "group_abandoned", "its worker said hello again")  # never completed
        worker = registry.join(hello, routing_id, user_id, now)
        self.admission.start_session(worker)
        self.release.start_session(worker)
        return self._ready(worker, settings, weights_port, now)

    def _ready(self, worker: WorkerInfo, settings: dict[str, Any], weights_port: int, now: float) -> Ready:
        """The ``ready`` of ``worker``'s current session."""
        worker.ready_at = now
        worker.last_credit_sent = self.intake.credit_limit(worker, now)
        return Ready(worker_id=worker.worker_id, credits=worker.last_credit_sent,
                     newest_version=worker.released_version, heartbeat_interval_s=self.config.heartbeat_interval_s,
                     settings={**settings, "weights_port": weights_port, "start_limit": self.admission.first_limit(),
                               **self.release.session_settings(worker),
                               **self.release.shard_settings()})

    def _make_room(self, now: float) -> bool:
        """Registry full: remove the worker silent longest among those taken for dead; False when all live."""
        oldest = self.registry.longest_silent_dead()
        if oldest is None:
            return False
        self.evict(oldest, f"the registry is full and it has been silent for {now - oldest.last_seen:.0f} s",
                   "made_room")
        return True

    def _key_has_room(self, user_id: str, now: float) -> bool:
        """Whether CURVE key ``user_id`` may register one more worker id: it holds fewer than
        ``max_ids_per_key``, or one of them taken for dead makes room (the one silent longest is removed)."""
        mine = self.registry.ids_of_key(user_id)
        if len(mine) < self.config.max_ids_per_key:
            return True
        oldest = self.registry.longest_silent_dead(mine)
        if oldest is None:
            return False
        self.evict(oldest, f"its key holds transport.max_ids_per_key ids and it has been silent for "
                   f"{now - oldest.last_seen:.0f} s", "key_full")
        return True

    def left(self, worker: WorkerInfo, failed: bool, reason: str) -> None:
        """``worker`` said bye: it is taken for dead (``failed``: it will not come back)."""
        worker.alive, worker.failed = False, failed
        self.admission.reclaim(worker)
        self.registry.events("left", "worker %s left: %s", worker.worker_id, reason[:200])

    def evict(self, worker: WorkerInfo, why: str, reason: str) -> None:
        """Remove ``worker`` from the registry: its incomplete groups are dropped, its unused permits go back
        to the fleet, its counters into `fleet_totals`; its id is free again (and no longer bound to its key)."""
        self.intake.drop_groups(worker, "worker_removed", why)
        self.admission.reclaim(worker)
        self.registry.remove(worker, why, reason)
        self.release.forget(worker.worker_id)

    def throttled(self, routing_id: bytes, verdict: Verdict, now: float) -> Message | None:
        """Connection ``routing_id`` was throttled (``verdict``): its worker is told so in its next ack, or, at
        `Verdict.DISCONNECT`, removed from the registry, its id and key refused for the back-off, and the bye
        returned to send."""
        backoff = self.throttle.backoff_s(routing_id)
        why = (f"more than transport.max_refusals_per_s ({self.config.max_refusals_per_s}) of its messages "
               "refused within a second")
        worker = self.registry.of_connection(routing_id)
        name = worker.worker_id if worker is not None else "a peer that has not said hello"
        self.registry.events("throttled", "%s %s for %g s: %s", name, verdict.value, backoff, why,
                             level=logging.WARNING)
        if worker is None:
            return None
        if verdict is Verdict.THROTTLED:
            worker.rejects.append(f"throttled: its messages are discarded unread for {backoff:g} s: {why}")
            return None
        self.throttle.ban([worker.worker_id, worker.public_key or ""], now + backoff)
        self.evict(worker, why, "throttled")
        return Bye("learner", f"{BYE_BUSY}disconnected for {backoff:g} s: {why}")

    def check_alive(self, worker: WorkerInfo, now: float) -> bool:
        """Time out what ``worker`` holds: itself (dead after ``heartbeat_timeout_s`` of silence, removed from
        the registry after ``worker_expiry_s``) and its incomplete groups (after ``group_timeout_s``). False
        when it was removed."""
        if self.registry.mark_dead_if_silent(worker, now):
            self.admission.reclaim(worker)
        if self.registry.expired(worker, now):
            self.evict(worker, f"silent for {now - worker.last_seen:.0f} s (transport.worker_expiry_s)", "expired")
            return False
        self.intake.expire_groups(worker, now)
        return True

    def revoke(self) -> list[tuple[bytes, Message]]:
        """Remove every worker whose key is no longer allowed; the refusals to send its live ones."""
        refusals = []
        for worker in self.registry.revoked():
            self.registry.stats["revoked"] += 1
            if worker.alive:
                refusals.append((worker.routing_id, refusal(REVOKED)))
            self.evict(worker, "its key was removed from the allowed keys", "revoked")
        return refusals
