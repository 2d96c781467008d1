"""The calls of `heterorl serve`'s sessions (`CallBook`): each a future under an id, bounded in number, run once per
request id, kept for retrieval after it finished, and cancellable; and the service's refusals."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from threading import Lock
from typing import Any, Callable

from heterorl.engines.base import GenerationWatch
from heterorl.errors import HeteroRLError
from heterorl.service import wire


class NotFound(HeteroRLError):
    """A session, sampler, future or weights version the service does not hold (HTTP 404)."""


class BadRequest(HeteroRLError):
    """A call the service cannot run as asked: an unknown method, a bad argument (HTTP 400)."""


class TooBusy(HeteroRLError):
    """More calls are waiting than the service takes, for this session or in all (HTTP 429, Retry-After)."""


@dataclass
class Call:
    """One submitted call: its future, and once it finished, its result or error in wire form. ``watch``: a
    sampling call's brake (`GenerationWatch`), which stops its generation between decode steps."""

    future: Future
    owner: str  # the session it belongs to
    created: float
    sampler: tuple[str, int] | None = None  # (session, version) of the sampler it runs on: never evicted meanwhile
    watch: GenerationWatch | None = None
    done_at: float | None = None
    result: Any = None
    error: dict | None = None


def _is_samples(value: list) -> bool:
    from heterorl.engines.base import SampleOutput

    first = value[0][0] if isinstance(value[0], list) and value[0] else value[0]
    return isinstance(first, SampleOutput)


class CallBook:
    """Every call the service runs: at most ``max_pending_per_session`` waiting or running per session and
    ``max_pending`` in all (`TooBusy` beyond); a ``request_id`` seen before for the same session and method
    returns the first call's id (a retry runs once); finished results are kept ``result_ttl_s`` seconds."""

    def __init__(self, *, result_ttl_s: float, max_pending_per_session: int, max_pending: int) -> None:
        self.result_ttl_s = result_ttl_s
        self.max_pending_per_session, self.max_pending = max_pending_per_session, max_pending
        self._lock = Lock()
        self._calls: dict[str, Call] = {}
        self._requests: OrderedDict[tuple, str] = OrderedDict()  # (session, method, request id) → call id

    def submit(self, owner: str, method: str, request_id: str | None, start: Callable[[], Future], *,
               sampler: tuple[str, int] | None = None, watch: GenerationWatch | None = None) -> str:
        """Start a call of session ``owner`` (``start()`` gives its future); its id."""
        self.expire()
        key = (owner, method, request_id)
        with self._lock:
            if request_id is not None and key in self._requests:
                return self._requests[key]
            self._check_room(owner)
        try:
            future = start()
        except (TypeError, KeyError) as exc:  # arguments the method does not take, or lacks
            raise BadRequest(f"bad arguments: {type(exc).__name__}: {exc}") from None
        call_id = f"f-{uuid.uuid4().hex}"
        call = Call(future, owner, time.monotonic(), sampler=sampler, watch=watch)
        with self._lock:
            self._calls[call_id] = call
            if request_id is not None:
                self._requests[key] = call_id
        future.add_done_callback(lambda f: self._finish(call, f))
        return call_id

    def _check_room(self, owner: str) -> None:
        """`TooBusy` when the session, or the service, already has as many calls waiting or running as it takes
        (called holding the lock)."""
        pending = [c.owner for c in self._calls.values() if c.done_at is None]
        mine = sum(1 for o in pending if o == owner)
        if mine >= self.max_pending_per_session:
            raise TooBusy(f"session {owner} has {mine} calls waiting or running, its limit "
                          f"({self.max_pending_per_session}): wait for their results before sending more")
        if len(pending) >= self.max_pending:
            raise TooBusy(f"this service has {len(pending)} calls waiting or running, its limit: retry later")

    def _finish(self, call: Call, future: Future) -> None:
        try:
            exc = future.exception()
            if exc is not None:
                call.error = wire.error_to_wire(exc)
            else:
                value = future.result()
                call.result = (wire.samples_to_wire(value) if isinstance(value, list) and value
                               and _is_samples(value) else wire.result_to_wire(value))
        except Exception as exc:  # a result that cannot be sent is an error the client hears of, never a hang
            call.error = wire.error_to_wire(exc)  # (a cancelled future's CancelledError too)
        call.done_at = time.monotonic()

    def get(self, call_id: str) -> Call:
        with self._lock:
            call = self._calls.get(call_id)
        if call is None:
            raise NotFound(f"no call {call_id!r}: unknown, or its result expired ({self.result_ttl_s:g} s after "
                           "it finished)")
        return call

    async def poll(self, call: Call, wait_s: float = 0.0) -> dict:
        """The call's state: ``pending``, or ``done`` with its ``result`` or ``error``; waits up to ``wait_s``
        for it to finish (long-poll) without holding a thread."""
        import asyncio

        if call.done_at is None and wait_s > 0:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_s
            done = asyncio.wrap_future(call.future)
            try:
                await asyncio.wait_for(asyncio.shield(done), wait_s)
            except (TimeoutError, Exception, asyncio.CancelledError):  # (a call's own error is in call.error)
                pass
            # the future's done callbacks run in order, and one added before `_finish` (a training call's memory
            # accounting, which trims the allocator) may still be running: the result is in wire form once
            # `_finish` has run, so wait for that too, within the same deadline
            while call.done_at is None and call.future.done() and loop.time() < deadline:
                await asyncio.sleep(0.01)
        if call.done_at is None:
            return {"status": "pending"}
        return {"status": "done", "result": call.result} if call.error is None else {"status": "done",
                                                                                      "error": call.error}

    def cancel(self, call_id: str) -> str:
        """Cancel a call: one still waiting never runs ("cancelled"); a sampling call that runs stops between two
        decode steps ("stopping"); any other running call runs to its end ("running"); "done" if it was."""
        call = self.get(call_id)
        if call.future.done():
            return "done"
        if call.future.cancel():
            return "cancelled"
        if call.watch is not None:
            call.watch.cancel()
            return "stopping"
        return "running"

    def pending(self) -> list[Call]:
        """The calls waiting or running."""
        with self._lock:
            return [c for c in self._calls.values() if c.done_at is None]

    def expire(self) -> None:
        """Forget the results kept past ``result_ttl_s``, and their request ids."""
        cutoff = time.monotonic() - self.result_ttl_s
        with self._lock:
            old = [cid for cid, c in self._calls.items() if c.done_at is not None and c.done_at < cutoff]
            for cid in old:
                del self._calls[cid]
            if old:
                gone = set(old)
                for rid in [r for r, cid in self._requests.items() if cid in gone]:
                    del self._requests[rid]


__all__ = ["BadRequest", "Call", "CallBook", "NotFound", "TooBusy"]
