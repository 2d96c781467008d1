"""No peer's claim sets its share or the run's numbers (docs/RELIABILITY.md, "Bounds per worker"): a worker's
share of the permits follows the groups the learner saw arrive, and the timings its heartbeats say are clipped
to what the learner can check before they reach the run's summary."""

import logging
from collections import Counter

import pytest

from heterorl.config import TransportConfig
from heterorl.transport.admission import Admission, share_out
from heterorl.transport.protocol import Heartbeat, Hello
from heterorl.transport.registry import WorkerRegistry


def fleet(names: list[str], now: float = 0.0):
    config, stats = TransportConfig(), Counter()
    registry = WorkerRegistry(config, stats)
    admission = Admission(registry, config, stats)
    admission.set(1000, 4)
    workers = [registry.join(Hello(name, "h", 1), name.encode(), None, now) for name in names]
    for worker in workers:
        admission.start_session(worker)
    return registry, admission, workers


def deliver(admission: Admission, worker, group: str, now: float) -> None:
    admission.count_start(worker, group)
    admission.count_complete(worker, group, now)


def test_a_workers_speed_is_the_groups_the_learner_saw_arrive_whatever_its_heartbeats_claim():
    """Two workers completing a group every 0.5 s, one of them saying it generated for 0.01 s in all (before,
    its claimed speed was 100x the other's, and it took 62 % of the trained groups): the same measured speed,
    the same share; one twice as fast as the other gets twice the share."""
    registry, admission, workers = fleet(["honest", "claims", "fast"])
    now = 0.0
    for tick in range(1, 201):  # 10 s of the I/O thread's 50 ms ticks
        now = tick * 0.05
        admission.grant_all(now, lambda worker: False)
        if tick % 10 == 0:
            deliver(admission, workers[0], f"h{tick}", now)
            deliver(admission, workers[1], f"c{tick}", now)
        if tick % 5 == 0:
            deliver(admission, workers[2], f"f{tick}", now)
        registry.heartbeat(workers[0], Heartbeat("honest", 0, now, busy_s=now * 0.9, idle_s=now * 0.1), now)
        registry.heartbeat(workers[1], Heartbeat("claims", 0, now, busy_s=0.01, idle_s=0.0), now)
        registry.heartbeat(workers[2], Heartbeat("fast", 0, now, busy_s=now * 0.9, idle_s=now * 0.1), now)
    honest, claims, fast = (worker.start_rate() for worker in workers)
    assert honest == pytest.approx(claims) and honest == pytest.approx(2.0, rel=0.1)
    assert fast == pytest.approx(2 * honest, rel=0.1)


def test_the_timings_a_heartbeat_says_are_clipped_to_the_time_that_passed_and_the_runs_age():
    """One peer's heartbeats said 2.26e11 s of weights arrival, 1e9 s for the slowest and an idle fraction of
    0.5 (before: the run's summary showed them as said); now its seconds busy and idle grow at most as time
    passes, and no version arrived later than the run is old. An honest worker's numbers are kept whole."""
    registry, _, (honest, liar) = fleet(["honest", "liar"])
    start = registry.started
    for k in range(1, 11):
        now = start + k
        registry.heartbeat(honest, Heartbeat("honest", 0, now, busy_s=0.8 * k, idle_s=0.2 * k, weights_arrived=k,
                                             weights_arrival_s=0.1 * k, weights_arrival_max_s=0.2), now)
        registry.heartbeat(liar, Heartbeat("liar", 0, now, busy_s=0.0, idle_s=1e8 * k, weights_arrived=k,
                                           weights_arrival_s=2.26e10 * k, weights_arrival_max_s=1e9), now)
    assert (honest.busy_s, honest.idle_s) == pytest.approx((8.0, 2.0))
    assert honest.weights_arrival_s == pytest.approx(1.0) and honest.weights_arrival_max_s == 0.2
    assert liar.busy_s + liar.idle_s <= 10 + registry.config.heartbeat_timeout_s  # 10 s passed, a bucket ahead
    assert liar.weights_arrival_max_s <= 10 and liar.weights_arrival_s <= 10 * 10
    assert registry.stats["heartbeats/timings_clipped"] >= 9
    totals = registry.fleet_totals()
    assert totals["idle_s"] <= 10 + 2 * registry.config.heartbeat_timeout_s + 2.0


def test_a_worker_taken_for_dead_that_says_hello_again_on_its_connection_is_logged_as_back(caplog):
    """A frozen host thawed (SIGSTOP, then SIGCONT): its worker says hello again on the connection it had. The
    learner's log says it is back (before, nothing: only a hello on a new connection was logged, as a rejoin)."""
    registry, _, (worker,) = fleet(["frozen"])
    assert registry.mark_dead_if_silent(worker, TransportConfig().heartbeat_timeout_s + 1.0)
    with caplog.at_level(logging.INFO, logger="heterorl.transport"):
        again = registry.join(Hello("frozen", "h", 1), b"frozen", None, 20.0)
    assert again is worker and worker.alive
    assert "worker frozen is back (hello again)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="heterorl.transport"):
        registry.join(Hello("frozen", "h", 1), b"frozen", None, 21.0)  # alive: a hello repeated is not news
    assert "frozen" not in caplog.text


def test_a_short_pool_is_shared_in_proportion_to_the_wants_the_remainder_in_turn():
    assert share_out([2, 1, 0], 5, 0) == ([2, 1, 0], 0)  # enough for all
    assert share_out([4, 4, 2], 5, 0) == ([2, 2, 1], 0)
    given, turn = share_out([2, 2, 2], 1, 1)
    assert given == [0, 1, 0] and turn == 2
    assert share_out([2, 2, 2], 1, turn) == ([0, 0, 1], 3)  # the turn passes on
    assert share_out([0, 3], 1, 0) == ([0, 1], 0)  # a worker that wants nothing gets nothing


def test_workers_of_one_speed_get_as_many_groups_in_whatever_order_they_joined_while_the_learner_is_the_bottleneck():
    """The learner takes a group every 0.1 s; four workers could each finish one every 0.1 s. Each gets about
    a quarter of the groups (before: the pool went in the registry's order, and the first to join took most)."""
    registry, admission, workers = fleet(["first", "second", "third", "fourth"])
    cap, now = 4, 0.0
    admission.set(cap, 2)
    for tick in range(1, 801):  # 40 s of 50 ms ticks
        now = tick * 0.05
        if tick % 2 == 0:
            cap += 1
            admission.set(cap, 2)
        admission.grant_all(now, lambda worker: False)
        for worker in workers:
            if tick % 2 == 0 and worker.starts_granted_session - worker.permits_voided > worker.groups_session:
                deliver(admission, worker, f"{worker.worker_id}-{tick}", now)
    groups = [worker.groups_session for worker in workers]
    assert sum(groups) >= 380
    assert min(groups) >= 0.8 * max(groups), groups
