"""A runtime run's accounting, one owner for the live learner and the simulated one: what each step trained and
how stale it was (`RunTally`, kept in the learner's checkpoints), the metrics of one step (`step_metrics`), the
rollouts wasted by reason (`rollout_waste`), the weights block (`weights_summary`), and the closing summary that
`heterorl train` prints (`summary_text`)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import numpy as np

from heterorl.rollout.spans import turn_metrics
from heterorl.runs import RunResult, format_table, idle_fraction, json_text, outcomes_line, without_update_note

if TYPE_CHECKING:
    from heterorl.runtime.buffer import Group, GroupBuffer

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


def weights_summary(stats: Counter, dtype: str, deltas: bool, ranks: int = 1, fleet: dict | None = None) -> dict:
    """The run's weights path from its counters (``weights/*``, kept by `LearnerServer` and the simulation):
    versions published, the bytes of one version in the wire dtype, the mean bytes of the step between two
    versions and their ratio, the payload bytes the learner sent, and what the workers' delay-model links
    carried: transfers, bytes, versions skipped while a bandwidth-limited link was busy. ``ranks`` > 1: a sharded
    learner whose every rank sends its own slices (the bytes are rank 0's, one of ``ranks`` about equal shares).
    ``fleet`` (a live learner's `fleet_totals`): the versions the workers had whole, timed from their publish,
    and the mean and most of those seconds (by the hosts' wall clocks; NaN when none was timed)."""
    steps = stats.get("weights/steps_encoded", 0)
    arrived = int((fleet or {}).get("weights_arrived", 0))
    step_mean = stats.get("weights/step_bytes", 0) / steps if steps else math.nan
    full = stats.get("weights/version_bytes", 0)
    return {
        "dtype": dtype, "deltas": deltas, "versions": stats.get("weights/versions", 0), "version_bytes": full,
        "step_bytes_mean": step_mean, "bytes_ratio": full / step_mean if steps and step_mean else math.nan,
        "encode_s_mean": stats.get("weights/encode_s", 0.0) / steps if steps else math.nan,
        "link_transfers": stats.get("weights/link_transfers", 0), "link_bytes": stats.get("weights/link_bytes", 0),
        "link_skipped": stats.get("weights/link_skipped", 0), "ranks": ranks,
        "bytes_sent": stats.get("weights/bytes_sent", 0), "arrived": arrived,
        "arrival_s_mean": fleet["weights_arrival_s"] / arrived if arrived else math.nan,
        "arrival_s_max": fleet["weights_arrival_max_s"] if arrived else math.nan,
    }


def _known(value) -> bool:
    """A number was measured: not None (a NaN that summary.json wrote as null) and not NaN."""
    return value is not None and value == value


def _measured(summary: dict, *keys: str) -> dict:
    """``summary`` with each of ``keys`` that holds null (a NaN written to JSON: nothing measured, e.g. a run
    stopped before its first step) as NaN, which formats as "nan" where None would not format at all."""
    return {**summary, **{key: math.nan for key in keys if summary.get(key) is None}}


def weights_line(weights: dict) -> str:
    """One line on the weights path, for `heterorl train`'s closing summary."""
    mb = 1e6
    line = f"weights: {weights['versions']} versions of {weights['version_bytes'] / mb:.3g} MB in {weights['dtype']}"
    if weights.get("ranks", 1) > 1:
        line += f" (rank 0's slices: every one of {weights['ranks']} learner ranks sends its own)"
    if weights["deltas"] and _known(weights["step_bytes_mean"]):
        line += (f", sent as deltas of {weights['step_bytes_mean'] / mb:.3g} MB a step "
                 f"({weights['bytes_ratio']:.1f}x smaller)")
    elif not weights["deltas"]:
        line += ", each sent whole (transport.weights_deltas off)"
    if weights["link_transfers"]:
        line += (f"; the workers' links carried {weights['link_bytes'] / mb:.3g} MB in {weights['link_transfers']} "
                 "transfers")
        if weights["link_skipped"]:
            line += f", {weights['link_skipped']} versions skipped while a link was busy"
    if weights.get("arrived") and _known(weights.get("arrival_s_mean")):
        line += (f"; a version reached a worker {weights['arrival_s_mean']:.2f} s after its publish on average "
                 f"(at most {weights['arrival_s_max']:.2f} s)")
    return line


@dataclass(kw_only=True)
class LearnerResult(RunResult):
    """A runtime run's result (live or simulated): the RL result and what the fleet did."""

    staleness_mean: float  # versions, over every trained group
    staleness_max: int
    staleness_p50: float  # the median and 95th percentile of the same (linear interpolation)
    staleness_p95: float
    tokens_per_s: float  # completion tokens trained per second of wall (or virtual) time
    learner_idle_frac: float
    worker_idle_frac: float
    # per sampling engine of the fleet: samples/s, staleness, training–inference mismatch (runtime.engine_stats)
    engines: dict[str, dict] = field(default_factory=dict)
    # trajectories generated, trained and discarded by reason, and the fraction wasted (`rollout_waste`)
    rollouts: dict = field(default_factory=dict)
    staleness_hist: list[int] = field(default_factory=list)  # groups trained at staleness 0, 1, 2, ... versions
    staleness_seconds_mean: float = 0.0  # seconds from a group's oldest version's publish to its training
    staleness_seconds_hist: dict[str, int] = field(default_factory=dict)  # the same by bin (accounting)
    samples_per_s: float = 0.0  # trajectories trained per second of wall (or virtual) time
    weights: dict = field(default_factory=dict)  # the weights path (`accounting.weights_summary`)


@dataclass
class RunTally:
    """What a run has trained and how stale it was, over its whole life (a resumed learner's goes on from its
    checkpoint): kept step by step by the live learner and by the simulation alike, and turned into the summary's
    fields by `summary_fields`. Staleness is in versions (the learner's version − a group's oldest token version)
    and in seconds (from that version's publish to the group's training), both on the learner's clock."""

    groups_trained: int = 0
    trajectories_trained: int = 0
    tokens_trained: int = 0  # the policy's completion tokens (an episode's environment tokens are not trained)
    staleness_sum: float = 0.0
    staleness_max: int = 0
    staleness_counts: dict[str, int] = field(default_factory=dict)  # staleness in versions → groups trained
    staleness_seconds_sum: float = 0.0
    staleness_seconds_counts: dict[str, int] = field(default_factory=dict)  # `seconds_histogram`
    idle_s: float = 0.0  # the learner's wait for data, on the run's clock (virtual in a simulation)
    elapsed_s: float = 0.0  # the run's clock

    def add_batch(self, groups: list[Group], staleness: list[int], staleness_s: list[float]) -> None:
        """Count one trained batch of whole ``groups`` with their staleness in versions and in seconds."""
        self.tokens_trained += sum(t.policy_token_count for g in groups for t in g.trajectories)
        self.groups_trained += len(groups)
        self.trajectories_trained += sum(len(g.trajectories) for g in groups)
        self.staleness_sum += sum(staleness)
        self.staleness_max = max(self.staleness_max, max(staleness))
        for gap in staleness:
            self.staleness_counts[str(gap)] = self.staleness_counts.get(str(gap), 0) + 1
        self.staleness_seconds_sum += sum(staleness_s)
        self.staleness_seconds_counts = seconds_histogram(self.staleness_seconds_counts, staleness_s)

    def summary_fields(self) -> dict:
        """The `LearnerResult` fields this tally holds: staleness (mean, max, p50, p95, histograms in versions
        and seconds), trained tokens and samples per second and the learner's idle fraction, per second of the
        run's clock."""
        elapsed = max(self.elapsed_s, 1e-9)
        return {
            "staleness_mean": self.staleness_sum / max(self.groups_trained, 1), "staleness_max": self.staleness_max,
            **staleness_percentiles({int(k): n for k, n in self.staleness_counts.items()}),
            "tokens_per_s": self.tokens_trained / elapsed, "learner_idle_frac": self.idle_s / elapsed,
            **run_staleness(self.staleness_counts, self.staleness_seconds_counts, self.staleness_seconds_sum,
                            self.groups_trained),
            "samples_per_s": self.trajectories_trained / elapsed,
        }


def staleness_percentiles(counts: dict[int, int]) -> dict[str, float]:
    """``staleness_p50`` and ``staleness_p95`` of the groups trained, from {staleness: groups} (0 when none)."""
    if not counts:
        return {"staleness_p50": 0.0, "staleness_p95": 0.0}
    values = np.repeat(np.array(list(counts), dtype=float), list(counts.values()))
    return {"staleness_p50": float(np.percentile(values, 50)), "staleness_p95": float(np.percentile(values, 95))}


def _histogram(values: list[int]) -> list[int]:
    return np.bincount(np.asarray(values, dtype=np.int64)).tolist() if values else []


def step_metrics(groups: list[Group], staleness: list[int], staleness_s: list[float], *, version: int,
                 buffer: GroupBuffer, tally: RunTally, workers_busy_s: float, workers_idle_s: float) -> dict:
    """The metrics of one learner step that the live learner and the simulated one share: the batch's reward,
    length and staleness (in versions and seconds), the new version, the buffer's state and counters, idle
    fractions and trained-token throughput (per second of the run's clock, from ``tally``)."""
    rewards = [t.reward for g in groups for t in g.trajectories]
    tokens = sum(len(t.completion_tokens) for g in groups for t in g.trajectories)
    trajectories = [t for g in groups for t in g.trajectories]
    # the versions of the policy's tokens (an episode's environment tokens carry their turn's version, not drawn)
    stamps = [t.policy_versions[t.policy_mask()] if t.env_spans else t.policy_versions for t in trajectories]
    stamps = [s for s in stamps if len(s)]
    token_gaps = version - 1 - np.concatenate(stamps) if stamps else np.zeros(1)
    episodes = turn_metrics((t.env_spans, len(t.completion_tokens)) for t in trajectories)
    if episodes:  # multi-turn: per episode, its oldest policy token's staleness and the versions its turns spanned
        episodes.update({"staleness/episode_versions_mean": float(np.mean([version - 1 - s.min() for s in stamps])),
                         "staleness/episode_versions_span_mean": float(np.mean([s.max() - s.min() for s in stamps]))})
    return {
        "rollout/reward_mean": float(np.mean(rewards)),
        "rollout/reward_std": float(np.std(rewards)),
        "rollout/completion_len": tokens / len(rewards),
        "staleness/versions_mean": float(np.mean(staleness)),
        "staleness/versions_max": int(max(staleness)),
        "staleness/versions_hist": _histogram(staleness),
        # per token (the version that drew each one: several in a trajectory that took in-flight updates)
        "staleness/token_versions_mean": float(token_gaps.mean()),
        "staleness/spanning_frac": float(np.mean([s.min() != s.max() for s in stamps])) if stamps else 0.0,
        "staleness/seconds_mean": float(np.mean(staleness_s)),
        "staleness/seconds_max": float(max(staleness_s)),
        "policy/version": version,
        "buffer/groups": len(buffer),
        **{f"buffer/{k}": v for k, v in buffer.counters.items()},
        "learner/idle_frac": tally.idle_s / max(tally.elapsed_s, 1e-9),
        "workers/idle_frac": idle_fraction(workers_idle_s, workers_busy_s),
        "throughput/tokens_per_s": tally.tokens_trained / max(tally.elapsed_s, 1e-9),
        **episodes,
    }


def rollout_waste(*, generated: int, trained: int, buffer: GroupBuffer, left_over: int, **more: int) -> dict:
    """The run's rollouts: ``generated`` (trajectories that reached the learner, refused ones included),
    ``trained``, ``discarded`` by reason (the buffer's `GroupBuffer.discarded`, and ``more``: refused by the
    transport, dropped with their group, already trained before a restart), ``left_over`` (buffered, never
    trained: the run ended), ``discarded_frac`` and ``wasted_frac``: the shares of generated trajectories
    discarded, and not trained (discarded or left over)."""
    discarded = {**{k: 0 for k in ("stale", "overflow", "partial", "inconsistent")}, **buffer.discarded, **more}
    share = (lambda n: n / generated) if generated else (lambda n: 0.0)
    return {"generated": generated, "trained": trained, "discarded": discarded, "left_over": left_over,
            "discarded_frac": share(sum(discarded.values())), "wasted_frac": share(max(0, generated - trained))}


GROUP_LOG = "groups.jsonl"  # logging.group_log: one line per group the live learner trained


def group_records(groups: list[Group], staleness: list[int], *, step: int, version: int, train_start: float,
                  trained_at: float) -> list[dict]:
    """One record per group trained at ``step`` from weights ``version``: the worker that sampled it, its id, its
    oldest token version and staleness (versions), its trajectories, when it was generated (the worker's clock:
    first start, last end), when its last member arrived and when the step that trained it began and ended (the
    learner's wall clock). `heterorl bench elastic` builds its timeline from these."""
    return [{"step": step, "version": version, "worker": g.trajectories[0].sampler_id, "group_id": g.group_id,
             "oldest_version": g.oldest_version, "staleness": int(lag), "trajectories": len(g.trajectories),
             "generation_start": min(t.generation_start for t in g.trajectories),
             "generation_end": max(t.generation_end for t in g.trajectories),
             "received_at": max(t.received_at for t in g.trajectories),
             "train_start": train_start, "trained_at": trained_at}
            for g, lag in zip(groups, staleness)]


def append_group_records(path: Path, records: list[dict]) -> None:
    """Append ``records`` to the group log at ``path``, one JSON line each, written whole and flushed (a learner
    killed mid-step leaves at most its last line cut, which `heterorl.runs.keep_metrics_until` drops on resume)."""
    with path.open("a") as f:
        f.write("".join(json_text(r) + "\n" for r in records))


def rollouts_lost(rollouts: dict) -> int:
    """Trajectories of a run's ``rollouts`` block (`rollout_waste`) that reached the learner and are neither
    trained, discarded (by reason) nor left over. The learner reads the fleet's count just before what is left
    over, so a group arriving in between counts as left over without being generated: hence the floor at 0."""
    return max(0, rollouts["generated"] - rollouts["trained"] - sum(rollouts["discarded"].values())
               - rollouts["left_over"])


def waste_line(rollouts: dict) -> str:
    """One line on the rollouts generated, trained and not trained, by reason; a resumed learner's are those of
    its own leg (``since_step``), and the line says so."""
    reasons = [f"{n} {reason.replace('_', ' ')}" for reason, n in rollouts["discarded"].items() if n]
    reasons += [f"{rollouts['left_over']} left over at the end"] if rollouts["left_over"] else []
    leg = f" since the resume at step {rollouts['since_step']}" if rollouts.get("since_step") else ""
    return (f"rollouts{leg}: {rollouts['generated']} trajectories generated, {rollouts['trained']} trained; "
            f"{rollouts['wasted_frac']:.1%} wasted" + (f" ({', '.join(reasons)})" if reasons else ""))


def summary_text(summary: dict, run_dir: Path) -> str:
    """What `heterorl train` prints when a run ends, from its ``summary.json``: success before and after, the
    change, staleness, throughput and idle time, the rollouts wasted, the programs the rewards ran, the weights
    path, the engines' tallies, and where the logs and the plot are."""
    simulated = summary.get("execution") == "simulated"
    clock = " of virtual time" if simulated else ""
    summary = _measured(summary, "base_success", "final_success", "best_success", "minutes", "staleness_mean",
                        "staleness_p50", "staleness_p95", "tokens_per_s", "learner_idle_frac", "worker_idle_frac",
                        "staleness_seconds_mean", "samples_per_s")
    lines = ["", format_table(
        ["", "held-out greedy success", "learner steps"],
        [["SFT base", summary["base_success"], 0],
         [f"after RL ({summary['mode']}, {summary['loss']})", summary["final_success"], summary["steps"]],
         ["best during RL", summary["best_success"], ""]]),
        f"\nchange: {100 * (summary['final_success'] - summary['base_success']):+.1f} points in "
        f"{summary['minutes']:.1f} min; staleness mean {summary['staleness_mean']:.2f} versions "
        f"(p50 {summary['staleness_p50']:g}, p95 {summary['staleness_p95']:g}, max {summary['staleness_max']}"
        f"{', a fixed lag' if summary.get('fixed_lag_steps') is not None else ''}); "
        f"{summary['tokens_per_s']:.0f} tokens/s{clock} trained; "
        f"learner idle {summary['learner_idle_frac']:.0%}, workers idle {summary['worker_idle_frac']:.0%}{clock}"
        + without_update_note(summary.get("steps_without_update", 0))]
    if summary.get("rollouts"):
        lines.append(waste_line(summary["rollouts"]))
    if summary.get("reward_outcomes"):
        lines.append(outcomes_line(summary["reward_outcomes"]))
    if summary.get("weights"):
        lines.append(weights_line(summary["weights"]))
        lines.append(f"staleness in seconds: mean {summary['staleness_seconds_mean']:.2f}; "
                     f"{summary['samples_per_s']:.1f} samples/s{clock} trained")
    if summary.get("engines"):
        lines.append("\nby sampling engine (mismatch: learner vs worker log-probs of the tokens sampled at "
                     "staleness 0)")
        lines.append(format_table(
            ["engine", "trained", "samples/s", "staleness mean/max", "tokens measured", "mean |Δ logp|",
             "max |Δ logp|", "p/q var"],
            [[name, e["trajectories_trained"], f"{e['samples_per_s']:.1f}",
              f"{e['staleness_mean']:.2f}/{e['staleness_max']}", e["mismatch_tokens"],
              *(("-",) * 3 if e["mismatch_abs_mean"] is None else
                (f"{e['mismatch_abs_mean']:.2e}", f"{e['mismatch_abs_max']:.2e}", f"{e['is_ratio_var']:.2e}"))]
             for name, e in summary["engines"].items()]))
    lines.append(f"logs:   {run_dir / 'metrics.jsonl'}" + ("" if simulated else f" and {run_dir / 'logs'}/"))
    lines.append(f"plot:   {run_dir / 'success.png'}")
    return "\n".join(lines)
