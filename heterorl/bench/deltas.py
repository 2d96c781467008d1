"""``heterorl bench deltas``: the same run with weight deltas on and off, behind bandwidth-limited weights links.

Each worker's weights link carries what the learner sends it: with ``transport.weights_deltas`` the steps since
the version it holds (heterorl.transport.weights.deltas), without them the whole version in the wire dtype. A link still
transmitting lets versions published meanwhile wait, and sends only the newest of them next, so a whole version
that takes longer than a learner step leaves workers further behind instead of queueing forever. The runs differ
only in that switch (same seed, model, task, delays); the table puts their staleness (groups trained per
staleness in versions, and by seconds since the version was published), samples/s and link bytes side by side.

The simulated execution (the default) charges the links on a virtual clock, so the comparison is exact and
repeatable; ``--live`` runs the real processes over loopback with the same links.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from heterorl.config import load_config


def _overrides(args, run_dir: Path, mode: str, bandwidth_bps: float, deltas: bool) -> list[str]:
    return [
        f"runtime.mode={mode}", "task.name=arithmetic", "task.options.digits=3", "task.options.ops=+",
        "task.options.answer_format=digits",
        "task.options.eval_size=128", "rl.base=add3-sft-base", f"loss.name={args.loss}", f"rl.steps={args.steps}",
        f"rl.prompts_per_step={args.prompts}", f"rl.eval_every={args.steps}", "rollout.group_size=8",
        "rollout.max_tokens=6", f"runtime.workers={args.workers}", "runtime.checkpoint_every=0",
        f"runtime.execution={'live' if args.live else 'simulated'}", f"runtime.weights_dtype={args.dtype}",
        f"transport.weights_deltas={str(deltas).lower()}", "delay.down.kind=constant",
        f"delay.down.constant_s={args.latency_s}", f"delay.down.bandwidth_bytes_per_s={bandwidth_bps / 8}",
        f"logging.run_dir={run_dir}", "logging.wandb_mode=disabled", "logging.progress=false",
        "logging.save_policy=false", *args.overrides,
    ]


def _hist(values: list[int]) -> str:
    return " ".join(str(v) for v in values)


def _seconds(hist: dict[str, int]) -> str:
    return " ".join(f"{label}:{n}" for label, n in hist.items() if n)


def _table(rows: list[tuple[str, dict, dict]]) -> list[str]:
    lines = [f"  {'':<40} {'deltas off':>12} {'deltas on':>12} {'on / off':>9}"]
    for name, off, on in rows:
        for label, key, fmt in (("staleness mean (versions)", "staleness_mean", ".2f"),
                                ("staleness p95 (versions)", "staleness_p95", ".1f"),
                                ("staleness mean (seconds)", "staleness_seconds_mean", ".2f"),
                                ("samples/s", "samples_per_s", ".2f"),
                                ("held-out success at the end", "final_success", ".3f")):
            ratio = f"{on[key] / off[key]:>8.2f}x" if off[key] else f"{'-':>9}"
            lines.append(f"  {name + ' ' + label:<40} {off[key]:>12{fmt}} {on[key]:>12{fmt}} {ratio}")
        link_off, link_on = off["weights"]["link_bytes"] / 1e6, on["weights"]["link_bytes"] / 1e6
        lines.append(f"  {name + ' MB over the links':<40} {link_off:>12.2f} {link_on:>12.2f} "
                     f"{link_on / link_off if link_off else float('nan'):>8.2f}x")
        for which, summary in (("off", off), ("on", on)):
            lines.append(f"    deltas {which:<3} groups by staleness 0,1,2..: {_hist(summary['staleness_hist'])}; "
                         f"by seconds: {_seconds(summary['staleness_seconds_hist'])}")
    return lines


def main(argv: list[str] | None = None) -> int:
    from heterorl.runtime.launch import train

    parser = argparse.ArgumentParser(prog="heterorl bench deltas", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidths-mbit", default="8,32",
                        help="weights link bandwidths, Mbit/s, comma-separated (default 8,32: a whole bf16 "
                             "version of the shipped 1M-parameter base takes about 2 and 0.5 learner steps)")
    parser.add_argument("--latency-s", type=float, default=0.1, help="constant latency of the weights links")
    parser.add_argument("--modes", default="async,sync",
                        help="runtime.mode of the runs, comma-separated (sync: each batch waits for the newest "
                             "version, so the link's time shows in samples/s)")
    parser.add_argument("--steps", type=int, default=30, help="learner steps of each run")
    parser.add_argument("--prompts", type=int, default=16, help="groups per learner step")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--loss", default="gepo")
    parser.add_argument("--dtype", default="bfloat16", help="runtime.weights_dtype (auto is float32 for this model)")
    parser.add_argument("--live", action="store_true", help="real processes over loopback instead of simulated")
    parser.add_argument("--out", type=Path, help="write both runs' summaries per bandwidth here (JSON)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides (every run)")
    args = parser.parse_args(argv)
    try:
        bandwidths = [float(b) * 1e6 for b in args.bandwidths_mbit.split(",")]
    except ValueError:
        parser.error(f"--bandwidths-mbit {args.bandwidths_mbit!r}: give numbers, e.g. 8,32")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"async", "sync"}:
        parser.error(f"--modes {args.modes!r}: give async, sync or both")
    rows, found = [], {}
    with tempfile.TemporaryDirectory(prefix="heterorl-bench-deltas-") as tmp:
        for mode in modes:
            for bandwidth in bandwidths:
                pair, name = [], f"{mode} {bandwidth / 1e6:g} Mbit/s"
                for deltas in (False, True):
                    run_dir = Path(tmp) / f"{mode}-{bandwidth:g}-{'on' if deltas else 'off'}"
                    train(load_config(None, _overrides(args, run_dir, mode, bandwidth, deltas)))
                    pair.append(json.loads((run_dir / "summary.json").read_text()))
                rows.append((name, *pair))
                found[name] = {"off": pair[0], "on": pair[1]}
    weights = rows[0][2]["weights"]
    print(f"{'live' if args.live else 'simulated'}: 1 learner + {args.workers} workers, {args.prompts} prompts x 8, "
          f"{args.steps} steps, {args.loss}; weights in {weights['dtype']}: {weights['version_bytes'] / 1e6:.2f} MB "
          f"a version, {weights['step_bytes_mean'] / 1e6:.3f} MB a step as deltas "
          f"({weights['bytes_ratio']:.1f}x smaller); links: {args.latency_s} s latency")
    print("\n".join(_table(rows)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(found, indent=2))
        print(f"summaries: {args.out}")
    return 0
