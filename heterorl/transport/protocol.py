"""Wire protocol between rollout workers and the learner: versioned messages, msgpack frames, strict decoding.

A message travels as ZeroMQ frames: a msgpack map (the header, with ``"v"`` =
schema version and ``"kind"``), then at most one raw little-endian data frame —
a weight chunk's bytes, or the four arrays of all trajectories of a batch back
to back — which the receiver views without a copy (``numpy.frombuffer``). A single
``trajectory`` message keeps its arrays as msgpack ``bin`` fields. Nothing is
ever pickled.

``decode`` trusts nothing: it checks the schema version, the kind, every
field's type, every array's dtype size, length and bounds, finiteness and the
size limits of :class:`Limits`, and raises :class:`ProtocolError` naming the
field. A service catches that one exception type, counts the reason and keeps
serving.

A frame that decodes may still not fit the learner: :class:`TrajectoryContract`
states what a trajectory must satisfy to reach its model (versions, vocabulary,
context, a log-prob floor, group size) and names every trajectory of a batch that
breaks it (docs/RELIABILITY.md).
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack
import numpy as np
import xxhash

from heterorl.errors import HeteroRLError

SCHEMA_VERSION = 3  # 2: weights chunks carry an XXH3-64 checksum instead of a CRC-32; 3: one data frame per batch

_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:@/+=-]+$")
_INT32_MAX = 2**31 - 1


class ProtocolError(HeteroRLError):
    """A frame that does not decode to a valid message. ``field`` names what is wrong; ``reason`` is a short tag."""

    def __init__(self, field_name: str, message: str, reason: str = "invalid") -> None:
        super().__init__(f"field `{field_name}`: {message}")
        self.field = field_name
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """Size and value bounds the decoder enforces (defaults suit tiny-to-8B models with 32k-token completions)."""

    max_header_bytes: int = 16 * 2**20  # one msgpack header frame
    max_tokens: int = 131_072  # per token array
    max_token_id: int = 2**24  # exclusive upper bound on token ids
    max_id_chars: int = 128
    max_abs_reward: float = 1e6
    max_tensors: int = 100_000  # tensors in one weight update
    max_chunk_bytes: int = 64 * 2**20
    max_settings: int = 256
    max_batch: int = 4096  # trajectories in one message


DEFAULT_LIMITS = Limits()


# -- field validators -------------------------------------------------------------------------------

def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(name, f"expected an integer, got {type(value).__name__}", "type")
    if not lo <= value <= hi:
        raise ProtocolError(name, f"{value} is outside [{lo}, {hi}]", "bounds")
    return value


def _float(name: str, value: Any, limit: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(name, f"expected a number, got {type(value).__name__}", "type")
    value = float(value)
    if not math.isfinite(value):
        raise ProtocolError(name, f"{value} is not finite", "not_finite")
    if abs(value) > limit:
        raise ProtocolError(name, f"|{value}| exceeds {limit}", "bounds")
    return value


def _str(name: str, value: Any, max_chars: int, pattern: re.Pattern | None = None) -> str:
    if not isinstance(value, str):
        raise ProtocolError(name, f"expected a string, got {type(value).__name__}", "type")
    if not value or len(value) > max_chars:
        raise ProtocolError(name, f"length {len(value)} is outside [1, {max_chars}]", "bounds")
    if pattern is not None and not pattern.match(value):
        raise ProtocolError(name, f"{value[:40]!r} holds characters outside [A-Za-z0-9_.:@/+=-]", "bounds")
    return value


def _ident(name: str, value: Any, limits: Limits) -> str:
    return _str(name, value, limits.max_id_chars, _ID_PATTERN)


def _array(name: str, value: Any, dtype: str, max_len: int) -> np.ndarray:
    """A read-only numpy view of a raw little-endian buffer (no copy)."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ProtocolError(name, f"expected raw bytes ({dtype}), got {type(value).__name__}", "type")
    itemsize = np.dtype(dtype).itemsize
    if len(value) % itemsize:
        raise ProtocolError(name, f"{len(value)} bytes is not a multiple of {itemsize} ({dtype})", "length")
    if len(value) // itemsize > max_len:
        raise ProtocolError(name, f"{len(value) // itemsize} elements exceed the limit {max_len}", "too_large")
    return np.frombuffer(value, dtype=dtype)


def _str_list(name: str, value: Any, limits: Limits, max_len: int) -> list[str]:
    if not isinstance(value, list):
        raise ProtocolError(name, f"expected a list, got {type(value).__name__}", "type")
    if len(value) > max_len:
        raise ProtocolError(name, f"{len(value)} entries exceed the limit {max_len}", "too_large")
    if not value or (_types_are(value, {str}) and 1 <= min(map(len, value)) and max(map(len, value)) <= 256):
        return value  # the common case, checked in bulk; else find and name the culprit
    return [_str(f"{name}[{i}]", v, 256) for i, v in enumerate(value)]


def _settings(name: str, value: Any, limits: Limits) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(name, f"expected a map, got {type(value).__name__}", "type")
    if len(value) > limits.max_settings:
        raise ProtocolError(name, f"{len(value)} entries exceed the limit {limits.max_settings}", "too_large")
    out = {}
    for key, item in value.items():
        _str(f"{name} key", key, 256)
        if isinstance(item, float) and not math.isfinite(item):
            raise ProtocolError(f"{name}.{key}", "is not finite", "not_finite")
        if isinstance(item, str) and len(item) > 1_000_000:
            raise ProtocolError(f"{name}.{key}", "string exceeds 1,000,000 characters", "too_large")
        if item is not None and not isinstance(item, (str, int, float, bool)):
            raise ProtocolError(f"{name}.{key}", f"expected a scalar, got {type(item).__name__}", "type")
        out[key] = item
    return out


def _le(array: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def _check_token_arrays(prompt: np.ndarray, completion: np.ndarray, logprobs: np.ndarray, versions: np.ndarray,
                        limits: Limits) -> tuple[int, int, float, int, int]:
    """Bounds and finiteness of (possibly concatenated) token arrays: one min/max pass per array. Returns what
    those passes found, the array part of `BatchExtremes`: (largest prompt token id, largest completion token
    id, lowest log-prob, oldest version, newest version)."""
    highest = []
    for name, tokens in (("prompt_tokens", prompt), ("completion_tokens", completion)):
        top = int(tokens.view("<u4").max()) if len(tokens) else -1  # negatives wrap to > 2**31
        if top >= limits.max_token_id:
            raise ProtocolError(name, f"token ids must lie in [0, {limits.max_token_id})", "bounds")
        highest.append(top)
    low = high = 0.0
    if len(logprobs):
        low, high = float(logprobs.min()), float(logprobs.max())
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ProtocolError("behaviour_logprobs", "holds NaN or inf", "not_finite")
        if high > 1e-4:
            raise ProtocolError("behaviour_logprobs", "holds values > 0 (log-probabilities are ≤ 0)", "bounds")
    oldest, newest = (int(versions.min()), int(versions.max())) if len(versions) else (0, -1)
    if oldest < 0:
        raise ProtocolError("policy_versions", "holds negative versions", "bounds")
    return highest[0], highest[1], low, oldest, newest


# -- messages -------------------------------------------------------------------------------------

@dataclass
class Message:
    """Base of every message. ``kind`` is the wire tag; subclasses list their fields."""

    kind: ClassVar[str] = ""
    data_frames: ClassVar[int] = 0  # raw frames after the header
    optional_fields: ClassVar[frozenset] = frozenset()  # header keys a peer may leave out (added since the schema)

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def payload(self) -> list:
        """The raw frames after the header (``data_frames`` of them)."""
        return []

    @classmethod
    def from_wire(cls, body: dict[str, Any], limits: Limits, data=()) -> "Message":
        raise NotImplementedError


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
            worker_id=_ident("worker_id", body["worker_id"], limits),
            host=_str("host", body["host"], 255),
            pid=_int("pid", body["pid"], 0, _INT32_MAX),
            version_held=_int("version_held", body["version_held"], -1, _INT32_MAX),
            sent_at=_float("sent_at", body["sent_at"]),
            # optional: workers of earlier versions (all of them torch workers) send no engine
            engine=_str("engine", body.get("engine", "torch"), 32, _ID_PATTERN),
            layout=_layout(body.get("layout", {}), limits),
        )


def _layout(value: Any, limits: Limits) -> dict[str, dict]:
    """A worker's layout, well formed (`reshard.DestLayout.from_dict`); whether it fits the model is the
    learner's to check."""
    from heterorl.transport.reshard import DestLayout, ReshardError

    if not isinstance(value, dict) or len(value) > limits.max_tensors:
        raise ProtocolError("layout", f"expected a map of at most {limits.max_tensors} tensors", "type")
    for name in value:
        _str("layout key", name, 1024)
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
            worker_id=_ident("worker_id", body["worker_id"], limits),
            credits=_int("credits", body["credits"], 0, _INT32_MAX),
            newest_version=_int("newest_version", body["newest_version"], -1, _INT32_MAX),
            heartbeat_interval_s=_float("heartbeat_interval_s", body["heartbeat_interval_s"], 3600.0),
            settings=_settings("settings", body["settings"], limits),
        )


@dataclass
class Heartbeat(Message):
    """Either direction, every ``heartbeat_interval_s``: I am alive. From a worker also: the version it holds,
    its cumulative seconds generating (``busy_s``) and waiting for credit or weights (``idle_s``), and the
    admission permits it has used this session (``groups_started``; −1: not reported, as by a worker of an
    earlier version): groups started and still on their way count, which the learner cannot see. And
    ``reward_outcomes``: the programs its task's reward ran this session, by outcome (the code task's sandbox:
    ok, wrong_answer, timeout, forbidden:socket, ...; empty for other tasks)."""

    kind: ClassVar[str] = "heartbeat"
    sender_id: str
    version_held: int = -1
    sent_at: float = 0.0
    busy_s: float = 0.0
    idle_s: float = 0.0
    groups_started: int = -1
    reward_outcomes: dict[str, int] = field(default_factory=dict)
    optional_fields: ClassVar[frozenset] = frozenset({"groups_started", "reward_outcomes"})

    def to_wire(self):
        body = super().to_wire()
        if not self.reward_outcomes:  # (left out when empty: a learner of an earlier version takes the beat)
            del body["reward_outcomes"]
        return body

    @classmethod
    def from_wire(cls, body, limits, data=()):
        return cls(
            sender_id=_ident("sender_id", body["sender_id"], limits),
            version_held=_int("version_held", body["version_held"], -1, _INT32_MAX),
            sent_at=_float("sent_at", body["sent_at"]),
            busy_s=_float("busy_s", body["busy_s"], 1e9),
            idle_s=_float("idle_s", body["idle_s"], 1e9),
            groups_started=_int("groups_started", body.get("groups_started", -1), -1, _INT32_MAX),
            reward_outcomes=_counts("reward_outcomes", body.get("reward_outcomes", {})),
        )


MAX_OUTCOMES = 64  # outcome names in a heartbeat's reward_outcomes


def _counts(name: str, value: Any) -> dict[str, int]:
    """A map of at most `MAX_OUTCOMES` names (64 characters of [A-Za-z0-9_.:@/+=-]) to counts >= 0."""
    if not isinstance(value, dict):
        raise ProtocolError(name, f"expected a map, got {type(value).__name__}", "type")
    if len(value) > MAX_OUTCOMES:
        raise ProtocolError(name, f"{len(value)} entries exceed the limit {MAX_OUTCOMES}", "too_large")
    return {_str(f"{name} key", key, 64, _ID_PATTERN): _int(f"{name}.{key}", count, 0, 2**53)
            for key, count in value.items()}


@dataclass
class Trajectory(Message):
    """One scored completion of a prompt, stamped by the worker that sampled it.

    Arrays are numpy views: ``prompt_tokens`` / ``completion_tokens`` int32,
    ``behaviour_logprobs`` float32 (log q of each completion token),
    ``policy_versions`` int32 (the weights version that sampled each completion
    token; one trajectory may span a weight update). Timestamps are seconds on
    the worker's clock except ``received_at`` (learner's clock, set on receipt).
    """

    # Workers send trajectories in batches (`TrajectoryBatch`), never as this one-trajectory message. It stays on
    # the wire (and the learner takes it in through the same checks as a batch's members) because
    # `heterorl bench transport` sends exactly this one-frame encoding as its raw-pyzmq baseline, and the protocol
    # tests and the transport fuzzer mutate its flat map, one field at a time, to reach every field check.
    kind: ClassVar[str] = "trajectory"
    trajectory_id: str
    group_id: str
    prompt_id: str
    sampler_id: str
    group_size: int
    prompt_tokens: np.ndarray
    completion_tokens: np.ndarray
    behaviour_logprobs: np.ndarray
    policy_versions: np.ndarray
    reward: float
    generation_start: float
    generation_end: float
    sent_at: float = 0.0
    received_at: float = 0.0
    stop_reason: str = "stop"

    @property
    def key(self) -> str:
        """The trajectory's id in its sampler's namespace: ids are chosen by workers, so the learner tells one
        worker's ids from another's by this key (docs/RELIABILITY.md, "Ids"); `|` cannot occur in an id."""
        return f"{self.sampler_id}|{self.trajectory_id}"

    @property
    def group_key(self) -> str:
        """The group's id in its sampler's namespace (see `key`)."""
        return f"{self.sampler_id}|{self.group_id}"

    def to_wire(self):
        body = super().to_wire()
        body["prompt_tokens"] = _le(self.prompt_tokens, "<i4")
        body["completion_tokens"] = _le(self.completion_tokens, "<i4")
        body["behaviour_logprobs"] = _le(self.behaviour_logprobs, "<f4")
        body["policy_versions"] = _le(self.policy_versions, "<i4")
        return body

    @classmethod
    def from_wire(cls, body, limits, data=()):
        prompt = _array("prompt_tokens", body["prompt_tokens"], "<i4", limits.max_tokens)
        completion = _array("completion_tokens", body["completion_tokens"], "<i4", limits.max_tokens)
        logprobs = _array("behaviour_logprobs", body["behaviour_logprobs"], "<f4", limits.max_tokens)
        versions = _array("policy_versions", body["policy_versions"], "<i4", limits.max_tokens)
        if len(prompt) == 0:
            raise ProtocolError("prompt_tokens", "is empty", "length")
        if len(completion) == 0:
            raise ProtocolError("completion_tokens", "is empty; drop empty completions on the worker", "length")
        for name, array in (("behaviour_logprobs", logprobs), ("policy_versions", versions)):
            if len(array) != len(completion):
                raise ProtocolError(name, f"has {len(array)} entries for {len(completion)} completion tokens",
                                    "length_mismatch")
        _check_token_arrays(prompt, completion, logprobs, versions, limits)
        start = _float("generation_start", body["generation_start"])
        end = _float("generation_end", body["generation_end"])
        if end < start:
            raise ProtocolError("generation_end", f"{end} is before generation_start {start}", "bounds")
        stop = _str("stop_reason", body["stop_reason"], 32, _ID_PATTERN)
        return cls(
            trajectory_id=_ident("trajectory_id", body["trajectory_id"], limits),
            group_id=_ident("group_id", body["group_id"], limits),
            prompt_id=_ident("prompt_id", body["prompt_id"], limits),
            sampler_id=_ident("sampler_id", body["sampler_id"], limits),
            group_size=_int("group_size", body["group_size"], 1, 65_536),
            prompt_tokens=prompt,
            completion_tokens=completion,
            behaviour_logprobs=logprobs,
            policy_versions=versions,
            reward=_float("reward", body["reward"], limits.max_abs_reward),
            generation_start=start,
            generation_end=end,
            sent_at=_float("sent_at", body["sent_at"]),
            received_at=_float("received_at", body["received_at"]),
            stop_reason=stop,
        )

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays (what holding it costs, to a few hundred bytes)."""
        return 4 * (len(self.prompt_tokens) + 3 * len(self.completion_tokens))


@dataclass
class TrajectoryBatch(Message):
    """Worker → learner: the trajectories the transport sends together (what goes on the wire).

    Per-trajectory scalars travel as lists in the header, with ``prompt_len`` and ``completion_len``; the arrays of
    all trajectories travel in one raw little-endian data frame, four sections back to back: every prompt's tokens,
    every completion's tokens, behaviour log-probs and policy versions (each entry 4 bytes). They are decoded as
    views split by those lengths — one vectorised check per array for the whole batch, no copy. One frame, not
    four: each zero-copy frame costs the sender a tracker and the receiver a frame object.
    """

    kind: ClassVar[str] = "trajectories"
    data_frames: ClassVar[int] = 1
    trajectories: list[Trajectory] = field(default_factory=list)
    # set by `from_wire` from the reductions its checks made anyway; else computed on first use (`extremes`)
    _extremes: BatchExtremes | None = field(default=None, init=False, repr=False, compare=False)

    _SCALARS: ClassVar[tuple[str, ...]] = (
        "trajectory_id", "group_id", "prompt_id", "sampler_id", "group_size", "reward", "generation_start",
        "generation_end", "sent_at", "stop_reason")
    _ARRAYS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("prompt_tokens", "<i4"), ("completion_tokens", "<i4"), ("behaviour_logprobs", "<f4"),
        ("policy_versions", "<i4"))

    def to_wire(self):
        ts = self.trajectories
        body = {name: [getattr(t, name) for t in ts] for name in self._SCALARS}
        body["prompt_len"] = [len(t.prompt_tokens) for t in ts]
        body["completion_len"] = [len(t.completion_tokens) for t in ts]
        return body

    def extremes(self) -> BatchExtremes:
        """What a `TrajectoryContract` bounds, over the whole batch (kept from decoding a received batch)."""
        if self._extremes is None:
            self._extremes = BatchExtremes.of(self.trajectories)
        return self._extremes

    def payload_nbytes(self) -> int:
        """Bytes of the data frame (every entry is 4 bytes)."""
        return 4 * sum(len(t.prompt_tokens) + 3 * len(t.completion_tokens) for t in self.trajectories)

    def payload(self, out: np.ndarray | None = None) -> list:
        """The data frame; written into ``out`` (a uint8 array of at least ``payload_nbytes()``) when given, so a
        sender can reuse its buffers, else into a new array."""
        ts = self.trajectories
        if out is None:
            out = np.empty(self.payload_nbytes(), np.uint8)
        offset = 0
        for name, dtype in self._ARRAYS:
            parts = [getattr(t, name) for t in ts]
            count = sum(map(len, parts))
            np.concatenate(parts, out=out[offset:offset + 4 * count].view(dtype), casting="same_kind")
            offset += 4 * count
        return [out[:offset]]

    @classmethod
    def from_wire(cls, body, limits, data=()):
        ids = body["trajectory_id"]
        if not isinstance(ids, list) or not 1 <= len(ids) <= limits.max_batch:
            raise ProtocolError("trajectory_id", f"expected a list of 1..{limits.max_batch} ids", "type")
        n = len(ids)
        for name in (*cls._SCALARS, "prompt_len", "completion_len"):
            value = body[name]
            if not isinstance(value, list) or len(value) != n:
                raise ProtocolError(name, f"expected a list of {n} entries (one per trajectory)", "length_mismatch")
        prompt_len = _lengths("prompt_len", body["prompt_len"], limits.max_tokens)
        completion_len = _lengths("completion_len", body["completion_len"], limits.max_tokens)
        total_prompt, total_completion = sum(prompt_len), sum(completion_len)
        frame = data[0]
        expected = 4 * (total_prompt + 3 * total_completion)
        if frame.nbytes != expected:
            raise ProtocolError("data", f"{frame.nbytes} bytes, but prompt_len and completion_len imply {expected} "
                                "(4 per prompt token, 12 per completion token)", "length_mismatch")
        words = np.frombuffer(frame, "<i4")
        cuts = (0, total_prompt, total_prompt + total_completion, total_prompt + 2 * total_completion, len(words))
        prompt, completion, logprobs, versions = (words[a:b] for a, b in zip(cuts, cuts[1:]))
        logprobs = logprobs.view("<f4")
        found = _check_token_arrays(prompt, completion, logprobs, versions, limits)
        if _scalars_valid(body, limits):  # the common case, checked in bulk; else find and name the culprit
            return cls._decoded(_build_batch(body, prompt, completion, logprobs, versions, prompt_len,
                                             completion_len), found, prompt_len, completion_len)
        trajectories = []
        p_off = c_off = 0
        for i in range(n):
            p_end, c_end = p_off + prompt_len[i], c_off + completion_len[i]
            start = _float(f"generation_start[{i}]", body["generation_start"][i])
            end = _float(f"generation_end[{i}]", body["generation_end"][i])
            if end < start:
                raise ProtocolError(f"generation_end[{i}]", f"{end} is before generation_start {start}", "bounds")
            trajectories.append(Trajectory(
                trajectory_id=_ident(f"trajectory_id[{i}]", ids[i], limits),
                group_id=_ident(f"group_id[{i}]", body["group_id"][i], limits),
                prompt_id=_ident(f"prompt_id[{i}]", body["prompt_id"][i], limits),
                sampler_id=_ident(f"sampler_id[{i}]", body["sampler_id"][i], limits),
                group_size=_int(f"group_size[{i}]", body["group_size"][i], 1, 65_536),
                prompt_tokens=prompt[p_off:p_end], completion_tokens=completion[c_off:c_end],
                behaviour_logprobs=logprobs[c_off:c_end], policy_versions=versions[c_off:c_end],
                reward=_float(f"reward[{i}]", body["reward"][i], limits.max_abs_reward),
                generation_start=start, generation_end=end,
                sent_at=_float(f"sent_at[{i}]", body["sent_at"][i]),
                stop_reason=_str(f"stop_reason[{i}]", body["stop_reason"][i], 32, _ID_PATTERN),
            ))
            p_off, c_off = p_end, c_end
        return cls._decoded(trajectories, found, prompt_len, completion_len)

    @classmethod
    def _decoded(cls, trajectories: list[Trajectory], found: tuple, prompt_len: list[int],
                 completion_len: list[int]) -> "TrajectoryBatch":
        """The decoded batch, keeping its extremes: what the array checks ``found``, the longest sequence and the
        largest group size."""
        batch = cls(trajectories)
        batch._extremes = BatchExtremes(*found, max(map(operator.add, prompt_len, completion_len)),
                                        max(t.group_size for t in trajectories))
        return batch


def _types_are(values, allowed: set) -> bool:
    """Every value's exact type is in ``allowed`` (no subclasses, so no bool for int); one pass in C."""
    return set(map(type, values)) <= allowed


def _lengths(name: str, values: list, max_tokens: int) -> list[int]:
    """Per-trajectory lengths in [1, max_tokens]: checked in bulk, the culprit named when one is wrong."""
    if _types_are(values, {int}) and 1 <= min(values) and max(values) <= max_tokens:
        return values
    return [_int(f"{name}[{i}]", v, 1, max_tokens) for i, v in enumerate(values)]


_IDS_PATTERN = re.compile(r"(?:[A-Za-z0-9_.:@/+=-]{1,128}\n)*")
_REASONS_PATTERN = re.compile(r"(?:[A-Za-z0-9_.:@/+=-]{1,32}\n)*")


def _scalars_valid(body: dict, limits: Limits) -> bool:
    """Bulk check of a batch's per-trajectory scalars; False sends the decoder down the per-entry path."""
    if limits.max_id_chars != 128:
        return False
    for name, pattern in (("trajectory_id", _IDS_PATTERN), ("group_id", _IDS_PATTERN), ("prompt_id", _IDS_PATTERN),
                          ("sampler_id", _IDS_PATTERN), ("stop_reason", _REASONS_PATTERN)):
        values = body[name] if name == "trajectory_id" else set(body[name])  # the others repeat within a batch
        if not _types_are(values, {str}) or not pattern.fullmatch("\n".join(values) + "\n"):
            return False
    sizes = body["group_size"]
    if not _types_are(sizes, {int}) or min(sizes) < 1 or max(sizes) > 65_536:
        return False
    rewards, starts, ends, sent = (body[name] for name in ("reward", "generation_start", "generation_end", "sent_at"))
    numbers = (*rewards, *starts, *ends, *sent)
    if not _types_are(numbers, {float, int}):
        return False
    try:
        finite = math.isfinite(math.fsum(numbers))  # NaN or inf anywhere makes the sum NaN or inf
    except OverflowError:  # finite values too large to add up: the per-entry path judges each
        return False
    return finite and max(map(abs, rewards)) <= limits.max_abs_reward and all(map(operator.ge, ends, starts))


def _build_batch(body, prompt, completion, logprobs, versions, prompt_len, completion_len) -> list[Trajectory]:
    p_ends = list(itertools.accumulate(prompt_len))
    c_ends = list(itertools.accumulate(completion_len))
    p_spans = list(zip([0, *p_ends[:-1]], p_ends))
    c_spans = list(zip([0, *c_ends[:-1]], c_ends))
    return [Trajectory(i, g, p, s, size, prompt[p0:p1], completion[c0:c1], logprobs[c0:c1], versions[c0:c1],
                       float(r), float(t0), float(t1), float(ts), 0.0, why)
            for i, g, p, s, size, (p0, p1), (c0, c1), r, t0, t1, ts, why in zip(
                body["trajectory_id"], body["group_id"], body["prompt_id"], body["sampler_id"], body["group_size"],
                p_spans, c_spans, body["reward"], body["generation_start"], body["generation_end"], body["sent_at"],
                body["stop_reason"])]


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
            accepted=_str_list("accepted", body["accepted"], limits, 65_536),
            rejected=_str_list("rejected", body["rejected"], limits, 65_536),
            credits=_int("credits", body["credits"], 0, _INT32_MAX),
            start_limit=_int("start_limit", body["start_limit"], -1, _INT32_MAX),
            threads=_int("threads", body.get("threads", 0), 0, 4096),
        )


@dataclass
class WeightsNotice(Message):
    """Learner → worker (control channel): version ``version`` is available on the weights channel."""

    kind: ClassVar[str] = "weights_notice"
    version: int

    @classmethod
    def from_wire(cls, body, limits, data=()):
        return cls(version=_int("version", body["version"], 0, _INT32_MAX))


@dataclass
class WeightsRequest(Message):
    """Worker → learner (weights channel): send me the newest version released to me, if newer than
    ``have_version``; ``chunk`` > 0 asks for one chunk of ``version`` (a resumed or windowed fetch).

    ``delta_base`` (optional; −1 or absent: none): on a header request, the version whose bytes the worker holds
    whole and verified, so the learner may send the newest version as deltas from it; on a chunk request, the
    base of the delta payload being fetched (−1: the full version)."""

    kind: ClassVar[str] = "weights_request"
    worker_id: str
    have_version: int = -1
    version: int = -1
    chunk: int = -1
    delta_base: int = -1
    layout: str = ""  # the key of the slices this worker declared in its hello (`reshard.layout_key`; "": whole)
    optional_fields: ClassVar[frozenset] = frozenset({"delta_base", "layout"})  # earlier workers: full, whole

    @classmethod
    def from_wire(cls, body, limits, data=()):
        return cls(
            worker_id=_ident("worker_id", body["worker_id"], limits),
            have_version=_int("have_version", body["have_version"], -1, _INT32_MAX),
            version=_int("version", body["version"], -1, _INT32_MAX),
            chunk=_int("chunk", body["chunk"], -1, _INT32_MAX),
            delta_base=_int("delta_base", body.get("delta_base", -1), -1, _INT32_MAX),
            layout=_str("layout", body["layout"], 64) if body.get("layout") else "",
        )


@dataclass
class WeightsHeader(Message):
    """Learner → worker: the layout of version ``version``: tensors packed back to back in ``names`` order,
    split into ``num_chunks`` chunks of ``chunk_bytes`` (the last may be shorter). Each chunk carries its own
    checksum: a version is whole when every chunk arrived, passed its checksum and the byte count adds up.

    Optional (absent from learners of earlier versions): ``base_version`` ≥ 0 says the chunks carry a delta
    payload (heterorl.transport.deltas) from that version, of ``payload_bytes`` bytes, instead of the packed
    tensors; ``checksums`` holds the XXH3-64 of each tensor of the version, which the rebuilt bytes must match;
    ``aliases`` names tensors sent once under another name (tied weights).

    A sharded learner's rank sends only the slices it owns (heterorl.transport.reshard): ``shard`` is [rank,
    world], and for each tensor ``full_shapes`` gives the whole tensor's shape and ``boxes`` where the slice lies
    in it ([start, stop] per dim); a worker places every rank's slices of one version before it uses any."""

    kind: ClassVar[str] = "weights_header"
    version: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    total_bytes: int
    chunk_bytes: int
    num_chunks: int
    base_version: int = -1
    payload_bytes: int = -1  # −1: the packed tensors themselves (``total_bytes``)
    checksums: list[int] = field(default_factory=list)
    aliases: list[list[str]] = field(default_factory=list)  # [name, name it is the same tensor as] (tied weights)
    shard: list[int] = field(default_factory=list)  # [rank, world] of a sharded learner's slices; [] whole tensors
    full_shapes: list[list[int]] = field(default_factory=list)  # (slices) each tensor's whole shape
    boxes: list[list[list[int]]] = field(default_factory=list)  # (slices) each slice's [start, stop] per dim
    # a LoRA learner's version holds only the adapter: {base (the digest of the base it was trained on), rank,
    # alpha, targets}; {} whole weights (heterorl.training.lora)
    adapter: dict = field(default_factory=dict)
    optional_fields: ClassVar[frozenset] = frozenset({"base_version", "payload_bytes", "checksums", "aliases",
                                                      "shard", "full_shapes", "boxes", "adapter"})

    @property
    def is_delta(self) -> bool:
        return self.base_version >= 0

    @property
    def transfer_bytes(self) -> int:
        """The bytes the chunks carry: the delta payload, or the packed tensors."""
        return self.payload_bytes if self.payload_bytes >= 0 else self.total_bytes

    @classmethod
    def from_wire(cls, body, limits, data=()):
        names = _str_list("names", body["names"], limits, limits.max_tensors)
        dtypes = _str_list("dtypes", body["dtypes"], limits, limits.max_tensors)
        shapes_raw = body["shapes"]
        if not isinstance(shapes_raw, list):
            raise ProtocolError("shapes", f"expected a list, got {type(shapes_raw).__name__}", "type")
        if not len(names) == len(dtypes) == len(shapes_raw):
            raise ProtocolError("shapes", f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes_raw)} shapes",
                                "length_mismatch")
        for i, dtype in enumerate(dtypes):
            if dtype not in TENSOR_DTYPES:
                raise ProtocolError(f"dtypes[{i}]", f"{dtype!r} is not one of {sorted(TENSOR_DTYPES)}", "bounds")
        shapes = []
        for i, shape in enumerate(shapes_raw):
            if not isinstance(shape, list) or len(shape) > 8:
                raise ProtocolError(f"shapes[{i}]", "expected a list of at most 8 dimensions", "type")
            shapes.append([_int(f"shapes[{i}]", d, 0, _INT32_MAX) for d in shape])
        total = _int("total_bytes", body["total_bytes"], 0, 2**50)
        expected = sum(TENSOR_DTYPES[d][1] * math.prod(s) for d, s in zip(dtypes, shapes))
        if expected != total:
            raise ProtocolError("total_bytes", f"{total} != {expected} implied by dtypes and shapes", "length_mismatch")
        version = _int("version", body["version"], 0, _INT32_MAX)
        base = _int("base_version", body.get("base_version", -1), -1, version - 1)
        payload = _int("payload_bytes", body.get("payload_bytes", -1), -1 if base < 0 else 0, 2**50)
        checksums = body.get("checksums", [])
        if not isinstance(checksums, list) or len(checksums) not in (0, len(names)):
            raise ProtocolError("checksums", f"expected a list of {len(names)} checksums", "length_mismatch")
        checksums = [_int(f"checksums[{i}]", c, 0, 2**64 - 1) for i, c in enumerate(checksums)]
        if base >= 0 and not checksums:
            raise ProtocolError("checksums", "a delta must come with the checksums of the tensors it rebuilds",
                                "length_mismatch")
        chunk_bytes = _int("chunk_bytes", body["chunk_bytes"], 1, limits.max_chunk_bytes)
        num_chunks = _int("num_chunks", body["num_chunks"], 0, _INT32_MAX)
        carried = payload if payload >= 0 else total
        if num_chunks != -(-carried // chunk_bytes):
            raise ProtocolError("num_chunks", f"{num_chunks} != ceil({carried} / {chunk_bytes})", "length_mismatch")
        shard, full_shapes, boxes = _slices(body, shapes)
        return cls(version=version, names=names, dtypes=dtypes, shapes=shapes, total_bytes=total,
                   chunk_bytes=chunk_bytes, num_chunks=num_chunks, base_version=base, payload_bytes=payload,
                   checksums=checksums, aliases=_aliases(body.get("aliases", []), names, limits), shard=shard,
                   full_shapes=full_shapes, boxes=boxes, adapter=_adapter(body.get("adapter", {}), limits))


def _slices(body: dict, shapes: list[list[int]]) -> tuple[list[int], list[list[int]], list[list[list[int]]]]:
    """A sharded rank's ``shard``, ``full_shapes`` and ``boxes``, checked: each box inside its whole tensor and
    of its slice's shape; all three absent for whole tensors."""
    shard = body.get("shard", [])
    if not shard:
        if body.get("full_shapes") or body.get("boxes"):
            raise ProtocolError("shard", "full_shapes and boxes come with shard [rank, world]", "length_mismatch")
        return [], [], []
    if not isinstance(shard, list) or len(shard) != 2:
        raise ProtocolError("shard", "expected [rank, world]", "type")
    world = _int("shard[1]", shard[1], 1, 1 << 16)
    rank = _int("shard[0]", shard[0], 0, world - 1)
    full_raw, boxes_raw = body.get("full_shapes"), body.get("boxes")
    if not (isinstance(full_raw, list) and isinstance(boxes_raw, list) and len(full_raw) == len(boxes_raw)
            == len(shapes)):
        raise ProtocolError("boxes", f"expected full_shapes and boxes for each of the {len(shapes)} tensors",
                            "length_mismatch")
    full_shapes, boxes = [], []
    for i, (full, box, shape) in enumerate(zip(full_raw, boxes_raw, shapes)):
        if not (isinstance(full, list) and isinstance(box, list) and len(full) == len(box) == len(shape)):
            raise ProtocolError(f"boxes[{i}]", f"expected {len(shape)} dims, a whole shape and [start, stop] "
                                "per dim", "type")
        full = [_int(f"full_shapes[{i}]", d, 0, _INT32_MAX) for d in full]
        pairs = []
        for d, (pair, size, extent) in enumerate(zip(box, full, shape)):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ProtocolError(f"boxes[{i}][{d}]", "expected [start, stop]", "type")
            start, stop = (_int(f"boxes[{i}][{d}]", x, 0, size) for x in pair)
            if stop - start != extent:
                raise ProtocolError(f"boxes[{i}][{d}]", f"[{start}, {stop}] is not the slice's {extent} along "
                                    f"dim {d}", "bounds")
            pairs.append([start, stop])
        full_shapes.append(full)
        boxes.append(pairs)
    return [rank, world], full_shapes, boxes


def _adapter(value: Any, limits: Limits) -> dict:
    """A LoRA version's adapter description, well formed ({} for whole weights)."""
    if value == {}:
        return {}
    if not isinstance(value, dict) or set(value) != {"base", "rank", "alpha", "targets"}:
        raise ProtocolError("adapter", "expected {base, rank, alpha, targets}", "type")
    return {"base": _str("adapter.base", value["base"], 64, _ID_PATTERN),
            "rank": _int("adapter.rank", value["rank"], 1, 1 << 16),
            "alpha": _float("adapter.alpha", value["alpha"], 1e6),
            "targets": _str_list("adapter.targets", value["targets"], limits, 64)}


def _aliases(value: Any, names: list[str], limits: Limits) -> list[list[str]]:
    """[alias, source] pairs: each source one of ``names``, each alias a name given nowhere else."""
    if not isinstance(value, list) or len(value) > limits.max_tensors:
        raise ProtocolError("aliases", f"expected a list of at most {limits.max_tensors} pairs", "type")
    known, pairs = set(names), []
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ProtocolError(f"aliases[{i}]", "expected [alias, source]", "type")
        alias, source = _str_list(f"aliases[{i}]", pair, limits, 2)
        if source not in names or alias in known:
            raise ProtocolError(f"aliases[{i}]", f"{alias!r} must be a new name and {source!r} one of the tensors'",
                                "bounds")
        known.add(alias)
        pairs.append([alias, source])
    return pairs


def chunk_checksum(data) -> int:
    """XXH3-64 of a weights chunk: it runs at memory speed, several times faster than CRC-32, and a corrupted
    chunk passes with odds of 2^-64."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass
class WeightsChunk(Message):
    """Learner → worker: chunk ``index`` of ``version``; the bytes travel as the second frame (``data``),
    ``checksum`` (``chunk_checksum``) guards the chunk; the header's byte count and chunk count guard the whole."""

    kind: ClassVar[str] = "weights_chunk"
    version: int
    index: int
    checksum: int
    data: memoryview | bytes = b""

    data_frames: ClassVar[int] = 1

    def to_wire(self):
        return {"version": self.version, "index": self.index, "checksum": self.checksum}

    def payload(self) -> list:
        return [self.data]

    @classmethod
    def from_wire(cls, body, limits, data=()):
        chunk = data[0]
        if chunk.nbytes > limits.max_chunk_bytes:
            raise ProtocolError("data", f"{chunk.nbytes} bytes exceed {limits.max_chunk_bytes}", "too_large")
        checksum = _int("checksum", body["checksum"], 0, 2**64 - 1)
        if chunk_checksum(chunk) != checksum:
            raise ProtocolError("data", "checksum mismatch: the chunk was corrupted in transit", "checksum")
        return cls(version=_int("version", body["version"], 0, _INT32_MAX),
                   index=_int("index", body["index"], 0, _INT32_MAX), checksum=checksum, data=chunk)


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
        return cls(sender_id=_ident("sender_id", body["sender_id"], limits), reason=reason)


MESSAGES: dict[str, type[Message]] = {
    cls.kind: cls
    for cls in (Hello, Ready, Heartbeat, Trajectory, TrajectoryBatch, Ack, WeightsNotice, WeightsRequest, WeightsHeader,
                WeightsChunk, Bye)
}

# wire dtype name → (numpy dtype, bytes per element); bfloat16 travels as raw 2-byte words
TENSOR_DTYPES = {
    "float32": ("<f4", 4), "float16": ("<f2", 2), "bfloat16": ("<u2", 2), "float64": ("<f8", 8),
    "int64": ("<i8", 8), "int32": ("<i4", 4), "int8": ("i1", 1), "uint8": ("u1", 1), "bool": ("u1", 1),
}


# -- the trajectory contract ----------------------------------------------------------------------

# The lowest behaviour log-prob a learner takes (`TrajectoryContract.min_logprob`). A sampler draws a token of
# log-prob below -50 with probability < V·e^-50 (< 2e-16 for a vocabulary of V = 10^6), so no honest value lies
# below it; and it keeps importance weights finite in float32: exp(log p − log q) ≤ e^50 ≈ 5e21 per token, and
# GEPO's group weight likewise (its log-denominator lies between the group's lowest and highest mean log q),
# where exp overflows past 88.7. A floor of -1e4 would not: exp(1e4) is inf.
MIN_LOGPROB = -50.0


@dataclass(frozen=True)
class BatchExtremes:
    """What a `TrajectoryContract` bounds, reduced over a whole batch (or one trajectory): one number per bound.
    Token ids are -1 and versions (0, -1) for empty arrays."""

    prompt_token_max: int
    completion_token_max: int
    logprob_min: float
    version_min: int
    version_max: int
    sequence_len_max: int  # prompt + completion tokens
    group_size_max: int

    @classmethod
    def of(cls, trajectories: list[Trajectory]) -> "BatchExtremes":
        """The extremes of ``trajectories`` (one reduction per array per trajectory)."""
        def extreme(name: str, highest: bool, empty):
            arrays = [getattr(t, name) for t in trajectories]
            values = [(a.max() if highest else a.min()).item() for a in arrays if len(a)]
            return (max if highest else min)(values, default=empty)

        return cls(extreme("prompt_tokens", True, -1), extreme("completion_tokens", True, -1),
                   extreme("behaviour_logprobs", False, 0.0), extreme("policy_versions", False, 0),
                   extreme("policy_versions", True, -1),
                   max((len(t.prompt_tokens) + len(t.completion_tokens) for t in trajectories), default=0),
                   max((t.group_size for t in trajectories), default=0))


@dataclass(frozen=True)
class Breach:
    """Trajectory ``index`` of a batch breaks its contract: ``reason`` is a short tag, ``message`` names the
    field, the value and the bound."""

    index: int
    reason: str
    message: str


@dataclass(frozen=True)
class TrajectoryContract:
    """What a trajectory must satisfy before it may reach the learner's model (docs/RELIABILITY.md). The
    decoder checks that a frame is well formed; this checks that it fits this learner:

    - ``policy_versions``: every entry in [0, newest version published] (`version_ahead`, `version_negative`);
    - ``prompt_tokens``, ``completion_tokens``: ids < ``vocab_size``, the rows of the model's input embedding
      (`token_out_of_vocab`);
    - prompt + completion ≤ ``max_sequence_len``, the model's context (`too_long`);
    - ``behaviour_logprobs`` ≥ ``min_logprob``, a floor that keeps the loss finite (`logprob_below_floor`;
      see `MIN_LOGPROB`);
    - ``group_size`` ≤ ``group_size`` (None: any), the completions sampled per prompt: a worker leaves out empty
      completions, so a group may be smaller, never larger (`group_too_large`).
    """

    vocab_size: int
    max_sequence_len: int
    min_logprob: float = MIN_LOGPROB
    group_size: int | None = None

    _SETTINGS: ClassVar[tuple[str, ...]] = ("vocab_size", "max_sequence_len", "min_logprob", "group_size")

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_sequence_len", "group_size"):
            value = getattr(self, name)
            if name == "group_size" and value is None:
                continue  # any group size
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise HeteroRLError(f"TrajectoryContract.{name} = {value!r}: must be a positive integer")
        if not (isinstance(self.min_logprob, (int, float)) and -math.inf < self.min_logprob < 0):
            raise HeteroRLError(f"TrajectoryContract.min_logprob = {self.min_logprob!r}: must be finite and < 0")

    def breaches(self, batch: TrajectoryBatch, newest_version: int) -> list[Breach]:
        """The trajectories of ``batch`` that break the contract, each with the first bound it breaks; [] when
        none does. The common case costs a few comparisons: the batch's extremes (reduced once, by the decoder
        for a received batch) are checked first, and each trajectory only when some bound fails."""
        if self._breach(batch.extremes(), newest_version) is None:
            return []
        found = []
        for index, traj in enumerate(batch.trajectories):
            breach = self._breach(BatchExtremes.of([traj]), newest_version)
            if breach is not None:
                found.append(Breach(index, *breach))
        return found

    def _breach(self, x: BatchExtremes, newest_version: int) -> tuple[str, str] | None:
        """(reason, message) of the first bound ``x`` breaks, or None."""
        if x.version_max > newest_version:
            return "version_ahead", (f"policy_versions holds version {x.version_max} > {newest_version}, the newest "
                                     "the learner has published")
        if x.version_min < 0:
            return "version_negative", f"policy_versions holds version {x.version_min} < 0"
        for name, top in (("prompt_tokens", x.prompt_token_max), ("completion_tokens", x.completion_token_max)):
            if top >= self.vocab_size:
                return "token_out_of_vocab", f"{name} holds token id {top} >= vocab_size {self.vocab_size}"
        if x.sequence_len_max > self.max_sequence_len:
            return "too_long", (f"prompt_tokens + completion_tokens = {x.sequence_len_max} tokens > max_sequence_len "
                                f"{self.max_sequence_len}")
        if x.logprob_min < self.min_logprob:
            return "logprob_below_floor", (f"behaviour_logprobs holds {x.logprob_min:g} < min_logprob "
                                           f"{self.min_logprob:g}")
        if self.group_size is not None and x.group_size_max > self.group_size:
            return "group_too_large", f"group_size {x.group_size_max} > {self.group_size} completions per prompt"
        return None

    def settings(self) -> dict[str, Any]:
        """The contract as ``ready`` settings (``contract.<field>``), so a worker can keep it."""
        return {f"contract.{name}": getattr(self, name) for name in self._SETTINGS}

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> "TrajectoryContract | None":
        """The contract a learner stated in its ``ready`` settings; None when it stated none."""
        if "contract.vocab_size" not in settings:
            return None
        return cls(**{name: settings.get(f"contract.{name}") for name in cls._SETTINGS})


# -- framing --------------------------------------------------------------------------------------

def encode(message: Message, out: np.ndarray | None = None) -> list:
    """The frames of ``message``: a msgpack header, then its raw data frames (weight chunk, trajectory arrays);
    a trajectory batch writes its arrays into ``out`` when given (see ``TrajectoryBatch.payload``)."""
    header = {"v": SCHEMA_VERSION, "kind": message.kind, **message.to_wire()}
    data = message.payload() if out is None else message.payload(out)
    return [msgpack.packb(header, use_bin_type=True), *data]


def decode(frames: list, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and decode the frames of one message (bytes, memoryviews or zmq Frames).

    Raises ProtocolError naming the field for anything malformed; never
    anything else for any input.
    """
    try:
        return _decode(frames, limits)
    except ProtocolError:
        raise
    except Exception as exc:  # a validator missed a case: still a refused frame, never a crash
        raise ProtocolError("frame", f"undecodable ({type(exc).__name__}: {str(exc)[:120]})", "malformed") from None


def _buffer(frame) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


def _decode(frames: list, limits: Limits) -> Message:
    if not frames:
        raise ProtocolError("frame", "no frames", "malformed")
    head = _buffer(frames[0])
    if head.nbytes > limits.max_header_bytes:
        raise ProtocolError("frame", f"header of {head.nbytes} bytes exceeds {limits.max_header_bytes}", "too_large")
    try:
        body = msgpack.unpackb(head, raw=False, strict_map_key=True, max_bin_len=limits.max_header_bytes,
                               max_str_len=limits.max_header_bytes, max_array_len=limits.max_tensors + 16,
                               max_map_len=limits.max_settings + 64, max_ext_len=0)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, UnicodeDecodeError) as exc:
        raise ProtocolError("frame", f"not a msgpack message ({type(exc).__name__})", "malformed") from None
    if not isinstance(body, dict):
        raise ProtocolError("frame", f"expected a msgpack map, got {type(body).__name__}", "malformed")
    version = body.pop("v", None)
    if version != SCHEMA_VERSION:
        raise ProtocolError("v", f"schema version {version!r} is not {SCHEMA_VERSION}; upgrade the older side",
                            "schema_version")
    kind = body.pop("kind", None)
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError("kind", f"unknown message kind {str(kind)[:40]!r}; known: {', '.join(MESSAGES)}",
                            "unknown_kind")
    expected = _wire_fields(cls)
    if body.keys() != expected:
        missing = sorted(expected - body.keys() - cls.optional_fields)
        if missing:
            raise ProtocolError(missing[0], f"missing from {kind} message", "missing_field")
        unknown = sorted(str(k) for k in body.keys() - expected)
        if unknown:
            raise ProtocolError(unknown[0][:40], f"is not a field of {kind} (schema v{SCHEMA_VERSION})",
                                "unknown_field")
    if len(frames) != 1 + cls.data_frames:
        raise ProtocolError("frame", f"{kind} takes {1 + cls.data_frames} frame(s), got {len(frames)}", "malformed")
    return cls.from_wire(body, limits, [_buffer(f) for f in frames[1:]])


_WIRE_FIELDS: dict[type, frozenset] = {}


def _wire_fields(cls: type[Message]) -> frozenset:
    """The header keys of ``cls`` (cached: computed once per message class)."""
    if cls not in _WIRE_FIELDS:
        names = {f.name for f in fields(cls)} - {"data", "trajectories"}
        if cls is TrajectoryBatch:
            names = set(TrajectoryBatch._SCALARS) | {"prompt_len", "completion_len"}
        _WIRE_FIELDS[cls] = frozenset(names)
    return _WIRE_FIELDS[cls]
