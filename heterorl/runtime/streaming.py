"""A vLLM worker's rollouts without a batch barrier (``runtime.vllm_streaming``).

The worker's usual loop samples ``groups_per_call`` groups in one call and sends them when the slowest completion
of the call has ended. Here the worker keeps up to ``runtime.stream_max_groups`` groups in vLLM's continuous batch
(`StreamingVLLMEngine`): a new group is submitted as soon as an admission permit allows and there is room, and
each group is scored and sent as soon as its last sample ends (scoring on the worker's scoring thread, beside
generation). New weights are loaded while groups run when ``runtime.inflight_updates`` is on (async mode; every
token stamped with the version that drew it); otherwise the worker stops submitting, lets the groups in flight
end on the weights they started with, then loads the version.

What cannot go on is counted (``StreamingRollouts.counts``, in the worker's closing log line): a version that
does not fit the model (``weights_refused``: the groups in flight end on the old weights and the worker keeps
them), a group whose request vLLM failed (``request_errors``: its permit is returned, the worker goes on), a
group started again because its samples would span more than ``runtime.max_versions_per_sample`` versions
(``restarted``, the engine's rule), a group started before the worker rejoined the learner (``dropped_at_rejoin``:
its permit belonged to the session the learner ended, which would refuse it as over the start limit).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import Counter
from dataclasses import dataclass

from heterorl.config import Config
from heterorl.errors import HeteroRLError, SamplingError
from heterorl.rollout.episodes import fit_max_tokens
from heterorl.rollout.textcodec import encode_prompt
from heterorl.runtime.rollouts import sampling_params, stamp_groups
from heterorl.tasks.rewards import outcome_counts
from heterorl.transport.protocol import MIN_LOGPROB

log = logging.getLogger("heterorl.runtime.streaming")
IDLE_POLL_S = 1.0  # how long the loop waits for a permit when nothing is in flight
BUSY_POLL_S = 0.02  # ... and for a permit or a finished group when groups are in flight


@dataclass
class _InFlight:
    index: int  # the worker's group number (its id and its seed)
    problem: object
    prompt: list[int]
    start_wall: float
    session: int  # the learner's session of this worker it was started in (its permit's)


class StreamingRollouts:
    """The loop of a `RolloutWorker` whose engine is a `StreamingVLLMEngine` (`run`)."""

    def __init__(self, worker, cfg: Config, task, rng) -> None:
        self.worker, self.cfg, self.task, self.rng = worker, cfg, task, rng
        self.engine = worker.sampler.engine
        self.tokenizer = worker.sampler.tokenizer
        self.client = worker.client
        self.in_flight: dict[concurrent.futures.Future, _InFlight] = {}
        self.limit = cfg.runtime.stream_max_groups or 2 * cfg.runtime.groups_per_call
        self.inflight_updates = cfg.runtime.inflight_updates and cfg.runtime.mode == "async"
        self.counts: Counter = Counter()
        self.max_context = worker.contract.max_sequence_len if worker.contract is not None else None
        self._pending = None  # a version received, waiting for the groups in flight to end (no in-flight updates)
        self._used_version, self._owed = -1, 0  # sync: the version of the share being sampled, its groups to start
        self._last_heard = time.monotonic()
        worker._scoring.max_pending = self.limit  # a group's scoring never holds up the next group's start

    def run(self) -> int:
        """Until the learner ends the run (0) or stays silent ``learner_timeout_s`` (1). A stretch of the loop with
        a group in flight counts as the worker's busy time, one without as idle (``workers/idle_frac``)."""
        client, worker = self.client, self.worker
        self._last_heard = time.monotonic()
        while not client.finished.is_set():
            tick, busy = time.monotonic(), bool(self.in_flight)
            code = self._step()
            elapsed = time.monotonic() - tick
            if busy or self.in_flight:
                worker.busy_s += elapsed
                client.busy_s = worker.busy_s
            else:
                worker.idle_s += elapsed
                client.idle_s = worker.idle_s
            if code is not None:
                return code
        for future in list(self.in_flight):  # the run is over: what is still running is not needed
            future.cancel()
        worker._scoring.drain()
        return 0

    def _step(self) -> int | None:
        """One turn of the loop: weights, finished groups, then new groups as permits and room allow."""
        cfg, client, worker = self.cfg, self.client, self.worker
        self._take_weights()
        self._harvest()
        if not client.learner_alive:
            if time.monotonic() - self._last_heard > cfg.runtime.learner_timeout_s:
                log.error("worker %s: learner silent for %.0f s; exiting", worker.options.worker_id,
                          cfg.runtime.learner_timeout_s)
                return 1
            time.sleep(0.1)
            return None
        self._last_heard = time.monotonic()
        sync = cfg.runtime.mode == "sync"
        if sync and self._owed == 0:  # sync: the next share is sampled by the next version, once this one's ended
            if self.in_flight:
                self._wait_any()
            elif worker.version <= self._used_version:
                got = client.wait_weights(self._used_version, 1.0)
                if got is not None:
                    self._load(got)
            else:
                self._used_version = worker.version
                self._owed = cfg.rl.prompts_per_step // cfg.runtime.workers
            return None
        room = self.limit - len(self.in_flight)
        if room <= 0 or self._pending is not None:
            self._wait_any()
            return None
        wanted = min(room, self._owed if sync else cfg.runtime.groups_per_call)
        n = client.acquire_starts(wanted, BUSY_POLL_S if self.in_flight else IDLE_POLL_S)
        if n == 0:
            worker._scoring.check()
            return None
        self._owed -= n if sync else 0
        for _ in range(n):
            self._submit()
        return None

    def _submit(self) -> None:
        """Start one group of a new problem from the worker's shard (its number, seed and id: the worker's next)."""
        cfg, worker = self.cfg, self.worker
        problem = self.task.sample_train(self.rng)
        prompt = encode_prompt(self.tokenizer, problem.prompt, cfg.task.chat_template)
        index = worker.groups_sent
        worker.groups_sent += 1
        params = fit_max_tokens(sampling_params(cfg, worker.options.worker_id, index), [prompt], self.max_context)
        future = self.engine.submit(prompt, params, cfg.rollout.group_size)
        self.in_flight[future] = _InFlight(index, problem, prompt, time.time(), self.client.sessions)

    # -- weights ------------------------------------------------------------------------------------
    def _take_weights(self) -> None:
        got = self.client.latest_weights()
        if got is not None:
            self._pending = got  # (a newer one replaces one still waiting)
        if self._pending is not None and (self.inflight_updates or not self.in_flight):
            got, self._pending = self._pending, None
            self._load(got)

    def _load(self, got) -> None:
        version, state = got
        try:
            self.engine.load_version(version, self.worker._for_engine(state))
        except SamplingError as exc:
            self.counts["weights_refused"] += 1
            log.error("worker %s: version %d refused, the groups in flight go on with version %d: %s",
                      self.worker.options.worker_id, version, self.engine.version, exc)
            return
        self.worker.sampler.version = version
        self.worker.version = version
        self.client.set_version_held(version)

    # -- groups -------------------------------------------------------------------------------------
    def _wait_any(self) -> None:
        if self.in_flight:
            concurrent.futures.wait(list(self.in_flight), timeout=BUSY_POLL_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        else:
            time.sleep(BUSY_POLL_S)

    def _harvest(self) -> None:
        """Send every group that has ended (scored on the worker's scoring thread)."""
        for future in [f for f in self.in_flight if f.done()]:
            group = self.in_flight.pop(future)
            try:
                samples = future.result()
            except SamplingError as exc:
                self.counts["request_errors"] += 1
                log.warning("worker %s: group %d failed in vLLM and is dropped (its permit returned): %s",
                            self.worker.options.worker_id, group.index, exc)
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
            self._send(group, samples)
        self.counts["restarted"] = self.engine.stats["restarted"]

    def _send(self, group: _InFlight, samples) -> None:
        worker, task = self.worker, self.task
        contract = worker.contract
        floor = contract.min_logprob if contract is not None else MIN_LOGPROB
        end_wall = time.time()

        def score_and_send() -> None:
            stamped = stamp_groups(task, worker.options.worker_id, group.index, worker.version, [group.problem],
                                   [group.prompt], [samples], group.start_wall, end_wall, floor,
                                   session=worker.session)
            outcomes = dict(outcome_counts(task))
            if outcomes != self.client.reward_outcomes:
                self.client.reward_outcomes = outcomes
            if not stamped[0] or worker._send(list(stamped[0])) == 0:
                self.client.return_starts(1)
        worker._scoring.submit(score_and_send)

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
