"""Weight deltas: version v as a patch of the bytes a worker already holds, lossless in the inference dtype.

The learner keeps float32 master weights and publishes their cast (``runtime.weights_dtype``, bf16 for large
models). In one RL step most elements of that cast do not change, so a version travels as one *step* per version
since the worker's: for each tensor that changed, the smallest of four encodings, measured:

- ``sparse``: the indices (uint32) of the elements whose bits changed, then their new values;
- ``sparse_zstd``: a zstd frame of the gaps between those indices (uint32), then the XORs of their bits;
- ``xor_zstd``: a zstd frame of the XOR of the old and new raw bits (zeros where nothing changed);
- ``full``: the new bytes, where every delta would be larger.

A step is one self-describing blob: a fixed header (magic, base and target version, record count), a table of
records (tensor index, method, element count, data bytes), then the records' data back to back. A payload is the
steps from the worker's version to the target, in order. Decoding checks every count, bound and length before it
writes, and the result is checked against the target's per-tensor XXH3-64 checksums: any doubt is a
`ProtocolError` (its ``reason`` says which), after which the worker asks for a full snapshot. Deltas are exact,
so a worker's bytes equal cast(master_v) however many it applied.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from heterorl.transport.protocol import TENSOR_DTYPES, ProtocolError, WeightsHeader

MAGIC = b"HRWD"
FORMAT = 1
SPARSE, XOR_ZSTD, FULL, SPARSE_ZSTD = 1, 2, 3, 4
METHODS = {SPARSE: "sparse", XOR_ZSTD: "xor_zstd", FULL: "full", SPARSE_ZSTD: "sparse_zstd"}
# which compressed encodings are measured, by the share of a tensor's elements that changed: sparse_zstd below
# 1/2, xor_zstd from 1/8 (both between). Measured on bf16 XORs at random positions: sparse_zstd is the smaller up
# to about 40 % changed (30 % smaller at 2-12 %), xor_zstd above; each costs a zstd pass over the tensor
SPARSE_ZSTD_BELOW, XOR_ZSTD_FROM = 1 / 2, 1 / 8
_STEP = np.dtype([("magic", "S4"), ("format", "<u4"), ("base", "<i4"), ("target", "<i4"), ("records", "<u4")])
_RECORD = np.dtype([("tensor", "<u4"), ("method", "u1"), ("count", "<u8"), ("nbytes", "<u8")])
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
ZSTD_LEVEL = 1  # measured on SmolLM2's bf16 deltas: level 3 is no smaller and slower
THREADS = min(4, os.cpu_count() or 1)  # tensors encoded or applied at once


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a packed version lies: byte offset, byte size and element size, in header order."""

    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    itemsizes: tuple[int, ...]
    total_bytes: int

    @classmethod
    def of(cls, header: WeightsHeader) -> Layout:
        itemsizes = [TENSOR_DTYPES[d][1] for d in header.dtypes]
        sizes = [s * math.prod(shape) for s, shape in zip(itemsizes, header.shapes)]
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist() if sizes else []
        return cls(tuple(offsets), tuple(sizes), tuple(itemsizes), sum(sizes))

    def view(self, buffer: np.ndarray, i: int) -> np.ndarray:
        """Tensor ``i`` of ``buffer`` as unsigned integers of its element size (its raw bits)."""
        return buffer[self.offsets[i]:self.offsets[i] + self.nbytes[i]].view(_UINT[self.itemsizes[i]])


def same_layout(a: WeightsHeader, b: WeightsHeader) -> bool:
    return a.names == b.names and a.dtypes == b.dtypes and a.shapes == b.shapes


def tensor_checksums(layout: Layout, buffer: np.ndarray) -> list[int]:
    """XXH3-64 of each tensor's bytes: what a worker's reconstruction must match."""
    return [xxhash.xxh3_64_intdigest(memoryview(buffer[o:o + n])) for o, n in zip(layout.offsets, layout.nbytes)]


@dataclass
class EncodedStep:
    """One step's blob and what it took: tensors (and bytes) per method, elements changed, seconds."""

    blob: np.ndarray  # uint8
    methods: Counter
    method_bytes: Counter
    changed: int
    seconds: float


def _encoder(layout: Layout, old: np.ndarray, new: np.ndarray, level: int):
    """The per-tensor encoder of one step: tensor index → (record, data, elements changed), or None when the
    tensor did not change. Each thread keeps its own XOR buffer (no fresh pages per tensor) and compressor."""
    local = threading.local()
    largest = max(layout.nbytes, default=0)

    def encode(i: int):
        size = layout.nbytes[i]
        if size == 0:
            return None
        if not hasattr(local, "scratch"):
            local.scratch = np.empty(largest, np.uint8)
            local.compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
        o, n = layout.view(old, i), layout.view(new, i)
        xor = np.bitwise_xor(o, n, out=local.scratch[:size].view(o.dtype))
        count = int(np.count_nonzero(xor))
        if count == 0:
            return None
        options = {SPARSE: count * (4 + layout.itemsizes[i]), FULL: size}
        packed = {}
        if options[SPARSE] > 64:  # (below, zstd's own header outweighs what it could save)
            if count >= XOR_ZSTD_FROM * xor.size:
                packed[XOR_ZSTD] = local.compressor.compress(xor)
            if count < SPARSE_ZSTD_BELOW * xor.size:
                where = np.flatnonzero(xor)
                gaps = np.diff(where, prepend=0).astype("<u4")  # the first index, then the distance to the next
                packed[SPARSE_ZSTD] = local.compressor.compress(np.concatenate([gaps.view(np.uint8),
                                                                                xor[where].view(np.uint8)]))
            options.update({m: len(p) for m, p in packed.items()})
        method = min(options, key=options.get)
        if method == SPARSE:
            where = np.flatnonzero(xor)
            piece = np.concatenate([where.astype("<u4").view(np.uint8), n[where].view(np.uint8)])
        else:
            piece = n.view(np.uint8) if method == FULL else np.frombuffer(packed[method], np.uint8)
        return (i, method, count if method in (SPARSE, SPARSE_ZSTD) else o.size, len(piece)), piece, count
    return encode


def encode_step(layout: Layout, old: np.ndarray, new: np.ndarray, base: int, target: int,
                level: int = ZSTD_LEVEL) -> EncodedStep:
    """The step from ``old`` (version ``base``) to ``new`` (version ``target``), both packed with ``layout``;
    tensors are encoded ``THREADS`` at a time (zstd and numpy release the GIL)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        encoded = [e for e in pool.map(_encoder(layout, old, new, level), range(len(layout.nbytes))) if e]
    methods, method_bytes = Counter(), Counter()
    for record, piece, _ in encoded:
        methods[METHODS[record[1]]] += 1
        method_bytes[METHODS[record[1]]] += len(piece)
    head = np.array([(MAGIC, FORMAT, base, target, len(encoded))], _STEP).view(np.uint8)
    table = np.array([e[0] for e in encoded], _RECORD).view(np.uint8) if encoded else np.empty(0, np.uint8)
    blob = np.concatenate([head, table, *(e[1] for e in encoded)])
    return EncodedStep(blob, methods, method_bytes, sum(e[2] for e in encoded), time.perf_counter() - start)


def _read_step(payload: np.ndarray, at: int, layout: Layout) -> tuple[int, int, np.ndarray, int]:
    """(base, target, records, offset of the first record's data) of the step at ``at``, checked."""
    if len(payload) - at < _STEP.itemsize:
        raise ProtocolError("delta", f"the payload ends inside a step header (at byte {at})", "delta_truncated")
    head = payload[at:at + _STEP.itemsize].view(_STEP)[0]
    if head["magic"] != MAGIC or head["format"] != FORMAT:
        raise ProtocolError("delta", f"no step header at byte {at} (magic {bytes(head['magic'])!r}, format "
                            f"{int(head['format'])}; expected {MAGIC!r}, {FORMAT})", "delta_corrupt")
    n = int(head["records"])
    end = at + _STEP.itemsize + n * _RECORD.itemsize
    if n > len(layout.nbytes) or end > len(payload):
        raise ProtocolError("delta", f"the step at byte {at} claims {n} records; the layout has "
                            f"{len(layout.nbytes)} tensors and the payload {len(payload) - at} bytes left",
                            "delta_truncated" if n <= len(layout.nbytes) else "delta_corrupt")
    records = payload[at + _STEP.itemsize:end].view(_RECORD)
    return int(head["base"]), int(head["target"]), records, end


def _apply_record(layout: Layout, out: np.ndarray, record, data: np.ndarray) -> None:
    i, method, count, nbytes = int(record["tensor"]), int(record["method"]), int(record["count"]), len(data)
    if i >= len(layout.nbytes):
        raise ProtocolError("delta", f"record for tensor {i}; the layout has {len(layout.nbytes)}", "delta_corrupt")
    target, itemsize = layout.view(out, i), layout.itemsizes[i]
    if method == SPARSE:
        if count > target.size or nbytes != count * (4 + itemsize):
            raise ProtocolError("delta", f"tensor {i}: a sparse patch of {count} elements in {nbytes} bytes does "
                                f"not fit its {target.size} elements of {itemsize} bytes", "delta_count")
        where = data[:4 * count].view("<u4")
        if count and int(where.max()) >= target.size:
            raise ProtocolError("delta", f"tensor {i}: index {int(where.max())} is out of its {target.size} "
                                "elements", "delta_count")
        target[where] = data[4 * count:].view(target.dtype)
    elif method == XOR_ZSTD:
        if count != target.size:
            raise ProtocolError("delta", f"tensor {i}: an XOR of {count} elements for a tensor of {target.size}",
                                "delta_count")
        xor = _decompress(data, layout.nbytes[i], i)
        np.bitwise_xor(target, np.frombuffer(xor, target.dtype), out=target)
    elif method == SPARSE_ZSTD:
        if count > target.size:
            raise ProtocolError("delta", f"tensor {i}: {count} elements changed in a tensor of {target.size}",
                                "delta_count")
        raw = np.frombuffer(_decompress(data, count * (4 + itemsize), i), np.uint8)
        gaps = raw[:4 * count].view("<u4")
        if count and (gaps[1:].min(initial=1) == 0 or int(gaps.sum(dtype=np.int64)) >= target.size):
            raise ProtocolError("delta", f"tensor {i}: its indices repeat or run past its {target.size} elements",
                                "delta_count")
        where = np.cumsum(gaps, dtype=np.int64)
        target[where] ^= raw[4 * count:].view(target.dtype)
    elif method == FULL:
        if count != target.size or nbytes != layout.nbytes[i]:
            raise ProtocolError("delta", f"tensor {i}: {nbytes} bytes ({count} elements) for a tensor of "
                                f"{layout.nbytes[i]} bytes", "delta_count")
        target[:] = data.view(target.dtype)
    else:
        raise ProtocolError("delta", f"tensor {i}: unknown method {method}", "delta_corrupt")


def _decompress(data: np.ndarray, expected: int, i: int) -> bytes:
    """A record's zstd frame, which must hold exactly ``expected`` bytes (one that claims more is refused before
    anything is allocated)."""
    try:
        if zstandard.frame_content_size(data) != expected:
            raise ProtocolError("delta", f"tensor {i}: the zstd frame does not hold the {expected} bytes its record "
                                "needs", "delta_count")
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise ProtocolError("delta", f"tensor {i}: its zstd stream does not decode ({exc})", "delta_zstd") from None
    if len(out) != expected:
        raise ProtocolError("delta", f"tensor {i}: the zstd frame holds {len(out)} bytes, not {expected}",
                            "delta_count")
    return out


def apply_steps(layout: Layout, base: np.ndarray, base_version: int, payload, version: int,
                out: np.ndarray, checksums: list[int]) -> None:
    """Write version ``version`` into ``out``: ``base`` (version ``base_version``) with the payload's steps
    applied in order, then checked against ``checksums``. Raises `ProtocolError` on any inconsistency; ``out``
    is then garbage (``base`` is never written)."""
    payload = np.frombuffer(payload, np.uint8)
    if len(base) != layout.total_bytes or len(out) != layout.total_bytes:
        raise ProtocolError("delta", f"the held version has {len(base)} bytes, the layout {layout.total_bytes}",
                            "delta_base")
    out[:] = base
    at, held = 0, base_version
    with ThreadPoolExecutor(THREADS) as pool:
        while at < len(payload):
            step_base, target, records, at = _read_step(payload, at, layout)
            if step_base != held or target <= held:
                raise ProtocolError("delta", f"a step from version {step_base} to {target} follows version "
                                    f"{held}", "delta_base")
            if len(np.unique(records["tensor"])) != len(records):
                raise ProtocolError("delta", f"the step to version {target} has two records for one tensor",
                                    "delta_corrupt")
            pieces = []
            for record in records:
                nbytes = int(record["nbytes"])
                if at + nbytes > len(payload):
                    raise ProtocolError("delta", f"tensor {int(record['tensor'])}: {nbytes} bytes claimed, "
                                        f"{len(payload) - at} left", "delta_truncated")
                pieces.append((record, payload[at:at + nbytes]))
                at += nbytes
            # one record per tensor: the step's records are applied THREADS at a time, the steps in order
            list(pool.map(lambda piece: _apply_record(layout, out, *piece), pieces))
            held = target
    if held != version:
        raise ProtocolError("delta", f"the steps end at version {held}, not {version}", "delta_base")
    if len(checksums) != len(layout.nbytes):
        raise ProtocolError("checksums", f"{len(checksums)} checksums for {len(layout.nbytes)} tensors",
                            "length_mismatch")
    for i, (got, want) in enumerate(zip(tensor_checksums(layout, out), checksums)):
        if got != want:
            raise ProtocolError("delta", f"tensor {i} does not match the learner's checksum after the deltas",
                                "delta_checksum")


class DeltaChain:
    """The learner's steps between consecutive published versions (target → `EncodedStep`, whose base is
    target − 1), and the payloads built from them for the workers' bases.

    Memory is bounded by one version's packed size twice over: the steps are kept, newest first, while their
    bytes sum to at most ``full_bytes`` (a longer chain would cost a worker more than a snapshot) and number at
    most ``max_steps``; built payloads are cached, newest first, within ``full_bytes`` too."""

    def __init__(self, max_steps: int = 64) -> None:
        self.max_steps = max_steps
        self._steps: OrderedDict[int, EncodedStep] = OrderedDict()
        self._payloads: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._full_bytes = 0

    def add(self, target: int, step: EncodedStep, full_bytes: int) -> None:
        if self._steps and next(reversed(self._steps)) != target - 1:
            self.reset()  # not consecutive (a resumed learner): the old steps lead nowhere
        self._steps[target] = step
        self._full_bytes = full_bytes
        while self._steps and (self.bytes_between(next(iter(self._steps)) - 1, target) or 0) > full_bytes:
            self._steps.popitem(last=False)
        while len(self._steps) > self.max_steps:
            self._steps.popitem(last=False)

    def reset(self) -> None:
        self._steps.clear()
        self._payloads.clear()

    def bytes_between(self, base: int, target: int) -> int | None:
        """The payload bytes from ``base`` to ``target``; None when a step between them is not kept."""
        if base < 0 or target <= base or any(v not in self._steps for v in range(base + 1, target + 1)):
            return None
        return sum(len(self._steps[v].blob) for v in range(base + 1, target + 1))

    def cached(self) -> list[tuple[int, int]]:
        """The (base, target) of the payloads still cached."""
        return list(self._payloads)

    def payload(self, base: int, target: int) -> np.ndarray | None:
        """The steps from ``base`` to ``target`` back to back (cached); None when one is not kept."""
        key = (base, target)
        if key in self._payloads:
            self._payloads.move_to_end(key)
            return self._payloads[key]
        if self.bytes_between(base, target) is None:
            return None
        blobs = [self._steps[v].blob for v in range(base + 1, target + 1)]
        payload = blobs[0] if len(blobs) == 1 else np.concatenate(blobs)
        self._payloads[key] = payload
        while sum(len(p) for p in self._payloads.values()) > max(self._full_bytes, len(payload)):
            self._payloads.popitem(last=False)
        return payload
