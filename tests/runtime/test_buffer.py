"""The learner's staleness-aware buffer: whole groups only, and each policy's rule."""

import numpy as np
import pytest

from heterorl.config import BufferConfig
from heterorl.errors import ConfigError
from heterorl.runtime.accounting import rollout_waste
from heterorl.runtime.buffer import GroupBuffer, Pacer, sampling_order
from heterorl.transport.groups import GroupAssembler
from heterorl.transport.protocol import Trajectory
from tests.conftest import trajectory


def member(group: str, j: int, version: int, size: int = 2, sampler: str = "w0") -> Trajectory:
    return trajectory(trajectory_id=f"{group}-{j}", group_id=group, sampler_id=sampler, group_size=size,
                      completion_len=2, version=version)


def fill(buffer: GroupBuffer, versions: dict[str, int], now: float = 0.0) -> None:
    for gid, version in versions.items():
        buffer.add_group([member(gid, j, version) for j in range(2)], now)


def ids(groups) -> list[str]:
    return [g.group_id for g in groups]


def test_only_complete_groups_are_handed_out():
    groups, buffer = GroupAssembler(timeout_s=600), GroupBuffer(BufferConfig(policy="count_only"))
    assert groups.add(member("a", 0, 1), 0.0).complete is None
    assert buffer.take(1, current_version=1) is None  # half a group is not a group
    group = buffer.add_group(groups.add(member("a", 1, 1), 0.0).complete, 0.0)
    assert len(group.trajectories) == 2
    assert ids(buffer.take(1, current_version=1)) == ["a"]


def test_what_never_arrived_whole_is_counted_by_reason():
    buffer = GroupBuffer()
    buffer.count_unassembled("inconsistent", 1)  # a member refused for another group size
    buffer.count_unassembled("partial", 3)  # a group of 4 that lost a member: its 3 expire
    assert (buffer.counters["inconsistent"], buffer.counters["dropped_partial"], len(buffer)) == (1, 1, 0)
    assert dict(buffer.discarded) == {"inconsistent": 1, "partial": 3}


def test_sampling_order_does_not_depend_on_arrival():
    """A sync batch is sorted by it: sampler, then the group's number in that sampler's life (10 after 9)."""
    arrivals = [("w1-ab12-10", "w1"), ("w0-cd34-2", "w0"), ("w1-ab12-9", "w1"), ("w0-cd34-11", "w0")]
    for order in (arrivals, arrivals[::-1]):
        buffer = GroupBuffer()
        for gid, sampler in order:
            buffer.add_group([member(gid, j, 0, sampler=sampler) for j in range(2)], 0.0)
        assert ids(sorted(buffer.take(4, 0), key=sampling_order)) == ["w0-cd34-2", "w0-cd34-11", "w1-ab12-9",
                                                                      "w1-ab12-10"]


def test_window_discards_stale_groups_takes_the_newest_and_blocks_when_none_is_fresh():
    buffer = GroupBuffer(BufferConfig(policy="window", max_staleness_steps=2))
    fill(buffer, {"old": 1, "mid": 4, "new": 5, "newer": 6})
    # at version 6: "old" is 5 versions stale (> 2): discarded; newest first
    assert ids(buffer.take(2, current_version=6)) == ["newer", "new"]
    assert buffer.counters["dropped_stale"] == 1
    assert buffer.take(1, current_version=7) is None  # "mid" (v4) is 3 stale at v7: gone, nothing fresh: wait
    assert buffer.counters["dropped_stale"] == 2 and len(buffer) == 0


def test_window_can_take_the_oldest_inside_the_window():
    buffer = GroupBuffer(BufferConfig(policy="window", max_staleness_steps=3, select="oldest"))
    fill(buffer, {"a": 5, "b": 3, "c": 4})
    assert ids(buffer.take(2, current_version=6)) == ["b", "c"]


def test_drop_stale_keeps_arrival_order():
    buffer = GroupBuffer(BufferConfig(policy="drop_stale", max_staleness_steps=1))
    fill(buffer, {"a": 5, "b": 2, "c": 4, "d": 5})
    assert ids(buffer.take(3, current_version=5)) == ["a", "c", "d"]
    assert buffer.counters["dropped_stale"] == 1


def test_count_only_never_discards():
    buffer = GroupBuffer(BufferConfig(policy="count_only", max_staleness_steps=0))
    fill(buffer, {"a": 0, "b": 9})
    assert ids(buffer.take(2, current_version=100)) == ["a", "b"]
    assert buffer.counters["dropped_stale"] == 0


def test_staleness_counts_the_oldest_token_of_the_group():
    buffer = GroupBuffer(BufferConfig(policy="count_only"))
    old = member("g", 0, 3)
    old.policy_versions = np.array([3, 4], dtype=np.int32)  # spans a weight update
    buffer.add_group([old, member("g", 1, 4)], 0.0)
    [group] = buffer.take(1, current_version=6)
    assert (group.oldest_version, group.newest_version, buffer.staleness(group, 6)) == (3, 4, 3)


def test_admission_limit_is_areal_rule():
    buffer = GroupBuffer(BufferConfig(policy="admission", max_staleness_steps=4))
    # after 10 batches of 8 groups, groups started may total (10 + 4 + 1) * 8
    assert buffer.admission_limit(10, 8) == 120
    assert GroupBuffer(BufferConfig(policy="window")).admission_limit(10, 8) is None
    buffer.counters["dropped_partial"] += 3  # started, never to be trained: three more may start
    assert buffer.admission_limit(10, 8) == 123


def test_admission_limit_follows_the_pace_and_never_passes_the_runs_end():
    buffer = GroupBuffer(BufferConfig(max_staleness_steps=4))
    assert buffer.config.policy == "admission"  # the default: pace, don't discard
    assert buffer.admission_limit(10, 8, ahead_steps=1) == 96  # the next batch may start while this one trains
    assert buffer.admission_limit(10, 8, total_steps=12, ahead_steps=4) == 96  # the run trains 12 batches in all
    assert buffer.admission_limit(10, 8, total_steps=100) == 120


def test_the_pacer_rises_only_while_the_learner_waits_on_a_fleet_out_of_permits():
    pacer = Pacer(BufferConfig(max_staleness_steps=3))
    assert pacer.ahead == 1
    assert not pacer.observe(waited_s=2.0, train_s=1.0, starved=False)  # the fleet is slow, not held back
    assert not pacer.observe(waited_s=0.2, train_s=1.0, starved=True)  # a wait too short to count
    assert pacer.observe(waited_s=0.3, train_s=1.0, starved=True) and pacer.ahead == 2
    assert pacer.observe(waited_s=0.3, train_s=1.0, starved=True) and pacer.ahead == 3
    assert not pacer.observe(waited_s=5.0, train_s=1.0, starved=True) and pacer.ahead == 3  # the bound
    assert pacer.raised == 2
    fixed = Pacer(BufferConfig(max_staleness_steps=3, pace_steps=2))
    assert fixed.ahead == 2 and not fixed.observe(9.0, 1.0, True) and fixed.ahead == 2
    assert Pacer(BufferConfig(max_staleness_steps=0)).ahead == 0  # on-policy: only the batch being trained
    with pytest.raises(ConfigError, match="buffer.pace_steps"):
        BufferConfig(max_staleness_steps=2, pace_steps=3).validate()


def test_discarded_trajectories_are_counted_by_reason_in_the_waste_report():
    buffer = GroupBuffer(BufferConfig(policy="window", max_staleness_steps=1, max_groups=2))
    fill(buffer, {"a": 0, "b": 5, "c": 5})  # a overflows (2 trajectories)
    buffer.count_unassembled("partial", 1)  # half a group, expired before it reached the buffer
    fill(buffer, {"d": 0})  # b overflows; d is stale at version 5
    assert ids(buffer.take(1, current_version=5)) == ["c"]
    assert dict(buffer.discarded) == {"overflow": 4, "partial": 1, "stale": 2}
    report = rollout_waste(generated=11, trained=2, buffer=buffer, left_over=buffer.held_trajectories, rejected=2)
    assert report["discarded"] == {"stale": 2, "overflow": 4, "partial": 1, "inconsistent": 0, "rejected": 2}
    assert report["left_over"] == 0
    assert report["wasted_frac"] == pytest.approx(9 / 11) and report["discarded_frac"] == pytest.approx(9 / 11)


def test_overflow_and_partial_expiry_are_counted():
    buffer = GroupBuffer(BufferConfig(policy="count_only", max_groups=2))
    fill(buffer, {"a": 0, "b": 0, "c": 0})
    assert len(buffer) == 2 and buffer.counters["dropped_overflow"] == 1
    groups = GroupAssembler(timeout_s=10)
    groups.add(member("half", 0, 0), now_s=100.0)
    assert groups.expire(105.0) == []
    [expired] = groups.expire(111.0)
    buffer.count_unassembled("partial", len(expired.members))
    assert buffer.counters["dropped_partial"] == 1 and buffer.discarded["partial"] == 1


@pytest.mark.parametrize("field, value", [("policy", "lifo"), ("select", "random"), ("max_staleness_steps", -1),
                                          ("max_groups", 0)])
def test_bad_buffer_config_names_the_key(field, value):
    with pytest.raises(ConfigError, match=f"buffer.{field}"):
        BufferConfig(**{field: value}).validate()
