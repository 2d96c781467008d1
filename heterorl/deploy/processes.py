"""The processes of a run deployed by `heterorl deploy` (heterorl/deploy/slurm.py, heterorl/deploy/k8s.py): each
one's command line, the classes of rollout workers, and the checks a config passes before anything is rendered.
Pure: a `Config` in, words and numbers out."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

from heterorl.config import Config, to_yaml
from heterorl.errors import ConfigError
from heterorl.runtime.launch import worker_engine, worker_throttle

# a deployed worker waits this long for its learner, whose process may still be starting (an image pulled, a model
# loaded), rather than `heterorl rollout`'s 120 s; an engine restarts a worker that gave up
CONNECT_TIMEOUT_S = 600


@dataclass(frozen=True)
class WorkerClass:
    """The rollout workers that share an engine and a throttle: worker i has runtime.engines[i % len] and
    runtime.throttle[i % len], as `heterorl train` gives them."""

    engine: str
    throttle: float
    count: int


def worker_classes(cfg: Config) -> list[WorkerClass]:
    """The workers grouped by (engine, throttle), in the order of their first worker."""
    counts: dict[tuple[str, float], int] = {}
    for i in range(cfg.runtime.workers):
        key = (worker_engine(cfg, i), worker_throttle(cfg, i))
        counts[key] = counts.get(key, 0) + 1
    return [WorkerClass(engine, throttle, count) for (engine, throttle), count in counts.items()]


def number(value: float) -> str:
    """``value`` as the shortest text that reads back the same: 2 -> "2", 1.5 -> "1.5"."""
    return f"{value:g}" if float(value) == float(f"{value:g}") else repr(float(value))


def whole_gpus(key: str, gpus: float, target: str) -> int:
    """``gpus`` as a count of whole GPUs; ConfigError for a fraction, which Ray shares and ``target`` cannot."""
    if not float(gpus).is_integer():
        raise ConfigError(f"config key `{key}` = {gpus!r}: {target} gives whole GPUs (Ray shares a fraction); "
                          f"give a whole number")
    return int(gpus)


def whole_cpus(cpus: float) -> int:
    """``cpus`` rounded up to a whole CPU, at least 1 (Slurm's --cpus-per-task)."""
    return max(1, math.ceil(cpus - 1e-9))


def shell_word(key: str, value: str) -> str:
    """``value`` (a path from the config) when it is one shell word as it stands; ConfigError otherwise, so that
    every rendered command line holds it unquoted and reads as the config does."""
    if not value or shlex.quote(value) != value:
        raise ConfigError(f"config key `{key}` = {value!r}: a deployed run's paths are written into shell command "
                          "lines: give one without spaces, quotes, '~' or '$'")
    return value


def shell_command(*segments: list[str], width: int = 112) -> str:
    """The words of ``segments`` as one command, each segment from a new line and over more lines of at most
    ``width`` characters where it is long (a backslash ends each but the last), an option kept with its value."""
    lines: list[str] = []
    for segment in segments:
        units: list[str] = []
        for word in segment:
            option = units and units[-1].startswith("-") and " " not in units[-1] and "=" not in units[-1]
            if option and not word.startswith("-"):
                units[-1] += " " + word
            else:
                units.append(word)
        lines.append(("    " if lines else "") + units[0])
        for unit in units[1:]:
            if len(lines[-1]) + 1 + len(unit) > width:
                lines.append("    " + unit)
            else:
                lines[-1] += " " + unit
    return " \\\n".join(lines)


def check_deployable(cfg: Config, target: str) -> None:
    """ConfigError naming the key when ``cfg`` cannot run as live processes on a cluster: a simulated run, or a
    device that disagrees with the GPUs the cluster section asks for (the processes would leave the GPUs idle, or
    look for GPUs they were not given). Both the learner and torch workers sample on policy.device."""
    if cfg.runtime.execution != "live":
        raise ConfigError(f"config key `runtime.execution` = {cfg.runtime.execution!r}: `heterorl deploy {target}` "
                          "starts live processes; set runtime.execution=live")
    on_gpu = cfg.policy.device.startswith("cuda")
    processes = [("cluster.learner", cfg.cluster.learner)]
    if "torch" in cfg.runtime.engines[:cfg.runtime.workers]:
        processes.append(("cluster.worker", cfg.cluster.worker))
    for key, resources in processes:
        if (resources.num_gpus > 0) != on_gpu:
            raise ConfigError(f"config key `{key}.num_gpus` = {resources.num_gpus!r} disagrees with `policy.device` "
                              f"= {cfg.policy.device!r}, on which the learner and torch workers run: set "
                              "policy.device=cuda with GPUs, policy.device=cpu without")


def learner_command(cfg: Config, config_path: str, keys: str) -> list[str]:
    """The learner: `heterorl learner` bound to cluster.port (weights on port + 1) with its CurveZMQ keys; under
    torchrun on one node when runtime.learner_ranks > 1 (a free rendezvous port, as `heterorl train` starts it)."""
    ranks = cfg.runtime.learner_ranks
    launcher = (["python", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m",
                 "heterorl.cli"] if ranks > 1 else ["heterorl"])
    return [*launcher, "learner", "--config", config_path, "--bind", f"tcp://*:{cfg.cluster.port}",
            "--curve-secret", f"{keys}/learner.key_secret", "--allow-keys", f"{keys}/allowed"]


def worker_arguments(connect: str, worker_id: str, engine: str, throttle: str, secret: str,
                     server_key: str) -> list[str]:
    """The arguments of `heterorl rollout` for one worker (words, or shell expressions the caller quotes)."""
    return ["rollout", "--connect", connect, "--worker-id", worker_id, "--engine", engine, "--throttle", throttle,
            "--curve-secret", secret, "--server-key", server_key, "--connect-timeout", str(CONNECT_TIMEOUT_S)]


def run_config_text(cfg: Config, target: str, note: str = "") -> str:
    """The run config the learner reads (workers receive it from the learner), with a header saying where it came
    from and ``note`` (comment lines) on what the renderer changed."""
    header = (f"# The run config of a run deployed by `heterorl deploy {target}`: the learner reads it (--config) and\n"
              "# sends it to every worker. Change the source config and render again rather than this copy.\n")
    return header + note + to_yaml(cfg)
