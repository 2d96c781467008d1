"""``heterorl bench simulate``: one small run live and simulated, the staleness each measured side by side.

The live run is the real system (a learner and its rollout workers as processes over ZeroMQ on loopback, a
constant delay on the weights path). The simulated run replays it on the virtual clock with the durations the
live run measured (the median seconds per learner step, the workers' busy seconds per engine call). Where the two
staleness distributions agree, the simulated sweeps' staleness means what a live fleet with those timings would
see. Live timings vary with the machine's load, so this is a benchmark and not a test: it prints both, it never
asserts their closeness.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from heterorl.config import load_config
from heterorl.runs import read_metrics, setup_run


def _overrides(args, run_dir: Path) -> list[str]:
    return [
        "task.name=maze", "task.options.eval_size=16", "rl.base=maze-sft-base", "loss.name=gepo",
        f"rl.steps={args.steps}", f"rl.prompts_per_step={args.prompts}", f"rl.eval_every={args.steps}",
        f"rollout.group_size={args.group_size}", "rollout.max_tokens=24", f"runtime.workers={args.workers}",
        f"runtime.groups_per_call={max(1, args.prompts // args.workers)}", "runtime.checkpoint_every=0",
        f"buffer.max_staleness_steps={args.max_staleness}", "delay.down.kind=constant",
        f"delay.down.constant_s={args.weights_delay_s}", f"logging.run_dir={run_dir}", "logging.wandb_mode=disabled",
        "logging.progress=false", "logging.save_policy=false", *args.overrides,
    ]


def _row(name: str, summary: dict) -> str:
    return (f"  {name:<10} {summary['staleness_mean']:>6.2f} {summary['staleness_p50']:>5.1f} "
            f"{summary['staleness_p95']:>5.1f} {summary['staleness_max']:>5.1f} "
            f"{summary['rollouts']['wasted_frac']:>8.1%}")


def main(argv: list[str] | None = None) -> int:
    from heterorl.runtime.launch import train
    from heterorl.runtime.simulate import Simulation

    parser = argparse.ArgumentParser(prog="heterorl bench simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="learner steps of each run")
    parser.add_argument("--prompts", type=int, default=4, help="groups per learner step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--weights-delay-s", type=float, default=1.5, help="constant delay of every weights message")
    parser.add_argument("--max-staleness", type=int, default=16, help="buffer.max_staleness_steps")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides (both runs)")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the step period is a median over the steps after the first)")
    with tempfile.TemporaryDirectory(prefix="heterorl-bench-simulate-") as tmp:
        live_dir, sim_dir = Path(tmp) / "live", Path(tmp) / "simulated"
        train(load_config(None, _overrides(args, live_dir)))
        live = json.loads((live_dir / "summary.json").read_text())
        steps = [r for r in read_metrics(live_dir / "metrics.jsonl") if r.get("step", 0) > 0]
        step_s = statistics.median(b["time_s"] - a["time_s"] for a, b in zip(steps, steps[1:]))
        call_s = steps[-1]["workers/busy_s_per_group"] * max(1, args.prompts // args.workers)
        cfg = load_config(None, [*_overrides(args, sim_dir), "runtime.execution=simulated",
                                 f"simulate.step_s={step_s}", f"simulate.call_s={call_s}"])
        task, training, logger, _ = setup_run(cfg, "bench-simulate", cfg.rl.base)
        try:
            simulated = dataclasses.asdict(Simulation(cfg, training, task, logger).run())
        finally:
            logger.close()
    print(f"1 learner + {args.workers} workers, {args.prompts} prompts x {args.group_size} per step, "
          f"{args.steps} steps, "
          f"weights delayed {args.weights_delay_s} s, buffer.max_staleness_steps={args.max_staleness}")
    print(f"measured live: {step_s:.3f} s per learner step, {call_s:.3f} s per engine call "
          f"(= {args.weights_delay_s / step_s:.1f} steps of weights delay)")
    print(f"  {'run':<10} {'mean':>6} {'p50':>5} {'p95':>5} {'max':>5} {'wasted':>8}   staleness in versions; "
          "rollouts never trained")
    print(_row("live", live))
    print(_row("simulated", simulated))
    ratio = simulated["staleness_mean"] / live["staleness_mean"] if live["staleness_mean"] else float("nan")
    print(f"simulated / live mean staleness: {ratio:.2f}x  (1.00x = the simulation matches)")
    return 0
