"""Admission control at the learner's end: how many groups the fleet may start (the cap the learner sets), how
many permits each worker may hold unused, and the threads advised to workers on the learner's machine.

Permits are leases, not gifts (docs/RELIABILITY.md, "Permits are leases"). A worker is *delivering* while it has
completed a group within its lease (`lease_s`: four times its measured seconds between completed groups, within
``permit_lease_min_s`` … ``permit_lease_s``); only a delivering worker holds its share of ``ahead`` (by its
speed, `permit_share`). Any other worker is *on probation*: it may hold one permit, granted beyond the cap
while unused (so a peer that holds one takes nothing from the delivering workers; the group started on it is
the cap's), and at most ``probation_permits`` probation permits are out at once. A probation permit neither used nor its
group completed within ``permit_lease_s``, or spent on a group that is dropped, expires, and its worker waits a
back-off (doubling) before the next. A worker that stops delivering gives back its unused permits. A heartbeat's
claim of groups on their way is believed only up to what arrived + ``ahead``; a group beyond the start limit the
worker was told is refused (`over_start_limit`, in `heterorl.transport.intake`).

A worker's start limit is cumulative over its session, as credit is: it travels in every ack, so a lost ack costs
nothing. A group counts as started when its first member arrives (`count_start`), or, by the worker's heartbeats,
when it is on its way; permits a dead or rejoining worker never used go back to the fleet (`reclaim`), and a
group started on a permit of the cap but refused or dropped widens the cap by one (`count_dropped`): it will
never be trained. Not thread-safe: the server's lock guards every call.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from heterorl.config import TransportConfig
from heterorl.transport.registry import HOST, WorkerInfo, WorkerRegistry

_MAX_BACKOFF_S = 600.0  # a probation worker's back-off after expired permits doubles up to this


def permit_share(rate: float | None, fleet: tuple[float, int] | None, ahead: int) -> int:
    """The unused admission permits a worker of speed ``rate`` may hold, ``fleet`` being (the delivering workers'
    summed speeds, their number): ``ahead`` each until every one's speed is measured (``fleet`` None); then the
    fleet's ``ahead`` × workers shared in proportion to their speeds (at least 1), so that a slow worker starts
    no more groups than it finishes while a fast one would (and its groups stay as fresh)."""
    if fleet is None or rate is None:
        return ahead
    total, workers = fleet
    return max(1, round(ahead * workers * rate / total))


def share_out(wants: list[int], pool: int, turn: int) -> tuple[list[int], int]:
    """``pool`` permits shared among workers wanting ``wants``, and whose turn is next: each its want when the
    pool has them all; otherwise in proportion to the wants (so to speed: a want is a share of the cap less what
    is held unused), the remainder one each in turn from the worker at ``turn`` (modulo their number), the turn
    passing on with each. Before, the pool went to the workers in the registry's order: while the learner was
    the bottleneck and the pool short, the first to join took most of it."""
    total = sum(wants)
    if total <= pool:
        return list(wants), turn
    given = [pool * want // total for want in wants]
    left = pool - sum(given)
    while left > 0:  # ends: the wants exceed the pool
        turn %= len(wants)
        if given[turn] < wants[turn]:
            given[turn] += 1
            left -= 1
        turn += 1
    return given, turn


class Admission:
    """The fleet's permits: ``cap`` groups in all (None: no admission control), ``granted`` so far, ``refused``
    (started on a permit of the cap, never to be trained), ``ahead`` unused ones per delivering worker at most;
    none for a worker whose weights are more than ``max_lag`` versions older than the newest released to it until
    it has caught up."""

    def __init__(self, registry: WorkerRegistry, config: TransportConfig, stats: Counter) -> None:
        self.registry, self.config, self.stats = registry, config, stats
        self.cap: int | None = None  # total groups the fleet may start (None: no admission control)
        self.granted = 0
        self.refused = 0  # groups started on a permit and refused whole: they widen the admission cap
        self.probation_unused = 0  # probation permits held unused: beyond the cap (a group started on one is its)
        self.ahead, self.local_threads = 1, 0  # permits a worker may hold; threads advised (0: none)
        self.max_lag: int | None = None  # versions a worker's weights may lag its newest and still get permits
        self.awaited_version = -1  # sync mode: the version every worker waits for before it may sample again
        self._turn = 0  # whose turn it is to get a permit first when the pool is short (`share_out`)
        self._granted_at: float | None = None  # when `grant_all` last ran (the lease clocks' tick)

    def set(self, cap: int | None, ahead: int, max_lag: int | None = None) -> None:
        self.cap, self.ahead, self.max_lag = cap, max(1, ahead), max_lag

    def await_version(self, version: int) -> None:
        """Sync mode: the learner has taken the batch of the version before ``version``; no worker can sample
        until it holds ``version`` (`heterorl.runtime.worker`: one share per version). Until a worker's heartbeats
        say it holds it, its lease clock stands still: the learner owes it the weights, however long the step
        (training, evaluation, a checkpoint, a weights delay) takes. Left running, the clock would expire the
        permits it holds for its next share, and a worker on probation would be granted one beyond the cap: a
        group for a version the run never trains."""
        self.awaited_version = version

    def lagging(self, worker: WorkerInfo) -> bool:
        """Whether ``worker``'s weights (as its heartbeats say) are more than ``max_lag`` versions behind the
        newest released to it: it would sample groups that stale, so it gets no new permit until its weights catch
        up. Counted from the version released to it, not the newest published: a version held back by a weights
        delay (`heterorl.delay`) or whose notice was lost is not one it could have fetched, and the learner does
        not wait on it."""
        behind = worker.released_version - worker.version_held
        lagging = self.max_lag is not None and worker.version_held >= 0 and behind > self.max_lag
        if lagging and not worker.weights_lagging:
            self.stats["permits_held_back/weights_lag"] += 1
            self.registry.events("lagging", "worker %s holds weights %d versions behind the newest released to "
                                 "it (runtime.max_weights_lag %d): no new permits until it catches up",
                                 worker.worker_id, behind, self.max_lag)
        worker.weights_lagging = lagging
        return lagging

    def start_session(self, worker: WorkerInfo) -> None:
        self._end_probation(worker)
        worker.groups_session = worker.starts_granted_session = worker.start_limit_told = 0
        worker.permits_voided = worker.permits_reusable = 0
        worker.owing_s, worker.starts_reported = 0.0, -1
        worker.last_start_limit_sent = -2
        worker.groups_completed_session = worker.groups_dropped_session = 0
        worker.first_permit_at = -1.0

    def first_limit(self) -> int:
        """The start limit a joining worker is told in ``ready`` (−1: no admission control)."""
        return -1 if self.cap is None else 0

    def threads_for(self, worker: WorkerInfo) -> int:
        """The torch threads advised to ``worker``: those set for workers on the learner's host (0: none)."""
        return self.local_threads if worker.host == HOST else 0

    # -- leases -----------------------------------------------------------------------------------
    def lease_s(self, worker: WorkerInfo) -> float:
        """How long ``worker`` may go without completing a group and still be delivering: four times its mean
        seconds between completed groups this session (after its first, the seconds from its first permit to
        it), within [``permit_lease_min_s``, ``permit_lease_s``]."""
        done = worker.groups_completed_session
        if done == 1 and worker.first_permit_at >= 0:
            interval = worker.first_completed_at - worker.first_permit_at
        elif done >= 2:
            interval = (worker.last_completed_at - worker.first_completed_at) / (done - 1)
        else:
            return self.config.permit_lease_s
        return min(self.config.permit_lease_s, max(self.config.permit_lease_min_s, 4 * interval))

    def delivering(self, worker: WorkerInfo, now: float) -> bool:
        """Whether ``worker`` holds its share of the cap: it has completed a group this session, and since its
        last one it has not owed a group for longer than its lease (`lease_s`; the lease clock runs only while it
        holds permits not yet turned into completed groups and none of its groups waits for the learner)."""
        return (worker.groups_completed_session > 0
                and now - max(worker.last_completed_at, worker.lease_from) <= self.lease_s(worker))

    def _owes(self, worker: WorkerInfo) -> bool:
        """Whether ``worker`` holds permits not yet turned into groups completed (or dropped)."""
        return self._held(worker) > worker.groups_completed_session + worker.groups_dropped_session

    @staticmethod
    def _held(worker: WorkerInfo) -> int:
        """Permits granted to ``worker`` this session and not taken back. Its start limit never falls (it is
        cumulative, and the worker may have used a permit the learner took back): a permit taken back is
        *voided*, and the next one granted is a new one."""
        return worker.starts_granted_session - worker.permits_voided

    def _void(self, worker: WorkerInfo, count: int, reusable: bool = False) -> None:
        """Take back ``count`` of ``worker``'s permits: they return to the fleet. ``reusable``: the worker
        never used them, so granting them again gives it nothing it may not already start (`_give`)."""
        worker.permits_voided += count
        worker.permits_reusable += count if reusable else 0
        self.granted -= count

    def _used(self, worker: WorkerInfo) -> int:
        """The admission permits ``worker`` has used this session: its groups arrived, or, as its heartbeats say,
        more (groups still on their way) — believed up to ``ahead`` beyond those arrived, so a worker that claims
        permits it never uses holds a bounded number of them back from the fleet."""
        reported = min(worker.starts_reported, worker.groups_session + self.ahead, self._held(worker))
        return max(worker.groups_session, reported)

    def _unused(self, worker: WorkerInfo) -> int:
        """Permits of the cap ``worker`` holds unused (a probation permit not counted)."""
        unused = self._held(worker) - self._used(worker)
        if worker.probation_since >= 0 and not worker.probation_group:
            unused -= 1
        return max(0, unused)

    # -- counting ---------------------------------------------------------------------------------
    def count_start(self, worker: WorkerInfo, group_id: str) -> None:
        """A worker sends each group's members back to back: a new group id is a new start (a re-sent duplicate
        is none, so callers count only new trajectories)."""
        worker.groups_session += 1
        worker.last_group_id = group_id
        if worker.probation_since >= 0 and not worker.probation_group:
            worker.probation_group = group_id  # its probation permit is spent on this group: the cap's from now
            self.probation_unused -= 1
            return
        if self.cap is not None and worker.groups_session > self._held(worker):
            # started on a permit taken back since (the worker was thought dead, or stopped delivering): it counts
            if worker.permits_voided:
                worker.permits_voided -= 1
                worker.permits_reusable = min(worker.permits_reusable, worker.permits_voided)
            else:
                worker.starts_granted_session += 1
            self.granted += 1

    def count_complete(self, worker: WorkerInfo, group_id: str, now: float) -> None:
        """A group of ``worker`` completed (it is queued for the learner): the worker is delivering."""
        if not worker.groups_completed_session:
            worker.first_completed_at = now
        worker.groups_completed_session += 1
        worker.last_completed_at = now
        worker.permit_expiries = 0
        if group_id == worker.probation_group:
            self._end_probation(worker)

    def count_dropped(self, worker: WorkerInfo, group_id: str, now: float) -> None:
        """A started group of ``worker`` will never be trained (refused or dropped): a permit of the cap it took
        widens the cap by one; a probation permit spent on it expires (`_expire_probation`)."""
        worker.groups_dropped_session += 1
        self.refused += 1
        if group_id and group_id == worker.probation_group:
            self._expire_probation(worker, now, "dropped")

    def _return_probation(self, worker: WorkerInfo) -> None:
        """``worker``'s probation permit, not used, goes back to the fleet."""
        if self._held(worker) > worker.groups_session:
            self._void(worker, 1, reusable=worker.starts_reported < self._held(worker))

    def _end_probation(self, worker: WorkerInfo) -> None:
        """``worker`` no longer holds a probation permit."""
        if worker.probation_since >= 0 and not worker.probation_group:
            self.probation_unused -= 1
        worker.probation_since, worker.probation_group = -1.0, ""

    def _expire_probation(self, worker: WorkerInfo, now: float, reason: str) -> None:
        """``worker``'s probation permit expired: it waits ``permit_lease_s`` × 2^(expiries − 1) (at most 600 s)
        before the next."""
        if not worker.probation_group:  # never used: it leaves its start limit, and goes back to the fleet
            self._return_probation(worker)
        self._end_probation(worker)
        worker.permit_expiries += 1
        backoff = min(_MAX_BACKOFF_S, self.config.permit_lease_s * 2 ** min(worker.permit_expiries - 1, 10))
        worker.permits_backoff_until = now + backoff
        self.stats["permits_expired"] += 1
        self.stats[f"permits_expired/{reason}"] += 1

    def reclaim(self, worker: WorkerInfo) -> None:
        """Return a dead, rejoining or no longer delivering worker's unused permits to the fleet (a probation
        permit included), so permits held by a worker that does not use them cannot stall the learner."""
        self._end_probation(worker)
        unused = self._held(worker) - worker.groups_session
        if unused > 0:
            self._void(worker, unused)
            self.stats["permits_reclaimed"] += unused  # groups it was let start and never delivered

    # -- granting ---------------------------------------------------------------------------------
    def pool(self) -> int:
        """Permits of the cap not yet granted (unused probation permits are beyond it)."""
        return self.cap + self.refused + self.probation_unused - self.granted

    def permits_left(self, now: float) -> int | None:
        """Permits not yet granted plus those the delivering workers hold unused (None: no admission control)."""
        if self.cap is None:
            return None
        held = sum(self._unused(w) for w in self.registry.workers.values() if w.alive and self.delivering(w, now))
        return max(0, self.pool()) + held

    def fleet_rate(self, delivering: list[WorkerInfo]) -> tuple[float, int] | None:
        """The delivering workers' summed `WorkerInfo.start_rate` and their number; None while one of them is
        unmeasured, or when fewer than two deliver (nothing to share)."""
        rates = [w.start_rate() for w in delivering]
        return None if len(rates) < 2 or None in rates else (sum(rates), len(rates))

    def grant_all(self, now: float, waits_on_learner: Callable[[WorkerInfo], bool]) -> None:
        """Top up every live worker's permits (its ``starts_granted_session``, the start limit its next ack
        tells): delivering workers first, to their share of the cap; then one each for workers on probation,
        ``probation_permits`` at most in all, beyond the cap while unused: a newcomer gets in even when the fleet
        uses the whole cap, and a peer holding a probation permit takes nothing from the delivering workers. A permit
        granted is never taken back from a worker that may start on it (its start limit, cumulative, never falls):
        only unused permits of workers that stopped delivering, and probation permits past their lease. Unused
        permits of a worker no longer delivering, and probation permits past their lease, return first."""
        if self.cap is None:
            return
        live = [w for w in self.registry.workers.values() if w.alive]
        tick = 0.0 if self._granted_at is None else max(0.0, now - self._granted_at)
        self._granted_at = now
        for worker in live:  # the lease clock stops while a worker owes nothing, or the learner owes it
            if not self._owes(worker) or waits_on_learner(worker) or worker.version_held < self.awaited_version:
                worker.lease_from = now
            else:
                worker.owing_s += tick  # (its speed's measure: `WorkerInfo.start_rate`)
        delivering = [w for w in live if self.delivering(w, now)]
        on_probation = [w for w in live if not self.delivering(w, now)]
        # a probation permit lasts permit_lease_s; permit_lease_min_s when another worker on probation waits for
        # one (an honest worker's group started on it is still taken when it arrives: within its start limit)
        waiting = any(w.probation_since < 0 and now >= w.permits_backoff_until for w in on_probation)
        lease = self.config.permit_lease_min_s if waiting else self.config.permit_lease_s
        for worker in on_probation:
            if worker.probation_since >= 0 and now - worker.probation_since > lease:
                self._expire_probation(worker, now, "incomplete" if worker.probation_group else "unused")
            keep = worker.probation_since >= 0 and not worker.probation_group
            if self._held(worker) - worker.groups_session > keep:
                self.stats["permits_returned"] += 1  # it stopped delivering: its permits of the cap go back
                self.reclaim_cap_permits(worker)
        fleet = self.fleet_rate(delivering)
        out = sum(w.probation_since >= 0 for w in live)
        topped, wants = [], []
        for worker in delivering:
            if worker.probation_since >= 0 and not worker.probation_group:  # delivering now: the cap is its share
                self.reclaim(worker)
            if not self.lagging(worker):
                topped.append(worker)
                wants.append(max(0, permit_share(worker.start_rate(), fleet, self.ahead) - self._unused(worker)))
        counts, self._turn = share_out(wants, max(0, self.pool()), self._turn)
        for worker, count in zip(topped, counts):
            self._give(worker, count)
        for worker in on_probation:
            if out >= self.config.probation_permits:
                break
            if (worker.probation_since < 0 and now >= worker.permits_backoff_until
                    and self._held(worker) <= self._used(worker) and not self.lagging(worker)):
                self._give(worker, 1)
                worker.probation_since = now
                if worker.first_permit_at < 0:
                    worker.first_permit_at = now
                self.probation_unused += 1
                out += 1

    def _give(self, worker: WorkerInfo, count: int) -> None:
        """Grant ``worker`` ``count`` permits: first those taken back from it that it never used (its start limit
        does not rise for them), then new ones."""
        if count <= 0:
            return
        again = min(count, worker.permits_reusable)
        worker.permits_reusable -= again
        worker.permits_voided -= again
        worker.starts_granted_session += count - again
        self.granted += count

    def reclaim_cap_permits(self, worker: WorkerInfo) -> None:
        """Return ``worker``'s unused permits of the cap, keeping an unused probation permit it holds."""
        keep = worker.probation_since >= 0 and not worker.probation_group
        unused = self._held(worker) - keep - worker.groups_session
        if unused > 0:
            self._void(worker, unused)

    def limit_of(self, worker: WorkerInfo) -> int:
        """The start limit to tell ``worker`` (−1 without admission control); the highest told this session
        bounds the groups it may start (`may_start`)."""
        if self.cap is None:
            return -1
        worker.start_limit_told = max(worker.start_limit_told, worker.starts_granted_session)
        return worker.starts_granted_session

    def may_start(self, worker: WorkerInfo) -> bool:
        """Whether ``worker`` may start one more group: within the highest start limit it was told this
        session (always without admission control)."""
        return self.cap is None or worker.groups_session < worker.start_limit_told

    def state_line(self, now: float) -> str:
        if self.cap is None:
            return "no admission control"
        held = ", ".join(
            f"{w.worker_id}{'' if w.alive else ' (dead)'}"
            f"{' (probation)' if w.alive and not self.delivering(w, now) else ''} {w.groups_session}/"
            f"{self._held(w)}" for w in self.registry.workers.values())
        return f"permits {self.granted}/{self.cap} granted; started/granted: {held}"
