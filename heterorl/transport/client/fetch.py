"""A worker's pull of one weights version over one weights channel (`WeightsFetch`): the header of the newest
version released to it, then its chunks, ``weights_pipeline`` requests in flight; the version rebuilt (a delta
applied to the held bytes) and checked against the header's checksums; anything doubtful answered by a full
resync. Versions are received into reused buffers (`ReceiveBuffers`); a LoRA learner's arrive as
`AdapterWeights`.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from typing import Callable, Protocol

import numpy as np
import zmq

from heterorl.config import TransportConfig
from heterorl.transport.protocol import (
    Message,
    ProtocolError,
    WeightsChunk,
    WeightsHeader,
    WeightsRequest,
    encode,
)
from heterorl.transport.sockets import send_frames
from heterorl.transport.weights import unpack_state_dict
from heterorl.transport.weights.deltas import Layout, apply_steps, same_layout, tensor_checksums

log = logging.getLogger("heterorl.transport")


class FetchOwner(Protocol):
    """What a fetch reads from the worker's weights side, and hands a verified whole version to
    (`receiver.WeightsReceiver`)."""

    worker_id: str
    config: TransportConfig
    layout_key: str  # named in each request
    stats: Counter
    fetched_version: int  # the newest version delivered (-1: none)

    def deliver(self, version: int, state: dict) -> None: ...


class AdapterWeights(dict):
    """A LoRA learner's version as delivered: the adapter's tensors (a dict, by base-model name), and in
    ``adapter`` what they belong to ({base, rank, alpha, targets}: the header's); the worker merges them into its
    base or loads them beside it (heterorl.training.lora)."""

    def __init__(self, tensors: dict, adapter: dict) -> None:
        super().__init__(tensors)
        self.adapter = dict(adapter)


class ReceiveBuffers:
    """The buffers of delivered weight versions, each reused for a later version of the same size once nothing
    views it any more. A fresh buffer costs a page fault per 4 KiB on its first write (about 25 ms per 100 MiB,
    as much as the copy into it); once the worker has loaded a version into its model and dropped the delivered
    tensors, that version's buffer takes the next one instead. Whether anything still views a buffer is read
    from its reference count: every tensor of a delivered state dict, and every view made of one, keeps it
    alive, so a buffer someone still uses is never overwritten. At most ``keep`` buffers are held for reuse: two
    by default, the peak a worker reaches anyway while it receives a version and still holds the previous one."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.allocated = 0  # fresh buffers made (the other versions were received into a reused one)
        self._kept: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        for i in range(len(self._kept)):
            # two references when only this list holds it: the list's and getrefcount's argument
            if len(self._kept[i]) == nbytes and sys.getrefcount(self._kept[i]) == 2:
                return self._kept.pop(i)
        self.allocated += 1
        return np.empty(nbytes, np.uint8)

    def prepare(self, nbytes: int) -> None:
        """Have a buffer of ``nbytes`` ready, its pages faulted in now (a whole version just arrived: the first
        delta after it is rebuilt into this one without that cost)."""
        if not any(len(b) == nbytes for b in self._kept):
            self.allocated += 1
            buffer = np.empty(nbytes, np.uint8)
            buffer.fill(0)
            self.reuse_later(buffer)

    def reuse_later(self, buffer: np.ndarray) -> None:
        """``buffer`` was delivered (or its transfer abandoned): reuse it once nothing views it."""
        self._kept = [*self._kept, buffer][-self.keep:]


RESYNC_BACKOFF_S = 0.5  # the second resync in a row waits this long before it asks, each later one twice as long
RESYNC_BACKOFF_MAX_S = 30.0  # ... up to this
REASK_S = 0.05  # chunks the learner held back (its bytes in flight at their bound) are asked again this soon


class WeightsFetch:
    """State of one pull-based weights transfer on a worker (header, then pipelined chunks), and the verified
    bytes of the version it holds (``held``: the base of the deltas it asks for, `heterorl.transport.weights.deltas`).
    Anything doubtful (a corrupted chunk, a delta from a version it does not hold, a payload that does not
    decode, rebuilt tensors whose checksums differ) is counted under ``weights/rejected/<reason>`` and answered
    by a full resync (``weights/resyncs``); the worker samples with the weights it has meanwhile. A resync that
    follows another with no version verified between them waits first (`RESYNC_BACKOFF_S`, doubling;
    ``weights/resync_backoffs``), so a link that corrupts every transfer is not asked again at full speed."""

    def __init__(self) -> None:
        self.buffers = ReceiveBuffers()
        self.active = False
        self.header: WeightsHeader | None = None
        self.buffer: np.ndarray | None = None
        self.held: tuple[WeightsHeader, np.ndarray] | None = None
        self.received: set[int] = set()
        self.next_chunk = 0
        self.last_progress = 0.0
        # a sharded learner's slices: the version to fetch from this rank (-1: the newest released), and who
        # takes a verified version (None: the receiver, as the whole model)
        self.want = -1
        self.deliver: Callable[[WeightsHeader, dict, float], None] | None = None
        self.failures = 0  # resyncs since the last version verified
        self.resume_at = 0.0  # backing off: no request before then
        self.deferred: int | None = None  # the version a start held back by the back-off wants (`check_timeout`)
        self.session = ""  # the token of this worker's session with the learner, named in each request
        # chunk requests the learner held back: asked again at once, then at most every REASK_S (`check_timeout`)
        self.reask_at, self.reask_due = 0.0, False

    def new_session(self, token: str) -> None:
        """The learner began a new session with this worker (a ``ready``, its ``weights_session``): requests carry
        ``token`` from now on, and a transfer asked for under an earlier session is given up (the learner no
        longer answers it); the held bytes stay the base of deltas."""
        if token != self.session:
            self.session = token
            self._drop_transfer()
            self.active, self.header = False, None

    def start(self, sock: zmq.Socket, receiver: FetchOwner, now: float, want: int = -1) -> None:
        if now < self.resume_at:
            self.deferred = want  # asked for when the back-off is over
            return
        self.deferred = None
        if self.active and self.header is None and want == self.want:
            return  # a header request is already out
        self._drop_transfer()
        self.active, self.header, self.received, self.next_chunk, self.want = True, None, set(), 0, want
        self.last_progress = now
        base = self.held[0].version if self.held is not None and receiver.config.weights_deltas else -1
        request = WeightsRequest(receiver.worker_id, have_version=receiver.fetched_version, version=want,
                                 delta_base=base, layout=receiver.layout_key, session=self.session)
        send_frames(sock, encode(request), receiver.stats, "weights_request")

    def resync(self, sock, receiver: FetchOwner, now: float, reason: str | None = None) -> None:
        """Forget the held bytes and fetch the newest version whole."""
        if reason is not None:
            receiver.stats[f"weights/rejected/{reason}"] += 1
        receiver.stats["weights/resyncs"] += 1
        self._drop_transfer()
        self.held, self.active, self.header = None, False, None
        self.failures += 1
        if self.failures > 1:
            wait = min(RESYNC_BACKOFF_S * 2 ** (self.failures - 2), RESYNC_BACKOFF_MAX_S)
            self.resume_at = now + wait
            receiver.stats["weights/resync_backoffs"] += 1
            log.warning("%d resyncs in a row failed verification; asking again in %.1f s", self.failures - 1, wait)
        self.start(sock, receiver, now, self.want)

    def _drop_transfer(self) -> None:
        """An unfinished transfer's buffer can take a later version."""
        if self.buffer is not None and (self.header is None or not self.header.is_delta):
            self.buffers.reuse_later(self.buffer)
        self.buffer = None

    def _request(self, sock, receiver: FetchOwner, index: int) -> None:
        request = WeightsRequest(receiver.worker_id, have_version=receiver.fetched_version,
                                 version=self.header.version, chunk=index, delta_base=self.header.base_version,
                                 layout=receiver.layout_key, session=self.session)
        send_frames(sock, encode(request), receiver.stats, "weights_request")

    def _on_header(self, sock, receiver: FetchOwner, message: WeightsHeader, now: float) -> None:
        if self.header is not None and (message.version, message.base_version) == (self.header.version,
                                                                                   self.header.base_version):
            receiver.stats["weights/held_back"] += 1  # the header of this transfer: a chunk request was held back
            self.reask_due = True
            self._reask(sock, receiver, now)
            return
        if self.want >= 0 and message.version != self.want:
            self.active = False  # this rank has not published it yet (or no longer keeps it): `_Shards` asks again
            receiver.stats["weights/shard_not_ready"] += 1
            return
        if message.version <= receiver.fetched_version:
            self.active = False  # nothing newer released to us yet
            return
        if self.deliver is not None and self.held is not None and self.held[0].version == message.version:
            self.active = False  # held already (a sharded learner's rank asked again): hand it over as it is
            self.deliver(self.held[0], unpack_state_dict(self.held[0], self.held[1]), now)
            return
        if message.is_delta and (self.held is None or self.held[0].version != message.base_version
                                 or not same_layout(self.held[0], message)):
            log.warning("weights version %d came as a delta from version %d, which this worker does not hold; "
                        "fetching it whole", message.version, message.base_version)
            self.resync(sock, receiver, now, "delta_base")
            return
        self._drop_transfer()  # (a transfer of an older version was under way: its buffer is free)
        self.header, self.received, self.reask_due = message, set(), False
        self.buffer = (np.empty(message.payload_bytes, np.uint8) if message.is_delta
                       else self.buffers.take(message.total_bytes))
        receiver.stats["weights/fresh_buffers"] = self.buffers.allocated
        self.last_progress = now
        self.next_chunk = min(receiver.config.weights_pipeline, message.num_chunks)
        for index in range(self.next_chunk):
            self._request(sock, receiver, index)
        if message.num_chunks == 0:
            self._finish(sock, receiver, now)

    def on_message(self, sock, receiver: FetchOwner, message: Message, now: float) -> None:
        if isinstance(message, WeightsHeader):
            self._on_header(sock, receiver, message, now)
        elif isinstance(message, WeightsChunk) and self.header is not None:
            if message.version != self.header.version or message.index in self.received:
                return
            start = message.index * self.header.chunk_bytes
            expected = min(self.header.chunk_bytes, self.header.transfer_bytes - start)
            if len(message.data) != expected:
                receiver.stats["rejected/chunk_length"] += 1
                return
            self.buffer[start:start + expected] = np.frombuffer(message.data, np.uint8)
            self.received.add(message.index)
            self.last_progress = now
            if self.next_chunk < self.header.num_chunks:
                self._request(sock, receiver, self.next_chunk)
                self.next_chunk += 1
            if len(self.received) == self.header.num_chunks:
                self._finish(sock, receiver, now)

    def _rebuild(self, header: WeightsHeader, payload: np.ndarray) -> np.ndarray:
        """The version's packed bytes: the payload itself, or the held bytes with the payload's steps applied;
        checked against the header's per-tensor checksums (`ProtocolError` if anything is off)."""
        layout = Layout.of(header)
        if not header.is_delta:
            if len(payload) != header.total_bytes:
                raise ProtocolError("total_bytes", f"received {len(payload)} bytes, header says "
                                    f"{header.total_bytes}", "length_mismatch")
            if header.checksums and tensor_checksums(layout, payload) != header.checksums:
                raise ProtocolError("checksums", "a tensor does not match its checksum", "checksum")
            return payload
        out = self.buffers.take(header.total_bytes)
        try:
            apply_steps(layout, self.held[1], header.base_version, payload, header.version, out, header.checksums)
        except ProtocolError:
            self.buffers.reuse_later(out)
            raise
        return out

    def _finish(self, sock, receiver: FetchOwner, now: float) -> None:
        header, payload = self.header, self.buffer
        self.active, self.header, self.buffer = False, None, None
        try:
            buffer = self._rebuild(header, payload)
            state = unpack_state_dict(header, buffer)
        except ProtocolError as exc:
            receiver.stats["weights/checksum_failures"] += 1
            log.warning("weights version %d failed verification (%s); fetching it whole", header.version, exc)
            if not header.is_delta:
                self.buffers.reuse_later(payload)
            self.resync(sock, receiver, now, exc.reason)
            return
        self.failures = 0
        receiver.stats["weights/fresh_buffers"] = self.buffers.allocated
        receiver.stats["weights/versions_received"] += 1
        receiver.stats["weights/deltas_applied" if header.is_delta else "weights/full_received"] += 1
        receiver.stats["weights/bytes_received"] += header.transfer_bytes
        if self.held is not None:
            self.buffers.reuse_later(self.held[1])
        # the bytes of the version stay as the next delta's base; without deltas the buffer is reused once free
        self.held = (header, buffer) if receiver.config.weights_deltas else None
        if self.held is None:
            self.buffers.reuse_later(buffer)
        if self.deliver is not None:
            self.deliver(header, state, now)
        elif header.shard:  # slices of a sharded learner, where the whole model was expected: never loaded
            receiver.stats["weights/rejected/shard"] += 1
            log.warning("weights version %d came as one rank's slices, but the learner named no other ranks; "
                        "not loading it", header.version)
        else:
            receiver.deliver(header.version, AdapterWeights(state, header.adapter) if header.adapter else state)
        if self.held is not None and not header.is_delta:
            self.buffers.prepare(header.total_bytes)

    def check_timeout(self, sock, receiver: FetchOwner, now: float) -> None:
        """The I/O loop's turn: give up a transfer silent for ``fetch_timeout_s``; start one the back-off held."""
        if self.active and now - self.last_progress > receiver.config.fetch_timeout_s:
            receiver.stats["weights/fetch_restarts"] += 1
            self.active = False
        if self.deferred is not None and now >= self.resume_at:
            self.start(sock, receiver, now, self.deferred)
        self._reask(sock, receiver, now)

    def _reask(self, sock, receiver: FetchOwner, now: float) -> None:
        """Ask again for the chunks asked for and not received, once the learner held one back and `REASK_S` has
        passed since the last time (a chunk that was only slow then comes twice: the second is ignored)."""
        if not self.reask_due or self.header is None or now < self.reask_at:
            return
        self.reask_due, self.reask_at = False, now + REASK_S
        for index in range(self.next_chunk):
            if index not in self.received:
                self._request(sock, receiver, index)
