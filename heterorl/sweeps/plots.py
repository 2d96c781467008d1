"""matplotlib for the sweeps' reports: headless, and one way to save a figure."""

from __future__ import annotations

from pathlib import Path

PNG_DPI = 110


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Lay ``fig`` out (its x tick labels kept apart: `separate_x_labels`), write it to ``path`` as a PNG and
    close it."""
    fig.tight_layout()
    separate_x_labels(fig)
    fig.savefig(path, dpi=PNG_DPI)
    pyplot().close(fig)
    return path


def x_labels_overlap(fig) -> bool:
    """Whether two x tick labels of an axes of ``fig`` overlap where they are drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if hasattr(fig.canvas, "get_renderer") else FigureCanvasAgg(fig)  # (a closed figure's)
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in fig.axes:
        low, high = sorted(ax.get_xlim())
        boxes = sorted((label.get_window_extent(renderer) for tick in
                        (*ax.xaxis.get_major_ticks(), *ax.xaxis.get_minor_ticks())
                        if low <= tick.get_loc() <= high and tick.label1.get_visible()
                        for label in [tick.label1] if label.get_text()), key=lambda box: box.x0)
        if any(a.x1 > b.x0 for a, b in zip(boxes, boxes[1:])):
            return True
    return False


def separate_x_labels(fig) -> None:
    """Keep the x tick labels apart: a log axis over less than a decade labels its minor ticks (4.1x10^-2,
    4.2x10^-2, ...), which run into each other, so a few plain ticks are labelled instead; the labels of other
    axes (delay settings by name) are turned, and the figure laid out again."""
    if not x_labels_overlap(fig):
        return
    from matplotlib.ticker import FormatStrFormatter, MaxNLocator, NullFormatter

    for ax in fig.axes:
        if ax.get_xscale() == "log":
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.xaxis.set_major_locator(MaxNLocator(nbins=4))
            ax.xaxis.set_major_formatter(FormatStrFormatter("%.3g"))
        else:
            ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
