"""Supervised warm start: cross-entropy on a task's demonstrations, stopped by measured success.

``heterorl sft`` trains the tiny policy to a *deliberately partial* base (the
maze recipe stops once held-out greedy success reaches ``sft.stop_success``),
so that RL has room to show what it adds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from heterorl.config import Config
from heterorl.loops.checkpoints import LoopCheckpoints, StopRequest, elapsed_clock
from heterorl.rollout.episodes import EpisodeLimits, demonstration_episode
from heterorl.rollout.spans import policy_token_weights
from heterorl.rollout.textcodec import encode_prompt, encode_text
from heterorl.tasks.base import Task
from heterorl.tasks.environment import is_multi_turn
from heterorl.training.evaluation import evaluate
from heterorl.training.lr_schedule import learning_rate
from heterorl.training.session import AdamParams, Datum, TrainingClient


@dataclass
class SFTResult:
    success: float
    steps: int
    minutes: float
    history: list[dict] = field(default_factory=list)
    stopped_by: str | None = None  # the signal that stopped it before its last step (None: it ran to the end)


def demonstration_datums(task: Task, tokenizer, rng: random.Random, batch_size: int,
                         chat_template: bool = False) -> list[Datum]:
    """``batch_size`` fresh training problems with their demonstrations (+ EOS) as datums, the prompts encoded
    as everywhere else (`encode_prompt`); a multi-turn task's demonstrations are whole episodes
    (`demonstration_episode`)."""
    datums = []
    for _ in range(batch_size):
        problem = task.sample_train(rng)
        if is_multi_turn(task):  # the expert's turns are trained on, the environment's answers are not
            prompt, completion, spans, _ = demonstration_episode(task, problem, tokenizer, chat_template)
            datums.append(Datum(tokens=prompt + completion, prompt_len=len(prompt),
                                weights=policy_token_weights(spans, len(completion))))
            continue
        prompt = encode_prompt(tokenizer, problem.prompt, chat_template)
        completion = encode_text(tokenizer, task.demonstration(problem), "demonstration") + [tokenizer.eos_token_id]
        datums.append(Datum(tokens=prompt + completion, prompt_len=len(prompt)))
    return datums


def run_sft(cfg: Config, training: TrainingClient, task: Task, logger=None, progress=None, *,
            checkpoints: LoopCheckpoints | None = None, stop: StopRequest | None = None) -> SFTResult:
    """Train until ``cfg.sft.steps`` or until eval success ≥ ``cfg.sft.stop_success``. ``checkpoints`` and
    ``stop`` as in `run_sync_rl`: checkpointed, resumed, stopped after the step in progress."""
    state = checkpoints.resume(training) if checkpoints is not None else None
    record = state.record if state is not None else {}
    if state is None:
        torch.manual_seed(cfg.seed)  # (a resumed run's torch RNG is the checkpoint's)
    rng = state.problem_rng() if state is not None else random.Random(cfg.seed)
    eval_problems = task.eval_problems()
    elapsed = elapsed_clock(record)
    success, history = float(record.get("success", 0.0)), list(record.get("history", []))
    step = state.step if state is not None else 0
    stopped_early = False
    while step < cfg.sft.steps and not stopped_early and not (stop is not None and stop.by):
        step += 1
        datums = demonstration_datums(task, training.tokenizer, rng, cfg.sft.batch_size, cfg.task.chat_template)
        out = training.forward_backward(datums, "cross_entropy").result()
        lr = learning_rate(step, cfg.sft.lr, cfg.sft.steps, cfg.sft.warmup_steps, "constant")
        training.optim_step(AdamParams(learning_rate=lr, grad_clip_norm=cfg.optim.grad_clip_norm)).result()
        metrics = {"sft/loss": out.loss, "optim/lr": lr}
        if step % cfg.sft.eval_every == 0 or step == cfg.sft.steps:
            sampler = training.save_weights_and_get_sampling_client()
            result = evaluate(sampler, task, eval_problems, cfg.rollout.max_tokens,
                              chat_template=cfg.task.chat_template,
                              limits=EpisodeLimits.for_sampler(cfg.rollout, sampler))
            success = result.success
            metrics["eval/success"] = success
            metrics.update({f"eval/success/{group}": s for group, s in result.by_group.items()})
            history.append({"step": step, "eval/success": success, "time_s": elapsed()})
        if logger:
            logger.log(step, metrics)
        if progress:
            progress(step, metrics)
        stopped_early = (cfg.sft.stop_success is not None and "eval/success" in metrics
                         and success >= cfg.sft.stop_success)
        if checkpoints is not None and (checkpoints.due(step, cfg.sft.steps) or stopped_early
                                        or (stop is not None and stop.by)):
            checkpoints.save(training, step, rng, {"success": success, "history": history,
                                                   "elapsed_s": elapsed()})
    stopped_by = stop.by if stop is not None and step < cfg.sft.steps and not stopped_early else None
    return SFTResult(success=success, steps=step, minutes=elapsed() / 60, history=history, stopped_by=stopped_by)
