"""What every message is made of: the `Message` base, the decoder's bounds (`Limits`), its one error type
(`ProtocolError`) and the field checks each message's ``from_wire`` runs on what a peer sent.

Every check takes the field's name, so whatever is wrong is named in the error; each returns the value it
checked. Arrays travel as raw little-endian bytes (msgpack ``bin`` fields or data frames) and are read back as
numpy views, no copy (`view_array`); `le_bytes` writes them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from heterorl.errors import HeteroRLError

ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:@/+=-]+$")  # identifiers: worker, trajectory, group, prompt ids; tags
INT32_MAX = 2**31 - 1


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
    def header_fields(cls) -> frozenset:
        """The keys of this kind's header (what ``to_wire`` writes), which the decoder expects: its fields, unless
        the kind says otherwise."""
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def from_wire(cls, body: dict[str, Any], limits: Limits, data=()) -> Message:
        raise NotImplementedError


# -- field checks ---------------------------------------------------------------------------------

def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(name, f"expected an integer, got {type(value).__name__}", "type")
    if not lo <= value <= hi:
        raise ProtocolError(name, f"{value} is outside [{lo}, {hi}]", "bounds")
    return value


def check_float(name: str, value: Any, limit: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(name, f"expected a number, got {type(value).__name__}", "type")
    value = float(value)
    if not math.isfinite(value):
        raise ProtocolError(name, f"{value} is not finite", "not_finite")
    if abs(value) > limit:
        raise ProtocolError(name, f"|{value}| exceeds {limit}", "bounds")
    return value


def check_str(name: str, value: Any, max_chars: int, pattern: re.Pattern | None = None) -> str:
    if not isinstance(value, str):
        raise ProtocolError(name, f"expected a string, got {type(value).__name__}", "type")
    if not value or len(value) > max_chars:
        raise ProtocolError(name, f"length {len(value)} is outside [1, {max_chars}]", "bounds")
    if pattern is not None and not pattern.match(value):
        raise ProtocolError(name, f"{value[:40]!r} holds characters outside [A-Za-z0-9_.:@/+=-]", "bounds")
    return value


def check_id(name: str, value: Any, limits: Limits) -> str:
    return check_str(name, value, limits.max_id_chars, ID_PATTERN)


def types_are(values, allowed: set) -> bool:
    """Every value's exact type is in ``allowed`` (no subclasses, so no bool for int); one pass in C."""
    return set(map(type, values)) <= allowed


def check_str_list(name: str, value: Any, limits: Limits, max_len: int) -> list[str]:
    if not isinstance(value, list):
        raise ProtocolError(name, f"expected a list, got {type(value).__name__}", "type")
    if len(value) > max_len:
        raise ProtocolError(name, f"{len(value)} entries exceed the limit {max_len}", "too_large")
    if not value or (types_are(value, {str}) and 1 <= min(map(len, value)) and max(map(len, value)) <= 256):
        return value  # the common case, checked in bulk; else find and name the culprit
    return [check_str(f"{name}[{i}]", v, 256) for i, v in enumerate(value)]


def check_settings(name: str, value: Any, limits: Limits) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(name, f"expected a map, got {type(value).__name__}", "type")
    if len(value) > limits.max_settings:
        raise ProtocolError(name, f"{len(value)} entries exceed the limit {limits.max_settings}", "too_large")
    out = {}
    for key, item in value.items():
        check_str(f"{name} key", key, 256)
        if isinstance(item, float) and not math.isfinite(item):
            raise ProtocolError(f"{name}.{key}", "is not finite", "not_finite")
        if isinstance(item, str) and len(item) > 1_000_000:
            raise ProtocolError(f"{name}.{key}", "string exceeds 1,000,000 characters", "too_large")
        if item is not None and not isinstance(item, (str, int, float, bool)):
            raise ProtocolError(f"{name}.{key}", f"expected a scalar, got {type(item).__name__}", "type")
        out[key] = item
    return out


# -- raw little-endian arrays ---------------------------------------------------------------------

def view_array(name: str, value: Any, dtype: str, max_len: int) -> np.ndarray:
    """A read-only numpy view of a raw little-endian buffer (no copy)."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ProtocolError(name, f"expected raw bytes ({dtype}), got {type(value).__name__}", "type")
    itemsize = np.dtype(dtype).itemsize
    if len(value) % itemsize:
        raise ProtocolError(name, f"{len(value)} bytes is not a multiple of {itemsize} ({dtype})", "length")
    if len(value) // itemsize > max_len:
        raise ProtocolError(name, f"{len(value) // itemsize} elements exceed the limit {max_len}", "too_large")
    return np.frombuffer(value, dtype=dtype)


def le_bytes(array: np.ndarray, dtype: str) -> bytes:
    """``array`` as raw little-endian ``dtype`` bytes (what `view_array` reads back)."""
    return np.ascontiguousarray(array, dtype=dtype).tobytes()
