"""``heterorl bench async``: the same run in sync and in async mode, side by side, on two workloads.

``maze`` (balanced): 1 learner + 1 worker on the tiny maze policy, where training and sampling take about as
long, so on 2 cores the ideal async / sync ratio is 2× (sampling and training fully overlapped); sync is
`heterorl train --mode sync` (the worker waits for every new version while the learner trains).

``add3`` (learner-bound): 3-digit addition from the shipped add3 SFT base, 32 prompts × 8 per step: training
takes longer than sampling. Sync is also the one-process loop `heterorl rl`, which gives each phase every core
in turn: async must not fall behind it.

Samples/s counts the completions the learner trains on, measured between the second and the last step
(start-up and the final evaluation excluded). Waste: the share of the trajectories generated that were never
trained (discarded, or left over when the run ended).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from heterorl.config import load_config, packaged
from heterorl.errors import HeteroRLError
from heterorl.runs import read_metrics

WORKLOADS = ("maze", "add3")
QUIET = ["logging.wandb_mode=disabled", "logging.progress=false", "logging.save_policy=false",
         "runtime.checkpoint_every=0"]


def _measured_steps(run_dir: Path) -> list[dict]:
    """The step records between the second and the last step (the last includes the final evaluation)."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("step", 0) > 0]
    if len(records) < 3:
        raise ValueError("need at least 3 steps to measure a rate")
    return records[:-1]


def _samples_per_s(records: list[dict], samples_per_step: int) -> float:
    first, last = records[0], records[-1]
    return (last["step"] - first["step"]) * samples_per_step / max(last["time_s"] - first["time_s"], 1e-9)


def _workload(name: str, args) -> tuple[list[str], int, int]:
    """(config overrides, steps, samples per step) of a workload."""
    if name == "maze":
        return (["task.name=maze", "task.options.eval_size=32", "rl.base=maze-sft-base", "loss.name=gepo",
                 f"rl.prompts_per_step={args.prompts}", f"rollout.group_size={args.group_size}",
                 "rollout.max_tokens=24", f"runtime.groups_per_call={max(1, args.prompts // 2)}"],
                args.steps, args.prompts * args.group_size)
    return (["runtime.groups_per_call=8"], args.add3_steps, 32 * 8)


def _run_mode(name: str, mode: str, run_dir: Path, args) -> dict:
    from heterorl.runtime.launch import train

    overrides, steps, per_step = _workload(name, args)
    config = str(packaged("add3_rl.yaml")) if name == "add3" else None
    common = [*overrides, f"rl.steps={steps}", f"rl.eval_every={10 * steps}", f"logging.run_dir={run_dir}", *QUIET]
    if mode == "rl":  # the one-process synchronous loop, every core to each phase in turn
        command = [sys.executable, "-m", "heterorl.cli", "rl", *(["--config", config] if config else []), *common,
                   *args.overrides]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "WANDB_SILENT": "true"})
        if done.returncode != 0:
            raise HeteroRLError(f"`heterorl rl` failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        steps_measured = _measured_steps(run_dir)
        return {"samples_per_s": _samples_per_s(steps_measured, per_step), "learner_idle": None,
                "worker_idle": None, "staleness": 0.0, "wasted": 0.0, "train_s": None, "wait_s": None,
                "success": summary["final_success"]}
    cfg = load_config(config, [*common, f"runtime.mode={mode}", f"runtime.workers={args.workers}", *args.overrides])
    train(cfg)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = _measured_steps(run_dir)
    return {
        "samples_per_s": _samples_per_s(records, per_step),
        "learner_idle": summary["learner_idle_frac"], "worker_idle": summary["worker_idle_frac"],
        "staleness": summary["staleness_mean"], "wasted": summary["rollouts"]["wasted_frac"],
        "train_s": sum(r["learner/train_s"] for r in records[1:]) / (len(records) - 1),
        "wait_s": sum(r["learner/wait_s"] for r in records[1:]) / (len(records) - 1),
        "success": summary["final_success"],
    }


def _print_workload(name: str, results: dict, args) -> None:
    _, steps, _ = _workload(name, args)
    shape = f"{args.prompts} prompts x {args.group_size}" if name == "maze" else "32 prompts x 8"
    print(f"\n{name} ({'balanced' if name == 'maze' else 'learner-bound'}): 1 learner + {args.workers} worker(s), "
          f"{shape} per step, {steps} steps")
    print(f"  {'mode':<6} {'samples/s':>10} {'learner idle':>13} {'worker idle':>12} {'staleness':>10} "
          f"{'wasted':>8} {'success':>8}")
    for mode, r in results.items():
        idle = [f"{r[k]:>{w}.0%}" if r[k] is not None else f"{'-':>{w}}" for k, w in (("learner_idle", 13),
                                                                                        ("worker_idle", 12))]
        print(f"  {mode:<6} {r['samples_per_s']:>10.1f} {idle[0]} {idle[1]} {r['staleness']:>10.2f} "
              f"{r['wasted']:>8.1%} {r['success']:>8.3f}")
    ratio = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"  async / sync: {ratio:.2f}x  (wasted: async {results['async']['wasted']:.1%}, "
          f"sync {results['sync']['wasted']:.1%})")
    if "rl" in results:
        print(f"  async / rl (one process, all cores per phase): "
              f"{results['async']['samples_per_s'] / results['rl']['samples_per_s']:.2f}x  (target >= 1.0x)")
    else:
        print("  (target >= 1.8x; the limit is 2x: sampling and training fully overlapped)")
    sync = results["sync"]
    bound = overlap_bound(sync["train_s"], sync["wait_s"])
    if bound is not None:
        print(f"  overlap bound of this workload: {bound:.2f}x (a sync step: learner trains {sync['train_s']:.3f} s, "
              f"then waits {sync['wait_s']:.3f} s for the next batch); async reached {ratio / bound:.0%} of it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench async", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=(*WORKLOADS, "both"), default="both")
    parser.add_argument("--steps", type=int, default=20, help="learner steps per mode (maze)")
    parser.add_argument("--prompts", type=int, default=16, help="groups per learner step (maze)")
    parser.add_argument("--group-size", type=int, default=8, help="(maze)")
    parser.add_argument("--add3-steps", type=int, default=100, help="learner steps per mode (add3)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides (every run)")
    args = parser.parse_args(argv)
    if min(args.steps, args.add3_steps) < 3:
        raise HeteroRLError("--steps and --add3-steps must be >= 3: the rate is measured between the second and "
                            "the last step")
    workloads = WORKLOADS if args.workload == "both" else (args.workload,)
    print("each learner / worker process: its runtime threads (runtime.learner_threads, runtime.worker_threads); "
          "`heterorl rl`: torch's default")
    with tempfile.TemporaryDirectory(prefix="heterorl-bench-async-") as tmp:
        for name in workloads:
            modes = ("sync", "async", "rl") if name == "add3" else ("sync", "async")
            results = {mode: _run_mode(name, mode, Path(tmp) / f"{name}-{mode}", args) for mode in modes}
            _print_workload(name, results, args)
    return 0


def overlap_bound(train_s: float | None, wait_s: float | None) -> float | None:
    """The best async/sync ratio a perfect overlap can give: a sync step takes T + S (train, then wait for the
    batch sampled with the new weights), an async one max(T, S). 2x only when both take equally long."""
    if train_s is None or wait_s is None or max(train_s, wait_s) <= 0:
        return None
    return (train_s + wait_s) / max(train_s, wait_s)
