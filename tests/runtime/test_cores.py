"""Splitting one machine's cores between the learner and its workers by measured phase times."""

from heterorl.runtime.cores import MARGIN, decide_split, machine_cores


def test_the_spare_cores_go_to_the_slower_phase():
    base = dict(cores=2, learner_threads=1, worker_threads=1)
    learner_bound = decide_split(0.40, 0.26, workers=1, **base)
    assert (learner_bound.learner_threads, learner_bound.worker_threads) == (2, 1)
    assert learner_bound.reason.startswith("learner-bound")
    sampler_bound = decide_split(0.10, 0.30, workers=1, **base)
    assert (sampler_bound.learner_threads, sampler_bound.worker_threads) == (1, 2)
    # two workers on two cores: no side has a spare core to take (at most one thread beyond the cores)
    assert decide_split(0.10, 0.30, workers=2, **base).worker_threads == 1
    assert decide_split(0.40, 0.10, workers=2, **base).learner_threads == 1
    assert decide_split(0.40, 0.10, cores=8, workers=2, learner_threads=1, worker_threads=1).learner_threads == 7
    assert decide_split(0.10, 0.40, cores=8, workers=2, learner_threads=1, worker_threads=1).worker_threads == 4
    balanced = decide_split(0.20, 0.20 * MARGIN * 0.99, workers=1, **base)
    assert (balanced.learner_threads, balanced.worker_threads) == (1, 1) and balanced.reason.startswith("balanced")
    # configured threads are a floor, never lowered
    assert decide_split(0.4, 0.1, cores=8, workers=4, learner_threads=2, worker_threads=3).worker_threads == 3


def test_machine_cores_counts_the_cores_this_process_may_use():
    assert machine_cores() >= 1
