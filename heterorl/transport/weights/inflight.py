"""The bytes of chunk replies a weights server has handed to ZeroMQ and ZeroMQ has not yet handed to the network
(`BytesInFlight`), per worker and in all, each held under its bound.

A peer that asks for chunks and never reads leaves its replies queued in ZeroMQ (up to ``weights_hwm`` a
connection, any number of connections). Each chunk reply is therefore a copy of its chunk (`WeightsStore.reply`),
not a view of the version's buffer: a queued view would keep its whole version alive for as long as the peer
stays connected (one version per stuck chunk, however old), where a copy keeps only its own bytes, and those are
what this count bounds. The copy costs one memory pass over each chunk sent (docs/RELIABILITY.md, "Weights
serving", has the measurement). A chunk request that would take a worker past ``per_worker``, or every worker
past ``total``, is answered with its transfer's header instead (`WeightsStore.reply`), and the worker asks again
for the chunks it lacks a moment later (`heterorl.transport.client.fetch`). An honest fetch has at most its
pipeline out (the default bound is twice that), but ZeroMQ says a frame is sent a little after the fact (pyzmq
releases it on its own thread), so it can meet the bound for a moment; it then waits that moment, never
``fetch_timeout_s``.
"""

from __future__ import annotations

from collections import Counter

import zmq

from heterorl.config import TransportConfig


class BytesInFlight:
    """Reply frames not yet sent, by worker: (their ZeroMQ tracker, their bytes). ``bytes``: the sum, as of the
    last `room`. Counts into ``stats``: ``weights/held_back`` (requests beyond a bound), ``weights/bytes_in_flight``
    and its peak. Not thread-safe: its owner's lock guards it."""

    def __init__(self, per_worker: int, total: int, stats: Counter) -> None:
        self.per_worker, self.total, self.stats = per_worker, total, stats
        self.bytes = 0
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


__all__ = ["BytesInFlight"]
