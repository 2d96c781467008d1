"""The protobuf messages of the Tinker API that `heterorl serve` reads and writes: a ``ForwardBackwardRequest``
read, a ``ForwardBackwardOutput`` and a ``SampleResponse`` written (field numbers and types of the SDK's
``tinker_public.proto``). Encoded by hand: the wire format is small, and the service then needs neither the SDK nor
a second registration of its schema.

Untrusted bytes: every read is bounded by the bytes given (a length that runs past the end is an error), nesting
is fixed by the schema, and a wrong wire type is refused, so a body can cost no more than its own size.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5
DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}  # (DType enum → numpy; 4, bfloat16, is widened on read)
FLOAT32, INT64 = 1, 2
STOP, LENGTH_STOP = 0, 1  # StopReason
MAX_DENSE_VALUES = 1 << 24  # a sparse tensor made dense holds at most this many values (64 MiB of float32)


class ProtobufError(ValueError):
    """Bytes that are not the message they claim to be."""


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ProtobufError("a varint runs past the end of the message")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def fields(data: bytes) -> list[tuple[int, int, object]]:
    """[(field number, wire type, value)] of one message: an int for varints and fixed numbers, bytes for
    length-delimited fields (strings, nested messages, packed arrays)."""
    out, at = [], 0
    while at < len(data):
        key, at = _varint(data, at)
        number, kind = key >> 3, key & 7
        if kind == VARINT:
            value, at = _varint(data, at)
        elif kind == FIXED64:
            if at + 8 > len(data):
                raise ProtobufError("a 64-bit field runs past the end of the message")
            value, at = data[at:at + 8], at + 8
        elif kind == LENGTH:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise ProtobufError(f"field {number} declares {size} bytes past the end of the message")
            value, at = data[at:at + size], at + size
        elif kind == FIXED32:
            if at + 4 > len(data):
                raise ProtobufError("a 32-bit field runs past the end of the message")
            value, at = data[at:at + 4], at + 4
        else:
            raise ProtobufError(f"field {number} has wire type {kind}, which this message does not use")
        out.append((number, kind, value))
    return out


def _expect(kind: int, wanted: int, what: str) -> None:
    if kind != wanted:
        raise ProtobufError(f"{what} has the wrong wire type ({kind}, expected {wanted})")


def _text(value, kind: int, what: str) -> str:
    _expect(kind, LENGTH, what)
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        raise ProtobufError(f"{what} is not UTF-8") from None


def _map_entry(data: bytes, what: str) -> tuple[str, object, int]:
    key, value, kind = "", b"", LENGTH
    for number, k, v in fields(data):
        if number == 1:
            key = _text(v, k, f"a key of {what}")
        elif number == 2:
            value, kind = v, k
    return key, value, kind


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def read_tensor(data: bytes, what: str) -> np.ndarray:
    """A ``TensorData`` as sent, as a numpy array (a sparse CSR one made dense)."""
    dense, sparse, dtype, shape = None, None, 0, []
    for number, kind, value in fields(data):
        if number == 1:
            _expect(kind, LENGTH, what)
            dense = value
        elif number == 2:
            _expect(kind, LENGTH, what)
            sparse = value
        elif number == 3:
            _expect(kind, VARINT, what)
            dtype = value
        elif number == 4:
            if kind == LENGTH:  # packed
                at = 0
                while at < len(value):
                    n, at = _varint(value, at)
                    shape.append(_signed(n))
            else:
                _expect(kind, VARINT, what)
                shape.append(_signed(value))
    if dtype == 4:  # bfloat16: the upper half of a float32
        np_type = np.float32
    elif dtype in DTYPES:
        np_type = DTYPES[dtype]
    else:
        raise ProtobufError(f"{what}: dtype {dtype} is not one of float32, int64, int32, bfloat16")
    if any(n < 0 for n in shape) or len(shape) > 2:
        raise ProtobufError(f"{what}: shape {shape} is not 1-D or 2-D")
    if sparse is not None:
        return _read_csr(sparse, np_type, shape, what)
    raw = bytes(dense or b"")
    if dtype == 4:
        if len(raw) % 2:
            raise ProtobufError(f"{what}: {len(raw)} bytes is not a whole number of bfloat16 values")
        array = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        itemsize = np.dtype(np_type).itemsize
        if len(raw) % itemsize:
            raise ProtobufError(f"{what}: {len(raw)} bytes is not a whole number of {np.dtype(np_type).name}")
        array = np.frombuffer(raw, dtype=np.dtype(np_type).newbyteorder("<")).astype(np_type)
    if shape:
        if math.prod(shape) != array.size:
            raise ProtobufError(f"{what}: shape {shape} does not hold {array.size} values")
        array = array.reshape(shape)
    return array


def _read_csr(data: bytes, np_type, shape: list[int], what: str) -> np.ndarray:
    if len(shape) != 2:
        raise ProtobufError(f"{what}: a sparse tensor needs a 2-D shape, got {shape}")
    if shape[0] * shape[1] > MAX_DENSE_VALUES:  # (checked before the dense array is allocated)
        raise ProtobufError(f"{what}: a sparse tensor of shape {shape} is over {MAX_DENSE_VALUES:,} values dense")
    parts = {1: b"", 2: b"", 3: b""}
    for number, kind, value in fields(data):
        if number in parts:
            _expect(kind, LENGTH, what)
            parts[number] = bytes(value)
    values = np.frombuffer(parts[1], dtype=np.dtype(np_type).newbyteorder("<"))
    rows = np.frombuffer(parts[2], dtype="<i8")
    cols = np.frombuffer(parts[3], dtype="<i8")
    if (len(rows) != shape[0] + 1 or len(cols) != len(values) or rows[0] != 0 or rows[-1] != len(values)
            or np.any(np.diff(rows) < 0) or np.any((cols < 0) | (cols >= shape[1]))):
        raise ProtobufError(f"{what}: the sparse (CSR) indices do not fit its shape {shape}")
    out = np.zeros(shape, dtype=np_type)
    row_of = np.repeat(np.arange(shape[0]), np.diff(rows))
    out[row_of, cols] = values
    return out


@dataclass
class Datum:
    """One Tinker datum: the tokens of its model input, and its loss inputs by name."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    data: list[Datum] = field(default_factory=list)
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


def read_forward_backward(data: bytes, max_datums: int) -> ForwardBackwardRequest:
    """A ``ForwardBackwardRequest``; `ProtobufError` naming what is wrong (a chunk other than text, too many datums,
    bytes that are not this message)."""
    request, v1 = ForwardBackwardRequest(), {}
    for number, kind, value in fields(data):
        if number == 1:
            request.model_id = _text(value, kind, "model_id")
        elif number == 2:
            _expect(kind, VARINT, "seq_id")
            request.seq_id = _signed(value) if value >= 1 << 31 else value
        elif number == 3:
            _expect(kind, LENGTH, "a datum")
            if len(request.data) >= max_datums:
                raise ProtobufError(f"more than {max_datums} datums in one request")
            request.data.append(_read_datum(value, len(request.data)))
        elif number == 4:
            request.loss_fn = _text(value, kind, "loss_fn")
        elif number == 5:
            _expect(kind, LENGTH, "loss_fn_config")
            key, number_bytes, k = _map_entry(value, "loss_fn_config")
            _expect(k, FIXED64, f"loss_fn_config[{key}]")
            v1[key] = struct.unpack("<d", number_bytes)[0]
        elif number == 6:
            _expect(kind, VARINT, "forward_only")
            request.forward_only = bool(value)
        elif number == 7:
            _expect(kind, LENGTH, "loss_fn_config_v2")
            key, entry, k = _map_entry(value, "loss_fn_config_v2")
            for n, kk, vv in fields(bytes(entry)) if k == LENGTH else []:
                if n == 1:
                    _expect(kk, FIXED64, f"loss_fn_config_v2[{key}]")
                    request.loss_fn_config[key] = struct.unpack("<d", vv)[0]
                elif n == 2:
                    request.loss_fn_config[key] = _text(vv, kk, f"loss_fn_config_v2[{key}]")
    for key, value in v1.items():  # (v2 holds every value v1 does, and strings too)
        request.loss_fn_config.setdefault(key, value)
    return request


def _read_datum(data: bytes, index: int) -> Datum:
    datum = Datum(tokens=[])
    for number, kind, value in fields(data):
        if number == 1:
            _expect(kind, LENGTH, f"datum {index}'s model_input")
            for n, k, v in fields(bytes(value)):
                if n != 1:
                    name = {2: "an image", 3: "a dmel"}.get(n, f"field {n}")
                    raise ProtobufError(f"datum {index}: its model_input has {name} chunk; heterorl trains on "
                                        "text tokens only (encoded_text chunks)")
                _expect(k, LENGTH, f"datum {index}'s text chunk")
                for nn, kk, vv in fields(bytes(v)):
                    if nn == 1:
                        _expect(kk, LENGTH, f"datum {index}'s tokens")
                        if len(vv) % 4:
                            raise ProtobufError(f"datum {index}: its tokens are not int32 values")
                        datum.tokens += np.frombuffer(bytes(vv), dtype="<i4").tolist()
        elif number == 2:
            _expect(kind, LENGTH, f"datum {index}'s loss_fn_inputs")
            key, value_bytes, k = _map_entry(bytes(value), f"datum {index}'s loss_fn_inputs")
            _expect(k, LENGTH, f"datum {index}'s loss_fn_inputs[{key}]")
            datum.inputs[key] = read_tensor(bytes(value_bytes), f"datum {index}'s loss_fn_inputs[{key}]")
    return datum


# -- writing ---------------------------------------------------------------------------------------------------

def _put_varint(out: bytearray, value: int) -> None:
    value &= (1 << 64) - 1
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _put(out: bytearray, number: int, kind: int, value) -> None:
    _put_varint(out, number << 3 | kind)
    if kind == VARINT:
        _put_varint(out, int(value))
    elif kind == FIXED64:
        out += struct.pack("<d", float(value))
    else:
        data = value.encode() if isinstance(value, str) else bytes(value)
        _put_varint(out, len(data))
        out += data


def _put_double_map(out: bytearray, number: int, values: dict[str, float]) -> None:
    for key, value in values.items():
        entry = bytearray()
        _put(entry, 1, LENGTH, key)
        _put(entry, 2, FIXED64, value)
        _put(out, number, LENGTH, entry)


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: one ``ArrayRecord`` whose field ``logprobs`` holds each datum's float32
    log-probs (concatenated, with byte offsets), and ``metrics`` ("name:reduction" → value)."""
    arrays = [np.ascontiguousarray(a, dtype="<f4") for a in logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
    batched = bytearray()
    _put(batched, 1, LENGTH, b"".join(a.tobytes() for a in arrays))
    _put(batched, 2, LENGTH, offsets.tobytes())
    _put(batched, 3, VARINT, FLOAT32)
    entry = bytearray()
    _put(entry, 1, LENGTH, "logprobs")
    _put(entry, 2, LENGTH, batched)
    record = bytearray()
    _put(record, 1, LENGTH, "ArrayRecord")
    _put(record, 2, LENGTH, entry)
    _put(record, 3, VARINT, len(arrays))
    out = bytearray()
    _put(out, 1, LENGTH, "ArrayRecord")
    _put(out, 2, LENGTH, record)
    _put_double_map(out, 3, metrics)
    return bytes(out)


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # a stop token, stop string or end of sequence ended it (else: max_tokens)


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None = None) -> bytes:
    """A ``SampleResponse``: each sequence's tokens (int32), log-probs (float32) and stop reason; the prompt's
    log-probs (float32, NaN for the first token) when asked for."""
    out = bytearray()
    for sequence in sequences:
        entry = bytearray()
        _put(entry, 1, VARINT, STOP if sequence.stopped else LENGTH_STOP)
        _put(entry, 2, LENGTH, np.asarray(sequence.tokens, dtype="<i4").tobytes())
        _put(entry, 3, LENGTH, np.asarray(sequence.logprobs, dtype="<f4").tobytes())
        _put(out, 1, LENGTH, entry)
    if prompt_logprobs is not None:
        _put(out, 2, LENGTH, np.asarray(prompt_logprobs, dtype="<f4").tobytes())
    return bytes(out)
