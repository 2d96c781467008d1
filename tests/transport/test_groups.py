"""The one group assembler (heterorl.transport.groups): members in, whole groups out, bounded per owner, expired
after the timeout, and nothing left behind. Times are passed in, so every value here is computed by hand."""

from heterorl.transport.groups import GROUP_EXPIRED, GroupAssembler
from tests.conftest import trajectory

BYTES = 40  # `Trajectory.nbytes` of `member`: 4 × (4 prompt tokens + 3 × 2 completion tokens)


def member(group: str, j: int, size: int = 3, owner: str = "w0"):
    return trajectory(trajectory_id=f"{group}-{j}", group_id=group, sampler_id=owner, group_size=size,
                      completion_len=2, version=0)


def assert_empty(groups: GroupAssembler) -> None:
    assert (groups.held, groups.open_groups("w0"), groups.open_bytes("w0")) == (0, 0, 0)
    assert groups._open == {} and groups._bytes == {}  # no owner's entry outlives its last open group


def test_a_group_is_handed_on_whole_once_its_last_member_arrives():
    groups = GroupAssembler(timeout_s=10)
    assert member("a", 0).nbytes == BYTES
    assert groups.add(member("a", 0), 1.0).complete is None
    assert groups.add(member("a", 1), 2.0).complete is None
    assert (groups.held, groups.open_groups("w0"), groups.open_bytes("w0")) == (2, 1, 2 * BYTES)
    done = groups.add(member("a", 2), 3.0)
    assert done.refused is None and [t.trajectory_id for t in done.complete] == ["a-0", "a-1", "a-2"]
    assert_empty(groups)
    assert groups.expire(100.0) == []  # a completed group never expires later


def test_a_group_of_one_is_complete_at_once_and_never_held():
    groups = GroupAssembler(timeout_s=10, max_open=0, max_bytes=0)
    single = member("s", 0, size=1)
    assert groups.add(single, 0.0).complete == [single]
    assert_empty(groups)


def test_a_member_of_another_size_or_a_repeated_id_is_refused_and_its_group_kept():
    groups = GroupAssembler(timeout_s=10)
    groups.add(member("a", 0, size=3), 0.0)
    refused = groups.add(member("a", 1, size=4), 0.0)
    assert refused.complete is None and refused.refused == (
        "group_inconsistent", "group a has group_size 3, this member 4")
    assert groups.add(member("a", 0, size=3), 0.0).refused[0] == "duplicate_member"
    assert (groups.held, groups.open_bytes("w0")) == (1, BYTES)  # a refusal changes nothing
    groups.add(member("a", 1), 0.0)
    assert len(groups.add(member("a", 2), 0.0).complete) == 3
    assert_empty(groups)


def test_owners_are_namespaces():
    """One worker's group id is not another's: the same id from two owners is two groups."""
    groups = GroupAssembler(timeout_s=10)
    groups.add(member("a", 0, size=2, owner="w0"), 0.0)
    assert groups.add(member("a", 1, size=3, owner="w9"), 0.0).refused is None  # not inconsistent: another group
    assert [t.sampler_id for t in groups.add(member("a", 1, size=2, owner="w0"), 0.0).complete] == ["w0", "w0"]
    assert (groups.open_groups("w9"), groups.held) == (1, 1)


def test_open_groups_per_owner_are_bounded_in_number():
    groups = GroupAssembler(timeout_s=10, max_open=2)
    groups.add(member("a", 0), 0.0)
    groups.add(member("b", 0), 0.0)
    reason, message = groups.add(member("c", 0), 0.0).refused
    assert reason == "open_groups_bound" and message.startswith("w0 already has 2 incomplete groups")
    assert groups.add(member("a", 1), 0.0).refused is None  # a group already open takes its members
    assert groups.add(member("c", 0, owner="w1"), 0.0).refused is None  # another owner has its own bound
    assert (groups.open_groups("w0"), groups.open_groups("w1"), groups.held) == (2, 1, 4)


def test_open_groups_per_owner_are_bounded_in_bytes_and_completion_frees_them():
    groups = GroupAssembler(timeout_s=10, max_bytes=2 * BYTES)
    groups.add(member("a", 0, size=2), 0.0)
    groups.add(member("b", 0), 0.0)  # 80 bytes held: the bound, reached
    reason, message = groups.add(member("b", 1), 0.0).refused
    assert reason == "open_bytes_bound" and f"{3 * BYTES} bytes > {2 * BYTES}" in message
    # the member that completes a group counts too (its bytes are held until then) ...
    assert groups.add(member("a", 1, size=2), 0.0).refused[0] == "open_bytes_bound"
    groups.discard("w0", "b", "group_rejected")
    # ... and once a group completes, its bytes are free again
    assert len(groups.add(member("a", 1, size=2), 0.0).complete) == 2
    assert groups.open_bytes("w0") == 0 and groups.add(member("c", 0), 0.0).refused is None


def test_expiry_drops_groups_older_than_the_timeout_with_the_reason():
    groups = GroupAssembler(timeout_s=10)
    groups.add(member("old", 0), 100.0)
    groups.add(member("old", 1), 105.0)  # the age counts from the first member
    groups.add(member("new", 0), 104.0)
    groups.add(member("other", 0, owner="w1"), 100.0)
    assert groups.expire(110.0) == []  # exactly the timeout: kept
    assert [d.group_id for d in groups.expire(110.5, owner="w0")] == ["old"]  # one owner's only
    [dropped] = groups.expire(110.5)
    assert (dropped.owner, dropped.group_id, dropped.size, dropped.reason) == ("w1", "other", 3, GROUP_EXPIRED)
    assert dropped.why == "incomplete after 10 s (transport.group_timeout_s)"
    [dropped] = groups.expire(114.5)
    assert [t.trajectory_id for t in dropped.members] == ["new-0"]
    assert_empty(groups)


def test_discarding_reports_what_was_held_and_leaves_nothing():
    groups = GroupAssembler(timeout_s=10)
    groups.add(member("a", 0), 0.0)
    groups.add(member("a", 1), 0.0)
    groups.add(member("b", 0), 0.0)
    assert groups.discard("w0", "zzz", "group_rejected") is None  # none of that id held
    dropped = groups.discard_owner("w0", "worker_removed", "silent for 700 s")
    assert [(d.group_id, len(d.members), d.reason, d.why) for d in dropped] == [
        ("a", 2, "worker_removed", "silent for 700 s"), ("b", 1, "worker_removed", "silent for 700 s")]
    assert_empty(groups)
    assert groups.add(member("a", 0), 1.0).complete is None  # the id may open again: a new group


def test_an_owner_at_its_bounds_still_sends_group_after_group():
    """One open group of one group's bytes is enough for a worker that sends each group's members together."""
    groups = GroupAssembler(timeout_s=10, max_open=1, max_bytes=3 * BYTES)
    for name in ("a", "b", "c"):
        done = [groups.add(member(name, j), 0.0) for j in range(3)]
        assert [d.refused for d in done] == [None] * 3 and len(done[-1].complete) == 3
    assert_empty(groups)
