"""Weights, learner → worker: the `WeightsNotice` on the control channel (a version is ready), then on the weights
channel the worker's `WeightsRequest`s and the learner's `WeightsHeader` (the version's layout: names, wire
dtypes, shapes, chunking; a delta's base, per-tensor checksums, tied names, a sharded rank's slices, a LoRA
adapter) and `WeightsChunk`s, each guarded by its XXH3-64 (`chunk_checksum`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import xxhash

from heterorl.transport.protocol.fields import (
    ID_PATTERN,
    INT32_MAX,
    Limits,
    Message,
    ProtocolError,
    check_float,
    check_id,
    check_int,
    check_str,
    check_str_list,
)

# wire dtype name → (numpy dtype, bytes per element); bfloat16 travels as raw 2-byte words
TENSOR_DTYPES = {
    "float32": ("<f4", 4), "float16": ("<f2", 2), "bfloat16": ("<u2", 2), "float64": ("<f8", 8),
    "int64": ("<i8", 8), "int32": ("<i4", 4), "int8": ("i1", 1), "uint8": ("u1", 1), "bool": ("u1", 1),
}


@dataclass
class WeightsNotice(Message):
    """Learner → worker (control channel): version ``version`` is available on the weights channel; it was
    published at ``published_at`` (the learner's wall clock, seconds since the epoch; 0: not said), from which the
    worker measures how long its weights took to arrive."""

    kind: ClassVar[str] = "weights_notice"
    version: int
    published_at: float = 0.0
    optional_fields: ClassVar[frozenset] = frozenset({"published_at"})  # learners of earlier versions

    @classmethod
    def from_wire(cls, body, limits, data=()):
        return cls(version=check_int("version", body["version"], 0, INT32_MAX),
                   published_at=check_float("published_at", body.get("published_at", 0.0), 1e12))


@dataclass
class WeightsRequest(Message):
    """Worker → learner (weights channel): send me the newest version released to me, if newer than
    ``have_version``; ``chunk`` > 0 asks for one chunk of ``version`` (a resumed or windowed fetch).

    ``delta_base`` (optional; −1 or absent: none): on a header request, the version whose bytes the worker holds
    whole and verified, so the learner may send the newest version as deltas from it; on a chunk request, the
    base of the delta payload being fetched (−1: the full version).

    ``session``: the token of the worker's current session, which the learner's ``ready`` gave it
    (``weights_session``): the learner answers only requests that carry it, so a connection that is not the
    worker's session cannot fetch in its name."""

    kind: ClassVar[str] = "weights_request"
    worker_id: str
    have_version: int = -1
    version: int = -1
    chunk: int = -1
    delta_base: int = -1
    layout: str = ""  # the key of the slices this worker declared in its hello (`reshard.layout_key`; "": whole)
    session: str = ""
    optional_fields: ClassVar[frozenset] = frozenset({"delta_base", "layout", "session"})  # earlier workers

    @classmethod
    def from_wire(cls, body, limits, data=()):
        return cls(
            worker_id=check_id("worker_id", body["worker_id"], limits),
            have_version=check_int("have_version", body["have_version"], -1, INT32_MAX),
            version=check_int("version", body["version"], -1, INT32_MAX),
            chunk=check_int("chunk", body["chunk"], -1, INT32_MAX),
            delta_base=check_int("delta_base", body.get("delta_base", -1), -1, INT32_MAX),
            layout=check_str("layout", body["layout"], 64) if body.get("layout") else "",
            session=check_str("session", body["session"], 64, ID_PATTERN) if body.get("session") else "",
        )


@dataclass
class WeightsHeader(Message):
    """Learner → worker: the layout of version ``version``: tensors packed back to back in ``names`` order,
    split into ``num_chunks`` chunks of ``chunk_bytes`` (the last may be shorter). Each chunk carries its own
    checksum: a version is whole when every chunk arrived, passed its checksum and the byte count adds up.

    Optional (absent from learners of earlier versions): ``base_version`` ≥ 0 says the chunks carry a delta
    payload (heterorl.transport.weights.deltas) from that version, of ``payload_bytes`` bytes, instead of the packed
    tensors; ``checksums`` holds the XXH3-64 of each tensor of the version, which the rebuilt bytes must match;
    ``aliases`` names tensors sent once under another name (tied weights).

    A sharded learner's rank sends only the slices it owns (heterorl.transport.weights.reshard): ``shard`` is [rank,
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
        names = check_str_list("names", body["names"], limits, limits.max_tensors)
        dtypes = check_str_list("dtypes", body["dtypes"], limits, limits.max_tensors)
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
            shapes.append([check_int(f"shapes[{i}]", d, 0, INT32_MAX) for d in shape])
        total = check_int("total_bytes", body["total_bytes"], 0, 2**50)
        expected = sum(TENSOR_DTYPES[d][1] * math.prod(s) for d, s in zip(dtypes, shapes))
        if expected != total:
            raise ProtocolError("total_bytes", f"{total} != {expected} implied by dtypes and shapes", "length_mismatch")
        version = check_int("version", body["version"], 0, INT32_MAX)
        base = check_int("base_version", body.get("base_version", -1), -1, version - 1)
        payload = check_int("payload_bytes", body.get("payload_bytes", -1), -1 if base < 0 else 0, 2**50)
        checksums = body.get("checksums", [])
        if not isinstance(checksums, list) or len(checksums) not in (0, len(names)):
            raise ProtocolError("checksums", f"expected a list of {len(names)} checksums", "length_mismatch")
        checksums = [check_int(f"checksums[{i}]", c, 0, 2**64 - 1) for i, c in enumerate(checksums)]
        if base >= 0 and not checksums:
            raise ProtocolError("checksums", "a delta must come with the checksums of the tensors it rebuilds",
                                "length_mismatch")
        chunk_bytes = check_int("chunk_bytes", body["chunk_bytes"], 1, limits.max_chunk_bytes)
        num_chunks = check_int("num_chunks", body["num_chunks"], 0, INT32_MAX)
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
    world = check_int("shard[1]", shard[1], 1, 1 << 16)
    rank = check_int("shard[0]", shard[0], 0, world - 1)
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
        full = [check_int(f"full_shapes[{i}]", d, 0, INT32_MAX) for d in full]
        pairs = []
        for d, (pair, size, extent) in enumerate(zip(box, full, shape)):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ProtocolError(f"boxes[{i}][{d}]", "expected [start, stop]", "type")
            start, stop = (check_int(f"boxes[{i}][{d}]", x, 0, size) for x in pair)
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
    return {"base": check_str("adapter.base", value["base"], 64, ID_PATTERN),
            "rank": check_int("adapter.rank", value["rank"], 1, 1 << 16),
            "alpha": check_float("adapter.alpha", value["alpha"], 1e6),
            "targets": check_str_list("adapter.targets", value["targets"], limits, 64)}


def _aliases(value: Any, names: list[str], limits: Limits) -> list[list[str]]:
    """[alias, source] pairs: each source one of ``names``, each alias a name given nowhere else."""
    if not isinstance(value, list) or len(value) > limits.max_tensors:
        raise ProtocolError("aliases", f"expected a list of at most {limits.max_tensors} pairs", "type")
    known, pairs = set(names), []
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ProtocolError(f"aliases[{i}]", "expected [alias, source]", "type")
        alias, source = check_str_list(f"aliases[{i}]", pair, limits, 2)
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

    @classmethod
    def header_fields(cls) -> frozenset:
        return frozenset({"version", "index", "checksum"})  # the bytes travel as the data frame

    def payload(self) -> list:
        return [self.data]

    @classmethod
    def from_wire(cls, body, limits, data=()):
        chunk = data[0]
        if chunk.nbytes > limits.max_chunk_bytes:
            raise ProtocolError("data", f"{chunk.nbytes} bytes exceed {limits.max_chunk_bytes}", "too_large")
        checksum = check_int("checksum", body["checksum"], 0, 2**64 - 1)
        if chunk_checksum(chunk) != checksum:
            raise ProtocolError("data", "checksum mismatch: the chunk was corrupted in transit", "checksum")
        return cls(version=check_int("version", body["version"], 0, INT32_MAX),
                   index=check_int("index", body["index"], 0, INT32_MAX), checksum=checksum, data=chunk)
