"""Metric sinks: a JSONL file in the run directory, and wandb (offline unless a project is given).

Metric names are grouped by '/', e.g. ``eval/success``, ``rollout/reward_mean``, ``loss/policy``.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Writes one JSON object per ``log`` call to ``run_dir/metrics.jsonl`` and mirrors it to wandb."""

    def __init__(self, run_dir: str | Path, *, config: dict | None = None, name: str = "run",
                 wandb_project: str | None = None, wandb_mode: str = "offline", append: bool = False,
                 wandb_group: str | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a" if append else "w", encoding="utf-8")  # append: a resumed run
        self._start = time.time()
        self._wandb_run = None
        if wandb_mode != "disabled":
            self._wandb_run = self._init_wandb(config, name, wandb_project, wandb_mode, wandb_group)

    def _init_wandb(self, config, name, project, mode, group):
        import wandb

        if project is None:
            mode = "offline"  # no project given: never touch the network
        os.environ.setdefault("WANDB_SILENT", "true")
        return wandb.init(
            project=project or "heterorl", name=name, mode=mode, dir=str(self.run_dir), config=config or {},
            group=group,
            reinit="finish_previous", settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    @property
    def wandb_dir(self) -> str | None:
        return getattr(self._wandb_run, "dir", None) if self._wandb_run is not None else None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        record = {"step": step, "time_s": round(time.time() - self._start, 3), **clean}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            numeric = {k: v for k, v in clean.items() if isinstance(v, float) and math.isfinite(v)}
            self._wandb_run.log(numeric, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
