"""`PeerInbox`'s rules on their own (docs/RELIABILITY.md, "Budgets per peer"): one budget of bytes and of work per
peer, all peers' bytes under one ceiling, the next message always the fairest, and the derived byte budget
large enough for an honest worker's whole credit of the longest trajectories."""

import numpy as np
import pytest

from heterorl.config import TransportConfig
from heterorl.rollout.spans import MAX_ENV_SPANS
from heterorl.transport import inbound
from heterorl.transport.inbound import DiscardPace, PeerInbox, peer_budget_bytes
from heterorl.transport.protocol import DEFAULT_LIMITS, TrajectoryBatch, TrajectoryContract, encode
from tests.conftest import trajectory


def drain(inbox: PeerInbox, now: float, cost: dict[str, float]) -> list[str]:
    """The peers of the messages handled in turn at ``now``, each charged ``cost[peer]``."""
    order = []
    while (taken := inbox.next(now)) is not None:
        order.append(taken[0])
        inbox.charge(taken[0], cost.get(taken[0], 0.0), now)
    return order


def test_a_peers_queued_bytes_are_bounded_and_another_peer_is_untouched():
    inbox = PeerInbox(peer_bytes=100, total_bytes=1000, work_s_per_s=1.0, burst_s=1.0)
    assert inbox.add("a", "a1", 60, 0.0) == []
    assert inbox.add("a", "a2", 50, 0.0) == [("a", "a2", "over_budget")]  # 110 > 100: dropped unread
    assert inbox.add("a", "a3", 101, 0.0) == [("a", "a3", "too_large")]  # could never fit
    assert inbox.add("b", "b1", 90, 0.0) == []  # b's budget is its own
    assert inbox.queued_of("a") == 60 and inbox.queued_bytes == 150 and len(inbox) == 2
    assert drain(inbox, 0.0, {}) == ["a", "b"] and inbox.queued_bytes == 0
    assert inbox.add("a", "a4", 100, 0.0) == []  # handled: room again


def test_all_peers_together_stay_under_the_ceiling_by_dropping_from_the_peer_that_holds_the_most():
    inbox = PeerInbox(peer_bytes=100, total_bytes=200, work_s_per_s=1.0, burst_s=1.0)
    for k in range(4):
        assert inbox.add("big", f"big{k}", 25, 0.0) == []
    assert inbox.add("honest", "h1", 40, 0.0) == []
    assert inbox.add("third", "t1", 50, 0.0) == []  # 190: fits
    # 220 > 200: the peer that holds the most (big, 100) gives up its newest
    assert inbox.add("third", "t2", 30, 0.0) == [("big", "big3", "inbound_full")]
    # 215: now third holds the most (80), and its newest goes
    assert inbox.add("honest", "h2", 20, 0.0) == [("third", "t2", "inbound_full")]
    assert inbox.queued_bytes == 185 <= 200
    assert [inbox.queued_of(name) for name in ("big", "honest", "third")] == [75, 60, 50]


def test_a_cheap_message_waits_at_most_for_the_one_being_handled_however_expensive_the_flood():
    inbox = PeerInbox(peer_bytes=10**6, total_bytes=10**7, work_s_per_s=100.0, burst_s=100.0)
    for k in range(20):
        inbox.add("flood", f"f{k}", 10, 0.0)
    assert inbox.next(0.0) == ("flood", "f0")
    inbox.add("honest", "h0", 10, 0.0)  # arrives while the flood's first message (0.4 s) is handled
    inbox.charge("flood", 0.4, 0.0)
    assert inbox.next(0.0) == ("honest", "h0")
    inbox.charge("honest", 0.001, 0.0)
    # both queue on: each is served the same work, not the same number of messages
    for k in range(1, 400):
        inbox.add("honest", f"h{k}", 10, 0.0)
    order = drain(inbox, 0.0, {"flood": 0.4, "honest": 0.001})
    first_flood = order.index("flood")
    assert first_flood == 399, order[:10]  # 399 cheap messages (0.4 s in all) before the flood's next one


def test_a_peer_idle_for_a_while_saves_up_no_credit():
    inbox = PeerInbox(peer_bytes=10**6, total_bytes=10**7, work_s_per_s=100.0, burst_s=100.0)
    for k in range(10):
        inbox.add("busy", f"b{k}", 10, 0.0)
    for _ in range(5):  # busy alone: 5 s of work served
        inbox.next(0.0)
        inbox.charge("busy", 1.0, 0.0)
    inbox.add("late", "l0", 10, 0.0)
    inbox.add("late", "l1", 10, 0.0)
    inbox.add("late", "l2", 10, 0.0)
    order = drain(inbox, 0.0, {"busy": 1.0, "late": 1.0})
    assert order[:4] in (["late", "busy", "late", "busy"], ["busy", "late", "busy", "late"]), order  # taking turns


def test_a_peer_whose_work_budget_is_spent_waits_until_it_refills_and_its_reconnect_owes_the_same():
    inbox = PeerInbox(peer_bytes=10**6, total_bytes=10**7, work_s_per_s=0.25, burst_s=1.0)
    inbox.add("key:attacker", "m0", 10, 0.0)
    inbox.add("key:attacker", "m1", 10, 0.0)
    assert inbox.next(0.0) == ("key:attacker", "m0")
    inbox.charge("key:attacker", 1.5, 0.0)  # 1 s in its bucket: 0.5 s owed
    assert inbox.next(0.0) is None and inbox.wait_s(0.0) == pytest.approx(2.0, abs=1e-3)
    assert inbox.add("key:attacker", "m2", 10, 0.05) == [("key:attacker", "m2", "work_spent")]  # dropped as read
    inbox.add("key:honest", "h0", 10, 0.1)
    assert inbox.next(0.1) == ("key:honest", "h0")  # another peer is not held up
    assert inbox.next(1.9) is None and inbox.next(2.01) == ("key:attacker", "m1")
    inbox.charge("key:attacker", 0.5, 2.01)
    assert not inbox.may_work("key:attacker", 2.02)  # a new connection of the same key is the same peer
    assert inbox.wait_s(2.02) is None  # nothing queued


def test_the_map_of_peers_is_bounded_and_a_peer_in_debt_is_not_forgotten(monkeypatch):
    monkeypatch.setattr(inbound, "MAX_PEERS", 4)
    inbox = PeerInbox(peer_bytes=100, total_bytes=1000, work_s_per_s=1.0, burst_s=1.0)
    inbox.charge("debtor", 10.0, 0.0)
    for k in range(20):
        inbox.add(f"id:{k}", "x", 1, 0.0)
        drain(inbox, 0.0, {})
    assert len(inbox._peers) <= 5 and "debtor" in inbox._peers
    assert not inbox.may_work("debtor", 0.0)


def test_a_peer_is_told_at_most_once_a_second():
    inbox = PeerInbox(peer_bytes=100, total_bytes=1000, work_s_per_s=1.0, burst_s=1.0)
    assert inbox.may_tell("a", 0.0) and not inbox.may_tell("a", 0.5) and inbox.may_tell("b", 0.5)
    assert inbox.may_tell("a", 1.0)


def test_the_derived_byte_budget_holds_an_honest_workers_whole_credit_of_the_longest_trajectories():
    """The worst an honest worker can have in flight: its whole credit, each trajectory as long as the contract
    allows, with ids of the longest, the most environment spans, and span ends of 5 bytes in msgpack."""
    length = 70_000
    config = TransportConfig(credits_per_worker=8)
    contract = TrajectoryContract(vocab_size=1000, max_sequence_len=length, min_logprob=-50.0, group_size=8)
    budget = peer_budget_bytes(config, contract, DEFAULT_LIMITS)
    longest = "x" * DEFAULT_LIMITS.max_id_chars
    spans = tuple(v for k in range(MAX_ENV_SPANS) for v in (65_536 + 2 * k, 65_537 + 2 * k))
    members = [trajectory(trajectory_id=f"{longest[:-1]}{k}", group_id=longest, prompt_id=longest, sampler_id=longest,
                          prompt_tokens=np.full(1, 5, np.int32), completion_len=length - 1,
                          reward=-123456.789, generation_start=1e12, generation_end=1e12 + 1, sent_at=1e12 + 2,
                          stop_reason="y" * 32, env_spans=spans)
               for k in range(8)]
    size = sum(len(frame) for frame in encode(TrajectoryBatch(members)))
    assert size <= budget - 2**20, (size, budget)  # (the MiB left is for its other messages)
    assert budget - 2**20 - size < 0.01 * size  # and not much more than it needs
    assert peer_budget_bytes(TransportConfig(peer_inbound_bytes=12345), contract, DEFAULT_LIMITS) == 12345
    assert peer_budget_bytes(TransportConfig(), None, DEFAULT_LIMITS) == 64 * 2**20


def test_a_connections_messages_are_handled_in_the_order_they_came_across_its_registration():
    """A hello and a repeated hello read before the first was handled wait in probation's queue; the heartbeat
    read after the first was handled (its connection now registered) joins them there, not its worker's own
    queue, which would be served first: the repeated hello is never taken after the heartbeat (a rejoin)."""
    inbox = PeerInbox(peer_bytes=10**6, total_bytes=10**7, work_s_per_s=1.0, burst_s=1.0)
    inbox.add("probation", "hello", 10, 0.0, connection=b"c1")
    inbox.add("probation", "hello again", 10, 0.0, connection=b"c1")
    assert inbox.next(0.0) == ("probation", "hello")
    inbox.charge("probation", 0.01, 0.0)
    inbox.add("id:w", "heartbeat", 10, 0.0, connection=b"c1")  # registered now, but "hello again" still waits
    assert drain(inbox, 0.0, {}) == ["probation", "probation"]
    inbox.add("id:w", "batch", 10, 0.0, connection=b"c1")  # nothing of it waits: its own peer from now on
    assert inbox.next(0.0) == ("id:w", "batch")


def test_reading_what_is_dropped_is_paced_in_all_and_a_pause_lasts_what_was_overspent():
    pace = DiscardPace(s_per_s=0.05, burst_s=0.001)
    assert pace.paused_s(0.0) == 0.0 and pace.left_s(0.0) == pytest.approx(0.001)
    pace.spend(0.0006, 0.0)
    assert pace.paused_s(0.0) == 0.0  # some left
    pace.spend(0.0009, 0.0)  # 0.5 ms overspent: a pause of 10 ms, then reading again
    assert pace.paused_s(0.0) == pytest.approx(0.01, abs=1e-5) and pace.paused_s(0.011) == 0.0
    pace.spend(0.002, 0.011)
    assert pace.paused_s(0.02) > 0
    assert pace.left_s(100.0) == pytest.approx(0.001)  # an idle while saves up one burst, no more
    with pytest.raises(ValueError, match="must be > 0"):
        DiscardPace(0.0, 0.001)
