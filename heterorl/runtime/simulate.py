"""Simulated execution: the learner and its rollout workers in one process, on a virtual clock.

    heterorl train --config run.yaml runtime.execution=simulated

The same run as the live system (`heterorl train`), with the same semantics:

- the same buffer policy (`GroupBuffer`: window, drop_stale, count_only, admission) and staleness accounting;
- the same delay links, named ``worker-i/trajectories`` (up) and ``worker-i/weights`` (down) and seeded as in
  the live system, so a seed draws the same delays;
- the same prompt shards, sampling seeds and trajectory stamps (`heterorl.runtime.worker`), the same learner step
  (`heterorl.runtime.learner_step`: a `Simulation` is its `StepHost`, with a virtual clock and queues), the same
  optimizer step (`heterorl.training.step.optimize_batch`) and metrics;
- sync mode waits for each new version, async mode never waits, as the live workers do.

With ``delay.fixed_lag_steps`` = k the fleet and its delays are replaced by a fixed staleness: each step's batch
is sampled (the workers' prompt shards and seeds, in turn) by the policy exactly k versions older than the
learner's, from the first step on: versions before the first are copies of the base, so there is no ramp. The learner
keeps the k + 1 newest versions for it.

Only time is simulated. A learner step takes ``simulate.step_s`` virtual seconds; a worker samples a group in
``simulate.call_s / runtime.groups_per_call`` seconds times its throttle; messages take what their delay link
draws. Events run in (virtual time, order) order, so a run is deterministic for a seed and as fast as the model
computes: no sockets, no sleeping. Credits work as live: a worker with ``transport.credits_per_worker``
trajectories not yet taken in by the learner waits (a full buffer leaves arrivals waiting, so a slow learner
holds the fleet back). What it leaves out: transport costs, crashes, and the contention of real processes.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from heterorl.config import Config
from heterorl.delay.links import DelayLink
from heterorl.delay.queue import DelayQueue
from heterorl.errors import HeteroRLError
from heterorl.rollout.episodes import EpisodeLimits, rollout_groups
from heterorl.runs import StepRecorder, idle_fraction, setup_run
from heterorl.runtime.accounting import LearnerResult, RunTally, rollout_waste, step_metrics, weights_summary
from heterorl.runtime.buffer import Group, GroupBuffer, Pacer
from heterorl.runtime.learner import finish_learner_run, group_datums, held_out_eval, trajectory_contract
from heterorl.runtime.learner_step import learner_step
from heterorl.runtime.rollouts import sampling_params, shard_rng, stamp_groups
from heterorl.tasks import Task
from heterorl.tasks.rewards import outcome_counts
from heterorl.training.evaluation import EvalResult
from heterorl.training.session import SamplingClient, TrainingClient
from heterorl.training.step import optimize_batch
from heterorl.transport.groups import GroupAssembler
from heterorl.transport.weights import dtype_name, unpack_state_dict, wire_dtype_for
from heterorl.transport.weights.store import WeightsStore

log = logging.getLogger("heterorl.runtime.simulate")


def durations(cfg: Config) -> tuple[float, float]:
    """(virtual seconds per learner step, virtual seconds per sampled group at throttle 1)."""
    step_s = cfg.simulate.step_s or cfg.delay.seconds_per_step or 1.0
    call_s = cfg.simulate.call_s or step_s * cfg.runtime.workers * cfg.runtime.groups_per_call / cfg.rl.prompts_per_step
    return step_s, call_s / cfg.runtime.groups_per_call


@dataclass
class _Worker:
    worker_id: str
    throttle: float
    rng: object  # the worker's prompt shard (random.Random)
    up: DelayLink | None
    down: DelayLink | None
    next_s: float = 0.0  # when it starts its next engine call; inf while it waits (weights or admission)
    waiting_since: float | None = None
    waiting_for: str = ""  # what it waits for: weights | credit | admission
    version: int = -1  # the version it holds
    used_version: int = -1  # the version of its last call (sync mode waits for a newer one)
    inbox: DelayQueue = field(default_factory=DelayQueue)  # versions of the weights on their way
    noticed: int = -1  # the newest version sent down its weights link (the base of the next delta)
    waiting: int = -1  # the newest version published while its bandwidth-limited link was busy
    groups_sent: int = 0
    in_transit: int = 0  # trajectories sent and not yet taken in by the learner (the live system's credits)
    busy_s: float = 0.0
    idle_s: float = 0.0

    def wait(self, now: float, what: str) -> None:
        self.next_s, self.waiting_since, self.waiting_for = math.inf, now, what

    def wake(self, at: float) -> None:
        if self.waiting_since is not None and at < self.next_s:
            self.idle_s += max(0.0, at - self.waiting_since)
            self.next_s, self.waiting_since = at, None


class Simulation:
    """One run of learner + ``runtime.workers`` workers on a virtual clock; `run` returns a `LearnerResult`. The
    learner's steps are `learner_step`'s, with this simulation as their `StepHost`."""

    def __init__(self, cfg: Config, training: TrainingClient, task: Task, logger=None, progress=None) -> None:
        if cfg.runtime.learner_ranks > 1:
            raise HeteroRLError("runtime.learner_ranks > 1 needs the live execution (runtime.execution=live)")
        self.cfg, self.training, self.task = cfg, training, task
        self.logger, self.progress = logger, progress
        self.step_s, self.group_s = durations(cfg)
        self.buffer = GroupBuffer(cfg.buffer)
        self._groups = GroupAssembler(cfg.transport.group_timeout_s)  # members in, whole groups to the buffer
        throttles = cfg.runtime.throttle or [1.0]
        self.workers = []
        for i in range(cfg.runtime.workers):
            worker_id = f"worker-{i}"
            self.workers.append(_Worker(
                worker_id=worker_id, throttle=throttles[i % len(throttles)], rng=shard_rng(cfg.seed, worker_id),
                up=DelayLink(cfg.delay.up, f"{worker_id}/trajectories") if cfg.delay.up.active else None,
                down=DelayLink(cfg.delay.down, f"{worker_id}/weights") if cfg.delay.down.active else None))
        self._by_id = {w.worker_id: w for w in self.workers}
        self._arrivals = DelayQueue()  # trajectories on their way to the learner
        self._weights: dict[int, dict] = {}  # version -> state dict, while some worker may still sample with it
        # what the live learner sends: the cast to the workers' dtype, as deltas (their bytes load the links)
        self._wire_dtype = wire_dtype_for(cfg.runtime.weights_dtype, training.model)
        self.weights_stats: Counter = Counter()  # `accounting.weights_summary`'s counters
        # the versions packed in the wire dtype and their steps, as the live learner's weights server keeps them
        self._store = WeightsStore(cfg.transport, self.weights_stats)
        self._eval_outcomes: Counter = Counter()  # the programs evaluation ran (the rest: the training rewards')
        self._published_s: dict[int, float] = {}
        self._started = 0  # groups the fleet started (admission control)
        self.pacer = Pacer(cfg.buffer)
        self.starved = False  # the fleet could start no group while the learner waited (`Pacer.observe`)
        self._generated = 0  # trajectories sampled (`rollout_waste`)
        self.tally = RunTally()  # what was trained and how stale, on the virtual clock (elapsed_s: `_now`)
        self.step = 0  # learner steps finished and published
        self.run_start = 0.0  # the virtual clock starts at 0
        self._base = 0  # the first version published (`run`)
        self.recorder: StepRecorder | None = None  # made by `run`
        self._lost = 0  # trajectories their link dropped
        self._now = 0.0  # the virtual clock
        # one sampler for the whole fleet, over its own copy of the weights: each call loads its worker's version
        self._sampler = SamplingClient.for_model(training.frozen_copy().to(self._wire_dtype), training.tokenizer,
                                                 device=cfg.policy.device)
        self._eval = training.live_sampling_client()
        self._limits = EpisodeLimits.of(cfg.rollout, trajectory_contract(cfg, training.model).max_sequence_len)

    # -- the learner side -------------------------------------------------------------------------
    def _publish(self, now: float) -> int:
        version, state = self.training.save_weights_for_sampler().result()
        self._weights[version] = self._pack(version, state)
        self._published_s[version] = now
        for w in self.workers:
            self._send_down(w, version, now)
            if self.buffer.config.policy == "admission":
                w.wake(now)  # the learner stepped: more groups may start
        self._forget_versions()
        return version

    def _pack(self, version: int, state: dict) -> dict:
        """``state`` as the workers receive it: packed in the wire dtype by a `WeightsStore`, with its step from the
        previous version, as the live learner's server publishes it (its counters go to ``weights_stats``)."""
        _, previous = self._store.begin(version)  # (no buffer reuse: the versions kept below are views of theirs)
        packed, step = self._store.pack(state, version, None, previous, self._wire_dtype)
        self._store.add(version, packed, step)
        self._store.trim(set())  # the store keeps the newest; `_weights` keeps what the workers still sample with
        return unpack_state_dict(packed.header, packed.buffer)

    def _send_down(self, w: _Worker, version: int, now: float) -> None:
        """``version`` down the worker's weights link, as the live learner sends it (`LearnerServer.
        _schedule_notice`): the steps since the version sent before where kept, else the whole version; on a
        link still transmitting it waits, replacing any older one waiting (`_settle_link`)."""
        if w.down is None:
            w.noticed = version
            w.inbox.put(now, version)
            if self.cfg.runtime.mode == "sync" or w.version < 0:
                w.wake(now)
            return
        if w.down.free_at is not None and now < w.down.free_at:
            self.weights_stats["weights/link_skipped"] += w.waiting >= 0
            w.waiting = version
            if self.cfg.runtime.mode == "sync" or w.version < 0:
                w.wake(w.down.free_at)  # to send it once the link is free (its call settles the link first)
            return
        steps = self._store.chain.bytes_between(w.noticed, version) if self.cfg.transport.weights_deltas else None
        size = self.weights_stats["weights/version_bytes"] if steps is None else steps
        self.weights_stats["weights/link_transfers"] += 1
        self.weights_stats["weights/link_bytes"] += size
        arrival = w.down.schedule(now, size)
        if arrival is None:
            return  # lost: a newer version will stand in
        w.noticed = version
        w.inbox.put(arrival, version)
        if self.cfg.runtime.mode == "sync" or w.version < 0:
            w.wake(arrival)

    def _settle_link(self, w: _Worker, now: float) -> None:
        """Send the version that waited for the worker's link, from when the link became free (if by ``now``)."""
        if w.waiting >= 0 and w.down is not None and w.down.free_at <= now:
            version, w.waiting = w.waiting, -1
            self._send_down(w, version, w.down.free_at)

    def _forget_versions(self) -> None:
        lag = self.cfg.delay.fixed_lag_steps
        if lag is not None:  # the next batch is sampled by version (newest - lag); before the base, by the base
            oldest = max(min(self._weights), max(self._weights) - lag)
            for v in [v for v in self._weights if v < oldest]:
                del self._weights[v]
            return
        needed = {w.version for w in self.workers} | {v for w in self.workers for v in w.inbox}
        needed |= {w.waiting for w in self.workers}
        for v in [v for v in self._weights if v not in needed and v != max(self._weights)]:
            del self._weights[v]

    def _ingest(self, now: float) -> None:
        room = self.cfg.buffer.max_groups - len(self.buffer)
        due = self._arrivals.pop_due(now) if room > 0 else []
        for i, (_, _, traj) in enumerate(due):
            if room <= 0:  # a full buffer leaves the rest waiting, in their order
                self._arrivals.restore(due[i:])
                break
            self._by_id[traj.sampler_id].in_transit -= 1
            added = self._groups.add(traj, now)
            if added.refused is not None:  # (no bounds here: a member declaring another group size)
                self.buffer.count_unassembled("inconsistent", 1)
            elif added.complete is not None:
                self.buffer.add_group(added.complete, now)
                room -= 1
        for dropped in self._groups.expire(now):
            self.buffer.count_unassembled("partial", len(dropped.members))
        for w in self.workers:
            if w.waiting_for == "credit" and w.in_transit < self.cfg.transport.credits_per_worker:
                w.wake(now)  # credit back (a no-op unless it waits; it rechecks what it waits for)

    def _evaluate(self) -> EvalResult:
        before = outcome_counts(self.task)
        result = held_out_eval(self.cfg, self._eval, self.task)
        self._eval_outcomes.update(outcome_counts(self.task) - before)
        return result

    # -- the worker side --------------------------------------------------------------------------
    def _run_workers(self, until: float, before: bool = False) -> None:
        """Run every worker call that starts at or before ``until`` (``before``: strictly before), in time order."""
        while True:
            w = min(self.workers, key=lambda w: (w.next_s, w.worker_id))
            if w.next_s > until or (before and w.next_s == until):
                return
            self._worker_call(w, w.next_s)

    def _worker_call(self, w: _Worker, now: float) -> None:
        cfg = self.cfg
        self._settle_link(w, now)
        for _, _, version in w.inbox.pop_due(now):
            w.version = max(w.version, version)  # a late older version changes nothing
        sync = cfg.runtime.mode == "sync"
        if w.version < 0 or (sync and w.version <= w.used_version):
            w.wait(now, "weights")
            if w.inbox:
                w.wake(w.inbox.next_due_time())
            elif w.waiting >= 0:  # a version waits for its link: sent (and settled) once the link is free
                w.wake(w.down.free_at)
            return
        if w.in_transit >= cfg.transport.credits_per_worker:
            w.wait(now, "credit")  # out of credit: woken when the learner takes data in
            return
        n = cfg.rl.prompts_per_step // cfg.runtime.workers if sync else cfg.runtime.groups_per_call
        cap = self._admission_cap()
        if cap is not None:
            n = min(n, cap - self._started)
            if n <= 0:
                w.wait(now, "admission")  # woken when the learner steps
                return
        self._started += n
        problems = [self.task.sample_train(w.rng) for _ in range(n)]
        if self._sampler.version != w.version:
            self._sampler.load_weights(w.version, self._weights[w.version])
        prompts, groups = rollout_groups(self._sampler, self.task, problems, cfg.rollout.group_size,
                                         sampling_params(cfg, w.worker_id, w.groups_sent),
                                         chat_template=cfg.task.chat_template, limits=self._limits)
        end = now + n * self.group_s * w.throttle
        stamped = stamp_groups(self.task, w.worker_id, w.groups_sent, w.version, problems, prompts, groups, now, end)
        w.groups_sent += n
        self._generated += sum(map(len, stamped))
        w.busy_s += end - now
        w.used_version = w.version
        for group in stamped:
            sent = 0
            for traj in group:
                traj.sent_at = end
                arrival = w.up.schedule(end, traj.nbytes) if w.up else end
                if arrival is None:
                    self._lost += 1
                    continue
                traj.received_at = arrival
                w.in_transit += 1
                sent += 1
                self._arrivals.put(arrival, traj)
            self._started -= sent == 0  # a group that never arrives (every completion empty, or lost) starts again
        w.next_s = end
        self._forget_versions()

    def _next_event(self) -> float:
        """When something next happens: a worker starts a call or a trajectory arrives (inf: nothing will)."""
        arrival = self._arrivals.next_due_time() if self._arrivals else math.inf
        return min(arrival, *(w.next_s for w in self.workers))

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> LearnerResult:
        cfg = self.cfg
        wall_start = time.monotonic()
        self.recorder = StepRecorder(cfg, self._evaluate, self.logger, self.progress)
        self.recorder.start()
        self._now = 0.0
        version = self._base = self.publish()
        while self.step < cfg.rl.steps:
            version = learner_step(self, version)
        busy, idle = sum(w.busy_s for w in self.workers), sum(w.idle_s for w in self.workers)
        return self.recorder.result(
            LearnerResult, steps=cfg.rl.steps, minutes=(time.monotonic() - wall_start) / 60,
            **self.tally.summary_fields(), worker_idle_frac=idle_fraction(idle, busy),
            rollouts=rollout_waste(generated=self._generated, trained=self.tally.trajectories_trained,
                                   buffer=self.buffer,
                                   left_over=self.buffer.held_trajectories + self._groups.held + len(self._arrivals),
                                   lost=self._lost),
            weights=weights_summary(self.weights_stats, dtype_name(self._wire_dtype),
                                    cfg.transport.weights_deltas),
            reward_outcomes=dict(sorted((outcome_counts(self.task) - self._eval_outcomes).items())))

    # -- the step's host (`learner_step.StepHost`) ------------------------------------------------
    def clock(self) -> float:
        return self._now

    def next_batch(self, version: int) -> list[Group]:
        lag = self.cfg.delay.fixed_lag_steps
        return self._next_batch(self.step + 1, version) if lag is None else self._lagged_batch(version - lag)

    def staleness_s(self, groups: list[Group]) -> list[float]:
        # a version before the base counts as published that many steps before it
        return [self._now - self._published_s.get(g.oldest_version, (g.oldest_version - self._base) * self.step_s)
                for g in groups]

    def optimise(self, groups: list[Group], staleness: list[int], version: int) -> dict:
        """`optimize_batch`, then the step's virtual seconds, the fleet's calls that start meanwhile run."""
        cfg = self.cfg
        metrics = optimize_batch(self.training, group_datums(groups), cfg, cfg.rl.steps * cfg.rl.updates_per_batch)
        self._run_workers(self._now + self.step_s, before=True)  # calls started while the learner trains
        self._now += self.step_s
        return metrics

    def publish(self) -> int:
        return self._publish(self._now)

    def training_time(self, step_start: float) -> float:
        return self.step_s

    def pace_fleet(self, train_s: float) -> None:
        """Nothing to send: a worker reads the admission cap at its next call (`_admission_cap`)."""

    def step_metrics(self, groups: list[Group], staleness: list[int], staleness_s: list[float], version: int,
                     waited_s: float, step_start: float) -> dict:
        busy, idle = sum(w.busy_s for w in self.workers), sum(w.idle_s for w in self.workers)
        shared = step_metrics(groups, staleness, staleness_s, version=version, buffer=self.buffer, tally=self.tally,
                              workers_busy_s=busy, workers_idle_s=idle)
        return {**shared, "sim/time_s": self._now, "sim/lost_trajectories": self._lost,
                "pace/ahead_steps": self.pacer.ahead}

    def end_step(self) -> None:
        """Nothing: a simulation keeps no checkpoints."""

    def _admission_cap(self) -> int | None:
        """`GroupBuffer.admission_limit` at the pace of the run's `Pacer` (None: no admission control)."""
        return self.buffer.admission_limit(self.step, self.cfg.rl.prompts_per_step,
                                           total_steps=self.cfg.rl.steps, ahead_steps=self.pacer.ahead)

    def _next_batch(self, step: int, version: int) -> list:
        """Run the fleet on the virtual clock until the buffer policy hands out a batch; the learner's wait counts
        as idle time."""
        self.starved = False
        while True:
            self._run_workers(self._now)
            self._ingest(self._now)
            groups = self.buffer.take(self.cfg.rl.prompts_per_step, version)
            if groups is not None:
                return groups
            later = self._next_event()
            if not math.isfinite(later):
                raise HeteroRLError(f"the simulation stalled at step {step}: no data on its way and every "
                                    f"worker waiting ({len(self.buffer)} groups buffered); check buffer and delays")
            self.tally.idle_s += max(0.0, later - self._now)  # (an arrival held back by a full buffer is not "later")
            cap = self._admission_cap()
            self.starved = self.starved or (cap is not None and cap <= self._started)
            self._now = max(self._now, later)

    def _lagged_batch(self, source: int) -> list[Group]:
        """``delay.fixed_lag_steps``: the step's batch, sampled by version ``source`` (the base before the base
        version) and stamped with it; each worker samples its share of the prompts in turn, from its own shard
        and seeds."""
        cfg = self.cfg
        weights = max(source, min(self._weights))  # the oldest kept: the base until the lag is past it
        if self._sampler.version != weights:
            self._sampler.load_weights(weights, self._weights[weights])
        groups, share = [], cfg.rl.prompts_per_step // len(self.workers)
        for i, w in enumerate(self.workers):
            n = share + (i < cfg.rl.prompts_per_step % len(self.workers))
            problems = [self.task.sample_train(w.rng) for _ in range(n)]
            prompts, sampled = rollout_groups(self._sampler, self.task, problems, cfg.rollout.group_size,
                                              sampling_params(cfg, w.worker_id, w.groups_sent),
                                              chat_template=cfg.task.chat_template, limits=self._limits)
            stamped = stamp_groups(self.task, w.worker_id, w.groups_sent, source, problems, prompts, sampled,
                                   self._now, self._now)
            w.groups_sent += n
            self._generated += sum(map(len, stamped))
            groups += [Group(members[0].group_id, members, self._now) for members in stamped if members]
        return groups


def simulate_run(cfg: Config, progress=None) -> LearnerResult:
    """``heterorl train`` with ``runtime.execution=simulated``: set up, run, and write what a live run writes."""
    import torch

    torch.set_num_threads(cfg.runtime.threads)
    task, training, logger, run_dir = setup_run(cfg, "simulated", cfg.rl.base or cfg.policy.model)
    try:
        result = Simulation(cfg, training, task, logger, progress).run()
    finally:
        logger.close()
    finish_learner_run(cfg, task, training, Path(run_dir), result,
                       {"execution": "simulated", "step_s": durations(cfg)[0],
                       "fixed_lag_steps": cfg.delay.fixed_lag_steps})
    return result


__all__ = ["Simulation", "durations", "simulate_run"]
