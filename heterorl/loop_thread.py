"""One event loop in a thread of its own, for the coroutines of a task's environments (the libraries whose
environments are async: tinker-cookbook's, verifiers')."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading


class LoopThread:
    """One event loop, run by a daemon thread started on first use, for every coroutine of a task's environments.

    The runner calls ``reset`` and ``step`` from whichever of its threads is free, and an env's state between
    calls (an ``asyncio.Lock``, a client session, a coroutine suspended until the policy's next turn) must stay
    on one loop: the cookbook's and verifiers' own rollouts run every env of a run on one loop, and so does this.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
                self._thread.start()
                self._loop = loop
            return self._loop

    def submit(self, coroutine) -> concurrent.futures.Future:
        """``coroutine`` scheduled on the loop; its future, to wait on from another thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine):
        """``coroutine``'s result (or its exception), waited for in the calling thread."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError(f"{self.name}: a coroutine waited for on the loop's own thread would never run")
        return self.submit(coroutine).result()
