"""Held-out evaluation: greedy (or sampled) success rate of a policy on a task's eval set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from heterorl.engines.base import SamplingParams
from heterorl.tasks.base import Problem, Task
from heterorl.tasks.rewards import score_all
from heterorl.training.textcodec import encode_prompt


@dataclass
class EvalResult:
    success: float  # mean reward
    mean_length: float  # completion tokens
    truncated: float  # fraction that hit max_tokens


def evaluate(sampling_client, task: Task, problems: Sequence[Problem], max_tokens: int,
             temperature: float = 0.0, seed: int = 0, chat_template: bool = False) -> EvalResult:
    """Mean reward of one completion per problem (greedy by default)."""
    tokenizer = sampling_client.tokenizer
    prompts = [encode_prompt(tokenizer, p.prompt, chat_template) for p in problems]
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    groups = sampling_client.sample(prompts, 1, params).result()
    rewards = score_all(task, problems, [group[0] for group in groups])
    lengths, truncated = [], []
    for (sample,) in groups:
        lengths.append(len(sample.tokens))
        truncated.append(sample.stop_reason == "length")
    n = len(problems)
    return EvalResult(sum(rewards) / n, sum(lengths) / n, sum(truncated) / n)
