"""Packing a state dict into one contiguous buffer for the weights channel, and back.

Tensors are laid out back to back in name order as raw little-endian bytes;
the layout (names, dtypes, shapes) travels in a :class:`WeightsHeader`; each
chunk carries its XXH3-64 checksum. The receiver checks each chunk as it
arrives and rebuilds tensors as views of the reassembled buffer (no second copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from heterorl.policies.storage import storage_key
from heterorl.transport.protocol import TENSOR_DTYPES, ProtocolError, WeightsHeader, chunk_checksum

_TORCH_DTYPES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64",
    torch.int64: "int64", torch.int32: "int32", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool",
}
_FROM_WIRE = {v: k for k, v in _TORCH_DTYPES.items()}


WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_FROM_PARAMETERS = 10_000_000  # weights_dtype auto: bf16 from this many parameters, float32 below


def wire_dtype(name: str, parameters: int) -> torch.dtype:
    """The dtype workers receive and sample with (``runtime.weights_dtype``): ``auto`` is bfloat16 for models of
    at least 10M parameters (where the bytes on the wire matter) and float32 below."""
    if name == "auto":
        return torch.bfloat16 if parameters >= BF16_FROM_PARAMETERS else torch.float32
    if name not in WIRE_DTYPES:
        raise ValueError(f"runtime.weights_dtype {name!r} is not auto or one of {sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def wire_dtype_for(weights_dtype: str, weights: torch.nn.Module | dict[str, torch.Tensor]) -> torch.dtype:
    """The one rule for the dtype ``weights`` travel in (`wire_dtype` of ``runtime.weights_dtype``), whoever asks:
    the learner publishing, a worker loading its policy, the simulation, a benchmark. ``weights``: a model (its
    parameters are counted) or the state dict that is sent (its tensors are counted: a LoRA adapter alone is
    small, so under ``auto`` it travels in float32 while its base samples in bfloat16)."""
    tensors = weights.parameters() if isinstance(weights, torch.nn.Module) else weights.values()
    return wire_dtype(weights_dtype, sum(t.numel() for t in tensors))


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype`` ("bfloat16"), as weights headers and run summaries spell it."""
    return _TORCH_DTYPES[dtype]


@dataclass
class PackedWeights:
    """One published version: its header and its buffer (sliced into chunks without copying)."""

    header: WeightsHeader
    buffer: np.ndarray  # uint8
    checksums: dict = field(default_factory=dict)  # chunk index → XXH3-64, computed on first request
    published_at: float = 0.0  # when the learner published it (its wall clock; 0: not said)

    def chunk(self, index: int) -> memoryview:
        start = index * self.header.chunk_bytes
        return memoryview(self.buffer[start:start + self.header.chunk_bytes])

    def chunk_checksum(self, index: int) -> int:
        """The chunk's checksum, computed once (lazily, so checksumming overlaps the transfer)."""
        if index not in self.checksums:
            self.checksums[index] = chunk_checksum(self.chunk(index))
        return self.checksums[index]


def pack_state_dict(state: dict[str, torch.Tensor], version: int, chunk_bytes: int = 4 * 2**20,
                    out: np.ndarray | None = None, dtype: torch.dtype | None = None) -> PackedWeights:
    """Copy ``state`` (CPU or GPU tensors) once into one buffer and describe it. ``out``: a uint8 array to
    reuse as that buffer when its size is exactly right (a retired version's: no fresh pages to fault in).
    ``dtype``: cast floating-point tensors to it (the workers' inference dtype; round to nearest even), in the
    same pass as the copy. Tensors that are the same bytes (tied embeddings) travel once: the header names the
    others as ``aliases``."""
    names, tensors, targets, aliases, seen = [], [], [], [], {}
    for name in sorted(state):
        tensor = state[name].detach()
        key = storage_key(tensor)
        if key is not None and key in seen:
            aliases.append([name, seen[key]])
            continue
        seen[key] = name
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        if target not in _TORCH_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which the weights channel cannot carry; "
                             f"cast it to one of {sorted(_TORCH_DTYPES.values())}")
        names.append(name)
        tensors.append(tensor)
        targets.append(target)
    sizes = [t.numel() * target.itemsize for t, target in zip(tensors, targets)]
    reuse = out is not None and out.dtype == np.uint8 and out.ndim == 1 and len(out) == sum(sizes)
    flat = torch.from_numpy(out) if reuse else torch.empty(sum(sizes), dtype=torch.uint8)
    offset = 0
    for tensor, target, size in zip(tensors, targets, sizes):
        if size and offset % target.itemsize == 0:  # cast and copied in one pass, straight from its device
            flat[offset:offset + size].view(target).copy_(tensor.reshape(-1))
        elif size:  # (an element that would straddle its alignment: cast first, then copy the bytes)
            flat[offset:offset + size].copy_(tensor.to(target).contiguous().reshape(-1).view(torch.uint8))
        offset += size
    buffer = flat.numpy()
    header = WeightsHeader(version=version, names=names, dtypes=[_TORCH_DTYPES[t] for t in targets],
                           shapes=[list(t.shape) for t in tensors], total_bytes=len(buffer), chunk_bytes=chunk_bytes,
                           num_chunks=-(-len(buffer) // chunk_bytes), aliases=aliases)
    return PackedWeights(header, buffer)


def unpack_state_dict(header: WeightsHeader, buffer) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffer`` (a writable uint8 array or bytearray holding every chunk, each already
    checked against its checksum on arrival)."""
    if len(buffer) != header.total_bytes:
        raise ProtocolError("total_bytes", f"received {len(buffer)} bytes, header says {header.total_bytes}",
                            "length_mismatch")
    raw = np.frombuffer(buffer, dtype=np.uint8)
    if not raw.flags.writeable:
        raw = raw.copy()  # torch wants a writable buffer
    state, offset = {}, 0
    for name, dtype, shape in zip(header.names, header.dtypes, header.shapes):
        nbytes = TENSOR_DTYPES[dtype][1] * math.prod(shape)
        piece = torch.from_numpy(raw[offset:offset + nbytes])
        state[name] = piece.view(_FROM_WIRE[dtype]).reshape(shape)
        offset += nbytes
    for alias, source in header.aliases:  # tied weights: the same tensor under both names
        state[alias] = state[source]
    return state
