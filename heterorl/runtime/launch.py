"""Running the system: a learner process, rollout-worker processes, and `heterorl train` that starts them all.

`heterorl train` starts one learner and ``runtime.workers`` workers as separate
processes on this machine, over real sockets on loopback, each with its log in
``RUN_DIR/logs/``. It follows the learner's metrics for its progress bar. A
worker that dies with an error leaves the fleet (its log tail is printed) and the
run goes on with the others; when the learner or the last worker dies, its log
tail is printed, the others are stopped and the exit status is non-zero. Ctrl-C
stops everything. Worker i samples with engine ``runtime.engines[i % len]``; a
vLLM worker runs under ``runtime.vllm_python`` (its own venv).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from heterorl.addresses import parse_host_port
from heterorl.config import Config, to_yaml, worker_command_word
from heterorl.errors import HeteroRLError
from heterorl.files import write_atomically
from heterorl.runs import json_text, keep_metrics_until, setup_run
from heterorl.runtime.accounting import GROUP_LOG
from heterorl.runtime.signals import signal_handlers, stop_after_step
from heterorl.runtime.supervise import Child, WorkerFleet

log = logging.getLogger("heterorl.runtime.launch")

ENDPOINTS = "endpoints.json"
INTERRUPT_WAIT_S = 600.0  # the longest a Ctrl-C'd `heterorl train` waits for its learner's step and checkpoint
METRICS = "metrics.jsonl"
BIND, BIND_EXAMPLE = "--bind (or runtime.address)", "tcp://127.0.0.1:5555"  # the learner's address, as it is named


def _init_ranks(cfg: Config) -> int:
    """Under torchrun (WORLD_SIZE > 1): join the process group (gloo on CPU, NCCL on GPU); returns the rank."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0
    if cfg.policy.device.startswith("cuda"):
        cfg.policy.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cfg.policy.device.startswith("cuda") else "gloo")
    return dist.get_rank()


def bind_shard_channels(cfg: Config, bind: str, curve=None, allow_plaintext: bool = False):
    """A learner that reshards (`_shard_ranks` > 1): every rank > 0 binds its weights channel (a `ShardServer`)
    on a free port of the host in ``bind``, and the ranks share those ports (one ``all_gather_object``, the first
    collective of the run on every rank), for rank 0 to tell the workers. Returns this rank's ShardServer (None on
    rank 0 or when the learner does not reshard) and the ports of ranks 1.. in order. A rank that cannot bind
    fails every rank, naming it and the address."""
    import torch.distributed as dist

    world = _shard_ranks(cfg)
    if world == 1:
        return None, []
    from heterorl.transport.weights.shards import ShardServer

    if not bind.startswith("tcp://"):
        raise HeteroRLError(f"a learner that reshards needs a tcp:// address, not {bind}: every rank binds its own "
                            "weights channel on that host (--bind, runtime.address; or runtime.weights_fanout=gather)")
    host, rank, server, mine = parse_host_port(bind, BIND, BIND_EXAMPLE)[0], dist.get_rank(), None, None
    if rank > 0:
        try:
            server = ShardServer(f"tcp://{host}:0", rank, world, _transport_config(cfg, allow_plaintext), curve=curve)
            mine = parse_host_port(server.endpoint, f"learner rank {rank}'s weights endpoint", BIND_EXAMPLE)[1]
        except Exception as exc:  # told to every rank, which all stop
            mine = f"learner rank {rank} cannot bind its weights channel on tcp://{host}:0: {exc}"
    shared: list = [None] * world
    dist.all_gather_object(shared, mine)
    failures = [port for port in shared[1:] if not isinstance(port, int)]
    if failures:
        if server is not None:
            server.close()
        raise HeteroRLError("; ".join(map(str, failures)))
    return server, shared[1:]


def _follow_rank(cfg: Config, resume: bool, shard_server=None) -> None:
    """A learner rank > 0: same model and optimizer, trains on its share of each batch; its only socket is
    ``shard_server`` (`bind_shard_channels`)."""
    from heterorl.policies import load_policy
    from heterorl.runtime.checkpoints import read_checkpoint
    from heterorl.runtime.learner import Learner
    from heterorl.tasks import make_task_from
    from heterorl.training.session import TrainingClient

    task = make_task_from(cfg.task)
    model, tokenizer = load_policy(cfg.rl.base or cfg.policy.model, alphabet=task.alphabet(), tiny=cfg.policy.tiny,
                                   device=cfg.policy.device)
    training = TrainingClient(model, tokenizer, device=cfg.policy.device, seed=cfg.seed, data_parallel=True,
                              shard=cfg.runtime.learner_sharding == "fsdp", lora=cfg.lora,
                              tokens_per_microbatch=cfg.optim.tokens_per_microbatch,
                              activation_checkpointing=cfg.policy.activation_checkpointing,
                              train_dtype=cfg.policy.train_dtype)
    if resume:
        training.load_state(read_checkpoint(cfg.logging.run_dir, cfg.policy.device).training_state).result()
    Learner(cfg, training, task, None, cfg.logging.run_dir).follow(shard_server)


def serve_learner(cfg: Config, bind: str, *, curve=None, resume: bool = False, allow_plaintext: bool = False,
                  progress=None, share_machine: bool = False):
    """The learner process: bind, train ``rl.steps`` steps, say bye to the workers, write the summary. With
    ``resume``, continue from the run dir's checkpoint, read and checked before anything is bound or written;
    the metrics of the steps after it are dropped, as they are trained again. The workers hear `BYE_RUN_FINISHED`
    when the run is over, `BYE_LEARNER_STOPPING` when it stops before (they wait for a restarted learner)."""
    run_dir = Path(cfg.logging.run_dir)
    if not resume and (run_dir / "checkpoints" / "learner_state.json").is_file():
        raise HeteroRLError(f"{run_dir} already holds a run: pass --resume to continue it (its workers hold its "
                            "versions), or choose another logging.run_dir")
    import torch

    from heterorl.runtime.checkpoints import read_checkpoint
    from heterorl.runtime.learner import Learner, finish_learner_run
    from heterorl.transport.protocol import BYE_LEARNER_STOPPING, BYE_RUN_FINISHED

    torch.set_num_threads(cfg.runtime.learner_threads or cfg.runtime.threads)
    rank = _init_ranks(cfg)
    shard_server, shard_ports = bind_shard_channels(cfg, bind, curve, allow_plaintext)
    if rank > 0:
        # torchrun passes SIGTERM and SIGINT to every rank: rank 0 stops the others (its "stop") after its last step
        with signal_handlers(signal.SIG_IGN):
            _follow_rank(cfg, resume, shard_server)
        return None
    checkpoint = read_checkpoint(run_dir, cfg.policy.device) if resume else None
    if checkpoint is not None:
        for logged in (METRICS, GROUP_LOG):  # each step is logged once
            keep_metrics_until(run_dir / logged, checkpoint.state.step)
    task, training, logger, run_dir = setup_run(cfg, "learner", cfg.rl.base or cfg.policy.model, append=resume,
                                                data_parallel=True)
    server = _learner_server(cfg, learner_addresses(cfg, bind, resume), training, curve=curve,
                             allow_plaintext=allow_plaintext, shard_ports=shard_ports,
                             published_before=checkpoint.newest_published if checkpoint is not None else -1)
    learner = Learner(cfg, training, task, server, run_dir, logger, progress, share_machine=share_machine)
    reason = BYE_LEARNER_STOPPING
    try:
        if checkpoint is not None:
            learner.resume(checkpoint)
        with _stop_on_signals(learner):
            result = learner.run()
        reason = BYE_LEARNER_STOPPING if learner.stopped_by else BYE_RUN_FINISHED
    finally:
        server.close(reason)
        logger.close()
    counted = ("rejected", "dropped_groups", "dropped_trajectories", "duplicates", "workers_removed", "revoked",
               "permits_expired", "permits_returned", "permits_reclaimed", "handshakes_refused", "end_of_run")
    finish_learner_run(cfg, task, training, run_dir, result,
                       {"execution": "live", "transport_rejected": server.stats["rejected"],
                        "stopped_by": learner.stopped_by or None,
                        "thread_split": None if learner.split is None else vars(learner.split),
                        # what the learner refused or dropped, by reason (docs/RELIABILITY.md)
                        "transport": {k: v for k, v in sorted(server.stats.items()) if k.startswith(counted)}})
    return result


@contextlib.contextmanager
def _stop_on_signals(learner):
    """SIGTERM and SIGINT end the learner's run after its step in progress, with a checkpoint (`Learner.request_stop`);
    a second one stops it at once. Outside the main thread (a learner run from a library) nothing changes."""

    def announce(name: str) -> None:
        log.warning("%s: stopping after the step in progress, with a checkpoint (send it again to stop at once)", name)

    with stop_after_step(lambda: learner.stopped_by, learner.request_stop, announce):
        yield


def learner_addresses(cfg: Config, bind: str, resume: bool) -> tuple[str, str | None]:
    """The control and weights addresses the learner binds: ``bind`` (weights None: on its port + 1), or, for a
    resumed learner whose ``bind`` leaves the port open, the ones in ``RUN_DIR/endpoints.json`` that its
    workers are still dialling."""
    endpoints = Path(cfg.logging.run_dir) / ENDPOINTS
    if resume and endpoints.is_file() and bind.endswith(":0"):
        previous = json.loads(endpoints.read_text())
        return previous["control"], previous["weights"]
    return bind, None


def refuse_busy_ports(cfg: Config, bind: str, resume: bool) -> None:
    """HeteroRLError naming the address when another process listens on the learner's control address or its
    weights one (`learner_addresses`): for `heterorl learner` and `heterorl train` to say at once, before the
    seconds that loading libraries and the model take, what the bind would say after them.
    Port 0 (free ports are picked) and addresses that are not tcp:// are left to the bind; a tcp:// one without
    a numeric port is a ConfigError (`parse_host_port`)."""
    control, weights = learner_addresses(cfg, bind, resume)
    if not control.startswith("tcp://"):
        return
    host, port = parse_host_port(control, BIND, BIND_EXAMPLE)
    if not port:
        return
    for channel, address in (("control", control), ("weights", weights or f"tcp://{host}:{port + 1}")):
        if _in_use(*parse_host_port(address, f"the learner's {channel} address", BIND_EXAMPLE)):
            raise HeteroRLError(f"{address} (the learner's {channel} channel) is in use by another process: choose "
                                "another port (--bind, or runtime.address; the weights channel takes port + 1, and "
                                "port 0 picks free ones) or stop the process that holds it")


def _in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails because another socket listens there; False when that cannot be told
    (a host only ZeroMQ resolves, such as an interface name; a port this user may not bind)."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo("0.0.0.0" if host == "*" else host.strip("[]"), port,
                                                           type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError, OverflowError):
        return False
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: a port in TIME_WAIT is free
        try:
            probe.bind(where)
            probe.listen(1)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _transport_config(cfg: Config, allow_plaintext: bool):
    from heterorl.config import TransportConfig

    return TransportConfig(**{**cfg.transport.__dict__, "allow_plaintext": allow_plaintext
                              or cfg.transport.allow_plaintext})


def _shard_ranks(cfg: Config) -> int:
    """The ranks that send their own slices of each version (1: rank 0 sends whole versions)."""
    import torch.distributed as dist

    sharded = (cfg.runtime.learner_sharding == "fsdp" and cfg.runtime.weights_fanout == "reshard"
               and dist.is_initialized())
    return dist.get_world_size() if sharded else 1


def _learner_server(cfg: Config, addresses: tuple[str, str | None], training, *, curve, allow_plaintext: bool,
                    published_before: int, shard_ports: list[int]):
    """The learner's `LearnerServer` on ``addresses`` (`learner_addresses`), its address written to
    ``RUN_DIR/endpoints.json``; ``shard_ports``: its other ranks' weights channels (`bind_shard_channels`)."""
    from heterorl.delay.clock import delay_clock
    from heterorl.delay.links import DelayLink
    from heterorl.runtime.learner import learner_settings, trajectory_contract
    from heterorl.transport import LearnerServer

    run_dir = Path(cfg.logging.run_dir)
    bind, weights_address = addresses
    transport = _transport_config(cfg, allow_plaintext)
    weights_delay = None
    if cfg.delay.down.active:
        weights_delay = lambda worker_id: DelayLink(cfg.delay.down, name=f"{worker_id}/weights")  # noqa: E731
    contract = trajectory_contract(cfg, training.model)  # checked on every trajectory before it is buffered
    server = LearnerServer(bind, transport, curve=curve, weights_address=weights_address, weights_delay=weights_delay,
                           settings=learner_settings(cfg, contract, training.base_hash), clock=delay_clock(cfg).now,
                           contract=contract, admission_control=cfg.buffer.policy == "admission",
                           published_before=published_before,
                           shard_ranks=_shard_ranks(cfg), shard_ports=shard_ports,
                           model_shapes={name: tuple(t.shape) for name, t in training.model.state_dict().items()})
    # renamed into place whole: whoever polls for it (a launcher, a lab, a script) never reads it half-written
    write_atomically(run_dir / ENDPOINTS, json.dumps({"control": server.control_endpoint,
                                                      "weights": server.weights_endpoint}).encode(), durable=False)
    print(f"learner listening on {server.control_endpoint} (weights on {server.weights_endpoint})", flush=True)
    return server


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run dir's latest checkpoint, or None when its learner state cannot be read (the learner
    then says what is wrong). Read here without importing the learner (and torch) into the launcher."""
    try:
        return int(json.loads((run_dir / "checkpoints" / "learner_state.json").read_bytes())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def worker_python(cfg: Config, engine: str) -> str:
    """The Python a worker of ``engine`` runs under: this one for torch; ``runtime.vllm_python`` for vLLM
    (its own venv), which must exist."""
    if engine != "vllm":
        return sys.executable
    python = Path(cfg.runtime.vllm_python).expanduser()
    if not python.is_file():
        raise HeteroRLError(f"runtime.engines asks for a vLLM worker, but runtime.vllm_python ({python}) does not "
                            "exist: run `make vllm` to build .venv-vllm, or set runtime.vllm_python to a Python "
                            "that has vLLM and this package")
    return str(python)


def _wait_for_endpoint(child: Child, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in child.log_path.read_text(errors="replace").splitlines():
            if line.startswith("learner listening on "):
                return line.split()[3]
        if child.proc.poll() is not None:
            raise HeteroRLError(f"the learner exited with status {child.proc.returncode} before listening:\n"
                                f"{child.tail()}")
        time.sleep(0.1)
    raise HeteroRLError(f"the learner did not start listening within {timeout_s:.0f} s; log: {child.log_path}")


def train(cfg: Config, *, resume: bool = False, progress=None) -> int:
    """Start the learner and the workers, follow the run, stop everything at the end (or on any crash).
    With ``runtime.execution=simulated`` the whole run happens in this process on a virtual clock."""
    run_dir = Path(cfg.logging.run_dir)
    if cfg.runtime.execution == "simulated":
        if resume:
            raise HeteroRLError("--resume needs the live execution; a simulated run is rerun (it is deterministic)")
        from heterorl.runtime.simulate import simulate_run

        simulate_run(cfg, progress)
        return 0
    check_run_dir(run_dir, resume)
    engines = worker_engines(cfg)
    pythons = [worker_python(cfg, engine) for engine in engines]  # a missing vLLM venv fails before anything starts
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "train_config.yaml"
    config_path.write_text(to_yaml(cfg))
    logs = run_dir / "logs"
    learner: Child | None = None
    fleet: WorkerFleet | None = None
    metrics_path = run_dir / METRICS
    step = checkpoint_step(run_dir) if resume else None
    if step is not None:
        keep_metrics_until(metrics_path, step)  # as the learner will: the progress follows from what stays
    seen = metrics_path.stat().st_size if resume and metrics_path.exists() else 0
    try:
        learner = Child("learner", _learner_argv(cfg, config_path, resume), logs / "learner.log",
                        ranks=cfg.runtime.learner_ranks, devices=cfg.runtime.learner_devices)
        endpoint = _wait_for_endpoint(learner, 300)

        def start_worker(name: str) -> Child:
            i = int(name.rsplit("-", 1)[1])
            prefix = [worker_command_word(word, i) for word in cfg.runtime.worker_prefix]
            return Child(name, worker_argv(cfg, i, endpoint, engines[i]), logs / f"{name}.log", python=pythons[i],
                         devices=_nth(cfg.runtime.worker_devices, i, ""), prefix=prefix, forkable=engines[i] != "vllm")

        fleet = WorkerFleet(start_worker, [f"worker-{i}" for i in range(len(engines))], cfg.runtime.worker_restarts)
        try:
            _follow_run(learner, fleet, metrics_path, seen, progress)
        except KeyboardInterrupt:
            # a Ctrl-C reaches this process alone (each child leads a session of its own): the learner hears it as
            # SIGINT, ends its step in progress with a checkpoint and tells its workers it stops (a second Ctrl-C
            # here stops everything at once); its summary says stopped_by SIGINT
            print("\nheterorl train: SIGINT: the learner stops after its step in progress, with a checkpoint "
                  f"(again: stop at once); waiting up to {INTERRUPT_WAIT_S:.0f} s", file=sys.stderr, flush=True)
            learner.stop(INTERRUPT_WAIT_S, first=signal.SIGINT)
            return 128 + signal.SIGINT
        record_restarts(run_dir, fleet.restarts())
        deadline = time.monotonic() + 30
        for child in fleet.children():
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))  # they leave on the learner's bye
            except subprocess.TimeoutExpired:
                pass
        return 0
    finally:
        for child in [*(fleet.children() if fleet is not None else []), *([learner] if learner else [])]:
            child.stop()


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """HeteroRLError unless ``run_dir`` holds a run to resume (``resume``) or none to overwrite."""
    if resume and not (run_dir / "checkpoints").is_dir():
        raise HeteroRLError(f"nothing to resume in {run_dir}: no checkpoints folder")
    if not resume and (run_dir / "checkpoints").is_dir():
        raise HeteroRLError(f"{run_dir} already holds a run; pass --resume {run_dir} to continue it, "
                            "or choose another logging.run_dir")


def worker_engine(cfg: Config, i: int) -> str:
    """Rollout worker ``i``'s engine: ``runtime.engines[i % len]``."""
    return cfg.runtime.engines[i % len(cfg.runtime.engines)]


def worker_throttle(cfg: Config, i: int) -> float:
    """Rollout worker ``i``'s slow-down factor: ``runtime.throttle[i % len]``, 1.0 when none is given."""
    return float(_nth(cfg.runtime.throttle, i, 1.0))


def worker_engines(cfg: Config) -> list[str]:
    """The engine of each rollout worker (`worker_engine`)."""
    return [worker_engine(cfg, i) for i in range(cfg.runtime.workers)]


def worker_argv(cfg: Config, i: int, endpoint: str, engine: str) -> list[str]:
    """Worker ``i``'s `heterorl rollout` command line (its keys apart), whoever starts it."""
    plaintext = ["--allow-plaintext"] if cfg.transport.allow_plaintext else []  # (its learner's, off loopback)
    return ["rollout", "--connect", endpoint, "--worker-id", f"worker-{i}", "--throttle",
            str(worker_throttle(cfg, i)), "--engine", engine, *plaintext]


def _follow_run(learner: Child, fleet: WorkerFleet, metrics_path: Path, seen: int, progress) -> None:
    """Until the learner exits: feed ``progress`` its metrics and supervise the workers (`WorkerFleet.check`).
    HeteroRLError when the learner fails or every worker has been given up."""
    while True:
        seen = follow_metrics(metrics_path, seen, progress)
        status = learner.proc.poll()
        if status is not None:
            follow_metrics(metrics_path, seen, progress)
            if status != 0:
                raise HeteroRLError(f"the learner failed (exit {status}); log {learner.log_path}:\n{learner.tail()}")
            return
        fleet.check()
        time.sleep(0.5)


def record_restarts(run_dir: Path, restarts: dict[str, int], **more) -> None:
    """Add the workers' restarts (`WorkerFleet.restarts`, or Ray's) to the learner's summary.json
    (``worker_restarts``), with ``more`` keys from the launcher."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return
    summary = json.loads(path.read_text())
    summary.update(worker_restarts=restarts, **more)
    write_atomically(path, json_text(summary, indent=2).encode())
    if restarts:
        print(f"heterorl train: worker restarts: {', '.join(f'{k} {v}' for k, v in sorted(restarts.items()))}",
              file=sys.stderr, flush=True)


def _learner_argv(cfg: Config, config_path: Path, resume: bool) -> list[str]:
    """The learner's command line; one learner rank shares this machine's cores with its workers."""
    return ["learner", "--config", str(config_path), "--bind", cfg.runtime.address,
            *(["--resume"] if resume else []), *(["--share-machine"] if cfg.runtime.learner_ranks == 1 else [])]


def _nth(values: list, i: int, default):
    """``values[i % len(values)]``, or ``default`` when there are none (runtime.throttle, runtime.worker_devices)."""
    return values[i % len(values)] if values else default


def follow_metrics(path: Path, offset: int, progress) -> int:
    """Feed new metrics records to ``progress``; returns the new file offset."""
    if progress is None or not path.exists():
        return offset
    with path.open("rb") as f:
        f.seek(offset)
        while True:
            line = f.readline()
            if not line.endswith(b"\n"):
                return offset
            offset += len(line)
            record = json.loads(line)
            progress(int(record.get("step", 0)), record)
