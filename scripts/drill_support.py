"""What the drill scripts (scripts/*_drill*.py, scripts/hostile_fleet.py) share; each runs as `python scripts/X.py`,
which puts this folder on the import path."""

from __future__ import annotations

import time


def wait(predicate, timeout_s: float, what: str):
    """Poll ``predicate`` every 0.1 s until it returns something true, and return that; TimeoutError naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
