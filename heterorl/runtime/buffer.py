"""The learner's staleness-aware buffer: whole groups in, batches of whole groups out, by a pluggable policy.

Pure (no sockets, no clocks of its own: times are passed in), so the live
learner and the simulated one share it.

Staleness of a group, when a batch takes it, is ``current_version −
oldest_version``: the learner's version minus the oldest policy version that
sampled any of its tokens. Policies:

``window``      HeteroRL's rule: groups staler than ``max_staleness_steps`` are discarded; when no group inside
                the window is left, the learner blocks (``take`` returns None) until fresher data arrives.
                ``select`` picks the newest groups first (default) or the oldest inside the window.
``drop_stale``  arrival order; groups staler than the bound are discarded; never waits for fresher data.
``count_only``  arrival order; nothing is discarded; staleness is only measured.
``admission``   (the default) arrival order, nothing discarded: workers may only *start* groups the learner can
                consume within the bound (AReaL / SkyRL), and no more than the run will train; see
                :meth:`GroupBuffer.admission_limit`. A `Pacer` decides how many steps ahead of the learner the
                fleet may run: one, raised while the learner waits on a fleet that has used every permit.

Every trajectory discarded is counted by reason in ``GroupBuffer.discarded`` (the run summary's waste report).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from heterorl.config import BufferConfig
from heterorl.transport.protocol import Trajectory

_UNASSEMBLED = {"partial": "dropped_partial", "inconsistent": "inconsistent"}  # `count_unassembled`: its counter


@dataclass
class Group:
    """The G trajectories of one prompt, complete."""

    group_id: str
    trajectories: list[Trajectory]
    arrived_s: float  # when the last member arrived (learner clock)

    @property
    def oldest_version(self) -> int:
        return min(int(t.policy_versions.min()) for t in self.trajectories)

    @property
    def newest_version(self) -> int:
        return max(int(t.policy_versions.max()) for t in self.trajectories)


def sampling_order(group: Group) -> tuple[str, int]:
    """A group's place in a batch that does not depend on arrival: its sampler, then its number in that sampler's
    life (group ids end in ``-{n}``, `heterorl.runtime.worker.stamp_groups`)."""
    sampler, _, number = group.group_id.rpartition("-")
    return group.trajectories[0].sampler_id, int(number) if number.isdigit() else -1


class GroupBuffer:
    """Holds complete groups and hands out batches by ``config.policy``. Groups are assembled before they reach it
    (`heterorl.transport.groups.GroupAssembler`: in the live learner's transport, or the simulation's)."""

    def __init__(self, config: BufferConfig | None = None) -> None:
        self.config = config or BufferConfig()
        self.config.validate()
        # keyed by `Trajectory.group_key` (group ids are chosen by workers: one worker's cannot clash with another's)
        self._groups: OrderedDict[str, Group] = OrderedDict()  # complete, in arrival order
        self.counters = {"groups_in": 0, "dropped_stale": 0, "dropped_overflow": 0, "dropped_partial": 0,
                         "inconsistent": 0, "groups_out": 0}
        self.discarded: Counter = Counter()  # trajectories discarded by reason: stale|overflow|partial|inconsistent

    def add_group(self, trajectories: list[Trajectory], now_s: float) -> Group:
        """Add a complete group (its members, all of one group) that arrived whole at ``now_s``; when the buffer
        is over ``max_groups``, its oldest groups go (overflow)."""
        first = trajectories[0]
        group = Group(first.group_id, list(trajectories), now_s)
        self._groups[first.group_key] = group
        self.counters["groups_in"] += 1
        while len(self._groups) > self.config.max_groups:
            _, dropped = self._groups.popitem(last=False)
            self.counters["dropped_overflow"] += 1
            self.discarded["overflow"] += len(dropped.trajectories)
        return group

    def count_unassembled(self, reason: str, trajectories: int) -> None:
        """Count what never reached the buffer whole: ``partial``, a group that never completed (one group of
        ``trajectories``), or ``inconsistent``, a member refused for a group size its group's first member did not
        declare (``trajectories`` = 1)."""
        self.counters[_UNASSEMBLED[reason]] += 1
        self.discarded[reason] += trajectories

    def __len__(self) -> int:
        return len(self._groups)

    def staleness(self, group: Group, current_version: int) -> int:
        return current_version - group.oldest_version

    def take(self, n_groups: int, current_version: int) -> list[Group] | None:
        """``n_groups`` groups for the batch at ``current_version``, or None if the policy says wait."""
        bound = self.config.max_staleness_steps
        policy = self.config.policy
        if policy in ("window", "drop_stale"):
            for key in [key for key, g in self._groups.items() if current_version - g.oldest_version > bound]:
                self.discarded["stale"] += len(self._groups.pop(key).trajectories)
                self.counters["dropped_stale"] += 1
        if len(self._groups) < n_groups:
            return None
        candidates = list(self._groups.values())
        if policy == "window":
            newest_first = self.config.select == "newest"
            candidates.sort(key=lambda g: g.oldest_version, reverse=newest_first)  # stable: arrival order on ties
        chosen = candidates[:n_groups]
        for group in chosen:
            del self._groups[group.trajectories[0].group_key]
        self.counters["groups_out"] += len(chosen)
        return chosen

    @property
    def held_trajectories(self) -> int:
        """Trajectories held in complete groups waiting for a batch."""
        return sum(len(g.trajectories) for g in self._groups.values())

    def admission_limit(self, current_version: int, groups_per_step: int, *, total_steps: int | None = None,
                        ahead_steps: int | None = None) -> int | None:
        """Under ``admission``: how many groups the fleet may have started in total, so that every started
        group is consumed at most ``ahead_steps`` (default ``max_staleness_steps``) versions after the version
        it starts with, and, given ``total_steps``, no group is started that the run will not train.

        A group started at version v is trained by step ≤ v + ahead only if at most (v + ahead + 1) ·
        groups_per_step groups were started before it (batches take groups in arrival order). Groups this
        buffer discarded (incomplete past their timeout, or overflow) were started but will never be trained,
        so they widen the limit. None for other policies (no limit).
        """
        if self.config.policy != "admission":
            return None
        ahead = self.config.max_staleness_steps if ahead_steps is None else ahead_steps
        steps = current_version + ahead + 1
        if total_steps is not None:
            steps = min(steps, total_steps)
        discarded = sum(self.counters[k] for k in ("dropped_stale", "dropped_overflow", "dropped_partial"))
        return steps * groups_per_step + discarded


class Pacer:
    """How many steps ahead of the learner the fleet may start groups under ``admission`` (``ahead``).

    ``buffer.pace_steps`` fixes it. Unset, it starts at one step (the next batch is sampled while the learner
    trains on this one: sampling and training overlap, and staleness stays near one version) and rises by one,
    up to ``max_staleness_steps``, after each step on which the learner waited for data (over a quarter of its
    training time) while the fleet could start no group (every permit used: the pace, not the fleet's speed,
    held the batch back — a link's latency, a slow worker's long calls). The learner leaves out its first step
    (start-up) and the last ones, where the run's end caps the permits. It never falls: a run pays the
    staleness its links need, once.
    """

    WAIT_FRACTION = 0.25  # a wait counts when longer than this share of the step's training (and 50 ms)

    def __init__(self, config: BufferConfig) -> None:
        self.fixed = config.pace_steps is not None
        self.bound = config.max_staleness_steps
        self.ahead = config.pace_steps if self.fixed else min(1, self.bound)
        self.raised = 0  # times the adaptive pace rose

    def observe(self, waited_s: float, train_s: float, starved: bool) -> bool:
        """After a step: ``waited_s`` for its batch, ``train_s`` to train it, and whether the fleet ran out of
        permits during the wait (``starved``). True when the pace rose."""
        if self.fixed or not starved or self.ahead >= self.bound:
            return False
        if waited_s <= max(0.05, self.WAIT_FRACTION * train_s):
            return False
        self.ahead += 1
        self.raised += 1
        return True
