"""How a rollout worker samples its groups: in batches (`BatchRollouts`) or streamed through vLLM's continuous
batch (`StreamingRollouts`, ``runtime.vllm_streaming``). The worker's one loop (`RolloutWorker.run_rollouts`)
owns everything both share — the learner-silence exit, the sync shares, the admission permits, the prompts and
the group numbers, the scoring hand-off — and asks its strategy only what differs (`RolloutStrategy`): when a
version may be loaded, how many groups may start now, how they are started, and when they have ended. A strategy
reaches its worker only through `WorkerPort`.

**Batch.** ``groups_per_call`` groups (a sync share: as many as the permits allow) are sampled in one call of the
episode runner (`rollout_groups`), which returns when the slowest completion has ended; the groups are then
handed off together. Weights are loaded between calls, or, with ``runtime.inflight_updates`` in async mode,
between decode steps (an engine that supports it) and between the turns of episodes.

**Streaming.** Up to ``runtime.stream_max_groups`` groups are kept in vLLM's continuous batch
(`StreamingVLLMEngine`): a new group is started as soon as an admission permit allows and there is room, and
each group is handed off as soon as its last sample ends. It does not go through `rollout_groups` (whose call
ends with its slowest completion: the barrier streaming removes) but through `start_group`, the same request for
one single-turn problem, returned as a future (heterorl/rollout/episodes.py). New weights are loaded while groups
run when ``runtime.inflight_updates`` is on (async mode; every token stamped with the version that drew it);
otherwise the worker stops starting groups, lets those in flight end on the weights they started with, then
loads the version.

What a streaming worker cannot go on with is counted (``StreamingRollouts.counts``, in the worker's closing log
line): a version that does not fit the model (``weights_refused``: the groups in flight end on the old weights
and the worker keeps them), a group whose request vLLM failed (``request_errors``: its permit is returned, the
worker goes on), a group started again because its samples would span more than
``runtime.max_versions_per_sample`` versions (``restarted``, the engine's rule), a group started before the
worker rejoined the learner (``dropped_at_rejoin``: its permit belonged to the session the learner ended, which
would refuse it as over the start limit).
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from heterorl.config import Config
from heterorl.errors import HeteroRLError, SamplingError
from heterorl.rollout.episodes import EpisodeLimits, rollout_groups, start_group
from heterorl.runtime.rollouts import sampling_params

if TYPE_CHECKING:
    from heterorl.training.session import SamplingClient
    from heterorl.transport import WorkerClient

log = logging.getLogger("heterorl.runtime.rollout_strategies")
IDLE_POLL_S = 1.0  # how long a streaming worker waits for a permit when nothing is in flight
BUSY_POLL_S = 0.02  # ... and for a permit or a finished group when groups are in flight


@dataclass
class SampledGroups:
    """Groups sampled and ready to be scored and sent (`WorkerPort.hand_off`): the worker's group numbers
    ``first_index`` onward, their problems, prompt tokens and samples; ``version`` stamps every token of a sample
    that names no per-token versions."""

    first_index: int
    version: int
    problems: list
    prompts: list[list[int]]
    groups: list[list]
    start_wall: float
    end_wall: float


@dataclass(frozen=True)
class TurnTime:
    """One turn of the worker's loop, for its strategy to count (`RolloutStrategy.count_turn`): its length, the
    part spent in the loop's waits (for weights, for permits, out of touch), and whether a group was in flight
    when it began."""

    turn_s: float
    waited_s: float
    in_flight_at_start: bool


class WorkerPort(Protocol):
    """What a rollout strategy is given by the worker that runs it, and all it may ask of it (`RolloutWorker`)."""

    client: WorkerClient  # weights received, permits returned, the learner's sessions of this worker
    sampler: SamplingClient  # its engine and tokenizer
    worker_id: str
    version: int  # the version the worker holds
    max_context: int | None  # the learner's max_sequence_len (None: not told)

    def weights_for_engine(self, state) -> dict:
        """A version's state as the engine loads it (a LoRA adapter checked, and merged unless kept apart)."""

    def hold_version(self, version: int) -> None:
        """The engine now samples with ``version``: the worker holds it and tells the learner."""

    def hand_off(self, sampled: SampledGroups) -> None:
        """Score ``sampled`` and send it, on the scoring thread while sampling goes on."""

    def count_busy(self, seconds: float) -> None:
        """Seconds spent generating (``workers/idle_frac``'s busy part)."""

    def count_idle(self, seconds: float) -> None:
        """Seconds spent waiting, with nothing to generate."""


class RolloutStrategy:
    """What the worker's loop asks of the way its groups are sampled; the defaults are a strategy that holds no
    group between turns."""

    name = ""  # in the worker's closing log line, before `tally`
    scoring_depth = 1  # groups' scoring jobs that may wait on the scoring thread before a hand-off waits
    permit_wait_s = 1.0  # how long the loop waits for admission permits

    def groups_in_flight(self) -> int:
        """Groups started and not yet handed off."""
        return 0

    def take_weights(self) -> None:
        """Load the newest version received, when this strategy can (each turn, first)."""
        raise NotImplementedError

    def load(self, got) -> None:
        """Load ``got`` (version, state) now: a sync worker waited for it."""
        raise NotImplementedError

    def harvest(self) -> None:
        """Hand off the groups that have ended."""

    def room(self) -> int:
        """How many groups may start now (0: wait for those in flight: `wait_for_groups`)."""
        return sys.maxsize

    def wait_for_groups(self) -> None:
        """Wait a moment for a group in flight to end."""

    def start(self, problems: list, first_index: int) -> None:
        """Sample a group of each problem, numbered ``first_index`` onward (their ids and seeds)."""
        raise NotImplementedError

    def count_turn(self, turn: TurnTime) -> None:
        """Count one turn of the loop as busy or idle time."""
        raise NotImplementedError

    def finish(self) -> None:
        """The run is over: drop what is still running."""

    def tally(self) -> str | None:
        """What went wrong along the way, for the closing log line; None: nothing to say."""
        return None


class BatchRollouts(RolloutStrategy):
    """Groups sampled in one call of the episode runner each turn, handed off together (the module's docstring).
    Busy time is the calls' (slowed by ``throttle`` > 1, emulating a slower device), idle time the loop's waits."""

    name = "batch"

    def __init__(self, port: WorkerPort, cfg: Config, task, throttle: float = 1.0) -> None:
        self.port, self.cfg, self.task, self.throttle = port, cfg, task, throttle
        self.sampler = port.sampler
        self.limits = EpisodeLimits.of(cfg.rollout, port.max_context)
        self.inflight_updates = cfg.runtime.inflight_updates and cfg.runtime.mode == "async"
        self.within_turns = self.inflight_updates and self.sampler.engine.supports_inflight_updates

    def take_weights(self) -> None:
        got = self.port.client.latest_weights()
        if got is not None:
            self.load(got)

    def load(self, got) -> None:
        version, state = got
        self.sampler.load_weights(version, self.port.weights_for_engine(state))
        self.port.hold_version(version)

    def start(self, problems: list, first_index: int) -> None:
        cfg, port = self.cfg, self.port
        params = sampling_params(cfg, port.worker_id, first_index)
        start_wall, start, version = time.time(), time.monotonic(), port.version
        prompts, groups = rollout_groups(
            self.sampler, self.task, problems, cfg.rollout.group_size, params, chat_template=cfg.task.chat_template,
            limits=self.limits, weight_updates=self._weights_in_flight if self.within_turns else None,
            between_turns=self.take_weights if self.inflight_updates else None)
        elapsed = time.monotonic() - start
        if self.throttle > 1:
            time.sleep((self.throttle - 1) * elapsed)  # a slower device: counted as busy time
        port.count_busy(time.monotonic() - start)
        port.hand_off(SampledGroups(first_index, version, problems, prompts, groups, start_wall, time.time()))

    def _weights_in_flight(self):
        """In-flight updates: the newest version received since the generation began, or None; the engine
        loads it between two decode steps."""
        got = self.port.client.latest_weights()
        if got is None:
            return None
        self.port.hold_version(got[0])
        return got[0], self.port.weights_for_engine(got[1])

    def count_turn(self, turn: TurnTime) -> None:
        self.port.count_idle(turn.waited_s)  # (the calls counted themselves as busy: `start`)


@dataclass
class _InFlight:
    index: int  # the worker's group number (its id and its seed)
    problem: object
    prompt: list[int]
    start_wall: float
    session: int  # the learner's session of this worker it was started in (its permit's)


class StreamingRollouts(RolloutStrategy):
    """Groups kept in a `StreamingVLLMEngine`'s continuous batch, each handed off as it ends (the module's
    docstring). Each is started with `start_group`, not the episode runner's `rollout_groups`: that call returns
    when the slowest group of its batch has ended, the barrier this strategy exists to remove, and it plays
    multi-turn episodes in rounds, which a streaming worker does not serve (`check_streaming`). A turn of the
    loop with a group in flight counts as busy time, one without as idle."""

    name = "streaming"

    def __init__(self, port: WorkerPort, cfg: Config, task) -> None:
        self.port, self.cfg, self.task = port, cfg, task
        self.engine = port.sampler.engine
        self.tokenizer = port.sampler.tokenizer
        self.client = port.client
        self.in_flight: dict[concurrent.futures.Future, _InFlight] = {}
        self.limit = cfg.runtime.stream_max_groups or 2 * cfg.runtime.groups_per_call
        self.scoring_depth = self.limit  # a group's scoring never holds up the next group's start
        self.inflight_updates = cfg.runtime.inflight_updates and cfg.runtime.mode == "async"
        self.counts: Counter = Counter()
        self._pending = None  # a version received, waiting for the groups in flight to end (no in-flight updates)

    @property
    def permit_wait_s(self) -> float:
        return BUSY_POLL_S if self.in_flight else IDLE_POLL_S

    def groups_in_flight(self) -> int:
        return len(self.in_flight)

    def room(self) -> int:
        return 0 if self._pending is not None else max(0, self.limit - len(self.in_flight))

    def start(self, problems: list, first_index: int) -> None:
        cfg = self.cfg
        for index, problem in enumerate(problems, start=first_index):
            params = sampling_params(cfg, self.port.worker_id, index)
            prompt, future = start_group(self.engine, self.tokenizer, problem, cfg.rollout.group_size, params,
                                         chat_template=cfg.task.chat_template, max_context=self.port.max_context)
            self.in_flight[future] = _InFlight(index, problem, prompt, time.time(), self.client.sessions)

    def count_turn(self, turn: TurnTime) -> None:
        if turn.in_flight_at_start or self.in_flight:
            self.port.count_busy(turn.turn_s)
        else:
            self.port.count_idle(turn.turn_s)

    def finish(self) -> None:
        for future in list(self.in_flight):  # the run is over: what is still running is not needed
            future.cancel()

    # -- weights ------------------------------------------------------------------------------------
    def take_weights(self) -> None:
        got = self.client.latest_weights()
        if got is not None:
            self._pending = got  # (a newer one replaces one still waiting)
        if self._pending is not None and (self.inflight_updates or not self.in_flight):
            got, self._pending = self._pending, None
            self.load(got)

    def load(self, got) -> None:
        version, state = got
        try:
            self.engine.load_version(version, self.port.weights_for_engine(state))
        except SamplingError as exc:
            self.counts["weights_refused"] += 1
            log.error("worker %s: version %d refused, the groups in flight go on with version %d: %s",
                      self.port.worker_id, version, self.engine.version, exc)
            return
        self.port.sampler.version = version
        self.port.hold_version(version)

    # -- groups -------------------------------------------------------------------------------------
    def wait_for_groups(self) -> None:
        if self.in_flight:
            concurrent.futures.wait(list(self.in_flight), timeout=BUSY_POLL_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        else:
            time.sleep(BUSY_POLL_S)

    def harvest(self) -> None:
        """Hand off every group that has ended."""
        for future in [f for f in self.in_flight if f.done()]:
            group = self.in_flight.pop(future)
            try:
                samples = future.result()
            except SamplingError as exc:
                self.counts["request_errors"] += 1
                log.warning("worker %s: group %d failed in vLLM and is dropped (its permit returned): %s",
                            self.port.worker_id, group.index, exc)
                self.client.return_starts(1)
                continue
            except concurrent.futures.CancelledError:
                self.client.return_starts(1)
                continue
            if group.session != self.client.sessions:  # started before the worker rejoined: the learner dropped
                self.counts["dropped_at_rejoin"] += 1  # the session its permit belonged to, and would refuse it
                continue
            for sample in samples:
                sample.text = self.tokenizer.decode(sample.tokens, skip_special_tokens=True)
            self.port.hand_off(SampledGroups(group.index, self.port.version, [group.problem], [group.prompt],
                                             [samples], group.start_wall, time.time()))
        self.counts["restarted"] = self.engine.stats["restarted"]

    def tally(self) -> str:
        counts = {**self.counts, "restarted": self.engine.stats["restarted"]}
        return ", ".join(f"{name} {value}" for name, value in sorted(counts.items()) if value) or "no incidents"


def check_streaming(cfg: Config, engine_name: str, task) -> None:
    """Refuse a streaming run the loop cannot serve, naming the setting to change."""
    from heterorl.tasks.environment import is_multi_turn

    if engine_name != "vllm":
        raise HeteroRLError("runtime.vllm_streaming is on, but this worker's engine is "
                            f"{engine_name}: start it with --engine vllm (or turn runtime.vllm_streaming off)")
    if is_multi_turn(task):
        raise HeteroRLError(f"runtime.vllm_streaming streams single-turn groups; task {task.name!r} plays "
                            "multi-turn episodes, which run in rounds: turn runtime.vllm_streaming off")
