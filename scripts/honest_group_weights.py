"""The effective importance weights of honest stale groups: what `rl.max_group_weight` must stay above.

Runs one cell of a committed sweep (simulated execution, a fixed lag) with the cap off, measures every group's
effective weight at every update (`heterorl.training.step.group_weights`), and writes:

- OUT/weights.json: per loss, the largest weight of each step and the quantiles over all groups;
- with --keep N: the N heaviest groups measured, as the learner's and the behaviour log-probs and the rewards,
  one JSON file per loss (tests/training/data/ holds those of the add3 lag-64 cells, seed 0).

With a fixed lag of k every batch is sampled by the policy k versions older than the learner, versions before the
first being the base: at learner version v < k the data is v versions stale (from the base), then k.

    python scripts/honest_group_weights.py --out runs/honest-weights --losses gepo grpo --keep 8
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from heterorl.config import load_config
from heterorl.runtime.simulate import simulate_run
from heterorl.training import step


def _recorder(measured: list, heaviest: list, keep: int):
    """A `group_weights` that records what it measures (and keeps the ``keep`` heaviest groups)."""
    measure = step.group_weights

    def recorded(loss_fn, batch, config, value):
        rows, group_ids, weight, coef = measure(loss_fn, batch, config, value)
        version = int(batch.current_version) if batch.current_version is not None else 0
        finite = weight[~weight.isnan()]
        measured.append({"version": version, "max": float(finite.max()) if len(finite) else None,
                         "weights": [round(float(w), 6) for w in finite]})
        if keep:
            for g in range(len(group_ids)):
                if math.isnan(float(weight[g])):
                    continue
                picked = (rows == g).nonzero().flatten().tolist()
                lengths = batch.mask[picked].sum(-1).long().tolist()
                def rows_of(values):
                    return [[round(float(x), 5) for x in values[i, :n]] for i, n in zip(picked, lengths)]

                heaviest.append({
                    "weight": float(weight[g]), "version": version,
                    "logprobs": rows_of(batch.logprobs.detach()),
                    "behaviour_logprobs": rows_of(batch.behaviour_logprobs),
                    "rewards": [float(batch.rewards[i]) for i in picked]})
            heaviest.sort(key=lambda g: -g["weight"])
            del heaviest[keep:]
        return rows, group_ids, weight, coef

    return recorded


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/configs/add3_cpu_run.yaml")
    parser.add_argument("--lag", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--losses", nargs="+", default=["gepo", "grpo"])
    parser.add_argument("--keep", type=int, default=0, help="keep the N heaviest groups, per loss")
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for loss in args.losses:
        measured, heaviest = [], []
        step.group_weights = _recorder(measured, heaviest, args.keep)
        cfg = load_config(args.config, [*args.overrides, "runtime.execution=simulated",
                                        f"delay.fixed_lag_steps={args.lag}", f"loss.name={loss}",
                                        f"seed={args.seed}", "rl.max_group_weight=1e30",
                                        f"logging.run_dir={out / ('run-' + loss)}"])
        simulate_run(cfg)
        every = sorted(w for m in measured for w in m["weights"])
        past = [m["max"] for m in measured if m["version"] > args.lag and m["max"] is not None]  # k stale
        summary[loss] = {
            "updates": len(measured), "groups": len(every),
            "max": every[-1] if every else None,
            "max_at_full_lag": max(past) if past else None,
            "q99": every[int(0.99 * (len(every) - 1))] if every else None,
            "q50": every[len(every) // 2] if every else None,
            "per_update_max": [m["max"] for m in measured]}
        print(f"{loss}: {len(every)} group weights over {len(measured)} updates; max {summary[loss]['max']:.4f}, "
              f"at the full lag {summary[loss]['max_at_full_lag']}, q99 {summary[loss]['q99']:.4f}", flush=True)
        if args.keep:
            (out / f"heaviest_{loss}.json").write_text(json.dumps(
                {"config": args.config, "lag": args.lag, "seed": args.seed, "loss": loss, "groups": heaviest}))
        (out / "weights.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
