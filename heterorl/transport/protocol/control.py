"""The control channel's session messages: the handshake (`Hello`, repeated until a `Ready` answers), `Heartbeat`s
both ways, the learner's `Ack`s (cumulative credit, admission permits, refusals) and `Bye` with the reasons a
learner gives (``BYE_*``). Trajectories and weights notices travel on this channel too (`trajectories`,
`weights`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from heterorl.transport.protocol.fields import (
    ID_PATTERN,
    INT32_MAX,
    Limits,
    Message,
    ProtocolError,
    check_float,
    check_id,
    check_int,
    check_settings,
    check_str,
    check_str_list,
)


@dataclass
class Hello(Message):
    """Worker → learner, repeated until a ``Ready`` answers: who I am and which weights I hold (−1: none)."""

    kind: ClassVar[str] = "hello"
    worker_id: str
    host: str
    pid: int
    version_held: int = -1
    sent_at: float = 0.0
    engine: str = "torch"  # the worker's sampling engine, for the learner's per-engine metrics (absent: torch)
    # the slices of each tensor this worker wants from a sharded learner (`reshard.DestLayout.to_dict`: a
    # tensor-parallel engine's rank); {} or absent: every tensor whole
    layout: dict[str, dict] = field(default_factory=dict)
    optional_fields: ClassVar[frozenset] = frozenset({"engine", "layout"})  # workers of earlier versions: none

    @classmethod
    def from_wire(cls, body, limits, data=()):
        return cls(
            worker_id=check_id("worker_id", body["worker_id"], limits),
            host=check_str("host", body["host"], 255),
            pid=check_int("pid", body["pid"], 0, INT32_MAX),
            version_held=check_int("version_held", body["version_held"], -1, INT32_MAX),
            sent_at=check_float("sent_at", body["sent_at"]),
            # optional: workers of earlier versions (all of them torch workers) send no engine
            engine=check_str("engine", body.get("engine", "torch"), 32, ID_PATTERN),
            layout=_layout(body.get("layout", {}), limits),
        )


def _layout(value: Any, limits: Limits) -> dict[str, dict]:
    """A worker's layout, well formed (`reshard.DestLayout.from_dict`); whether it fits the model is the
    learner's to check."""
    from heterorl.transport.weights.reshard import DestLayout, ReshardError

    if not isinstance(value, dict) or len(value) > limits.max_tensors:
        raise ProtocolError("layout", f"expected a map of at most {limits.max_tensors} tensors", "type")
    for name in value:
        check_str("layout key", name, 1024)
    try:
        return DestLayout.from_dict(value).to_dict()
    except ReshardError as exc:
        raise ProtocolError("layout", str(exc), "bounds") from None


@dataclass
class Ready(Message):
    """Learner → worker: accepted. ``credits`` trajectories may be sent before the next grant."""

    kind: ClassVar[str] = "ready"
    worker_id: str
    credits: int
    newest_version: int
    heartbeat_interval_s: float
    settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, body, limits, data=()):
        return cls(
            worker_id=check_id("worker_id", body["worker_id"], limits),
            credits=check_int("credits", body["credits"], 0, INT32_MAX),
            newest_version=check_int("newest_version", body["newest_version"], -1, INT32_MAX),
            heartbeat_interval_s=check_float("heartbeat_interval_s", body["heartbeat_interval_s"], 3600.0),
            settings=check_settings("settings", body["settings"], limits),
        )


_ARRIVALS = ("weights_arrived", "weights_arrival_s", "weights_arrival_max_s")  # Heartbeat's, said once known


@dataclass
class Heartbeat(Message):
    """Either direction, every ``heartbeat_interval_s``: I am alive. From a worker also: the version it holds,
    its cumulative seconds generating (``busy_s``) and waiting for credit or weights (``idle_s``), and the
    admission permits it has used this session (``groups_started``; −1: not reported, as by a worker of an
    earlier version): groups started and still on their way count, which the learner cannot see. And
    ``reward_outcomes``: the programs its task's reward ran this session, by outcome (the code task's sandbox:
    ok, wrong_answer, timeout, forbidden:socket, ...; empty for other tasks). And the weights versions its process
    received whole and verified whose publish time their notice said (``weights_arrived``), the sum and the most
    of the seconds each took from the learner's publish to that (``weights_arrival_s``, ``weights_arrival_max_s``;
    the two hosts' wall clocks, so their offset is in it)."""

    kind: ClassVar[str] = "heartbeat"
    sender_id: str
    version_held: int = -1
    sent_at: float = 0.0
    busy_s: float = 0.0
    idle_s: float = 0.0
    groups_started: int = -1
    reward_outcomes: dict[str, int] = field(default_factory=dict)
    weights_arrived: int = 0
    weights_arrival_s: float = 0.0
    weights_arrival_max_s: float = 0.0
    optional_fields: ClassVar[frozenset] = frozenset({"groups_started", "reward_outcomes", *_ARRIVALS})

    def to_wire(self):
        body = super().to_wire()
        if not self.reward_outcomes:  # (left out when empty: a learner of an earlier version takes the beat)
            del body["reward_outcomes"]
        if not self.weights_arrived:
            for name in _ARRIVALS:
                del body[name]
        return body

    @classmethod
    def from_wire(cls, body, limits, data=()):
        return cls(
            sender_id=check_id("sender_id", body["sender_id"], limits),
            version_held=check_int("version_held", body["version_held"], -1, INT32_MAX),
            sent_at=check_float("sent_at", body["sent_at"]),
            busy_s=check_float("busy_s", body["busy_s"], 1e9),
            idle_s=check_float("idle_s", body["idle_s"], 1e9),
            groups_started=check_int("groups_started", body.get("groups_started", -1), -1, INT32_MAX),
            reward_outcomes=_counts("reward_outcomes", body.get("reward_outcomes", {})),
            weights_arrived=check_int("weights_arrived", body.get("weights_arrived", 0), 0, INT32_MAX),
            weights_arrival_s=check_float("weights_arrival_s", body.get("weights_arrival_s", 0.0), 1e12),
            weights_arrival_max_s=check_float("weights_arrival_max_s", body.get("weights_arrival_max_s", 0.0), 1e9),
        )


MAX_OUTCOMES = 64  # outcome names in a heartbeat's reward_outcomes


def _counts(name: str, value: Any) -> dict[str, int]:
    """A map of at most `MAX_OUTCOMES` names (64 characters of [A-Za-z0-9_.:@/+=-]) to counts >= 0."""
    if not isinstance(value, dict):
        raise ProtocolError(name, f"expected a map, got {type(value).__name__}", "type")
    if len(value) > MAX_OUTCOMES:
        raise ProtocolError(name, f"{len(value)} entries exceed the limit {MAX_OUTCOMES}", "too_large")
    return {check_str(f"{name} key", key, 64, ID_PATTERN): check_int(f"{name}.{key}", count, 0, 2**53)
            for key, count in value.items()}


@dataclass
class Ack(Message):
    """Learner → worker: trajectories taken (``accepted``, duplicates included: delivered once) or refused
    ("id: reason"); ``credits``: the cumulative number of trajectories the worker may have sent this session;
    ``start_limit``: the cumulative number of groups it may have started (admission control), −1 for no limit;
    ``threads``: the torch threads a worker on the learner's own machine should use (0: no advice; a learner of
    an earlier version sends none)."""

    kind: ClassVar[str] = "ack"
    accepted: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    credits: int = 0
    start_limit: int = -1
    threads: int = 0
    optional_fields: ClassVar[frozenset] = frozenset({"threads"})

    @classmethod
    def from_wire(cls, body, limits, data=()):
        return cls(
            accepted=check_str_list("accepted", body["accepted"], limits, 65_536),
            rejected=check_str_list("rejected", body["rejected"], limits, 65_536),
            credits=check_int("credits", body["credits"], 0, INT32_MAX),
            start_limit=check_int("start_limit", body["start_limit"], -1, INT32_MAX),
            threads=check_int("threads", body.get("threads", 0), 0, 4096),
        )


# What a learner's bye tells a worker (its ``reason``); any other reason reads as BYE_LEARNER_STOPPING.
BYE_RUN_FINISHED = "run finished"  # the run is over: the worker leaves
BYE_LEARNER_STOPPING = "learner stopping"  # the learner exits before the run is over (an error, an interrupt, a
#   restart): the worker keeps saying hello until runtime.learner_timeout_s, so a restarted learner gets it back
BYE_REFUSED = "refused: "  # prefix: this worker may not join (e.g. its id belongs to another key); it stops
BYE_BUSY = "busy: "  # prefix: the learner cannot take this worker now (its registry is full); it says hello again
#   every transport.hello_interval_s until runtime.learner_timeout_s, and names the reason if it gives up
# What a worker's bye may tell the learner: it failed and will not come back (its fleet wait stops counting it)
BYE_WORKER_FAILED = "failed: "  # prefix, then the error


@dataclass
class Bye(Message):
    """Either direction: I am leaving (or: you are refused), with a reason. A learner's reason is one of the
    ``BYE_*`` above, which tells its workers whether to leave (`ends_run`), stop (`refuses`) or wait for it."""

    kind: ClassVar[str] = "bye"
    sender_id: str
    reason: str = ""

    @property
    def ends_run(self) -> bool:
        return self.reason == BYE_RUN_FINISHED

    @property
    def refuses(self) -> bool:
        return self.reason.startswith(BYE_REFUSED)

    @property
    def busy(self) -> bool:
        return self.reason.startswith(BYE_BUSY)

    @property
    def failed(self) -> bool:
        return self.reason.startswith(BYE_WORKER_FAILED)

    @classmethod
    def from_wire(cls, body, limits, data=()):
        reason = body["reason"]
        if not isinstance(reason, str) or len(reason) > 1000:
            raise ProtocolError("reason", "expected a string of at most 1000 characters", "type")
        return cls(sender_id=check_id("sender_id", body["sender_id"], limits), reason=reason)
