"""The ``heterorl`` command line.

    heterorl demo                       RL on the maze from the shipped SFT base (the README's demo)
    heterorl sft  [--config F] [k=v..]  supervised warm start (saves a policy folder)
    heterorl rl   [--config F] [k=v..]  synchronous RL from a policy folder
    heterorl bench engine               sampling throughput: our engine vs transformers generate
    heterorl bench losses               forward+backward time of every gepo loss, relative to grpo

Every training command takes a YAML file (--config), dotted overrides
(``loss.name=grpo rollout.temperature=0.7``) and --dry-run (print the resolved
config and exit).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from importlib import resources
from pathlib import Path

from heterorl.errors import HeteroRLError

DEMO_CONFIG = "demo.yaml"
SFT_CONFIG = "maze_sft.yaml"
SFT_BASE = "maze-sft-base"


def packaged(name: str) -> Path:
    """Path of a file shipped inside the package (configs/ or assets/)."""
    for folder in ("configs", "assets"):
        candidate = Path(str(resources.files("heterorl"))) / folder / name
        if candidate.exists():
            return candidate
    raise HeteroRLError(f"packaged file {name} is missing: reinstall heterorl")


def _add_config_args(parser: argparse.ArgumentParser, default_config: str | None) -> None:
    parser.add_argument("--config", default=default_config,
                        help="YAML config file" + (f" (default: the packaged {default_config})" if default_config else ""))
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. optim.lr=3e-4")


def _resolve_config(args):
    from heterorl.config import load_config, to_yaml

    path = args.config
    if path is not None and not Path(path).exists() and "/" not in path:
        path = packaged(path)
    cfg = load_config(path, args.overrides)
    if args.dry_run:
        print(to_yaml(cfg), end="")
        return None
    return cfg


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, file=sys.stderr)
    shown: dict[str, float] = {}

    def update(step: int, metrics: dict) -> None:
        for key, short in (("eval/success", "eval"), ("rollout/reward_mean", "reward"), ("sft/loss", "loss")):
            if key in metrics:
                shown[short] = round(float(metrics[key]), 3)
        bar.set_postfix(shown, refresh=False)
        bar.update(step - bar.n)

    return bar, update


def quiet_transformers() -> None:
    """Our own progress bar is the one to watch: hide transformers' load/save bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _setup(cfg, name: str, policy: str):
    from heterorl.config import to_dict, to_yaml
    from heterorl.metrics import MetricsLogger
    from heterorl.policies import load_policy
    from heterorl.session import TrainingClient
    from heterorl.tasks import make_task

    quiet_transformers()
    task = make_task(cfg.task.name, dict(cfg.task.options), cfg.task.reward_fn)
    model, tokenizer = load_policy(policy, alphabet=task.alphabet(), tiny=cfg.policy.tiny, device=cfg.policy.device)
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    logger = MetricsLogger(run_dir, config=to_dict(cfg), name=name, wandb_project=cfg.logging.wandb_project,
                           wandb_mode=cfg.logging.wandb_mode)
    training = TrainingClient(model, tokenizer, device=cfg.policy.device, seed=cfg.seed)
    return task, training, logger, run_dir


def cmd_sft(args) -> int:
    from heterorl.config import to_dict
    from heterorl.policies import save_policy
    from heterorl.sft import run_sft

    cfg = _resolve_config(args)
    if cfg is None:
        return 0
    task, training, logger, run_dir = _setup(cfg, "sft", cfg.policy.model)
    bar, update = _progress(cfg.sft.steps, "sft", cfg.logging.progress)
    try:
        result = run_sft(cfg, training, task, logger, update)
    finally:
        bar.close()
        logger.close()
    out = save_policy(training.model, training.tokenizer, cfg.sft.output)
    summary = {"success": result.success, "steps": result.steps, "minutes": result.minutes, "policy": str(out),
               "command": "heterorl sft " + " ".join(sys.argv[2:]), "config": to_dict(cfg)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    # the policy folder records how it was made: its SFT summary and per-step curve
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    shutil.copyfile(run_dir / "metrics.jsonl", out / "sft_metrics.jsonl")
    print(f"SFT: held-out greedy success {result.success:.3f} after {result.steps} steps "
          f"({result.minutes:.1f} min); policy saved to {out}")
    print(f"logs: {run_dir / 'metrics.jsonl'}")
    return 0


def _rl(cfg, title: str) -> int:
    from heterorl.policies import save_policy
    from heterorl.report import format_table, plot_curves
    from heterorl.sync_rl import run_sync_rl

    base = cfg.rl.base or cfg.policy.model
    if base == SFT_BASE:
        base = str(packaged(SFT_BASE))
    task, training, logger, run_dir = _setup(cfg, title, base)
    bar, update = _progress(cfg.rl.steps, title, cfg.logging.progress)
    try:
        result = run_sync_rl(cfg, training, task, logger, update)
    finally:
        bar.close()
        logger.close()
    save_policy(training.model, training.tokenizer, run_dir / "policy")
    plot = plot_curves({cfg.loss.name: [(h["step"], h["eval/success"]) for h in result.history]},
                       run_dir / "success.png", title=f"{task.name}: held-out greedy success ({title})",
                       xlabel="RL step")
    summary = {"base_success": result.base_success, "final_success": result.final_success,
               "best_success": result.best_success, "steps": result.steps, "minutes": result.minutes,
               "loss": cfg.loss.name, "history": result.history}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print()
    print(format_table(
        ["policy", "held-out greedy success", "optimizer steps"],
        [["SFT base", result.base_success, 0],
         [f"after RL ({cfg.loss.name})", result.final_success, training.step],
         ["best during RL", result.best_success, ""]],
    ))
    print(f"\nchange: {100 * (result.final_success - result.base_success):+.1f} points in {result.minutes:.1f} min")
    print(f"logs:   {run_dir / 'metrics.jsonl'}" + (f"  (wandb offline run under {run_dir / 'wandb'})"
                                                    if cfg.logging.wandb_mode != "disabled" else ""))
    print(f"plot:   {plot}")
    print(f"policy: {run_dir / 'policy'}")
    return 0


def cmd_rl(args) -> int:
    cfg = _resolve_config(args)
    return 0 if cfg is None else _rl(cfg, "rl")


def cmd_demo(args) -> int:
    cfg = _resolve_config(args)
    return 0 if cfg is None else _rl(cfg, "demo")


def cmd_bench(args) -> int:
    if args.what == "engine":
        from heterorl.bench_engine import main as bench_engine

        return bench_engine(args.rest)
    if args.what == "losses":
        from heterorl.bench_losses import main as bench_losses

        return bench_losses(args.rest)
    raise HeteroRLError(f"unknown benchmark {args.what!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="heterorl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="RL on the maze task from the shipped SFT base, with a before/after table")
    _add_config_args(p, DEMO_CONFIG)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("sft", help="supervised warm start on a task's demonstrations")
    _add_config_args(p, SFT_CONFIG)
    p.set_defaults(fn=cmd_sft)
    p = sub.add_parser("rl", help="synchronous RL (GRPO-style loop over the session primitives)")
    _add_config_args(p, DEMO_CONFIG)
    p.set_defaults(fn=cmd_rl)
    p = sub.add_parser("bench", help="benchmarks that print ratios measured in one run")
    p.add_argument("what", choices=["engine", "losses"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark (see --help after its name)")
    p.set_defaults(fn=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except HeteroRLError as exc:
        print(f"heterorl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("heterorl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
