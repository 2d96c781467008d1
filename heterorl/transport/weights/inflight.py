"""The bytes of chunk replies a weights server has handed to ZeroMQ and ZeroMQ has not yet handed to the network
(`BytesInFlight`), per holder — the CURVE key of the worker asking, else its worker id, so the ids of one key
share one bound — and in all, each held under its bound.

A peer that asks for chunks and never reads leaves its replies queued in ZeroMQ (up to ``weights_hwm`` a connection,
any number of connections). Each chunk reply is therefore a copy of its chunk (`WeightsStore.reply`), not a view of
the version's buffer: a queued view would keep its whole version alive for as long as the peer stays connected (one
version per stuck chunk, however old), where a copy keeps only its own bytes, and those are what this count bounds.
Freed copies stay with the allocator for reuse (the next chunks take them: no page faults), so once the bytes
counted fall by `TRIM_AFTER_BYTES` from their peak (a peer that did not read went) and no reply was added for
`TRIM_IDLE_S`, the allocator is told to give its free memory back to the system (`malloc_trim`). The copy costs one
memory pass over each chunk sent (docs/RELIABILITY.md, "Weights serving", has the measurement). A chunk request that
would take its holder past ``per_worker``, or every holder past ``total``, is answered with its transfer's header
instead (`WeightsStore.reply`), and the worker asks again for the chunks it lacks a moment later
(`heterorl.transport.client.fetch`). An honest fetch has at most its pipeline out (the default bound is twice that),
but ZeroMQ says a frame is sent a little after the fact (pyzmq releases it on its own thread), so it can meet the
bound for a moment; it then waits that moment, never ``fetch_timeout_s``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections import Counter

import zmq

from heterorl.config import TransportConfig

TRIM_AFTER_BYTES = 64 * 2**20  # bytes in flight freed since their peak before free memory goes back to the system
TRIM_IDLE_S = 5.0  # ... once no reply was added for this long (a run that fetches every step keeps its memory warm)


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere): give the allocator's free memory back to the system."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


class BytesInFlight:
    """Reply frames not yet sent, by worker: (their ZeroMQ tracker, their bytes). ``bytes``: the sum, as of the
    last `room`. Counts into ``stats``: ``weights/held_back`` (requests beyond a bound), ``weights/bytes_in_flight``
    and its peak. Not thread-safe: its owner's lock guards it."""

    def __init__(self, per_worker: int, total: int, stats: Counter) -> None:
        self.per_worker, self.total, self.stats = per_worker, total, stats
        self.bytes = 0
        self._peak, self._added_at = 0, 0.0  # the most bytes counted since the last trim, the last reply added
        self._frames: dict[str, list[tuple[zmq.MessageTracker, int]]] = {}

    @classmethod
    def of(cls, config: TransportConfig, stats: Counter) -> BytesInFlight:
        """The bounds of ``config``: ``weights_bytes_in_flight_per_worker`` (0: twice a fetch's pipeline,
        ``weights_chunk_bytes`` × ``weights_pipeline`` × 2) and ``weights_bytes_in_flight``."""
        pipeline = config.weights_chunk_bytes * config.weights_pipeline
        return cls(config.weights_bytes_in_flight_per_worker or 2 * pipeline, config.weights_bytes_in_flight, stats)

    def of_worker(self, worker_id: str) -> int:
        """The bytes ``worker_id``'s replies still hold (as of the last `room`)."""
        return sum(nbytes for _, nbytes in self._frames.get(worker_id, ()))

    def settle_all(self) -> None:
        """Count out every reply ZeroMQ has finished with (sent, or dropped with its connection): a holder that
        never asks again is counted out too (the server's housekeeping calls this); and once the count has fallen
        `TRIM_AFTER_BYTES` below its peak since the last trim and no reply was added for `TRIM_IDLE_S`, give the
        freed copies' memory back."""
        for holder in list(self._frames):
            self._settle(holder)
        if (self._peak - self.bytes >= TRIM_AFTER_BYTES and time.monotonic() - self._added_at >= TRIM_IDLE_S
                and MALLOC_TRIM is not None):
            MALLOC_TRIM(0)
            self.stats["weights/memory_trims"] += 1
            self._peak = self.bytes

    def room(self, worker_id: str, nbytes: int) -> bool:
        """Whether a reply of ``nbytes`` more to ``worker_id`` keeps both bounds, counting only the replies
        ZeroMQ has not finished with."""
        self._settle(worker_id)
        if self.bytes + nbytes > self.total:
            for other in list(self._frames):
                self._settle(other)
        room = self.of_worker(worker_id) + nbytes <= self.per_worker and self.bytes + nbytes <= self.total
        self.stats["weights/held_back"] += not room
        return room

    def add(self, worker_id: str, frame: zmq.Frame, nbytes: int) -> None:
        """``frame`` (made with ``track=True``), ``nbytes`` long, is a reply to ``worker_id``."""
        self._frames.setdefault(worker_id, []).append((frame.tracker, nbytes))
        self.bytes += nbytes
        self._peak, self._added_at = max(self._peak, self.bytes), time.monotonic()
        self.stats["weights/bytes_in_flight"] = self.bytes
        self.stats["weights/bytes_in_flight_peak"] = max(self.stats["weights/bytes_in_flight_peak"], self.bytes)

    def _settle(self, worker_id: str) -> None:
        frames = self._frames.get(worker_id)
        if frames is None:
            return
        unsent = [(tracker, nbytes) for tracker, nbytes in frames if not tracker.done]
        self.bytes -= sum(nbytes for _, nbytes in frames) - sum(nbytes for _, nbytes in unsent)
        if unsent:
            self._frames[worker_id] = unsent
        else:
            del self._frames[worker_id]
        self.stats["weights/bytes_in_flight"] = self.bytes


__all__ = ["BytesInFlight"]
