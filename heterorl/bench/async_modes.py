"""``heterorl bench async``: the same run in sync and in async mode (1 learner + 1 worker), side by side.

Sync mode alternates (the worker waits for every new version while the learner
trains), async mode overlaps sampling and training, so on 2 cores the ideal
ratio is 2×. Samples/s counts the completions the learner trains on, measured
between the second and the last step (start-up and the final evaluation
excluded).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from heterorl.config import load_config
from heterorl.runs import read_metrics


def _measured_steps(run_dir: Path) -> list[dict]:
    """The step records between the second and the last step (the last includes the final evaluation)."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("step", 0) > 0]
    if len(records) < 3:
        raise ValueError("need at least 3 steps to measure a rate")
    return records[:-1]


def _samples_per_s(records: list[dict], samples_per_step: int) -> float:
    first, last = records[0], records[-1]
    return (last["step"] - first["step"]) * samples_per_step / max(last["time_s"] - first["time_s"], 1e-9)


def main(argv: list[str] | None = None) -> int:
    from heterorl.runtime.launch import train

    parser = argparse.ArgumentParser(prog="heterorl bench async", description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="learner steps per mode")
    parser.add_argument("--prompts", type=int, default=16, help="groups per learner step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="heterorl-bench-async-") as tmp:
        for mode in ("sync", "async"):
            run_dir = Path(tmp) / mode
            cfg = load_config(None, [
                "task.name=maze", "task.options.eval_size=32", "rl.base=maze-sft-base", "loss.name=gepo",
                f"rl.steps={args.steps}", f"rl.prompts_per_step={args.prompts}", f"rl.eval_every={10 * args.steps}",
                f"rollout.group_size={args.group_size}", "rollout.max_tokens=24", f"runtime.mode={mode}",
                f"runtime.workers={args.workers}", f"runtime.groups_per_call={max(1, args.prompts // 2)}",
                "runtime.checkpoint_every=0", f"logging.run_dir={run_dir}", "logging.wandb_mode=disabled",
                "logging.progress=false", *args.overrides,
            ])
            train(cfg)
            summary = json.loads((run_dir / "summary.json").read_text())
            steps = _measured_steps(run_dir)
            results[mode] = {
                "samples_per_s": _samples_per_s(steps, args.prompts * args.group_size),
                "learner_idle": summary["learner_idle_frac"], "worker_idle": summary["worker_idle_frac"],
                "staleness": summary["staleness_mean"],
                "train_s": sum(r["learner/train_s"] for r in steps[1:]) / (len(steps) - 1),
                "wait_s": sum(r["learner/wait_s"] for r in steps[1:]) / (len(steps) - 1),
            }
    print(f"1 learner + {args.workers} worker(s), {args.prompts} prompts x {args.group_size} per step, "
          f"{args.steps} steps, tiny maze policy, 1 thread per process")
    print(f"  {'mode':<6} {'samples/s':>10} {'learner idle':>13} {'worker idle':>12} {'staleness':>10}")
    for mode, r in results.items():
        print(f"  {mode:<6} {r['samples_per_s']:>10.1f} {r['learner_idle']:>13.0%} {r['worker_idle']:>12.0%} "
              f"{r['staleness']:>10.2f}")
    ratio = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"async / sync: {ratio:.2f}x  (target >= 1.6x; the limit is 2x: sampling and training fully overlapped)")
    sync = results["sync"]
    bound = overlap_bound(sync["train_s"], sync["wait_s"])
    if bound is not None:
        print(f"overlap bound of this workload: {bound:.2f}x (a sync step: learner trains {sync['train_s']:.3f} s, "
              f"then waits {sync['wait_s']:.3f} s for the next batch); async reached {ratio / bound:.0%} of it")
    return 0


def overlap_bound(train_s: float, wait_s: float) -> float | None:
    """The best async/sync ratio a perfect overlap can give: a sync step takes T + S (train, then wait for the
    batch sampled with the new weights), an async one max(T, S). 2x only when both take equally long."""
    if max(train_s, wait_s) <= 0:
        return None
    return (train_s + wait_s) / max(train_s, wait_s)
