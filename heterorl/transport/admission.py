"""Admission control at the learner's end: how many groups the fleet may start (the cap the learner sets), how
many permits each worker may hold unused (its share of ``ahead``, by its measured speed), and the threads
advised to workers on the learner's machine.

A worker's start limit is cumulative over its session, as credit is: it travels in every ack, so a lost ack costs
nothing. A group counts as started when its first member arrives (`count_start`), or, by the worker's heartbeats,
when it is on its way; permits a dead or rejoining worker never used go back to the fleet (`reclaim`), and a
group started but refused or dropped widens the cap by one (`count_refused`): it will never be trained.
Not thread-safe: the server's lock guards every call.
"""

from __future__ import annotations

from heterorl.transport.registry import HOST, WorkerInfo, WorkerRegistry


def permit_share(rate: float | None, fleet: tuple[float, int] | None, ahead: int) -> int:
    """The unused admission permits a worker of speed ``rate`` may hold, ``fleet`` being (the live workers'
    summed speeds, their number): ``ahead`` each until every live worker's speed is measured (``fleet`` None);
    then the fleet's ``ahead`` × workers shared in proportion to their speeds (at least 1), so that a slow worker
    starts no more groups than it finishes while a fast one would (and its groups stay as fresh)."""
    if fleet is None or rate is None:
        return ahead
    total, workers = fleet
    return max(1, round(ahead * workers * rate / total))


class Admission:
    """The fleet's permits: ``cap`` groups in all (None: no admission control), ``granted`` so far, ``refused``
    (started, never to be trained), ``ahead`` unused ones per worker at most."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self.cap: int | None = None  # total groups the fleet may start (None: no admission control)
        self.granted = 0
        self.refused = 0  # groups started on a permit and refused whole: they widen the admission cap
        self.ahead, self.local_threads = 1, 0  # permits a worker may hold; threads advised (0: none)

    def set(self, cap: int | None, ahead: int) -> None:
        self.cap, self.ahead = cap, max(1, ahead)

    def start_session(self, worker: WorkerInfo) -> None:
        worker.groups_session = worker.starts_granted_session = 0
        worker.busy_base, worker.starts_reported = worker.busy_s, -1
        worker.last_start_limit_sent = -2

    def first_limit(self) -> int:
        """The start limit a joining worker is told in ``ready`` (−1: no admission control)."""
        return -1 if self.cap is None else 0

    def threads_for(self, worker: WorkerInfo) -> int:
        """The torch threads advised to ``worker``: those set for workers on the learner's host (0: none)."""
        return self.local_threads if worker.host == HOST else 0

    def permits_left(self) -> int | None:
        """Permits not yet granted plus those the live workers hold unused (None: no admission control)."""
        if self.cap is None:
            return None
        pool = self.cap + self.refused - self.granted
        held = sum(max(0, w.starts_granted_session - self._used(w)) for w in self.registry.workers.values()
                   if w.alive)
        return max(0, pool) + held

    def _used(self, worker: WorkerInfo) -> int:
        """The admission permits ``worker`` has used this session: its groups arrived, or, as its heartbeats say,
        more (groups still on their way) — believed up to 4 × ``ahead`` beyond those arrived, so a worker that
        claims permits it never uses holds a bounded number of them back from the fleet."""
        reported = min(worker.starts_reported, worker.groups_session + 4 * self.ahead, worker.starts_granted_session)
        return max(worker.groups_session, reported)

    def state_line(self) -> str:
        if self.cap is None:
            return "no admission control"
        held = ", ".join(f"{w.worker_id}{'' if w.alive else ' (dead)'} {w.groups_session}/"
                         f"{w.starts_granted_session}" for w in self.registry.workers.values())
        return f"permits {self.granted}/{self.cap} granted; started/granted: {held}"

    def count_start(self, worker: WorkerInfo, group_id: str) -> None:
        """A worker sends each group's members back to back: a new group id is a new start (a re-sent duplicate
        is none, so callers count only new trajectories)."""
        worker.groups_session += 1
        worker.last_group_id = group_id
        if self.cap is not None and worker.groups_session > worker.starts_granted_session:
            # started on a permit reclaimed since (the worker was thought dead): it counts all the same
            worker.starts_granted_session += 1
            self.granted += 1

    def count_refused(self) -> None:
        """A group was started (and counted) but will never be trained: the cap widens by one."""
        self.refused += 1

    def reclaim(self, worker: WorkerInfo) -> None:
        """Return a dead or rejoining worker's unused permits to the fleet, so permits held by a worker that never
        comes back cannot stall the learner."""
        unused = worker.starts_granted_session - worker.groups_session
        if unused > 0:
            self.granted -= unused
            worker.starts_granted_session = worker.groups_session

    def fleet_rate(self) -> tuple[float, int] | None:
        """The live workers' summed `WorkerInfo.start_rate` and their number; None without admission control,
        while one of them is unmeasured, or when only one is alive (nothing to share)."""
        if self.cap is None:
            return None
        rates = [w.start_rate() for w in self.registry.workers.values() if w.alive]
        return None if len(rates) < 2 or None in rates else (sum(rates), len(rates))

    def grant(self, worker: WorkerInfo, fleet_rate: tuple[float, int] | None = None) -> int:
        """The worker's cumulative start limit this session: −1 without admission control; else top its unused
        permits up to its share (`permit_share`) while the fleet's total stays within the cap."""
        if self.cap is None:
            return -1
        # groups started on their way count as used (by its heartbeats), so a link's latency does not cap its rate
        unused = worker.starts_granted_session - self._used(worker)
        grant = min(permit_share(worker.start_rate(), fleet_rate, self.ahead) - unused,
                    self.cap + self.refused - self.granted)
        if grant > 0:
            worker.starts_granted_session += grant
            self.granted += grant
        return worker.starts_granted_session
