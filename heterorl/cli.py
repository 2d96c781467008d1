"""The ``heterorl`` command line.

    heterorl demo                       the async system (learner + 2 workers, GEPO, injected delays) on 3-digit
                                        addition from the shipped add3-sft-base, with a table
    heterorl sft  [--config F] [k=v..]  supervised warm start (saves a policy folder)
    heterorl rl   [--config F] [k=v..]  synchronous RL in one process from a policy (shipped name, folder, smollm2)
    heterorl bench engine               sampling throughput: our engine vs transformers generate
    heterorl bench losses               forward+backward time of every gepo loss, relative to grpo
    heterorl bench transport            trajectories and weights over ZeroMQ vs raw pyzmq
    heterorl bench weights              bytes and publish->applied time of weight deltas vs whole versions
    heterorl bench deltas               staleness behind bandwidth-limited weights links, deltas on vs off
    heterorl bench async                samples/s of the same run in sync and in async mode
    heterorl bench simulate             staleness of one run live and simulated with its measured timings
    heterorl bench service              the session primitives remote (heterorl serve) vs local; OpenAI endpoint load
    heterorl bench reshard              a sharded learner's weights: every rank sends its slices vs gather
    heterorl bench lora                 LoRA vs full fine-tuning: learning, bytes and time per version, sampling
    heterorl bench sandbox              the code task's sandbox: start-up, tests/s (jail vs weak), a worker's samples/s
    heterorl bench serve-load           heterorl serve: OpenAI req/s batched vs not; honest p99 with an abuser
    heterorl bench wan                  one run over the network lab's links vs loopback with delay.* set alike
    heterorl bench learner              the learner's log-probs: full logits vs completion positions in chunks
    heterorl bench peers                heterorl (sync, async 1 and 2 workers) beside TRL's GRPOTrainer, matched
    heterorl keys [make] --name NAME [--out D]   a CurveZMQ key pair for a learner or a remote worker
    heterorl keys revoke --name NAME --allow-keys D   refuse a worker's key (no restart)
    heterorl train [--config F] [k=v..] learner + N rollout workers on this machine (--mode sync|async;
                                        --launcher ray: on a Ray cluster)
    heterorl learner --bind ADDR        the learner alone (remote workers connect to it)
    heterorl rollout --connect ADDR     one rollout worker (on any machine that reaches the learner; --engine vllm)
    heterorl serve [--bind HOST:PORT]   training sessions over HTTP, an OpenAI-compatible endpoint, Tinker's API
    heterorl deploy slurm|k8s CONFIG    the files that launch a run on Slurm or Kubernetes, and the command
    heterorl tasks [--show NAME]        the tasks a run can name (heterorl's, reasoning-gym's datasets), options
    heterorl losses [--show NAME]       the losses a run can name, one line each; --show: its formula and options
    heterorl sweep SWEEP.yaml [k=v..]   a delay sweep: losses x delays x seeds, resumable, K cells at once
    heterorl report SWEEP_DIR           tables, plots and a Markdown summary of a sweep
    heterorl compare --losses gepo,grpo --delay lag16 --seeds 0,1,2   losses side by side, online and at a delay

Every training command takes a YAML file (--config), dotted overrides
(``loss.name=grpo rollout.temperature=0.7``) and --dry-run (print the resolved
config and exit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
from importlib import resources
from pathlib import Path

import gepo
from heterorl.config import ENGINES, packaged
from heterorl.errors import ConfigError, HeteroRLError
from heterorl.runs import run_header

DEMO_CONFIG = "demo.yaml"
RL_CONFIG = DEMO_CONFIG  # `rl` and `train` start from one config: sync in one process vs learner + workers
RL_RUN_DIR = "runs/rl"  # `heterorl rl`'s run dir when the command line names none (the config's is the demo's)
SFT_CONFIG = "maze_sft.yaml"


def _positive(kind: type):
    """An argparse type: a number of ``kind`` > 0 (argparse names the flag and exits 2 otherwise)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not value > 0:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
        return value

    return parse


def _seed_list(text: str) -> list[int]:
    """An argparse type: comma-separated integer seeds, e.g. ``0,1,2``."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. 0,1,2") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one seed, e.g. 0")
    return seeds


def _add_config_args(parser: argparse.ArgumentParser, default_config: str | None) -> None:
    default = f" (default: the packaged {default_config})" if default_config else ""
    parser.add_argument("--config", default=default_config, help="YAML config file" + default)
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. optim.lr=3e-4")


def _add_resume_arg(parser: argparse.ArgumentParser, saved: str) -> None:
    parser.set_defaults(config=None)  # the default config when not given; None tells a --config given with --resume
    parser.add_argument("--resume", metavar="RUN_DIR", help=f"continue the run in RUN_DIR from its last checkpoint, "
                        f"with the {saved} it saved there (key=value overrides apply on top)")


def _packaged_configs() -> list[str]:
    return sorted(path.name for path in (Path(str(resources.files("heterorl"))) / "configs").glob("*.yaml"))


def _config_path(name: str) -> Path:
    """``--config NAME``: a file here, else a packaged config of that name (``demo.yaml``); ConfigError naming
    the packaged ones when it is neither."""
    path = Path(name)
    if path.exists() or "/" in name:
        return path  # load_config says what is wrong with a path that is not a file
    if name in _packaged_configs():
        return packaged(name)
    raise ConfigError(f"config file {name} does not exist here ({Path.cwd()}), and no packaged config has that "
                      f"name; packaged configs: {', '.join(_packaged_configs())}")


def _load(path: str | Path | None, overrides: list[str]):
    """`load_config`, except that a ``task.name=`` override that changes the file's task drops the file's
    ``task.options``: they are the fields of the other task's config (a maze's ``size`` means nothing to
    ``jsonl``), so only the ``task.options.*`` given on the command line remain."""
    from heterorl.config import load_config

    cfg = load_config(path, overrides)
    renamed = [o for o in overrides if o.startswith("task.name=")]
    if not renamed:
        return cfg
    task_overrides = [o for o in overrides if o.startswith("task.options")]
    from_file = load_config(path, [o for o in overrides if o not in renamed and o not in task_overrides]).task
    if from_file.name != cfg.task.name and from_file.options:
        cfg.task.options = load_config(None, task_overrides).task.options
        print(f"heterorl: task.name={cfg.task.name} replaces the config's task {from_file.name!r}: its options "
              f"({', '.join(from_file.options)}) are dropped; set the new task's as task.options.KEY=VALUE",
              file=sys.stderr)
    return cfg


# the config a run dir keeps, which --resume continues with
SAVED_CONFIG = {"train": "train_config.yaml", "sft": "config.yaml", "rl": "config.yaml"}


def _resumed_config(args, command: str, overrides: list[str]):
    """``--resume RUN_DIR``: the config the run saved there, with the command line's overrides."""
    if args.config is not None:
        raise HeteroRLError(f"--resume {args.resume} continues with that run's {SAVED_CONFIG[command]}: drop "
                            f"--config {args.config} (give changes as key=value overrides)")
    saved = Path(args.resume) / SAVED_CONFIG[command]
    if not saved.is_file():
        raise HeteroRLError(f"--resume {args.resume}: no {SAVED_CONFIG[command]} there; is it a `heterorl "
                            f"{command}` run dir?")
    return _load(saved, [*overrides, f"logging.run_dir={args.resume}"])


def _resolve_config(args, default: str | None = None, command: str = ""):
    """The config of a command: ``--config`` (else ``default``) with the overrides, or with ``--resume`` the
    one the run saved; None after printing it for ``--dry-run``."""
    from heterorl.config import to_yaml

    if command in ("sft", "rl") and args.resume:  # (the learner's --resume is a flag: its config is given)
        cfg = _resumed_config(args, command, args.overrides)
    else:
        config = args.config or default
        cfg = _load(None if config is None else _config_path(config), args.overrides)
    if args.dry_run:
        print(to_yaml(cfg), end="")
        return None
    return cfg


class _Progress:
    """A command's progress bar, and while it is open, the log's warnings (and Python's) written above it with
    their level (``heterorl: WARNING: ...``), not into its line."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, file=sys.stderr)
        self._root = logging.getLogger()
        self._handler = None
        if not self._root.handlers:  # (a command that set up its own logging keeps it)
            self._handler = _BarLogHandler()
            self._handler.setFormatter(logging.Formatter("heterorl: %(levelname)s: %(message)s"))
            self._root.addHandler(self._handler)
            logging.captureWarnings(True)

    def close(self) -> None:
        self.bar.close()
        if self._handler is not None:
            self._root.removeHandler(self._handler)
            logging.captureWarnings(False)
            self._handler = None


class _BarLogHandler(logging.Handler):
    """Writes each record above the progress bars (`tqdm.write`), which are drawn again below it."""

    def emit(self, record) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 (logging's own contract: a handler reports, never raises)
            self.handleError(record)


def _progress(total: int, desc: str, enabled: bool):
    """A `_Progress` and the function that advances it with a step's metrics."""
    progress = _Progress(total, desc, enabled)
    bar = progress.bar
    shown: dict[str, float] = {}

    def update(step: int, metrics: dict) -> None:
        for key, short in (("eval/success", "eval"), ("rollout/reward_mean", "reward"), ("sft/loss", "loss")):
            if key in metrics:
                shown[short] = round(float(metrics[key]), 3)
        if metrics.get("optim/updates", 1) == 0:  # a step without an update (optim/skip_reason says why)
            shown["no-update steps"] = shown.get("no-update steps", 0) + 1
        bar.set_postfix(shown, refresh=False)
        bar.update(step - bar.n)

    return progress, update


def _setup(cfg, name: str, policy: str, append: bool = False):
    from heterorl.policies import quiet_transformers
    from heterorl.runs import setup_run

    quiet_transformers()
    return setup_run(cfg, name, policy, append=append)


def cmd_sft(args) -> int:
    from heterorl.config import to_dict
    from heterorl.loops.sft import run_sft
    from heterorl.runs import json_text, save_trained_policy

    cfg = _resolve_config(args, SFT_CONFIG, "sft")
    if cfg is None:
        return 0
    print(run_header(cfg, "sft", _config_named(args, SFT_CONFIG, "sft")), flush=True)
    task, training, logger, run_dir, checkpoints = _setup_loop(cfg, "sft", cfg.policy.model, args.resume)
    bar, update = _progress(cfg.sft.steps, "sft", cfg.logging.progress)
    try:
        with _stop_after_step("sft") as stop:
            result = run_sft(cfg, training, task, logger, update, checkpoints=checkpoints, stop=stop)
    finally:
        bar.close()
        logger.close()
    summary = {"success": result.success, "steps": result.steps, "minutes": result.minutes,
               "stopped_by": result.stopped_by, "command": "heterorl sft " + " ".join(sys.argv[2:]),
               "config": to_dict(cfg)}
    if result.stopped_by:  # a policy trained part of the way is not saved as the SFT base
        (run_dir / "summary.json").write_text(json_text(summary, indent=2))
        return _stopped("sft", run_dir, result.stopped_by, result.steps, cfg.sft.steps, checkpoints)
    out = save_trained_policy(training, Path(cfg.sft.output), Path(cfg.sft.output) / "adapter")
    summary["policy"] = str(out)
    (run_dir / "summary.json").write_text(json_text(summary, indent=2))
    # the policy folder records how it was made: its SFT summary and per-step curve
    (out / "sft_summary.json").write_text(json_text(summary, indent=2))
    shutil.copyfile(run_dir / "metrics.jsonl", out / "sft_metrics.jsonl")
    print(f"SFT: held-out greedy success {result.success:.3f} after {result.steps} steps "
          f"({result.minutes:.1f} min); policy saved to {out}")
    print(f"logs: {run_dir / 'metrics.jsonl'}")
    return 0


def _config_named(args, default: str, command: str) -> str:
    """The config a run's header names: the one given, the resumed run's, or the default."""
    return f"{args.resume}/{SAVED_CONFIG[command]}" if args.resume else (args.config or default)


def _setup_loop(cfg, name: str, policy: str, resume: str | None):
    """`_setup` for a sync loop (`heterorl sft`, `heterorl rl`), with its checkpoints; resumed: the checkpoint
    read and checked first, and the metrics of the steps after it dropped (they are trained again)."""
    from heterorl.loops.checkpoints import FOLDER, LoopCheckpoints, read_loop_state
    from heterorl.runs import keep_metrics_until

    run_dir, state = Path(cfg.logging.run_dir), None
    if resume:
        state = read_loop_state(run_dir / FOLDER, name)
        keep_metrics_until(run_dir / "metrics.jsonl", state.step)
    elif (run_dir / FOLDER).is_dir():
        raise HeteroRLError(f"{run_dir} already holds a run with checkpoints: continue it with `heterorl {name} "
                            f"--resume {run_dir}`, or give another logging.run_dir (or delete it)")
    task, training, logger, run_dir = _setup(cfg, name, policy, append=bool(resume))
    return task, training, logger, run_dir, LoopCheckpoints(run_dir, name, cfg.runtime.checkpoint_every,
                                                            resume=state)


@contextlib.contextmanager
def _stop_after_step(command: str):
    """SIGINT and SIGTERM during the block ask the loop to stop after its step in progress, with a checkpoint (a
    second one stops it at once); yields the `StopRequest` the loop reads."""
    from heterorl.loops.checkpoints import StopRequest
    from heterorl.runtime.signals import stop_after_step

    stop = StopRequest()

    def announce(name: str) -> None:
        print(f"\nheterorl {command}: {name}: stopping after the step in progress, with a checkpoint (again: stop "
              "at once)", file=sys.stderr, flush=True)

    with stop_after_step(lambda: stop.by, stop.request, announce):
        yield stop


def _stopped(command: str, run_dir: Path, stopped_by: str, step: int, steps: int, checkpoints) -> int:
    """Say where a stopped run stands and how to go on; the exit status of a run stopped by a signal."""
    import signal

    from heterorl.runs import stopped_line

    print(stopped_line(command, run_dir, stopped_by, step, steps, checkpoints.saved_step), file=sys.stderr)
    return 128 + int(getattr(signal, stopped_by, signal.SIGINT))


def _rl(cfg, title: str, config: str | None, resume: str | None = None) -> int:
    from heterorl.loops.sync_rl import run_sync_rl
    from heterorl.runs import finish_run, format_table, json_text, outcomes_line, without_update_note

    print(run_header(cfg, "rl", config), flush=True)
    base = cfg.rl.base or cfg.policy.model
    task, training, logger, run_dir, checkpoints = _setup_loop(cfg, title, base, resume)
    bar, update = _progress(cfg.rl.steps, title, cfg.logging.progress)
    try:
        with _stop_after_step(title) as stop:
            result = run_sync_rl(cfg, training, task, logger, update, checkpoints=checkpoints, stop=stop)
    finally:
        bar.close()
        logger.close()
    if result.stopped_by:  # summary.json says so; the plot and the policy are left for the finished run
        (run_dir / "summary.json").write_text(json_text({**result.__dict__, "loss": cfg.loss.name}, indent=2))
        return _stopped(title, run_dir, result.stopped_by, result.steps, cfg.rl.steps, checkpoints)
    plot = finish_run(cfg, task, training, run_dir, result, {}, title=title, xlabel="RL step")
    print()
    print(format_table(
        ["policy", "held-out greedy success", "optimizer steps"],
        [["SFT base", result.base_success, 0],
         [f"after RL ({cfg.loss.name})", result.final_success, training.step],
         ["best during RL", result.best_success, ""]],
    ))
    print(f"\nchange: {100 * (result.final_success - result.base_success):+.1f} points in {result.minutes:.1f} min"
          + without_update_note(result.steps_without_update))
    if result.reward_outcomes:
        print(outcomes_line(result.reward_outcomes))
    print(f"logs:   {run_dir / 'metrics.jsonl'}" + (f"  (wandb offline run under {run_dir / 'wandb'})"
                                                    if cfg.logging.wandb_mode != "disabled" else ""))
    print(f"plot:   {plot}")
    if cfg.logging.save_policy:
        print(f"policy: {run_dir / 'policy'}")
    return 0


def cmd_rl(args) -> int:
    if (not args.resume and args.config in (None, RL_CONFIG)
            and not any(o.startswith("logging.run_dir=") for o in args.overrides)):
        args.overrides = [*args.overrides, f"logging.run_dir={RL_RUN_DIR}"]  # not over the demo's run
    cfg = _resolve_config(args, RL_CONFIG, "rl")
    return 0 if cfg is None else _rl(cfg, "rl", _config_named(args, RL_CONFIG, "rl"), args.resume)


def cmd_demo(args) -> int:
    """The async system (1 learner + 2 workers, GEPO, injected delay) from the shipped SFT base."""
    cfg = _resolve_config(args)
    if cfg is None:
        return 0
    run_dir = Path(cfg.logging.run_dir)
    if (run_dir / "checkpoints").is_dir():
        print(f"demo: replacing the previous demo run in {run_dir}", file=sys.stderr)
        shutil.rmtree(run_dir)
    return _train(cfg, config=args.config, command="demo")


# heterorl bench NAME: the module of heterorl.bench whose main(argv) runs it
BENCHMARKS = {"engine": "engine", "losses": "losses", "transport": "transport", "weights": "weights",
              "deltas": "deltas", "async": "async_modes", "simulate": "simulation", "service": "service",
              "reshard": "reshard", "lora": "lora", "sandbox": "sandbox",
              "serve-load": "service_load", "wan": "wan", "learner": "learner",
              "peers": "peers", "elastic": "elastic"}


def cmd_bench(args) -> int:
    import importlib

    if args.what not in BENCHMARKS:
        raise HeteroRLError(f"unknown benchmark {args.what!r}; one of {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"heterorl.bench.{BENCHMARKS[args.what]}").main(args.rest)


def cmd_keys(args) -> int:
    from heterorl.config import TransportConfig
    from heterorl.transport import make_keypair, revoke_key

    if args.action == "revoke":
        if not args.allow_keys:
            raise HeteroRLError("keys revoke needs --allow-keys: the learner's folder of allowed worker *.key files")
        moved = revoke_key(args.allow_keys, args.name)
        print(f"revoked {args.name}: its key moved to {moved}; a running learner refuses it within "
              f"transport.keys_reload_s ({TransportConfig().keys_reload_s:g} s by default), live connections "
              "included (move the file back to allow it again)")
        return 0
    if args.allow_keys:
        raise HeteroRLError("--allow-keys is for `heterorl keys revoke`; `heterorl keys` writes into --out")
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
    from heterorl.policies import quiet_transformers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_transformers()


def cmd_learner(args) -> int:
    import os

    from heterorl.runs import outcomes_line
    from heterorl.runtime.launch import refuse_busy_ports, serve_learner

    cfg = _resolve_config(args)
    if cfg is None:
        return 0
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 binds (the others would find its ports taken)
        refuse_busy_ports(cfg, args.bind or cfg.runtime.address, args.resume)  # before transformers loads
    _log_to_console()
    result = serve_learner(cfg, args.bind or cfg.runtime.address, resume=args.resume,
                           curve=_curve(args.curve_secret, allowed=args.allow_keys),
                           allow_plaintext=args.allow_plaintext, share_machine=args.share_machine)
    if result is None:
        return 0  # a learner rank > 0 under torchrun: rank 0 reports
    print(f"learner done: success {result.base_success:.3f} -> {result.final_success:.3f} "
          f"(best {result.best_success:.3f}) in {result.steps} steps, {result.minutes:.1f} min")
    if result.reward_outcomes:
        print(outcomes_line(result.reward_outcomes))
    return 0


def cmd_rollout(args) -> int:
    import os
    import socket

    from heterorl.runtime.worker import WorkerOptions, run_rollout_worker

    if args.serve_openai is None and args.serve_openai_host is not None:
        raise HeteroRLError("--serve-openai-host needs --serve-openai PORT (the port of the endpoint)")
    if args.serve_openai is not None and not 0 <= args.serve_openai <= 65535:
        raise HeteroRLError(f"--serve-openai {args.serve_openai}: give a port in 0..65535 (0: any free port)")
    _log_to_console()
    options = WorkerOptions(
        address=args.connect, worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        curve=_curve(args.curve_secret, server_key=args.server_key), throttle=args.throttle, policy=args.policy,
        connect_timeout_s=args.connect_timeout, allow_plaintext=args.allow_plaintext, engine=args.engine,
        openai_port=args.serve_openai, openai_host=args.serve_openai_host or "127.0.0.1")
    return run_rollout_worker(options)


def cmd_train(args) -> int:
    from heterorl.config import to_yaml

    if args.address and args.launcher != "ray":
        raise HeteroRLError(f"--address {args.address} is the address of a Ray cluster: add --launcher ray")
    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"runtime.mode={args.mode}")
    if args.workers is not None:
        overrides.append(f"runtime.workers={args.workers}")
    if args.resume:
        cfg = _resumed_config(args, "train", overrides)
    else:
        cfg = _load(_config_path(args.config or DEMO_CONFIG), overrides)
    if args.dry_run:
        print(to_yaml(cfg), end="")
        return 0
    config = f"{args.resume}/train_config.yaml" if args.resume else (args.config or DEMO_CONFIG)
    return _train(cfg, resume=bool(args.resume), launcher=args.launcher, address=args.address, config=config)


def _train(cfg, resume: bool = False, launcher: str = "local", address: str | None = None,
           config: str | None = None, command: str = "train") -> int:
    """A run of learner + rollout workers (`heterorl train`, `heterorl demo`): on this machine's processes
    (``launcher`` local, or one process with runtime.execution=simulated) or on a Ray cluster at ``address``; a
    progress bar, then the run's summary."""
    from heterorl.runtime.accounting import summary_text
    from heterorl.runtime.launch import refuse_busy_ports, train

    if cfg.runtime.execution != "simulated" and launcher == "local":  # said here, in one line
        refuse_busy_ports(cfg, cfg.runtime.address, resume)
    print(run_header(cfg, command, config), flush=True)
    bar, update = _progress(cfg.rl.steps, f"train ({cfg.runtime.mode}, {cfg.runtime.workers} workers"
                            f"{', on Ray' if launcher == 'ray' else ''})", cfg.logging.progress)
    try:
        if launcher == "ray":
            from heterorl.deploy.ray_launcher import train_on_ray

            code = train_on_ray(cfg, address=address, resume=resume, progress=update)
        else:
            code = train(cfg, resume=resume, progress=update)
    finally:
        bar.close()
    run_dir = Path(cfg.logging.run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if summary:
        print(summary_text(summary, run_dir))
    if summary.get("stopped_by"):
        from heterorl.runs import stopped_line
        from heterorl.runtime.launch import checkpoint_step

        print(stopped_line(command, run_dir, summary["stopped_by"], summary.get("steps", 0), cfg.rl.steps,
                           checkpoint_step(run_dir), resume=f"heterorl train --resume {run_dir}"), file=sys.stderr)
    elif code:  # interrupted before the learner could say where it stopped (its log says why)
        print(f"heterorl {command}: interrupted before the learner wrote its summary ({run_dir / 'logs'}/learner.log "
              f"says why); a checkpoint it wrote goes on with: heterorl train --resume {run_dir}", file=sys.stderr)
    return code


def _finish_sweep(sweep, failed: list[str]) -> int:
    from heterorl.sweeps.report import write_report

    summary = write_report(sweep.out)
    print(f"report: {summary}")
    if failed:
        print(f"{len(failed)} cells failed: {', '.join(failed)} (their logs: {sweep.out / 'cells'}/<cell>/log.txt); "
              "run the sweep again to retry them", file=sys.stderr)
        return 1
    return 0


def cmd_serve(args) -> int:
    from heterorl.addresses import parse_host_port
    from heterorl.service.server import is_loopback, serve
    from heterorl.service.sessions import Service

    host, port = parse_host_port(args.bind, "--bind", "127.0.0.1:8765")
    api_key = None
    if args.api_key_file:
        path = Path(args.api_key_file)
        # one key per line: each user's sessions are its own ("latest" looks among them)
        api_key = [line.strip() for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
        if not api_key:
            raise HeteroRLError(f"--api-key-file {path}: no such file, or it is empty; write a long random key "
                                "into it (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`), "
                                "one per line for several users")
        if len(set(api_key)) < len(api_key):
            raise HeteroRLError(f"--api-key-file {path}: a key is given twice; give each user a key of its own")
        if path.stat().st_mode & 0o077:
            print(f"heterorl serve: WARNING: --api-key-file {path} can be read by other users of this machine "
                  f"(mode {path.stat().st_mode & 0o777:o}): chmod 600 {path}", file=sys.stderr, flush=True)
    if api_key is None and not is_loopback(host.strip("[]")):
        raise HeteroRLError(f"refusing to serve training sessions on {host} without an API key: give "
                            "--api-key-file (a file holding the key), or bind 127.0.0.1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from heterorl.policies import register_models

    service = Service(args.state_dir, result_ttl_s=args.result_ttl_s, max_sessions=args.max_sessions,
                      max_samplers=args.max_samplers, device=args.device, models=register_models(args.model),
                      session_ttl_s=args.session_ttl_s or None,
                      memory_budget_mb="auto" if args.memory_budget_mb is None else args.memory_budget_mb or None)
    budget = "none" if service.budget.budget_bytes is None else f"{service.budget.budget_bytes / 2**20:,.0f} MB"

    def listening(url: str) -> None:
        print(f"serving training sessions on {url} (API: /api/v1, OpenAI-compatible: /v1, Tinker's SDK: "
              f"{url}/tinker; "
              f"{f'{len(api_key)} bearer token(s)' if api_key else 'no key: loopback only'}; memory budget: "
              f"{budget})", flush=True)

    stopped_by = None
    try:
        stopped_by = serve(service, host.strip("[]"), port, api_key=api_key,
                           max_body_bytes=int(args.max_body_mb * 2**20), log_level=args.log_level,
                           on_listening=listening, docs=args.docs, batching=not args.no_openai_batching,
                           grace_s=args.shutdown_grace_s)
    finally:
        cancelled, running = service.shutdown(timeout_s=5.0)
        print(f"heterorl serve stopped{f' on {stopped_by}' if stopped_by else ''}: {cancelled} queued calls "
              f"cancelled, {running} running calls aborted; the sessions are gone, their saved states stay in "
              f"{args.state_dir}", flush=True)
        if running:
            os._exit(0)  # (a call still running cannot be interrupted: end now, as the stop promised)
    return 0


def cmd_sweep(args) -> int:
    from heterorl.sweeps.runner import SweepRunner

    sweep = SweepRunner(args.sweep, args.overrides, out=args.out)
    if args.dry_run:
        return _list_cells(sweep)
    failed = sweep.run()
    return _finish_sweep(sweep, failed)


def _list_cells(sweep) -> int:
    """--dry-run of a sweep: print each cell's overrides and check that every cell's config resolves."""
    for cell in sweep.cells:
        print(cell.name, " ".join(f"{k}={v}" for k, v in cell.overrides.items() if not k.startswith("logging.")))
    for cell in sweep.cells:
        sweep.resolve(cell)
    print(f"{len(sweep.cells)} runs; every config resolves")
    return 0


def cmd_report(args) -> int:
    from heterorl.sweeps.report import log_report_to_wandb, write_report

    if args.summary:
        from heterorl.sweeps.summary import write_summary

        print(f"summary: {write_summary(args.sweep_dir, args.summary, args.seeds)}")
        return 0
    if len(args.sweep_dir) > 1:
        raise HeteroRLError(f"{len(args.sweep_dir)} sweep folders given: report one at a time, or give --summary FILE "
                            "for one page across them")
    sweep_dir = args.sweep_dir[0]
    summary = write_report(sweep_dir, args.out, args.seeds)
    print(summary.with_name("table.txt").read_text())
    print(f"report: {summary}")
    if args.wandb_project:
        log_report_to_wandb(sweep_dir, args.wandb_project, args.wandb_mode)
    return 0


def cmd_compare(args) -> int:
    from heterorl.sweeps.report import compare_table, confidence_table, load_sweep
    from heterorl.sweeps.runner import SweepRunner, SweepSpec

    config = _config_path(args.config)
    losses = [x for x in args.losses.split(",") if x]
    name = f"compare-{'-'.join(losses)}-d{args.delay}"
    online = "lag0" if args.delay.startswith("lag") else "0"  # the on-policy reference, by the same mechanism
    delays = [args.delay] if args.delay == online or args.no_online else [online, args.delay]
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise HeteroRLError(f"override {bad[0]!r} is not of the form key=value (e.g. rl.steps=30)")
    spec = SweepSpec(name=name, config=str(config.resolve()), mode=args.mode, parallel=args.parallel,
                     losses=losses, delays=delays, seeds=args.seeds,
                     overrides=dict(o.split("=", 1) for o in args.overrides))
    sweep = SweepRunner(None, spec=spec, out=args.out or Path("runs") / "compare" / name)
    if args.dry_run:
        return _list_cells(sweep)
    failed = sweep.run()
    results = load_sweep(sweep.out)
    print()
    print(compare_table(results))
    print()
    print(confidence_table(results))
    return _finish_sweep(sweep, failed)


def cmd_deploy(args) -> int:
    from heterorl.deploy.render import deploy_command

    return deploy_command(args.target, _load(_config_path(args.config), args.overrides), args.config, out=args.out,
                          force=args.force)


def cmd_tasks(args) -> int:
    from heterorl.tasks.catalog import tasks_command

    return tasks_command(show_name=args.show, as_json=args.json)


def cmd_losses(args) -> int:
    """One line per registered loss (its docstring's first paragraph); --show: the whole docstring (the formula)
    and the loss's options with their defaults."""
    import dataclasses
    import inspect

    if args.show:
        spec = gepo.get_loss(args.show)
        print(f"{spec.name}: {inspect.getdoc(spec.fn)}")
        print("options (loss.options.<name>; defaults):")
        defaults = spec.config_cls()
        for field in dataclasses.fields(defaults):
            print(f"  {field.name}: {json.dumps(getattr(defaults, field.name))}")
        return 0
    names = gepo.loss_names()
    width = max(map(len, names))
    for name in names:
        print(f"{name:<{width}}  {gepo.get_loss(name).description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="heterorl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the async system on 3-digit addition from the shipped SFT base, with a table")
    _add_config_args(p, DEMO_CONFIG)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("sft", help="supervised warm start on a task's demonstrations")
    _add_config_args(p, SFT_CONFIG)
    _add_resume_arg(p, "config.yaml")
    p.set_defaults(fn=cmd_sft)
    p = sub.add_parser("rl", help="synchronous RL in one process (the RL loop over the session primitives)")
    _add_config_args(p, RL_CONFIG)
    _add_resume_arg(p, "config.yaml")
    p.set_defaults(fn=cmd_rl)
    p = sub.add_parser("bench", help="benchmarks that print ratios measured in one run")
    p.add_argument("what", choices=list(BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark (see --help after its name)")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("train", help="learner + rollout workers as separate processes on this machine, or on a Ray "
                       "cluster (runtime.execution=simulated: all in one process on a virtual clock)")
    _add_config_args(p, DEMO_CONFIG)
    _add_resume_arg(p, "train_config.yaml")
    p.add_argument("--mode", choices=["sync", "async"], help="sync: workers wait for every new version "
                   "(the on-policy baseline); async: they never wait (default: runtime.mode)")
    p.add_argument("--workers", type=_positive(int), help="rollout worker processes (default: runtime.workers)")
    p.add_argument("--launcher", choices=["local", "ray"], default="local",
                   help="local: processes of this machine (default); ray: Ray actors placed on a Ray cluster by "
                   "their resources (the cluster section of the config; docs/DEPLOY.md)")
    p.add_argument("--address", help="--launcher ray: the Ray cluster's address (auto, HOST:6379, ray://HOST:10001; "
                   "default: cluster.ray.address, else $RAY_ADDRESS, else a local Ray started for the run)")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("learner", help="the learner alone: binds, waits for workers, trains, publishes weights")
    _add_config_args(p, DEMO_CONFIG)
    p.add_argument("--bind", help="control address, e.g. tcp://*:5555 (weights on port + 1; default: runtime.address)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in logging.run_dir")
    p.add_argument("--curve-secret", help="the learner's *.key_secret file (turns on CurveZMQ)")
    p.add_argument("--allow-keys", help="folder of the public *.key files of the workers allowed in")
    p.add_argument("--allow-plaintext", action="store_true", help="allow plaintext on a non-loopback address")
    p.add_argument("--share-machine", action="store_true",
                   help="the workers run on this machine (as `heterorl train` starts them): in async mode split its "
                        "cores between learner and workers by measured phase times (runtime.thread_split)")
    p.set_defaults(fn=cmd_learner)
    p = sub.add_parser("rollout", help="a rollout worker: connects to a learner and streams scored groups")
    p.add_argument("--connect", required=True, help="the learner's control address, e.g. tcp://10.0.0.5:5555")
    p.add_argument("--worker-id", help="unique id of this worker (default: HOSTNAME-PID)")
    p.add_argument("--throttle", type=float, default=1.0, help="slow-down factor emulating a slower device (>= 1)")
    p.add_argument("--policy", help="starting policy folder on this machine (default: the learner config's)")
    p.add_argument("--curve-secret", help="this worker's *.key_secret file (turns on CurveZMQ)")
    p.add_argument("--server-key", help="the learner's public *.key file")
    p.add_argument("--connect-timeout", type=_positive(float), default=120.0,
                   help="seconds to wait for the learner (> 0)")
    p.add_argument("--allow-plaintext", action="store_true", help="allow plaintext to a non-loopback address")
    p.add_argument("--engine", choices=ENGINES, default="torch",
                   help="sampling engine: torch (default) or vllm (run from a Python that has vLLM: `make vllm`, "
                        "then .venv-vllm/bin/heterorl rollout ...)")
    p.add_argument("--serve-openai", type=int, metavar="PORT",
                   help="also serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions) over the "
                        "weights this worker holds, models 'latest' and 'heterorl:worker-ID/VERSION' "
                        "(docs/SERVICE.md); 0: any free port")
    p.add_argument("--serve-openai-host", metavar="HOST",
                   help="address the endpoint listens on (default 127.0.0.1; it has no authentication: give "
                        "another only on a network you trust)")
    p.set_defaults(fn=cmd_rollout)
    p = sub.add_parser("serve", help="training sessions over HTTP (the session primitives, remote: "
                       "heterorl.service.client.connect), an OpenAI-compatible endpoint over their sampling clients, "
                       "and Tinker's REST API under /tinker (TINKER_BASE_URL=http://HOST:PORT/tinker)")
    p.add_argument("--bind", default="127.0.0.1:8765", help="HOST:PORT to listen on (default 127.0.0.1:8765; port 0: "
                   "a free one, printed at start; any address other than loopback needs --api-key-file)")
    p.add_argument("--api-key-file", help="a file holding the bearer token every request must carry")
    p.add_argument("--state-dir", default="runs/serve", help="where sessions save their states (default runs/serve)")
    p.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                   help="a local Hugging Face folder sessions may start from by NAME (repeatable; listed by "
                   "list_base_models with the shipped policies)")
    p.add_argument("--device", default="cpu", help="torch device of the sessions' models (default cpu)")
    p.add_argument("--threads", type=_positive(int), help="torch threads (default: torch's)")
    p.add_argument("--max-sessions", type=_positive(int), default=8, help="sessions held at once (default 8)")
    p.add_argument("--max-samplers", type=_positive(int), default=8,
                   help="sampling clients kept per session, newest first (default 8)")
    p.add_argument("--result-ttl-s", type=_positive(float), default=600.0,
                   help="seconds a finished call's result is kept for retrieval (default 600)")
    p.add_argument("--max-body-mb", type=_positive(float), default=64.0, help="largest request body (default 64)")
    p.add_argument("--session-ttl-s", type=float, default=3600.0,
                   help="close a session no request named for this long (default 3600; 0: never)")
    p.add_argument("--memory-budget-mb", type=float, metavar="MB",
                   help="memory the sessions (model, gradients, AdamW state, exported weights) and their sampling "
                   "clients may hold together (default: half of this machine's memory, or of the GPU's with "
                   "--device cuda; 0: no budget). At the budget the sampling clients used least recently are "
                   "evicted (never a session's newest, nor one with a call running; their ids then answer 404); "
                   "a session or sampler that still does not fit is refused (HTTP 507). GET /api/v1/memory shows "
                   "what each holds")
    p.add_argument("--docs", action="store_true", help="serve /docs, /redoc and /openapi.json (behind the key)")
    p.add_argument("--shutdown-grace-s", type=_positive(float), default=10.0,
                   help="on SIGTERM or SIGINT, how long requests in flight get to finish before they are cut "
                   "(default 10)")
    p.add_argument("--no-openai-batching", action="store_true",
                   help="give each OpenAI request an engine call of its own (default: concurrent requests to one "
                   "model with the same n and sampling parameters and no seed share one)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level (info: a line per request; default info)")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("sweep", help="a delay sweep: losses x delays x seeds (resumable), then its report")
    p.add_argument("sweep", help="sweep YAML (see experiments/configs/)")
    p.add_argument("--out", help="sweep directory (default: runs/sweeps/NAME)")
    p.add_argument("--dry-run", action="store_true", help="list the cells and check their configs, run nothing")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="sweep-file overrides, e.g. seeds=[0] parallel=1")
    p.set_defaults(fn=cmd_sweep)
    p = sub.add_parser("report", help="tables, plots and a Markdown summary of a sweep directory")
    p.add_argument("sweep_dir", nargs="+", help="the sweep's output folder (several with --summary)")
    p.add_argument("--summary", metavar="FILE", help="write one Markdown page across the sweeps given instead: "
                   "every claim per task, GEPO against each baseline per task and pooled (e.g. "
                   "experiments/results/SUMMARY.md)")
    p.add_argument("--out", help="report folder (default: SWEEP_DIR/report)")
    p.add_argument("--seeds", type=_seed_list, help="comma-separated seeds to report (default: all; e.g. those a "
                   "running sweep has finished for every cell); with --summary, of every sweep given")
    p.add_argument("--wandb-project", help="also log the table to wandb, grouped by the sweep's name")
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "online"])
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("compare", help="two or more losses side by side, online and at one delay or fixed lag: "
                       "tables with 95%% confidence intervals over seeds, and plots")
    p.add_argument("--losses", default="gepo,grpo", help="comma-separated losses or presets (default: gepo,grpo)")
    p.add_argument("--delay", default="16", help="a delay preset: 0 (online), steps (a maximum tolerable delay: "
                   "8, 16, ...), lagK (a fixed staleness of K versions), lognormal, weibull; runs next to the "
                   "online reference (0, or lag0 for a lag)")
    p.add_argument("--no-online", action="store_true", help="run the given delay only, without the online reference")
    p.add_argument("--config", default=DEMO_CONFIG, help=f"base run config (default: the packaged {DEMO_CONFIG})")
    p.add_argument("--seeds", type=_seed_list, default=[0], help="comma-separated seeds (default: 0)")
    p.add_argument("--mode", default="simulated", choices=["simulated", "live"])
    p.add_argument("--parallel", type=_positive(int), default=1, help="runs at once (default 1)")
    p.add_argument("--out", help="output directory (default: runs/compare/NAME)")
    p.add_argument("--dry-run", action="store_true", help="list the runs and check their configs, run nothing")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="run-config overrides, e.g. rl.steps=30")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("deploy", help="render the files that launch a run on Slurm (one sbatch script) or "
                       "Kubernetes (manifests), and print the command that launches them",
                       description="Render a run config into the files that launch it on a cluster, write them into "
                       "--out and print what to do once (make the CurveZMQ keys) and the one command that launches "
                       "the run. slurm: an sbatch script (a heterogeneous job: the learner, then the workers) and "
                       "the run config it reads; k8s: manifests.yaml (ConfigMap, PersistentVolumeClaim, Service, the "
                       "learner's Deployment, the workers' Deployment or Job). The config's `cluster` section sets "
                       "the resources, port, keys folder and the engine's own settings (docs/DEPLOY.md).")
    p.add_argument("target", choices=["slurm", "k8s"], help="the cluster engine")
    p.add_argument("config", help="the run config: a YAML file, or a packaged config's name (e.g. demo.yaml)")
    p.add_argument("--out", metavar="DIR", help="folder for the files (default: runs/deploy/TARGET/NAME); its "
                   "other files are left alone")
    p.add_argument("--force", action="store_true", help="replace rendered files in --out that differ from these "
                   "(hand edits included)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides, e.g. runtime.workers=8 cluster.worker.num_gpus=1")
    p.set_defaults(fn=cmd_deploy)
    p = sub.add_parser("tasks", help="list the tasks a run can name: heterorl's own with their options, and "
                       "reasoning-gym's datasets (task.name=reasoning_gym)")
    p.add_argument("--show", metavar="NAME", help="one task's options, or one reasoning-gym dataset's with an "
                   "example problem")
    p.add_argument("--json", action="store_true", help="the whole list as JSON")
    p.set_defaults(fn=cmd_tasks)
    p = sub.add_parser("losses", help="list the losses a run can name (loss.name=...), each with its paper and what "
                       "it does")
    p.add_argument("--show", metavar="NAME", choices=gepo.loss_names(), help="one loss's formula (its docstring) and "
                   "its options with their defaults")
    p.set_defaults(fn=cmd_losses)
    p = sub.add_parser("keys", help="make a CurveZMQ key pair (NAME.key public, NAME.key_secret secret), or "
                       "revoke a worker's key")
    p.add_argument("action", nargs="?", choices=["make", "revoke"], default="make",
                   help="make (default): write a key pair into --out; revoke: take NAME.key out of the learner's "
                   "--allow-keys folder (a running learner refuses it within transport.keys_reload_s)")
    p.add_argument("--name", required=True, help="whose keys: 'learner' or a worker id")
    p.add_argument("--out", default="keys", help="folder for the key files (default: keys)")
    p.add_argument("--allow-keys", help="revoke: the learner's folder of allowed worker *.key files")
    p.set_defaults(fn=cmd_keys)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:  # key=value overrides may also come after options (argparse stops collecting them at an option)
        if not hasattr(args, "overrides") or any(r.startswith("-") or "=" not in r for r in rest):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*args.overrides, *rest]
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
