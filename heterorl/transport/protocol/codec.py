"""Framing: a message is a msgpack header (``"v"``, the schema version, and ``"kind"``, then its fields)
followed by its raw data frames. `encode` writes one; `decode` reads one back and trusts nothing: schema
version, kind, missing and unknown fields, frame count, then the kind's own checks (``from_wire``). Anything
wrong raises `ProtocolError`, and nothing else escapes it, whatever the bytes."""

from __future__ import annotations

import msgpack
import numpy as np

from heterorl.transport.protocol.control import Ack, Bye, Heartbeat, Hello, Ready
from heterorl.transport.protocol.fields import (
    DEFAULT_LIMITS,
    Limits,
    Message,
    ProtocolError,
)
from heterorl.transport.protocol.trajectories import Trajectory, TrajectoryBatch
from heterorl.transport.protocol.weights import (
    WeightsChunk,
    WeightsHeader,
    WeightsNotice,
    WeightsRequest,
)

SCHEMA_VERSION = 3  # 2: weights chunks carry an XXH3-64 checksum instead of a CRC-32; 3: one data frame per batch

MESSAGES: dict[str, type[Message]] = {
    cls.kind: cls
    for cls in (Hello, Ready, Heartbeat, Trajectory, TrajectoryBatch, Ack, WeightsNotice, WeightsRequest, WeightsHeader,
                WeightsChunk, Bye)
}
_HEADER_FIELDS = {cls: cls.header_fields() for cls in MESSAGES.values()}


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
    expected = _HEADER_FIELDS[cls]
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
