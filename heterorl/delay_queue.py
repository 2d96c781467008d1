"""Delayed delivery: hold each message until its link says it has arrived, then hand it out in delivery order.

A transport wraps one `DelayQueue` per link, on either path (trajectories up, weights down)::

    queue = DelayQueue(DelayLink(cfg, "worker-3/trajectories"), clock, max_pending=1024)
    queue.put(frame, size_bytes=len(frame))       # when the frame is sent (or received off a real socket)
    frame = queue.get(timeout_s=5.0)              # blocks on a real or scaled clock; None on timeout

Independent of ZeroMQ. Thread-safe: one lock guards the link and the heap.

Back-pressure policy: ``put`` never blocks and never drops silently. When ``max_pending`` undelivered messages
are held it raises `DelayQueueFullError` and keeps nothing, leaving the link's state untouched; the caller stops
reading from its socket (or withholds credit) until ``room()`` is positive again. Lost messages (``loss_prob``)
take no room.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from typing import Generic, TypeVar

from heterorl.clock import Clock
from heterorl.delay import DelayLink
from heterorl.errors import DelayQueueFullError

M = TypeVar("M")


class DelayQueue(Generic[M]):
    """Messages keyed by delivery time on ``clock``; ``get``/``pop_due`` return them once ``clock.now()`` >= it.

    Order: by delivery time, ties in put order. On an order-preserving link that is exactly the send order.
    With a `VirtualClock` nothing blocks: ``get(timeout_s)`` advances the clock to the next delivery (or by
    ``timeout_s`` if none comes sooner), and an event loop can instead drive it with ``next_due_time()``.
    """

    def __init__(self, link: DelayLink, clock: Clock, max_pending: int = 1024):
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"DelayQueue max_pending = {max_pending!r}: must be an integer >= 1")
        self.link = link
        self.clock = clock
        self.max_pending = max_pending
        self._heap: list[tuple[float, int, M]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()

    def put(self, message: M, size_bytes: int = 0) -> float | None:
        """Send ``message`` now (``clock.now()``); returns its delivery time, or None if the link lost it."""
        if message is None:
            raise ValueError("DelayQueue.put(None): None is what get() returns on timeout; wrap the message")
        with self._cond:
            if len(self._heap) >= self.max_pending:
                raise DelayQueueFullError(
                    f"delay queue of link {self.link.name!r} holds max_pending = {self.max_pending} undelivered "
                    "messages: stop reading or withhold credit until room() > 0, or raise max_pending")
            delivery_s = self.link.schedule(self.clock.now(), size_bytes)
            if delivery_s is not None:
                heapq.heappush(self._heap, (delivery_s, next(self._order), message))
                self._cond.notify_all()
            return delivery_s

    def pop_due(self) -> list[M]:
        """Every message whose delivery time has come, in delivery order; never blocks."""
        with self._cond:
            now = self.clock.now()
            due = []
            while self._heap and self._heap[0][0] <= now:
                due.append(heapq.heappop(self._heap)[2])
            return due

    def get(self, timeout_s: float) -> M | None:
        """The next message once it is due, waiting at most ``timeout_s`` clock seconds; None on timeout."""
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"DelayQueue.get timeout_s = {timeout_s!r}: must be finite and >= 0 "
                             "(nothing waits forever on a dead peer)")
        with self._cond:
            deadline_s = self.clock.now() + timeout_s
            while True:
                now = self.clock.now()
                if self._heap and self._heap[0][0] <= now:
                    return heapq.heappop(self._heap)[2]
                if now >= deadline_s:
                    return None
                wake_s = min(deadline_s, self._heap[0][0]) if self._heap else deadline_s
                self.clock.wait_until(self._cond, wake_s)

    def next_due_time(self) -> float | None:
        """Delivery time of the earliest held message (possibly already past), or None when empty."""
        with self._cond:
            return self._heap[0][0] if self._heap else None

    def room(self) -> int:
        """How many more messages ``put`` accepts now."""
        with self._cond:
            return self.max_pending - len(self._heap)

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)


__all__ = ["DelayQueue"]
