"""``heterorl bench peers``: heterorl beside TRL's GRPOTrainer on one task, matched setting by setting.

Four systems train the same base model on 3-digit addition (heterorl/configs/add3_rl.yaml): heterorl's
one-process sync loop (`heterorl rl`), its async runtime with 1 and with 2 rollout workers (`heterorl train`), and
TRL's `GRPOTrainer` (transformers' `generate`, no vLLM). Matched: the prompts (the sync loop's problems in its
order, token ids rendered by heterorl's `encode_prompt`), the reward (heterorl's scoring), prompts per step, group
size, completion length, temperature, the GRPO loss (TRL's loss_type="grpo", no KL, one optimizer step per batch,
group-normalised advantages), AdamW's lr, betas, eps and weight decay at a constant lr, gradient clipping,
float32, the seed and the torch threads. What TRL does its own way is printed under the table (docs/FROM_TRL.md,
"Side by side with TRL").

Each system runs in a fresh process. s/step is the mean over the steps after the first (the async runtime's last
step, which holds its final evaluation, left out), split into generation (sampling and scoring a batch; for the
async runtime: the learner's wait for rollouts, the sampling it could not hide) and training (the rest of the
step). Peak RSS: the process's (the async runtime: the sum of its processes' peaks). Held-out accuracy: greedy,
on the task's eval set, every system's final weights through the same `evaluate`. SmolLM2 scores nothing on this
task as shipped, so it trains on a partial-credit reward (`answer_prefix`); its accuracy is still exact match.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from heterorl.bench.async_modes import QUIET, _measured_steps
from heterorl.config import Config, load_config, packaged
from heterorl.runs import read_metrics

SYSTEMS = {"rl": "heterorl rl (sync, 1 process)", "async1": "heterorl train, 1 worker",
           "async2": "heterorl train, 2 workers", "trl": "TRL GRPOTrainer"}
MODELS = {"add3": "add3-sft-base", "smollm2": "smollm2"}
REWARD_FN = "heterorl.bench.peers:answer_prefix"  # (by its import path: `python -m` runs this module as __main__)
INSTALL_HINT = "TRL is not installed: `make peers` (or `pip install -e '.[peers]'`) adds it"
# what TRL does its own way, whatever the options (printed under every table)
UNMATCHED = (
    "TRL samples with transformers' generate and its own RNG stream: the same prompts, not the same completions",
    "TRL's advantage divides by std + 1e-4, heterorl's by std + 1e-6 (equal unless a group's std is tiny)",
    "TRL's ratio is exactly 1 (old log-probs = the detached new ones); heterorl's is against the sampler's "
    "log-probs (the same weights in float32: 1 within ~1e-5)",
    "TRL computes each token's entropy in the training forward (for its logs), heterorl does not",
    "heterorl skips a batch in which every group scored alike (no signal); TRL trains on it (a zero-advantage step)",
    "the async runtime's workers draw their own problems (the same task, not the same sequence) and train up to "
    "runtime.max_staleness_steps behind; it places its processes on the cores itself (runtime.threads per process)",
)


def answer_prefix(prompt: str, completion: str, answer: str) -> float:
    """1 for the exact answer (the add3 task's reward), else half the share of the answer's digits the completion
    starts with: SmolLM2 never answers a bare ``123+456=`` exactly, and a reward that is 0 everywhere trains
    nothing (heterorl skips such a batch). The prefix of ``"57 apples"`` for 579 is 2 digits: 0.5 · 2/3."""
    if completion == answer:
        return 1.0
    same = 0
    for got, want in zip(completion, answer):
        if got != want:
            break
        same += 1
    return 0.5 * same / len(answer)


@dataclasses.dataclass(frozen=True)
class Setting:
    """What one side-by-side run uses, the same for every system."""

    model: str  # a key of MODELS
    steps: int
    prompts: int
    group_size: int
    max_tokens: int
    threads: int
    eval_size: int
    seed: int = 0
    activation_checkpointing: bool = False


def heterorl_config(setting: Setting, run_dir: Path, overrides: tuple[str, ...] = ()) -> Config:
    """The add3 config with the setting applied: GRPO, constant lr (no warm-up: the schedules' warm-ups differ by
    a step), one optimizer step per batch, evaluation only at the start and the end."""
    smollm2 = setting.model == "smollm2"
    return load_config(str(packaged("add3_rl.yaml")), [
        f"rl.base={MODELS[setting.model]}", f"seed={setting.seed}", f"rl.steps={setting.steps}",
        f"rl.prompts_per_step={setting.prompts}", f"rollout.group_size={setting.group_size}",
        f"rollout.max_tokens={setting.max_tokens}", f"task.options.eval_size={setting.eval_size}",
        "loss.name=grpo", "rl.updates_per_batch=1", "optim.warmup_steps=0", "optim.schedule=constant",
        f"policy.activation_checkpointing={str(setting.activation_checkpointing).lower()}",
        f"rl.eval_every={10 * setting.steps}", f"logging.run_dir={run_dir}", *QUIET,
        *([f"task.reward_fn={REWARD_FN}"] if smollm2 else []), *overrides])


def trl_config(cfg: Config, output_dir: Path, **more):
    """TRL's `GRPOConfig` matching ``cfg`` (docs/FROM_TRL.md's table): one generation batch of
    prompts_per_step × group_size completions per optimizer step, used once; ValueError for a setting TRL cannot
    take as heterorl means it."""
    from trl import GRPOConfig

    from heterorl.training.session import resolve_loss

    if cfg.loss.name != "grpo":
        raise ValueError(f"loss.name={cfg.loss.name!r}: the bench matches GRPO (TRL's loss_type='grpo')")
    if cfg.optim.warmup_steps or cfg.optim.schedule != "constant":
        raise ValueError("the bench matches a constant lr without warm-up (transformers' warm-up starts a step "
                         "later than heterorl's): optim.warmup_steps=0 optim.schedule=constant")
    if cfg.rl.updates_per_batch != 1:
        raise ValueError("rl.updates_per_batch must be 1 (one optimizer step per generation batch)")
    _, loss = resolve_loss(cfg.loss.name, cfg.loss.resolved_options())
    scale = {"group_normalized": "group", "group_centered": "none"}.get(loss.advantage)
    if scale is None:
        raise ValueError(f"loss advantage {loss.advantage!r} has no TRL scale_rewards")
    batch = cfg.rl.prompts_per_step * cfg.rollout.group_size
    return GRPOConfig(
        output_dir=str(output_dir), seed=cfg.seed, max_steps=cfg.rl.steps,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=cfg.rollout.group_size, max_completion_length=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        loss_type="grpo", beta=0.0, scale_rewards=scale, epsilon=loss.clip_eps,
        epsilon_high=loss.clip_eps_high if loss.clip_eps_high is not None else loss.clip_eps,
        mask_truncated_completions=False,
        learning_rate=cfg.optim.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=cfg.optim.beta1, adam_beta2=cfg.optim.beta2, adam_epsilon=1e-8,
        weight_decay=cfg.optim.weight_decay, max_grad_norm=cfg.optim.grad_clip_norm,
        gradient_checkpointing=cfg.policy.activation_checkpointing, bf16=False, fp16=False, use_cpu=True,
        shuffle_dataset=False, remove_unused_columns=False, dataloader_num_workers=0,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True, log_completions=False, **more)


def _accuracy(sampler, cfg: Config) -> float:
    """Held-out greedy exact-match success of ``sampler``'s weights on the task's eval set (the task's own
    reward, whatever reward the run trained on): the sync loop's `evaluate`, for every system."""
    from heterorl.rollout.episodes import EpisodeLimits
    from heterorl.tasks import make_task_from
    from heterorl.training.evaluation import evaluate

    task = make_task_from(dataclasses.replace(cfg.task, reward_fn=None, reward_weights=None))
    limits = EpisodeLimits.for_sampler(cfg.rollout, sampler)
    return evaluate(sampler, task, task.eval_problems(), cfg.rl.eval_max_tokens or cfg.rollout.max_tokens,
                    chat_template=cfg.task.chat_template, limits=limits).success


def _peak_rss_kb(pid: int | str = "self") -> int | None:
    """A process's peak RSS (``VmHWM``), None once it is gone. Not ``ru_maxrss``: Linux carries that over fork
    and exec, so a child started by a large parent would report the parent's peak."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), None)


def _peak_rss_mb() -> float:
    return (_peak_rss_kb() or 0) / 1024


def summarize(step_s: list[float], generation_s: list[float], completion_tokens: list[float]) -> dict:
    """s/step, its generation and training parts and completion tokens/s over the steps after the first (all of
    them when there is one)."""
    window = slice(1, None) if len(step_s) > 1 else slice(None)
    steps, generation, tokens = step_s[window], generation_s[window], completion_tokens[window]
    mean = sum(steps) / len(steps)
    gen = sum(generation) / len(generation)
    return {"step_s": mean, "generation_s": gen, "training_s": mean - gen, "tokens_per_s": sum(tokens) / sum(steps),
            "steps_measured": len(steps)}


def run_trl(cfg: Config) -> dict:
    """TRL's GRPOTrainer on ``cfg``'s task and base, in this process; the run's numbers and final accuracy."""
    import random

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from heterorl.engines.base import SampleOutput
    from heterorl.policies import load_policy
    from heterorl.rollout.textcodec import encode_prompt
    from heterorl.tasks import make_task_from
    from heterorl.tasks.rewards import score_all
    from heterorl.training.session import SamplingClient

    task = make_task_from(cfg.task)
    model, tokenizer = load_policy(cfg.rl.base, alphabet=task.alphabet())
    rng = random.Random(cfg.seed)  # the sync loop's draws, in its order
    problems = [task.sample_train(rng) for _ in range(cfg.rl.steps * cfg.rl.prompts_per_step)]
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "problem": list(range(len(problems)))})
    declared = model.generation_config.eos_token_id  # (an int, a list or None)
    eos = {tokenizer.eos_token_id, *(declared if isinstance(declared, list) else [declared])} - {None}

    def reward(prompts, completions, completion_ids, problem, **_):
        """heterorl's scoring of each completion, from its token ids as heterorl's engine reports a sample."""
        samples = [SampleOutput(tokens=list(ids), logprobs=[], stop_reason="eos" if ids and ids[-1] in eos
                                else "length", text=tokenizer.decode(ids, skip_special_tokens=True))
                   for ids in completion_ids]
        return score_all(task, [problems[i] for i in problem], samples)

    generation_s, completion_tokens, step_ends = [], [], []

    class Trainer(GRPOTrainer):
        def _tokenize_prompts(self, prompts):  # heterorl's prompt rendering, token for token
            return [encode_prompt(self._tokenizer, p, cfg.task.chat_template) for p in prompts], None, {}

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            generation_s.append(time.perf_counter() - start)
            completion_tokens.append(float(out["completion_mask"].sum()))
            return out

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory(prefix="heterorl-peers-trl-") as out:
        trainer = Trainer(model=model, reward_funcs=reward, args=trl_config(cfg, Path(out)), train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepClock()])
        trainer.train()
    step_s = [b - a for a, b in zip(step_ends, step_ends[1:])]
    peak = _peak_rss_mb()
    trained = trainer.model.eval()
    return {**summarize(step_s, generation_s, completion_tokens), "peak_rss_mb": peak, "updates": len(step_s),
            "accuracy": _accuracy(SamplingClient.for_model(trained, tokenizer), cfg)}


def run_sync(cfg: Config) -> dict:
    """heterorl's one-process sync loop (`heterorl rl`) on ``cfg``, in this process, its sampling timed."""
    import heterorl.loops.sync_rl as sync_rl
    from heterorl.runs import setup_run

    generation_s = []
    sample = sync_rl.rollout_datums

    def timed(*args, **kwargs):  # (the loop calls its module's rollout_datums each step: timed here, only here)
        start = time.perf_counter()
        out = sample(*args, **kwargs)
        generation_s.append(time.perf_counter() - start)
        return out

    task, training, logger, run_dir = setup_run(cfg, "rl", cfg.rl.base)
    sync_rl.rollout_datums = timed
    try:
        sync_rl.run_sync_rl(cfg, training, task, logger)
    finally:
        sync_rl.rollout_datums = sample
        logger.close()
    peak = _peak_rss_mb()
    records = read_metrics(run_dir / "metrics.jsonl")
    times = [r["time_s"] for r in records]
    steps = [r for r in records if r.get("step", 0) > 0]
    per_step = cfg.rl.prompts_per_step * cfg.rollout.group_size
    return {**summarize([b - a for a, b in zip(times, times[1:])], generation_s,
                        [r["rollout/completion_len"] * per_step for r in steps]),
            "peak_rss_mb": peak, "updates": int(sum(r.get("optim/updates", 0) for r in steps)),
            "accuracy": _accuracy(training.save_weights_and_get_sampling_client(), cfg)}


class DescendantPeaks:
    """The peak RSS (VmHWM) of every descendant of this process, read from /proc every ``every_s`` while the block
    runs (the async runtime's learner and workers are processes of their own)."""

    def __init__(self, every_s: float = 0.2) -> None:
        self.every_s, self.peaks_kb = every_s, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> DescendantPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def total_mb(self) -> float:
        return sum(self.peaks_kb.values()) / 1024

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            self.read()

    def read(self) -> None:
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        mine, frontier = set(), {os.getpid()}
        while frontier:
            frontier = {pid for pid, parent in parents.items() if parent in frontier} - mine
            mine |= frontier
        for pid in mine:
            peak = _peak_rss_kb(pid)
            if peak is not None:
                self.peaks_kb[pid] = max(self.peaks_kb.get(pid, 0), peak)


def run_async(cfg: Config) -> dict:
    """heterorl's async runtime (`heterorl train`: a learner and ``runtime.workers`` rollout workers) on ``cfg``;
    the learner's records give the steps."""
    from heterorl.policies import load_policy
    from heterorl.runtime.launch import train
    from heterorl.training.session import SamplingClient

    with DescendantPeaks() as peaks:
        train(cfg)
    run_dir = Path(cfg.logging.run_dir)
    records = _measured_steps(run_dir)  # the last step holds the final evaluation: left out
    times = [r["time_s"] for r in records]
    per_step = cfg.rl.prompts_per_step * cfg.rollout.group_size
    rest = records[1:]
    model, tokenizer = load_policy(str(run_dir / "policy"))
    return {"step_s": (times[-1] - times[0]) / len(rest),
            "generation_s": sum(r["learner/wait_s"] for r in rest) / len(rest),
            "training_s": sum(r["learner/train_s"] for r in rest) / len(rest),
            "tokens_per_s": sum(r["rollout/completion_len"] * per_step for r in rest) / (times[-1] - times[0]),
            "steps_measured": len(rest), "peak_rss_mb": peaks.total_mb() + _peak_rss_mb(),
            "processes": len(peaks.peaks_kb),
            "updates": int(sum(r.get("optim/updates", 0) for r in read_metrics(run_dir / "metrics.jsonl"))),
            "accuracy": _accuracy(SamplingClient.for_model(model.eval(), tokenizer), cfg)}


def run_one(system: str, setting: Setting, run_dir: Path) -> dict:
    """One system's run in this process (`main` gives each its own): torch's threads set, the numbers back."""
    import torch

    torch.set_num_threads(setting.threads)
    if system == "trl":
        return run_trl(heterorl_config(setting, run_dir))
    if system == "rl":
        return run_sync(heterorl_config(setting, run_dir))
    workers = int(system.removeprefix("async"))
    return run_async(heterorl_config(setting, run_dir, ("runtime.mode=async", f"runtime.workers={workers}",
                                                        "logging.save_policy=true")))


def _spawn(system: str, setting: Setting, run_dir: Path) -> dict:
    """``system``'s run in a fresh process (its peak RSS its own); its result, or its error's tail."""
    argv = [sys.executable, "-m", "heterorl.bench.peers", "--_one", system, json.dumps(dataclasses.asdict(setting)),
            str(run_dir)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": (done.stdout[-1500:] + done.stderr[-2500:]).strip()}
    return json.loads(lines[-1])


def _row(name: str, r: dict, trl: dict | None) -> str:
    if "error" in r:
        return f"  {name:<30} failed"
    ratios = ""
    if trl is not None and "error" not in trl and name != SYSTEMS["trl"]:
        ratios = f" {r['step_s'] / trl['step_s']:>7.2f}x {r['peak_rss_mb'] / trl['peak_rss_mb']:>7.2f}x"
    return (f"  {name:<30} {r['step_s']:>7.2f} {r['generation_s']:>7.2f} {r['training_s']:>7.2f} "
            f"{r['tokens_per_s']:>8.0f} {r['peak_rss_mb']:>8,.0f} {r['accuracy']:>8.3f} {r['updates']:>7d}{ratios}")


def print_table(setting: Setting, results: dict) -> None:
    trl = results.get("trl")
    print(f"\n{setting.model} ({MODELS[setting.model]}): {setting.steps} steps of {setting.prompts} prompts x "
          f"{setting.group_size}, {setting.max_tokens} tokens"
          + (" (reward: answer_prefix)" if setting.model == "smollm2" else ""))
    print(f"  {'system':<30} {'s/step':>7} {'gen s':>7} {'train s':>7} {'tok/s':>8} {'RSS MB':>8} {'held-out':>8} "
          f"{'updates':>7}" + (f" {'step':>8} {'RSS':>8}" if trl else ""))
    for system, r in results.items():
        print(_row(SYSTEMS[system], r, trl))
    for system, r in results.items():
        if "error" in r:
            print(f"  {SYSTEMS[system]} failed:\n" + "\n".join(f"    {line}" for line in r["error"].splitlines()[-25:]))
    if trl:
        print("  step, RSS: heterorl / TRL (< 1: heterorl faster, smaller). async: gen s = the learner's wait for "
              "rollouts; RSS = all its processes")


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be >= {minimum}")
        return value
    return parse


def _names(allowed):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of {', '.join(allowed)}")
        return names
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="heterorl bench peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=_names(MODELS), default=list(MODELS), help="add3,smollm2 (default both)")
    parser.add_argument("--systems", type=_names(SYSTEMS), default=list(SYSTEMS),
                        help="rl,async1,async2,trl (default all)")
    parser.add_argument("--steps", type=_at_least(3), default=8, help="optimizer steps on add3-sft-base")
    parser.add_argument("--smollm2-steps", type=_at_least(3), default=4, help="optimizer steps on SmolLM2")
    parser.add_argument("--prompts", type=_at_least(1), default=8, help="prompts per step")
    parser.add_argument("--group-size", type=_at_least(2), default=8, help="completions per prompt (>= 2: GRPO)")
    parser.add_argument("--max-tokens", type=_at_least(1), default=8, help="completion tokens at most")
    parser.add_argument("--eval-size", type=_at_least(1), default=256, help="held-out problems")
    parser.add_argument("--threads", type=_at_least(1), default=2, help="torch threads of each system's process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="on in both (TRL's gradient_checkpointing, heterorl's policy.activation_checkpointing)")
    parser.add_argument("--_one", nargs=3, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._one:
        system, setting, run_dir = args._one
        print(json.dumps(run_one(system, Setting(**json.loads(setting)), Path(run_dir))))
        return 0
    if "trl" in args.systems:
        try:
            import trl  # noqa: F401
        except ImportError:
            print(INSTALL_HINT)
            return 2
    settings = []
    for model in args.models:
        if model == "smollm2":
            from heterorl.errors import PolicyLoadError
            from heterorl.policies.smollm2 import smollm2_folder

            try:
                smollm2_folder()
            except PolicyLoadError as exc:
                print(f"smollm2: skipped ({exc})")
                continue
        settings.append(Setting(model, args.smollm2_steps if model == "smollm2" else args.steps, args.prompts,
                                args.group_size, args.max_tokens, args.threads, args.eval_size, args.seed,
                                args.activation_checkpointing))
    print(f"heterorl bench peers: {args.prompts} prompts x {args.group_size} completions per step, "
          f"{args.max_tokens} tokens, GRPO (TRL loss_type=grpo, beta 0), lr 1e-4 constant, float32, seed "
          f"{args.seed}, {args.threads} torch threads per process, activation checkpointing "
          f"{'on' if args.activation_checkpointing else 'off'}, {args.eval_size} held-out problems (greedy)")
    with tempfile.TemporaryDirectory(prefix="heterorl-bench-peers-") as tmp:
        for setting in settings:
            results = {system: _spawn(system, setting, Path(tmp) / f"{setting.model}-{system}")
                       for system in args.systems}
            print_table(setting, results)
    print("\nnot matched (TRL's own way; docs/FROM_TRL.md):")
    for line in UNMATCHED:
        print(f"  - {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
