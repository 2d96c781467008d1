"""Resharding weights: each trainer rank sends the exact slices it owns straight to the workers that need them.

The model. A tensor of shape ``S`` lives in global coordinates; a *box* is a tuple of ``(start, stop)`` per dim.

- The trainer side (`SourceLayout`) holds each tensor either replicated (DDP: every rank has all of it) or sharded
  along one dim over its ``world`` ranks with ``torch.chunk`` semantics (FSDP2): ``chunk = ceil(size / world)``
  and rank ``i`` owns ``[i * chunk, min((i + 1) * chunk, size))``, so trailing ranks may own fewer or no rows.
- A worker (`DestLayout`) wants each tensor whole (the default: a worker that holds the whole model declares
  nothing) or part ``index`` of ``parts`` equal parts along one dim, as rank ``index`` of a tensor-parallel
  engine of size ``parts`` does. Parts must divide the size evenly; anything else is refused up front.
- `plan` intersects every source rank's box with every worker's box; each non-empty intersection is one `Piece`:
  its global box, where it lies in the source rank's local tensor and where in the worker's. A replicated tensor
  is not all sent by rank 0: each worker's box is split along its largest dim into ``world`` chunks and rank
  ``r`` sends chunk ``r``, so the fan-out runs on every rank even under DDP.
- A worker's `Assembler` places the pieces of one version and is all-or-nothing: it refuses a piece of another
  version, of the wrong shape, outside its tensors, or overlapping one already placed, and `Assembler.tensors`
  refuses to hand out a model that is not fully covered (a worker must never sample from a half-updated one).

Example: an 8x8 matrix sharded by rows over 2 trainer ranks, wanted by 4 workers split by columns. Worker ``j``
holds columns ``2j..2j+1`` (a local 8x2 tensor) and gets two 4x2 pieces: rows 0-3 from trainer rank 0 (its
local rows 0-3, columns ``2j..2j+1``), placed at the worker's local rows 0-3; and rows 4-7 from rank 1 (its local
rows 0-3), placed at local rows 4-7.

Pure: torch and the standard library only, no sockets; the transport moves the bytes `take` cuts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from heterorl.errors import HeteroRLError

__all__ = ["Assembler", "Box", "DestLayout", "Piece", "Placement", "Plan", "ReshardError", "SourceLayout", "box_of",
           "box_shape", "box_slices", "chunk_bounds", "even_bounds", "intersect", "layout_key", "local", "plan",
           "take", "volume"]

Box = tuple[tuple[int, int], ...]
REPLICATE, SHARD = "replicate", "shard"
_PLACEMENT_KEYS = ("kind", "dim", "parts")


class ReshardError(HeteroRLError, ValueError):
    """A layout, plan or piece that cannot be honoured. ``reason`` says which check refused, for machines:
    ``layout``, ``placement``, ``version``, ``dest``, ``unknown_tensor``, ``shape``, ``dtype``, ``offset``,
    ``duplicate`` or ``incomplete``."""

    def __init__(self, message: str, reason: str = "layout"):
        super().__init__(message)
        self.reason = reason


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Placement:
    """How one side holds a tensor: whole (``replicate``) or split along ``dim`` into ``parts`` (``shard``)."""

    kind: str = REPLICATE
    dim: int = 0
    parts: int = 1

    def __post_init__(self) -> None:
        if self.kind not in (REPLICATE, SHARD):
            raise ReshardError(f"placement kind {self.kind!r} is not {REPLICATE!r} or {SHARD!r}", "placement")
        if not _is_int(self.dim) or self.dim < 0:
            raise ReshardError(f"placement dim {self.dim!r} is not a non-negative int (count dims from 0, "
                               "not from the end)", "placement")
        if not _is_int(self.parts) or self.parts < 1:
            raise ReshardError(f"placement parts {self.parts!r} is not an int >= 1", "placement")
        if self.kind == REPLICATE and (self.dim, self.parts) != (0, 1):
            raise ReshardError(f"a replicate placement has no dim or parts (got dim={self.dim}, "
                               f"parts={self.parts}); use Placement.replicate()", "placement")

    @classmethod
    def replicate(cls) -> Placement:
        return cls(REPLICATE)

    @classmethod
    def shard(cls, dim: int, parts: int) -> Placement:
        return cls(SHARD, dim, parts)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "dim": self.dim, "parts": self.parts}

    @classmethod
    def from_dict(cls, data) -> Placement:
        """The placement a peer sent (msgpack); anything but ``kind`` plus optional ``dim`` and ``parts`` is refused."""
        if not isinstance(data, Mapping) or "kind" not in data:
            raise ReshardError(f"a placement is a dict with a 'kind' key, got {data!r}", "placement")
        unknown = sorted(map(str, set(data) - set(_PLACEMENT_KEYS)))
        if unknown:
            raise ReshardError(f"placement {dict(data)!r} has unknown keys {unknown}; "
                               f"it takes {list(_PLACEMENT_KEYS)}", "placement")
        return cls(**data)


# ---------------------------------------------------------------------------------------------------- boxes

def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """Rows of part ``index`` under torch.chunk semantics: ``chunk = ceil(size / parts)``, clipped to ``size``
    (trailing parts may be short or empty). How FSDP2 shards a parameter over a trainer's ranks."""
    if not 0 <= index < parts:
        raise ReshardError(f"part index {index} is outside 0..{parts - 1}")
    chunk = -(-size // parts)
    return min(index * chunk, size), min((index + 1) * chunk, size)


def even_bounds(size: int, parts: int, index: int, where: str = "a dim") -> tuple[int, int]:
    """Rows of part ``index`` of ``parts`` equal parts (how a tensor-parallel engine splits a tensor). ``where``
    names the tensor and dim in the refusal."""
    if size % parts:
        fits = [p for p in range(1, min(size, 8) + 1) if size % p == 0]
        raise ReshardError(f"{where} has size {size}, which does not split into {parts} equal parts; ask for "
                           f"parts that divide {size} (e.g. {fits}) or replicate the tensor")
    if not 0 <= index < parts:
        raise ReshardError(f"{where}: part index {index} is outside 0..{parts - 1} ({parts} parts); "
                           "give each worker an index below parts")
    step = size // parts
    return index * step, (index + 1) * step


def box_of(shape: tuple[int, ...], placement: Placement, index: int, even: bool, name: str = "tensor") -> Box:
    """The global box that part ``index`` of ``placement`` covers: even parts (``even``, a worker's) or chunk
    semantics (a trainer rank's). A replicate placement covers the whole tensor whatever the index."""
    whole = tuple((0, size) for size in shape)
    if placement.kind == REPLICATE:
        return whole
    if placement.dim >= len(shape):
        raise ReshardError(f"tensor {name!r} of shape {tuple(shape)} has no dim {placement.dim} to split into "
                           f"{placement.parts} parts; shard along a dim below {len(shape)} or replicate it")
    where = f"tensor {name!r} dim {placement.dim}"
    size = shape[placement.dim]
    if even:
        bounds = even_bounds(size, placement.parts, index, where)
    else:
        bounds = chunk_bounds(size, placement.parts, index)
    return whole[:placement.dim] + (bounds,) + whole[placement.dim + 1:]


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``; None when they share no element."""
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(start >= stop for start, stop in box) else box


def local(box: Box, within: Box) -> Box:
    """``box`` in the local coordinates of a tensor that holds the global box ``within``."""
    moved = tuple((s - w0, e - w0) for (s, e), (w0, _) in zip(box, within, strict=True))
    if any(s < 0 or e > w1 - w0 for (s, e), (w0, w1) in zip(moved, within)):
        raise ReshardError(f"box {box} is not inside {within}")
    return moved


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def volume(box: Box) -> int:
    return math.prod(box_shape(box))


# ---------------------------------------------------------------------------------------------------- layouts

@dataclass(frozen=True)
class SourceLayout:
    """The trainer's side: ``world`` ranks, and per tensor a replicate or a shard over all ``world`` ranks."""

    world: int
    placements: dict[str, Placement] = field(default_factory=dict)

    @classmethod
    def fsdp(cls, shapes: Mapping[str, tuple[int, ...]], world: int) -> SourceLayout:
        """FSDP2's layout: every tensor sharded along dim 0 (a 0-dim tensor cannot be, and is replicated)."""
        return cls(world, {name: Placement.shard(0, world) if len(shape) else Placement.replicate()
                           for name, shape in shapes.items()})

    @classmethod
    def replicated(cls, shapes: Mapping[str, tuple[int, ...]], world: int) -> SourceLayout:
        """DDP's layout: every rank holds every tensor."""
        return cls(world, {name: Placement.replicate() for name in shapes})

    def box(self, name: str, shape: tuple[int, ...], rank: int) -> Box:
        return box_of(shape, self.placements[name], rank, even=False, name=name)

    def validate(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse a layout that does not describe exactly these tensors over ``world`` ranks."""
        if not _is_int(self.world) or self.world < 1:
            raise ReshardError(f"the trainer's world {self.world!r} is not an int >= 1")
        missing, unknown = sorted(set(shapes) - set(self.placements)), sorted(set(self.placements) - set(shapes))
        if missing or unknown:
            raise ReshardError(f"the trainer's layout does not match the model: no placement for {missing[:5]}, "
                               f"placements for tensors it does not have {unknown[:5]}; give one per tensor "
                               "(SourceLayout.fsdp or .replicated build it)")
        for name, placement in sorted(self.placements.items()):
            if placement.kind == SHARD and placement.parts != self.world:
                raise ReshardError(f"tensor {name!r} dim {placement.dim}: the trainer shards it into "
                                   f"{placement.parts} parts over {self.world} ranks; a trainer shard has "
                                   "parts == world")
            self.box(name, shapes[name], 0)  # the dim exists


@dataclass(frozen=True)
class DestLayout:
    """One worker's side: per tensor ``(placement, index)``; a tensor not named is wanted whole."""

    placements: dict[str, tuple[Placement, int]] = field(default_factory=dict)

    def placement(self, name: str) -> tuple[Placement, int]:
        return self.placements.get(name, (Placement.replicate(), 0))

    def box(self, name: str, shape: tuple[int, ...]) -> Box:
        placement, index = self.placement(name)
        return box_of(shape, placement, index, even=True, name=name)

    def validate(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse a tensor the model lacks, a dim out of range, parts that do not divide, an index out of range."""
        for name, (placement, index) in sorted(self.placements.items()):
            if name not in shapes:
                raise ReshardError(f"the worker's layout names tensor {name!r}, which the model does not have "
                                   f"(it has {len(shapes)} tensors, e.g. {sorted(shapes)[:3]})")
            if not _is_int(index) or not 0 <= index < placement.parts:
                raise ReshardError(f"tensor {name!r} dim {placement.dim}: index {index!r} is outside "
                                   f"0..{placement.parts - 1} ({placement.parts} parts); give each worker an "
                                   "index below parts")
            self.box(name, shapes[name])

    @classmethod
    def tensor_parallel(cls, shapes: Mapping[str, tuple[int, ...]], rank: int, size: int,
                        shard_vocab: bool = False) -> DestLayout:
        """The slices rank ``rank`` of a ``size``-way tensor-parallel engine holds of a Llama-family model (the
        Hugging Face names of Llama, Qwen2, SmolLM2), as Megatron-style engines split it: the query, key, value,
        gate and up projections (and their biases) by output rows (dim 0), the attention output and down
        projections by input columns (dim 1), the norms whole; the embedding and the head by vocabulary rows when
        ``shard_vocab`` (an engine that pads the vocabulary to a multiple of ``size`` cannot be served an
        uneven split), else whole. A split along heads needs the head counts divisible by ``size``: the caller
        checks that; a size that does not divide a tensor's dim is refused by `validate`."""
        if not _is_int(size) or size < 1 or not _is_int(rank) or not 0 <= rank < size:
            raise ReshardError(f"tensor-parallel rank {rank!r} of size {size!r}: give 0 <= rank < size")
        rows = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
                "gate_proj.weight", "up_proj.weight")
        columns = ("o_proj.weight", "down_proj.weight")
        vocab = ("embed_tokens.weight", "lm_head.weight") if shard_vocab else ()
        placements = {}
        for name in shapes:
            if name.endswith(rows + vocab):
                placements[name] = (Placement.shard(0, size), rank)
            elif name.endswith(columns):
                placements[name] = (Placement.shard(1, size), rank)
        layout = cls(placements if size > 1 else {})
        layout.validate(shapes)
        return layout

    def to_dict(self) -> dict:
        return {name: {**placement.to_dict(), "index": index} for name, (placement, index) in self.placements.items()}

    @classmethod
    def from_dict(cls, data) -> DestLayout:
        """The layout a worker sent: ``{name: {kind, dim, parts, index}}``."""
        if not isinstance(data, Mapping) or not all(isinstance(v, Mapping) for v in data.values()):
            raise ReshardError(f"a worker layout is a dict of tensor name to placement dict, got {data!r}",
                               "placement")
        placements = {}
        for name, entry in data.items():
            if not isinstance(name, str):
                raise ReshardError(f"a worker layout's tensor names are strings, got {name!r}", "placement")
            fields = dict(entry)
            index = fields.pop("index", 0)
            if not _is_int(index):
                raise ReshardError(f"tensor {name!r}: index {index!r} is not an int", "placement")
            placements[name] = (Placement.from_dict(fields), index)
        return cls(placements)


# ---------------------------------------------------------------------------------------------------- plan

@dataclass(frozen=True)
class Piece:
    """One slice to send: tensor ``name``'s ``global_box``, cut at ``src_box`` from source rank ``src_rank``'s
    local tensor (of shape ``src_shape``) and placed at ``dst_box`` in worker ``dest``'s local tensor."""

    name: str
    src_rank: int
    dest: str
    global_box: Box
    src_box: Box
    dst_box: Box
    src_shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return volume(self.global_box)


def _dtype_size(dtype_size: int | Mapping[str, int], name: str) -> int:
    return dtype_size[name] if isinstance(dtype_size, Mapping) else dtype_size


@dataclass(frozen=True)
class Plan:
    """Every piece, ordered by tensor name, then worker, then source rank."""

    world: int
    pieces: tuple[Piece, ...]

    def pieces_from(self, src_rank: int) -> dict[str, list[Piece]]:
        """What source rank ``src_rank`` sends, per worker (workers it sends nothing are left out)."""
        out: dict[str, list[Piece]] = {}
        for piece in self.pieces:
            if piece.src_rank == src_rank:
                out.setdefault(piece.dest, []).append(piece)
        return out

    def pieces_for(self, dest: str) -> list[Piece]:
        return [piece for piece in self.pieces if piece.dest == dest]

    def bytes_from(self, src_rank: int, dtype_size: int | Mapping[str, int]) -> int:
        """Bytes source rank ``src_rank`` sends; ``dtype_size``: bytes per element, one for all or per tensor."""
        return sum(p.numel * _dtype_size(dtype_size, p.name) for p in self.pieces if p.src_rank == src_rank)

    def bytes_for(self, dest: str, dtype_size: int | Mapping[str, int]) -> int:
        return sum(p.numel * _dtype_size(dtype_size, p.name) for p in self.pieces if p.dest == dest)


def _split_replicated(box: Box, world: int) -> list[tuple[int, Box]]:
    """``box`` cut along its largest dim (the first of equals) into ``world`` chunks: (rank, chunk) pairs."""
    if not box or world == 1:
        return [(0, box)]
    dim = max(range(len(box)), key=lambda d: box[d][1] - box[d][0])
    start, stop = box[dim]
    out = []
    for rank in range(world):
        lo, hi = chunk_bounds(stop - start, world, rank)
        out.append((rank, box[:dim] + ((start + lo, start + hi),) + box[dim + 1:]))
    return out


def _tensor_pieces(name: str, shape: tuple[int, ...], source: SourceLayout, dest: str, dst: Box) -> list[Piece]:
    whole = tuple((0, size) for size in shape)
    if source.placements[name].kind == REPLICATE:
        owned = [(rank, whole, part) for rank, part in _split_replicated(dst, source.world)]
    else:
        owned = [(rank, source.box(name, shape, rank), dst) for rank in range(source.world)]
    pieces = []
    for rank, src, wanted in owned:
        common = intersect(src, wanted)
        if common is not None:
            pieces.append(Piece(name, rank, dest, common, local(common, src), local(common, dst), box_shape(src)))
    return pieces


def layout_key(layout: DestLayout) -> str:
    """A short name for a worker layout (workers that want the same slices share a pack): "" for the whole
    model, else a digest of its canonical form."""
    import hashlib
    import json

    if not layout.placements:
        return ""
    canonical = json.dumps(layout.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def plan(shapes: Mapping[str, tuple[int, ...]], source: SourceLayout, dests: Mapping[str, DestLayout]) -> Plan:
    """The pieces that carry every tensor from the trainer's ranks to every worker (``dests``: worker name →
    layout). Deterministic: the same inputs give the same pieces in the same order, whatever the dicts' order."""
    shapes = {name: tuple(shape) for name, shape in shapes.items()}
    source.validate(shapes)
    for dest, layout in sorted(dests.items()):
        try:
            layout.validate(shapes)
        except ReshardError as error:
            raise ReshardError(f"worker {dest!r}: {error}", error.reason) from error
    pieces = []
    for name in sorted(shapes):
        for dest in sorted(dests):
            pieces += _tensor_pieces(name, shapes[name], source, dest, dests[dest].box(name, shapes[name]))
    return Plan(source.world, tuple(pieces))


def take(local_tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The contiguous slice of a source rank's local tensor that ``piece`` carries (a view when it already is)."""
    if tuple(local_tensor.shape) != piece.src_shape:
        raise ReshardError(f"tensor {piece.name!r}: source rank {piece.src_rank} holds a local tensor of shape "
                           f"{tuple(local_tensor.shape)}, the plan expects {piece.src_shape}; the SourceLayout "
                           "does not describe how the trainer holds it", "shape")
    return local_tensor[box_slices(piece.src_box)].contiguous()


# ---------------------------------------------------------------------------------------------------- assembly

class Assembler:
    """A worker's tensors of one version, filled piece by piece; handed out only when every element is filled.

    Coverage is counted, not masked: accepted pieces never overlap (an overlap is refused), so a tensor is full
    when the volumes of its pieces add up to its size."""

    def __init__(self, version: int, shapes: Mapping[str, tuple[int, ...]], dest_layout: DestLayout,
                 dtype: torch.dtype | Mapping[str, torch.dtype], dest: str | None = None,
                 device: torch.device | str = "cpu"):
        """``dest``: this worker's name, when given pieces for another worker are refused."""
        shapes = {name: tuple(shape) for name, shape in shapes.items()}
        dest_layout.validate(shapes)
        if isinstance(dtype, Mapping) and set(shapes) - set(dtype):
            raise ReshardError(f"no dtype for tensors {sorted(set(shapes) - set(dtype))[:5]}")
        self.version, self.dest = version, dest
        self._tensors: dict[str, torch.Tensor] = {}
        self._filled: dict[str, list[Box]] = {}
        self._count: dict[str, int] = {}
        for name in sorted(shapes):
            shape = box_shape(dest_layout.box(name, shapes[name]))
            tensor_dtype = dtype[name] if isinstance(dtype, Mapping) else dtype
            self._tensors[name] = torch.empty(shape, dtype=tensor_dtype, device=device)
            self._filled[name], self._count[name] = [], 0

    def _check(self, version: int, piece: Piece, data: torch.Tensor) -> None:
        where = f"piece of tensor {piece.name!r} from source rank {piece.src_rank} at {piece.dst_box}"
        if version != self.version:
            raise ReshardError(f"{where} is of version {version}, this assembler builds version {self.version}; "
                               "start a new Assembler per version", "version")
        if self.dest is not None and piece.dest != self.dest:
            raise ReshardError(f"{where} is for worker {piece.dest!r}, this is {self.dest!r}", "dest")
        if piece.name not in self._tensors:
            raise ReshardError(f"{where}: this worker has no such tensor", "unknown_tensor")
        target = self._tensors[piece.name]
        if tuple(data.shape) != box_shape(piece.dst_box):
            raise ReshardError(f"{where}: the data has shape {tuple(data.shape)}, the box "
                               f"{box_shape(piece.dst_box)}", "shape")
        if data.dtype != target.dtype:
            raise ReshardError(f"{where}: the data is {data.dtype}, the tensor {target.dtype}; cast before "
                               "sending", "dtype")
        if len(piece.dst_box) != target.dim() or any(
                start < 0 or stop > size for (start, stop), size in zip(piece.dst_box, target.shape)):
            raise ReshardError(f"{where}: the box lies outside the local tensor of shape {tuple(target.shape)}",
                               "offset")
        clash = next((box for box in self._filled[piece.name] if intersect(box, piece.dst_box)), None)
        if clash is not None:
            raise ReshardError(f"{where} overlaps the piece already placed at {clash}", "duplicate")

    def add(self, version: int, piece: Piece, data: torch.Tensor) -> None:
        """Place one piece; refused (`ReshardError`, its ``reason`` says why) unless it fits exactly and
        covers only elements not yet filled."""
        self._check(version, piece, data)
        self._tensors[piece.name][box_slices(piece.dst_box)].copy_(data)
        self._filled[piece.name].append(piece.dst_box)
        self._count[piece.name] += volume(piece.dst_box)

    def missing(self, name: str | None = None) -> int:
        """Elements not yet filled: of tensor ``name``, or of all tensors."""
        names = self._tensors if name is None else [name]
        return sum(self._tensors[n].numel() - self._count[n] for n in names)

    @property
    def complete(self) -> bool:
        return self.missing() == 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """The assembled local tensors; refused while any element is missing."""
        short = {name: self.missing(name) for name in self._tensors if self.missing(name)}
        if short:
            listed = ", ".join(f"{name!r} ({count} of {self._tensors[name].numel()} elements)"
                               for name, count in list(short.items())[:5])
            raise ReshardError(f"version {self.version} is incomplete: {len(short)} tensors are missing elements: "
                               f"{listed}; a worker must not run a half-updated model", "incomplete")
        return dict(self._tensors)
