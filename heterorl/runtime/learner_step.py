"""One learner step, for every learner that runs a fleet: the live learner (`heterorl.runtime.learner.Learner`:
sockets, threads, the machine's clocks) and the simulated execution (`heterorl.runtime.simulate.Simulation`: a
virtual clock, delay queues and a fleet it runs itself). Each is a `StepHost`: it supplies its clock, its batch
and its way of training and publishing; `learner_step` is the order of a step and what every learner measures
in it, written once:

    batch (the learner's wait is idle time) → staleness in versions and seconds → optimise (a simulation runs
    its fleet meanwhile) → publish → pace the fleet (`Pacer`) → tally and record the step → the host's end of
    step (the live learner's checkpoint)

Staleness is measured on the learner's clock only: versions (the learner's version − a group's oldest token
version) and seconds since that version was published (`StepHost.staleness_s`).
"""

from __future__ import annotations

import logging
from typing import Protocol

from heterorl.config import Config
from heterorl.runs import StepRecorder
from heterorl.runtime.accounting import RunTally
from heterorl.runtime.buffer import Group, Pacer

log = logging.getLogger("heterorl.runtime.learner_step")


class StepHost(Protocol):
    """What `learner_step` needs of the learner it steps."""

    cfg: Config
    tally: RunTally  # the run's tally: the host adds the learner's wait for data to ``idle_s``
    pacer: Pacer
    recorder: StepRecorder
    step: int  # learner steps finished (a resumed learner's go on from its checkpoint)
    starved: bool  # during the last wait for a batch the fleet could start no group (out of permits)
    run_start: float  # when the run started on `clock` (a resumed run's lies its elapsed time before the restart)

    def clock(self) -> float:
        """Seconds on the run's clock (monotonic; virtual in a simulation); ``tally.elapsed_s`` is read on it."""

    def next_batch(self, version: int) -> list[Group] | None:
        """Wait for the buffer policy's next batch, counting the wait in ``tally.idle_s`` (None: stopped)."""

    def staleness_s(self, groups: list[Group]) -> list[float]:
        """Seconds from the publish of each group's oldest version to now, on the learner's clock."""

    def optimise(self, groups: list[Group], staleness: list[int], version: int) -> dict:
        """Train on the batch (`heterorl.training.step.optimize_batch`); the optimiser's metrics. A simulation's
        step takes its virtual seconds here, its fleet running meanwhile."""

    def publish(self) -> int:
        """Publish the new weights to the fleet; their version."""

    def training_time(self, step_start: float) -> float:
        """The step's seconds from ``step_start`` on `clock` to its publish, as the pacer weighs a wait against."""

    def pace_fleet(self, train_s: float) -> None:
        """Tell the fleet how far it may run ahead after this step (the pacer's ``ahead`` may have risen); the live
        learner on a machine it shares with its workers also splits the cores after its first steps."""

    def step_metrics(self, groups: list[Group], staleness: list[int], staleness_s: list[float], version: int,
                     waited_s: float, step_start: float) -> dict:
        """The step's metrics beyond the optimiser's (`heterorl.runtime.accounting.step_metrics` and the host's)."""

    def end_step(self) -> None:
        """What the host does once a step is recorded (the live learner: its checkpoints)."""


def learner_step(host: StepHost, version: int) -> int:
    """One learner step (the module docstring's order); returns the version published, or ``version`` itself when
    the host stopped while waiting for a batch."""
    cfg, tally = host.cfg, host.tally
    idle_before = tally.idle_s
    groups = host.next_batch(version)
    if groups is None:
        return version
    waited = tally.idle_s - idle_before
    step_start = host.clock()
    staleness = [version - g.oldest_version for g in groups]
    staleness_s = host.staleness_s(groups)
    metrics = host.optimise(groups, staleness, version)
    host.step += 1
    version = host.publish()
    train_s = host.training_time(step_start)
    # the first batch waits for start-up, and near the end the run's last step caps the permits
    starved = host.starved and 1 < host.step < cfg.rl.steps - host.pacer.ahead
    if host.pacer.observe(waited, train_s, starved):
        log.info("pace raised to %d step(s) ahead: the learner waited %.2f s for data while the fleet was out of "
                 "permits", host.pacer.ahead, waited)
    host.pace_fleet(train_s)
    tally.add_batch(groups, staleness, staleness_s)
    tally.elapsed_s = host.clock() - host.run_start
    metrics.update(host.step_metrics(groups, staleness, staleness_s, version, waited, step_start))
    host.recorder.record(host.step, metrics, tally.elapsed_s)
    host.end_step()
    return version


__all__ = ["StepHost", "learner_step"]
