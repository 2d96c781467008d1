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
``admission``   arrival order, nothing discarded, and workers may only *start* groups the learner can consume
                within the bound (AReaL / SkyRL): see :meth:`GroupBuffer.admission_limit`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from heterorl.config import BufferConfig
from heterorl.transport.protocol import Trajectory


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


@dataclass
class _Partial:
    members: dict[str, Trajectory] = field(default_factory=dict)
    group_size: int = 0
    first_s: float = 0.0


class GroupBuffer:
    """Collects trajectories into complete groups and hands out batches by ``config.policy``."""

    def __init__(self, config: BufferConfig | None = None) -> None:
        self.config = config or BufferConfig()
        self.config.validate()
        # keyed by `Trajectory.group_key` (group ids are chosen by workers: one worker's cannot clash with another's)
        self._partial: OrderedDict[str, _Partial] = OrderedDict()
        self._groups: OrderedDict[str, Group] = OrderedDict()  # complete, in arrival order
        self.counters = {"groups_in": 0, "dropped_stale": 0, "dropped_overflow": 0, "dropped_partial": 0,
                         "inconsistent": 0, "groups_out": 0}

    def add(self, traj: Trajectory, now_s: float) -> Group | None:
        """Add one trajectory; returns its group when this completes it."""
        key = traj.group_key
        partial = self._partial.get(key)
        if partial is None:
            partial = self._partial[key] = _Partial(group_size=traj.group_size, first_s=now_s)
        if traj.group_size != partial.group_size:
            self.counters["inconsistent"] += 1  # one group, two sizes: refuse the newcomer
            return None
        partial.members[traj.trajectory_id] = traj
        if len(partial.members) < partial.group_size:
            return None
        del self._partial[key]
        group = Group(traj.group_id, list(partial.members.values()), now_s)
        self._groups[key] = group
        self.counters["groups_in"] += 1
        while len(self._groups) > self.config.max_groups:
            self._groups.popitem(last=False)
            self.counters["dropped_overflow"] += 1
        return group

    def expire_partial(self, now_s: float) -> int:
        """Discard groups incomplete for longer than ``partial_group_timeout_s``; returns how many."""
        expired = [gid for gid, p in self._partial.items() if now_s - p.first_s > self.config.partial_group_timeout_s]
        for gid in expired:
            del self._partial[gid]
        self.counters["dropped_partial"] += len(expired)
        return len(expired)

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def incomplete(self) -> int:
        """Groups still waiting for members."""
        return len(self._partial)

    def staleness(self, group: Group, current_version: int) -> int:
        return current_version - group.oldest_version

    def take(self, n_groups: int, current_version: int) -> list[Group] | None:
        """``n_groups`` groups for the batch at ``current_version``, or None if the policy says wait."""
        bound = self.config.max_staleness_steps
        policy = self.config.policy
        if policy in ("window", "drop_stale"):
            for key in [key for key, g in self._groups.items() if current_version - g.oldest_version > bound]:
                del self._groups[key]
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

    def admission_limit(self, current_version: int, groups_per_step: int) -> int | None:
        """Under ``admission``: how many groups the fleet may have started in total, so that every started
        group is consumed at most ``max_staleness_steps`` versions after the version it starts with.

        A group started at version v is trained by step ≤ v + bound only if at most (v + bound + 1) ·
        groups_per_step groups were started before it (batches take groups in arrival order). Groups this
        buffer discarded (incomplete past their timeout, or overflow) were started but will never be trained,
        so they widen the limit. None for other policies (no limit).
        """
        if self.config.policy != "admission":
            return None
        discarded = sum(self.counters[k] for k in ("dropped_stale", "dropped_overflow", "dropped_partial"))
        return (current_version + self.config.max_staleness_steps + 1) * groups_per_step + discarded
