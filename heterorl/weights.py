"""Packing a state dict into one contiguous buffer for the weights channel, and back.

Tensors are laid out back to back in name order as raw little-endian bytes;
the layout (names, dtypes, shapes) travels in a :class:`WeightsHeader` with the
buffer's SHA-256. The receiver rebuilds tensors as views of the reassembled
buffer (no second copy).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from heterorl.protocol import TENSOR_DTYPES, ProtocolError, WeightsHeader

_TORCH_DTYPES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64",
    torch.int64: "int64", torch.int32: "int32", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool",
}
_FROM_WIRE = {v: k for k, v in _TORCH_DTYPES.items()}


@dataclass
class PackedWeights:
    """One published version: its header and its buffer (``bytes``; sliced into chunks without copying)."""

    header: WeightsHeader
    buffer: bytes

    def chunk(self, index: int) -> memoryview:
        start = index * self.header.chunk_bytes
        return memoryview(self.buffer)[start:start + self.header.chunk_bytes]


def pack_state_dict(state: dict[str, torch.Tensor], version: int, chunk_bytes: int = 4 * 2**20) -> PackedWeights:
    """Copy ``state`` (CPU or GPU tensors) into one buffer and describe it."""
    names = sorted(state)
    dtypes, shapes, parts = [], [], []
    for name in names:
        tensor = state[name].detach()
        if tensor.dtype not in _TORCH_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which the weights channel cannot carry; "
                             f"cast it to one of {sorted(_TORCH_DTYPES.values())}")
        tensor = tensor.to("cpu").contiguous()
        dtypes.append(_TORCH_DTYPES[tensor.dtype])
        shapes.append(list(tensor.shape))
        # view as bytes without a numpy dtype for bfloat16
        parts.append(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    buffer = b"".join(parts)
    header = WeightsHeader(version=version, names=names, dtypes=dtypes, shapes=shapes, total_bytes=len(buffer),
                           chunk_bytes=chunk_bytes, num_chunks=-(-len(buffer) // chunk_bytes),
                           sha256=hashlib.sha256(buffer).hexdigest())
    return PackedWeights(header, buffer)


def unpack_state_dict(header: WeightsHeader, buffer: bytearray | bytes) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffer`` (checked against the header's SHA-256 first)."""
    if len(buffer) != header.total_bytes:
        raise ProtocolError("total_bytes", f"received {len(buffer)} bytes, header says {header.total_bytes}",
                            "length_mismatch")
    if hashlib.sha256(buffer).hexdigest() != header.sha256:
        raise ProtocolError("sha256", f"weights version {header.version} failed its checksum; fetch it again",
                            "checksum")
    raw = np.frombuffer(buffer, dtype=np.uint8)
    if not raw.flags.writeable:
        raw = raw.copy()  # torch wants a writable buffer; a bytearray avoids this copy
    state, offset = {}, 0
    for name, dtype, shape in zip(header.names, header.dtypes, header.shapes):
        nbytes = TENSOR_DTYPES[dtype][1] * math.prod(shape)
        piece = torch.from_numpy(raw[offset:offset + nbytes])
        state[name] = piece.view(_FROM_WIRE[dtype]).reshape(shape)
        offset += nbytes
    return state
