"""The synchronous GRPO-style loop, written over the session primitives (cookbook style).

Each step: sample G completions for P prompts with the current weights, score
them with the task's reward, run ``forward_backward`` + ``optim_step`` on
``updates_per_batch`` minibatches of whole groups (the loss estimates the
advantages from the rewards, with ``loss.advantage``), publish the new weights.
On-policy up to the minibatch split.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from heterorl.config import Config, loss_options
from heterorl.engines.base import SamplingParams
from heterorl.evaluation import evaluate
from heterorl.schedule import learning_rate
from heterorl.session import AdamParams, Datum, TrainingClient
from heterorl.tasks.base import Task
from heterorl.textcodec import encode


@dataclass
class RLResult:
    base_success: float
    final_success: float
    best_success: float
    steps: int
    minutes: float
    steps_without_update: int = 0  # steps whose every minibatch was skipped (see optimize_batch)
    history: list[dict] = field(default_factory=list)  # {"step", "eval/success", ...}


def rollout_datums(sampler, task: Task, problems, cfg: Config, seed: int) -> tuple[list[Datum], dict]:
    """Sample a group per problem, score it, and turn it into datums with rewards and group ids."""
    tokenizer = sampler.tokenizer
    prompts = [encode(tokenizer, p.prompt, "prompt") for p in problems]
    params = SamplingParams(max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, seed=seed)
    groups = sampler.sample(prompts, cfg.rollout.group_size, params).result()
    rows = [(gid, prompt, s, task.reward(problem, s.text))
            for gid, (problem, prompt, group) in enumerate(zip(problems, prompts, groups)) for s in group]
    rewards = torch.tensor([r for *_, r in rows])
    datums = [
        Datum(tokens=prompt + s.tokens, prompt_len=len(prompt), reward=r, group_id=gid,
              behaviour_logprobs=s.logprobs, policy_versions=[sampler.version] * len(s.tokens))
        for gid, prompt, s, r in rows
    ]
    lengths = torch.tensor([len(s.tokens) for _, _, s, _ in rows], dtype=torch.float)
    stats = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()),
        "rollout/completion_len": float(lengths.mean()),
        "rollout/truncated_frac": sum(s.stop_reason == "length" for _, _, s, _ in rows) / len(rows),
        "rollout/mixed_groups_frac": sum(has_signal([g]) for g in group_rows(datums)) / len(problems),
    }
    return datums, stats


def group_rows(datums: list[Datum]) -> list[list[Datum]]:
    """The datums of each group, in order of first appearance."""
    groups: dict[int, list[Datum]] = {}
    for d in datums:
        groups.setdefault(d.group_id, []).append(d)
    return list(groups.values())


def has_signal(groups: list[list[Datum]]) -> bool:
    """Whether some group's rewards differ: if none do, every group-relative advantage is 0."""
    return any(len({d.reward for d in group}) > 1 for group in groups)


def minibatches(datums: list[Datum], count: int) -> list[list[Datum]]:
    """Split into ``count`` minibatches of whole groups (groups are contiguous in ``datums``)."""
    ordered = group_rows(datums)
    size = max(1, -(-len(ordered) // count))
    return [[d for g in ordered[i:i + size] for d in g] for i in range(0, len(ordered), size)]


# ``optim/skip_reason`` of a step that ran no update (``optim/updates`` 0)
NO_SIGNAL = "no_signal"  # every group's completions scored alike: every group-relative advantage is 0
TOO_FEW_GROUPS = "too_few_groups"  # fewer groups with signal in each minibatch than learner ranks


def optimize_batch(training: TrainingClient, datums: list[Datum], cfg: Config, total_updates: int,
                   shard: tuple[int, int] = (0, 1)) -> dict:
    """``forward_backward`` + ``optim_step`` on ``cfg.rl.updates_per_batch`` minibatches of whole groups.

    A minibatch in which every group scored alike carries no learning signal and is skipped; with
    ``cfg.rl.drop_uniform_groups`` such groups are dropped from every minibatch first. Returns the
    metrics of the last update (the loss's diagnostics, ``optim/lr``, ``optim/grad_norm``) and
    ``optim/updates`` (how many updates ran). A step that ran no update has no loss, so it reports none of
    the loss's metrics (``loss/*``, ``is/*``, ``kl/*``) nor ``optim/lr``/``optim/grad_norm``: by design they
    are absent, not NaN, and ``optim/skip_reason`` says why (`NO_SIGNAL` or `TOO_FEW_GROUPS`).

    ``shard = (rank, world)``: under data parallelism every rank is given the whole batch, makes the same
    minibatch and skip decisions, and runs ``forward_backward`` on its share of each minibatch's groups
    (groups rank, rank + world, ...); the gradient all-reduce in ``optim_step`` averages the shares.
    """
    rank, world = shard
    metrics: dict = {"optim/updates": 0}
    reason = NO_SIGNAL
    if cfg.rl.drop_uniform_groups:
        datums = [d for group in group_rows(datums) if has_signal([group]) for d in group]
    for batch in minibatches(datums, cfg.rl.updates_per_batch):
        groups = group_rows(batch)
        if not has_signal(groups):
            continue  # (every rank decides alike, so no rank waits in an all-reduce the others skip)
        if len(groups) < world:
            reason = TOO_FEW_GROUPS
            continue
        if world > 1:
            batch = [d for g in groups[rank::world] for d in g]
        out = training.forward_backward(batch, cfg.loss.name, loss_options(cfg),
                                        temperature=cfg.rollout.temperature or 1.0).result()
        lr = learning_rate(training.step + 1, cfg.optim.lr, total_updates, cfg.optim.warmup_steps,
                           cfg.optim.schedule, cfg.optim.min_lr_ratio)
        optim = training.optim_step(AdamParams(
            learning_rate=lr, beta1=cfg.optim.beta1, beta2=cfg.optim.beta2,
            weight_decay=cfg.optim.weight_decay, grad_clip_norm=cfg.optim.grad_clip_norm)).result()
        metrics.update(out.metrics)
        metrics.update({"optim/lr": lr, "optim/grad_norm": optim.grad_norm})
        metrics["optim/updates"] += 1
    if not metrics["optim/updates"]:
        metrics["optim/skip_reason"] = reason
    return metrics


def run_sync_rl(cfg: Config, training: TrainingClient, task: Task, logger=None, progress=None) -> RLResult:
    """Train ``training``'s policy on ``task`` for ``cfg.rl.steps`` steps; evaluate every ``cfg.rl.eval_every``."""
    rng = random.Random(cfg.seed)
    eval_problems = task.eval_problems()
    eval_tokens = cfg.rl.eval_max_tokens or cfg.rollout.max_tokens
    start = time.time()
    sampler = training.save_weights_and_get_sampling_client()
    base = evaluate(sampler, task, eval_problems, eval_tokens).success
    history = [{"step": 0, "eval/success": base, "time_s": 0.0}]
    if logger:
        logger.log(0, {"eval/success": base})
    total_updates = cfg.rl.steps * cfg.rl.updates_per_batch
    without_update = 0
    for step in range(1, cfg.rl.steps + 1):
        problems = [task.sample_train(rng) for _ in range(cfg.rl.prompts_per_step)]
        datums, metrics = rollout_datums(sampler, task, problems, cfg, seed=cfg.seed * 100_003 + step)
        metrics.update(optimize_batch(training, datums, cfg, total_updates))
        without_update += not metrics["optim/updates"]
        sampler = training.save_weights_and_get_sampling_client()
        metrics["policy/version"] = sampler.version
        if step % cfg.rl.eval_every == 0 or step == cfg.rl.steps:
            metrics["eval/success"] = evaluate(sampler, task, eval_problems, eval_tokens).success
            history.append({"step": step, "eval/success": metrics["eval/success"], "time_s": time.time() - start})
        if logger:
            logger.log(step, metrics)
        if progress:
            progress(step, metrics)
    successes = [h["eval/success"] for h in history]
    return RLResult(base_success=base, final_success=successes[-1], best_success=max(successes),
                    steps=cfg.rl.steps, minutes=(time.time() - start) / 60, steps_without_update=without_update,
                    history=history)
