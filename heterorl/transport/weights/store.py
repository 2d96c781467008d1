"""The versions a weights server holds, packed for the wire, and the steps between them (deltas): what the
learner's `LearnerServer` and a sharded learner's other ranks (`heterorl.transport.weights.shards.ShardServer`) publish
and answer weights requests from.

Not thread-safe by itself: its owner holds one lock around every call except `pack`, the heavy part (the copy into
the send buffer, the checksums, the delta encoding), which runs outside it on the publishing thread.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict, deque
from typing import Callable

import torch
import zmq

from heterorl.config import TransportConfig
from heterorl.transport.protocol import WeightsChunk, WeightsHeader, WeightsRequest, encode
from heterorl.transport.sockets import TransportError
from heterorl.transport.weights.deltas import (
    DeltaChain,
    EncodedStep,
    Layout,
    encode_step,
    same_layout,
    tensor_checksums,
)
from heterorl.transport.weights.inflight import BytesInFlight
from heterorl.transport.weights.pack import PackedWeights, pack_state_dict


class WeightsStore:
    """Versions (newest last), the buffers of retired ones for reuse, the delta chain and cached delta payloads.
    Counts into ``stats`` (the owner's counter): ``weights/versions``, ``weights/version_bytes``,
    ``weights/steps_encoded``, ``weights/step_bytes``, ``weights/encode_s``, the headers sent."""

    def __init__(self, config: TransportConfig, stats: Counter, newest: int = -1) -> None:
        self.config, self.stats = config, stats
        self.versions: OrderedDict[int, PackedWeights] = OrderedDict()
        self.retired: deque[PackedWeights] = deque(maxlen=2)  # dropped versions whose buffers `pack` reuses
        self.chain = DeltaChain(config.max_retained_versions)  # steps between versions (weights_deltas)
        self.payloads: dict[tuple[int, int], PackedWeights] = {}  # (base, version) → a delta payload's chunks
        # the newest version's step from the one before it (`EncodedStep`), the dtype of its floating-point tensors
        self.last_step: EncodedStep | None = None
        self.weights_dtype = "float32"
        self.newest = newest

    def begin(self, version: int) -> tuple[PackedWeights | None, PackedWeights | None]:
        """Under the lock, before `pack`: (a retired version's buffer to reuse, the newest version, the base of the
        step). Refuses a version that is not newer than every one published."""
        if version <= self.newest:
            raise TransportError(f"weights version {version} is not newer than {self.newest}")
        spare = self.retired.popleft() if self.retired else None  # (chunks are sent as copies: nothing views it)
        return spare, self.versions.get(self.newest)  # the newest is never retired, so it stays intact

    def pack(self, state: dict, version: int, spare: PackedWeights | None, previous: PackedWeights | None,
             dtype: torch.dtype | None, describe: Callable[[WeightsHeader], None] | None = None
             ) -> tuple[PackedWeights, EncodedStep | None]:
        """Outside the lock: ``state`` packed (cast to ``dtype``) into ``spare``'s buffer or a new one, with its
        per-tensor checksums and, with ``weights_deltas``, the step from ``previous``. ``describe`` adds to the
        header before the step is encoded (a sharded rank's slice boxes)."""
        packed = pack_state_dict(state, version, self.config.weights_chunk_bytes,
                                 out=spare.buffer if spare is not None else None, dtype=dtype)
        if describe is not None:
            describe(packed.header)
        layout = Layout.of(packed.header)
        packed.header.checksums = tensor_checksums(layout, packed.buffer)
        step = None
        if self.config.weights_deltas and previous is not None and same_layout(previous.header, packed.header):
            step = encode_step(layout, previous.buffer, packed.buffer, previous.header.version, version)
        return packed, step

    def add(self, version: int, packed: PackedWeights, step: EncodedStep | None) -> None:
        """Under the lock, after `pack`: ``version`` is the newest."""
        if version <= self.newest:
            raise TransportError(f"weights version {version} is not newer than {self.newest}")
        previous = self.versions.get(self.newest)
        self.versions[version] = packed
        self.newest, self.last_step = version, step
        self.weights_dtype = next((d for d in packed.header.dtypes if d.startswith(("float", "bfloat"))),
                                  self.weights_dtype)
        self.stats["weights/versions"] += 1
        self.stats["weights/version_bytes"] = packed.header.total_bytes
        if step is not None:
            self.stats["weights/steps_encoded"] += 1
            self.stats["weights/step_bytes"] += len(step.blob)
            self.stats["weights/encode_s"] += step.seconds
        if step is not None and previous is not None and previous.header.version == version - 1:
            self.chain.add(version, step, packed.header.total_bytes)
        else:
            self.chain.reset()

    def delta_payload(self, base: int, released: PackedWeights) -> PackedWeights | None:
        """Version ``released`` as the steps from ``base`` (a delta header and its payload, cached for the chunk
        requests that follow); None when a step is not kept or ``base`` is not older."""
        version = released.header.version
        key = (base, version)
        if key not in self.payloads:
            payload = self.chain.payload(base, version) if base < version else None
            if payload is None:
                return None
            header = dataclasses.replace(released.header, base_version=base, payload_bytes=len(payload),
                                         num_chunks=-(-len(payload) // released.header.chunk_bytes))
            cached = set(self.chain.cached())
            self.payloads = {k: p for k, p in self.payloads.items() if k in cached}
            self.payloads[key] = PackedWeights(header, payload)
        return self.payloads[key]

    def reply(self, request: WeightsRequest, released: PackedWeights, in_flight: BytesInFlight,
              holder: str) -> tuple[list, int]:
        """Under the lock: the frames that answer ``request``, released ``released``, and the chunk bytes they
        carry (0: a header), counted against ``holder`` (the asking worker's CURVE key, else its worker id:
        `BytesInFlight`). A header request gets ``released``'s header (as steps from
        the worker's ``delta_base`` when they are kept); a chunk request a copy of the chunk in a tracked frame,
        counted in ``in_flight`` (what a peer that does not read keeps queued is that copy, never the version:
        `heterorl.transport.weights.inflight`), or, when that would take the worker's bytes in flight or
        everyone's past their bound, the header of its transfer again (``weights/held_back``): the worker asks
        once more for the chunks it lacks a moment later."""
        if request.chunk >= 0 and not in_flight.room(holder, self.config.weights_chunk_bytes):
            transfer = (self.versions.get(request.version) if request.delta_base < 0
                        else self.payloads.get((request.delta_base, request.version)))
            return encode((transfer or released).header), 0
        if request.chunk < 0 and request.delta_base >= 0:
            released = self.delta_payload(request.delta_base, released) or released
        packed = None
        if request.chunk >= 0:
            packed = (self.versions.get(request.version) if request.delta_base < 0
                      else self.payloads.get((request.delta_base, request.version)))
        if packed is None or request.chunk >= packed.header.num_chunks:
            self.stats["weights/headers_sent"] += 1
            self.stats["weights/delta_headers_sent" if released.header.is_delta else "weights/full_headers_sent"] += 1
            return encode(released.header), 0
        data = packed.chunk(request.chunk)
        chunk = WeightsChunk(version=packed.header.version, index=request.chunk,
                             checksum=packed.chunk_checksum(request.chunk))
        frame = zmq.Frame(bytes(data), copy=False, track=True)
        in_flight.add(holder, frame, len(data))
        header, _ = encode(chunk)
        return [header, frame], len(data)

    def trim(self, needed: set[int]) -> list[int]:
        """Retire versions beyond ``max_retained_versions`` (oldest first) and every one not ``needed`` (a worker
        may still be given it), never the newest; the versions retired."""
        gone = []
        while len(self.versions) > self.config.max_retained_versions:
            oldest = next(iter(self.versions))
            if oldest == self.newest:
                break
            if oldest in needed:
                self.stats["weights/retention_skips"] += 1
            gone.append(self._retire(oldest))
        for version in [v for v in self.versions if v not in needed and v != self.newest]:
            gone.append(self._retire(version))
        return gone

    def _retire(self, version: int) -> int:
        self.retired.append(self.versions.pop(version))
        return version


__all__ = ["WeightsStore"]
