"""No peer's claim sets its share or the run's numbers (docs/RELIABILITY.md, "Bounds per worker"): a worker's
share of the permits follows the groups the learner saw arrive, and the timings its heartbeats say are clipped
to what the learner can check before they reach the run's summary."""

from collections import Counter

import pytest

from heterorl.config import TransportConfig
from heterorl.transport.admission import Admission
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
