"""`heterorl deploy slurm`: one run as one sbatch script, a heterogeneous job (docs/DEPLOY.md, "Slurm").

Component 0 is the learner (one node; runtime.learner_ranks ranks' worth of cluster.learner), component 1 the
runtime.workers rollout workers (one task each, cluster.worker). Every path in the script is relative to the
directory it was rendered in, which is where it is submitted from ($SLURM_SUBMIT_DIR, seen by every node).
Pure: `render_slurm` returns the files' texts."""

from __future__ import annotations

import math
import shlex

from heterorl.config import Config
from heterorl.deploy.processes import (
    check_deployable,
    learner_command,
    number,
    run_config_text,
    shell_command,
    shell_word,
    whole_cpus,
    whole_gpus,
    worker_arguments,
)
from heterorl.errors import ConfigError
from heterorl.runtime.launch import worker_throttle

SCRIPT = "job.sbatch"
RUN_CONFIG = "run_config.yaml"
_FEATURE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def render_slurm(cfg: Config, out: str) -> dict[str, str]:
    """{file name: text} of the job: the sbatch script and the run config it reads, both to be written into
    ``out`` (the output folder as given: relative to the submit directory, or absolute)."""
    check_deployable(cfg, "slurm")
    for key, value in (("--out", out), ("cluster.keys", cfg.cluster.keys),
                       ("cluster.slurm.venv", cfg.cluster.slurm.venv), ("logging.run_dir", cfg.logging.run_dir)):
        shell_word(key, value)
    return {SCRIPT: _script(cfg, out.rstrip("/") or "/"), RUN_CONFIG: run_config_text(cfg, "slurm")}


def key_commands(cfg: Config) -> list[str]:
    """The commands that make the job's CurveZMQ keys in cluster.keys: the learner's pair, one pair per worker
    (worker-0 ...), and the learner's folder of allowed worker public keys."""
    keys, last = cfg.cluster.keys, cfg.runtime.workers - 1
    return [f"heterorl keys --name learner --out {keys}",
            f"for i in $(seq 0 {last}); do heterorl keys --name worker-$i --out {keys}; done",
            f"mkdir -p {keys}/allowed && cp {keys}/worker-*.key {keys}/allowed/"]


def _resources(resources, tasks_worth: int, key: str) -> list[str]:
    """sbatch options of one task holding ``tasks_worth`` processes of ``resources`` (a ProcessResources)."""
    options = [f"--cpus-per-task={whole_cpus(resources.num_cpus * tasks_worth)}"]
    gpus = whole_gpus(f"{key}.num_gpus", resources.num_gpus, "Slurm") * tasks_worth
    if gpus:
        options.append(f"--gpus-per-task={gpus}")
    return options


def _learner_memory(resources, ranks: int) -> list[str]:
    """The learner's --mem: memory_gib per rank (its node holds it alone)."""
    if resources.memory_gib is None:
        return []
    mib = math.ceil(resources.memory_gib * ranks * 1024)
    return [f"--mem={mib // 1024}G" if mib % 1024 == 0 else f"--mem={mib}M"]


def _worker_memory(resources) -> list[str]:
    """A worker's --mem-per-cpu: memory_gib over its CPUs (several workers may share a node, and Slurm has no
    memory per task)."""
    if resources.memory_gib is None:
        return []
    return [f"--mem-per-cpu={math.ceil(resources.memory_gib * 1024 / whole_cpus(resources.num_cpus))}M"]


def _constraint(resources, key: str) -> list[str]:
    """cluster.*.resources' names as node features (--constraint, all of them); their amounts mean nothing here."""
    for name in resources.resources:
        if not name or not set(name) <= _FEATURE:
            raise ConfigError(f"config key `{key}.resources.{name}`: Slurm takes it as a node feature "
                              "(--constraint), whose name is letters, digits, '_', '.' and '-'")
    return [f"--constraint={'&'.join(resources.resources)}"] if resources.resources else []


def _header(cfg: Config) -> list[str]:
    slurm, learner, worker = cfg.cluster.slurm, cfg.cluster.learner, cfg.cluster.worker
    ranks = cfg.runtime.learner_ranks
    common = [f"--time={slurm.time}"]
    common += [f"--partition={shell_word('cluster.slurm.partition', slurm.partition)}"] if slurm.partition else []
    common += [f"--account={shell_word('cluster.slurm.account', slurm.account)}"] if slurm.account else []
    name = cfg.logging.run_dir.rstrip("/").rsplit("/", 1)[-1]
    learner_options = [f"--job-name=heterorl-{name}", *common, "--nodes=1", "--ntasks=1",
                       *_resources(learner, ranks, "cluster.learner"), *_learner_memory(learner, ranks),
                       *_constraint(learner, "cluster.learner")]
    worker_options = [*common, f"--ntasks={cfg.runtime.workers}", *_resources(worker, 1, "cluster.worker"),
                      *_worker_memory(worker), *_constraint(worker, "cluster.worker")]
    return ([f"#SBATCH {option}" for option in learner_options] + ["#SBATCH hetjob"]
            + [f"#SBATCH {option}" for option in worker_options])


def _key_check(cfg: Config) -> str:
    keys, last = cfg.cluster.keys, cfg.runtime.workers - 1
    make = "\n".join(f"  {command}" for command in key_commands(cfg))
    return f"""missing=()
for key in {keys}/learner.key {keys}/learner.key_secret; do [ -f "$key" ] || missing+=("$key"); done
for i in $(seq 0 {last}); do
    for key in "{keys}/worker-$i.key_secret" "{keys}/allowed/worker-$i.key"; do [ -f "$key" ] || missing+=("$key"); done
done
if [ ${{#missing[@]}} -gt 0 ]; then
    echo "heterorl: missing CurveZMQ keys: ${{missing[*]}}. Make them once, in $PWD:" >&2
    cat >&2 <<'KEYS'
{make}
KEYS
    exit 1
fi"""


def _worker_program(cfg: Config) -> str:
    """What each worker task runs: its index is $SLURM_PROCID (0 .. runtime.workers - 1 in the step)."""
    engines = cfg.runtime.engines
    pythons = ["python" if engine == "torch" else shell_word("runtime.vllm_python", cfg.runtime.vllm_python)
               for engine in engines]
    throttles = [number(worker_throttle(cfg, i)) for i in range(max(1, len(cfg.runtime.throttle)))]
    keys = cfg.cluster.keys
    arguments = worker_arguments(f'"tcp://$HETERORL_LEARNER_HOST:{cfg.cluster.port}"', '"worker-$i"',
                                 f'"${{engines[i % {len(engines)}]}}"', f'"${{throttles[i % {len(throttles)}]}}"',
                                 f'"{keys}/worker-$i.key_secret"', f"{keys}/learner.key")
    return (f"i=$SLURM_PROCID\n"
            f"engines=({' '.join(engines)}) pythons=({' '.join(pythons)}) throttles=({' '.join(throttles)})\n"
            + shell_command(["exec", f'"${{pythons[i % {len(engines)}]}}"', "-m", "heterorl.cli", arguments[0]],
                            arguments[1:]))


def _script(cfg: Config, out: str) -> str:
    keys, venv, run_config = cfg.cluster.keys, cfg.cluster.slurm.venv, f"{out}/{RUN_CONFIG}"
    logs = f"{cfg.logging.run_dir.rstrip('/')}/logs"
    ranks, workers = cfg.runtime.learner_ranks, cfg.runtime.workers
    learner_step = ["srun", "--het-group=0", "--ntasks=1", *_resources(cfg.cluster.learner, ranks, "cluster.learner"),
                    f"--output={logs}/learner.log", "--open-mode=append"]
    learner = [shlex.quote(word) for word in learner_command(cfg, run_config, keys)]
    worker_step = ["srun", "--het-group=1", f"--ntasks={workers}", *_resources(cfg.cluster.worker, 1, "cluster.worker"),
                   "--kill-on-bad-exit=0", f"--output={logs}/worker-%t.log", "--open-mode=append"]
    header = "\n".join(_header(cfg))
    return f"""#!/bin/bash
# Rendered by `heterorl deploy slurm`: one run as a heterogeneous job, its learner ({ranks} rank{"s" * (ranks > 1)})
# in component 0 and its {workers} rollout worker{"s" * (workers > 1)} in component 1. Submit it from the directory it
# was rendered in (every path below is relative to it, and every node must see it):
#   sbatch {out}/{SCRIPT} [--resume]
# --resume continues the run in logging.run_dir from its last checkpoint (after a failure or the time limit),
# as a job Slurm requeues does (submitted with --requeue, after a node failure or a preemption).
{header}
set -euo pipefail
cd "$SLURM_SUBMIT_DIR"
resume=()
case "${{1:-}}" in
    --resume) resume=(--resume) ;;
    "") ;;
    *) echo "usage: sbatch {out}/{SCRIPT} [--resume]" >&2; exit 2 ;;
esac
if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then resume=(--resume); fi  # requeued (sbatch --requeue): go on
for file in {venv}/bin/activate {run_config}; do
    [ -f "$file" ] || {{ echo "heterorl: no $file in $PWD: submit from where this was rendered" >&2; exit 1; }}
done
{_key_check(cfg)}
# shellcheck source=/dev/null
source {venv}/bin/activate
export PYTHONUNBUFFERED=1 WANDB_SILENT=true
mkdir -p {logs}
HETERORL_LEARNER_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | sed -n 1p)  # (not head: pipefail)
export HETERORL_LEARNER_HOST

{shell_command(learner_step, learner + ['${resume[@]+"${resume[@]}"}', "&"])}
learner=$!
# each task is one worker: its id, engine and throttle follow its index, as `heterorl train` gives them
# shellcheck disable=SC2016  # (single quotes: each task's own bash expands them)
{shell_command(worker_step, ["bash", "-c", "'"])}
{_worker_program(cfg)}' &
workers=$!

status=0
wait "$learner" || status=$?
# the workers leave on the learner's bye; those still running a minute later are stopped
for _ in $(seq 300); do kill -0 "$workers" 2>/dev/null || break; sleep 0.2; done
kill "$workers" 2>/dev/null || true
wait "$workers" || true
echo "heterorl: the learner exited with status $status; the logs are in {logs}/"
exit "$status"
"""
