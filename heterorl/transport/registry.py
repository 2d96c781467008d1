"""The learner's worker registry: who is connected (`WorkerInfo`, by worker id and by connection), who is alive,
who may join (the allowed CURVE keys, re-read every ``keys_reload_s``), and the refusals each worker is told.

One connection is one worker (a hello under a new id replaces the old entry). A worker silent for
``heartbeat_timeout_s`` is taken for dead; one silent for ``worker_expiry_s`` leaves the registry, and when
``max_workers`` are registered the dead one silent longest makes room for a newcomer. Its counters then go into
the fleet's totals (`fleet_totals`). What a peer names is bounded: the reward outcome names kept
(`outcomes.OutcomeNames`), the ids of one CURVE key (`ids_of_key`, ``max_ids_per_key``: `Membership`), the
membership log lines (`PacedLog`). The bottom room of the learner's end (heterorl.transport.server): the others
read `WorkerInfo`; this module reads none of them. Not thread-safe: the server's lock guards every call.
"""

from __future__ import annotations

import logging
import socket as pysocket
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from zmq.auth.thread import ThreadAuthenticator

from heterorl.config import TransportConfig
from heterorl.delay.queue import DelayQueue
from heterorl.transport.outcomes import OutcomeNames
from heterorl.transport.protocol import Heartbeat, Hello
from heterorl.transport.weights.reshard import DestLayout, layout_key

log = logging.getLogger("heterorl.transport")

HOST = pysocket.gethostname()  # a worker whose hello names this host shares the learner's machine
# per-worker counters `fleet_totals` sums (and the most of ``weights_arrival_max_s``)
_TOTALS = ("trajectories", "duplicates", "busy_s", "idle_s", "weights_arrived", "weights_arrival_s")
_LIVE_ONLY = ("pending_notices", "acks", "rejects", "poisoned_groups", "outcomes_said")  # left out of a `snapshot`


class RateLimitedLog:
    """Log the first few events of each reason, then every 1,000th (a flood must not flood the log)."""

    def __init__(self, what: str = "rejected message", level: int = logging.WARNING) -> None:
        self.counts: Counter = Counter()
        self.what, self.level = what, level

    def __call__(self, reason: str, message: str) -> None:
        self.counts[reason] += 1
        n = self.counts[reason]
        if n <= 5 or n % 1000 == 0:
            log.log(self.level, "%s (%s, #%d): %s", self.what, reason, n, message)


class PacedLog:
    """Log a peer's membership events (joined, rejoined, back, left, dead) at most ``burst`` lines of each kind at
    once, then one per ``interval_s``; the next line logged says how many were left out. An honest fleet's
    events are all logged; a flood of hellos, byes or ids is not (docs/RELIABILITY.md, "Maps a peer fills")."""

    def __init__(self, burst: int = 20, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.interval_s, self._clock = burst, interval_s, clock
        self._allowance: dict[str, tuple[float, float]] = {}  # kind (the code's, never a peer's) → (lines, when)
        self.left_out: Counter = Counter()  # by kind, since its last line

    def __call__(self, kind: str, fmt: str, *args, level: int = logging.INFO) -> None:
        now = self._clock()
        lines, when = self._allowance.get(kind, (float(self.burst), now))
        lines = min(float(self.burst), lines + (now - when) / self.interval_s)
        if lines < 1:
            self._allowance[kind] = (lines, now)
            self.left_out[kind] += 1
            return
        self._allowance[kind] = (lines - 1, now)
        skipped = self.left_out.pop(kind, 0)
        log.log(level, fmt + (f" ({skipped} more '{kind}' lines left out)" if skipped else ""), *args)


class Rejections:
    """A refusal is counted in ``stats`` (``rejected``, ``rejected/<reason>``), logged (rate-limited) and, for a
    trajectory, told to its worker in its next ack."""

    def __init__(self, stats: Counter) -> None:
        self.stats = stats
        self._log = RateLimitedLog()

    def __call__(self, reason: str, message: str, worker: WorkerInfo | None = None, trajectory_id: str = "") -> None:
        self.stats["rejected"] += 1
        self.stats[f"rejected/{reason}"] += 1
        self._log(reason, message)
        if worker is not None and trajectory_id:
            worker.rejects.append(f"{trajectory_id}: {reason}: {message}"[:256])


@dataclass
class WorkerInfo:
    """The learner's view of one worker (each room of the server keeps its part here)."""

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
    ready_at: float = float("-inf")  # when the learner last answered its hello with ready (its monotonic clock)
    heard_in_session: bool = False  # it sent a heartbeat this session (its first message after ready): a hello
    # from it now is a rejoin, not a hello repeated before its ready arrived
    weights_lagging: bool = False  # its weights lag the newest by more than the admission's max_lag (no permits)
    released_version: int = -1  # newest weights version released to it (after the weights delay)
    noticed_version: int = -1  # the newest version whose notice was scheduled: its next costs the steps since
    waiting_version: int = -1  # the newest version published while its bandwidth-limited link was busy
    alive: bool = True
    pending_notices: DelayQueue[int] = field(default_factory=DelayQueue)  # versions, due when their notice arrives
    acks: list = field(default_factory=list)
    rejects: list = field(default_factory=list)
    last_credit_sent: int = -1
    busy_s: float = 0.0  # the worker's cumulative seconds generating (from its heartbeats, clipped: `heartbeat`)
    idle_s: float = 0.0  # ... and waiting for credit, permits or weights
    timings_said: tuple = (0.0, 0.0)  # (busy_s, idle_s) as its latest heartbeat said them (its process's own)
    timing_allowance: float = 0.0  # seconds of busy + idle it may still claim (`WorkerRegistry.heartbeat`)
    timing_allowance_at: float = -1.0  # when that allowance was last topped up (-1: no heartbeat yet)
    owing_s: float = 0.0  # seconds this session it owed a group and nothing held it back (`Admission.grant_all`)
    groups_session: int = 0  # groups whose first trajectory arrived this session
    reward_outcomes: dict = field(default_factory=dict)  # its process's programs run by outcome (heartbeats; folded)
    outcomes_said: dict = field(default_factory=dict)  # ... as its latest heartbeat said them (at most 64 names)
    outcomes_before: Counter = field(default_factory=Counter)  # ... and its earlier processes' under this id
    weights_arrived: int = 0  # versions its processes had whole, timed from their publish (heartbeats) ...
    weights_arrival_s: float = 0.0  # ... the sum of those seconds, and the most
    weights_arrival_max_s: float = 0.0
    arrivals_said: tuple = (0, 0.0)  # (count, seconds) as its latest heartbeat said them (its process's own)
    arrivals_before: tuple = (0, 0.0)  # ... and its earlier processes' under this id
    last_group_id: str = ""
    starts_granted_session: int = 0  # admission permits granted this session (cumulative)
    starts_reported: int = -1  # permits it has used this session, as its latest heartbeat said (-1: none said)
    start_limit_told: int = 0  # the highest start limit told this session: it may start no more groups
    permits_voided: int = 0  # of starts_granted_session, taken back since (`Admission._held`)
    permits_reusable: int = 0  # of those, the ones it never used (granted again without a new start limit)
    groups_completed_session: int = 0  # its groups completed this session (queued for the learner)
    groups_dropped_session: int = 0  # ... started and then refused or dropped
    first_permit_at: float = -1.0  # when it was granted its first permit this session (-1: not yet)
    first_completed_at: float = 0.0  # when its first and latest groups completed (the learner's monotonic clock)
    last_completed_at: float = 0.0
    lease_from: float = 0.0  # its lease clock runs from here (`Admission.delivering`)
    probation_since: float = -1.0  # when it was granted the probation permit it holds (-1: none)
    probation_group: str = ""  # the group it spent that permit on ("": not yet)
    permit_expiries: int = 0  # its probation permits expired in a row (its back-off doubles)
    permits_backoff_until: float = 0.0  # no probation permit before this
    last_start_limit_sent: int = -2
    poisoned_groups: OrderedDict = field(default_factory=OrderedDict)  # recent group ids with a rejected member
    open_bytes: int = 0  # in a snapshot (`LearnerServer.workers`): the bytes its incomplete groups hold
    rate_tokens: float = 0.0  # transport.max_trajectories_per_s: trajectories it may still send (a token bucket)
    rate_refilled: float = 0.0

    def start_rate(self) -> float | None:
        """Groups completed this session per second it owed one (held a permit it had not turned into a group,
        none of its groups waiting for the learner): its speed as the learner measured it, from the groups that
        arrived and when — never from what the worker says (None until it has owed for half a second and
        completed a group)."""
        done = self.groups_completed_session
        return done / self.owing_s if self.owing_s > 0.5 and done else None

    def credit_limit(self, window: int, rate_room: float = float("inf")) -> int:
        return self.received_session + int(max(0, min(window - self.buffered, rate_room)))


class WorkerRegistry:
    """The workers by id (``workers``) and by connection (``by_routing``), the totals of those removed, and the
    allowed keys (``auth``: the server's CURVE authenticator, None without CURVE)."""

    def __init__(self, config: TransportConfig, stats: Counter, allowed_keys_dir: str | None = None) -> None:
        self.config, self.stats = config, stats
        self.workers: dict[str, WorkerInfo] = {}
        self.by_routing: dict[bytes, str] = {}
        self.started = time.monotonic()  # (a version's arrival said in a heartbeat is at most the run's age)
        self._departed: Counter = Counter()  # `_TOTALS` of the workers removed from the registry
        self._departed_outcomes: Counter = Counter()  # and their `reward_outcomes`
        self._departed_arrival_max_s = 0.0  # and the most of their `weights_arrival_max_s`
        self.auth: ThreadAuthenticator | None = None
        self._allowed_dir = allowed_keys_dir
        self._allowed_keys: set[str] | None = None  # z85 public keys allowed in (CURVE only)
        self._keys_signature, self._keys_checked = None, 0.0  # (the allowed keys' files, when last read)
        self._removal_log = RateLimitedLog("worker removed from the registry", logging.INFO)
        self.outcome_names = OutcomeNames()
        self.events = PacedLog()  # membership events' log lines

    # -- who is who -------------------------------------------------------------------------------
    def of_connection(self, routing_id: bytes) -> WorkerInfo | None:
        worker_id = self.by_routing.get(routing_id)
        return self.workers.get(worker_id) if worker_id else None

    def key_allowed(self, user_id: str | None) -> bool:
        """Whether a message signed by CURVE key ``user_id`` may be served (None: no CURVE)."""
        return user_id is None or user_id in self._allowed_keys

    def owns(self, worker: WorkerInfo, user_id: str | None) -> bool:
        """Whether ``user_id`` may speak for ``worker``: a worker id is bound to the key that first used it."""
        return user_id is None or worker.public_key in (None, user_id)

    def full(self) -> bool:
        return len(self.workers) >= self.config.max_workers

    def ids_of_key(self, user_id: str) -> list[WorkerInfo]:
        """The entries registered by CURVE key ``user_id`` (at most ``max_ids_per_key``)."""
        return [w for w in self.workers.values() if w.public_key == user_id]

    def longest_silent_dead(self, among: list[WorkerInfo] | None = None) -> WorkerInfo | None:
        """The worker silent longest among those taken for dead (of ``among``, default all): a full registry's,
        or a key's at ``max_ids_per_key``, candidate to make room."""
        dead = [w for w in (self.workers.values() if among is None else among) if not w.alive]
        return min(dead, key=lambda w: w.last_seen) if dead else None

    # -- joining and leaving ----------------------------------------------------------------------
    def join(self, hello: Hello, routing_id: bytes, user_id: str | None, now: float) -> WorkerInfo:
        """The entry of the worker ``hello`` names, new or rejoining on ``routing_id``, its session begun."""
        worker = self.workers.get(hello.worker_id)
        if worker is None:
            worker = WorkerInfo(worker_id=hello.worker_id, host=hello.host, pid=hello.pid, routing_id=routing_id,
                                public_key=user_id, joined_at=now, last_seen=now,
                                rate_tokens=self.config.credits_per_worker, rate_refilled=now)
            self.workers[hello.worker_id] = worker
            self.events("joined", "worker %s joined from %s (pid %d)", hello.worker_id, hello.host, hello.pid)
        else:
            if worker.routing_id != routing_id:
                self.by_routing.pop(worker.routing_id, None)
                self.events("rejoined", "worker %s rejoined from %s (pid %d)", hello.worker_id, hello.host,
                            hello.pid)
            elif not worker.alive:  # taken for dead, it said hello again on its connection (a frozen host thawed)
                self.events("back", "worker %s is back (hello again)", hello.worker_id)
            worker.routing_id, worker.host, worker.pid = routing_id, hello.host, hello.pid
        self.by_routing[routing_id] = hello.worker_id
        worker.last_seen, worker.alive, worker.version_held = now, True, hello.version_held
        worker.engine, worker.failed = hello.engine, False
        worker.layout, worker.layout_key = hello.layout, layout_key(DestLayout.from_dict(hello.layout))
        worker.received_session, worker.heard_in_session = 0, False
        return worker

    def heartbeat(self, worker: WorkerInfo, beat: Heartbeat, now: float) -> None:
        """Take in ``beat`` at ``now`` (the learner's monotonic clock). What it says of time is clipped to what
        the learner can check: the seconds busy and idle it adds, to the time that passed (an allowance that grows
        a second a second, at most `heartbeat_timeout_s` ahead); a version's arrival, to the run's age."""
        worker.version_held, worker.heard_in_session = beat.version_held, True
        timings = (beat.busy_s, beat.idle_s)
        new_process = timings[0] < worker.timings_said[0] or timings[1] < worker.timings_said[1]
        busy, idle = timings if new_process else (timings[0] - worker.timings_said[0],
                                                  timings[1] - worker.timings_said[1])
        worker.timings_said = timings
        cap = self.config.heartbeat_timeout_s
        if worker.timing_allowance_at < 0:
            worker.timing_allowance = cap
        else:
            worker.timing_allowance = min(cap, worker.timing_allowance + now - worker.timing_allowance_at)
        worker.timing_allowance_at = now
        scale = min(1.0, worker.timing_allowance / (busy + idle)) if busy + idle > 0 else 1.0
        if scale < 1.0:
            self.stats["heartbeats/timings_clipped"] += 1
        worker.busy_s += busy * scale
        worker.idle_s += idle * scale
        worker.timing_allowance -= (busy + idle) * scale
        worker.starts_reported = beat.groups_started
        # cumulative over the worker's process: lower counts come from a new process under the same id, so the
        # previous process's counts are kept aside. Compared by the names it said; kept by the names it may hold
        # (`OutcomeNames`: the learner's map of names is bounded, whatever a peer invents)
        said = beat.reward_outcomes
        if any(said.get(name, 0) < count for name, count in worker.outcomes_said.items()):
            worker.outcomes_before.update(worker.reward_outcomes)
        worker.outcomes_said = said
        worker.reward_outcomes = self.outcome_names.fold(said, worker.worker_id)
        age = now - self.started  # no version arrived later than the run is old
        arrived = (beat.weights_arrived, min(beat.weights_arrival_s, beat.weights_arrived * age))
        if arrived[0] < worker.arrivals_said[0]:  # a new process under the same id: its counts start at 0
            worker.arrivals_before = tuple(a + b for a, b in zip(worker.arrivals_before, worker.arrivals_said))
        worker.arrivals_said = arrived
        worker.weights_arrived = worker.arrivals_before[0] + arrived[0]
        worker.weights_arrival_s = worker.arrivals_before[1] + arrived[1]
        worker.weights_arrival_max_s = max(worker.weights_arrival_max_s, min(beat.weights_arrival_max_s, age))

    def mark_dead_if_silent(self, worker: WorkerInfo, now: float) -> bool:
        """Take a live worker silent for ``heartbeat_timeout_s`` for dead; True when it just died."""
        silent = now - worker.last_seen
        if not worker.alive or silent <= self.config.heartbeat_timeout_s:
            return False
        worker.alive = False
        self.events("dead", "worker %s silent for %.1f s: marked dead", worker.worker_id, silent,
                    level=logging.WARNING)
        return True

    def expired(self, worker: WorkerInfo, now: float) -> bool:
        """A dead worker silent for ``worker_expiry_s``: it is to leave the registry."""
        return not worker.alive and now - worker.last_seen > self.config.worker_expiry_s

    def remove(self, worker: WorkerInfo, why: str, reason: str) -> None:
        """Remove ``worker``: its counters go into `fleet_totals`; its id is free again (and no longer bound to its
        key). Counted in ``stats["workers_removed/<reason>"]``."""
        for name in _TOTALS:
            self._departed[name] += getattr(worker, name)
        self._departed_arrival_max_s = max(self._departed_arrival_max_s, worker.weights_arrival_max_s)
        self._departed_outcomes.update(worker.outcomes_before)
        self._departed_outcomes.update(worker.reward_outcomes)
        del self.workers[worker.worker_id]
        if self.by_routing.get(worker.routing_id) == worker.worker_id:
            del self.by_routing[worker.routing_id]
        self.stats["workers_removed"] += 1
        self.stats[f"workers_removed/{reason}"] += 1
        self._removal_log(reason, f"{worker.worker_id}: {why}")

    # -- the allowed keys -------------------------------------------------------------------------
    def keys_due(self, now: float) -> bool:
        """Time to re-read the allowed keys (every ``keys_reload_s``, with CURVE only)."""
        if self.auth is None or now - self._keys_checked < self.config.keys_reload_s:
            return False
        self._keys_checked = now
        return True

    def reload_keys(self) -> bool:
        """(Re)read the allowed-keys folder when its *.key files changed: the authenticator then refuses new
        connections by a removed key, and `key_allowed` the live ones (`revoked`). A folder that cannot be
        read leaves the keys read last in force (the authenticator logs why). True when the keys changed."""
        folder = Path(self._allowed_dir)
        try:
            signature = sorted((path.name, path.stat().st_mtime_ns, path.stat().st_size)
                               for path in folder.glob("*.key"))
        except OSError:
            signature = None
        if signature == self._keys_signature and self._allowed_keys is not None:
            return False
        self._keys_signature = signature
        self.auth.configure_curve(domain="*", location=str(folder))
        keys = {key.decode("ascii") for key in self.auth.certs.get("*", {})}
        changed = keys != self._allowed_keys
        self._allowed_keys = keys
        return changed

    def revoked(self) -> list[WorkerInfo]:
        """The workers whose key is no longer allowed."""
        return [w for w in self.workers.values() if w.public_key not in self._allowed_keys]

    # -- what the registry reports ----------------------------------------------------------------
    def snapshot(self, open_bytes: Callable[[str], int]) -> list[WorkerInfo]:
        """Copies of the entries, with the bytes of each worker's incomplete groups (``open_bytes(worker_id)``)."""
        fields = [k for k in WorkerInfo.__dataclass_fields__ if k not in _LIVE_ONLY]
        return [WorkerInfo(**{**{k: getattr(w, k) for k in fields}, "open_bytes": open_bytes(w.worker_id)})
                for w in self.workers.values()]

    def reward_outcomes(self) -> dict[str, int]:
        totals = Counter(self._departed_outcomes)
        for worker in self.workers.values():
            totals.update(worker.outcomes_before)
            totals.update(worker.reward_outcomes)
        return dict(sorted(totals.items()))

    def fleet_totals(self) -> dict[str, float]:
        totals = Counter(self._departed)
        for worker in self.workers.values():
            for name in _TOTALS:
                totals[name] += getattr(worker, name)
        arrival_max = max([self._departed_arrival_max_s, *(w.weights_arrival_max_s for w in self.workers.values())])
        return {**{name: totals[name] for name in _TOTALS}, "weights_arrival_max_s": arrival_max}
