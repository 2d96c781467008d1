"""The mechanism behind a sweep's scores: how much the importance weight each loss actually applies varies, next to
how much the plain sequence ratio p/q varies, against the measured KL between sampler and learner.

Every finished cell's summary keeps the run's mean of ``is/weight_var`` (the variance of the loss's own raw
weight: GEPO's group weight, GRPO's token ratio, GSPO's length-normalised sequence ratio, ...), ``ratio/seq_var``
(the variance of Π_t p/q, the same quantity for every loss) and ``kl/k3`` (per token, sampler ‖ learner). One
point per run, one figure per task (``mechanism_<task>.png``), and a table per (loss, delay).

What the argument predicts. If a completion's per-token log ratios δ_t = log p − log q are independent with mean
≈ 0, the k3 estimate is KL ≈ E[δ²]/2, so the sequence's log ratio Σ_t δ_t has variance ≈ 2·T·KL over T tokens
and, log-normally, Var(p/q) = e^{2·T·KL} − 1: exponential in the drift. GEPO's weight replaces each sequence's own
q_i by the group's expectation Ê_q[q] (one number per group), so the 1/q_i factor that makes p/q heavy-tailed is
gone and its variance should stay near its on-policy value as the KL grows: the paper's variance-reduction
argument (arXiv 2508.17850). The figure draws e^{2·T·KL} − 1 with T fitted to the sequence-ratio points (the
median of log(1 + Var)/(2·KL) over the stale runs), so "do the data follow it" reads as: the fitted T is close to
the task's completion length, and the applied weight's points sit under the curve by a margin that grows with KL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean, median

from heterorl.sweeps.plots import pyplot, save

APPLIED, SEQUENCE, KL = "is/weight_var", "ratio/seq_var", "kl/k3"
MIN_KL = 1e-4  # a run below this drifted too little to show anything (on-policy runs measure ~1e-13: rounding)


@dataclass(frozen=True)
class MechanismRow:
    """Means over the finished seeds of one (loss, delay) of the runs' mean drift metrics."""

    loss: str
    delay: str
    n: int
    kl: float
    applied_var: float
    sequence_var: float

    @property
    def ratio(self) -> float | None:
        """Var(applied weight) / Var(p/q); None where p/q did not vary (on-policy)."""
        return self.applied_var / self.sequence_var if self.sequence_var > 1e-9 else None


def _means(cell) -> dict[str, float] | None:
    means = cell.summary.get("metric_means") or {}
    if all(isinstance(means.get(k), (int, float)) and math.isfinite(means[k]) for k in (APPLIED, SEQUENCE, KL)):
        return {k: float(means[k]) for k in (APPLIED, SEQUENCE, KL)}
    return None


def mechanism_points(sweep, task: str) -> list[tuple[str, str, dict[str, float]]]:
    """``(loss, delay, means)`` of every finished run of ``task`` whose summary kept the three metrics."""
    return [(loss, delay, means) for loss in sweep.losses for delay in sweep.delays
            for cell in sweep.finished(task, loss, delay) if (means := _means(cell)) is not None]


def mechanism_rows(sweep, task: str) -> list[MechanismRow]:
    rows = []
    points = mechanism_points(sweep, task)
    for loss in sweep.losses:
        for delay in sweep.delays:
            runs = [m for lo, de, m in points if (lo, de) == (loss, delay)]
            if runs:
                rows.append(MechanismRow(loss, delay, len(runs), fmean(m[KL] for m in runs),
                                         fmean(m[APPLIED] for m in runs), fmean(m[SEQUENCE] for m in runs)))
    return rows


def fitted_length(points: list[tuple[str, str, dict[str, float]]], min_kl: float = MIN_KL) -> float | None:
    """T of Var(p/q) = e^{2·T·KL} − 1, the median over the runs that drifted (KL ≥ ``min_kl``); None without any."""
    fits = [math.log1p(m[SEQUENCE]) / (2 * m[KL]) for _, _, m in points if m[KL] >= min_kl]
    return median(fits) if fits else None


def markdown_section(sweep, task: str, plot: Path | None) -> list[str]:
    """The report's "mechanism" section for ``task``: the table, the fitted T, the figure."""
    rows = mechanism_rows(sweep, task)
    if not rows:
        return []
    length = fitted_length(mechanism_points(sweep, task))
    lines = ["### The mechanism: weight variance against the measured KL", "",
             "| loss | delay | runs | KL (k3, per token) | Var(applied weight) | Var(p/q, sequence) | ratio |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = "–" if r.ratio is None else f"{r.ratio:.3g}"
        lines.append(f"| {r.loss} | {r.delay} | {r.n} | {r.kl:.3g} | {r.applied_var:.3g} | {r.sequence_var:.3g} | "
                     f"{ratio} |")
    lines += ["", "Means over each run's steps, then over its seeds. The applied weight is each loss's own raw weight "
              "(`is/weight_var`): GEPO's group weight, GRPO's and most others' token ratio, GSPO's length-normalised "
              "sequence ratio. " + (f"The log-normal model Var(p/q) = e^(2·T·KL) − 1 fits these runs with T = "
                                   f"{length:.1f} tokens." if length is not None else ""), ""]
    lines += [ARGUMENT, ""] + _verdict(rows)
    if plot is not None:
        lines += [f"![mechanism]({plot.name})", ""]
    return lines


ARGUMENT = ("What the paper's argument predicts: with per-token log ratios of mean ≈ 0, Var(p/q) = e^(2·T·KL) − 1 "
            "grows exponentially with the drift, because each sequence is divided by its own q; GEPO divides by the "
            "group's expectation of q instead, so its weight's variance should stay near its on-policy value and its "
            "ratio to Var(p/q) should fall as the KL grows.")


def _verdict(rows: list[MechanismRow], loss: str = "gepo") -> list[str]:
    """Whether ``loss``'s rows follow the argument: its weight's variance against p/q's, least to most drift."""
    stale = sorted((r for r in rows if r.loss == loss and r.ratio is not None), key=lambda r: r.kl)
    online = [r for r in rows if r.loss == loss and r.ratio is None]
    if not stale:
        return []
    low, high = stale[0], stale[-1]
    start = f" (on-policy, its weight variance is {online[0].applied_var:.3g})" if online else ""
    # the table above holds each row's numbers: the sentence says only what they come to
    text = (f"Here, {loss.upper()}'s ratio to Var(p/q) goes {low.ratio:.3g} → {high.ratio:.3g} from the least "
            f"drift to the most in the table{start}")
    if len(stale) < 2 or high.kl <= low.kl:
        return [text + " (one drift level: nothing to compare).", ""]
    follows = high.ratio < low.ratio
    return [text + (" — it falls as the KL grows, as the argument predicts." if follows else
                    " — it does not fall as the KL grows: the data do not follow the argument."), ""]


def plot_mechanism(sweep, task: str, path: Path) -> Path | None:
    """Both variances of every run against its KL, log-log, with the fitted e^{2·T·KL} − 1; None without points."""
    points = [p for p in mechanism_points(sweep, task) if p[2][KL] >= MIN_KL]  # on-policy runs: KL ~1e-13
    if not points:
        return None
    fig, ax = pyplot().subplots(figsize=(7, 5))
    colors = {loss: f"C{i}" for i, loss in enumerate(sweep.losses)}
    for loss in sweep.losses:
        mine = [m for lo, _, m in points if lo == loss]
        if not mine:
            continue
        kl = [m[KL] for m in mine]
        ax.scatter(kl, [m[APPLIED] for m in mine], color=colors[loss], marker="o", s=18,
                   label=f"{loss}: applied weight")
        ax.scatter(kl, [m[SEQUENCE] for m in mine], facecolors="none", edgecolors=colors[loss],
                   marker="s", s=22, label=f"{loss}: p/q (sequence)")
    length = fitted_length(points)
    if length is not None:
        lo, hi = min(m[KL] for _, _, m in points), max(m[KL] for _, _, m in points)
        grid = [lo * (hi / lo) ** (i / 60) for i in range(61)] if hi > lo else [lo]
        ax.plot(grid, [math.expm1(2 * length * k) for k in grid], "k--", linewidth=1,
                label=f"e^(2·T·KL) − 1, T = {length:.1f}")
    ax.set(xscale="log", yscale="log", xlabel="KL(sampler ‖ learner) per token, k3 (run mean)",
           ylabel="variance (run mean)", title=f"{task}: importance-weight variance against drift\n"
                                                "filled: the weight a loss applies; hollow: p/q "
                                                "(runs with KL < 1e-4 left out)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)
    return save(fig, path)
