"""Group assembly: a group's members are held until all of them have arrived, then handed on together, once.

One `GroupAssembler` per consumer: the learner's transport (`heterorl.transport.intake`, bounded per worker) and
the simulated learner (`heterorl.runtime.simulate`, unbounded) both use it, so a group is assembled in one place.
Pure: no sockets and no clock of its own; every time is passed in (seconds, never decreasing).

An incomplete group is dropped by `expire` at its owner's deadline (`deadline_s`): four times the slowest of
the owner's recent groups took to arrive whole (the fleet's recent groups until the owner has completed one),
at least ``min_deadline_s`` and at most ``timeout_s`` (``timeout_s`` before any group has completed), so a
worker whose members arrive together loses a group it never completes within seconds, and one whose link
spreads its members (a per-trajectory delay) is given the time its own groups take.

A group is named by its owner (the worker that sampled it: `Trajectory.sampler_id`) and its ``group_id``, which
that worker chose, so one worker's ids never meet another's. Its first member declares its size; a member that
declares another size is refused and the group kept. A group of one is complete at once and never held.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from heterorl.transport.protocol import Trajectory

GROUP_EXPIRED = "group_expired"  # the reason `GroupAssembler.expire` drops a group for
_SPREADS_KEPT = 16  # per owner: the assembly times of its latest complete groups, for its deadline
_FLEET_SPREADS_KEPT = 64  # over all owners: for an owner with none yet
_MAX_OWNERS_MEASURED = 4096  # owners whose assembly times are kept (least recently completed forgotten)


@dataclass
class OpenGroup:
    """The members of one group that arrived so far (the group is incomplete)."""

    size: int  # as its first member declared
    first_s: float  # when its first member arrived
    members: dict[str, Trajectory] = field(default_factory=dict)  # by trajectory id, in arrival order
    nbytes: int = 0  # `Trajectory.nbytes` of the members


@dataclass(frozen=True)
class DroppedGroup:
    """An incomplete group dropped: its members will never be handed on."""

    owner: str
    group_id: str
    size: int  # declared
    members: list[Trajectory]  # those that had arrived
    reason: str  # `GROUP_EXPIRED`, or what the caller of `discard` said
    why: str = ""


@dataclass(frozen=True)
class Added:
    """What `GroupAssembler.add` did with a member: ``complete`` is its group when it completed one (members in
    arrival order); ``refused`` is (reason, message) when it was refused (nothing changed)."""

    complete: list[Trajectory] | None = None
    refused: tuple[str, str] | None = None


class GroupAssembler:
    """Open groups by owner, oldest first. Per owner at most ``max_open`` open groups holding at most
    ``max_bytes`` bytes (None: no bound); a group still incomplete ``timeout_s`` after its first member arrived is
    dropped by `expire`. Not thread-safe: its owner serializes the calls."""

    def __init__(self, timeout_s: float, max_open: int | None = None, max_bytes: int | None = None,
                 min_deadline_s: float | None = None) -> None:
        self.timeout_s, self.max_open, self.max_bytes = timeout_s, max_open, max_bytes
        self.min_deadline_s = timeout_s if min_deadline_s is None else min(min_deadline_s, timeout_s)
        self._spreads: OrderedDict[str, deque[float]] = OrderedDict()  # owner → its groups' assembly seconds
        self._fleet_spreads: deque[float] = deque(maxlen=_FLEET_SPREADS_KEPT)
        self._open: dict[str, OrderedDict[str, OpenGroup]] = {}  # owner → group id → its open group
        self._bytes: dict[str, int] = {}  # owner → the bytes its open groups hold
        self.held = 0  # members held in open groups, all owners

    def deadline_s(self, owner: str) -> float:
        """How long ``owner``'s incomplete group may wait for its members (see the module's docstring)."""
        spreads = self._spreads.get(owner) or self._fleet_spreads
        if not spreads:
            return self.timeout_s
        return min(self.timeout_s, max(self.min_deadline_s, 4 * max(spreads)))

    def _measured(self, owner: str, seconds: float) -> None:
        spreads = self._spreads.pop(owner, None) or deque(maxlen=_SPREADS_KEPT)
        spreads.append(seconds)
        self._spreads[owner] = spreads  # most recently completed last
        if len(self._spreads) > _MAX_OWNERS_MEASURED:
            self._spreads.popitem(last=False)
        self._fleet_spreads.append(seconds)

    def open_groups(self, owner: str) -> int:
        return len(self._open.get(owner, ()))

    def held_by(self, owner: str) -> int:
        """Members of ``owner``'s incomplete groups held."""
        return sum(len(group.members) for group in self._open.get(owner, {}).values())

    def open_bytes(self, owner: str) -> int:
        return self._bytes.get(owner, 0)

    def holds(self, owner: str, group_id: str) -> bool:
        return group_id in self._open.get(owner, ())

    def holds_member(self, owner: str, traj: Trajectory) -> bool:
        """Whether ``traj`` itself is held in an open group of ``owner``."""
        group = self._open.get(owner, {}).get(traj.group_id)
        return group is not None and group.members.get(traj.trajectory_id) is traj

    def add(self, traj: Trajectory, now_s: float) -> Added:
        """Hold ``traj`` with the members of its group that arrived before it; its group when this completes
        it. Refused, with nothing changed: a member that would open one group too many for its owner, that
        declares another size than its group's first member, repeats a held member's id, or would take its
        owner's held bytes past the bound."""
        if traj.group_size == 1:
            return Added(complete=[traj])
        owner, nbytes = traj.sampler_id, traj.nbytes
        groups = self._open.get(owner, {})
        group = groups.get(traj.group_id)
        if group is None and self.max_open is not None and len(groups) >= self.max_open:
            return Added(refused=("open_groups_bound", (
                f"{owner} already has {len(groups)} incomplete groups at the learner "
                "(transport.open_groups_per_worker); send each group's members together")))
        if group is not None and group.size != traj.group_size:
            return Added(refused=("group_inconsistent", f"group {traj.group_id} has group_size {group.size}, "
                                                        f"this member {traj.group_size}"))
        if group is not None and traj.trajectory_id in group.members:
            return Added(refused=("duplicate_member", f"group {traj.group_id} holds {traj.trajectory_id} already"))
        held_bytes = self.open_bytes(owner)
        if self.max_bytes is not None and held_bytes + nbytes > self.max_bytes:
            return Added(refused=("open_bytes_bound", (
                f"{owner}'s incomplete groups would hold {held_bytes + nbytes} bytes > {self.max_bytes} "
                "(transport.open_group_bytes_per_worker)")))
        if group is None:
            group = self._open.setdefault(owner, OrderedDict())[traj.group_id] = OpenGroup(traj.group_size, now_s)
        group.members[traj.trajectory_id] = traj
        group.nbytes += nbytes
        self._bytes[owner] = held_bytes + nbytes
        self.held += 1
        if len(group.members) < group.size:
            return Added()
        self._remove(owner, traj.group_id)
        self._measured(owner, max(0.0, now_s - group.first_s))
        return Added(complete=list(group.members.values()))

    def discard(self, owner: str, group_id: str, reason: str, why: str = "") -> DroppedGroup | None:
        """Drop ``owner``'s open group ``group_id`` (None when it holds none of that id)."""
        if not self.holds(owner, group_id):
            return None
        group = self._remove(owner, group_id)
        return DroppedGroup(owner, group_id, group.size, list(group.members.values()), reason, why)

    def discard_owner(self, owner: str, reason: str, why: str = "") -> list[DroppedGroup]:
        """Drop every open group of ``owner``, oldest first."""
        return [self.discard(owner, group_id, reason, why) for group_id in list(self._open.get(owner, ()))]

    def expire(self, now_s: float, owner: str | None = None) -> list[DroppedGroup]:
        """Drop the groups (of ``owner``; None: of every owner) whose first member arrived more than their
        owner's `deadline_s` before ``now_s``, oldest first, reason `GROUP_EXPIRED`."""
        dropped = []
        for name in [owner] if owner is not None else list(self._open):
            groups = self._open.get(name, {})
            deadline = self.deadline_s(name)
            why = (f"incomplete after {deadline:g} s (transport.group_timeout_s)" if deadline >= self.timeout_s else
                   f"incomplete after {deadline:.3g} s (4 x the slowest of its worker's recent groups to arrive "
                   "whole, at least transport.group_deadline_min_s)")
            while groups:
                group_id, group = next(iter(groups.items()))
                if now_s - group.first_s <= deadline:
                    break  # the others arrived later
                dropped.append(self.discard(name, group_id, GROUP_EXPIRED, why))
        return dropped

    def _remove(self, owner: str, group_id: str) -> OpenGroup:
        groups = self._open[owner]
        group = groups.pop(group_id)
        self._bytes[owner] -= group.nbytes
        self.held -= len(group.members)
        if not groups:  # nothing of an owner outlives its last open group
            del self._open[owner], self._bytes[owner]
        return group
