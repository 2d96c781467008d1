"""Trajectory intake at the learner's end: a decoded batch from a registered worker is checked (its sender, the
learner's `TrajectoryContract`, credit, rate), its groups assembled (`GroupAssembler`, bounded per worker),
duplicates acknowledged and taken once, and whole groups queued for the learner's consumer (`pop_groups`).

Flow control is by credit: each worker has a cumulative ``credit_limit`` (trajectories it may have sent this
session), which grows only as the consumer takes that worker's trajectories out of the queue, so buffered +
in-flight trajectories per worker never exceed ``credits_per_worker``; with ``max_trajectories_per_s`` it also
follows a per-worker token bucket. A refused member refuses its group: the members held are dropped, later ones
refused (`GROUP_REJECTED`), and the worker is told why in its next ack. Not thread-safe: the server's lock guards
every call.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque

from heterorl.config import TransportConfig
from heterorl.transport.admission import Admission
from heterorl.transport.groups import DroppedGroup, GroupAssembler
from heterorl.transport.protocol import Trajectory, TrajectoryBatch, TrajectoryContract
from heterorl.transport.registry import Rejections, WorkerInfo, WorkerRegistry

GROUP_REJECTED = "group_rejected"  # the reason a member is refused for when another member of its group was refused
_POISONED_GROUPS_KEPT = 64  # per worker: a worker sends a group's members back to back, so a few recent ones suffice


class Intake:
    """Trajectories in, whole groups out: ``groups`` holds the incomplete ones, the queue the complete ones in
    the order they completed (a group's members together)."""

    def __init__(self, config: TransportConfig, stats: Counter, registry: WorkerRegistry, admission: Admission,
                 reject: Rejections, contract: TrajectoryContract | None) -> None:
        self.config, self.stats, self.registry, self.admission = config, stats, registry, admission
        self._reject = reject
        self.contract = contract
        self.groups = GroupAssembler(config.group_timeout_s, config.open_groups_per_worker,
                                     config.open_group_bytes_per_worker, config.group_deadline_min_s)
        self._seen: OrderedDict[str, None] = OrderedDict()  # `Trajectory.key`s taken (dedup_window newest)
        self._queue: deque[list[Trajectory]] = deque()  # complete groups, oldest first
        self.queued = 0  # trajectories in the queue

    @property
    def held(self) -> int:
        """Trajectories accepted and not yet taken: queued, or held until their group is complete."""
        return self.queued + self.groups.held

    # -- the consumer's end -----------------------------------------------------------------------
    def pop(self, max_items: int) -> list[Trajectory]:
        """Up to ``max_items`` queued trajectories, oldest first (the rest of a group split here stays first)."""
        taken: list[Trajectory] = []
        while self._queue and len(taken) < max_items:
            group = self._queue[0]
            room = max_items - len(taken)
            if len(group) > room:
                taken += group[:room]
                self._queue[0] = group[room:]
                break
            taken += self._queue.popleft()
        self._release(taken)
        return taken

    def pop_groups(self, max_items: int) -> list[list[Trajectory]]:
        """Whole groups, oldest first, of up to ``max_items`` trajectories in all (the first one even if larger)."""
        groups: list[list[Trajectory]] = []
        count = 0
        while self._queue and (not groups or count + len(self._queue[0]) <= max_items):
            groups.append(self._queue.popleft())
            count += len(groups[-1])
        self._release([traj for group in groups for traj in group])
        return groups

    def _release(self, taken: list[Trajectory]) -> None:
        """Taken out of the queue: their workers' credit is free again."""
        self.queued -= len(taken)
        for sampler_id, count in Counter(traj.sampler_id for traj in taken).items():
            worker = self.registry.workers.get(sampler_id)
            if worker is not None:  # (not one removed from the registry since, whose id came back)
                worker.buffered = max(0, worker.buffered - count)

    def waits_on_learner(self, worker: WorkerInfo) -> bool:
        """Whether complete groups of ``worker`` wait in the queue for the learner to take them."""
        return worker.buffered > self.groups.held_by(worker.worker_id)

    # -- credit -----------------------------------------------------------------------------------
    def credit_limit(self, worker: WorkerInfo, now: float) -> int:
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

    # -- a batch in -------------------------------------------------------------------------------
    def take_batch(self, worker: WorkerInfo, batch: TrajectoryBatch, received_at: float, now: float,
                   newest_version: int) -> None:
        """Take in a batch: its checks in bulk when every member is new, within credit (and rate), the worker's
        own and within the contract (stamped up to ``newest_version``), else one by one (which names each
        refusal). ``received_at``: wall time, stamped on each; ``now``: the learner's monotonic clock."""
        trajectories = batch.trajectories
        keys = [traj.key for traj in trajectories]
        breaches = self._breaches(worker, batch, newest_version)
        if (breaches or worker.buffered + len(keys) > self.config.credits_per_worker
                or not self._seen.keys().isdisjoint(keys) or len(set(keys)) != len(keys)
                or any(traj.sampler_id != worker.worker_id for traj in trajectories)
                or (self.config.max_trajectories_per_s and self._rate_room(worker, now) < len(keys))):
            for index, traj in enumerate(trajectories):
                self._take_one(worker, traj, received_at, now, breaches.get(index))
        else:
            worker.received_session += len(keys)
            for traj, key in zip(trajectories, keys):
                traj.received_at = received_at
                self._take(worker, traj, key, now)
        if self.groups.open_groups(worker.worker_id):  # (none in the common case: whole groups per batch)
            self._detach_held(worker, trajectories)

    def _detach_held(self, worker: WorkerInfo, trajectories: list[Trajectory]) -> None:
        """Copy the members of ``trajectories`` still held in incomplete groups out of their message's frame, so
        that a held member pins only its own bytes, never the whole message (which the bound on held bytes,
        ``open_group_bytes_per_worker``, would not see)."""
        for traj in trajectories:
            if traj.group_size > 1 and self.groups.holds_member(worker.worker_id, traj):
                traj.detach()

    def _breaches(self, worker: WorkerInfo, batch: TrajectoryBatch, newest_version: int) -> dict[int, tuple[str, str]]:
        """{index: (reason, message)} of the members of ``batch`` to refuse: those that break the contract, and
        every member of a group one of whose members was refused (such a group can never be trained whole, so
        its other members must not wait in the buffer for it). {} in the common case, at the cost of a few
        comparisons."""
        found = {}
        if self.contract is not None:
            found = {b.index: (b.reason, b.message) for b in self.contract.breaches(batch, newest_version)}
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

    def _take_one(self, worker: WorkerInfo, traj: Trajectory, received_at: float, now: float,
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
        if self.config.max_trajectories_per_s and self._rate_room(worker, now) < 1:
            self._reject("rate_limited", f"{worker.worker_id} sent beyond transport.max_trajectories_per_s "
                         f"({self.config.max_trajectories_per_s:g})", worker, traj.trajectory_id)
            return
        traj.received_at = received_at
        self._take(worker, traj, key, now)

    def _take(self, worker: WorkerInfo, traj: Trajectory, key: str, now: float) -> None:
        """Accept ``traj`` (new, within credit and the contract) into its group, and queue the group when this
        completes it; or refuse it, with its group, when it starts a group beyond the worker's start limit
        (admission control) or would take its worker past its bounds on incomplete groups
        (`GroupAssembler.add`)."""
        if traj.group_size > 1 and traj.group_id in worker.poisoned_groups:
            self._refuse_member(worker, traj, GROUP_REJECTED, f"group {traj.group_id} has a member that was rejected")
            return
        starts = traj.group_id != worker.last_group_id and not self.groups.holds(worker.worker_id, traj.group_id)
        if starts and not self.admission.may_start(worker):
            self._refuse_member(worker, traj, "over_start_limit", (
                f"{worker.worker_id} started group {traj.group_id} beyond its start limit "
                f"({worker.start_limit_told} groups this session): wait for the learner's permits"), counted=False)
            return
        added = self.groups.add(traj, now)
        if added.refused is not None:
            self._refuse_member(worker, traj, *added.refused)
            return
        if starts:
            self.admission.count_start(worker, traj.group_id)
        self._seen[key] = None
        if len(self._seen) > self.config.dedup_window:
            self._seen.popitem(last=False)
        worker.buffered += 1
        worker.trajectories += 1
        worker.acks.append(traj.trajectory_id)
        self.stats["accepted"] += 1
        if self.config.max_trajectories_per_s:
            worker.rate_tokens -= 1
        if added.complete is not None:
            self._queue.append(added.complete)
            self.queued += len(added.complete)
            self.admission.count_complete(worker, traj.group_id, now)

    # -- refusals and drops -----------------------------------------------------------------------
    def _refuse_member(self, worker: WorkerInfo, traj: Trajectory, reason: str, message: str,
                       counted: bool = True) -> None:
        """Refuse ``traj`` and, with it, its group: the members held so far are dropped, later ones refused
        (`GROUP_REJECTED`). A refused group still counts as a group its worker started (an admission permit),
        and widens the fleet's admission cap by one, as it will never be trained — unless not ``counted`` (it
        was refused for starting beyond its worker's permits)."""
        poisoned = worker.poisoned_groups
        poisoned[traj.group_id] = None
        while len(poisoned) > _POISONED_GROUPS_KEPT:
            poisoned.popitem(last=False)
        dropped = self.groups.discard(worker.worker_id, traj.group_id, GROUP_REJECTED,
                                      f"its member {traj.trajectory_id} was refused")
        if dropped is not None:
            self._dropped(worker, dropped)
        elif not counted:
            worker.last_group_id = traj.group_id  # (its later members are refused with it, never counted)
        elif traj.group_id != worker.last_group_id:
            self.admission.count_start(worker, traj.group_id)
            self.admission.count_dropped(worker, traj.group_id, time.monotonic())
        self._reject(reason, message, worker, traj.trajectory_id)

    def drop_groups(self, worker: WorkerInfo, reason: str, why: str) -> None:
        """Drop every incomplete group of ``worker`` (it rejoined, or leaves the registry)."""
        for dropped in self.groups.discard_owner(worker.worker_id, reason, why):
            self._dropped(worker, dropped)

    def expire_groups(self, worker: WorkerInfo, now: float) -> None:
        """Drop ``worker``'s groups incomplete for longer than ``group_timeout_s``."""
        for dropped in self.groups.expire(now, worker.worker_id):
            self._dropped(worker, dropped)

    def _dropped(self, worker: WorkerInfo, dropped: DroppedGroup) -> None:
        """An incomplete group dropped: its members free their credit and are never trained (counted in
        ``stats["dropped_groups/<reason>"]`` and told to the worker)."""
        members = len(dropped.members)
        worker.buffered = max(0, worker.buffered - members)
        # started (and counted), never trained: the admission cap widens
        self.admission.count_dropped(worker, dropped.group_id, time.monotonic())
        self.stats["dropped_groups"] += 1
        self.stats[f"dropped_groups/{dropped.reason}"] += 1
        self.stats["dropped_trajectories"] += members
        worker.rejects.append(f"{dropped.group_id}: {dropped.reason}: {members} of its {dropped.size} members "
                              f"dropped unused: {dropped.why}"[:256])
