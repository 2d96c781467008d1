"""A scoring library's call, bounded and counted: the rewards of the library-backed tasks (``reasoning_gym``,
``verifiers``, the ``math_verify`` extractor and reward) go through `GuardedScore`.

Their scorers are other people's code run on every completion. One that raises on an odd completion, or never
returns on a pathological one, must not end a run that has trained for hours: the call is limited to
``task.reward_timeout_s`` seconds (`TimedCall`), and a call that raises or times out scores 0 and is counted by
outcome (``ok``, ``timeout``, ``error:ValueError``, ...). The counts are the task's ``stats``, which a worker
reports to the learner and every run summary lists (``reward_outcomes``). Only a scorer that hangs again and
again stops the run: each timed-out call leaves a thread stuck inside it, so after `MAX_ABANDONED_CALLS` of
them the run ends with an error naming the library, rather than piling up threads.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from collections import Counter
from typing import Callable

from heterorl.errors import TaskError
from heterorl.tasks.rewards import CallTimedOut, TimedCall

log = logging.getLogger("heterorl.tasks.guarded")
MAX_ABANDONED_CALLS = 8  # timed-out calls (each leaves a stuck thread) before the run is stopped
MAX_OUTCOME_NAME = 48  # characters of an outcome's name (an exception's type name, say)


class GuardedScore:
    """``fn(*args)`` as a reward in [0, 1]: a finite real number, clipped; 0 for a call that raises, returns
    something else, or has not returned within ``timeout_s`` seconds (None: no limit, and the call runs in the
    caller's thread, which a library that uses signals needs). ``stats`` counts every call by outcome; the first
    failure of each kind is logged with what was scored. ``what`` names the library call in messages."""

    def __init__(self, fn: Callable, timeout_s: float | None, what: str, clip: bool = True) -> None:
        self.call = TimedCall(fn, timeout_s)
        self.what = what
        self.clip = clip
        self.stats: Counter = Counter()
        self._lock = threading.Lock()
        self._abandoned = 0

    def __call__(self, *args, where: str = "", **kwargs) -> float:
        try:
            value = self.call(*args, **kwargs)
        except CallTimedOut:
            with self._lock:
                self._abandoned += 1
                abandoned = self._abandoned
            if abandoned > MAX_ABANDONED_CALLS:
                raise TaskError(
                    f"{self.what} has not returned within {self.call.timeout_s:g} s on {abandoned} calls "
                    f"(task.reward_timeout_s); each leaves a thread stuck inside it, so the run stops here. "
                    f"Last: {where}. Raise task.reward_timeout_s or fix the scorer") from None
            return self._failed("timeout", f"did not return within {self.call.timeout_s:g} s", where)
        except Exception as err:
            return self._failed(f"error:{type(err).__name__}"[:MAX_OUTCOME_NAME], f"raised {type(err).__name__}: "
                                f"{str(err)[:200]}", where)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            return self._failed("bad_value", f"returned {value!r:.80} where a finite number was expected", where)
        self.count("ok")
        value = float(value)
        return min(1.0, max(0.0, value)) if self.clip else value

    def count(self, outcome: str) -> int:
        """Count one call that ended as ``outcome`` (a caller's own outcome too: an answer it could not find)."""
        with self._lock:
            self.stats[outcome] += 1
            return self.stats[outcome]

    def _failed(self, outcome: str, what_happened: str, where: str) -> float:
        if self.count(outcome) == 1:
            log.warning("%s %s (%s); scored 0, and counted as %r in the run's reward_outcomes", self.what,
                        what_happened, where or "no details", outcome)
        return 0.0
