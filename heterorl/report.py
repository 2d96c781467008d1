"""Run reports: a plain-text table and a success-over-steps plot."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A fixed-width text table."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])])


def _fmt(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def plot_curves(curves: dict[str, list[tuple[float, float]]], path: str | Path, *, title: str,
                xlabel: str = "optimizer step", ylabel: str = "held-out greedy success") -> Path:
    """Save a line plot of ``{label: [(x, y), ...]}`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for label, points in curves.items():
        xs, ys = zip(*points) if points else ((), ())
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel, ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
