"""What each sampling engine of a fleet contributed, and how far its log-probs sit from the learner's.

A mixed fleet (torch and vLLM workers feeding one learner) is only trustworthy if the two engines' samples are
alike to the loss. The learner keeps one `EngineTally` per engine name (the one each worker states in its
``hello``): trajectories received and trained, tokens, staleness, and the **training–inference mismatch** —
the learner's teacher-forced log-probs against the worker's behaviour log-probs of the same tokens, on the
trajectories sampled by the very weights the learner holds when it trains them (staleness 0). There every
difference is the engines' own (kernels, dtype, sampling processors), not the policy's drift, so it is the part
of the importance ratio that TIS / IcePop / GEPO absorb even in a synchronous run:

- ``mismatch_abs_mean`` / ``mismatch_abs_max``: |log p_learner − log q_worker| over those tokens;
- ``is_ratio_var``: the variance of the per-token ratio p/q = exp(log p − log q) over them (0 when the engines
  agree exactly; the variance staleness 0 alone puts into a token-level importance weight).

The learner's log-probs come from the first update of each step (the weights it was published as, before any
``optim_step``), so measuring costs no extra forward pass; the tokens of minibatches without learning signal
(skipped, no forward) and of later updates are not measured.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from heterorl.config import ENGINES

if TYPE_CHECKING:
    from heterorl.runtime.buffer import Group

UNKNOWN_ENGINE = "unknown"  # a trajectory whose worker left the registry before the learner saw its hello
OTHER_ENGINE = "other"  # the engines named after `MAX_NEW_ENGINES` others had their tallies
KNOWN_ENGINES = frozenset({*ENGINES, UNKNOWN_ENGINE, OTHER_ENGINE})
MAX_NEW_ENGINES = 4  # tallies of engine names outside KNOWN_ENGINES (a worker names its engine: a peer's input)
MAX_SAMPLERS_REMEMBERED = 4096  # sampler ids whose engine is remembered (the least recently used is forgotten)


@dataclass
class EngineTally:
    """Running totals of one engine's trajectories (JSON-serialisable: it is part of the learner's checkpoint)."""

    received: int = 0  # trajectories taken in from the transport
    trained: int = 0  # trajectories in the batches trained
    tokens_trained: int = 0
    staleness_sum: float = 0.0  # over trained groups, in versions
    groups_trained: int = 0
    staleness_max: int = 0
    mismatch_tokens: int = 0  # tokens measured at staleness 0
    mismatch_abs_sum: float = 0.0
    mismatch_abs_max: float = 0.0
    # sums of (p/q − 1) and its square: near 1 the variance is a difference of small numbers, not of two ≈ 1
    excess_sum: float = 0.0
    excess_sq_sum: float = 0.0

    @classmethod
    def from_json(cls, raw: dict) -> EngineTally:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    def add_mismatch(self, delta: np.ndarray) -> None:
        """Account the per-token log-prob differences (learner − worker) of one trajectory at staleness 0."""
        if not len(delta):
            return
        excess = np.expm1(np.clip(delta, -50.0, 50.0))  # p/q − 1, exact for tiny differences
        self.mismatch_tokens += len(delta)
        self.mismatch_abs_sum += float(np.abs(delta).sum())
        self.mismatch_abs_max = max(self.mismatch_abs_max, float(np.abs(delta).max()))
        self.excess_sum += float(excess.sum())
        self.excess_sq_sum += float((excess * excess).sum())

    def summary(self, elapsed_s: float) -> dict:
        """The run summary's entry: rates over the learner's elapsed time, means, and the mismatch (None: no
        token of this engine was measured at staleness 0)."""
        n = self.mismatch_tokens
        mean_excess = self.excess_sum / n if n else math.nan
        return {
            "trajectories_received": self.received,
            "trajectories_trained": self.trained,
            "samples_per_s": self.trained / max(elapsed_s, 1e-9),
            "tokens_per_s": self.tokens_trained / max(elapsed_s, 1e-9),
            "staleness_mean": self.staleness_sum / max(self.groups_trained, 1),
            "staleness_max": self.staleness_max,
            "mismatch_tokens": n,
            "mismatch_abs_mean": self.mismatch_abs_sum / n if n else None,
            "mismatch_abs_max": self.mismatch_abs_max if n else None,
            "is_ratio_mean": 1.0 + mean_excess if n else None,
            "is_ratio_var": max(self.excess_sq_sum / n - mean_excess ** 2, 0.0) if n else None,
        }


def step_mismatch(deltas: dict[str, list[np.ndarray]]) -> dict[str, float]:
    """One step's mismatch metrics per engine (``mismatch/<engine>/abs_mean`` ...) from its per-trajectory
    deltas."""
    metrics = {}
    for engine, parts in sorted(deltas.items()):
        tally = EngineTally()
        for delta in parts:
            tally.add_mismatch(delta)
        if tally.mismatch_tokens:
            s = tally.summary(1.0)
            metrics.update({f"mismatch/{engine}/abs_mean": s["mismatch_abs_mean"],
                            f"mismatch/{engine}/abs_max": s["mismatch_abs_max"],
                            f"mismatch/{engine}/is_ratio_var": s["is_ratio_var"],
                            f"mismatch/{engine}/tokens": tally.mismatch_tokens})
    return metrics


def tallies_to_json(tallies: dict[str, EngineTally]) -> dict[str, dict]:
    return {name: asdict(t) for name, t in tallies.items()}


class FleetEngines:
    """The learner's tallies by engine (`EngineTally`), each worker's engine looked up by its sampler id in what
    ``workers`` lists (the registry's `WorkerInfo`s: ``worker_id``, ``engine``). Bounded whatever the workers
    name: a tally for each of `KNOWN_ENGINES` and for the first `MAX_NEW_ENGINES` other names (those of a resumed
    run's checkpoint included), the rest counted under `OTHER_ENGINE`; the engines of the last
    `MAX_SAMPLERS_REMEMBERED` sampler ids. Not thread-safe: its owner holds its lock around every call."""

    def __init__(self, workers: Callable[[], Iterable], tallies: dict[str, EngineTally] | None = None) -> None:
        self._workers = workers
        self._engine_of: OrderedDict[str, str] = OrderedDict()  # sampler id → the engine it named, most recent last
        self.tallies: dict[str, EngineTally] = dict(tallies or {})  # engine → its totals (saved in checkpoints)

    def engine(self, sampler_id: str) -> str:
        """The engine ``sampler_id``'s worker named in its hello, or the name it is tallied under (a worker's hello
        precedes its trajectories; one removed from the registry before the learner first looks is
        `UNKNOWN_ENGINE`)."""
        engine = self._engine_of.get(sampler_id)
        if engine is None:  # one look at the fleet for every worker not yet known: they go in as least recent
            for worker in self._workers():
                if worker.worker_id not in self._engine_of:
                    self._engine_of[worker.worker_id] = worker.engine
                    self._engine_of.move_to_end(worker.worker_id, last=False)
            engine = self._engine_of.setdefault(sampler_id, UNKNOWN_ENGINE)
        self._engine_of.move_to_end(sampler_id)
        while len(self._engine_of) > MAX_SAMPLERS_REMEMBERED:
            self._engine_of.popitem(last=False)
        return self._tallied_as(engine)

    def _tallied_as(self, engine: str) -> str:
        """``engine``, or `OTHER_ENGINE` once `MAX_NEW_ENGINES` names outside `KNOWN_ENGINES` have tallies."""
        if engine in KNOWN_ENGINES or engine in self.tallies:
            return engine
        new = sum(1 for name in self.tallies if name not in KNOWN_ENGINES)
        return engine if new < MAX_NEW_ENGINES else OTHER_ENGINE

    def tally(self, sampler_id: str) -> EngineTally:
        return self.tallies.setdefault(self.engine(sampler_id), EngineTally())

    def add_batch(self, groups: list[Group], staleness: list[int], fresh: dict[int, list[float]],
                  version: int) -> dict:
        """Add a trained batch to its engines' tallies; the step's per-engine metrics: trajectories and staleness,
        and the training–inference mismatch of the trajectories sampled by ``version`` (the weights the batch was
        trained from) whose learner log-probs ``fresh`` holds (rows in the batch's order)."""
        metrics: dict = {}
        deltas: dict[str, list[np.ndarray]] = {}
        row = 0
        for group, gap in zip(groups, staleness):
            engines = set()
            for t in group.trajectories:
                engine, tally = self.engine(t.sampler_id), self.tally(t.sampler_id)
                engines.add(engine)
                tally.trained += 1
                tally.tokens_trained += t.policy_token_count
                metrics[f"engine/{engine}/trajectories"] = metrics.get(f"engine/{engine}/trajectories", 0) + 1
                if row in fresh and bool((t.policy_versions == version).all()):
                    delta = np.asarray(fresh[row], np.float64) - t.behaviour_logprobs.astype(np.float64)
                    delta = delta[t.policy_mask()] if t.env_spans else delta  # (environment tokens: no log-prob)
                    tally.add_mismatch(delta)
                    deltas.setdefault(engine, []).append(delta)
                row += 1
            for engine in engines:
                tally = self.tallies[engine]
                tally.groups_trained += 1
                tally.staleness_sum += gap
                tally.staleness_max = max(tally.staleness_max, gap)
        return {**metrics, **step_mismatch(deltas)}
