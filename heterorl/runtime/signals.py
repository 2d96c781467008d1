"""How the runtime's processes take SIGTERM and SIGINT: one helper that sets a handler for the length of a block
and puts the earlier ones back (the learner stops after its step, a learner rank > 0 ignores them, a rollout
worker is interrupted)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable

Handler = Callable | int | signal.Handlers


@contextlib.contextmanager
def signal_handlers(handler: Handler, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)):
    """``handler`` for ``signals`` during the block, the earlier handlers back after it. Only the main thread may
    set handlers: elsewhere (a learner or worker run from a library's thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)


@contextlib.contextmanager
def stop_after_step(stopped_by: Callable[[], str | None], request: Callable[[str], None],
                    announce: Callable[[str], None]):
    """SIGTERM and SIGINT during the block ask a loop to stop after its step in progress: the first one calls
    ``request(NAME)`` and ``announce(NAME)`` (NAME: ``SIGINT``, ``SIGTERM``); a second one, once ``stopped_by()``
    is set, raises KeyboardInterrupt to stop at once. Used by the learner and by the sync loops of sft and rl."""

    def on_signal(signum, _frame) -> None:
        name = signal.Signals(signum).name
        if stopped_by():
            raise KeyboardInterrupt(f"{name} again: stopping at once")
        request(name)
        announce(name)

    with signal_handlers(on_signal):
        yield
