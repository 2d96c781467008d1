"""The synchronous GRPO-style loop, written over the session primitives (cookbook style).

Each step: sample G completions for P prompts with the current weights, score
them with the task's reward, run ``forward_backward`` + ``optim_step`` on
``updates_per_batch`` minibatches of whole groups (the loss estimates the
advantages from the rewards, with ``loss.advantage``), publish the new weights.
On-policy up to the minibatch split.
"""

from __future__ import annotations

import random
from collections import Counter

import torch

from heterorl.config import Config
from heterorl.engines.base import SamplingParams
from heterorl.loops.checkpoints import LoopCheckpoints, StopRequest, elapsed_clock
from heterorl.rollout.episodes import EpisodeLimits, rollout_groups
from heterorl.rollout.spans import policy_token_weights, turn_metrics
from heterorl.runs import RunResult, StepRecorder
from heterorl.tasks.base import Task
from heterorl.tasks.rewards import outcome_counts, outcomes_kind, score_all
from heterorl.training.evaluation import evaluate
from heterorl.training.session import Datum, TrainingClient
from heterorl.training.step import group_rows, has_signal, optimize_batch


def rollout_datums(sampler, task: Task, problems, cfg: Config, seed: int) -> tuple[list[Datum], dict]:
    """Sample a group per problem, score it, and turn it into datums with rewards and group ids."""
    params = SamplingParams(max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, seed=seed)
    prompts, groups = rollout_groups(sampler, task, problems, cfg.rollout.group_size, params,
                                     chat_template=cfg.task.chat_template,
                                     limits=EpisodeLimits.for_sampler(cfg.rollout, sampler))
    flat = [(gid, problem, prompt, s) for gid, (problem, prompt, group) in enumerate(zip(problems, prompts, groups))
            for s in group]
    scores = score_all(task, [problem for _, problem, _, _ in flat], [s for *_, s in flat])
    rows = [(gid, prompt, s, r) for (gid, _, prompt, s), r in zip(flat, scores)]
    rewards = torch.tensor([r for *_, r in rows])
    datums = [
        Datum(tokens=prompt + s.tokens, prompt_len=len(prompt), reward=r, group_id=gid,
              behaviour_logprobs=s.logprobs, policy_versions=[sampler.version] * len(s.tokens),
              weights=policy_token_weights(s.env_spans, len(s.tokens)))
        for gid, prompt, s, r in rows if s.tokens
    ]
    lengths = torch.tensor([len(s.tokens) for _, _, s, _ in rows], dtype=torch.float)
    stats = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()),
        "rollout/completion_len": float(lengths.mean()),
        "rollout/truncated_frac": sum(s.stop_reason == "length" for _, _, s, _ in rows) / len(rows),
        "rollout/mixed_groups_frac": sum(has_signal([g]) for g in group_rows(datums)) / len(problems),
        **turn_metrics((s.env_spans, len(s.tokens)) for _, _, s, _ in rows),
    }
    return datums, stats


def run_sync_rl(cfg: Config, training: TrainingClient, task: Task, logger=None, progress=None, *,
                checkpoints: LoopCheckpoints | None = None, stop: StopRequest | None = None) -> RunResult:
    """Train ``training``'s policy on ``task`` for ``cfg.rl.steps`` steps; evaluate every ``cfg.rl.eval_every``.
    With ``checkpoints``: checkpointed as they say, and resumed from the latest when they were made to resume
    (the steps after it are the same as an uninterrupted run's). With ``stop``: a request ends the loop after the
    step in progress, with a checkpoint; the result's ``stopped_by`` says who asked."""
    state = checkpoints.resume(training) if checkpoints is not None else None
    record = state.record if state is not None else {}
    rng = state.problem_rng() if state is not None else random.Random(cfg.seed)
    eval_problems = task.eval_problems()
    eval_tokens = cfg.rl.eval_max_tokens or cfg.rollout.max_tokens
    elapsed = elapsed_clock(record)
    if state is not None:  # the checkpoint's weights were sampled as its version: the next sampler holds them again
        training.version -= 1
    sampler = training.save_weights_and_get_sampling_client()
    limits = EpisodeLimits.for_sampler(cfg.rollout, sampler)
    recorder = StepRecorder(cfg, lambda: evaluate(sampler, task, eval_problems, eval_tokens,
                                                  chat_template=cfg.task.chat_template, limits=limits),
                            logger, progress, history=record.get("history"),
                            steps_without_update=record.get("steps_without_update", 0))
    recorder.start()
    total_updates = cfg.rl.steps * cfg.rl.updates_per_batch
    # the programs the training rewards ran, by outcome (evaluation's left out)
    outcomes = Counter(record.get("reward_outcomes", {}))
    kind = outcomes_kind(task)  # the middle of the outcomes' metric names: programs, episodes, scoring
    step = state.step if state is not None else 0
    while step < cfg.rl.steps and not (stop is not None and stop.by):
        step += 1
        problems = [task.sample_train(rng) for _ in range(cfg.rl.prompts_per_step)]
        before = outcome_counts(task)
        datums, metrics = rollout_datums(sampler, task, problems, cfg, seed=cfg.seed * 100_003 + step)
        ran = outcome_counts(task) - before
        outcomes.update(ran)
        metrics.update({f"rollout/{kind}/{reason}": count for reason, count in ran.items()})
        metrics.update(optimize_batch(training, datums, cfg, total_updates))
        sampler = training.save_weights_and_get_sampling_client()  # (the recorder evaluates the newest)
        metrics["policy/version"] = sampler.version
        recorder.record(step, metrics, elapsed())
        if checkpoints is not None and (checkpoints.due(step, cfg.rl.steps) or (stop is not None and stop.by)):
            checkpoints.save(training, step, rng, {
                "history": recorder.history, "steps_without_update": recorder.steps_without_update,
                "reward_outcomes": dict(outcomes), "elapsed_s": elapsed()})
    return recorder.result(steps=step, minutes=elapsed() / 60, reward_outcomes=dict(sorted(outcomes.items())),
                           stopped_by=(stop.by if stop is not None and step < cfg.rl.steps else None))
