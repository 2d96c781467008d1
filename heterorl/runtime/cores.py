"""One machine's cores, split between the learner and the workers that `heterorl train` starts on it.

In async mode the learner trains while its workers sample, so on one machine they share its cores. One thread
each (the start) wastes cores whenever one side is faster: it waits, paced, while the other is the
bottleneck. ``runtime.thread_split: adaptive`` (the default) measures both phases over the first steps — the
learner's training time per step, and a worker's time to sample its share of a step — and gives the spare cores
to the slower side:

- learner-bound (training takes over ``MARGIN`` × the sampling): the learner takes the cores its workers'
  threads leave, plus one (the workers are idle, paced, much of the time, and then the learner has the cores
  to itself); the workers keep their threads;
- sampler-bound: the workers share the cores the learner's threads leave, plus one; the learner keeps its own;
- within the margin: unchanged.

So at most one thread more than the machine has cores. Measured on 2 cores (docs/RESULTS.md, "Async without
waste"): giving a learner-bound learner both cores beats one thread each, and giving both sides both cores
is far worse than either (their thread pools fight). The decision is made once; `heterorl learner` /
`heterorl rollout` started by hand keep their configured threads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MARGIN = 1.25  # a side counts as the bottleneck when its phase takes this much longer than the other's
PROBE_STEPS = 5  # learner steps measured before the split is decided (the first one, start-up, is left out)


def machine_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Split:
    learner_threads: int
    worker_threads: int
    reason: str


def decide_split(train_s: float, sample_s: float, *, cores: int, workers: int, learner_threads: int,
                 worker_threads: int) -> Split:
    """The threads for the learner and for each worker, from the measured phase times: ``train_s``, the
    learner's training time per step, and ``sample_s``, a worker's time to sample its share of a step (both
    measured with ``learner_threads`` and ``worker_threads``)."""
    workers = max(workers, 1)
    if train_s > MARGIN * sample_s:
        return Split(max(learner_threads, cores - workers * worker_threads + 1), worker_threads,
                     f"learner-bound: training {train_s:.3f} s a step, sampling {sample_s:.3f} s")
    if sample_s > MARGIN * train_s:
        return Split(learner_threads, max(worker_threads, (cores - learner_threads) // workers + 1),
                     f"sampler-bound: sampling {sample_s:.3f} s a step, training {train_s:.3f} s")
    return Split(learner_threads, worker_threads,
                 f"balanced: training {train_s:.3f} s a step, sampling {sample_s:.3f} s")
