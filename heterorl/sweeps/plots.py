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
    """Lay ``fig`` out, write it to ``path`` as a PNG and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=PNG_DPI)
    pyplot().close(fig)
    return path
