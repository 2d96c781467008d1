"""Run-summary pieces the live learner and the simulated one share: the staleness-in-seconds histogram and
the weights block (what the weights path carried, and how much the deltas saved)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

# upper edges (seconds) of the staleness-in-seconds histogram's bins; the last bin is open
SECONDS_EDGES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)


def seconds_label(value: float) -> str:
    """The histogram bin of ``value`` seconds: "<0.25", "0.25-0.5", ..., "512+"."""
    lower = 0.0
    for edge in SECONDS_EDGES:
        if value < edge:
            return f"<{edge:g}" if lower == 0 else f"{lower:g}-{edge:g}"
        lower = edge
    return f"{SECONDS_EDGES[-1]:g}+"


def seconds_histogram(counts: dict[str, int], values: Iterable[float]) -> dict[str, int]:
    """``counts`` (bin label → groups) with ``values`` added, every bin listed in order (zeros included, so two
    runs' histograms line up)."""
    added = Counter(seconds_label(max(0.0, v)) for v in values)
    labels = [seconds_label(e - 1e-9 if i else 0.0) for i, e in enumerate((0.0, *SECONDS_EDGES))]
    labels.append(seconds_label(math.inf))
    return {label: counts.get(label, 0) + added.get(label, 0) for label in labels}


def run_staleness(counts: dict[str, int], seconds_counts: dict[str, int], seconds_sum: float, groups: int) -> dict:
    """The run summary's staleness histograms: groups trained per staleness in versions (0, 1, 2, ...), the mean
    staleness in seconds and its histogram."""
    hist = [0] * (max(map(int, counts), default=-1) + 1)
    for gap, n in counts.items():
        hist[int(gap)] += n
    return {"staleness_hist": hist, "staleness_seconds_mean": seconds_sum / max(groups, 1),
            "staleness_seconds_hist": seconds_histogram(seconds_counts, [])}


def weights_summary(stats: Counter, dtype: str, deltas: bool, ranks: int = 1) -> dict:
    """The run's weights path from its counters (``weights/*``, kept by `LearnerServer` and the simulation):
    versions published, the bytes of one version in the wire dtype, the mean bytes of the step between two
    versions and their ratio, and what the workers' links carried: transfers, bytes, versions skipped while a
    bandwidth-limited link was busy. ``ranks`` > 1: a sharded learner whose every rank sends its own slices
    (the bytes are rank 0's, one of ``ranks`` about equal shares)."""
    steps = stats.get("weights/steps_encoded", 0)
    step_mean = stats.get("weights/step_bytes", 0) / steps if steps else math.nan
    full = stats.get("weights/version_bytes", 0)
    return {
        "dtype": dtype, "deltas": deltas, "versions": stats.get("weights/versions", 0), "version_bytes": full,
        "step_bytes_mean": step_mean, "bytes_ratio": full / step_mean if steps and step_mean else math.nan,
        "encode_s_mean": stats.get("weights/encode_s", 0.0) / steps if steps else math.nan,
        "link_transfers": stats.get("weights/link_transfers", 0), "link_bytes": stats.get("weights/link_bytes", 0),
        "link_skipped": stats.get("weights/link_skipped", 0), "ranks": ranks,
    }


def weights_line(weights: dict) -> str:
    """One line on the weights path, for `heterorl train`'s closing summary."""
    mb = 1e6
    line = f"weights: {weights['versions']} versions of {weights['version_bytes'] / mb:.3g} MB in {weights['dtype']}"
    if weights.get("ranks", 1) > 1:
        line += f" (rank 0's slices: every one of {weights['ranks']} learner ranks sends its own)"
    if weights["deltas"] and weights["step_bytes_mean"] == weights["step_bytes_mean"]:  # (not NaN)
        line += (f", sent as deltas of {weights['step_bytes_mean'] / mb:.3g} MB a step "
                 f"({weights['bytes_ratio']:.1f}x smaller)")
    elif not weights["deltas"]:
        line += ", each sent whole (transport.weights_deltas off)"
    if weights["link_transfers"]:
        line += (f"; the workers' links carried {weights['link_bytes'] / mb:.3g} MB in {weights['link_transfers']} "
                 "transfers")
        if weights["link_skipped"]:
            line += f", {weights['link_skipped']} versions skipped while a link was busy"
    return line
