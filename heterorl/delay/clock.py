"""Clocks: where a live run's delay links get their time.

Two clocks share one interface (`Clock`), in seconds as floats:

- `RealClock`: wall time (``time.monotonic``); a delay of 1,800 s takes 1,800 s.
- `ScaledClock(factor)`: real time sped up. ``now()`` returns *simulated* seconds, which pass ``factor`` times
  faster than real ones: at factor 100, a delay of 1,800 simulated seconds takes 18 real seconds.

``factor`` says how many of the clock's seconds pass in one real second (1 for `RealClock`): a sender that waits
in real time for a message due on the clock divides by it. The simulated execution keeps its own virtual time (a
float it moves from event to event: heterorl.runtime.simulate) and needs no clock object.

Readings are comparable only between calls on the same clock object (each has its own origin).
"""

from __future__ import annotations

import math
import time
from typing import Protocol, runtime_checkable

from heterorl.config import Config
from heterorl.errors import ClockError


@runtime_checkable
class Clock(Protocol):
    factor: float  # the clock's seconds per real second

    def now(self) -> float:
        """Seconds on this clock's own time line (monotonic, never decreasing)."""


class RealClock:
    """Wall time: ``now() = time.monotonic()``."""

    factor = 1.0

    def now(self) -> float:
        return time.monotonic()


class ScaledClock:
    """Real time sped up by ``factor``: ``now() = (time.monotonic() − t_created)·factor`` simulated seconds.

    Delays and timeouts are given in simulated seconds, so a config written for the paper's 1,800 s runs
    unchanged, only faster.
    """

    def __init__(self, factor: float):
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ClockError(f"ScaledClock factor = {factor!r}: must be a finite number > 0 "
                             "(e.g. 100 makes 1,800 simulated seconds pass in 18 real seconds)")
        self.factor = float(factor)
        self._origin = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self.factor


def delay_clock(cfg: Config) -> Clock:
    """The clock of a live run's delay links: real time, or ``delay.time_scale`` times faster."""
    return RealClock() if cfg.delay.time_scale == 1.0 else ScaledClock(cfg.delay.time_scale)


__all__ = ["Clock", "RealClock", "ScaledClock", "delay_clock"]
