"""The numbers of `heterorl bench elastic`, on records made by hand: who was live when, each worker's rate, the
learner's waits, the timeline's windows, the joins, the accounting and the targets' verdicts."""

import pytest

from heterorl.bench.elastic_timeline import (
    Action,
    first_trained,
    learner_rate,
    learner_waits,
    live_intervals,
    totals,
    trained_twice,
    windows,
    worker_rates,
)
from heterorl.runtime.accounting import rollouts_lost


def record(worker: str, group: str, step: int, *, generated: tuple[float, float], trained: tuple[float, float],
           staleness: int = 1, trajectories: int = 4) -> dict:
    return {"step": step, "version": step - 1, "worker": worker, "group_id": group, "oldest_version": step - 1,
            "staleness": staleness, "trajectories": trajectories, "generation_start": generated[0],
            "generation_end": generated[1], "received_at": generated[1], "train_start": trained[0],
            "trained_at": trained[1]}


ACTIONS = [Action(100.0, "start", "a"), Action(100.0, "start", "b"), Action(110.0, "partition", "b"),
           Action(115.0, "heal", "b"), Action(118.0, "kill", "a"), Action(125.0, "start", "a")]


def test_a_worker_is_live_from_its_start_or_heal_until_it_is_killed_partitioned_or_removed():
    assert live_intervals(ACTIONS, end=130.0) == {"a": [(100.0, 118.0), (125.0, 130.0)],
                                                  "b": [(100.0, 110.0), (115.0, 130.0)]}


def test_a_workers_rate_counts_the_groups_of_one_call_once_over_their_shared_span():
    records = [record("a", "a-0", 1, generated=(100.0, 102.0), trained=(103.0, 103.5)),
               record("a", "a-1", 1, generated=(100.0, 102.0), trained=(103.0, 103.5)),  # the same call
               record("a", "a-2", 2, generated=(104.0, 106.0), trained=(107.0, 107.5)),
               record("b", "b-0", 2, generated=(100.0, 108.0), trained=(107.0, 107.5))]
    assert worker_rates(records) == {"a": pytest.approx(12 / 4), "b": pytest.approx(4 / 8)}


def test_the_learner_waits_before_each_step_and_its_rate_leaves_the_waits_out():
    records = [record("a", "a-0", 1, generated=(0, 1), trained=(10.0, 11.0)),
               record("a", "a-1", 2, generated=(0, 1), trained=(13.0, 14.0))]
    waits = {1: 2.0, 2: 1.0}
    assert learner_waits(records, waits) == [(8.0, 10.0), (12.0, 13.0)]
    # from 8 to 14: 6 s, 3 of them waiting; 8 samples in the other 3
    assert learner_rate(records, waits) == pytest.approx(8 / 3)


def test_windows_count_samples_by_when_their_step_ended_and_weigh_live_workers_by_time():
    records = [record("a", "a-0", 1, generated=(100.0, 101.0), trained=(101.0, 102.0), staleness=0),
               record("b", "b-0", 1, generated=(100.0, 104.0), trained=(101.0, 102.0), staleness=2),
               record("b", "b-1", 2, generated=(105.0, 109.0), trained=(112.0, 113.0), staleness=3)]
    rows = windows(records, ACTIONS, {1: 1.0, 2: 3.0}, start=100.0, end=130.0, width=10.0)
    assert [r["t"] for r in rows] == [0, 10, 20]
    first, second, third = rows
    assert first["samples_per_s"] == pytest.approx(0.8) and second["samples_per_s"] == pytest.approx(0.4)
    assert sum(r["samples_per_s"] * r["seconds"] for r in rows) == 12  # every sample trained, once
    assert first["live"] == pytest.approx(2.0) and second["live"] == pytest.approx(0.5 + 0.8)
    assert third["live"] == pytest.approx(1.0 + 0.5)
    assert first["learner_busy"] == pytest.approx(0.8) and second["learner_busy"] == pytest.approx(0.8)
    assert first["staleness"] == {"a": {"mean": 0.0, "max": 0}, "b": {"mean": 2.0, "max": 2}}
    assert not first["steady"] and not second["steady"] and not third["steady"]  # an action within 10 s of each
    rates = worker_rates(records)
    assert first["capacity"] == pytest.approx(rates["a"] + rates["b"])


def test_a_join_waits_for_the_first_group_generated_after_it_and_a_rejoin_counts_afresh():
    records = [record("a", "a-0", 1, generated=(100.5, 101.0), trained=(101.0, 102.5)),
               record("a", "a-9", 9, generated=(126.0, 127.0), trained=(127.0, 128.0))]
    joins = first_trained(records, ACTIONS)
    assert [(j["worker"], j["first_trained_s"]) for j in joins] == [("a", 2.5), ("b", None), ("a", 3.0)]


def test_the_accounting_floors_what_is_lost_at_zero_and_counts_a_group_trained_twice():
    rollouts = {"generated": 100, "trained": 80, "discarded": {"stale": 8, "partial": 2}, "left_over": 10}
    assert rollouts_lost(rollouts) == 0 and rollouts_lost({**rollouts, "generated": 103}) == 3
    assert rollouts_lost({**rollouts, "generated": 99}) == 0  # (the fleet counted a moment before what was left over)
    one = record("a", "a-0", 1, generated=(0, 1), trained=(1, 2))
    assert trained_twice([one, record("b", "a-0", 1, generated=(0, 1), trained=(1, 2))], 0) == 0
    assert trained_twice([one, one], 0) == 1 and trained_twice([one], 2) == 2


def test_the_targets_say_met_not_met_or_not_applicable_with_why():
    records = [record("a", f"a-{k}", k + 1, generated=(100.0 + 2 * k, 101.0 + 2 * k),
                      trained=(101.0 + 2 * k, 102.0 + 2 * k)) for k in range(20)]
    actions = [Action(100.0, "start", "a"), Action(100.0, "start", "b")]
    waits = {k + 1: 1.0 for k in range(20)}
    rows = windows(records, actions, waits, start=100.0, end=140.0)
    rollouts = {"generated": 80, "trained": 80, "discarded": {}, "left_over": 0}
    found = totals(records, actions, rows, waits, rollouts, 0)
    targets = found["targets"]
    assert targets["nothing lost or trained twice"]["verdict"] == "met"
    assert targets["a joining worker's first group trained <= 10 s after it starts"]["verdict"] == (
        "not applicable (a joiner had no group trained)")  # b never delivered
    # the learner waits half the time and trains 4 samples/s when it works: it is the bottleneck (capacity 4/s)
    idle = targets["learner idle < 10% while a worker is live and the learner is the bottleneck"]
    assert idle["value"] == pytest.approx(0.5, abs=0.05) and idle["verdict"] == "not met"
    assert found["learner_rate"] == pytest.approx(4.0)
    assert targets["throughput >= 80% of the live capacity line in steady phases"]["verdict"] == "not met"
    assert found["lost"] == 0 and found["trained_twice"] == 0 and found["groups_trained"] == 20
