"""The ``heterorl`` command line.

    heterorl demo                       the async system on the maze from the shipped SFT base (README demo)
    heterorl sft  [--config F] [k=v..]  supervised warm start (saves a policy folder)
    heterorl rl   [--config F] [k=v..]  synchronous RL from a policy folder
    heterorl bench engine               sampling throughput: our engine vs transformers generate
    heterorl bench losses               forward+backward time of every gepo loss, relative to grpo
    heterorl bench transport            trajectories and weights over ZeroMQ vs raw pyzmq
    heterorl bench async                samples/s of the same run in sync and in async mode
    heterorl keys --name NAME [--out D] a CurveZMQ key pair for a learner or a remote worker
    heterorl train [--config F] [k=v..] learner + N rollout workers on this machine (--mode sync|async)
    heterorl learner --bind ADDR        the learner alone (remote workers connect to it)
    heterorl rollout --connect ADDR     one rollout worker (on any machine that reaches the learner)

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
RL_CONFIG = "maze_rl.yaml"
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
    from heterorl.launch import setup_run

    quiet_transformers()
    return setup_run(cfg, name, policy)


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
    """The async system (1 learner + 2 workers, GEPO, injected delay) from the shipped SFT base."""
    cfg = _resolve_config(args)
    if cfg is None:
        return 0
    run_dir = Path(cfg.logging.run_dir)
    if (run_dir / "checkpoints").is_dir():
        print(f"demo: replacing the previous demo run in {run_dir}", file=sys.stderr)
        shutil.rmtree(run_dir)
    return cmd_train(argparse.Namespace(config=args.config, overrides=args.overrides, dry_run=False, mode=None,
                                        workers=None, resume=None))


def cmd_bench(args) -> int:
    if args.what == "engine":
        from heterorl.bench_engine import main as bench_engine

        return bench_engine(args.rest)
    if args.what == "losses":
        from heterorl.bench_losses import main as bench_losses

        return bench_losses(args.rest)
    if args.what == "async":
        from heterorl.bench_async import main as bench_async

        return bench_async(args.rest)
    if args.what == "transport":
        from heterorl.bench_transport import main as bench_transport

        return bench_transport(args.rest)
    raise HeteroRLError(f"unknown benchmark {args.what!r}")


def cmd_keys(args) -> int:
    from heterorl.transport import make_keypair

    public, secret = make_keypair(args.out, args.name)
    print(f"public key: {public}   (give it to the other side: a worker's goes into the learner's allowed folder)")
    print(f"secret key: {secret}   (stays on this machine, mode 0600)")
    return 0


def _curve(secret: str | None, server_key: str | None = None, allowed: str | None = None):
    from heterorl.transport import CurveConfig

    if secret is None:
        if server_key or allowed:
            raise HeteroRLError("--server-key/--allow-keys need --curve-secret (this side's *.key_secret file)")
        return None
    return CurveConfig(secret_key_file=secret, server_key_file=server_key, allowed_keys_dir=allowed)


def _log_to_console() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_transformers()


def cmd_learner(args) -> int:
    from heterorl.launch import serve_learner

    cfg = _resolve_config(args)
    if cfg is None:
        return 0
    _log_to_console()
    result = serve_learner(cfg, args.bind or cfg.runtime.address, resume=args.resume,
                           curve=_curve(args.curve_secret, allowed=args.allow_keys),
                           allow_plaintext=args.allow_plaintext)
    if result is None:
        return 0  # a learner rank > 0 under torchrun: rank 0 reports
    print(f"learner done: success {result.base_success:.3f} -> {result.final_success:.3f} "
          f"(best {result.best_success:.3f}) in {result.steps} steps, {result.minutes:.1f} min")
    return 0


def cmd_rollout(args) -> int:
    import os
    import socket

    from heterorl.rollout import WorkerOptions, run_rollout_worker

    _log_to_console()
    options = WorkerOptions(
        address=args.connect, worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        curve=_curve(args.curve_secret, server_key=args.server_key), throttle=args.throttle, policy=args.policy,
        connect_timeout_s=args.connect_timeout, allow_plaintext=args.allow_plaintext)
    return run_rollout_worker(options)


def cmd_train(args) -> int:
    from heterorl.config import load_config, to_yaml
    from heterorl.launch import train

    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"runtime.mode={args.mode}")
    if args.workers:
        overrides.append(f"runtime.workers={args.workers}")
    if args.resume:
        saved = Path(args.resume) / "train_config.yaml"
        if not saved.is_file():
            raise HeteroRLError(f"--resume {args.resume}: no train_config.yaml there; is it a `heterorl train` run dir?")
        cfg = load_config(saved, overrides + [f"logging.run_dir={args.resume}"])
    else:
        cfg = _resolve_config(args) if not overrides else _resolve_config(argparse.Namespace(
            config=args.config, overrides=overrides, dry_run=args.dry_run))
        if cfg is None:
            return 0
    if args.dry_run:
        print(to_yaml(cfg), end="")
        return 0
    bar, update = _progress(cfg.rl.steps, f"train ({cfg.runtime.mode}, {cfg.runtime.workers} workers)",
                            cfg.logging.progress)
    try:
        code = train(cfg, resume=bool(args.resume), progress=update)
    finally:
        bar.close()
    run_dir = Path(cfg.logging.run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    _print_runtime_summary(summary, run_dir)
    return code


def _print_runtime_summary(summary: dict, run_dir: Path) -> None:
    from heterorl.report import format_table

    print()
    print(format_table(
        ["", "held-out greedy success", "learner steps"],
        [["SFT base", summary["base_success"], 0],
         [f"after RL ({summary['mode']}, {summary['loss']})", summary["final_success"], summary["steps"]],
         ["best during RL", summary["best_success"], ""]],
    ))
    print(f"\nchange: {100 * (summary['final_success'] - summary['base_success']):+.1f} points in "
          f"{summary['minutes']:.1f} min; staleness mean {summary['staleness_mean']:.2f} versions "
          f"(max {summary['staleness_max']}); {summary['tokens_per_s']:.0f} tokens/s trained; "
          f"learner idle {summary['learner_idle_frac']:.0%}, workers idle {summary['worker_idle_frac']:.0%}")
    print(f"logs:   {run_dir / 'metrics.jsonl'} and {run_dir / 'logs'}/")
    print(f"plot:   {run_dir / 'success.png'}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="heterorl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the async system on the maze task from the shipped SFT base, with a table")
    _add_config_args(p, DEMO_CONFIG)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("sft", help="supervised warm start on a task's demonstrations")
    _add_config_args(p, SFT_CONFIG)
    p.set_defaults(fn=cmd_sft)
    p = sub.add_parser("rl", help="synchronous RL in one process (the GRPO loop over the session primitives)")
    _add_config_args(p, RL_CONFIG)
    p.set_defaults(fn=cmd_rl)
    p = sub.add_parser("bench", help="benchmarks that print ratios measured in one run")
    p.add_argument("what", choices=["engine", "losses", "transport", "async"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark (see --help after its name)")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("train", help="learner + rollout workers as separate processes on this machine")
    _add_config_args(p, DEMO_CONFIG)
    p.add_argument("--mode", choices=["sync", "async"], help="sync: workers wait for every new version "
                   "(the on-policy baseline); async: they never wait (default: runtime.mode)")
    p.add_argument("--workers", type=int, help="rollout worker processes (default: runtime.workers)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("learner", help="the learner alone: binds, waits for workers, trains, publishes weights")
    _add_config_args(p, DEMO_CONFIG)
    p.add_argument("--bind", help="control address, e.g. tcp://*:5555 (weights on port + 1; default: runtime.address)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in logging.run_dir")
    p.add_argument("--curve-secret", help="the learner's *.key_secret file (turns on CurveZMQ)")
    p.add_argument("--allow-keys", help="folder of the public *.key files of the workers allowed in")
    p.add_argument("--allow-plaintext", action="store_true", help="allow plaintext on a non-loopback address")
    p.set_defaults(fn=cmd_learner)
    p = sub.add_parser("rollout", help="a rollout worker: connects to a learner and streams scored groups")
    p.add_argument("--connect", required=True, help="the learner's control address, e.g. tcp://10.0.0.5:5555")
    p.add_argument("--worker-id", help="unique id of this worker (default: HOSTNAME-PID)")
    p.add_argument("--throttle", type=float, default=1.0, help="slow-down factor emulating a slower device (>= 1)")
    p.add_argument("--policy", help="starting policy folder on this machine (default: the learner config's)")
    p.add_argument("--curve-secret", help="this worker's *.key_secret file (turns on CurveZMQ)")
    p.add_argument("--server-key", help="the learner's public *.key file")
    p.add_argument("--connect-timeout", type=float, default=120.0, help="seconds to wait for the learner")
    p.add_argument("--allow-plaintext", action="store_true", help="allow plaintext to a non-loopback address")
    p.set_defaults(fn=cmd_rollout)
    p = sub.add_parser("keys", help="make a CurveZMQ key pair (NAME.key public, NAME.key_secret secret)")
    p.add_argument("--name", required=True, help="whose keys: 'learner' or a worker id")
    p.add_argument("--out", default="keys", help="folder for the key files (default: keys)")
    p.set_defaults(fn=cmd_keys)
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
