"""Clocks: where the delay injector and the loops around it get their time.

Three clocks share one interface (`Clock`), in seconds as floats:

- `RealClock`: wall time (``time.monotonic``); a delay of 1,800 s takes 1,800 s.
- `ScaledClock(factor)`: real time sped up. ``now()`` returns *simulated* seconds, which pass ``factor`` times
  faster than real ones: at factor 100, 1,800 simulated seconds take 18 real seconds, ``sleep(1800)`` sleeps 18 s.
- `VirtualClock`: deterministic simulation in one process. Time moves only when someone moves it
  (``advance``/``advance_to``, or ``sleep``/``wait_until``, which move it instead of blocking).

Readings are comparable only between calls on the same clock object (each has its own origin).
Non-positive durations (``sleep(-1)``) return at once, so loops need not clamp their remaining time.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Protocol, runtime_checkable

from heterorl.config import Config
from heterorl.errors import ClockError


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock's own time line (monotonic, never decreasing)."""

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` of this clock's time pass."""

    def wait_until(self, condition: threading.Condition, deadline_s: float) -> None:
        """With ``condition`` held by the caller: wait until notified or until ``now() >= deadline_s``.

        May return early (a notification or a spurious wake-up): callers re-check their state in a loop.
        """


class RealClock:
    """Wall time: ``now() = time.monotonic()``."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    def wait_until(self, condition: threading.Condition, deadline_s: float) -> None:
        condition.wait(max(0.0, deadline_s - self.now()))


class ScaledClock:
    """Real time sped up by ``factor``: ``now() = (time.monotonic() − t_created)·factor`` simulated seconds.

    ``sleep(s)`` sleeps ``s / factor`` real seconds. Delays and timeouts are given in simulated seconds,
    so a config written for the paper's 1,800 s runs unchanged, only faster.
    """

    def __init__(self, factor: float):
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ClockError(f"ScaledClock factor = {factor!r}: must be a finite number > 0 "
                             "(e.g. 100 makes 1,800 simulated seconds pass in 18 real seconds)")
        self.factor = float(factor)
        self._origin = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self.factor

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds) / self.factor)

    def wait_until(self, condition: threading.Condition, deadline_s: float) -> None:
        condition.wait(max(0.0, deadline_s - self.now()) / self.factor)


class VirtualClock:
    """Simulated time that moves only when advanced; for deterministic discrete-event runs in one process.

    A discrete-event loop drains what is due, then jumps to the next event::

        while events_left:
            handle(queue.pop_due())
            clock.advance_to(queue.next_due_time())

    ``sleep(d)`` and ``wait_until(cond, t)`` never block: they advance the clock (to ``now + d``, to ``t``), as if
    the wait had run to its end with nothing else happening — which in a single-threaded simulation is the case.
    """

    def __init__(self, start_s: float = 0.0):
        self._now = float(start_s)
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._now

    def advance_to(self, t_s: float) -> float:
        """Set the time to ``t_s`` (>= now); returns it. Moving backwards is an error: time in a simulation
        only goes forward, and asking otherwise means events were handled out of order."""
        with self._lock:
            if not t_s >= self._now:  # also rejects NaN
                raise ClockError(f"VirtualClock.advance_to({t_s!r}) is before now ({self._now!r}): "
                                 "a virtual clock only moves forward; drain due events before advancing")
            self._now = float(t_s)
            return self._now

    def advance(self, dt_s: float) -> float:
        """Move forward by ``dt_s`` >= 0 seconds; returns the new time."""
        if not dt_s >= 0:
            raise ClockError(f"VirtualClock.advance({dt_s!r}): the step must be >= 0 seconds")
        with self._lock:
            self._now += float(dt_s)
            return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def wait_until(self, condition: threading.Condition, deadline_s: float) -> None:
        with self._lock:
            self._now = max(self._now, float(deadline_s))


def delay_clock(cfg: Config) -> Clock:
    """The clock of a live run's delay links: real time, or ``delay.time_scale`` times faster."""
    return RealClock() if cfg.delay.time_scale == 1.0 else ScaledClock(cfg.delay.time_scale)


__all__ = ["Clock", "RealClock", "ScaledClock", "VirtualClock", "delay_clock"]
