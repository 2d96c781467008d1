"""Delayed delivery: hold each message until its due time, then hand it out in due order.

The one implementation behind both delayed paths of the transport: the worker's outbox of trajectories (due when
its trajectories link delivers them) and the learner's weights notices per worker (due when its weights link
does). The caller asks its `DelayLink` (or any ``(send_s, size_bytes) -> due_s | None`` schedule) for the due
time and puts the message with it; a message the link loses is simply not put. Times are seconds on the caller's
clock, passed in, so the queue runs the same on a real, a scaled or a virtual clock::

    due_s = link.schedule(clock.now(), size_bytes)
    if due_s is not None:
        queue.put(due_s, message)
    ...
    for _, _, message in queue.pop_due(clock.now()):
        deliver(message)

Not thread-safe, on purpose: each owner already holds a lock over the state the queue goes with (the worker's
credit counts, the learner's registry), so the queue takes none of its own. Unbounded: the transport's credit
window bounds what a worker holds, and the learner holds at most one notice per published version and worker.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any, Generic, Iterator, TypeVar

M = TypeVar("M")

Held = tuple[float, int, Any]  # (due_s, order, message): what `pop_due` hands out and `restore` takes back


class DelayQueue(Generic[M]):
    """Messages keyed by due time, handed out earliest first, ties in put order (on an order-preserving link that
    is exactly the send order)."""

    def __init__(self) -> None:
        self._heap: list[Held] = []
        self._order = itertools.count()
        self._latest_due_s = -math.inf  # once it has passed, everything held is due (no scan needed)

    def put(self, due_s: float, message: M) -> None:
        heapq.heappush(self._heap, (due_s, next(self._order), message))
        self._latest_due_s = max(self._latest_due_s, due_s)

    def pop_due(self, now_s: float) -> list[Held]:
        """Every held ``(due_s, order, message)`` with ``due_s <= now_s``, earliest first; never blocks."""
        heap = self._heap
        if not heap or heap[0][0] > now_s:
            return []
        if self._latest_due_s <= now_s:  # all due (always so without a delay): one sort, not n heap pops
            due, self._heap, self._latest_due_s = sorted(heap), [], -math.inf
            return due
        due = []
        while heap and heap[0][0] <= now_s:
            due.append(heapq.heappop(heap))
        return due

    def restore(self, held: list[Held]) -> None:
        """Put popped entries back in their old places (a sender that could not send them after all)."""
        for entry in held:
            heapq.heappush(self._heap, entry)
            self._latest_due_s = max(self._latest_due_s, entry[0])

    def count_due(self, now_s: float) -> int:
        """How many messages ``pop_due(now_s)`` would hand out."""
        if self._latest_due_s <= now_s:
            return len(self._heap)
        return sum(1 for entry in self._heap if entry[0] <= now_s)

    def next_due_time(self) -> float | None:
        """Due time of the earliest held message (possibly already past), or None when empty."""
        return self._heap[0][0] if self._heap else None

    def clear(self) -> None:
        self._heap, self._latest_due_s = [], -math.inf

    def __iter__(self) -> Iterator[M]:
        """The held messages, in no particular order."""
        return (entry[2] for entry in self._heap)

    def __len__(self) -> int:
        return len(self._heap)


__all__ = ["DelayQueue", "Held"]
