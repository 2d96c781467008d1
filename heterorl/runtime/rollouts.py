"""What every rollout path shares — a worker's loop and its strategies (heterorl/runtime/worker.py,
rollout_strategies.py) and the simulated execution (simulate.py): each worker's prompt shard, the sampling seeds,
the stamping of scored groups into trajectories, and the scoring thread that runs beside generation."""

from __future__ import annotations

import random
import secrets
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from heterorl.config import Config
from heterorl.engines.base import SamplingParams
from heterorl.tasks.rewards import score_all
from heterorl.transport.protocol import MIN_LOGPROB, Trajectory


def shard_rng(seed: int, worker_id: str) -> random.Random:
    """The worker's own prompt stream: seeded by (run seed, worker id), stable across runs and machines."""
    return random.Random(f"heterorl-shard/{seed}/{worker_id}")


def sampling_params(cfg: Config, worker_id: str, groups_sent: int) -> SamplingParams:
    """The rollout's sampling settings, seeded by (run seed, worker, groups sent so far): reproducible."""
    return SamplingParams(max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature,
                          top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                          seed=zlib.crc32(f"{cfg.seed}/{worker_id}/{groups_sent}".encode()))


def new_session() -> str:
    """A worker process's session token, drawn at start (48 random bits): the ids it stamps never repeat those of
    an earlier life of the same worker id, which the learner has trained or still remembers."""
    return secrets.token_hex(6)


def stamp_groups(task, worker_id: str, first_index: int, version: int, problems, prompts, groups,
                 start_wall: float, end_wall: float, min_logprob: float = MIN_LOGPROB, *,
                 session: str = "") -> list[list[Trajectory]]:
    """Score each sampled group and stamp its trajectories (ids, policy version per token, behaviour log-probs,
    timestamps). ``version`` stamps every token of a sample that names no per-token ``versions`` (a generation
    that took in-flight updates names them). Group ids are ``{worker_id}-{session}-{n}`` (``{worker_id}-{n}``
    without a session, as in the simulation, which has one life), n counting from ``first_index``; trajectory
    ids add ``-{j}``. Empty
    completions are left out (a group is as large as what remains). Behaviour log-probs are clipped to
    [``min_logprob``, 0]: the learner's floor (its contract) exists only to keep the loss finite, and no token a
    sampler draws lies below it but with odds of about e^-50, so clipping there changes nothing else."""
    stamped = []
    prefix = f"{worker_id}-{session}" if session else worker_id
    groups = [[sample for sample in group if sample.tokens] for group in groups]
    flat = [(problem, sample) for problem, group in zip(problems, groups) for sample in group]
    rewards = iter(score_all(task, [p for p, _ in flat], [s for _, s in flat]))  # (all at once: in parallel)
    for n, (problem, prompt, group) in enumerate(zip(problems, prompts, groups), start=first_index):
        group_id = f"{prefix}-{n}"
        stamped.append([Trajectory(
            trajectory_id=f"{group_id}-{j}", group_id=group_id, prompt_id=problem.problem_id[:128],
            sampler_id=worker_id, group_size=len(group),
            prompt_tokens=np.asarray(prompt, dtype=np.int32),
            completion_tokens=np.asarray(sample.tokens, dtype=np.int32),
            behaviour_logprobs=np.clip(np.asarray(sample.logprobs, dtype=np.float32), min_logprob, 0.0),
            policy_versions=(np.full(len(sample.tokens), version, dtype=np.int32) if sample.versions is None
                             else np.asarray(sample.versions, dtype=np.int32)),
            reward=next(rewards),
            generation_start=start_wall, generation_end=end_wall, stop_reason=sample.stop_reason,
            env_spans=sample.env_spans,
        ) for j, sample in enumerate(group)])
    return stamped


class Pipeline:
    """Jobs run one at a time on a thread of their own, in order: a batch's scoring and sending runs while the next
    batch is sampled, so rewards that take long (programs run in a sandbox) do not stall generation. `submit`
    waits only when ``max_pending`` jobs are already queued or running (the batch loop: 1, so at most one batch
    waits to be scored; a streaming worker: as many as the groups it keeps in flight); a job's error comes back at
    the next `submit`, `check` or `drain`."""

    def __init__(self, max_pending: int = 1) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heterorl-scoring")
        self._pending: deque[Future] = deque()
        self.max_pending = max_pending

    def submit(self, job: Callable[[], None]) -> None:
        self.check()
        while len(self._pending) >= self.max_pending:
            self._pending.popleft().result()
        self._pending.append(self._executor.submit(job))

    def drain(self) -> None:
        """Wait for every job queued; raise the first error."""
        while self._pending:
            self._pending.popleft().result()

    def check(self) -> None:
        """Raise the error of a job that has ended with one (a worker waiting for permits learns at once that a
        batch failed); forget the jobs that ended well."""
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()

    def close(self) -> None:
        """Stop taking jobs; the one running ends on its own (a closing worker's sends give up at once)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
