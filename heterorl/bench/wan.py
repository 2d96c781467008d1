"""``heterorl bench wan``: does the delay model tell the truth? The same run twice, side by side:

- **lab**: a `heterorl learner` and ``--workers`` `heterorl rollout` processes on separate hosts of the network
  lab (`heterorl.netlab`: network namespaces), each worker's link shaped in the kernel and on the wire with the
  given latency ± jitter, packet loss and bandwidth, both ways; TCP and ZeroMQ carry everything for real;
- **model**: `heterorl train` on loopback with ``delay.up`` and ``delay.down`` set to the same parameters (a
  uniform delay of latency ± jitter per message, the bandwidth as ``bandwidth_bytes_per_s``).

It prints the staleness each measured (versions: mean, p50, p95, max; seconds: mean and the largest step mean),
samples/s, steps/s, the weights bytes the learner sent and the time from a version's publish until a worker had
it, with the ratio lab / model for each. Packet loss has no counterpart in the model: TCP retransmits what a
link loses, so the lab's loss shows up as latency, while the model's ``loss_prob`` drops whole messages; the
model run is given no loss (docs/DELAY.md, "What the model leaves out"). Needs root (the lab); a benchmark, not
a test: it asserts nothing about the two runs' closeness.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from heterorl.config import load_config, packaged, to_yaml
from heterorl.runs import read_metrics

BASE = ["loss.name=gepo", "runtime.mode=async", "task.options.eval_size=8", "rollout.group_size=4",
        "rl.prompts_per_step=4", "runtime.groups_per_call=2", "runtime.checkpoint_every=0",
        "runtime.fleet_wait_s=300", "logging.wandb_mode=disabled", "logging.progress=false",
        "logging.save_policy=false"]


def _config(args, run_dir: Path, delays: list[str]) -> str:
    overrides = [*BASE, f"rl.steps={args.steps}", f"rl.eval_every={args.steps}", f"runtime.workers={args.workers}",
                 f"logging.run_dir={run_dir}", *delays, *args.overrides]
    return to_yaml(load_config(packaged("maze_rl.yaml"), overrides))


def model_delays(args) -> list[str]:
    """``delay.up`` and ``delay.down`` as the lab's links: latency ± jitter (uniform) per message, the bandwidth;
    no loss (TCP turns a lost packet into a retransmission, not a lost message)."""
    low, high = max(0.0, args.delay_ms - args.jitter_ms) / 1e3, (args.delay_ms + args.jitter_ms) / 1e3
    delays = []
    for way in ("up", "down"):
        delays += [f"delay.{way}.kind=uniform", f"delay.{way}.low_s={low}", f"delay.{way}.high_s={high}"]
        if args.rate_mbit:
            delays.append(f"delay.{way}.bandwidth_bytes_per_s={args.rate_mbit * 1e6 / 8}")
    return delays


def run_lab(args, folder: Path) -> Path:
    """The run on the lab's hosts (plaintext: the model run has no CURVE either); its run folder."""
    from heterorl.netlab import LinkShape, NetLab
    from heterorl.netlab.fleet import LabFleet

    run_dir = folder / "run"
    config = folder / "run.yaml"
    config.write_text(_config(args, run_dir, ["delay.up.kind=none", "delay.down.kind=none"]))
    shape = LinkShape(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, loss=args.loss,
                      rate_mbit=args.rate_mbit or None)
    sysctls = {"net.ipv4.tcp_slow_start_after_idle": "0"} if args.no_slow_start_after_idle else {}
    with NetLab(args.workers, shape, backend=args.backend, sysctls=sysctls) as lab:
        fleet = LabFleet(lab, folder, config, curve=False)
        fleet.start_learner()
        workers = [fleet.start_worker(k) for k in range(1, args.workers + 1)]
        if fleet.learner.wait(args.timeout_s) != 0:
            raise RuntimeError(f"the lab's learner failed:\n{fleet.tail('learner')}")
        for k, worker in enumerate(workers, 1):
            try:
                worker.wait(60)
            except subprocess.TimeoutExpired:  # the learner's run is measured; a worker that missed its end is named
                worker.terminate()
                worker.wait(30)
                print(f"lab: worker {k} was still running 60 s after the learner's run ended (stopped); its log:\n"
                      f"{fleet.tail(f'w{k}')}")
        print(f"lab: {lab.backend} links; frames [carried, dropped] per link: {lab.wire_stats() or 'netem'}; "
              f"the wire used {lab.wire_cpu_s():.1f} CPU s of this machine's {os.cpu_count()} cores "
              f"(the learner's run took {_seconds(run_dir):.1f} s)")
    return run_dir


def _seconds(run_dir: Path) -> float:
    return 60 * json.loads((run_dir / "summary.json").read_text())["minutes"]


def run_model(args, folder: Path) -> Path:
    """The run on loopback with the delay model; its run folder."""
    run_dir = folder / "run"
    config = folder / "run.yaml"
    config.write_text(_config(args, run_dir, model_delays(args)))
    log = folder / "train.log"
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "heterorl.cli", "train", "--config", str(config)], stdout=out,
                              stderr=subprocess.STDOUT, timeout=args.timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the model run failed ({done.returncode}); see {log}")
    return run_dir


def measured(run_dir: Path) -> dict[str, float]:
    """What one run measured (the rows of the table; NaN where it measured nothing, e.g. no version's arrival
    timed in a very short run)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "staleness/seconds_mean" in r]
    weights = summary["weights"]
    row = {
        "staleness mean (versions)": summary["staleness_mean"], "staleness p50": summary["staleness_p50"],
        "staleness p95": summary["staleness_p95"], "staleness max": summary["staleness_max"],
        "staleness mean (s)": summary["staleness_seconds_mean"],
        "largest step mean (s)": max((r["staleness/seconds_mean"] for r in records), default=math.nan),
        "samples/s": summary["samples_per_s"], "steps/s": summary["steps"] / (60 * summary["minutes"]),
        "weights MB sent": weights.get("bytes_sent", 0) / 1e6,
        "weights arrival mean (s)": weights.get("arrival_s_mean", math.nan),
        "weights arrival max (s)": weights.get("arrival_s_max", math.nan),
    }
    return {name: math.nan if value is None else float(value) for name, value in row.items()}


def table(lab: dict[str, float], model: dict[str, float]) -> list[str]:
    lines = [f"  {'':28} {'lab':>10} {'model':>10} {'lab/model':>10}"]
    for name in lab:
        a, b = lab[name], model[name]
        ratio = a / b if b and not math.isnan(b) else math.nan
        lines.append(f"  {name:28} {a:10.3f} {b:10.3f} {ratio:9.2f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    from heterorl.netlab import missing

    parser = argparse.ArgumentParser(prog="heterorl bench wan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="learner steps of each run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="one-way latency of every link")
    parser.add_argument("--jitter-ms", type=float, default=10.0, help="± jitter (uniform)")
    parser.add_argument("--loss", type=float, default=0.005, help="packet loss on the lab's links (not modelled)")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="bandwidth each way (0: unlimited)")
    parser.add_argument("--backend", choices=("auto", "netem", "wire"), default="auto",
                        help="the lab's latency and loss: netem where the kernel has it, else the userspace wire")
    parser.add_argument("--no-slow-start-after-idle", action="store_true",
                        help="the lab hosts keep TCP windows over idle periods (tcp_slow_start_after_idle=0)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="give up on a run after this long")
    parser.add_argument("--out", default=None, help="keep both runs here (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides (both runs)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    why = missing()
    if why is not None:
        print(f"heterorl bench wan: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="heterorl-bench-wan-") as tmp:
        out = Path(args.out or tmp)
        (out / "lab").mkdir(parents=True, exist_ok=True)
        (out / "model").mkdir(parents=True, exist_ok=True)
        lab = measured(run_lab(args, out / "lab"))
        model = measured(run_model(args, out / "model"))
    rate = f"{args.rate_mbit:g} Mbit/s" if args.rate_mbit else "unlimited"
    print(f"{args.workers} workers, {args.steps} steps of the maze run; links {args.delay_ms:g} ms ± "
          f"{args.jitter_ms:g} ms one way, {args.loss:.1%} packet loss (lab only), {rate} each way")
    print("\n".join(table(lab, model)))
    return 0
