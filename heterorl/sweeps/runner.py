"""Delay sweeps: losses × delay settings × seeds (× any other config key), one normal training run per cell.

    heterorl sweep experiments/configs/maze_cpu.yaml [key=value ...] [--out DIR] [--dry-run]
    heterorl compare --losses gepo,grpo --delay 16 [--config RUN.yaml] [--seeds 0,1]

A sweep file names a base run config and the grid (docs/EXPERIMENTS.md has the whole picture)::

    name: maze-cpu
    config: maze_sweep_run.yaml      # the base run config: a path relative to this file, or a packaged config
    mode: simulated                  # simulated (one process per cell, virtual clock) | live (processes, ZeroMQ)
    parallel: 2                      # cells run at once
    seconds_per_step: 28.125         # the stated mapping of delay seconds to learner steps (1800 s = 64 steps)
    losses: [gepo, grpo, gspo, tis, dr_grpo]   # presets (LOSS_PRESETS) or {label: {dotted.key: value}}
    delays: ["0", "8", "16", "32", "64", lognormal, weibull]   # presets (delay_overrides) or {label: {...}}
    seeds: [0, 1, 2]
    grid: {optim.lr: [1.0e-4, 3.0e-4]}         # optional: any other config key
    overrides: {rl.steps: 60}                  # optional: applied to every cell

Each cell is ``heterorl train`` on the base config plus the cell's overrides, in ``OUT/cells/<cell>/`` (its own
run dir). Resumable: a cell whose ``summary.json`` says done with the same resolved config is not rerun; a cell
interrupted half-way is run again from the start. ``OUT/report/`` is rewritten at the end (`heterorl report`).

Delay presets, with S = seconds_per_step:

``"0"``         online: sync mode (workers wait for every new version), no delay;
``"lagK"``      a fixed staleness of K versions (``delay.fixed_lag_steps``, simulated execution): every batch is
                sampled by the policy exactly K versions old, from the first step (no ramp); "lag0" is on-policy;
``"K"`` (int)   max tolerable delay of K steps: async; each version reaches each worker after its own delay,
                uniform in [0, K·S] s (a worker keeps the newest it has); the learner's window drops data
                older than K versions;
``lognormal``   the paper's seconds-based setting: delay = clamp(T − d0, L, U), T LogNormal with P(L ≤ T ≤ U) =
``weibull``     c; L = 60 s, U = 1920 s, d0 = 400 s, c = 0.995 (Weibull alike), each version its own delay;
                window of ceil(U / S) versions.
``lognormal@S'`` the same delays at S' seconds per learner step instead of the sweep's S: a faster learner
``weibull@S'``  sees the same seconds as more versions (lognormal@3: mean staleness ~20, where S = 28.125 gives ~4).

All the delay sits on the weights path (learner → workers): what matters to the loss is how old the sampling
policy is, and one path keeps that legible. Trajectories travel without delay.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from heterorl.errors import ConfigError, HeteroRLError
from heterorl.files import write_atomically
from heterorl.runs import json_text, read_metrics
from heterorl.runtime.signals import signal_handlers
from heterorl.runtime.supervise import stop_process
from heterorl.sweeps.environment import run_environment
from heterorl.sweeps.report import cell_name

# A loss preset is the loss with its published defaults; "tis" is GRPO with truncated importance sampling.
LOSS_PRESETS: dict[str, dict[str, Any]] = {
    "gepo": {"loss.name": "gepo"},
    "grpo": {"loss.name": "grpo"},
    "gspo": {"loss.name": "gspo"},
    "tis": {"loss.name": "tis"},
    "dr_grpo": {"loss.name": "dr_grpo"},
}
# a stopped sweep gives each running cell this long to stop its learner and workers itself (`heterorl train` stops
# each in turn, up to 10 s apiece), then SIGKILLs what is left of the cell's process tree
CELL_STOP_S = 45.0
PAPER_DELAY = {"L_s": 60.0, "U_s": 1920.0, "d0_s": 400.0, "c": 0.995}


@dataclass
class SweepSpec:
    name: str = "sweep"
    config: str = "demo.yaml"
    mode: str = "simulated"  # simulated | live
    parallel: int = 1
    threads_per_cell: int = 1
    seconds_per_step: float = 28.125  # 1800 s ≈ 64 steps, as the paper states
    time_scale: float = 10.0  # live mode only: virtual seconds per real second
    losses: Any = None  # a list of presets or {label: overrides}; None: gepo and grpo
    delays: Any = None  # a list of presets or {label: overrides}; None: online (0) and 16 steps
    seeds: list[int] = field(default_factory=lambda: [0])
    grid: dict[str, list[Any]] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    wandb_project: str | None = None


def delay_overrides(label: str, seconds_per_step: float) -> dict[str, Any]:
    """The config overrides of a delay preset (see the module docstring)."""
    none = {"delay.up.kind": "none", "delay.down.kind": "none"}
    if label == "0":
        return {"runtime.mode": "sync", **none, "delay.seconds_per_step": seconds_per_step}
    if label.startswith("lag") and label[3:].isdigit():
        return {"runtime.mode": "sync", **none, "delay.fixed_lag_steps": int(label[3:]),
                "delay.seconds_per_step": seconds_per_step}
    if label.isdigit():
        steps = int(label)
        return {"runtime.mode": "async", "buffer.policy": "window", "buffer.max_staleness_steps": steps,
                "delay.up.kind": "none", "delay.down.kind": "uniform", "delay.down.low_s": 0.0,
                "delay.down.high_s": steps * seconds_per_step, "delay.down.reorder": True,
                "delay.seconds_per_step": seconds_per_step}
    kind, _, at = label.partition("@")
    if kind in ("lognormal", "weibull"):
        if at:
            try:
                seconds_per_step = float(at)
            except ValueError:
                seconds_per_step = -1.0
            if not (math.isfinite(seconds_per_step) and seconds_per_step > 0):
                raise ConfigError(f"delay {label!r}: after '@' give the seconds per learner step, a number > 0 "
                                  f"(e.g. {kind}@3)")
        window = math.ceil(PAPER_DELAY["U_s"] / seconds_per_step)
        return {"runtime.mode": "async", "buffer.policy": "window", "buffer.max_staleness_steps": window,
                "delay.up.kind": "none", "delay.down.kind": kind, "delay.down.reorder": True,
                **{f"delay.down.{k}": v for k, v in PAPER_DELAY.items()}, "delay.seconds_per_step": seconds_per_step}
    raise ConfigError(f"delay {label!r}: not a preset (0, a number of steps, lagK, lognormal, weibull, "
                      f"lognormal@SECONDS_PER_STEP); give it as a "
                      f"mapping {{label: {{dotted.key: value}}}} in `delays` instead")


def _labelled(value: Any, key: str, preset) -> dict[str, dict[str, Any]]:
    """``[name, ...]`` (presets) or ``{label: {dotted.key: value}}`` → {label: overrides}."""
    if isinstance(value, dict):
        return {str(k): dict(v or {}) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and value:
        return {str(v): preset(str(v)) for v in value}
    raise ConfigError(f"sweep key `{key}`: give a non-empty list of presets or a mapping {{label: overrides}}")


def _loss_preset(name: str) -> dict[str, Any]:
    import gepo

    if name in LOSS_PRESETS:
        return dict(LOSS_PRESETS[name])
    if name in gepo.loss_names():
        return {"loss.name": name}
    raise ConfigError(f"loss {name!r}: not a loss ({', '.join(gepo.loss_names())})")


@dataclass
class PlannedCell:
    name: str
    loss: str
    delay: str
    seed: int
    overrides: dict[str, Any]
    extra: dict[str, Any]  # values of the other swept keys

    @property
    def variant(self) -> str:
        """The loss label, plus the other swept keys' values when there are any."""
        return self.loss + "".join(f"+{k}={v}" for k, v in self.extra.items())


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # the shell's exit status for a signal, after the `finally` blocks ran


class SweepRunner:
    def __init__(self, spec_path: str | Path | None, overrides: list[str] = (), out: str | Path | None = None,
                 spec: SweepSpec | None = None, base_dir: Path | None = None):
        self.spec = spec or load_spec(spec_path, overrides)
        self.base_dir = base_dir or (Path(spec_path).resolve().parent if spec_path else Path.cwd())
        self.out = Path(out or Path("runs") / "sweeps" / self.spec.name)
        self.losses = _labelled(self.spec.losses, "losses", _loss_preset)
        self.delays = _labelled(self.spec.delays, "delays",
                                lambda label: delay_overrides(label, self.spec.seconds_per_step))
        self.base_config = self._base_config_path()
        self.cells = self._cells()

    def _base_config_path(self) -> Path:
        from heterorl.config import packaged

        path = Path(self.spec.config)
        if not path.is_absolute():
            path = self.base_dir / path
        if path.is_file():
            return path
        try:
            return packaged(self.spec.config)
        except HeteroRLError:
            raise ConfigError(f"sweep key `config` = {self.spec.config!r}: no such file next to the sweep file "
                              f"({path}) nor a packaged config") from None

    def _cells(self) -> list[PlannedCell]:
        import itertools

        keys = list(self.spec.grid)
        cells = []
        # seed-major: a sweep stopped half-way has whole grids for its first seeds
        for seed, *values, delay, loss in itertools.product(self.spec.seeds, *self.spec.grid.values(), self.delays,
                                                            self.losses):
            extra = dict(zip(keys, values))
            cell = PlannedCell("", loss, delay, seed, {}, extra)
            cell.name = cell_name(cell.variant, delay, seed)
            cell.overrides = {**self.spec.overrides, **self.losses[loss], **self.delays[delay], **extra,
                              "seed": seed, "runtime.execution": self.spec.mode,
                              "runtime.threads": self.spec.threads_per_cell,
                              "logging.run_dir": str(self.out / "cells" / cell.name), "logging.progress": False,
                              "logging.save_policy": False, "logging.wandb_group": self.spec.name}
            if self.spec.wandb_project:
                cell.overrides["logging.wandb_project"] = self.spec.wandb_project
            if self.spec.mode == "live":
                cell.overrides["delay.time_scale"] = self.spec.time_scale
            cells.append(cell)
        return cells

    # -- resolution and state ---------------------------------------------------------------------
    def resolve(self, cell: PlannedCell):
        from heterorl.config import load_config

        try:
            return load_config(self.base_config, [f"{k}={_yaml(v)}" for k, v in cell.overrides.items()])
        except ConfigError as exc:
            raise ConfigError(f"cell {cell.name}: {exc}") from None

    def is_done(self, cell: PlannedCell, digest: str) -> bool:
        path = self.out / "cells" / cell.name / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        return summary.get("status") == "done" and summary.get("config_sha") == digest

    def write_spec(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        variants = list(dict.fromkeys(c.variant for c in self.cells))
        online = next((d for d in ("0", "lag0") if d in self.delays), None)  # the on-policy reference
        (self.out / "sweep.json").write_text(json.dumps({
            "name": self.spec.name, "mode": self.spec.mode, "losses": variants, "delays": list(self.delays),
            "seeds": list(self.spec.seeds), "online_delay": online, "seconds_per_step": self.spec.seconds_per_step,
            "base_config": str(self.base_config), "grid": {k: list(v) for k, v in self.spec.grid.items()},
        }, indent=2))

    # -- running ----------------------------------------------------------------------------------
    def run(self, log=print) -> list[str]:
        """Run every cell not done yet, ``parallel`` at a time; returns the names of the cells that failed."""
        from heterorl.config import to_yaml

        self.write_spec()
        todo = []
        base_text = self.base_config.read_text()
        for cell in self.cells:
            text = to_yaml(self.resolve(cell))
            # what the cell asked for (base file + its overrides), not the resolved config: a new config key
            # with a default in a later release does not make finished cells stale
            asked = {k: v for k, v in cell.overrides.items() if k != "logging.run_dir"}  # a moved sweep dir is fine
            asked_json = json.dumps([base_text, asked], sort_keys=True, default=str)
            digest = hashlib.sha256(asked_json.encode()).hexdigest()[:16]
            if self.is_done(cell, digest):
                continue
            todo.append((cell, text, digest))
        log(f"sweep {self.spec.name}: {len(self.cells)} cells, {len(self.cells) - len(todo)} done already, "
            f"{len(todo)} to run ({self.spec.parallel} at a time, {self.spec.mode}) -> {self.out}")
        running: list[tuple[PlannedCell, str, subprocess.Popen, float]] = []
        failed: list[str] = []
        try:
            # SIGTERM (`kill`, `timeout`, a batch system) ends the sweep through `finally`, as Ctrl-C does: the cells
            # run in sessions of their own, so a signal to the sweep does not reach them, and left running they
            # would write into folders the next run starts again
            with signal_handlers(_exit_on_signal, (signal.SIGTERM,)):
                self._run_cells(todo, running, failed, log)
        finally:
            for _, _, proc, _ in running:  # interrupted: stop what runs (each cell's whole process tree, until it is
                stop_process(proc, CELL_STOP_S)  # gone: no orphan writes into its folder); those cells rerun next time
        return failed

    def _run_cells(self, todo: list, running: list, failed: list[str], log) -> None:
        """Start cells as slots free up and record each one that ends, until none is left (``running`` is the
        caller's, so that it can stop what runs when this is interrupted)."""
        finished = 0
        while todo or running:
            while todo and len(running) < self.spec.parallel:
                cell, text, digest = todo.pop(0)
                running.append((cell, digest, self._start(cell, text), time.monotonic()))
            for item in list(running):
                cell, digest, proc, started = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                finished += 1
                ok = self._record(cell, digest, proc.returncode)
                if not ok:
                    failed.append(cell.name)
                log(self._progress_line(cell, ok, finished, finished + len(todo) + len(running),
                                        time.monotonic() - started))
            time.sleep(0.2)

    def _start(self, cell: PlannedCell, config_text: str) -> subprocess.Popen:
        folder = self.out / "cells" / cell.name
        if folder.exists():
            shutil.rmtree(folder)  # half-done: start again
        folder.mkdir(parents=True)
        (folder / "cell_config.yaml").write_text(config_text)
        threads = str(self.spec.threads_per_cell)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "WANDB_SILENT": "true",
               "PYTHONUNBUFFERED": "1"}
        with (folder / "log.txt").open("wb") as log_file:
            return subprocess.Popen([sys.executable, "-m", "heterorl.cli", "train", "--config",
                                     str(folder / "cell_config.yaml")], stdout=log_file, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)

    def _record(self, cell: PlannedCell, digest: str, code: int) -> bool:
        folder = self.out / "cells" / cell.name
        path = folder / "summary.json"
        cfg = OmegaConf.load(folder / "cell_config.yaml")
        meta = {"cell": cell.name, "task": cfg.task.name, "loss": cell.variant, "loss_name": cfg.loss.name,
                "delay": cell.delay, "seed": cell.seed, "mode": self.spec.mode, "config_sha": digest,
                "swept": cell.extra, "environment": run_environment(self.spec.threads_per_cell)}
        if code == 0 and path.is_file():
            summary = {**json.loads(path.read_text()), **meta, "status": "done",
                       "metric_means": metric_means(folder / "metrics.jsonl")}
        else:
            tail = (folder / "log.txt").read_text(errors="replace").splitlines()[-20:]
            summary = {**meta, "status": "failed", "exit_code": code, "log_tail": tail}
        write_atomically(path, json_text(summary, indent=2).encode())
        return summary["status"] == "done"

    def _progress_line(self, cell: PlannedCell, ok: bool, finished: int, total: int, seconds: float) -> str:
        if not ok:
            log_path = self.out / "cells" / cell.name / "log.txt"
            return f"[{finished}/{total}] {cell.name}: FAILED after {seconds:.0f} s (see {log_path})"
        s = json.loads((self.out / "cells" / cell.name / "summary.json").read_text())
        return (f"[{finished}/{total}] {cell.name}: success {s['base_success']:.3f} -> {s['final_success']:.3f} "
                f"(best {s['best_success']:.3f}), staleness {s['staleness_mean']:.1f} (max {s['staleness_max']}), "
                f"{seconds:.0f} s")


# the per-step metrics a finished cell's summary keeps the run's mean of, so that a sweep's claims and drift
# columns rebuild from the summaries alone (a cell's metrics.jsonl may stay on the machine that ran it)
SUMMARISED = ("ratio/seq_var", "ratio/seq_ess", "ratio/token_var", "is/weight_var", "is/clip_frac", "is/mask_frac",
              "kl/k3")


def metric_means(path: Path) -> dict[str, float]:
    """{metric: its mean over the steps of ``path`` that logged it}, for the `SUMMARISED` metrics."""
    records = read_metrics(path) if path.is_file() else []
    means = {}
    for key in SUMMARISED:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if values:
            means[key] = sum(values) / len(values)
    return means


def _yaml(value: Any) -> str:
    """A value as an OmegaConf dotlist right-hand side."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _override(merged, item: str):
    """One ``key=value`` from the command line: a mapping merges into a mapping (``overrides={rl.steps: 2}``
    adds to the file's), anything else replaces (``losses=[gepo]`` runs one loss of a file that maps its losses)."""
    key = item.split("=", 1)[0].strip()
    value = OmegaConf.select(OmegaConf.from_dotlist([item]), key)
    current = OmegaConf.select(merged, key, default=None)
    OmegaConf.update(merged, key, value, merge=OmegaConf.is_dict(current) and OmegaConf.is_dict(value))
    return merged


def load_spec(path: str | Path | None, overrides: list[str] = ()) -> SweepSpec:
    """Defaults ← the sweep YAML ← ``key=value`` overrides, validated."""
    merged = OmegaConf.structured(SweepSpec)
    try:
        if path is not None:
            if not Path(path).is_file():
                raise ConfigError(f"sweep file {path} does not exist")
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override {bad[0]!r} is not of the form key=value (e.g. parallel=2)")
        for item in overrides:
            merged = _override(merged, item)
        container = OmegaConf.to_container(merged, resolve=True)
    except (OmegaConfBaseException, TypeError) as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"sweep key `{key}`: {str(exc).splitlines()[0]}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"sweep file {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    spec = SweepSpec(**container)
    spec.losses = spec.losses if spec.losses is not None else ["gepo", "grpo"]
    spec.delays = spec.delays if spec.delays is not None else ["0", "16"]
    if spec.mode not in ("simulated", "live"):
        raise ConfigError(f"sweep key `mode` = {spec.mode!r}: must be simulated or live")
    for key in ("parallel", "threads_per_cell", "seconds_per_step", "time_scale"):
        if not getattr(spec, key) > 0:
            raise ConfigError(f"sweep key `{key}` = {getattr(spec, key)}: must be > 0")
    if not spec.seeds:
        raise ConfigError("sweep key `seeds`: give at least one seed")
    for key, values in spec.grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep key `grid.{key}`: give a non-empty list of values")
    return spec


__all__ = ["LOSS_PRESETS", "SweepRunner", "SweepSpec", "delay_overrides", "load_spec"]
