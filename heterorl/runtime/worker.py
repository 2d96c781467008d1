"""The rollout worker: sample groups with the weights it holds, score them, stamp them, push them to the learner.

    heterorl rollout --connect tcp://LEARNER:5555 --worker-id berlin-0 [--server-key learner.key ...]

The worker needs only the package, the learner's address (and, off loopback,
the learner's public key and its own key pair). Everything else — task,
rollout settings, delays, mode — comes from the learner's config in its
``ready`` answer, so a fleet cannot drift apart.

Prompts: each worker draws from its *own shard* of the task, a random stream
seeded by (run seed, worker id). Why not prompts handed out by the learner?
Because a handed-out prompt costs a round trip across the (possibly
minutes-long) link before every generation, and a worker whose link is slow
would starve; with its own shard a worker always has work, stays
reproducible, and two workers never draw the same stream.

Weights are applied between generations (one policy version per group), or,
with ``runtime.inflight_updates`` in async mode, between decode steps of a
generation in progress (each token stamped with the version that drew it; the
torch engine). A vLLM worker with ``runtime.vllm_streaming`` has no batch barrier at all: groups are submitted
and sent one by one, weights loaded while they run. Both are strategies under the worker's one loop
(`run_rollouts`; heterorl/runtime/rollout_strategies.py), which owns what they share: the exit when the learner
stays silent, the sync shares, the admission permits, the scoring hand-off. A worker never waits forever for new
weights: in async mode it keeps generating with what it has; in sync mode (the on-policy baseline) it waits for
the next version after each share of a batch, with a timeout.

With ``--serve-openai PORT`` the worker also serves an OpenAI-compatible API over the weights it holds, so an
agent harness can generate with its current policy (`served_models`, docs/SERVICE.md).
"""

from __future__ import annotations

import functools
import logging
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from heterorl.config import ENGINES, Config, TransportConfig, load_config
from heterorl.delay.clock import delay_clock
from heterorl.delay.links import DelayLink
from heterorl.errors import HeteroRLError
from heterorl.policies import load_policy, policy_folder
from heterorl.policies.hf_folder import declared_vocab_size, load_hf_tokenizer
from heterorl.runtime.rollout_strategies import (
    BatchRollouts,
    RolloutStrategy,
    SampledGroups,
    StreamingRollouts,
    TurnTime,
    check_streaming,
)
from heterorl.runtime.rollouts import (  # noqa: F401 (sampling_params, new_session: imported from here too)
    Pipeline,
    new_session,
    sampling_params,
    shard_rng,
    stamp_groups,
)
from heterorl.runtime.signals import signal_handlers
from heterorl.tasks import make_task_from
from heterorl.tasks.rewards import outcome_counts
from heterorl.training import lora
from heterorl.training.session import SamplingClient
from heterorl.transport import CurveConfig, TransportTimeout, WorkerClient
from heterorl.transport.client import AdapterWeights
from heterorl.transport.protocol import BYE_WORKER_FAILED, MIN_LOGPROB, Trajectory, TrajectoryContract
from heterorl.transport.weights import wire_dtype_for

log = logging.getLogger("heterorl.runtime.worker")


@dataclass
class WorkerOptions:
    address: str
    worker_id: str
    curve: CurveConfig | None = None
    throttle: float = 1.0  # > 1 emulates a slower device: sleep (throttle − 1) × generation time per call
    policy: str | None = None  # override the learner config's starting policy (a local folder on this machine)
    connect_timeout_s: float = 120.0
    allow_plaintext: bool = False
    engine: str = "torch"  # the sampling engine: torch (TorchEngine) | vllm (VLLMEngine; needs vLLM installed)
    openai_port: int | None = None  # serve the OpenAI-compatible endpoint on this port (0: a free one); None: not
    openai_host: str = "127.0.0.1"  # where it listens: loopback unless given (it has no authentication)


class RolloutWorker:
    """One worker: set up from the learner's config, then its loop (`run_rollouts`) over a rollout strategy, to
    which it is the `WorkerPort`. ``run`` returns when the learner says the run is over or stays silent too
    long. ``client``: the transport to the learner (default: a `WorkerClient` to ``options.address``)."""

    def __init__(self, options: WorkerOptions, client: WorkerClient | None = None) -> None:
        if options.throttle < 1:
            raise HeteroRLError(f"--throttle {options.throttle}: must be >= 1 (2 = a device half as fast)")
        if options.engine not in ENGINES:
            raise HeteroRLError(f"--engine {options.engine!r}: must be one of {', '.join(ENGINES)}")
        self._born = time.monotonic()
        self.options = options
        self.sampler: SamplingClient | None = None
        self.openai_server = self._serve_openai()  # first: a port in use fails before the learner is contacted
        transport = TransportConfig(allow_plaintext=options.allow_plaintext)
        self.client = client or WorkerClient(options.address, options.worker_id, transport, curve=options.curve,
                                             engine=options.engine)
        self.version = -1
        self.learner_timeout_s = 300.0  # from the learner's config once it answers
        self.contract: TrajectoryContract | None = None  # what the learner takes, from its ready answer
        self.session = new_session()  # in every id this process stamps
        self.groups_sent = 0
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._scratch: tempfile.TemporaryDirectory | None = None  # a fresh tiny policy saved for vLLM
        self._lora_base: str | None = None  # a LoRA learner's base digest (its ready settings)
        self._merger: lora.Merger | None = None  # a LoRA run's adapters merged into this worker's base
        self._lora_digest: str | None = None  # the digest of this worker's base (a LoRA run)
        self._scoring = Pipeline()  # a batch is scored and sent while the next one is sampled
        self.strategy: RolloutStrategy | None = None  # how its groups are sampled, once the loop runs
        self._task = None  # the task whose groups it scores (`hand_off`), once it runs
        self._turn_waited_s = 0.0  # the loop's waits in its current turn (`_wait`)
        self._closing = threading.Event()

    def _serve_openai(self):
        """The OpenAI-compatible endpoint over the weights this worker holds (``openai_port``; docs/SERVICE.md), on
        a daemon thread: the loop never waits for it. Its requests queue on the worker's sampler with the worker's
        own generations, each delaying the next rollout by as long as it takes. None without a port."""
        if self.options.openai_port is None:
            return None
        from heterorl.service.openai_api import openai_app
        from heterorl.service.server import ServerThread, is_loopback

        worker_id, host = self.options.worker_id, self.options.openai_host
        server = ServerThread(openai_app(self.served_models, owned_by=f"heterorl:worker-{worker_id}"), host,
                              self.options.openai_port)
        log.info("worker %s: OpenAI-compatible endpoint on %s/v1 (models: latest, heterorl:worker-%s/VERSION)",
                 worker_id, server.url, worker_id)
        if not is_loopback(host):
            log.warning("worker %s: the OpenAI-compatible endpoint on %s has no authentication: whoever reaches "
                        "it can generate with this worker's policy and delay its rollouts", worker_id, server.url)
        return server

    def served_models(self) -> dict[str, SamplingClient]:
        """The model ids the OpenAI-compatible endpoint serves: the weights this worker holds, as "latest" and
        as ``heterorl:worker-{worker_id}/{version}`` (the policy version); none before the first weights."""
        sampler = self.sampler
        if sampler is None or sampler.version < 0:
            return {}
        return {"latest": sampler, f"heterorl:worker-{self.options.worker_id}/{sampler.version}": sampler}

    # -- set-up from the learner's config ---------------------------------------------------------
    def _configure(self) -> Config:
        ready = self.client.wait_ready(self.options.connect_timeout_s)
        if "config" not in ready.settings:
            raise HeteroRLError("the learner sent no run config in its ready message; is it a heterorl learner?")
        cfg = load_config(text=ready.settings["config"])
        self.contract = TrajectoryContract.from_settings(ready.settings)
        self._lora_base = ready.settings.get("lora_base")  # a LoRA learner's base digest
        self.client.config = cfg.transport
        self.learner_timeout_s = cfg.runtime.learner_timeout_s
        torch.set_num_threads(cfg.runtime.worker_threads or cfg.runtime.threads)
        clock = delay_clock(cfg)
        if cfg.delay.up.active:
            link = DelayLink(cfg.delay.up, name=f"{self.options.worker_id}/trajectories")
            self.client.set_trajectory_delay(link.schedule, clock)
        return cfg

    def _check_lora_base(self, cfg: Config, model, base: str) -> str | None:
        """A LoRA run: the digest of this worker's base (`lora.base_hash`), refused at once when it is not the
        learner's; None otherwise."""
        if not cfg.lora.enabled:
            return None
        digest = lora.base_hash(model)
        if self._lora_base and digest != self._lora_base:
            raise HeteroRLError(f"policy {base!r} is not the base the learner's adapter is trained on (their "
                                "weights' digests differ): start the worker with the learner's base model (the same "
                                "folder or shipped policy, unmodified), or no --policy")
        return digest

    def _keep_adapters_unmerged(self, cfg: Config, sampler: SamplingClient) -> None:
        """``lora.apply: unmerged`` on the torch engine: adapter layers beside the model's, loaded per version."""
        engine = sampler.engine
        lora.inject(engine.model, cfg.lora)
        engine.adapter_loader = functools.partial(lora.load_adapter, engine.model)

    # -- what a rollout strategy may ask of its worker (`WorkerPort`) --------------------------------
    @property
    def worker_id(self) -> str:
        return self.options.worker_id

    @property
    def max_context(self) -> int | None:
        """The learner's max_sequence_len, from its ready answer (None before it)."""
        return self.contract.max_sequence_len if self.contract is not None else None

    def weights_for_engine(self, state: dict) -> dict:
        """A version as the engine loads it: a LoRA adapter checked against this worker's base (`LoraError`
        naming both when it is another's), then merged into the base unless kept unmerged."""
        if isinstance(state, AdapterWeights):
            lora.check_base(state.adapter, self._lora_digest)
            if self._merger is not None:
                return self._merger.merge(state, state.adapter)
        return state

    def hold_version(self, version: int) -> None:
        """The engine samples with ``version`` now: held, and told to the learner (its heartbeats)."""
        self.version = version
        self.client.set_version_held(version)

    def count_busy(self, seconds: float) -> None:
        self.busy_s += seconds
        self.client.busy_s = self.busy_s

    def count_idle(self, seconds: float) -> None:
        self.idle_s += seconds
        self.client.idle_s = self.idle_s

    def hand_off(self, sampled: SampledGroups) -> None:
        """Score ``sampled`` and send it on the scoring thread, while the next groups are sampled (`Pipeline`);
        a group the learner will never see (no completion left, or dropped whole by the trajectory delay link)
        has its admission permit returned."""
        task, worker_id, session = self._task, self.options.worker_id, self.session
        floor = self.contract.min_logprob if self.contract is not None else MIN_LOGPROB

        def score_and_send() -> None:
            stamped = stamp_groups(task, worker_id, sampled.first_index, sampled.version, sampled.problems,
                                   sampled.prompts, sampled.groups, sampled.start_wall, sampled.end_wall, floor,
                                   session=session)
            outcomes = dict(outcome_counts(task))  # the programs its reward ran, by outcome
            if outcomes != self.client.reward_outcomes:
                self.client.reward_outcomes = outcomes  # told to the learner in the next heartbeat
            never = sum(not group or self._send(list(group)) == 0 for group in stamped)
            if never:  # groups the learner will never see: their admission permits are free again
                self.client.return_starts(never)
        self._scoring.submit(score_and_send)

    def _follow_thread_advice(self, cfg: Config) -> None:
        """Use the torch threads the learner advises a worker on its own machine (`heterorl train`,
        ``runtime.thread_split: adaptive``: heterorl.runtime.cores), between generations."""
        advised = self.client.advised_threads
        if advised and cfg.runtime.thread_split == "adaptive" and advised != torch.get_num_threads():
            log.info("worker %s: %d torch threads, as the learner advises", self.options.worker_id, advised)
            torch.set_num_threads(advised)

    def _wait(self, fn, *args):
        """``fn(*args)``, a wait of the loop's turn (counted with the turn: `RolloutStrategy.count_turn`)."""
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._turn_waited_s += time.monotonic() - start

    def _idle(self, fn, *args):
        """``fn(*args)``, counted as idle time at once (outside the loop's turns, or on the scoring thread)."""
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.count_idle(time.monotonic() - start)

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self._configure()
        worker_id = self.options.worker_id
        task = make_task_from(cfg.task)
        if cfg.runtime.vllm_streaming:
            check_streaming(cfg, self.options.engine, task)
        self.sampler = self._load_sampler(cfg, task)
        got = self._idle(self.client.wait_weights, -1, cfg.runtime.learner_timeout_s)
        if got is None:
            raise HeteroRLError(f"no weights from the learner within {cfg.runtime.learner_timeout_s} s")
        version, state = got
        self.sampler.load_weights(version, self.weights_for_engine(state))
        self.hold_version(version)
        log.info("worker %s (session %s): version %d, task %s, mode %s, %.1f s after the worker started", worker_id,
                 self.session, self.version, task.name, cfg.runtime.mode, time.monotonic() - self._born)
        if cfg.runtime.inflight_updates and not (self.sampler.engine.supports_inflight_updates or
                                                 cfg.runtime.vllm_streaming):
            log.warning("worker %s: runtime.inflight_updates is on, but the %s engine takes new weights only "
                        "between generations (and between the turns of episodes); this worker does so", worker_id,
                        self.options.engine)
        return self.run_rollouts(cfg, task)

    def run_rollouts(self, cfg: Config, task) -> int:
        """The loop, once the sampler holds its first weights: until the learner ends the run (0) or stays silent
        ``learner_timeout_s`` (1). Each turn: weights (`RolloutStrategy.take_weights`), ended groups handed off,
        then as many new groups as the admission permits, the strategy's room and, in sync mode, the share left
        of the version being sampled allow (a share is sampled in as many turns as its permits take)."""
        worker_id = self.options.worker_id
        self.strategy = strategy = self._strategy(cfg, task)
        self._task, self._scoring.max_pending = task, strategy.scoring_depth
        rng = shard_rng(cfg.seed, worker_id)
        sync = cfg.runtime.mode == "sync"
        share = cfg.rl.prompts_per_step // cfg.runtime.workers
        last_heard = time.monotonic()
        used_version, owed = -1, 0  # sync: the version of the share being sampled, and its groups still to start
        while not self.client.finished.is_set():
            turn_start, in_flight_at_start, self._turn_waited_s = time.monotonic(), strategy.groups_in_flight(), 0.0
            try:
                strategy.take_weights()
                strategy.harvest()
                self._follow_thread_advice(cfg)
                if not self.client.learner_alive:
                    if time.monotonic() - last_heard > cfg.runtime.learner_timeout_s:
                        log.error("worker %s: learner silent for %.0f s; exiting", worker_id,
                                  cfg.runtime.learner_timeout_s)
                        return 1
                    self._wait(time.sleep, 0.1)
                    continue
                last_heard = time.monotonic()
                if sync and owed == 0:  # the next share is sampled by the next version, once this one's have ended
                    if strategy.groups_in_flight():
                        strategy.wait_for_groups()
                        continue
                    if self.version <= used_version:
                        got = self._wait(self.client.wait_weights, used_version, 1.0)
                        if got is not None:
                            strategy.load(got)
                        continue
                    used_version, owed = self.version, share
                room = strategy.room()
                if room <= 0:
                    strategy.wait_for_groups()
                    continue
                n = self._wait(self.client.acquire_starts, min(room, owed if sync else cfg.runtime.groups_per_call),
                               strategy.permit_wait_s)
                if n == 0:
                    self._scoring.check()
                    continue
                owed -= n if sync else 0
                problems = [task.sample_train(rng) for _ in range(n)]
                first, self.groups_sent = self.groups_sent, self.groups_sent + n
                strategy.start(problems, first)
            finally:
                strategy.count_turn(TurnTime(time.monotonic() - turn_start, self._turn_waited_s,
                                             bool(in_flight_at_start)))
        strategy.finish()
        self._scoring.drain()
        if self.client.refused:
            raise HeteroRLError(f"the learner refused worker {worker_id}: {self.client.refused}")
        log.info("worker %s: the learner ended the run after %s", worker_id, self.tally())
        return 0

    def _strategy(self, cfg: Config, task) -> RolloutStrategy:
        """How this worker samples its groups: streamed (``runtime.vllm_streaming``) or in batches."""
        if cfg.runtime.vllm_streaming:
            if self.options.throttle > 1:
                log.warning("worker %s: --throttle is ignored by a streaming vLLM worker (it has no calls to slow "
                            "down)", self.options.worker_id)
            return StreamingRollouts(self, cfg, task)
        return BatchRollouts(self, cfg, task, throttle=self.options.throttle)

    def tally(self) -> str:
        """What this worker did: groups sent, the version it holds, the versions it received and how."""
        stats = self.client.stats
        incidents = self.strategy.tally() if self.strategy is not None else None
        told = f"; {self.strategy.name}: {incidents}" if incidents is not None else ""
        return (f"{self.groups_sent} groups (holding version {self.version}; weights: "
                f"{stats['weights/full_received']} versions whole, {stats['weights/deltas_applied']} as deltas, "
                f"{stats['weights/resyncs']} resyncs, {stats['weights/checksum_failures']} checksum failures"
                f"{told})")

    def _load_sampler(self, cfg: Config, task) -> SamplingClient:
        """The policy (checked against the learner's model and, in a LoRA run, its base), cast to the sampling
        dtype, under the chosen engine."""
        base = self.options.policy or cfg.rl.base or cfg.policy.model
        folder = policy_folder(base) if self.options.engine == "vllm" and not cfg.lora.enabled else None
        if folder is not None:  # vLLM loads the weights itself: only the tokenizer and the vocabulary are checked
            tokenizer = load_hf_tokenizer(folder)
            self._check_vocab(declared_vocab_size(folder), base)
            return self._make_sampler(cfg, base, None, tokenizer)
        # a vLLM worker only checks the policy (and saves a fresh tiny one for vLLM): its copy stays on the CPU
        device = cfg.policy.device if self.options.engine == "torch" else "cpu"
        model, tokenizer = load_policy(base, alphabet=task.alphabet(), tiny=cfg.policy.tiny, device=device)
        self._check_policy(model, base)
        dtype = wire_dtype_for(cfg.runtime.weights_dtype, model)
        digest = self._lora_digest = self._check_lora_base(cfg, model, base)
        if digest is not None and cfg.lora.apply == "merged":
            self._merger = lora.Merger(model.state_dict(), digest, dtype)  # (the float32 base, before the cast)
        # it samples with what the learner sends: the cast of its master weights (runtime.weights_dtype)
        model = model.to(dtype)
        model.eval()
        sampler = self._make_sampler(cfg, base, model, tokenizer)  # (the torch engine: over this model)
        if digest is not None and self._merger is None and self.options.engine == "torch":
            self._keep_adapters_unmerged(cfg, sampler)  # (vLLM loads them as LoRA adapters: `_make_sampler`)
        return sampler

    def _make_sampler(self, cfg: Config, base: str, model, tokenizer) -> SamplingClient:
        """The sampler over the chosen engine. vLLM loads the policy's Hugging Face folder itself (a fresh
        tiny policy is saved to a temporary one first); its weights are replaced by the learner's at once."""
        if self.options.engine == "torch":
            return SamplingClient.for_model(model, tokenizer, device=cfg.policy.device)
        from heterorl.engines.vllm_engine import VLLMEngine
        from heterorl.engines.vllm_stream import StreamingVLLMEngine

        folder = policy_folder(base)
        if folder is None:  # a fresh tiny policy: vLLM needs it as a folder
            self._scratch = tempfile.TemporaryDirectory(prefix="heterorl-vllm-")
            folder = Path(self._scratch.name)
            model.save_pretrained(folder)
        settings = dict(eos_token_id=tokenizer.eos_token_id, seed=cfg.seed, dtype=cfg.runtime.vllm_dtype,
                        kv_cache_gib=cfg.runtime.vllm_kv_cache_gib,
                        gpu_memory_utilization=cfg.runtime.vllm_gpu_memory_utilization,
                        max_model_len=cfg.runtime.vllm_max_model_len,
                        lora_rank=cfg.lora.rank if cfg.lora.enabled and cfg.lora.apply == "unmerged" else None)
        started = time.monotonic()
        if cfg.runtime.vllm_streaming:
            engine = StreamingVLLMEngine(folder, inflight_kv=cfg.runtime.vllm_inflight_kv,
                                         max_versions_per_sample=cfg.runtime.max_versions_per_sample, **settings)
        else:
            engine = VLLMEngine(folder, **settings)
        log.info("worker %s: vLLM engine on %s (%s%s), started in %.1f s", self.options.worker_id, folder,
                 cfg.runtime.vllm_dtype, ", streaming" if cfg.runtime.vllm_streaming else "",
                 time.monotonic() - started)
        return SamplingClient(engine, tokenizer, version=-1)

    def _check_policy(self, model, base: str) -> None:
        self._check_vocab(model.get_input_embeddings().num_embeddings, base)

    def _check_vocab(self, vocab: int, base: str) -> None:
        """Refuse to start with a policy whose token ids the learner's model cannot take (a wrong tokenizer)."""
        if self.contract is not None and vocab > self.contract.vocab_size:
            raise HeteroRLError(f"policy {base!r} has {vocab} token ids but the learner's model takes "
                                f"{self.contract.vocab_size}: its trajectories would be rejected; start the worker "
                                "with the learner's policy (or a --policy with the same tokenizer)")

    def _send(self, group: list[Trajectory]) -> int:
        """Queue a group's trajectories in one call, waiting out back-pressure; how many were queued: 0 when the
        trajectory delay link dropped them all (what a timeout got through counts as queued). HeteroRLError once
        the learner has been silent for ``learner_timeout_s``."""
        silent_since, queued = None, 0
        while group and not self.client.finished.is_set() and not self._closing.is_set():
            try:
                return queued + self._idle(self.client.send_many, group, 1.0)
            except TransportTimeout as exc:  # back-pressure (the learner is behind) or the learner is gone
                group, queued = group[exc.done:], queued + exc.done
                if self.client.learner_alive:
                    silent_since = None
                    continue
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since > self.learner_timeout_s:
                    raise HeteroRLError(f"the learner has been silent for {self.learner_timeout_s:.0f} s") from None
        return queued

    def close(self, failure: Exception | None = None) -> None:
        """Leave: the bye tells the learner when this worker failed (`BYE_WORKER_FAILED`), so it stops waiting."""
        self._closing.set()  # (a batch still being scored is not sent)
        self._scoring.close()
        if self.openai_server is not None:  # before the sampler closes under its requests
            self.openai_server.stop()
        self.client.close("done" if failure is None else f"{BYE_WORKER_FAILED}{str(failure)[:900]}")
        if self.sampler is not None:
            self.sampler.close()
        if self._scratch is not None:
            self._scratch.cleanup()


def run_rollout_worker(options: WorkerOptions) -> int:
    """Run a worker until the learner ends the run (0). SIGTERM or SIGINT stop it (0): its bye says done and its
    log says what it did."""
    worker = RolloutWorker(options)
    failure: Exception | None = None
    try:
        with signal_handlers(_interrupt, (signal.SIGTERM,)):  # as SIGINT does
            return worker.run()
    except KeyboardInterrupt:  # an interrupt is not a failure: that worker may well come back
        log.info("worker %s: stopped by a signal after %s", options.worker_id, worker.tally())
        return 0
    except Exception as exc:
        failure = exc
        raise
    finally:
        worker.close(failure)


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt("SIGTERM")
