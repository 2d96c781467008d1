"""The environment contract: what a multi-turn task gives the episode runner.

An environment is one episode's state. The runner calls ``reset(problem)`` once, which returns the first
observation (the episode's prompt), then alternates: the policy writes a turn (until its end-of-sequence token, a
stop token or ``rollout.max_tokens``), ``step(action)`` answers with a `StepResult` (the observation appended to
the context, this turn's reward, whether the episode is over). The episode's reward is the sum of its turns'
rewards. A whole environment, 20 lines::

    class Guess(Environment):
        def reset(self, problem):
            self.secret, self.tries = int(problem.answer), 0
            return problem.prompt                      # "guess a number in 0..9\\n"

        def step(self, action):
            self.tries += 1
            guess = action.strip()
            if guess == str(self.secret):
                return StepResult("", reward=1.0, done=True)
            hint = "higher" if guess.isdigit() and int(guess) < self.secret else "lower"
            return StepResult(f"\\n{hint}\\n", done=self.tries == 4)

Observations are text (encoded with the policy's tokenizer) or a list of token ids (taken as they are). An
environment with ``takes_token_ids = True`` gets the policy's token ids as its action instead of their text. An
environment's calls may be slow (a tool, a remote service): the runner runs them in threads, bounded by
``rollout.env_step_timeout_s``, and other episodes go on meanwhile. An environment that holds something (a
process, a session) releases it in ``close``, which the runner calls once the episode has ended.

A multi-turn task (`EpisodeTask`) is a task — problems, a held-out set, an alphabet — whose
``environment(problem)`` makes a fresh environment for each episode, and whose ``demonstration(problem)`` is the
list of an expert's actions (the SFT loop plays them through an environment to get its observations).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Protocol, Union, runtime_checkable

from heterorl.tasks.base import Problem

Observation = Union[str, "list[int]"]


class EnvContractError(Exception):
    """An environment broke its contract (a malformed observation, reward or done flag): the episode ends with
    reward 0 and the reason is counted (``bad_observation``)."""


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` returns: the ``observation`` appended after the action (text or token ids; ignored once
    ``done``), this turn's ``reward`` (the episode's reward is the sum of its turns'), and ``done``."""

    observation: Observation = ""
    reward: float = 0.0
    done: bool = False


class Environment:
    """Base of an environment: override `reset` and `step` (see the module's docstring). Subclassing is optional;
    any object with these two methods will do."""

    takes_token_ids = False  # True: step gets the policy's token ids, not their text

    def reset(self, problem: Problem) -> Observation:
        raise NotImplementedError

    def step(self, action) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 (optional: most environments hold nothing)
        """Release what the episode holds (a tool's process, a session): called once its episode has ended,
        however it ended (done, a bound, a failure), within ``rollout.env_step_timeout_s``."""


@runtime_checkable
class EpisodeTask(Protocol):
    """A multi-turn task: a `heterorl.tasks.base.Task` whose episodes are played with an environment."""

    name: str

    def environment(self, problem: Problem) -> Environment:
        """A fresh environment for one episode of ``problem``."""

    def demonstration(self, problem: Problem) -> list[str]:
        """An expert's actions, one per turn, for SFT."""


def is_multi_turn(task) -> bool:
    """Whether ``task``'s rollouts are episodes played with an environment (it has ``environment``)."""
    return callable(getattr(task, "environment", None))


def checked_step(result) -> StepResult:
    """``step``'s return value as a `StepResult`: a `StepResult`, or a tuple ``(observation, reward, done)``.
    `EnvContractError` naming what is wrong otherwise."""
    if isinstance(result, tuple) and len(result) == 3:
        result = StepResult(*result)
    if not isinstance(result, StepResult):
        raise EnvContractError(f"step returned {type(result).__name__}; return a StepResult or a tuple "
                                "(observation, reward, done)")
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvContractError(f"step returned reward {reward!r:.60}; a finite number is expected")
    if not isinstance(result.done, bool):
        raise EnvContractError(f"step returned done={result.done!r:.60}; True or False is expected")
    check_observation(result.observation)
    return result


def check_observation(observation) -> Observation:
    """``observation`` when it is text or a list of ints; `EnvContractError` otherwise."""
    if isinstance(observation, str):
        return observation
    if isinstance(observation, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in observation):
        return observation
    raise EnvContractError(f"an observation must be text or a list of token ids, got {type(observation).__name__}")
