"""The rollout workers of the weight benchmarks (`bench weights`, `bench reshard`), as threads beside the
publisher: `load_versions`, a worker's loop, loads each version and reports when; `applied_times`, the
publisher's side, waits until every worker has reported a version and says when each did."""

from __future__ import annotations

import queue
import time
from typing import Callable

import torch

from heterorl.errors import HeteroRLError


def load_versions(client, load: Callable[[dict[str, torch.Tensor]], object], versions: int, timeout_s: float,
                  reports: queue.Queue) -> None:
    """A rollout worker's side: wait for each of versions 0..``versions`` (``client``'s ``wait_weights``), hand
    its state to ``load`` (into the worker's own copy), report (version, when loaded, None) on ``reports`` and
    tell the learner the version held. A failure is reported as (version held, None, the error), for the
    publishing thread to raise (`applied_times`)."""
    held = -1
    try:
        for _ in range(versions + 1):
            got = client.wait_weights(held, timeout_s)
            if got is None:
                raise TimeoutError(f"{client.worker_id}: no weights newer than version {held} in {timeout_s:.0f} s")
            held = got[0]
            load(got[1])
            reports.put((held, time.perf_counter(), None))
            del got  # its receive buffer can take a later version
            client.set_version_held(held)
    except Exception as exc:
        reports.put((held, None, exc))


def applied_times(reports: queue.Queue, version: int, workers: int, timeout_s: float) -> list[float]:
    """When each of ``workers`` workers loaded ``version`` (`load_versions`' reports); HeteroRLError when one
    reports nothing within ``timeout_s``, failed, or loaded another version."""
    times = []
    for _ in range(workers):
        try:
            held, at, error = reports.get(timeout=timeout_s)
        except queue.Empty:
            raise HeteroRLError(f"version {version}: a worker reported nothing in {timeout_s:.0f} s") from None
        if error is not None:
            raise HeteroRLError(f"a worker failed at version {held}: {error}") from error
        if held != version:
            raise HeteroRLError(f"a worker loaded version {held} while version {version} was the newest")
        times.append(at)
    return times


__all__ = ["applied_times", "load_versions"]
