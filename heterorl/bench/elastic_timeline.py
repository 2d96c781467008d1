"""The numbers of `heterorl bench elastic`, from what its run left behind: the learner's record of each group it
trained (``RUN_DIR/groups.jsonl``, `heterorl.runtime.accounting.group_records`), the scenario's actions (when
each worker was started, killed, partitioned, healed or removed) and the run's summary. Pure: no processes, so
that each number is tested on records made by hand (tests/bench/test_elastic_timeline.py).

Every time is the wall clock of the one machine the bench runs on (the workers stamp their generation times on
it, the learner its receipt and training times).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from heterorl.runtime.accounting import rollouts_lost

# a worker's state after each action: live (generating and heard), or not
OPENS, CLOSES = frozenset({"start", "heal"}), frozenset({"kill", "partition", "remove"})
SETTLE_S = 10.0  # a window is steady when no action came within this long before it, nor during it
JOIN_TARGET_S, IDLE_TARGET, CAPACITY_TARGET = 10.0, 0.10, 0.80  # issue 65's targets (the bench's docstring)


@dataclass(frozen=True)
class Action:
    """One step of the scenario: at wall time ``t``, ``verb`` (start, kill, partition, heal, remove) to ``worker``
    (``throttle``: its slow-down factor, for a start)."""

    t: float
    verb: str
    worker: str
    throttle: float = 1.0


def live_intervals(actions: list[Action], end: float) -> dict[str, list[tuple[float, float]]]:
    """Each worker's spans of being live: from a start or a heal until a kill, partition or remove (or ``end``)."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    opened: dict[str, float] = {}
    for a in sorted(actions, key=lambda a: a.t):
        if a.verb in OPENS and a.worker not in opened:
            opened[a.worker] = a.t
        elif a.verb in CLOSES and a.worker in opened:
            spans[a.worker].append((opened.pop(a.worker), a.t))
    for worker, since in opened.items():
        spans[worker].append((since, end))
    return dict(spans)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _overlap(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


def worker_rates(records: list[dict]) -> dict[str, float]:
    """Each worker's samples/s while it generated: the trajectories it had trained over the union of its groups'
    generation spans (the groups of one call overlap; a throttled worker's sleep is inside its spans). Measured in
    this run, under its CPU contention: the capacity it showed, not a solo calibration."""
    by_worker: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_worker[r["worker"]].append(r)
    rates = {}
    for worker, mine in by_worker.items():
        seconds = sum(hi - lo for lo, hi in _union([(r["generation_start"], r["generation_end"]) for r in mine]))
        rates[worker] = sum(r["trajectories"] for r in mine) / seconds if seconds > 0 else 0.0
    return rates


def learner_waits(records: list[dict], waits: dict[int, float]) -> list[tuple[float, float]]:
    """The learner's waits for data, one per step: the ``waits`` (step → seconds, its metrics' ``learner/wait_s``)
    just before the step's training began."""
    starts = {r["step"]: r["train_start"] for r in records}
    return _union([(start - waits.get(step, 0.0), start) for step, start in starts.items()])


def learner_rate(records: list[dict], waits: dict[int, float]) -> float:
    """Samples the learner trained per second it did not wait for data (training, publishing, its bookkeeping):
    what it could take if it never waited."""
    if not records:
        return 0.0
    waited = learner_waits(records, waits)
    first, last = waited[0][0] if waited else min(r["train_start"] for r in records), max(
        r["trained_at"] for r in records)
    working = last - first - sum(hi - lo for lo, hi in waited)
    return sum(r["trajectories"] for r in records) / working if working > 0 else 0.0


def windows(records: list[dict], actions: list[Action], waits: dict[int, float], start: float, end: float,
            width: float = 10.0) -> list[dict]:
    """The timeline, one row per ``width`` seconds from ``start``: live workers (time-weighted), samples/s trained
    (groups by when their step ended), the learner's busy fraction (the share of the window it did not wait for
    data, ``waits`` being each step's wait: see `learner_waits`), the capacity line (Σ over workers of their
    measured rate × the share of the window they were live), whether the learner was the bottleneck (the
    capacity line at or above what the learner can train), steadiness, and each worker's staleness mean and max
    over the groups trained in it."""
    live, rates, waited = live_intervals(actions, end), worker_rates(records), learner_waits(records, waits)
    ceiling = learner_rate(records, waits)
    times = sorted(a.t for a in actions)
    rows, lo = [], start
    while lo < end - 1e-9:
        hi = min(lo + width, end)
        span = hi - lo
        shares = {w: _overlap(s, lo, hi) / span for w, s in live.items()}
        inside = [r for r in records if lo <= r["trained_at"] < hi]
        lags: dict[str, list[int]] = defaultdict(list)
        for r in inside:
            lags[r["worker"]].append(r["staleness"])
        capacity = sum(rates.get(w, 0.0) * share for w, share in shares.items())
        rows.append({
            "t": round(lo - start, 3), "seconds": round(span, 3), "live": sum(shares.values()),
            "samples_per_s": sum(r["trajectories"] for r in inside) / span,
            "learner_busy": max(0.0, 1.0 - _overlap(waited, lo, hi) / span), "capacity": capacity,
            "learner_bound": capacity >= ceiling > 0,
            "steady": not any(lo - SETTLE_S < t < hi for t in times),
            "staleness": {w: {"mean": sum(v) / len(v), "max": max(v)} for w, v in sorted(lags.items())},
        })
        lo = hi
    return rows


def first_trained(records: list[dict], actions: list[Action]) -> list[dict]:
    """For each start (a rejoin under an old id too): seconds from it to that worker's first group trained after
    it (None: none was)."""
    found = []
    for a in sorted(actions, key=lambda a: a.t):
        if a.verb != "start":
            continue
        later = [r["trained_at"] for r in records if r["worker"] == a.worker and r["generation_start"] >= a.t]
        found.append({"worker": a.worker, "started": a.t, "first_trained_s": min(later) - a.t if later else None})
    return found


def trained_twice(records: list[dict], dropped_trained: int) -> int:
    """Groups the log shows trained more than once, and ids the learner refused as trained already."""
    return len(records) - len({(r["worker"], r["group_id"]) for r in records}) + dropped_trained


def staleness_by_worker(records: list[dict]) -> dict[str, dict]:
    """Each worker's groups trained and their staleness in versions (mean, max)."""
    lags: dict[str, list[int]] = defaultdict(list)
    for r in records:
        lags[r["worker"]].append(r["staleness"])
    return {w: {"groups": len(v), "mean": sum(v) / len(v), "max": max(v)} for w, v in sorted(lags.items())}


def totals(records: list[dict], actions: list[Action], rows: list[dict], waits: dict[int, float], rollouts: dict,
           dropped_trained: int) -> dict:
    """The run's totals and issue 65's four targets, each with its measured value and a verdict: "met", "not
    met", or "not applicable" (with why)."""
    joins = first_trained(records, actions)
    with_live = [r for r in rows if r["live"] > 0]
    bound = [r for r in with_live if r["learner_bound"]]
    steady = [r for r in with_live if r["steady"]]
    idle_live = sum((1 - r["learner_busy"]) * r["seconds"] for r in with_live)
    idle_bound = (sum((1 - r["learner_busy"]) * r["seconds"] for r in bound) / sum(r["seconds"] for r in bound)
                  if bound else None)
    trained_steady = sum(r["samples_per_s"] * r["seconds"] for r in steady)
    capacity_steady = sum(r["capacity"] * r["seconds"] for r in steady)
    ceiling = learner_rate(records, waits)
    reachable = sum(min(r["capacity"], ceiling) * r["seconds"] for r in steady)
    twice, gone = trained_twice(records, dropped_trained), rollouts_lost(rollouts)
    waits = [j["first_trained_s"] for j in joins]
    slowest = None if None in waits or not waits else max(waits)

    def verdict(value, ok: bool, shown: str, why_not_applicable: str = "") -> dict:
        if value is None:
            return {"value": None, "shown": "-", "verdict": f"not applicable ({why_not_applicable})"}
        return {"value": value, "shown": shown, "verdict": "met" if ok else "not met"}

    capacity_frac = trained_steady / capacity_steady if capacity_steady else None
    return {
        "rollouts": rollouts, "lost": gone, "trained_twice": twice, "groups_trained": len(records),
        "learner_idle_s_while_live": idle_live, "learner_rate": ceiling, "rates": worker_rates(records),
        "joins": joins, "staleness": staleness_by_worker(records), "steady_capacity_frac": capacity_frac,
        "steady_reachable_frac": trained_steady / reachable if reachable else None,
        "targets": {
            "nothing lost or trained twice": verdict(
                gone + twice, gone == 0 and twice == 0, f"{gone} lost, {twice} trained twice"),
            "learner idle < 10% while a worker is live and the learner is the bottleneck": verdict(
                idle_bound, idle_bound is not None and idle_bound < IDLE_TARGET,
                f"{idle_bound:.1%} idle over {len(bound)} windows" if bound else "",
                "the learner was never the bottleneck"),
            "a joining worker's first group trained <= 10 s after it starts": verdict(
                slowest, slowest is not None and slowest <= JOIN_TARGET_S, f"the slowest {slowest or 0:.1f} s",
                "a joiner had no group trained"),
            "throughput >= 80% of the live capacity line in steady phases": verdict(
                capacity_frac, capacity_frac is not None and capacity_frac >= CAPACITY_TARGET,
                f"{capacity_frac or 0:.0%} of the capacity line over {len(steady)} windows "
                f"({(trained_steady / reachable if reachable else 0):.0%} of min(capacity, learner))",
                "no steady window"),
        },
    }


def plot(rows: list[dict], actions: list[Action], start: float, path, learner: float = 0.0) -> None:
    """Samples/s trained against the capacity line (and ``learner``: what the learner trains per second it does
    not wait), the live workers and the learner's busy fraction, with the scenario's actions marked, in one
    figure at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mid = [r["t"] + r["seconds"] / 2 for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(2, 1))
    top.plot(mid, [r["samples_per_s"] for r in rows], marker="o", label="samples/s trained")
    top.plot(mid, [r["capacity"] for r in rows], linestyle="--", label="capacity (live workers' measured rates)")
    if learner:
        top.axhline(learner, color="tab:green", linestyle=":", label="the learner's rate when it never waits")
    top.set_ylabel("samples/s")
    top.set_ylim(bottom=0)
    top.legend(loc="upper right", fontsize=8)
    bottom.step(mid, [r["live"] for r in rows], where="mid", label="live workers")
    bottom.set_ylabel("live workers")
    busy = bottom.twinx()
    busy.plot(mid, [r["learner_busy"] for r in rows], color="tab:red", label="learner busy")
    busy.set_ylim(0, 1.05)
    busy.set_ylabel("learner busy fraction")
    bottom.set_xlabel("seconds since the scenario began")
    marks: list[tuple[float, str, list[str]]] = []  # one mark per verb for the actions of one moment
    for a in sorted(actions, key=lambda a: a.t):
        if marks and marks[-1][1] == a.verb and a.t - marks[-1][0] < 2.0:
            marks[-1][2].append(a.worker)
        else:
            marks.append((a.t, a.verb, [a.worker]))
    for t, verb, workers in marks:
        top.axvline(t - start, color="grey", linewidth=0.5)
        top.text(t - start, 0.02, f" {verb} {' '.join(workers)}", rotation=90, fontsize=7, va="bottom",
                 transform=top.get_xaxis_transform())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
