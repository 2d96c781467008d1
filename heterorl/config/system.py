"""The config sections of the distributed system: the learner's buffer, the transport, the network delays, the
runtime (learner + rollout workers) and the simulated execution."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np

from heterorl.config.checks import fail, one_of, optional_positive, positive
from heterorl.config.scope import learner_only
from heterorl.errors import DelayConfigError

ENGINES = ("torch", "vllm")  # sampling engines a rollout worker can run (runtime.engines, --engine)


BUFFER_POLICIES = ("window", "drop_stale", "count_only", "admission")


@dataclass
class BufferConfig:
    """The learner's staleness-aware buffer (heterorl/runtime/buffer.py has the policies' rules)."""

    policy: str = "admission"  # admission | window | drop_stale | count_only
    max_staleness_steps: int = 8
    # admission: how many steps of groups ahead of the learner the fleet may start; None (the default) paces
    # adaptively, from 1 step up to max_staleness_steps while the learner waits on a fleet out of permits
    pace_steps: Optional[int] = None
    select: str = "newest"  # window only: newest | oldest groups first
    max_groups: int = 256  # complete groups the learner holds; when full it stops pulling (back-pressure)
    # deprecated: read as `transport.group_timeout_s` (a value set here only is copied there, with a warning); kept
    # equal to it, so that workers of the previous release read the config a learner sends them
    partial_group_timeout_s: float = 600.0

    def validate(self, key: str = "buffer") -> None:
        one_of(f"{key}.policy", self.policy, BUFFER_POLICIES)
        one_of(f"{key}.select", self.select, ("newest", "oldest"))
        if self.max_staleness_steps < 0:
            fail(f"{key}.max_staleness_steps", self.max_staleness_steps, "must be >= 0")
        if self.pace_steps is not None and not 0 <= self.pace_steps <= self.max_staleness_steps:
            fail(f"{key}.pace_steps", self.pace_steps, f"must be in [0, `{key}.max_staleness_steps`] (now "
                  f"{self.max_staleness_steps}), or null to pace adaptively")
        if self.max_groups < 1:
            fail(f"{key}.max_groups", self.max_groups, "must be >= 1")


@dataclass
class TransportConfig:
    """Knobs shared by both ends of the transport. Times in seconds."""

    control_hwm: int = 1000  # messages queued per peer on the control channel
    weights_hwm: int = 64  # chunk messages queued per peer on the weights channel
    credits_per_worker: int = 256  # trajectories buffered + in flight per worker
    trajectory_batch: int = 32  # trajectories a worker packs into one message at most
    trajectory_linger_ms: float = 2.0  # a due trajectory waits at most this long for a batch to fill
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    hello_interval_s: float = 0.5
    weights_chunk_bytes: int = 4 * 2**20
    weights_pipeline: int = 8  # chunk requests in flight per fetch
    fetch_timeout_s: float = 30.0  # restart a weights fetch after this long without a chunk
    # the learner's weights serving (docs/RELIABILITY.md, "Weights serving"): bytes of chunk replies not yet handed
    # to the network, per worker and in all (a chunk request beyond either is answered with its header, and the
    # worker asks again shortly); 0 per worker: twice a fetch's pipeline (weights_chunk_bytes x weights_pipeline x 2)
    weights_bytes_in_flight_per_worker: int = learner_only(0)
    weights_bytes_in_flight: int = learner_only(2 * 2**30)
    # distinct slice layouts a sharded learner packs each publish; a hello beyond is refused
    max_layouts: int = learner_only(8)
    max_retained_versions: int = 64  # packed versions kept for workers whose release is still delayed
    # send a version as deltas from the one a worker holds (heterorl.transport.weights.deltas): exact, checked, and a
    # full snapshot whenever the chain is missing, longer than a snapshot, or doubted. Off: every version whole
    weights_deltas: bool = True
    dedup_window: int = 1_000_000  # trajectory ids remembered for duplicate detection
    max_workers: int = 1024  # registry size; when full, the entry of the worker silent longest makes room
    max_ids_per_key: int = learner_only(8)  # worker ids one CURVE key may hold in the registry (docs/RELIABILITY.md)
    worker_expiry_s: float = 600.0  # a worker silent this long leaves the registry (it may say hello again)
    # per worker (docs/RELIABILITY.md, "Bounds per worker"): incomplete groups it may have at the learner, and
    # their bytes; a member beyond either is refused with its group
    open_groups_per_worker: int = 32
    open_group_bytes_per_worker: int = 256 * 2**20
    # a group still incomplete this long after its first member arrived is dropped (workers receive it as
    # `buffer.partial_group_timeout_s`, the deprecated key that mirrors it and that the previous release reads)
    group_timeout_s: float = learner_only(600.0)
    # ... or sooner: 4 x the slowest of its worker's recent groups took to arrive whole, at least this (seconds)
    group_deadline_min_s: float = learner_only(5.0)
    # admission permits are leases (docs/RELIABILITY.md, "Permits"): a worker that owes a group for 4 x its
    # measured seconds per group (within these bounds) stops holding its share; a probation permit lasts
    # permit_lease_s; at most probation_permits are out at once
    permit_lease_s: float = learner_only(60.0)
    permit_lease_min_s: float = learner_only(5.0)
    probation_permits: int = learner_only(2)
    # a connection with more refused messages than this within a second is throttled (its messages discarded
    # unread) for throttle_s, doubling each time; its worker is disconnected (and refused for the back-off) at
    # the throttles_before_disconnect-th throttle in a row (docs/RELIABILITY.md, "Work a peer makes")
    max_refusals_per_s: int = learner_only(1000)
    throttle_s: float = learner_only(1.0)
    throttles_before_disconnect: int = learner_only(3)
    # one budget per peer (its CURVE key, else its worker id; connections before their hello share one), what it
    # may have the learner's I/O thread hold and do (docs/RELIABILITY.md, "Budgets per peer"): bytes of its
    # messages received and not yet handled (0: what its credit lets an honest worker have in flight,
    # credits_per_worker trajectories of the contract's longest, and 1 MiB); the same for all peers together; the
    # I/O thread's CPU seconds a second its messages may take, in a bucket of peer_work_burst_s
    peer_inbound_bytes: int = learner_only(0)
    inbound_bytes: int = learner_only(2**30)
    peer_work_s_per_s: float = learner_only(0.1)
    peer_work_burst_s: float = learner_only(1.0)
    # the I/O thread's CPU seconds a second for reading messages it then discards or drops (those of throttled
    # connections, those past a peer's budget), all peers together, in a bucket of discard_read_burst_s; when it is
    # spent the control socket is not read until it refills (docs/RELIABILITY.md, "Budgets per peer")
    discard_read_s_per_s: float = learner_only(0.05)
    discard_read_burst_s: float = learner_only(0.001)
    max_trajectories_per_s: float = 0.0  # per worker, enforced through its credit; 0: no limit
    keys_reload_s: float = 2.0  # how often the learner re-reads its allowed-keys folder (revocation)
    linger_ms: int = 1000
    # at the end of the run the learner keeps its end open until every live worker has answered its bye, at most
    # this long: a bye still in TCP's retransmissions on a lossy link is not cut off by the close (0: no wait)
    end_of_run_wait_s: float = learner_only(10.0)
    allow_plaintext: bool = False  # plaintext on a non-loopback address

    def validate(self, key: str = "transport") -> None:
        positive(self, key, "control_hwm", "weights_hwm", "credits_per_worker", "trajectory_batch",
                  "weights_chunk_bytes", "weights_pipeline", "max_retained_versions", "dedup_window", "max_workers",
                  "max_ids_per_key", "weights_bytes_in_flight", "max_layouts",
                  "heartbeat_interval_s", "open_groups_per_worker", "open_group_bytes_per_worker", "group_timeout_s",
                  "keys_reload_s", "group_deadline_min_s", "permit_lease_s", "permit_lease_min_s", "probation_permits",
                  "max_refusals_per_s", "throttle_s", "throttles_before_disconnect", "inbound_bytes",
                  "peer_work_s_per_s", "peer_work_burst_s", "discard_read_s_per_s", "discard_read_burst_s")
        if not 0 <= self.peer_inbound_bytes <= self.inbound_bytes:
            fail(f"{key}.peer_inbound_bytes", self.peer_inbound_bytes,
                  f"must be 0 (what a worker's credit allows) or at most `{key}.inbound_bytes` ({self.inbound_bytes})")
        if self.permit_lease_min_s > self.permit_lease_s:
            fail(f"{key}.permit_lease_min_s", self.permit_lease_min_s,
                  f"must be at most `{key}.permit_lease_s` ({self.permit_lease_s})")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            fail(f"{key}.heartbeat_timeout_s", self.heartbeat_timeout_s,
                  f"must exceed `{key}.heartbeat_interval_s` ({self.heartbeat_interval_s})")
        if self.worker_expiry_s < self.heartbeat_timeout_s:
            fail(f"{key}.worker_expiry_s", self.worker_expiry_s,
                  f"must be at least `{key}.heartbeat_timeout_s` ({self.heartbeat_timeout_s}): only a worker "
                  "taken for dead can expire")
        if not self.end_of_run_wait_s >= 0:
            fail(f"{key}.end_of_run_wait_s", self.end_of_run_wait_s, "must be >= 0 (0: no wait)")
        if not self.max_trajectories_per_s >= 0:
            fail(f"{key}.max_trajectories_per_s", self.max_trajectories_per_s, "must be >= 0 (0: no limit)")
        pipeline_bytes = self.weights_chunk_bytes * self.weights_pipeline
        if self.weights_bytes_in_flight_per_worker and self.weights_bytes_in_flight_per_worker < pipeline_bytes:
            fail(f"{key}.weights_bytes_in_flight_per_worker", self.weights_bytes_in_flight_per_worker,
                  f"must be 0 (twice a fetch's pipeline) or at least `{key}.weights_chunk_bytes` x "
                  f"`{key}.weights_pipeline` ({pipeline_bytes}), or an honest fetch would wait on itself")


DELAY_KINDS = ("none", "constant", "uniform", "exponential", "lognormal", "weibull", "trace")


@dataclass
class LinkDelayConfig:
    """One delay model, applied to each link separately (each link draws from its own seeded stream)."""

    kind: str = "none"  # none | constant | uniform | exponential | lognormal | weibull | trace
    constant_s: float = 0.0  # constant: every message waits this long
    low_s: float = 0.0  # uniform: delay ~ U[low_s, high_s]
    high_s: float = 0.0
    mean_s: float = 0.0  # exponential: delay ~ Exp(mean mean_s)
    # lognormal | weibull (the paper): P(L_s <= T <= U_s) = c, equal tails; delay = clamp(T - d0_s, L_s, U_s).
    # Defaults are the paper's Qwen3-1.7B setting.
    L_s: float = 60.0
    U_s: float = 1920.0
    c: float = 0.995
    d0_s: float = 400.0
    trace_path: Optional[str] = None  # trace: delays in seconds, one per line (# comments), replayed in order, cycling
    seed: int = 0  # base seed; each link derives its own from (seed, link name), see link_seed
    reorder: bool = False  # False: never deliver a message before one sent earlier on the same link
    loss_prob: float = 0.0  # probability that a message is dropped
    bandwidth_bytes_per_s: Optional[float] = None  # None: unlimited; else size/bandwidth per message, queued FIFO

    @property
    def active(self) -> bool:
        """Whether the link does anything: a delay, a loss or a bandwidth limit (kind none with a bandwidth limit
        is a link of no latency that still queues messages behind one another)."""
        return self.kind != "none" or self.loss_prob > 0 or self.bandwidth_bytes_per_s is not None

    def describe(self) -> str:
        """This link's model in a few words: ``uniform 0.1-1 s``, ``none``, ``lognormal 60-1920 s, 1 % lost``."""
        model = {"none": "none", "constant": f"constant {self.constant_s:g} s",
                 "uniform": f"uniform {self.low_s:g}-{self.high_s:g} s",
                 "exponential": f"exponential, mean {self.mean_s:g} s",
                 "lognormal": f"lognormal {self.L_s:g}-{self.U_s:g} s",
                 "weibull": f"weibull {self.L_s:g}-{self.U_s:g} s",
                 "trace": f"trace {self.trace_path}"}.get(self.kind, self.kind)
        if self.loss_prob:
            model += f", {100 * self.loss_prob:g} % lost"
        if self.bandwidth_bytes_per_s is not None:
            model += f", {self.bandwidth_bytes_per_s / 1e6:g} MB/s"
        return model

    def validate(self, key: str = "delay") -> None:
        """Raise DelayConfigError naming the first bad field (as ``{key}.field``) and the fix; reads the trace file."""
        _check_delay_fields(self, key)
        if self.kind == "trace":
            load_trace(self.trace_path, key)


def _check_delay_fields(cfg: LinkDelayConfig, key: str) -> None:
    def fail(name: str, requirement: str) -> None:
        raise DelayConfigError(f"config key `{key}.{name}` = {getattr(cfg, name)!r}: {requirement}")

    def number(name: str) -> float:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            fail(name, "must be a finite number")
        return value

    if cfg.kind not in DELAY_KINDS:
        fail("kind", f"must be one of {', '.join(DELAY_KINDS)}")
    if cfg.kind == "constant" and number("constant_s") < 0:
        fail("constant_s", "must be >= 0 seconds (a delay cannot be negative)")
    if cfg.kind == "uniform":
        if number("low_s") < 0:
            fail("low_s", "must be >= 0 seconds (a delay cannot be negative)")
        if number("high_s") < cfg.low_s:
            fail("high_s", f"must be >= `{key}.low_s` ({cfg.low_s!r}): swap them")
    if cfg.kind == "exponential" and number("mean_s") <= 0:
        fail("mean_s", "must be > 0 seconds for kind=exponential (use kind=none for no delay)")
    if cfg.kind in ("lognormal", "weibull"):
        if number("L_s") <= 0:
            fail("L_s", "must be > 0 seconds: it is the lower end of the latency's central interval [L_s, U_s]")
        if number("U_s") <= cfg.L_s:
            fail("U_s", f"must be > `{key}.L_s` ({cfg.L_s!r}): [L_s, U_s] is the central interval of the latency")
        if not 0 < number("c") < 1:
            fail("c", "must be in (0, 1): the probability that the latency lies in [L_s, U_s], e.g. 0.995")
        if number("d0_s") < 0:
            fail("d0_s", "must be >= 0 seconds: the offset subtracted from the latency before clamping")
    if cfg.kind == "trace" and not (isinstance(cfg.trace_path, str) and cfg.trace_path):
        fail("trace_path", "is required for kind=trace: a file of latencies in seconds, one per line")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        fail("seed", "must be an integer")
    if not isinstance(cfg.reorder, bool):
        fail("reorder", "must be true or false")
    if not 0 <= number("loss_prob") <= 1:
        fail("loss_prob", "must be a probability in [0, 1] (0 = no loss)")
    if cfg.bandwidth_bytes_per_s is not None and not number("bandwidth_bytes_per_s") > 0:
        fail("bandwidth_bytes_per_s", "must be > 0 bytes per second, or null for unlimited")


def load_trace(path: str | Path | None, key: str = "delay") -> np.ndarray:
    """Delays in seconds from a text file: one number per line; ``#`` starts a comment; blank lines are skipped."""
    where = f"trace file {path} (config key `{key}.trace_path`)"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DelayConfigError(f"{where} does not exist: record one latency in seconds per line") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DelayConfigError(f"{where} cannot be read as UTF-8 text: {exc}") from None
    values = []
    for number, line in enumerate(text.splitlines(), start=1):
        field = line.split("#", 1)[0].strip()
        if not field:
            continue
        try:
            value = float(field)
        except ValueError:
            raise DelayConfigError(f"{where}, line {number}: {field!r} is not a number of seconds") from None
        if not (math.isfinite(value) and value >= 0):
            raise DelayConfigError(f"{where}, line {number}: {field!r} is not a finite latency >= 0 seconds")
        values.append(value)
    if not values:
        raise DelayConfigError(f"{where} holds no latencies: write one number of seconds per line")
    return np.asarray(values, dtype=np.float64)


@dataclass
class DelayConfig:
    """The network-delay injector, per worker link (docs/DELAY.md)."""

    up: LinkDelayConfig = field(default_factory=LinkDelayConfig)  # trajectories, worker → learner
    down: LinkDelayConfig = field(default_factory=LinkDelayConfig)  # weights, learner → worker
    time_scale: float = 1.0  # simulated seconds per real second: 100 lets 1,800 s of delay pass in 18 s
    seconds_per_step: Optional[float] = None  # stated mapping of seconds to learner steps, for reports
    # a fixed staleness instead of delays (simulated execution): every batch is sampled by the policy exactly this
    # many versions older than the learner's, from the first step on (versions before 0 are copies of the base)
    fixed_lag_steps: Optional[int] = None

    def describe(self) -> str:
        """The injected delay in a few words, for a run's first lines."""
        if self.fixed_lag_steps is not None:
            return f"a fixed lag of {self.fixed_lag_steps} versions"
        if not (self.up.active or self.down.active):
            return "none"
        scale = f" (time x{self.time_scale:g})" if self.time_scale != 1.0 else ""
        return f"up {self.up.describe()}, down {self.down.describe()}{scale}"

    def validate(self, key: str = "delay") -> None:
        positive(self, key, "time_scale")
        optional_positive(self, key, "seconds_per_step")
        self.up.validate(f"{key}.up")
        self.down.validate(f"{key}.down")
        if self.fixed_lag_steps is not None:
            if self.fixed_lag_steps < 0:
                fail(f"{key}.fixed_lag_steps", self.fixed_lag_steps, "must be >= 0 (0: on-policy), or null")
            if self.up.active or self.down.active:
                fail(f"{key}.fixed_lag_steps", self.fixed_lag_steps,
                      f"sets the staleness itself: leave `{key}.up` and `{key}.down` at kind none, with no loss and "
                      "no bandwidth limit")


@dataclass
class RuntimeConfig:
    """The learner + rollout workers system (`heterorl train`, `heterorl learner`, `heterorl rollout`)."""

    mode: str = "async"  # async: workers never wait for new weights | sync: each batch uses the newest version
    # live: real processes over ZeroMQ | simulated: one process on a virtual clock (heterorl/simulate.py)
    execution: str = "live"
    workers: int = 2  # rollout worker processes `heterorl train` starts
    address: str = "tcp://127.0.0.1:0"  # learner control address (weights on port + 1); port 0 = pick free ports
    groups_per_call: int = 4  # groups a worker samples per engine call
    # admission: a worker may hold this many calls' worth of unused permits; 2 lets the permits of its next call
    # arrive while it samples this one, which on links whose round trip is near a call's time keeps it sampling
    permit_calls: int = 1
    # admission: a worker whose weights are more than this many versions older than the newest released to it gets
    # no new permits until it has caught up, so a link too slow for the learner's pace slows the learner rather than
    # letting the staleness grow without bound (None: no limit; a weights delay's versions are not counted until due)
    max_weights_lag: Optional[int] = None
    throttle: List[float] = field(default_factory=list)  # slowdown factor of worker i = throttle[i % len]; 1 = full
    threads: int = 1  # torch threads per learner / worker / simulated process (`sft` and `rl` use torch's default)
    learner_threads: Optional[int] = None  # the learner's torch threads (None: runtime.threads)
    worker_threads: Optional[int] = None  # each worker's torch threads (None: runtime.threads)
    # async `heterorl train`, one machine: adaptive gives the spare cores to the slower of training and sampling,
    # measured over the first steps (heterorl/runtime/cores.py) | fixed: the threads above throughout
    thread_split: str = "adaptive"
    learner_ranks: int = 1  # > 1: `heterorl train` runs the learner under torchrun as this many DDP ranks
    # how several learner ranks hold the model: ddp (each the whole model, gradients all-reduced) | fsdp (FSDP2:
    # each rank 1/world of the parameters, gradients and optimizer state; checkpoints sharded, DCP)
    learner_sharding: str = "ddp"
    # how a sharded learner's weights reach the workers: reshard (every rank sends its own slices, in parallel;
    # heterorl.transport.weights.shards) | gather (all ranks gather the whole model onto rank 0, which sends it)
    weights_fanout: str = "reshard"
    checkpoint_every: int = 25  # learner steps between checkpoints (0: only at the end)
    # async: a worker takes a newer version between decode steps of a generation in progress (torch engine;
    # each token stamped with its version). Off: new weights are applied between generations
    inflight_updates: bool = False
    # what workers receive and sample with: the learner keeps float32 master weights and publishes their cast.
    # auto: bfloat16 for models of 10M parameters or more, float32 below | bfloat16 | float16 | float32
    weights_dtype: str = "auto"
    worker_timeout_s: float = 300.0  # learner fails if no data arrives and no worker is alive for this long
    # `heterorl train` starts a worker that exits abnormally again, after a back-off, at most this many times per
    # worker in an hour; then gives it up (0: a failed worker leaves the fleet at once)
    worker_restarts: int = learner_only(3)
    # before its first step the learner waits up to this long for `workers` workers to hold its weights, so
    # a run does not start on whichever worker loaded its model first (0: start on the first data)
    fleet_wait_s: float = 120.0
    learner_timeout_s: float = 300.0  # a worker exits if the learner stays silent this long
    # the sampling engine of worker i = engines[i % len] (`heterorl train`): torch | vllm. A vLLM worker runs
    # under vllm_python (its own venv: `make vllm`), with vllm_dtype and a KV cache of vllm_kv_cache_gib
    engines: List[str] = field(default_factory=lambda: ["torch"])
    vllm_python: str = ".venv-vllm/bin/python"
    vllm_dtype: str = "float32"
    vllm_kv_cache_gib: float = 1.0  # on CPU; on a GPU vLLM takes vllm_gpu_memory_utilization of its device
    vllm_gpu_memory_utilization: float = 0.85
    vllm_max_model_len: Optional[int] = None  # prompt + completion vLLM makes room for (None: the model's context)
    # a vLLM worker keeps its engine full: a group is submitted whenever a permit allows and there is room (at most
    # stream_max_groups in flight; None: 2 x groups_per_call), and sent as soon as its last sample ends, with no
    # batch barrier (heterorl/runtime/rollout_strategies.py; single-turn tasks). With inflight_updates (async) new
    # weights load while groups run, each token stamped with its version; vllm_inflight_kv: recompute (the requests in
    # flight are prefilled again with the new weights: exact log-probs) | keep (their old keys and values stay:
    # faster, log-probs after an update belong to neither version). max_versions_per_sample: a group whose samples
    # would span more versions is started again from its prompt on the new weights (0: no bound)
    vllm_streaming: bool = False
    stream_max_groups: Optional[int] = None
    vllm_inflight_kv: str = "recompute"
    max_versions_per_sample: int = 0
    # the GPUs each process sees (CUDA_VISIBLE_DEVICES), e.g. learner_devices: "0", worker_devices: ["1", "2,3"]:
    # worker i gets worker_devices[i % len]; empty = every process sees what `heterorl train` sees
    learner_devices: str = ""
    worker_devices: List[str] = field(default_factory=list)
    # `heterorl train`: a command each worker runs under, before its own (a restarted worker too), with {index}
    # (0, 1, ...), {number} (1, 2, ...) and {name} (worker-0, ...) filled in, e.g. ["taskset", "-c", "{number}"]
    # or ["ip", "netns", "exec", "site-{number}"] (a worker per network namespace); empty: none
    worker_prefix: List[str] = field(default_factory=list)

    def validate(self, key: str = "runtime") -> None:
        one_of(f"{key}.mode", self.mode, ("async", "sync"))
        one_of(f"{key}.execution", self.execution, ("live", "simulated"))
        one_of(f"{key}.thread_split", self.thread_split, ("adaptive", "fixed"))
        one_of(f"{key}.learner_sharding", self.learner_sharding, ("ddp", "fsdp"))
        one_of(f"{key}.weights_fanout", self.weights_fanout, ("reshard", "gather"))
        positive(self, key, "workers", "groups_per_call", "permit_calls", "threads", "learner_ranks",
                  "vllm_kv_cache_gib")
        optional_positive(self, key, "learner_threads", "worker_threads", "max_weights_lag", "stream_max_groups")
        one_of(f"{key}.vllm_inflight_kv", self.vllm_inflight_kv, ("recompute", "keep"))
        if self.max_versions_per_sample < 0:
            fail(f"{key}.max_versions_per_sample", self.max_versions_per_sample,
                  "must be >= 0 (0: no bound; 1: no sample drawn by two versions)")
        if self.worker_restarts < 0:
            fail(f"{key}.worker_restarts", self.worker_restarts, "must be >= 0 (0: a failed worker is not restarted)")
        if any(f < 1 for f in self.throttle):
            fail(f"{key}.throttle", self.throttle, "factors must be >= 1 (2 = a device half as fast)")
        if not self.engines:
            fail(f"{key}.engines", self.engines, f"name at least one engine ({', '.join(ENGINES)})")
        for engine in self.engines:
            one_of(f"{key}.engines", engine, ENGINES)
        one_of(f"{key}.vllm_dtype", self.vllm_dtype, ("float32", "bfloat16", "float16", "auto"))
        one_of(f"{key}.weights_dtype", self.weights_dtype, ("auto", "bfloat16", "float16", "float32"))
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            fail(f"{key}.vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization, "must be in (0, 1]")
        if self.vllm_max_model_len is not None and self.vllm_max_model_len < 1:
            fail(f"{key}.vllm_max_model_len", self.vllm_max_model_len, "must be >= 1 (or null: the model's context)")
        for name, devices in ([("learner_devices", self.learner_devices)] if self.learner_devices else []) + [
                ("worker_devices", d) for d in self.worker_devices]:
            if not isinstance(devices, str) or not re.fullmatch(r"\d+(,\d+)*", devices):
                fail(f"{key}.{name}", devices, 'give CUDA device indices as a string, e.g. "0" or "1,2"')
        for word in self.worker_prefix:
            try:
                worker_command_word(word, 0)
            except (KeyError, IndexError, ValueError, AttributeError) as exc:
                fail(f"{key}.worker_prefix", word, f"only {{index}}, {{number}} and {{name}} are filled in ({exc!r})")


def worker_command_word(word: str, index: int, name: str | None = None) -> str:
    """A word of `RuntimeConfig.worker_prefix` for worker ``index``, named ``name`` (else ``worker-{index}``)."""
    if not isinstance(word, str):
        raise ValueError("each word of the prefix is a string")
    return word.format(index=index, number=index + 1, name=name or f"worker-{index}")


@dataclass
class SimulateConfig:
    """Virtual durations of the simulated execution (``runtime.execution=simulated``; docs/EXPERIMENTS.md)."""

    step_s: Optional[float] = None  # virtual seconds per learner step; None: delay.seconds_per_step, else 1.0
    # virtual seconds of one worker engine call (runtime.groups_per_call groups) at throttle 1; None: the fleet
    # makes exactly one batch per learner step (step_s · workers · groups_per_call / prompts_per_step)
    call_s: Optional[float] = None

    def validate(self, key: str = "simulate") -> None:
        optional_positive(self, key, "step_s", "call_s")
