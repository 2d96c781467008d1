"""Run directories and what a run leaves in them: the metrics sinks (JSONL + wandb), plain-text tables,
plots, the set-up every training command shares (`setup_run`) and the files every finished run writes
(`finish_run`).

Metric names are grouped by '/', e.g. ``eval/success``, ``rollout/reward_mean``, ``loss/policy``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from heterorl.config import Config, to_dict, to_yaml
from heterorl.errors import ConfigError, TaskError
from heterorl.files import write_atomically

log = logging.getLogger("heterorl.runs")


def finite_or_null(value: Any) -> Any:
    """``value`` with every float that is not finite (inf, -inf, NaN), in lists and dicts too, replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def json_text(value: Any, **kwargs) -> str:
    """Standard JSON for ``value``: a number that is not finite is written as null (JSON has no Infinity or NaN,
    and strict parsers refuse them); what reads a run's files skips nulls as it skips absent metrics."""
    return json.dumps(finite_or_null(value), allow_nan=False, **kwargs)


class MetricsLogger:
    """Writes one JSON object per ``log`` call to ``run_dir/metrics.jsonl`` (standard JSON: `json_text`) and mirrors
    it to wandb."""

    def __init__(self, run_dir: str | Path, *, config: dict | None = None, name: str = "run",
                 wandb_project: str | None = None, wandb_mode: str = "offline", append: bool = False,
                 wandb_group: str | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a" if append else "w", encoding="utf-8")  # append: a resumed run
        self._start = time.time()
        self._wandb_run = None
        if wandb_mode != "disabled":
            self._wandb_run = self._init_wandb(config, name, wandb_project, wandb_mode, wandb_group)

    def _init_wandb(self, config, name, project, mode, group):
        import wandb

        if project is None:
            mode = "offline"  # no project given: never touch the network
        os.environ.setdefault("WANDB_SILENT", "true")
        return wandb.init(
            project=project or "heterorl", name=name, mode=mode, dir=str(self.run_dir), config=config or {},
            group=group,
            reinit="finish_previous", settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        record = {"step": step, "time_s": round(time.time() - self._start, 3), **clean}
        self._file.write(json_text(record) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            numeric = {k: v for k, v in clean.items() if isinstance(v, float) and math.isfinite(v)}
            self._wandb_run.log(numeric, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file; of a live run's, those written whole (a last line not yet ended
    by its newline is still being written, and is left out)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip() and line.endswith("\n")]



def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A fixed-width text table."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])])


def _fmt(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def plot_curves(curves: dict[str, list[tuple[float, float]]], path: str | Path, *, title: str,
                xlabel: str = "optimizer step", ylabel: str = "held-out greedy success") -> Path:
    """Save a line plot of ``{label: [(x, y), ...]}`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for label, points in curves.items():
        xs, ys = zip(*points) if points else ((), ())
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel, ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def run_header(cfg: Config, command: str, config: str | Path | None) -> str:
    """A run's first line: the command, the task, what it starts from, the loss, how it runs (and the injected
    delay), and the config it read."""
    source = f"config {config}" if config is not None else "the built-in defaults"
    if command == "sft":
        return (f"heterorl sft: task {cfg.task.name}, policy {cfg.policy.model}, {cfg.sft.steps} steps of "
                f"{cfg.sft.batch_size} demonstrations, saved to {cfg.sft.output} ({source})")
    shape = f"{cfg.rl.steps} steps x {cfg.rl.prompts_per_step} prompts x {cfg.rollout.group_size}"
    if command == "rl":
        how = "synchronous in one process, no delay (`heterorl train --mode sync`: the same with workers)"
    elif cfg.runtime.execution == "simulated":
        how = (f"{cfg.runtime.mode}, {cfg.runtime.workers} workers simulated on a virtual clock, delay "
               f"{cfg.delay.describe()}")
    else:
        workers = f"{cfg.runtime.workers} worker{'s' if cfg.runtime.workers != 1 else ''}"
        how = f"{cfg.runtime.mode}, {workers}, delay {cfg.delay.describe()}"
    return (f"heterorl {command}: task {cfg.task.name}, base {cfg.rl.base or cfg.policy.model}, loss {cfg.loss.name}, "
            f"{shape}; {how} ({source})")


# each task's shipped SFT base (heterorl/assets/NAME/sft_summary.json says how many steps its recipe took)
SHIPPED_BASES = {"maze": "maze-sft-base", "arithmetic": "add3-sft-base", "reasoning_gym": "rg-arith-sft-base",
                 "maze_walk": "maze-walk-sft-base", "calculator": "calculator-sft-base"}
SFT_STEPS_DEFAULT = 1000  # the SFT steps suggested for a task without a shipped base (add3's took 1,000)
CHECKED_PROBLEMS = 8  # held-out problems whose text a base's tokenizer must read back


def _sft_steps(task_name: str) -> int:
    """The steps the SFT recipe of ``task_name``'s shipped base took (`SFT_STEPS_DEFAULT` without one)."""
    from heterorl.policies import shipped_policy

    try:
        summary = json.loads((shipped_policy(SHIPPED_BASES[task_name]) / "sft_summary.json").read_text())
        return int(summary["steps"])
    except (KeyError, OSError, ValueError, TypeError):
        return SFT_STEPS_DEFAULT


def check_base_reads_task(cfg: Config, task, tokenizer, policy: str) -> None:
    """ConfigError naming the fix when ``policy``'s tokenizer cannot represent the text of ``task`` (a base made
    for another task: the tiny policies' tokenizers hold their task's characters only): an SFT command for this
    task (with the steps its shipped base's recipe took), or ``rl.base=smollm2``."""
    for problem in task.eval_problems()[:CHECKED_PROBLEMS]:
        try:
            demonstration = task.demonstration(problem)
        except TaskError:  # a task without demonstrations (a verifiers or cookbook env): its prompts are checked
            demonstration = []
        for text in [problem.prompt, *(demonstration if isinstance(demonstration, list) else [demonstration])]:
            if not text.strip():
                continue
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if ids and tokenizer.decode(ids).strip() == text.strip():
                continue
            options = "".join(f" task.options.{k}={v if isinstance(v, str) else json.dumps(v, separators=(',', ':'))}"
                              for k, v in to_dict(cfg)["task"]["options"].items())
            name = cfg.task.name.replace(":", "_").replace(".", "_")
            raise ConfigError(
                f"the base policy {policy!r} cannot read task {cfg.task.name!r}: its tokenizer cannot represent "
                f"{text[:40]!r} (a tiny base's tokenizer holds its own task's characters only). Start from a base "
                f"that reads it: make one with `heterorl sft task.name={cfg.task.name}{options} "
                f"sft.steps={_sft_steps(cfg.task.name)} sft.output=runs/{name}-sft`, then rl.base=runs/{name}-sft; "
                "or rl.base=smollm2 (SmolLM2-135M-Instruct, whose tokenizer reads any text; slower on CPU)")


def setup_run(cfg: Config, name: str, policy: str, append: bool = False, data_parallel: bool = False):
    """Task, TrainingClient over ``policy``, metrics logger and run dir, as every training command needs; a
    ``policy`` that cannot read the task's text is refused with the fix (`check_base_reads_task`)."""
    from heterorl.policies import load_policy
    from heterorl.tasks import make_task_from
    from heterorl.training.session import TrainingClient

    task = make_task_from(cfg.task)
    model, tokenizer = load_policy(policy, alphabet=task.alphabet(), tiny=cfg.policy.tiny, device=cfg.policy.device)
    if policy != "tiny":  # (the tiny policy's tokenizer is made from this task's alphabet)
        check_base_reads_task(cfg, task, tokenizer, policy)
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    logger = MetricsLogger(run_dir, config=to_dict(cfg), name=name, wandb_project=cfg.logging.wandb_project,
                           wandb_mode=cfg.logging.wandb_mode, append=append, wandb_group=cfg.logging.wandb_group)
    training = TrainingClient(model, tokenizer, device=cfg.policy.device, seed=cfg.seed, data_parallel=data_parallel,
                              shard=data_parallel and cfg.runtime.learner_sharding == "fsdp", lora=cfg.lora,
                              tokens_per_microbatch=cfg.optim.tokens_per_microbatch,
                              activation_checkpointing=cfg.policy.activation_checkpointing,
                              train_dtype=cfg.policy.train_dtype)
    return task, training, logger, run_dir


def save_trained_policy(training, path: Path, adapter_path: Path) -> Path:
    """The trained policy as a plain Hugging Face folder at ``path`` (`save_policy`): the model, or with LoRA the
    base with the adapter merged, the adapter also alone at ``adapter_path`` (peft's format)."""
    from heterorl.policies import save_policy

    if training.lora is None:
        return save_policy(training.full_model, training.tokenizer, path)
    out = save_policy(training.frozen_copy(), training.tokenizer, path)
    training.model.save_pretrained(adapter_path)
    for file in Path(adapter_path).iterdir():
        file.chmod(0o644)  # (safetensors writes 0600, as in save_policy)
    return out


def finish_run(cfg: Config, task, training, run_dir: Path, result: RunResult, extra: dict, *, title: str,
               xlabel: str) -> Path:
    """What every finished RL run leaves in its run dir: the policy (unless logging.save_policy is off; a LoRA
    run's with its adapter merged, and the adapter alone in peft's format in ``adapter/``), the success plot
    (returned) and summary.json (the result's fields, the loss and ``extra``)."""
    if cfg.logging.save_policy:
        save_trained_policy(training, run_dir / "policy", run_dir / "adapter")
    plot = plot_curves({cfg.loss.name: [(h["step"], h["eval/success"]) for h in result.history]},
                       run_dir / "success.png", title=f"{task.name}: held-out greedy success ({title})", xlabel=xlabel)
    summary = {**result.__dict__, "loss": cfg.loss.name, **extra}
    (run_dir / "summary.json").write_text(json_text(summary, indent=2))
    return plot


@dataclass(kw_only=True)
class RunResult:
    """What an RL loop returns; `finish_run` writes it into summary.json."""

    base_success: float
    final_success: float
    best_success: float
    steps: int
    minutes: float
    steps_without_update: int = 0  # steps that ran no update (optim/updates 0; optim/skip_reason says why)
    history: list[dict] = field(default_factory=list)  # {"step", "eval/success", "time_s"}: step 0 is the base
    # the programs the training rewards ran, by outcome (the code task's sandbox: ok, wrong_answer, timeout,
    # forbidden:socket, ...); empty for tasks that run none
    reward_outcomes: dict[str, int] = field(default_factory=dict)
    stopped_by: str | None = None  # the signal that stopped the run before its last step (None: it ran to the end)


NOTHING_SOLVED = (
    "the starting policy solves none of the held-out problems (success 0.000 at step 0). If it was trained to solve "
    "them, its prompts are likely encoded unlike its training data (special tokens such as a BOS token: save the "
    "tokenizer the model was trained with, so its own rule adds them), or the reward does not accept its output "
    "format (the task's answer format, task.reward_fn), or rollout.max_tokens cuts its answers short")


class StepRecorder:
    """The end of a step, the same in every RL loop: evaluate every ``rl.eval_every`` steps and at the last,
    log the step's metrics, advance the progress bar, keep the eval history and count the steps that ran no
    update; at the end, the `RunResult`.

    ``evaluate()`` returns the held-out success of the current weights, a number or an `EvalResult` (whose
    success per group, a mixture's datasets, is logged as ``eval/success/GROUP`` and kept in the history).
    ``history`` and ``steps_without_update`` carry a resumed run's record on."""

    def __init__(self, cfg: Config, evaluate: Callable[[], Any], logger=None, progress=None, *,
                 history: list[dict] | None = None, steps_without_update: int = 0) -> None:
        self.eval_every, self.steps = cfg.rl.eval_every, cfg.rl.steps
        self.evaluate, self.logger, self.progress = evaluate, logger, progress
        self.history = history if history is not None else []
        self.steps_without_update = steps_without_update

    def start(self) -> None:
        """Evaluate and log the starting weights as step 0 (unless a resumed record has them)."""
        if not self.history:
            measured = self._measure()
            self.history.append({"step": 0, **measured, "time_s": 0.0})
            if measured["eval/success"] == 0:
                log.warning(NOTHING_SOLVED)
            if self.logger:
                self.logger.log(0, measured)

    def _measure(self) -> dict[str, float]:
        """``eval/success`` of the current weights, and ``eval/success/GROUP`` for each group when it has groups."""
        result = self.evaluate()
        if isinstance(result, (int, float)):
            return {"eval/success": float(result)}
        return {"eval/success": result.success, **{f"eval/success/{g}": s for g, s in result.by_group.items()}}

    def record(self, step: int, metrics: dict, time_s: float) -> None:
        """End step ``step``: ``metrics`` gains ``eval/success`` when it is an eval step; ``time_s`` is the run's
        time at its end (wall or virtual), kept with each eval."""
        self.steps_without_update += metrics.get("optim/updates", 1) == 0
        if step % self.eval_every == 0 or step == self.steps:
            measured = self._measure()
            metrics.update(measured)
            self.history.append({"step": step, **measured, "time_s": time_s})
        if self.logger:
            self.logger.log(step, metrics)
        if self.progress:
            self.progress(step, metrics)

    def result(self, cls: type[RunResult] = RunResult, *, steps: int, minutes: float, **fields) -> RunResult:
        successes = [h["eval/success"] for h in self.history]
        return cls(base_success=successes[0], final_success=successes[-1], best_success=max(successes), steps=steps,
                   minutes=minutes, steps_without_update=self.steps_without_update, history=self.history, **fields)


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop the records of the steps after ``step`` from the metrics file ``path`` (a learner or a sync loop
    resumed from the checkpoint of ``step`` logs them again), and a last line a killed run left half-written, by
    rewriting it atomically; a file with nothing to drop is left as it is."""
    if not path.is_file():
        return
    lines = path.read_bytes().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if line.endswith(b"\n") and isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
    if len(kept) == len(lines):
        return
    write_atomically(path, b"".join(kept))


def stopped_line(command: str, run_dir: Path, stopped_by: str, step: int, steps: int,
                 checkpoint_step: int | None, resume: str = "") -> str:
    """Where a run stopped by a signal stands and the command that goes on with it."""
    resume = resume or f"heterorl {command} --resume {run_dir}"
    if checkpoint_step is None:
        return (f"heterorl {command}: stopped by {stopped_by} at step {step} of {steps}, before its first "
                f"checkpoint: start it again (runtime.checkpoint_every sets how often it checkpoints)")
    return (f"heterorl {command}: stopped by {stopped_by} at step {step} of {steps}; its last checkpoint is step "
            f"{checkpoint_step} ({run_dir / 'checkpoints'}). To go on: {resume}")


def idle_fraction(idle_s: float, busy_s: float) -> float:
    """The share of time spent idle: idle / (busy + idle), 0 before anything ran."""
    return idle_s / (busy_s + idle_s) if busy_s + idle_s > 0 else 0.0


def outcomes_line(outcomes: dict[str, int]) -> str:
    """One line on the training rewards' outcomes (the programs the code task ran, a scoring library's calls), the
    most frequent first."""
    ranked = sorted(outcomes.items(), key=lambda item: (-item[1], item[0]))
    return (f"reward outcomes: {sum(outcomes.values())} (" + ", ".join(f"{name} {n}" for name, n in ranked)
            + ")")


def without_update_note(count: int) -> str:
    """The end of a run's "change:" line when some steps made no update (empty otherwise)."""
    return f"; {count} steps without an update (optim/skip_reason in the metrics says why)" if count else ""
