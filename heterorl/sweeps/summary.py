"""One page across sweeps (``heterorl report --summary FILE SWEEP_DIR ...``): every claim of the paper per task with
its verdict and interval, GEPO against each baseline at each staleness per task and pooled over tasks, and the
figures of each sweep's report.

Pooling. Per task the difference is paired on seeds (GEPO's last-evals score minus the baseline's, same seed),
with its Student-t interval. Over tasks, each task weighs the same: the pooled difference is the mean of the
per-task means, its standard error sqrt(Σ se_t²) / K from the per-task standard errors (tasks fixed, seeds
random), and its 95 % interval uses Student's t with Σ (n_t − 1) degrees of freedom. It answers "on these K
tasks, on average", not "on tasks in general" (three tasks say little about a population of tasks). A task in
two sweeps (the same task run longer) is pooled once, from the first sweep given; the other is shown beside it.

Text below the `HAND_WRITTEN` line of an earlier page (the reading of the tables) is kept when the page is
written again.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from heterorl.sweeps.claims import last_score, paper_claims
from heterorl.sweeps.stats import Interval, paired_ci, t_quantile

REFERENCE = "gepo"
# a line in the summary page after which the text is written by hand and kept when the page is written again
HAND_WRITTEN = "<!-- written by hand below: kept by heterorl report --summary -->"


@dataclass(frozen=True)
class Pooled:
    """A difference averaged over tasks (each the same weight) and its 95 % interval."""

    mean: float
    low: float
    high: float
    tasks: int

    def __str__(self) -> str:
        return f"{100 * self.mean:+.1f} [{100 * self.low:+.1f}, {100 * self.high:+.1f}]"


def pool(intervals: Sequence[Interval]) -> Pooled | None:
    """The tasks' paired differences averaged, each task the same weight (the module docstring says how)."""
    usable = [iv for iv in intervals if iv.n > 1]
    if not usable:
        return None
    k = len(usable)
    mean = sum(iv.mean for iv in usable) / k
    errors = [iv.half_width / t_quantile(0.975, iv.n - 1) for iv in usable]
    se = math.sqrt(sum(e * e for e in errors)) / k
    half = t_quantile(0.975, sum(iv.n - 1 for iv in usable)) * se
    return Pooled(mean, mean - half, mean + half, k)


def _score(cell) -> float:
    return last_score(cell.summary["history"])


def _pct(interval: Interval) -> str:
    text = f"{100 * interval.mean:+.1f} [{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]"
    return f"**{text}**" if interval.excludes_zero() else text


def write_summary(sweep_dirs: Sequence[str | Path], out: str | Path, seeds: Sequence[int] | None = None) -> Path:
    """Write the cross-sweep summary of ``sweep_dirs`` (each a sweep's output folder) to the Markdown file ``out``;
    ``seeds``: only these seeds of every sweep (None: all)."""
    from heterorl.sweeps.report import load_sweep

    out = Path(out)
    sweeps = [load_sweep(d, seeds) for d in sweep_dirs]
    lines = ["# Round-up of the sweeps: every claim, per task", "",
             "Written by `heterorl report --summary` from " + ", ".join(f"`{s.name}`" for s in sweeps) + ". "
             "Score = a run's mean held-out success over its last three evals, in points; differences are paired on "
             "seeds, 95 % intervals; **bold**: the interval excludes 0.", "", "## The paper's claims", "",
             "| claim | sweep / task | verdict | evidence |", "| --- | --- | --- | --- |"]
    for sweep in sweeps:
        for task in sweep.tasks:
            for claim in paper_claims(sweep, task):
                lines.append(f"| {claim.claim} | {sweep.name} / {task} | **{claim.verdict}** | {claim.evidence} |")
    lines += ["", f"## {REFERENCE.upper()} minus each baseline, per task and pooled", "",
              "Positive: GEPO scored higher. Pooled: each task the same weight (heterorl/sweeps/summary.py).", ""]
    lines += _comparison_table(sweeps)
    lines += ["", "## Figures", ""]
    for sweep in sweeps:
        report = sweep.path / "report"
        for png in sorted(report.glob("final_vs_delay_*.png")) + sorted(report.glob("mechanism_*.png")):
            lines.append(f"- {sweep.name}: [{png.stem}]({Path(os.path.relpath(png, out.parent)).as_posix()})")
    kept = _hand_written(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n" + (f"\n{kept}" if kept else ""), encoding="utf-8")
    return out


def _hand_written(out: Path) -> str:
    """What follows `HAND_WRITTEN` in an earlier ``out`` (the marker included): the reading of the tables, kept
    when they are written again."""
    if not out.is_file():
        return ""
    text = out.read_text(encoding="utf-8")
    at = text.find(HAND_WRITTEN)
    return text[at:] if at >= 0 else ""


def _comparison_table(sweeps) -> list[str]:
    delays = list(dict.fromkeys(d for s in sweeps for d in s.delays))
    baselines = [loss for loss in dict.fromkeys(loss for s in sweeps for loss in s.losses) if loss != REFERENCE]
    rows = []
    for baseline in baselines:
        for delay in delays:
            per_task, cells, pooled_tasks = [], [], set()
            for sweep in sweeps:
                if delay not in sweep.delays or baseline not in sweep.losses or REFERENCE not in sweep.losses:
                    continue
                for task in sweep.tasks:
                    ours = sweep.seed_scores(task, REFERENCE, delay, _score)
                    theirs = sweep.seed_scores(task, baseline, delay, _score)
                    if set(ours) & set(theirs):
                        interval = paired_ci(ours, theirs)
                        # a task is pooled once: a later sweep of the same task (e.g. longer runs) is shown only
                        pooled_here = task not in pooled_tasks
                        if pooled_here:
                            per_task.append(interval)
                            pooled_tasks.add(task)
                        note = "" if pooled_here else ", not pooled: its task is pooled already"
                        cells.append(f"{sweep.name} / {task}: {_pct(interval)} (n={interval.n}{note})")
            if per_task:
                pooled = pool(per_task)
                shown = "–" if pooled is None else (f"**{pooled}**" if pooled.low > 0 or pooled.high < 0 else
                                                   str(pooled))
                rows.append(f"| {baseline} | {delay} | {'; '.join(cells)} | {shown} |")
    if not rows:
        return ["No (baseline, delay) was run beside GEPO."]
    return ["| baseline | delay | per task | pooled |", "| --- | --- | --- | --- |", *rows]
