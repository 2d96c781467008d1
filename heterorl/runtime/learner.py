"""The learner: stamped trajectories in, whole-group batches through a gepo loss, new weights out.

    heterorl learner --bind tcp://*:5555 [--config F] [k=v ...]

Each step: pull what the workers pushed into the staleness-aware buffer
(heterorl.runtime.buffer), take ``rl.prompts_per_step`` whole groups when the buffer
policy allows, run ``forward_backward`` + ``optim_step`` through the session
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
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from heterorl.config import Config, to_yaml
from heterorl.errors import HeteroRLError
from heterorl.files import write_atomically
from heterorl.runs import RunResult, StepRecorder, finish_run, idle_fraction
from heterorl.runtime.buffer import Group, GroupBuffer, Pacer
from heterorl.runtime.cores import PROBE_STEPS, Split, decide_split, machine_cores
from heterorl.runtime.engine_stats import UNKNOWN_ENGINE, EngineTally, step_mismatch, tallies_to_json
from heterorl.runtime.run_report import run_staleness, seconds_histogram, weights_summary
from heterorl.tasks.base import Task
from heterorl.training.evaluation import evaluate
from heterorl.training.session import Datum, SamplingClient, TrainingClient, read_training_state
from heterorl.training.step import SkippedUpdate, optimize_batch
from heterorl.transport import LearnerServer
from heterorl.transport.protocol import TrajectoryContract
from heterorl.transport.reshard import DestLayout
from heterorl.transport.shards import describer, slices_for, slices_of
from heterorl.transport.weights import wire_dtype

log = logging.getLogger("heterorl.runtime.learner")

CHECKPOINTS = "checkpoints"  # the folder under the run dir
LEARNER_STATE = "learner_state.json"  # the latest checkpoint: the learner's state, naming its weights file
PREVIOUS_STATE = "learner_state.prev.json"  # the checkpoint before it, kept with its weights file until the next
PUBLISHED = "published.json"  # the newest version published (and when), rewritten before each publish
CHECKPOINT = "checkpoint.pt"  # the weights file of a learner state that names none (run dirs of older versions)
SKIPPED_BATCHES = "skipped_batches.jsonl"  # one line per minibatch the loss refused: its trajectory ids, the reason


@dataclass(kw_only=True)
class LearnerResult(RunResult):
    """A runtime run's result (live or simulated): the RL result and what the fleet did."""

    staleness_mean: float  # versions, over every trained group
    staleness_max: int
    staleness_p50: float  # the median and 95th percentile of the same (linear interpolation)
    staleness_p95: float
    tokens_per_s: float  # completion tokens trained per second of wall (or virtual) time
    learner_idle_frac: float
    worker_idle_frac: float
    # per sampling engine of the fleet: samples/s, staleness, training–inference mismatch (runtime.engine_stats)
    engines: dict[str, dict] = field(default_factory=dict)
    # trajectories generated, trained and discarded by reason, and the fraction wasted (`rollout_waste`)
    rollouts: dict = field(default_factory=dict)
    staleness_hist: list[int] = field(default_factory=list)  # groups trained at staleness 0, 1, 2, ... versions
    staleness_seconds_mean: float = 0.0  # seconds from a group's oldest version's publish to its training
    staleness_seconds_hist: dict[str, int] = field(default_factory=dict)  # the same by bin (run_report)
    samples_per_s: float = 0.0  # trajectories trained per second of wall (or virtual) time
    weights: dict = field(default_factory=dict)  # the weights path (`run_report.weights_summary`)


@dataclass
class LearnerState:
    """What a resume needs besides the TrainingClient state."""

    step: int = 0
    trained_ids: list[str] = field(default_factory=list)  # `Trajectory.key` of each trajectory trained
    history: list[dict] = field(default_factory=list)
    publish_wall_s: dict[str, float] = field(default_factory=dict)  # version → time.time() it was published
    staleness_sum: float = 0.0
    staleness_max: int = 0
    staleness_counts: dict[str, int] = field(default_factory=dict)  # staleness in versions → groups trained
    staleness_seconds_sum: float = 0.0
    staleness_seconds_counts: dict[str, int] = field(default_factory=dict)  # `run_report.seconds_histogram`
    trajectories_trained: int = 0
    groups_trained: int = 0
    tokens_trained: int = 0
    steps_without_update: int = 0
    idle_s: float = 0.0
    elapsed_s: float = 0.0
    version: int = -1  # the policy version of the checkpoint's weights (-1: not recorded, older run dirs)
    engines: dict[str, dict] = field(default_factory=dict)  # engine name → `EngineTally` fields
    weights: str = CHECKPOINT  # the checkpoint's weights file in checkpoints/: model, optimizer, version, RNG


@dataclass
class Checkpoint:
    """A checkpoint read back and checked (`read_checkpoint`): what `Learner.resume` continues from."""

    state: LearnerState
    training_state: dict  # its weights file, as `read_training_state` returns it
    newest_published: int  # the newest version any learner of the run published: at least the checkpoint's
    published_wall_s: dict[str, float]  # version → time.time() it was published, for those after the checkpoint


def _read_learner_state(path: Path) -> LearnerState:
    if not path.is_file():
        raise HeteroRLError(f"{path} does not exist")
    try:
        raw = json.loads(path.read_bytes())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise HeteroRLError(f"{path} is not a learner state: not valid JSON ({exc})") from None
    names = {f.name for f in fields(LearnerState)}
    if (not isinstance(raw, dict) or not set(raw) <= names or not isinstance(raw.get("step"), int)
            or not isinstance(raw.get("trained_ids"), list) or not isinstance(raw.get("weights", ""), str)):
        raise HeteroRLError(f"{path} is not a learner state: expected a JSON object with an integer step, a list "
                            f"of trained_ids and no other keys than {', '.join(sorted(names))}")
    return LearnerState(**raw)


def _read_pair(folder: Path, name: str, map_location) -> tuple[LearnerState, dict]:
    """The learner state ``name`` and the weights file it names, checked to belong together."""
    state = _read_learner_state(folder / name)
    weights = folder / Path(state.weights).name
    training_state = read_training_state(weights, map_location)
    if state.version >= 0 and training_state["version"] != state.version:
        raise HeteroRLError(f"{weights} holds policy version {training_state['version']}, but {name} was written "
                            f"with version {state.version}: they are not one checkpoint")
    return state, training_state


def _read_published(folder: Path) -> tuple[int, dict[str, float]]:
    """(newest version published, {version: wall time} of those since the last checkpoint); (-1, {}) if none."""
    path = folder / PUBLISHED
    if not path.is_file():
        return -1, {}
    try:
        raw = json.loads(path.read_bytes())
        return int(raw["version"]), {str(int(v)): float(t) for v, t in raw["publish_wall_s"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HeteroRLError(f"{path} is not a record of the newest version published ({exc!r}); stop every worker "
                            "(one holding a newer version would ignore the learner's), delete the file and resume "
                            "again: the versions then go on from the checkpoint's") from None


def read_checkpoint(run_dir: str | Path, map_location="cpu") -> Checkpoint:
    """The latest checkpoint of ``run_dir``, every file read and checked (the weights with
    ``torch.load(weights_only=True)``); HeteroRLError naming the file and what is wrong, and which checkpoint
    to resume from instead (the previous one, when it is good) and how."""
    folder = Path(run_dir) / CHECKPOINTS
    if not (folder / LEARNER_STATE).is_file() and not (folder / PREVIOUS_STATE).is_file():
        raise HeteroRLError(f"no checkpoint to resume in {folder}; was the run started with this run dir?")
    try:
        state, training_state = _read_pair(folder, LEARNER_STATE, map_location)
    except HeteroRLError as exc:
        raise HeteroRLError(f"cannot resume from the latest checkpoint: {exc}. {_fallback(folder, map_location)}"
                            ) from None
    newest, wall_s = _read_published(folder)
    return Checkpoint(state, training_state, max(newest, int(training_state["version"])), wall_s)


def _fallback(folder: Path, map_location) -> str:
    """What to resume from when the latest checkpoint is bad: the previous one if it is good, and how."""
    try:
        state, _ = _read_pair(folder, PREVIOUS_STATE, map_location)
    except HeteroRLError as exc:
        return f"No good checkpoint remains ({exc}): start the run again in another logging.run_dir."
    return (f"The previous checkpoint (step {state.step}: {folder / PREVIOUS_STATE} and {state.weights}) is good; "
            f"to resume from it, run `cp {folder / PREVIOUS_STATE} {folder / LEARNER_STATE}` and resume again "
            f"(the steps after {state.step} are trained again)")


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
    """The datums of whole groups; group ids become batch-local indices."""
    datums = []
    for index, group in enumerate(groups):
        for t in group.trajectories:
            prompt = t.prompt_tokens.tolist()
            datums.append(Datum(
                tokens=prompt + t.completion_tokens.tolist(), prompt_len=len(prompt), reward=t.reward,
                group_id=index, behaviour_logprobs=t.behaviour_logprobs.tolist(),
                policy_versions=t.policy_versions.tolist(),
            ))
    return datums


def staleness_percentiles(counts: dict[int, int]) -> dict[str, float]:
    """``staleness_p50`` and ``staleness_p95`` of the groups trained, from {staleness: groups} (0 when none)."""
    if not counts:
        return {"staleness_p50": 0.0, "staleness_p95": 0.0}
    values = np.repeat(np.array(list(counts), dtype=float), list(counts.values()))
    return {"staleness_p50": float(np.percentile(values, 50)), "staleness_p95": float(np.percentile(values, 95))}


def _histogram(values: list[int]) -> list[int]:
    return np.bincount(np.asarray(values, dtype=np.int64)).tolist() if values else []


def held_out_success(cfg: Config, sampler: SamplingClient, task: Task) -> float:
    """Greedy success of ``sampler``'s weights on the task's held-out problems."""
    tokens = cfg.rl.eval_max_tokens or cfg.rollout.max_tokens
    return evaluate(sampler, task, task.eval_problems(), tokens, chat_template=cfg.task.chat_template).success


def step_metrics(groups: list[Group], staleness: list[int], staleness_s: list[float], *, version: int,
                 buffer: GroupBuffer, idle_s: float, elapsed_s: float, workers_busy_s: float,
                 workers_idle_s: float, tokens_trained: int) -> dict:
    """The metrics of one learner step that the live learner and the simulated one share: the batch's reward,
    length and staleness (in versions and seconds), the new version, the buffer's state and counters, idle
    fractions and trained-token throughput (per second of the run's clock)."""
    rewards = [t.reward for g in groups for t in g.trajectories]
    tokens = sum(len(t.completion_tokens) for g in groups for t in g.trajectories)
    stamps = [t.policy_versions for g in groups for t in g.trajectories if len(t.policy_versions)]
    token_gaps = version - 1 - np.concatenate(stamps) if stamps else np.zeros(1)
    return {
        "rollout/reward_mean": float(np.mean(rewards)),
        "rollout/reward_std": float(np.std(rewards)),
        "rollout/completion_len": tokens / len(rewards),
        "staleness/versions_mean": float(np.mean(staleness)),
        "staleness/versions_max": int(max(staleness)),
        "staleness/versions_hist": _histogram(staleness),
        # per token (the version that drew each one: several in a trajectory that took in-flight updates)
        "staleness/token_versions_mean": float(token_gaps.mean()),
        "staleness/spanning_frac": float(np.mean([s.min() != s.max() for s in stamps])) if stamps else 0.0,
        "staleness/seconds_mean": float(np.mean(staleness_s)),
        "staleness/seconds_max": float(max(staleness_s)),
        "policy/version": version,
        "buffer/groups": len(buffer),
        **{f"buffer/{k}": v for k, v in buffer.counters.items()},
        "learner/idle_frac": idle_s / max(elapsed_s, 1e-9),
        "workers/idle_frac": idle_fraction(workers_idle_s, workers_busy_s),
        "throughput/tokens_per_s": tokens_trained / max(elapsed_s, 1e-9),
    }


def rollout_waste(*, generated: int, trained: int, buffer: GroupBuffer, left_over: int, **more: int) -> dict:
    """The run's rollouts: ``generated`` (trajectories that reached the learner, refused ones included),
    ``trained``, ``discarded`` by reason (the buffer's `GroupBuffer.discarded`, and ``more``: refused by the
    transport, dropped with their group, already trained before a restart), ``left_over`` (buffered, never
    trained: the run ended), ``discarded_frac`` and ``wasted_frac``: the shares of generated trajectories
    discarded, and not trained (discarded or left over)."""
    discarded = {**{k: 0 for k in ("stale", "overflow", "partial", "inconsistent")}, **buffer.discarded, **more}
    share = (lambda n: n / generated) if generated else (lambda n: 0.0)
    return {"generated": generated, "trained": trained, "discarded": discarded, "left_over": left_over,
            "discarded_frac": share(sum(discarded.values())), "wasted_frac": share(max(0, generated - trained))}


class Learner:
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
        self.run_dir = Path(run_dir)
        self.logger, self.progress = logger, progress
        self.buffer = GroupBuffer(cfg.buffer)
        self.pacer = Pacer(cfg.buffer)
        self._starved = False  # during the last wait for a batch the fleet could start no group (out of permits)
        self._trained_here = 0  # trajectories this learner process trained (the waste report is per process)
        self._share_machine = share_machine and cfg.runtime.mode == "async" and cfg.runtime.thread_split == "adaptive"
        self._train_times: list[float] = []  # training seconds of the steps measured for the core split
        self.split: Split | None = None  # the core split decided (`_split_cores`)
        self.state = LearnerState()
        self._trained: set[str] = set()
        self._eval_sampler = training.live_sampling_client() if self.ranks.rank == 0 else None
        # a sharded learner's every rank sends its own slices of each version (heterorl.transport.shards)
        self._reshard = training is not None and training.sharded and cfg.runtime.weights_fanout == "reshard"
        self._shard_server = None  # ranks > 0 of a learner that reshards: their slices' weights channel (`follow`)
        self.recorder: StepRecorder | None = None  # made by `run`, over the (possibly resumed) state
        self.dropped_trained = 0  # trajectories that arrived after being trained (before a restart): never twice
        self._since_checkpoint: dict[str, float] = {}  # version → wall time, for versions after the checkpoint
        self._resumed_step = 0  # the step this learner resumed at: its server counts the groups started since
        self._buffer_lock = threading.Condition()
        self._stop_ingest = threading.Event()
        self._ingest_error: BaseException | None = None
        self._engine_of: dict[str, str] = {}  # sampler id → the engine its hello named
        self._tallies: dict[str, EngineTally] = {}  # engine → its totals (saved in the learner state)

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Checkpoint the learner as it stands: its weights file ``checkpoint-STEP.pt`` first, then
        ``learner_state.json``, which names that file, as the commit (each written atomically, so a killed
        learner leaves the old checkpoint or the new one). The checkpoint it replaces stays, as
        ``learner_state.prev.json`` and its weights file; older weights files and temporary files go."""
        folder = self.run_dir / CHECKPOINTS
        folder.mkdir(parents=True, exist_ok=True)
        state = self.state
        state.trained_ids = sorted(self._trained)
        with self._buffer_lock:
            state.engines = tallies_to_json(self._tallies)
        if self.recorder is not None:
            state.steps_without_update = self.recorder.steps_without_update
        suffix = ".dcp" if self.training.sharded else ".pt"  # sharded: a folder every rank writes its shards into
        state.version, state.weights = self.training.version, f"checkpoint-{state.step:06d}{suffix}"
        if self.training.sharded:
            self.ranks.share(("save", str(folder / state.weights)))
        self.training.save_state(folder / state.weights).result()
        keep, latest = {state.weights}, folder / LEARNER_STATE
        if latest.is_file():
            data = latest.read_bytes()
            write_atomically(folder / PREVIOUS_STATE, data)
            try:
                keep.add(json.loads(data).get("weights", CHECKPOINT))
            except (ValueError, AttributeError):
                pass  # not a learner state (the resume that read it would have refused it): nothing to keep
        write_atomically(latest, json.dumps(asdict(state)).encode())
        self._since_checkpoint.clear()  # every version published so far is in the checkpoint's publish_wall_s
        for path in folder.iterdir():  # weights no checkpoint names, and what a killed learner left half-written
            if path.name.startswith(".") or (path.suffix in (".pt", ".dcp") and path.name not in keep):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    def resume(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint`` (`read_checkpoint`): its weights, optimizer, RNG and learner state. The
        version goes on above every version published before, by the learner that wrote the checkpoint or by
        one that ran on after it, so the next publish gives every worker the checkpoint's weights under a
        version newer than any it holds."""
        self.training.load_state(checkpoint.training_state).result()
        self.state = checkpoint.state
        self.state.publish_wall_s.update(checkpoint.published_wall_s)
        self._since_checkpoint = dict(checkpoint.published_wall_s)
        self._trained = set(self.state.trained_ids)
        self._tallies = {name: EngineTally.from_json(raw) for name, raw in self.state.engines.items()}
        self._resumed_step = self.state.step
        self.training.version = checkpoint.newest_published
        log.info("resumed at step %d from version %d; the newest version published was %d, the next is %d",
                 self.state.step, checkpoint.training_state["version"], checkpoint.newest_published,
                 checkpoint.newest_published + 1)

    # -- helpers ------------------------------------------------------------------------------------
    def _evaluate(self) -> float:
        if self._reshard:  # rank 0's whole copy is refreshed only here: every rank gathers into it
            self.ranks.share(("gather",))
            self.training.refresh_full_model().result()
        return held_out_success(self.cfg, self._eval_sampler, self.task)

    def _wire_dtype(self):
        return wire_dtype(self.cfg.runtime.weights_dtype, sum(p.numel() for p in self.training.model.parameters()))

    def _publish(self) -> int:
        if self._reshard:
            return self._publish_slices()
        if self.training.sharded:
            self.ranks.share(("export",))  # every rank takes part in the gather
        adapter = self.training.adapter_meta if self.cfg.lora.publish == "adapter" else None
        version, state = self.training.save_weights_for_sampler("adapter" if adapter else "whole").result()
        wall_s = self.state.publish_wall_s[str(version)] = time.time()
        self._record_published(version, wall_s)
        if adapter:  # the adapter alone, stamped with its base (heterorl.training.lora), at its own wire dtype
            dtype = wire_dtype(self.cfg.runtime.weights_dtype, sum(t.numel() for t in state.values()))
            self.server.publish(version, state, dtype=dtype, describe=lambda header: setattr(header, "adapter",
                                                                                                adapter))
        else:
            self.server.publish(version, state, dtype=self._wire_dtype())
        return version

    def _publish_slices(self) -> int:
        """Every rank publishes its own slices of the new version: rank 0 on its weights channel, the others on
        theirs, keeping the versions rank 0 may still release to a worker."""
        layouts = self.server.layouts()  # the slices workers declared (tensor-parallel engines' ranks)
        self.ranks.share(("slices", sorted(self.server.needed_versions()), layouts))
        version, state = self.training.save_shards_for_sampler().result()
        world = self.ranks.world
        for key, layout in layouts.items():  # first: `publish` below notifies every worker
            slices, shapes, boxes = slices_for(state, 0, world, DestLayout.from_dict(layout))
            self.server.publish_layout(key, version, slices, dtype=self._wire_dtype(),
                                       describe=describer(0, world, shapes, boxes))
        slices, shapes, boxes = slices_of(state, 0, world)
        wall_s = self.state.publish_wall_s[str(version)] = time.time()
        self._record_published(version, wall_s)
        self.server.publish(version, slices, dtype=self._wire_dtype(), describe=describer(0, world, shapes, boxes))
        return version

    def _publish_own_slices(self, needed: list[int], layouts: dict[str, dict]) -> None:
        """Ranks > 0: this rank's slices of the new version, on its weights channel (bound at setup, its port
        told to rank 0: `launch.bind_shard_channels`)."""
        rank, world = self.ranks.rank, self.ranks.world
        if self._shard_server is None:
            raise HeteroRLError(f"learner rank {rank} was asked for its slices but has no weights channel: a learner "
                                "that reshards binds one on every rank at setup (heterorl.runtime.launch)")
        version, state = self.training.save_shards_for_sampler().result()
        self._shard_server.keep_layouts(set(layouts))
        for key, layout in layouts.items():
            slices, shapes, boxes = slices_for(state, rank, world, DestLayout.from_dict(layout))
            self._shard_server.publish(version, slices, shapes, boxes, dtype=self._wire_dtype(), needed=set(needed),
                                       layout=key)
        slices, shapes, boxes = slices_of(state, rank, world)
        self._shard_server.publish(version, slices, shapes, boxes, dtype=self._wire_dtype(), needed=set(needed))

    def _record_published(self, version: int, wall_s: float) -> None:
        """Write down ``version`` as the newest published before any worker can see it (a small file, written
        atomically): a learner resumed from an older checkpoint publishes above it (`read_checkpoint`)."""
        self._since_checkpoint[str(version)] = wall_s
        folder = self.run_dir / CHECKPOINTS
        folder.mkdir(parents=True, exist_ok=True)
        record = {"version": version, "publish_wall_s": self._since_checkpoint}
        write_atomically(folder / PUBLISHED, json.dumps(record).encode())

    def _admit(self, waited_s: float = 0.0, train_s: float = 0.0) -> None:
        """Hand the fleet its admission cap for the learner's current step, after letting the pacer see the
        step's wait for data and training time (`Pacer.observe`)."""
        per_step, steps = self.cfg.rl.prompts_per_step, self.cfg.rl.steps
        # the first batch waits for start-up, and near the end the run's last step caps the permits
        starved = self._starved and 1 < self.state.step < steps - self.pacer.ahead
        if self.pacer.observe(waited_s, train_s, starved):
            log.info("pace raised to %d step(s) ahead: the learner waited %.2f s for data while the fleet was out "
                     "of permits", self.pacer.ahead, waited_s)
        cap = self.buffer.admission_limit(self.state.step, per_step, total_steps=steps, ahead_steps=self.pacer.ahead)
        if cap is not None:  # the server counts the groups started in this learner's life: the steps before it
            cap -= self._resumed_step * per_step  # consumed theirs, so the fleet stays as far ahead as ever
        self.server.set_admission(cap, ahead=self.cfg.runtime.groups_per_call)

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
        while ready < cfg.workers - gone and time.monotonic() < deadline:
            time.sleep(0.05)
            ready, gone = counts()
        if cfg.fleet_wait_s > 0 and ready < cfg.workers:
            log.warning("%d of %d workers ready (%d failed) after %.0f s of runtime.fleet_wait_s = %.0f s; training "
                        "starts with them", ready, cfg.workers, gone, cfg.fleet_wait_s - (deadline - time.monotonic()),
                        cfg.fleet_wait_s)

    def _ingest(self) -> None:
        """Background thread: move arrived trajectories from the transport into the buffer while the learner
        trains, so workers get their credits back at once. A full buffer (``buffer.max_groups``) stops the
        pulling: the data then waits in the transport, whose credits hold the workers back (back-pressure)."""
        try:
            self._ingest_loop()
        except BaseException as exc:  # surfaced by _next_batch: a learner must not wait on a dead thread
            self._ingest_error = exc
            with self._buffer_lock:
                self._buffer_lock.notify_all()

    def _ingest_loop(self) -> None:
        cfg = self.cfg
        while not self._stop_ingest.is_set():
            with self._buffer_lock:
                room = cfg.buffer.max_groups - len(self.buffer)
            if room <= 0:
                self._stop_ingest.wait(0.01)
                continue
            arrived = self.server.get(room * cfg.rollout.group_size, timeout_s=0.05)
            now = time.monotonic()
            with self._buffer_lock:
                for traj in arrived:
                    if traj.key in self._trained:
                        self.dropped_trained += 1  # already trained before a restart: never twice
                        continue
                    self._tally(traj.sampler_id).received += 1
                    self.buffer.add(traj, now)
                self.buffer.expire_partial(now)
                self._buffer_lock.notify_all()

    def _next_batch(self, version: int) -> list[Group]:
        """Block until the buffer policy hands out a batch."""
        cfg = self.cfg
        silent_since, waiting_since, reported = None, time.monotonic(), 0
        self._starved = False
        with self._buffer_lock:
            while True:
                groups = self.buffer.take(cfg.rl.prompts_per_step, version)
                if groups is not None:
                    return groups
                if self._ingest_error is not None:
                    raise HeteroRLError(f"the learner's ingest thread failed: {self._ingest_error!r}")
                self._buffer_lock.wait(0.05)
                self._starved = self._starved or self.server.permits_left() == 0
                now = time.monotonic()
                if now - waiting_since > 30 * (reported + 1):
                    reported += 1
                    alive = sum(w.alive for w in self.server.workers())
                    log.info("waiting %.0f s for a batch of %d groups at version %d: %d complete, %d incomplete "
                             "groups buffered, %d live workers, %s", now - waiting_since, cfg.rl.prompts_per_step,
                             version, len(self.buffer), self.buffer.incomplete, alive,
                             self.server.admission_state())
                if any(w.alive for w in self.server.workers()):
                    silent_since = None
                elif silent_since is None:
                    silent_since = now
                elif now - silent_since > cfg.runtime.worker_timeout_s:
                    raise HeteroRLError(
                        f"no live rollout worker for {cfg.runtime.worker_timeout_s:.0f} s and no data; "
                        f"start workers with `heterorl rollout --connect {self.server.control_endpoint}`")

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> LearnerResult:
        cfg, state = self.cfg, self.state
        start = time.monotonic() - state.elapsed_s
        self.recorder = StepRecorder(cfg, self._evaluate, self.logger, self.progress, history=state.history,
                                     steps_without_update=state.steps_without_update)
        self.recorder.start()
        if not (self.run_dir / CHECKPOINTS / LEARNER_STATE).is_file():
            self.save_checkpoint()  # step 0: a learner killed before its first checkpoint can resume too
        version = self._publish()
        self._admit()
        self._await_fleet()
        ingest = threading.Thread(target=self._ingest, name="heterorl-learner-ingest", daemon=True)
        ingest.start()
        try:
            while state.step < cfg.rl.steps:
                version = self._step(start, version)
        finally:
            self._stop_ingest.set()
            ingest.join(5)
        self.ranks.share("stop")
        fleet = self.server.fleet_totals()
        return self.recorder.result(
            LearnerResult, steps=state.step, minutes=state.elapsed_s / 60,
            staleness_mean=state.staleness_sum / max(state.groups_trained, 1), staleness_max=state.staleness_max,
            **staleness_percentiles({int(k): n for k, n in state.staleness_counts.items()}),
            tokens_per_s=state.tokens_trained / max(state.elapsed_s, 1e-9),
            learner_idle_frac=state.idle_s / max(state.elapsed_s, 1e-9),
            worker_idle_frac=idle_fraction(fleet["idle_s"], fleet["busy_s"]),
            engines={name: t.summary(state.elapsed_s) for name, t in sorted(self._tallies.items())},
            rollouts=self._waste(fleet), **run_staleness(state.staleness_counts, state.staleness_seconds_counts,
                                                         state.staleness_seconds_sum, state.groups_trained),
            samples_per_s=state.trajectories_trained / max(state.elapsed_s, 1e-9),
            weights=weights_summary(self.server.stats, self.server.weights_dtype, cfg.transport.weights_deltas,
                                    self.ranks.world if self._reshard else 1),
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
        with self._buffer_lock:
            return rollout_waste(generated=int(fleet["trajectories"]) + stats["rejected"], trained=self._trained_here,
                                 buffer=self.buffer, left_over=self.buffer.held_trajectories + self.server.buffered(),
                                 rejected=stats["rejected"], dropped_with_group=stats["dropped_trajectories"],
                                 already_trained=self.dropped_trained)

    def _step(self, start: float, version: int) -> int:
        """One learner step: wait for a batch, train on it, publish, record; returns the new version."""
        cfg, state = self.cfg, self.state
        wait_start = time.monotonic()
        groups = self._next_batch(version)
        waited = time.monotonic() - wait_start
        state.idle_s += waited
        step_start = time.monotonic()
        now_wall = time.time()
        staleness = [version - g.oldest_version for g in groups]
        staleness_s = [now_wall - state.publish_wall_s.get(str(g.oldest_version), now_wall) for g in groups]
        _, datums, _ = self.ranks.share(("train", group_datums(groups), self.training.version))
        total_updates = cfg.rl.steps * cfg.rl.updates_per_batch
        skipped: list[SkippedUpdate] = []
        fresh: dict[int, list[float]] = {}
        metrics = optimize_batch(self.training, datums, cfg, total_updates, (self.ranks.rank, self.ranks.world),
                                 skipped=skipped, fresh_logprobs=fresh)
        engine_metrics = self._tally_step(groups, staleness, fresh, version)
        self._keep_skipped(groups, skipped)
        with self._buffer_lock:
            for g in groups:
                self._trained.update(t.key for t in g.trajectories)
        state.step += 1
        version = self._publish()
        self._admit(waited, time.monotonic() - step_start)
        self._trained_here += len(datums)
        self._split_cores(time.monotonic() - step_start)
        state.tokens_trained += sum(len(t.completion_tokens) for g in groups for t in g.trajectories)
        state.groups_trained += len(groups)
        state.staleness_sum += sum(staleness)
        state.staleness_max = max(state.staleness_max, max(staleness))
        for gap in staleness:
            state.staleness_counts[str(gap)] = state.staleness_counts.get(str(gap), 0) + 1
        state.staleness_seconds_sum += sum(staleness_s)
        state.staleness_seconds_counts = seconds_histogram(state.staleness_seconds_counts, staleness_s)
        state.trajectories_trained += len(datums)
        state.elapsed_s = time.monotonic() - start
        metrics.update(self._step_metrics(groups, staleness, staleness_s, version))
        metrics.update(engine_metrics)
        metrics.update({"learner/wait_s": waited, "learner/train_s": time.monotonic() - step_start})
        self.recorder.record(state.step, metrics, state.elapsed_s)
        every = cfg.runtime.checkpoint_every
        if (every and state.step % every == 0) or state.step == cfg.rl.steps:
            self.save_checkpoint()
        return version

    def _engine(self, sampler_id: str) -> str:
        """The engine ``sampler_id``'s worker named in its hello (a worker's hello precedes its trajectories; one
        removed from the registry before the learner first looks is `UNKNOWN_ENGINE`)."""
        engine = self._engine_of.get(sampler_id)
        if engine is None:
            self._engine_of.update((w.worker_id, w.engine) for w in self.server.workers())
            engine = self._engine_of.setdefault(sampler_id, UNKNOWN_ENGINE)
        return engine

    def _tally(self, sampler_id: str) -> EngineTally:
        return self._tallies.setdefault(self._engine(sampler_id), EngineTally())

    def _tally_step(self, groups: list[Group], staleness: list[int], fresh: dict[int, list[float]],
                    version: int) -> dict:
        """Add a trained batch to its engines' tallies; the step's per-engine metrics: trajectories and staleness,
        and the training–inference mismatch of the trajectories sampled by ``version`` (the weights the batch was
        trained from) whose learner log-probs ``fresh`` holds (`heterorl.runtime.engine_stats`)."""
        metrics: dict = {}
        deltas: dict[str, list[np.ndarray]] = {}
        row = 0
        with self._buffer_lock:
            for group, gap in zip(groups, staleness):
                engines = set()
                for t in group.trajectories:
                    engine = self._engine(t.sampler_id)
                    tally = self._tally(t.sampler_id)
                    engines.add(engine)
                    tally.trained += 1
                    tally.tokens_trained += len(t.completion_tokens)
                    metrics[f"engine/{engine}/trajectories"] = metrics.get(f"engine/{engine}/trajectories", 0) + 1
                    if row in fresh and bool((t.policy_versions == version).all()):
                        delta = np.asarray(fresh[row], np.float64) - t.behaviour_logprobs.astype(np.float64)
                        tally.add_mismatch(delta)
                        deltas.setdefault(engine, []).append(delta)
                    row += 1
                for engine in engines:
                    tally = self._tallies[engine]
                    tally.groups_trained += 1
                    tally.staleness_sum += gap
                    tally.staleness_max = max(tally.staleness_max, gap)
        return {**metrics, **step_mismatch(deltas)}

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

    def _step_metrics(self, groups: list[Group], staleness: list[int], staleness_s: list[float],
                      version: int) -> dict:
        """`step_metrics` on the learner's clock, and what only a live fleet has: its workers and transport."""
        state, workers, fleet = self.state, self.server.workers(), self.server.fleet_totals()
        busy, trajectories = fleet["busy_s"], fleet["trajectories"]
        with self._buffer_lock:
            shared = step_metrics(groups, staleness, staleness_s, version=version, buffer=self.buffer,
                                  idle_s=state.idle_s, elapsed_s=state.elapsed_s, workers_busy_s=busy,
                                  workers_idle_s=fleet["idle_s"], tokens_trained=state.tokens_trained)
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
            "buffer/dropped_trained": self.dropped_trained,
            "transport/duplicates": self.server.stats["duplicates"],
            # incomplete groups the server dropped (docs/RELIABILITY.md, "Bounds per worker"): refused with a
            # member, timed out, or left behind by a worker that said hello again or left the registry
            "transport/dropped_groups": self.server.stats["dropped_groups"],
            "pace/ahead_steps": self.pacer.ahead,
            "cores/learner_threads": torch.get_num_threads(),
            "rollouts/discarded_frac": self._waste(fleet)["discarded_frac"],
            **self._weights_metrics(),
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
        self._shard_server = shard_server
        total_updates = self.cfg.rl.steps * self.cfg.rl.updates_per_batch
        while True:
            message = self.ranks.share()
            if message == "stop":
                if self._shard_server is not None:
                    self._shard_server.close()
                return
            if message[0] == "train":
                _, datums, self.training.version = message  # rank 0 publishes; the versions must agree (loss)
                optimize_batch(self.training, datums, self.cfg, total_updates, (self.ranks.rank, self.ranks.world))
            elif message[0] == "export":
                self.training.save_weights_for_sampler().result()
            elif message[0] == "slices":
                self._publish_own_slices(*message[1:])
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
    return {"config": to_yaml(cfg), **(contract.settings() if contract is not None else {}),
            **({"lora_base": base_hash} if base_hash else {})}

