"""Delay-sweep reports: per-(loss, delay) tables over seeds, plots against step and delay, optional wandb table.

A sweep directory holds ``sweep.json`` (the grid: losses x delays x seeds) and ``cells/<cell>/`` with each
run's ``summary.json`` and ``metrics.jsonl``. Only cells whose summary says ``"status": "done"`` are counted;
every other grid point is reported as missing.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from statistics import fmean, pstdev
from typing import Callable, Sequence

from heterorl.errors import HeteroRLError
from heterorl.runs import format_table, json_text, read_metrics
from heterorl.sweeps.claims import Claim, last_score, paper_claims, run_metric
from heterorl.sweeps.mechanism import markdown_section, plot_mechanism
from heterorl.sweeps.plots import pyplot as _pyplot
from heterorl.sweeps.plots import save as _save
from heterorl.sweeps.stats import LAST_EVALS, eval_auc, last_evals_mean, mean_ci, paired_ci
from heterorl.sweeps.tuning import tuning_section

_CELL_KEYS = ("task", "loss", "delay", "seed", "base_success", "best_success", "final_success")


@dataclass(frozen=True)
class CellResult:
    """One run of the grid. ``status`` is the summary's status, or why there is none; metrics are read for
    finished cells only, since an unfinished one may still be writing them."""

    name: str
    status: str
    summary: dict
    metrics: list[dict]

    @property
    def done(self) -> bool:
        return self.status == "done"

    @property
    def key(self) -> tuple[str, str, int]:
        return self.summary["loss"], self.summary["delay"], self.summary["seed"]


@dataclass(frozen=True)
class SweepResults:
    """The spec of ``sweep.json`` and the cells found under ``cells/``."""

    path: Path
    name: str
    mode: str
    losses: list[str]
    delays: list[str]
    seeds: list[int]
    online_delay: str | None  # the on-policy setting degradation is measured against; None: the sweep has none
    seconds_per_step: float | None
    cells: list[CellResult]

    @property
    def tasks(self) -> list[str]:
        return sorted({c.summary["task"] for c in self.cells if c.done})

    def finished(self, task: str, loss: str, delay: str) -> list[CellResult]:
        """The finished cells of one (task, loss, delay), one per seed."""
        return [c for c in self.cells if c.done and c.summary["task"] == task and c.key[:2] == (loss, delay)]

    def seed_scores(self, task: str, loss: str, delay: str, score: Callable) -> dict[int, float]:
        """``{seed: score(cell)}`` of the finished runs of (task, loss, delay) that evaluated after the base,
        leaving out those where ``score`` gives None."""
        out = {}
        for cell in self.finished(task, loss, delay):
            if len(cell.summary.get("history", [])) > 1 and (value := score(cell)) is not None:
                out[cell.summary["seed"]] = value
        return out

    def missing(self) -> list[tuple[str, str]]:
        """``(cell name, status)`` of every grid point without a finished cell, in grid order."""
        done = {c.key for c in self.cells if c.done}
        status = {c.name: c.status for c in self.cells}
        return [(name, status.get(name, "not started"))
                for loss in self.losses for delay in self.delays for seed in self.seeds
                if (loss, delay, seed) not in done for name in [cell_name(loss, delay, seed)]]


@dataclass(frozen=True)
class SummaryRow:
    """Statistics of one (task, loss, delay) over its finished seeds; ``None`` where nothing was measured."""

    task: str
    loss: str
    delay: str
    n_seeds: int
    base_mean: float | None
    best_mean: float | None
    best_std: float | None
    last_mean: float | None
    last_std: float | None
    degradation_pct: float | None  # 100 * (online - this) / online of the last-LAST_EVALS-evals score, same loss
    gap_mean: float | None  # mean over seeds of best - last
    staleness_mean: float | None
    staleness_p50: float | None  # the measured staleness's median, 95th percentile and maximum, over seeds (means;
    staleness_p95: float | None  # the maximum: the largest); None for cells written before they were recorded
    staleness_max: float | None
    seq_ratio_var: float | None  # mean over steps of ratio/seq_var (the same quantity for every loss), then seeds
    kl_k3: float | None  # mean over steps of kl/k3, then over seeds


def cell_name(loss: str, delay: str, seed: int) -> str:
    """The directory name of a grid point under ``cells/``, e.g. ``gepo__d16__s0``."""
    return f"{loss}__d{delay}__s{seed}"


def load_sweep(sweep_dir: str | Path, seeds: Sequence[int] | None = None) -> SweepResults:
    """Read ``sweep_dir/sweep.json`` and every ``sweep_dir/cells/*/``; raises ``HeteroRLError`` naming the file
    if the spec is missing or malformed, or a finished cell's summary lacks a required key. ``seeds``: keep only
    these seeds (e.g. the seeds every cell of a sweep still running has finished)."""
    path = Path(sweep_dir)
    spec = _read_spec(path / "sweep.json")
    cells_dir = path / "cells"
    cells = [_read_cell(d) for d in sorted(cells_dir.iterdir()) if d.is_dir()] if cells_dir.is_dir() else []
    if seeds is not None:
        unknown = sorted(set(seeds) - set(spec["seeds"]))
        if unknown:
            raise HeteroRLError(f"seeds {unknown} are not in the sweep {path / 'sweep.json'} (it has {spec['seeds']})")
        spec["seeds"] = [s for s in spec["seeds"] if s in seeds]
        cells = [c for c in cells if c.summary.get("seed", _seed_of(c.name)) in seeds]
    return SweepResults(path=path, cells=cells, **spec)


def _seed_of(name: str) -> int | None:
    """The seed in a cell directory name (``…__s<seed>``), for cells without a summary yet."""
    tail = name.rpartition("__s")[2]
    return int(tail) if tail.isdigit() else None


def _read_spec(spec_path: Path) -> dict:
    try:
        raw = json.loads(spec_path.read_text(encoding="utf-8"))
        return dict(name=str(raw["name"]), mode=str(raw["mode"]), losses=[str(x) for x in raw["losses"]],
                    delays=[str(x) for x in raw["delays"]], seeds=[int(x) for x in raw["seeds"]],
                    online_delay=None if raw["online_delay"] is None else str(raw["online_delay"]),
                    seconds_per_step=raw.get("seconds_per_step"))
    except FileNotFoundError:
        raise HeteroRLError(f"{spec_path}: no sweep spec; pass the directory a delay sweep wrote") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HeteroRLError(f"{spec_path}: malformed sweep spec ({type(e).__name__}: {e}); expected keys "
                            "name, mode, losses, delays, seeds, online_delay") from None


def _read_cell(cell_dir: Path) -> CellResult:
    summary_path = cell_dir / "summary.json"
    try:
        raw = json.loads(summary_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return CellResult(cell_dir.name, "no summary.json", {}, [])
    except (OSError, ValueError):
        return CellResult(cell_dir.name, "unreadable summary.json", {}, [])
    status = str(raw.get("status", "no status"))
    if status != "done":
        return CellResult(cell_dir.name, status, raw, [])
    absent = [k for k in _CELL_KEYS if k not in raw]
    if absent:
        raise HeteroRLError(f"{summary_path}: finished cell lacks {absent}")
    summary = {**raw, "delay": str(raw["delay"]), "seed": int(raw["seed"])}
    return CellResult(cell_dir.name, status, summary, _read_cell_metrics(cell_dir / "metrics.jsonl"))


def _read_cell_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    try:
        return read_metrics(path)
    except ValueError as e:
        raise HeteroRLError(f"{path}: malformed metrics line ({e})") from None


def _mean(values: Sequence[float | None]) -> float | None:
    finite = _finite(values)
    return fmean(finite) if finite else None


def _std(values: Sequence[float | None]) -> float | None:
    finite = _finite(values)
    return pstdev(finite) if finite else None


def _finite(values: Sequence[object]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def summary_rows(sweep: SweepResults) -> dict[str, list[SummaryRow]]:
    """``{task: rows}``, one row per (loss, delay) in spec order (losses outer), including rows with no
    finished seed. Means and population stds (ddof=0) are over finished seeds; NaN values are skipped."""
    return {task: [_summarise(sweep, task, loss, delay) for loss in sweep.losses for delay in sweep.delays]
            for task in sweep.tasks}


def _summarise(sweep: SweepResults, task: str, loss: str, delay: str) -> SummaryRow:
    cells = sweep.finished(task, loss, delay)
    best = [c.summary["best_success"] for c in cells]
    last = [c.summary["final_success"] for c in cells]
    # degradation: on the claims' measure (the mean of the last LAST_EVALS evals), the one measure of the page
    online_score = _mean([last_score(c.summary["history"]) for c in sweep.finished(task, loss, sweep.online_delay)])
    score = _mean([last_score(c.summary["history"]) for c in cells])
    last_mean = _mean(last)
    return SummaryRow(
        task=task, loss=loss, delay=delay, n_seeds=len(cells),
        base_mean=_mean([c.summary["base_success"] for c in cells]),
        best_mean=_mean(best), best_std=_std(best), last_mean=last_mean, last_std=_std(last),
        degradation_pct=(None if not online_score or score is None
                         else 100.0 * (online_score - score) / online_score),
        gap_mean=_mean([b - f for b, f in zip(best, last)]),
        staleness_mean=_mean([c.summary.get("staleness_mean") for c in cells]),
        staleness_p50=_mean([c.summary.get("staleness_p50") for c in cells]),
        staleness_p95=_mean([c.summary.get("staleness_p95") for c in cells]),
        staleness_max=max((c.summary["staleness_max"] for c in cells if c.summary.get("staleness_max") is not None),
                          default=None),
        seq_ratio_var=_mean([run_metric(c, "ratio/seq_var") for c in cells]),
        kl_k3=_mean([run_metric(c, "kl/k3") for c in cells]),
    )


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _pm(mean: float | None, std: float | None) -> str:
    return "n/a" if mean is None else f"{mean:.3f} ± {std:.3f}"


def _staleness(row: SummaryRow) -> str:
    """The measured staleness, mean / p50 / p95 / max versions (what the delay setting produced)."""
    return " / ".join(_num(v, ".2f" if i == 0 else ".3g") for i, v in enumerate(
        (row.staleness_mean, row.staleness_p50, row.staleness_p95, row.staleness_max)))


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"


_SUMMARY_HEADER = ["loss", "delay", "n", "best", "last", f"degradation (last {LAST_EVALS} evals)", "best-last",
                   "staleness mean/p50/p95/max", "p/q seq var", "KL k3"]


def _summary_cells(row: SummaryRow) -> list[str]:
    return [row.loss, row.delay, str(row.n_seeds), _pm(row.best_mean, row.best_std),
            _pm(row.last_mean, row.last_std), _pct(row.degradation_pct), _num(row.gap_mean, ".3f"),
            _staleness(row),
            _num(row.seq_ratio_var, ".3g"), _num(row.kl_k3, ".3g")]


def _footer(sweep: SweepResults) -> list[str]:
    return [
        "best, last: held-out eval success (best during the run, at its end), mean ± population std (ddof=0) "
        "over finished seeds; one seed gives std 0.",
        f"degradation: (online - stale) / online in percent of the mean success over the last {LAST_EVALS} evals "
        f"(the measure the claims use; 'last' is the final eval alone), against the same loss at the online delay "
        f"{sweep.online_delay!r}; positive means worse than online; n/a when that cell is missing or its score "
        "is 0.",
        "best-last: mean over seeds of best minus last success. staleness: policy versions behind, as measured "
        "over the groups trained (mean, median, 95th percentile: means over seeds; max: the largest), whatever "
        "the delay setting's label says (a 'K' delay is a maximum tolerable delay; 'lagK' a fixed staleness). "
        "p/q seq var, KL k3: mean over the run's steps that ran an update of ratio/seq_var (the variance of the "
        "sequence ratio learner/sampler, the same quantity for every loss; each loss's own weight is is/weight_*) "
        "and kl/k3 (a step without one, optim/updates 0, has no loss metrics), then over seeds.",
    ]


def compare_table(sweep: SweepResults) -> str:
    """A compact side-by-side table per (task, delay): losses as rows with base, best, last, staleness mean,
    sequence-ratio variance and KL k3 (means over seeds; ± is the population std)."""
    header = ["loss", "n", "base", "best", "last", "staleness mean/p50/p95/max", "p/q seq var", "KL k3"]
    blocks = [
        f"{task}, delay {delay}:\n" + format_table(header, [
            [r.loss, r.n_seeds, _num(r.base_mean, ".3f"), _pm(r.best_mean, r.best_std), _pm(r.last_mean, r.last_std),
             _staleness(r), _num(r.seq_ratio_var, ".3g"), _num(r.kl_k3, ".3g")]
            for r in rows if r.delay == delay])
        for task, rows in summary_rows(sweep).items() for delay in sweep.delays
    ]
    return "\n\n".join(blocks) if blocks else f"no finished cells in {sweep.path / 'cells'}"


def write_report(sweep_dir: str | Path, out_dir: str | Path | None = None,
                 seeds: Sequence[int] | None = None) -> Path:
    """Write ``summary.md``, ``table.txt`` and the PNG plots of a sweep into ``out_dir`` (default
    ``sweep_dir/report``); returns the path of ``summary.md``. Per task: ``success_vs_step_<task>_<delay>.png``
    for each delay with a finished cell, and, when the sweep has more than one delay,
    ``final_vs_delay_<task>.png`` and ``drift_vs_delay_<task>.png``."""
    sweep = load_sweep(sweep_dir, seeds)
    out = Path(out_dir) if out_dir is not None else sweep.path / "report"
    out.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(sweep)
    plots = [p for task, task_rows in rows.items() for p in _plot_task(sweep, task, task_rows, out)]
    claims = {task: paper_claims(sweep, task) for task in rows}
    (out / "table.txt").write_text(_text_report(sweep, rows, claims), encoding="utf-8")
    summary = out / "summary.md"
    summary.write_text(_markdown_report(sweep, rows, claims, plots), encoding="utf-8")
    export_metrics(sweep, out / "metrics.jsonl")
    return summary


# the per-step metrics worth keeping with a report (the cells' own metrics.jsonl hold everything)
EXPORTED = ("eval/success", "rollout/reward_mean", "rollout/completion_len", "loss/policy", "is/weight_mean",
            "is/weight_var", "is/weight_var_qweighted", "is/weight_max", "is/ess", "is/clip_frac", "is/mask_frac",
            "ratio/seq_mean", "ratio/seq_var", "ratio/seq_max", "ratio/seq_ess", "ratio/token_var",
            "kl/k1", "kl/k3", "staleness/versions_mean", "staleness/versions_max", "staleness/seconds_mean",
            "optim/grad_norm", "learner/idle_frac", "buffer/dropped_stale", "sim/time_s")


def export_metrics(sweep: SweepResults, path: Path) -> Path:
    """One compact JSON line per (finished cell, logged step): the cell's loss, delay, seed and task, and the
    `EXPORTED` metrics it logged at that step, floats rounded to 5 significant digits."""
    with path.open("w", encoding="utf-8") as f:
        for cell in (c for c in sweep.cells if c.done):
            head = {"cell": cell.name, "task": cell.summary["task"], "loss": cell.summary["loss"],
                    "delay": cell.summary["delay"], "seed": cell.summary["seed"]}
            for record in cell.metrics:
                values = {k: _compact(record[k]) for k in EXPORTED if k in record}
                f.write(json_text({**head, "step": record["step"], **values}) + "\n")
    return path


def _compact(value):
    return float(f"{value:.5g}") if isinstance(value, float) else value


def _spec_line(sweep: SweepResults) -> str:
    seconds = "" if sweep.seconds_per_step is None else f"; seconds per step {sweep.seconds_per_step}"
    return (f"losses {', '.join(sweep.losses)}; delays {', '.join(sweep.delays)}; seeds "
            f"{', '.join(map(str, sweep.seeds))}; online delay {sweep.online_delay}{seconds}")


def _text_report(sweep: SweepResults, rows: dict[str, list[SummaryRow]], claims: dict[str, list[Claim]]) -> str:
    tables = [f"task {task}:\n" + format_table(_SUMMARY_HEADER, [_summary_cells(r) for r in task_rows])
              for task, task_rows in rows.items()]
    missing = [f"  {name}: {status}" for name, status in sweep.missing()]
    said = [f"task {task}, the paper's claims:\n" + "\n".join(f"  {c.sentence().replace('**', '')}"
                                                            for c in task_claims)
            for task, task_claims in claims.items()]
    return "\n".join([f"sweep {sweep.name} ({sweep.mode}): {_spec_line(sweep)}", "",
                      "\n\n".join(tables) or "no finished cells", "", *_footer(sweep), "", *said, "",
                      f"missing or unfinished cells: {len(missing)}", *missing]) + "\n"


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    line = lambda cells: "| " + " | ".join(cells) + " |"
    return "\n".join([line(header), line(["---"] * len(header)), *map(line, rows)])


_CI_HEADER = ["loss", "delay", "n", f"last {LAST_EVALS} evals [95% CI]", "AUC [95% CI]",
              "vs same loss online [95% CI]", "vs grpo same delay [95% CI]"]


def confidence_rows(sweep: SweepResults, task: str) -> list[list[str]]:
    """Per (loss, delay) of ``task``: the mean over seeds of each run's last-`LAST_EVALS` eval mean and of its
    eval AUC, with t intervals; and the paired difference of the last-evals score (same seeds) against the same
    loss at the online delay and against grpo at the same delay ("—" where that reference is the row itself or
    has no common seed)."""
    def scores(loss: str, delay: str, score) -> dict[int, float]:
        return sweep.seed_scores(task, loss, delay, lambda cell: score(cell.summary["history"]))

    def last(history):
        return last_evals_mean(history, LAST_EVALS)

    def versus(mine: dict, loss: str, delay: str | None) -> str:
        other = scores(loss, delay, last) if delay is not None else {}
        return str(paired_ci(mine, other)) if set(mine) & set(other) else "—"

    rows = []
    for loss in sweep.losses:
        for delay in sweep.delays:
            mine = scores(loss, delay, last)
            if not mine:
                continue
            online = sweep.online_delay if delay != sweep.online_delay else None
            rows.append([loss, delay, str(len(mine)), str(mean_ci(list(mine.values()))),
                         str(mean_ci(list(scores(loss, delay, eval_auc).values()))), versus(mine, loss, online),
                         versus(mine, "grpo", delay) if loss != "grpo" else "—"])
    return rows


def confidence_table(sweep: SweepResults) -> str:
    """`confidence_rows` of every task as text tables, with what they mean."""
    blocks = [f"{task}, scores with 95 % confidence intervals:\n" + format_table(_CI_HEADER, rows)
              for task in summary_rows(sweep) for rows in [confidence_rows(sweep, task)] if rows]
    return "\n\n".join(blocks + [_confidence_footer()]) if blocks else "no finished cells with evaluations"


def _confidence_footer() -> str:
    return (f"last {LAST_EVALS} evals: each run's mean held-out success over its last {LAST_EVALS} evaluations; AUC: "
            "the area under its eval curve over the steps it spans (its mean success). Mean over seeds with a 95 % "
            "Student-t interval; \"vs\": the paired difference of the last-evals score on the seeds both settings "
            "ran (positive: this row is higher); an interval that excludes 0 decides the comparison at 95 %.")


def _markdown_report(sweep: SweepResults, rows: dict[str, list[SummaryRow]], claims: dict[str, list[Claim]],
                     plots: list[Path]) -> str:
    parts = [f"# Delay sweep `{sweep.name}` ({sweep.mode})", "", _spec_line(sweep), ""]
    for task, task_rows in rows.items():
        parts += [f"## Task `{task}`", "", _markdown_table(_SUMMARY_HEADER, map(_summary_cells, task_rows)), ""]
        confidence = confidence_rows(sweep, task)
        if confidence:
            parts += ["### Scores with 95 % confidence intervals", "", _markdown_table(_CI_HEADER, confidence), "",
                      _confidence_footer(), "", "### The paper's claims", "",
                      *(f"- {claim.sentence()}" for claim in claims[task]), "", _CLAIMS_FOOTER, ""]
        plot = next((p for p in plots if p.name == f"mechanism_{_slug(task)}.png"), None)
        parts += markdown_section(sweep, task, plot)
    if not rows:
        parts += ["No finished cells yet.", ""]
    parts += [*(f"- {line}" for line in _footer(sweep)), ""]
    parts += tuning_section([c.summary for c in sweep.cells], sweep.losses)  # none unless labels are LOSS@SETTING
    parts += ["## Missing or unfinished cells", ""]
    parts += [f"- `{name}`: {status}" for name, status in sweep.missing()] or ["None."]
    parts += ["", "## Plots", "", *(f"- [{p.stem}]({p.name})" for p in plots)]
    return "\n".join(parts) + "\n"


_CLAIMS_FOOTER = ("Each claim is checked with paired 95 % intervals over the seeds both settings ran "
                  "(heterorl/sweeps/claims.py says how each verdict is reached).")


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label)


def _plot_task(sweep: SweepResults, task: str, rows: list[SummaryRow], out: Path) -> list[Path]:
    paths = [_plot_success_vs_step(sweep, task, delay, out / f"success_vs_step_{_slug(task)}_{_slug(delay)}.png")
             for delay in sweep.delays if any(r.n_seeds for r in rows if r.delay == delay)]
    if len(sweep.delays) > 1:
        paths.append(_plot_final_vs_delay(sweep, task, rows, out / f"final_vs_delay_{_slug(task)}.png"))
        paths.append(_plot_drift_vs_delay(sweep, task, rows, out / f"drift_vs_delay_{_slug(task)}.png"))
    mechanism = plot_mechanism(sweep, task, out / f"mechanism_{_slug(task)}.png")
    return paths + ([mechanism] if mechanism is not None else [])


def _eval_points(cells: list[CellResult]) -> dict[int, list[float]]:
    """``{step: [eval success of each seed that evaluated at that step]}``, from each run's eval history (its
    summary), else its metrics."""
    points: dict[int, list[float]] = {}
    for cell in cells:
        for record in cell.summary.get("history") or cell.metrics:
            if _finite([record.get("eval/success")]):
                points.setdefault(int(record["step"]), []).append(float(record["eval/success"]))
    return points


def _plot_success_vs_step(sweep: SweepResults, task: str, delay: str, path: Path) -> Path:
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    for loss in sweep.losses:
        cells = sweep.finished(task, loss, delay)
        points = sorted(_eval_points(cells).items())
        if not points:
            continue
        steps = [step for step, _ in points]
        (line,) = ax.plot(steps, [fmean(v) for _, v in points], marker="o", markersize=3,
                          label=f"{loss} (n={len(cells)})")
        ax.fill_between(steps, [min(v) for _, v in points], [max(v) for _, v in points],
                        color=line.get_color(), alpha=0.2)
    measured = _mean([c.summary.get("staleness_mean") for loss in sweep.losses
                      for c in sweep.finished(task, loss, delay)])
    ax.set(title=f"{task}, delay {delay} (measured staleness {_num(measured, '.1f')})\n"
                 "held-out success: mean, min-max over seeds", xlabel="learner step",
           ylabel="held-out greedy success", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _lines_vs_delay(ax, sweep: SweepResults, rows: list[SummaryRow], value: str, error: str | None = None) -> None:
    for loss in sweep.losses:
        points = [(sweep.delays.index(r.delay), getattr(r, value), getattr(r, error) if error else 0.0)
                  for r in rows if r.loss == loss and getattr(r, value) is not None]
        if points:
            xs, ys, errs = zip(*points)
            ax.errorbar(xs, ys, yerr=errs if error else None, marker="o", markersize=4, capsize=3, label=loss)
    measured = {d: _mean([r.staleness_mean for r in rows if r.delay == d]) for d in sweep.delays}
    ax.set_xticks(range(len(sweep.delays)), [f"{d}\n{_num(measured[d], '.1f')}" for d in sweep.delays])
    ax.set_xlabel("delay setting / measured mean staleness (versions)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def _plot_final_vs_delay(sweep: SweepResults, task: str, rows: list[SummaryRow], path: Path) -> Path:
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    _lines_vs_delay(ax, sweep, rows, "last_mean", "last_std")
    ax.set(title=f"{task}: last eval success vs delay\n(mean ± std over seeds)", ylabel="held-out greedy success",
           ylim=(0, 1))
    return _save(fig, path)


def _plot_drift_vs_delay(sweep: SweepResults, task: str, rows: list[SummaryRow], path: Path) -> Path:
    fig, (ax_var, ax_kl) = _pyplot().subplots(1, 2, figsize=(11, 4))
    _lines_vs_delay(ax_var, sweep, rows, "seq_ratio_var")
    ax_var.set(title=f"{task}: variance of the\nsequence ratio p/q", ylabel="mean ratio/seq_var (symlog)")
    _lines_vs_delay(ax_kl, sweep, rows, "kl_k3")
    ax_kl.set(title=f"{task}: KL estimate (k3)\nlearner vs sampler", ylabel="mean kl/k3 (symlog)")
    for ax in (ax_var, ax_kl):  # the losses' drift spans orders of magnitude; 0 (on-policy) stays visible
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_ylim(bottom=0)
    return _save(fig, path)


def log_report_to_wandb(sweep_dir: str | Path, project: str, mode: str = "offline") -> None:
    """Log the sweep's summary rows as the wandb Table ``sweep/summary`` in a run with group = sweep name and
    job_type ``report``. Call only when a wandb project is given; ``mode="offline"`` writes the run under
    ``sweep_dir/wandb`` without touching the network."""
    import wandb

    sweep = load_sweep(sweep_dir)
    columns = [f.name for f in fields(SummaryRow)]
    data = [list(asdict(r).values()) for rows in summary_rows(sweep).values() for r in rows]
    run = wandb.init(project=project, name=f"{sweep.name}-report", group=sweep.name, job_type="report", mode=mode,
                     dir=str(sweep.path), reinit="finish_previous",
                     settings=wandb.Settings(console="off", x_disable_stats=True))
    try:
        run.log({"sweep/summary": wandb.Table(columns=columns, data=data)})
    finally:
        run.finish()
