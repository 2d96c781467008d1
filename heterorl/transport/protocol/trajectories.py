"""Trajectories, worker → learner: one scored completion (`Trajectory`) and the batches workers send
(`TrajectoryBatch`: per-trajectory scalars as lists in the header, all arrays in one raw little-endian data
frame, checked with one vectorised pass per array for the whole batch), and the batch's `BatchExtremes`, what the
learner's `contract.TrajectoryContract` bounds."""

from __future__ import annotations

import itertools
import math
import operator
import re
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from heterorl.rollout.spans import MAX_ENV_SPANS, env_spans_problem, policy_token_mask
from heterorl.transport.protocol.fields import (
    ID_PATTERN,
    Limits,
    Message,
    ProtocolError,
    check_float,
    check_id,
    check_int,
    check_str,
    le_bytes,
    types_are,
    view_array,
)


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


@dataclass
class Trajectory(Message):
    """One scored completion of a prompt, stamped by the worker that sampled it.

    Arrays are numpy views: ``prompt_tokens`` / ``completion_tokens`` int32,
    ``behaviour_logprobs`` float32 (log q of each completion token),
    ``policy_versions`` int32 (the weights version that sampled each completion
    token; one trajectory may span a weight update). Timestamps are seconds on
    the worker's clock except ``received_at`` (learner's clock, set on receipt).

    ``env_spans``: in a multi-turn episode, where the environment's answers lie among the completion tokens, as
    flattened half-open ranges (heterorl.rollout.spans); they carry log-prob 0 and the version of the policy token
    before them, and are never trained. Empty for a single-turn completion (every token is the policy's).
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
    env_spans: tuple[int, ...] = ()

    optional_fields: ClassVar[frozenset] = frozenset({"env_spans"})  # single-turn senders may leave it out

    @property
    def key(self) -> str:
        """The trajectory's id in its sampler's namespace: ids are chosen by workers, so the learner tells one
        worker's ids from another's by this key (docs/RELIABILITY.md, "Ids"); `|` cannot occur in an id."""
        return f"{self.sampler_id}|{self.trajectory_id}"

    @property
    def group_key(self) -> str:
        """The group's id in its sampler's namespace (see `key`)."""
        return f"{self.sampler_id}|{self.group_id}"

    def policy_mask(self) -> np.ndarray:
        """(completion tokens,) bool: the tokens the policy sampled, the ones a loss trains on (every token of a
        single-turn completion; not the environment's answers of an episode)."""
        return policy_token_mask(self.env_spans, len(self.completion_tokens))

    @property
    def policy_token_count(self) -> int:
        """How many completion tokens the policy sampled (`policy_mask`'s count)."""
        return len(self.completion_tokens) - sum(self.env_spans[1::2]) + sum(self.env_spans[::2])

    def detach(self) -> None:
        """Copy the arrays out of the frame they view (a received trajectory's arrays view its message's data
        frame, which stays alive as long as one of them does): held apart from its message, it holds only its own
        bytes (`nbytes`)."""
        for name in ("prompt_tokens", "completion_tokens", "behaviour_logprobs", "policy_versions"):
            array = getattr(self, name)
            if array.base is not None:
                setattr(self, name, array.copy())

    def to_wire(self):
        body = super().to_wire()
        body["prompt_tokens"] = le_bytes(self.prompt_tokens, "<i4")
        body["completion_tokens"] = le_bytes(self.completion_tokens, "<i4")
        body["behaviour_logprobs"] = le_bytes(self.behaviour_logprobs, "<f4")
        body["policy_versions"] = le_bytes(self.policy_versions, "<i4")
        body["env_spans"] = list(self.env_spans)
        return body

    @classmethod
    def from_wire(cls, body, limits, data=()):
        prompt = view_array("prompt_tokens", body["prompt_tokens"], "<i4", limits.max_tokens)
        completion = view_array("completion_tokens", body["completion_tokens"], "<i4", limits.max_tokens)
        logprobs = view_array("behaviour_logprobs", body["behaviour_logprobs"], "<f4", limits.max_tokens)
        versions = view_array("policy_versions", body["policy_versions"], "<i4", limits.max_tokens)
        if len(prompt) == 0:
            raise ProtocolError("prompt_tokens", "is empty", "length")
        if len(completion) == 0:
            raise ProtocolError("completion_tokens", "is empty; drop empty completions on the worker", "length")
        for name, array in (("behaviour_logprobs", logprobs), ("policy_versions", versions)):
            if len(array) != len(completion):
                raise ProtocolError(name, f"has {len(array)} entries for {len(completion)} completion tokens",
                                    "length_mismatch")
        _check_token_arrays(prompt, completion, logprobs, versions, limits)
        start = check_float("generation_start", body["generation_start"])
        end = check_float("generation_end", body["generation_end"])
        if end < start:
            raise ProtocolError("generation_end", f"{end} is before generation_start {start}", "bounds")
        stop = check_str("stop_reason", body["stop_reason"], 32, ID_PATTERN)
        spans = _env_spans("env_spans", body.get("env_spans", []), len(completion))
        return cls(
            trajectory_id=check_id("trajectory_id", body["trajectory_id"], limits),
            group_id=check_id("group_id", body["group_id"], limits),
            prompt_id=check_id("prompt_id", body["prompt_id"], limits),
            sampler_id=check_id("sampler_id", body["sampler_id"], limits),
            group_size=check_int("group_size", body["group_size"], 1, 65_536),
            prompt_tokens=prompt,
            completion_tokens=completion,
            behaviour_logprobs=logprobs,
            policy_versions=versions,
            reward=check_float("reward", body["reward"], limits.max_abs_reward),
            generation_start=start,
            generation_end=end,
            sent_at=check_float("sent_at", body["sent_at"]),
            received_at=check_float("received_at", body["received_at"]),
            stop_reason=stop,
            env_spans=spans,
        )

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays (what holding it costs, to a few hundred bytes)."""
        return 4 * (len(self.prompt_tokens) + 3 * len(self.completion_tokens) + len(self.env_spans))


def _env_spans(name: str, value, completion_len: int) -> tuple[int, ...]:
    """A trajectory's ``env_spans``: a list of at most 2 × `MAX_ENV_SPANS` integers that mark environment spans
    of its completion (heterorl.rollout.spans); ProtocolError naming what is wrong otherwise."""
    if not isinstance(value, list):
        raise ProtocolError(name, f"expected a list of integers, got {type(value).__name__}", "type")
    if len(value) > 2 * MAX_ENV_SPANS:
        raise ProtocolError(name, f"{len(value)} entries exceed the limit {2 * MAX_ENV_SPANS}", "too_large")
    if not types_are(value, {int}):
        raise ProtocolError(name, "expected a list of integers", "type")
    problem = env_spans_problem(value, completion_len)
    if problem is not None:
        raise ProtocolError(name, problem, "bounds")
    return tuple(value)


@dataclass
class TrajectoryBatch(Message):
    """Worker → learner: the trajectories the transport sends together (what goes on the wire).

    Per-trajectory scalars travel as lists in the header, with ``prompt_len`` and ``completion_len`` (and
    ``env_spans``, one list per trajectory, only when some trajectory of the batch is multi-turn); the arrays of
    all trajectories travel in one raw little-endian data frame, four sections back to back: every prompt's tokens,
    every completion's tokens, behaviour log-probs and policy versions (each entry 4 bytes). They are decoded as
    views split by those lengths — one vectorised check per array for the whole batch, no copy. One frame, not
    four: each zero-copy frame costs the sender a tracker and the receiver a frame object.
    """

    kind: ClassVar[str] = "trajectories"
    data_frames: ClassVar[int] = 1
    optional_fields: ClassVar[frozenset] = frozenset({"env_spans"})  # absent: every trajectory is single-turn
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
        if any(t.env_spans for t in ts):
            body["env_spans"] = [list(t.env_spans) for t in ts]
        return body

    @classmethod
    def header_fields(cls) -> frozenset:
        return frozenset({*cls._SCALARS, "prompt_len", "completion_len", "env_spans"})

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
        spans = _batch_env_spans(body.get("env_spans"), completion_len)
        if _scalars_valid(body, limits):  # the common case, checked in bulk; else find and name the culprit
            return cls._decoded(_build_batch(body, prompt, completion, logprobs, versions, prompt_len,
                                             completion_len, spans), found, prompt_len, completion_len)
        trajectories = []
        p_off = c_off = 0
        for i in range(n):
            p_end, c_end = p_off + prompt_len[i], c_off + completion_len[i]
            start = check_float(f"generation_start[{i}]", body["generation_start"][i])
            end = check_float(f"generation_end[{i}]", body["generation_end"][i])
            if end < start:
                raise ProtocolError(f"generation_end[{i}]", f"{end} is before generation_start {start}", "bounds")
            trajectories.append(Trajectory(
                trajectory_id=check_id(f"trajectory_id[{i}]", ids[i], limits),
                group_id=check_id(f"group_id[{i}]", body["group_id"][i], limits),
                prompt_id=check_id(f"prompt_id[{i}]", body["prompt_id"][i], limits),
                sampler_id=check_id(f"sampler_id[{i}]", body["sampler_id"][i], limits),
                group_size=check_int(f"group_size[{i}]", body["group_size"][i], 1, 65_536),
                prompt_tokens=prompt[p_off:p_end], completion_tokens=completion[c_off:c_end],
                behaviour_logprobs=logprobs[c_off:c_end], policy_versions=versions[c_off:c_end],
                reward=check_float(f"reward[{i}]", body["reward"][i], limits.max_abs_reward),
                generation_start=start, generation_end=end,
                sent_at=check_float(f"sent_at[{i}]", body["sent_at"][i]),
                stop_reason=check_str(f"stop_reason[{i}]", body["stop_reason"][i], 32, ID_PATTERN),
                env_spans=spans[i],
            ))
            p_off, c_off = p_end, c_end
        return cls._decoded(trajectories, found, prompt_len, completion_len)

    @classmethod
    def _decoded(cls, trajectories: list[Trajectory], found: tuple, prompt_len: list[int],
                 completion_len: list[int]) -> TrajectoryBatch:
        """The decoded batch, keeping its extremes: what the array checks ``found``, the longest sequence and the
        largest group size."""
        batch = cls(trajectories)
        batch._extremes = BatchExtremes(*found, max(map(operator.add, prompt_len, completion_len)),
                                        max(t.group_size for t in trajectories))
        return batch


def max_trajectory_wire_bytes(max_sequence_len: int, limits: Limits) -> int:
    """The most bytes one trajectory of at most ``max_sequence_len`` tokens adds to a `TrajectoryBatch` message:
    its arrays (4 bytes per prompt token, 12 per completion token), its header entries (4 ids of
    ``limits.max_id_chars``, 6 numbers, a stop reason of 32) and its environment spans (`MAX_ENV_SPANS` ranges of
    integers of up to 5 bytes in msgpack)."""
    return 12 * max_sequence_len + 4 * (limits.max_id_chars + 5) + 6 * 9 + 40 + 2 * MAX_ENV_SPANS * 5 + 16


def _batch_env_spans(value, completion_len: list[int]) -> list[tuple[int, ...]]:
    """Each trajectory's ``env_spans`` from a batch header's list of lists (None: all single-turn)."""
    n = len(completion_len)
    if value is None:
        return [()] * n
    if not isinstance(value, list) or len(value) != n:
        raise ProtocolError("env_spans", f"expected a list of {n} entries (one per trajectory)", "length_mismatch")
    return [_env_spans(f"env_spans[{i}]", spans, length) if spans != [] else ()
            for i, (spans, length) in enumerate(zip(value, completion_len))]


def _lengths(name: str, values: list, max_tokens: int) -> list[int]:
    """Per-trajectory lengths in [1, max_tokens]: checked in bulk, the culprit named when one is wrong."""
    if types_are(values, {int}) and 1 <= min(values) and max(values) <= max_tokens:
        return values
    return [check_int(f"{name}[{i}]", v, 1, max_tokens) for i, v in enumerate(values)]


_IDS_PATTERN = re.compile(r"(?:[A-Za-z0-9_.:@/+=-]{1,128}\n)*")
_REASONS_PATTERN = re.compile(r"(?:[A-Za-z0-9_.:@/+=-]{1,32}\n)*")


def _scalars_valid(body: dict, limits: Limits) -> bool:
    """Bulk check of a batch's per-trajectory scalars; False sends the decoder down the per-entry path."""
    if limits.max_id_chars != 128:
        return False
    for name, pattern in (("trajectory_id", _IDS_PATTERN), ("group_id", _IDS_PATTERN), ("prompt_id", _IDS_PATTERN),
                          ("sampler_id", _IDS_PATTERN), ("stop_reason", _REASONS_PATTERN)):
        values = body[name] if name == "trajectory_id" else set(body[name])  # the others repeat within a batch
        if not types_are(values, {str}) or not pattern.fullmatch("\n".join(values) + "\n"):
            return False
    sizes = body["group_size"]
    if not types_are(sizes, {int}) or min(sizes) < 1 or max(sizes) > 65_536:
        return False
    rewards, starts, ends, sent = (body[name] for name in ("reward", "generation_start", "generation_end", "sent_at"))
    numbers = (*rewards, *starts, *ends, *sent)
    if not types_are(numbers, {float, int}):
        return False
    try:
        finite = math.isfinite(math.fsum(numbers))  # NaN or inf anywhere makes the sum NaN or inf
    except OverflowError:  # finite values too large to add up: the per-entry path judges each
        return False
    return finite and max(map(abs, rewards)) <= limits.max_abs_reward and all(map(operator.ge, ends, starts))


def _build_batch(body, prompt, completion, logprobs, versions, prompt_len, completion_len,
                 env_spans: list[tuple[int, ...]]) -> list[Trajectory]:
    p_ends = list(itertools.accumulate(prompt_len))
    c_ends = list(itertools.accumulate(completion_len))
    p_spans = list(zip([0, *p_ends[:-1]], p_ends))
    c_spans = list(zip([0, *c_ends[:-1]], c_ends))
    return [Trajectory(i, g, p, s, size, prompt[p0:p1], completion[c0:c1], logprobs[c0:c1], versions[c0:c1],
                       float(r), float(t0), float(t1), float(ts), 0.0, why, spans)
            for i, g, p, s, size, (p0, p1), (c0, c1), r, t0, t1, ts, why, spans in zip(
                body["trajectory_id"], body["group_id"], body["prompt_id"], body["sampler_id"], body["group_size"],
                p_spans, c_spans, body["reward"], body["generation_start"], body["generation_end"], body["sent_at"],
                body["stop_reason"], env_spans)]


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
    def of(cls, trajectories: list[Trajectory]) -> BatchExtremes:
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
