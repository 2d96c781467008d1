"""The learner: stamped trajectories in, whole-group batches through a gepo loss, new weights out.

    heterorl learner --bind tcp://*:5555 [--config F] [k=v ...]

Each step (`heterorl.runtime.learner_step`, the one step the simulated execution takes too): pull what the
workers pushed into the staleness-aware buffer (heterorl.runtime.buffer), take ``rl.prompts_per_step`` whole
groups when the buffer policy allows, run ``forward_backward`` + ``optim_step`` through the session
primitives (the loss from gepo, by name), publish the new version. Staleness
is measured on the learner's clock only — versions (current − oldest token
version of a group) and seconds (now − when that version was published) — so
a worker's skewed clock cannot corrupt it.

Checkpoints (``runtime.checkpoint_every``, and one before the first publish)
hold the weights, the optimizer, the version, the RNG, the step, the ids of
every trajectory trained (none is trained twice after a resume) and the eval
history; the newest version published is written down at every publish, so
that a resumed learner's versions go on above it (docs/RELIABILITY.md, "Crash
and resume").
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from heterorl.config import Config, to_worker_dict
from heterorl.errors import HeteroRLError
from heterorl.rollout.episodes import EpisodeLimits
from heterorl.rollout.spans import policy_token_weights
from heterorl.runs import StepRecorder, finish_run, idle_fraction
from heterorl.runtime.accounting import (
    GROUP_LOG,
    LearnerResult,
    RunTally,
    append_group_records,
    group_records,
    rollout_waste,
    step_metrics,
    weights_summary,
)
from heterorl.runtime.buffer import Group, Pacer
from heterorl.runtime.checkpoints import (
    CHECKPOINTS,
    LEARNER_STATE,
    Checkpoint,
    LearnerState,
    commit_checkpoint,
)
from heterorl.runtime.cores import PROBE_STEPS, Split, decide_split, machine_cores
from heterorl.runtime.engine_stats import EngineTally, tallies_to_json
from heterorl.runtime.learner_inbox import LearnerInbox
from heterorl.runtime.learner_step import learner_step
from heterorl.runtime.publishing import Publisher
from heterorl.tasks.base import Task
from heterorl.training.evaluation import EvalResult, evaluate
from heterorl.training.session import Datum, SamplingClient, TrainingClient
from heterorl.training.step import SkippedUpdate, optimize_batch
from heterorl.transport import LearnerServer
from heterorl.transport.protocol import TrajectoryContract

log = logging.getLogger("heterorl.runtime.learner")

SKIPPED_BATCHES = "skipped_batches.jsonl"  # one line per minibatch the loss refused: its trajectory ids, the reason

class Ranks:
    """The learner's torch.distributed group: rank 0 owns the sockets, the buffer, evaluation, logs and
    checkpoints, and hands each batch to every rank; each rank trains on its share of the groups and DDP
    averages the gradients, so all ranks hold the same weights (rank 0 publishes them). Sharded (FSDP), the
    weights are gathered for each publish and checkpoints written by every rank: rank 0 tells the others when
    (`Learner.follow`), so every rank enters each collective in the same order."""

    def __init__(self) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialised else 0
        self.world = dist.get_world_size() if initialised else 1

    def share(self, payload=None):
        """Rank 0's ``payload`` on every rank (a no-op with one rank)."""
        if self.world == 1:
            return payload
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def group_datums(groups: list[Group]) -> list[Datum]:
    """The datums of whole groups; group ids become batch-local indices; an episode's environment tokens weigh 0."""
    datums = []
    for index, group in enumerate(groups):
        for t in group.trajectories:
            prompt = t.prompt_tokens.tolist()
            datums.append(Datum(
                tokens=prompt + t.completion_tokens.tolist(), prompt_len=len(prompt), reward=t.reward,
                group_id=index, behaviour_logprobs=t.behaviour_logprobs.tolist(),
                policy_versions=t.policy_versions.tolist(),
                weights=policy_token_weights(t.env_spans, len(t.completion_tokens)),  # 0: an environment's token
            ))
    return datums


def held_out_eval(cfg: Config, sampler: SamplingClient, task: Task) -> EvalResult:
    """Greedy success of ``sampler``'s weights on the task's held-out problems (per group of a mixture too)."""
    tokens = cfg.rl.eval_max_tokens or cfg.rollout.max_tokens
    limits = EpisodeLimits.for_sampler(cfg.rollout, sampler)
    return evaluate(sampler, task, task.eval_problems(), tokens, chat_template=cfg.task.chat_template, limits=limits)


class Learner:
    """The live learner: a `StepHost` (`heterorl.runtime.learner_step`) over a `LearnerServer` and its fleet, on the
    machine's clocks, with checkpoints and resume."""

    def __init__(self, cfg: Config, training: TrainingClient, task: Task, server: LearnerServer | None,
                 run_dir: str | Path, logger=None, progress=None, *, share_machine: bool = False) -> None:
        """``share_machine``: the workers run on this machine (`heterorl train`): split its cores between
        learner and workers by measured phase times (heterorl.runtime.cores)."""
        self.cfg, self.training, self.task, self.server = cfg, training, task, server
        self.ranks = Ranks()
        per_update = cfg.rl.prompts_per_step // cfg.rl.updates_per_batch
        if per_update < self.ranks.world:
            raise HeteroRLError(f"{self.ranks.world} learner ranks need at least as many groups per update; "
                                f"raise rl.prompts_per_step (now {cfg.rl.prompts_per_step}) or lower "
                                f"rl.updates_per_batch (now {cfg.rl.updates_per_batch})")
        if server is not None and cfg.buffer.policy == "admission" and server.permits_left() is None:
            raise ValueError("buffer.policy 'admission' needs a LearnerServer made with admission_control=True: "
                             "a worker that joined before the first permits would start groups without limit")
        self.run_dir = Path(run_dir)
        self.logger, self.progress = logger, progress
        self.inbox = LearnerInbox(cfg, server, lambda: self.stopped_by)  # the buffer, fed by the ingest thread
        self.pacer = Pacer(cfg.buffer)
        self.run_start = 0.0  # when `run` started, on the monotonic clock, less a resumed run's elapsed time
        self._trained_here = 0  # trajectories this learner process trained (the waste report is per process)
        self._share_machine = share_machine and cfg.runtime.mode == "async" and cfg.runtime.thread_split == "adaptive"
        self._train_times: list[float] = []  # training seconds of the steps measured for the core split
        self.split: Split | None = None  # the core split decided (`_split_cores`)
        self.state = LearnerState()
        self._eval_sampler = training.live_sampling_client() if self.ranks.rank == 0 else None
        self.publisher = Publisher(cfg, training, self.ranks, self.run_dir, server)  # every version's way out
        self.recorder: StepRecorder | None = None  # made by `run`, over the (possibly resumed) state
        self._resumed_step = 0  # the step this learner resumed at: its server counts the groups started since
        self.stopped_by = ""  # why the run stopped before rl.steps (`request_stop`; "": it did not)

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Checkpoint the learner as it stands: its weights file ``checkpoint-STEP.pt`` (every rank's shards into a
        ``.dcp`` folder when sharded), then its state as the commit (`checkpoints.commit_checkpoint`)."""
        folder = self.run_dir / CHECKPOINTS
        folder.mkdir(parents=True, exist_ok=True)
        state = self.state
        with self.inbox.lock:
            state.trained_ids = sorted(self.inbox.trained)
            state.engines = tallies_to_json(self.inbox.engines.tallies)
        if self.recorder is not None:
            state.steps_without_update = self.recorder.steps_without_update
        suffix = ".dcp" if self.training.sharded else ".pt"  # sharded: a folder every rank writes its shards into
        state.version, state.weights = self.training.version, f"checkpoint-{state.step:06d}{suffix}"
        if self.training.sharded:
            self.ranks.share(("save", str(folder / state.weights)))
        self.training.save_state(folder / state.weights).result()
        commit_checkpoint(folder, state)
        self.publisher.since_checkpoint.clear()  # the checkpoint's publish_wall_s holds them all

    def resume(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint`` (`read_checkpoint`): its weights, optimizer, RNG and learner state. The
        version goes on above every version published before, by the learner that wrote the checkpoint or by
        one that ran on after it, so the next publish gives every worker the checkpoint's weights under a
        version newer than any it holds."""
        self.training.load_state(checkpoint.training_state).result()
        self.state = checkpoint.state
        self.state.publish_wall_s.update(checkpoint.published_wall_s)
        self.publisher.since_checkpoint = dict(checkpoint.published_wall_s)
        self.inbox.trained = set(self.state.trained_ids)
        self.inbox.engines.tallies = {name: EngineTally.from_json(raw) for name, raw in self.state.engines.items()}
        self._resumed_step = self.state.step
        self.training.version = checkpoint.newest_published
        log.info("resumed at step %d from version %d; the newest version published was %d, the next is %d",
                 self.state.step, checkpoint.training_state["version"], checkpoint.newest_published,
                 checkpoint.newest_published + 1)

    # -- the step's host (`learner_step.StepHost`) ----------------------------------------------------
    @property
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def tally(self) -> RunTally:
        return self.state.tally

    @property
    def starved(self) -> bool:
        return self.inbox.starved

    def next_batch(self, version: int) -> list[Group] | None:
        """`LearnerInbox.next_batch`; the wait is the learner's idle time (a step stopped meanwhile has none)."""
        groups, waited = self.inbox.next_batch(version)
        if groups is not None:
            self.state.tally.idle_s += waited
            if self.cfg.runtime.mode == "sync":  # the fleet can sample nothing more until the next version lands
                self.server.await_version(version + 1)
        return groups

    def clock(self) -> float:
        return time.monotonic()

    def staleness_s(self, groups: list[Group]) -> list[float]:
        now_wall = time.time()  # versions' publish times are wall times: a resumed learner's go on from before
        return [now_wall - self.state.publish_wall_s.get(str(g.oldest_version), now_wall) for g in groups]

    def publish(self) -> int:
        return self.publisher.publish(self.state.publish_wall_s)

    def training_time(self, step_start: float) -> float:
        return time.monotonic() - step_start

    def pace_fleet(self, train_s: float) -> None:
        self._admit()
        self._split_cores(train_s)

    def end_step(self) -> None:
        every = self.cfg.runtime.checkpoint_every
        if (every and self.state.step % every == 0) or self.state.step == self.cfg.rl.steps:
            self.save_checkpoint()

    # -- helpers ------------------------------------------------------------------------------------
    def _evaluate(self) -> EvalResult:
        if self.publisher.reshard:  # rank 0's whole copy is refreshed only here: every rank gathers into it
            self.ranks.share(("gather",))
            self.training.refresh_full_model().result()
        return held_out_eval(self.cfg, self._eval_sampler, self.task)

    def _admit(self) -> None:
        """Hand the fleet its admission cap for the learner's current step at the pacer's pace."""
        per_step, steps = self.cfg.rl.prompts_per_step, self.cfg.rl.steps
        cap = self.inbox.buffer.admission_limit(self.state.step, per_step, total_steps=steps,
                                                ahead_steps=self.pacer.ahead)
        if cap is not None:  # the server counts the groups started in this learner's life: the steps before it
            cap -= self._resumed_step * per_step  # consumed theirs, so the fleet stays as far ahead as ever
        runtime = self.cfg.runtime
        self.server.set_admission(cap, ahead=runtime.permit_calls * runtime.groups_per_call,
                                  max_lag=runtime.max_weights_lag)

    def _await_fleet(self) -> None:
        """Wait up to ``runtime.fleet_wait_s`` until ``runtime.workers`` live workers hold weights (they said
        hello, loaded their model and applied a version); start with those present when the wait runs out. A
        worker whose bye said it failed (a model its engine cannot load, weights that do not fit:
        `BYE_WORKER_FAILED`) is not waited for: then the wait ends once every other worker is ready."""
        cfg = self.cfg.runtime
        deadline = time.monotonic() + cfg.fleet_wait_s

        def counts() -> tuple[int, int]:
            workers = self.server.workers()
            return sum(w.alive and w.version_held >= 0 for w in workers), sum(w.failed for w in workers)

        ready, gone = counts()
        while ready < cfg.workers - gone and time.monotonic() < deadline and not self.stopped_by:
            time.sleep(0.05)
            ready, gone = counts()
        if self.stopped_by and ready < cfg.workers:
            log.warning("%s while waiting for the fleet (%d of %d workers ready): no training; stopping",
                        self.stopped_by, ready, cfg.workers)
        elif cfg.fleet_wait_s > 0 and ready < cfg.workers:
            log.warning("%d of %d workers ready (%d failed) after %.0f s of runtime.fleet_wait_s = %.0f s; training "
                        "starts with them", ready, cfg.workers, gone, cfg.fleet_wait_s - (deadline - time.monotonic()),
                        cfg.fleet_wait_s)

    # -- the loop -----------------------------------------------------------------------------------
    def request_stop(self, why: str) -> None:
        """End the run after the step in progress (a batch not yet complete is not waited for), with a checkpoint
        to resume from; thread- and signal-safe."""
        self.stopped_by = self.stopped_by or why

    def run(self) -> LearnerResult:
        cfg, state = self.cfg, self.state
        self.run_start = time.monotonic() - state.tally.elapsed_s
        self.recorder = StepRecorder(cfg, self._evaluate, self.logger, self.progress, history=state.history,
                                     steps_without_update=state.steps_without_update)
        self.recorder.start()
        if not (self.run_dir / CHECKPOINTS / LEARNER_STATE).is_file():
            self.save_checkpoint()  # step 0: a learner killed before its first checkpoint can resume too
        version = self.publish()
        self._admit()
        self._await_fleet()
        self.inbox.start()
        try:
            while state.step < cfg.rl.steps and not self.stopped_by:
                version = learner_step(self, version)
            if self.stopped_by and state.step < cfg.rl.steps:
                log.info("stopped at step %d of %d (%s); resume with --resume", state.step, cfg.rl.steps,
                         self.stopped_by)
                self.save_checkpoint()
        finally:
            self.inbox.stop()
        self.ranks.share("stop")
        fleet = self.server.fleet_totals()
        return self.recorder.result(
            LearnerResult, steps=state.step, minutes=state.tally.elapsed_s / 60, **state.tally.summary_fields(),
            worker_idle_frac=idle_fraction(fleet["idle_s"], fleet["busy_s"]),
            engines={name: t.summary(state.tally.elapsed_s) for name, t in sorted(self.inbox.engines.tallies.items())},
            rollouts=self._waste(fleet),
            weights=weights_summary(self.server.stats, self.server.weights_dtype, cfg.transport.weights_deltas,
                                    self.ranks.world if self.publisher.reshard else 1, fleet),
            reward_outcomes=self.server.reward_outcomes())

    def _split_cores(self, train_s: float) -> None:
        """With ``share_machine``: after `PROBE_STEPS` steps (start-up's left out), split the machine's cores by
        the measured training time per step and a worker's sampling time for its share (`decide_split`)."""
        if not self._share_machine or self.split is not None:
            return
        self._train_times.append(train_s)
        fleet, workers = self.server.fleet_totals(), sum(w.alive for w in self.server.workers())
        if len(self._train_times) <= PROBE_STEPS or not fleet["trajectories"] or not workers:
            return
        cfg = self.cfg
        per_group = fleet["busy_s"] * cfg.rollout.group_size / fleet["trajectories"]
        base_learner = cfg.runtime.learner_threads or cfg.runtime.threads
        base_worker = cfg.runtime.worker_threads or cfg.runtime.threads
        self.split = decide_split(float(np.mean(self._train_times[1:])), per_group * cfg.rl.prompts_per_step / workers,
                                  cores=machine_cores(), workers=workers, learner_threads=base_learner,
                                  worker_threads=base_worker)
        torch.set_num_threads(self.split.learner_threads)
        if self.split.worker_threads != base_worker:
            self.server.advise_local_threads(self.split.worker_threads)
        log.info("cores: learner %d thread(s), each worker %d (%s)", self.split.learner_threads,
                 self.split.worker_threads, self.split.reason)

    def _waste(self, fleet: dict) -> dict:
        """`rollout_waste` of this learner process (a resumed learner counts from its restart)."""
        stats = self.server.stats
        inbox = self.inbox
        with inbox.lock:
            left_over = inbox.buffer.held_trajectories + self.server.buffered()
            waste = rollout_waste(generated=int(fleet["trajectories"]) + stats["rejected"], trained=self._trained_here,
                                  buffer=inbox.buffer, left_over=left_over, rejected=stats["rejected"],
                                  dropped_with_group=stats["dropped_trajectories"],
                                  already_trained=inbox.dropped_trained)
        # (the summary's other counts are the whole run's: the waste line says which leg its counts are of)
        return {**waste, "since_step": self._resumed_step or None}

    def optimise(self, groups: list[Group], staleness: list[int], version: int) -> dict:
        """Train every rank on the batch (`optimize_batch`); tally it by engine, keep what the loss refused, note
        its trajectories as trained (and, under ``logging.group_log``, each group in ``RUN_DIR/groups.jsonl``); the
        optimiser's and the engines' metrics."""
        cfg, train_start = self.cfg, time.time()
        _, datums, _ = self.ranks.share(("train", group_datums(groups), self.training.version))
        skipped: list[SkippedUpdate] = []
        fresh: dict[int, list[float]] = {}
        metrics = optimize_batch(self.training, datums, cfg, cfg.rl.steps * cfg.rl.updates_per_batch,
                                 (self.ranks.rank, self.ranks.world), skipped=skipped, fresh_logprobs=fresh)
        with self.inbox.lock:
            metrics.update(self.inbox.engines.add_batch(groups, staleness, fresh, version))
        self._keep_skipped(groups, skipped)
        self.inbox.mark_trained(groups)
        self._trained_here += len(datums)
        if cfg.logging.group_log:
            append_group_records(self.run_dir / GROUP_LOG, group_records(
                groups, staleness, step=self.state.step + 1, version=version, train_start=train_start,
                trained_at=time.time()))
        return metrics

    def _keep_skipped(self, groups: list[Group], skipped: list[SkippedUpdate]) -> None:
        """Append each minibatch the loss refused to ``RUN_DIR/skipped_batches.jsonl``: the step, the version,
        the reason and the ids of its trajectories (rows index `group_datums`' order), for inspection."""
        if not skipped:
            return
        ids = [t.trajectory_id for g in groups for t in g.trajectories]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with (self.run_dir / SKIPPED_BATCHES).open("a") as f:
            for update in skipped:
                f.write(json.dumps({"step": self.state.step + 1, "version": self.training.version,
                                    "reason": update.reason, "trajectory_ids": [ids[i] for i in update.rows]}) + "\n")

    def step_metrics(self, groups: list[Group], staleness: list[int], staleness_s: list[float], version: int,
                     waited_s: float, step_start: float) -> dict:
        """`step_metrics` on the learner's clock, and what only a live fleet has: its workers and transport."""
        state, workers, fleet = self.state, self.server.workers(), self.server.fleet_totals()
        busy, trajectories = fleet["busy_s"], fleet["trajectories"]
        with self.inbox.lock:
            shared = step_metrics(groups, staleness, staleness_s, version=version, buffer=self.inbox.buffer,
                                  tally=state.tally, workers_busy_s=busy, workers_idle_s=fleet["idle_s"])
        return {
            **shared,
            "buffer/trajectories_waiting": self.server.buffered(),
            "workers/alive": sum(w.alive for w in workers),
            # what a simulated run needs to mimic this fleet: simulate.call_s = this × runtime.groups_per_call
            "workers/busy_s_per_group": busy * self.cfg.rollout.group_size / max(trajectories, 1),
            # a worker holding a version the learner has not published would mean the versions went backwards
            "workers/version_held_max": max((w.version_held for w in workers if w.alive), default=-1),
            "transport/rejected": self.server.stats["rejected"],
            # since the learner started: ids it had already trained (before a restart) and ids it had already taken
            "buffer/dropped_trained": self.inbox.dropped_trained,
            "transport/duplicates": self.server.stats["duplicates"],
            # incomplete groups the server dropped (docs/RELIABILITY.md, "Bounds per worker"): refused with a
            # member, timed out, or left behind by a worker that said hello again or left the registry
            "transport/dropped_groups": self.server.stats["dropped_groups"],
            "pace/ahead_steps": self.pacer.ahead,
            "cores/learner_threads": torch.get_num_threads(),
            "rollouts/discarded_frac": self._waste(fleet)["discarded_frac"],
            **self._weights_metrics(),
            "learner/wait_s": waited_s, "learner/train_s": time.monotonic() - step_start,
        }

    def _weights_metrics(self) -> dict:
        """The newest version's step as deltas (bytes, how much smaller than the version, encode seconds) and
        what the workers' links have carried so far."""
        step, stats = self.server.last_step, self.server.stats
        found = {"weights/link_mb": stats["weights/link_bytes"] / 1e6,
                 "weights/link_skipped": stats["weights/link_skipped"]}
        if step is not None:
            found.update({"weights/step_mb": len(step.blob) / 1e6, "weights/encode_s": step.seconds,
                          "weights/bytes_ratio": stats["weights/version_bytes"] / max(len(step.blob), 1)})
        return found

    def follow(self, shard_server=None) -> None:
        """Ranks > 0: do what rank 0 says, in its order, until it says stop: train on a batch (``train``), and,
        sharded, take part in gathering the weights for a publish (``export``) or for evaluation (``gather``),
        publish this rank's slices of a version (``slices``; on ``shard_server``, this rank's weights channel,
        closed at the end) and write a checkpoint's shards (``save``)."""
        self.publisher.shard_server = shard_server
        total_updates = self.cfg.rl.steps * self.cfg.rl.updates_per_batch
        while True:
            message = self.ranks.share()
            if message == "stop":
                if self.publisher.shard_server is not None:
                    self.publisher.shard_server.close()
                return
            if message[0] == "train":
                _, datums, self.training.version = message  # rank 0 publishes; the versions must agree (loss)
                optimize_batch(self.training, datums, self.cfg, total_updates, (self.ranks.rank, self.ranks.world))
            elif message[0] == "export":
                self.training.save_weights_for_sampler().result()
            elif message[0] == "slices":
                self.publisher.publish_own_slices(*message[1:])
            elif message[0] == "gather":
                self.training.refresh_full_model().result()
            elif message[0] == "save":
                self.training.save_state(message[1]).result()


def finish_learner_run(cfg: Config, task: Task, training: TrainingClient, run_dir: Path, result: LearnerResult,
                       extra: dict) -> None:
    """`finish_run` for a runtime run (live or simulated): its summary also names the mode and the fleet."""
    finish_run(cfg, task, training, run_dir, result,
               {"mode": cfg.runtime.mode, "workers": cfg.runtime.workers, **extra},
               title=f"{cfg.runtime.mode}, {cfg.loss.name}", xlabel="learner step")


def trajectory_contract(cfg: Config, model) -> TrajectoryContract:
    """What every trajectory must satisfy to reach ``model`` (docs/RELIABILITY.md): token ids inside its input
    embedding, prompt + completion within its context (``config.max_position_embeddings``), groups of at most
    ``rollout.group_size``; behaviour log-probs at or above the default floor."""
    context = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(context, int):
        raise HeteroRLError(f"the policy's config has no max_position_embeddings (got {context!r}): the learner "
                            "cannot bound the sequences it takes; use a model whose config states its context")
    return TrajectoryContract(vocab_size=model.get_input_embeddings().num_embeddings, max_sequence_len=context,
                              group_size=cfg.rollout.group_size)


def learner_settings(cfg: Config, contract: TrajectoryContract | None = None, base_hash: str | None = None) -> dict:
    """What workers receive in ``ready``: the whole run config, so a fleet cannot drift apart, the contract
    their trajectories must keep (``contract.*``), so an honest worker never breaks it, and a LoRA learner's
    base digest (``lora_base``), so a worker on another base says so before it samples anything."""
    return {"config": _config_for_workers(cfg), **(contract.settings() if contract is not None else {}),
            **({"lora_base": base_hash} if base_hash else {})}


def _config_for_workers(cfg: Config) -> str:
    """The run config as workers receive it (`to_worker_dict`: each key's field declares whether it is sent), in the
    form workers of the previous release read too: the group timeout travels as ``buffer.partial_group_timeout_s``,
    the deprecated key that mirrors it, and the keys new in this release only when they are set."""
    return yaml.safe_dump(to_worker_dict(cfg), sort_keys=False)
