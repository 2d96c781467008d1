"""Held-out evaluation: greedy (or sampled) success rate of a policy on a task's eval set."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from heterorl.engines.base import SamplingParams
from heterorl.rollout.episodes import EpisodeLimits, rollout_groups
from heterorl.tasks.base import Problem, Task
from heterorl.tasks.rewards import score_all


@dataclass
class EvalResult:
    success: float  # mean reward
    mean_length: float  # completion tokens
    truncated: float  # fraction that hit max_tokens
    by_group: dict[str, float] = field(default_factory=dict)  # mean reward per group of a mixed task (`group_of`)


def group_of(task: Task):
    """The task's ``group_of(problem) -> str`` (a mixture's dataset), through a reward wrapper; None without one."""
    return getattr(task, "group_of", None) or getattr(getattr(task, "base", None), "group_of", None)


def evaluate(sampling_client, task: Task, problems: Sequence[Problem], max_tokens: int,
             temperature: float = 0.0, seed: int = 0, chat_template: bool = False,
             limits: EpisodeLimits | None = None) -> EvalResult:
    """Mean reward of one completion per problem (greedy by default), or of one episode per problem of a
    multi-turn task (within ``limits``; ``max_tokens`` per turn); for a task that groups its problems
    (`group_of`) into more than one group, the mean of each group too."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    _, groups = rollout_groups(sampling_client, task, problems, 1, params, chat_template=chat_template,
                               limits=limits)
    rewards = score_all(task, problems, [group[0] for group in groups])
    lengths, truncated = [], []
    for (sample,) in groups:
        lengths.append(len(sample.tokens))
        truncated.append(sample.stop_reason == "length")
    n = len(problems)
    by_group: dict[str, list[float]] = defaultdict(list)
    grouping = group_of(task)
    if grouping is not None:
        for problem, reward in zip(problems, rewards):
            by_group[grouping(problem)].append(reward)
    means = {name: sum(r) / len(r) for name, r in sorted(by_group.items())} if len(by_group) > 1 else {}
    return EvalResult(sum(rewards) / n, sum(lengths) / n, sum(truncated) / n, means)
