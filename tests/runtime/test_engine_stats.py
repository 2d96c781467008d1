"""The per-engine tallies the learner keeps: the training–inference mismatch arithmetic and its JSON round trip."""

import json

import numpy as np
import pytest

from heterorl.runtime import engine_stats
from heterorl.runtime.engine_stats import (
    KNOWN_ENGINES,
    MAX_NEW_ENGINES,
    OTHER_ENGINE,
    EngineTally,
    FleetEngines,
    step_mismatch,
    tallies_to_json,
)


def test_mismatch_figures_are_those_of_all_tokens_pooled():
    rng = np.random.default_rng(0)
    parts = [rng.normal(0, 0.05, n) for n in (3, 7, 1)]
    tally = EngineTally()
    for delta in parts:
        tally.add_mismatch(delta)
    every = np.concatenate(parts)
    got = tally.summary(elapsed_s=2.0)
    assert got["mismatch_tokens"] == 11
    assert got["mismatch_abs_mean"] == pytest.approx(np.abs(every).mean())
    assert got["mismatch_abs_max"] == pytest.approx(np.abs(every).max())
    assert got["is_ratio_mean"] == pytest.approx(np.exp(every).mean())
    assert got["is_ratio_var"] == pytest.approx(np.exp(every).var(), rel=1e-6)
    metrics = step_mismatch({"vllm": parts, "torch": []})
    assert metrics["mismatch/vllm/tokens"] == 11 and "mismatch/torch/tokens" not in metrics
    assert metrics["mismatch/vllm/is_ratio_var"] == pytest.approx(got["is_ratio_var"])


def test_engines_that_agree_exactly_have_no_ratio_variance_and_unmeasured_ones_say_none():
    tally = EngineTally()
    tally.add_mismatch(np.zeros(5))
    assert tally.summary(1.0)["is_ratio_var"] == 0.0 and tally.summary(1.0)["mismatch_abs_max"] == 0.0
    empty = EngineTally(trained=8, tokens_trained=40).summary(elapsed_s=4.0)
    assert empty["mismatch_abs_mean"] is None and empty["is_ratio_var"] is None
    assert empty["samples_per_s"] == 2.0 and empty["tokens_per_s"] == 10.0


def test_tallies_survive_the_learner_state_json():
    tally = EngineTally(received=9, trained=8, staleness_sum=3.0, groups_trained=2, staleness_max=2)
    tally.add_mismatch(np.array([0.1, -0.2]))
    raw = json.loads(json.dumps(tallies_to_json({"vllm": tally})))
    assert EngineTally.from_json(raw["vllm"]) == tally
    assert EngineTally.from_json({**raw["vllm"], "from_a_newer_version": 1}) == tally


def test_the_ratio_variance_stays_exact_when_the_engines_all_but_agree():
    """float32 engines differ by ~1e-6 in log-prob: a variance of ~1e-12 must not drown in the rounding of ≈ 1."""
    delta = np.random.default_rng(1).normal(0.0, 1e-6, 20_000)
    tally = EngineTally()
    for part in np.array_split(delta, 7):
        tally.add_mismatch(part)
    assert tally.summary(1.0)["is_ratio_var"] == pytest.approx(np.var(np.expm1(delta)), rel=1e-6)


def test_a_resumed_runs_engine_tallies_count_against_the_bound_and_sampler_ids_are_forgotten(monkeypatch):
    """Tallies read from a checkpoint hold their places among the `MAX_NEW_ENGINES` new names (the rest go to
    ``other``, known engines never); the engines of at most `MAX_SAMPLERS_REMEMBERED` sampler ids are kept.
    (Over loopback: tests/transport/test_peer_maps.py.)"""

    class Worker:
        def __init__(self, worker_id: str, engine: str) -> None:
            self.worker_id, self.engine = worker_id, engine

    fleet = [Worker(f"w{i}", f"x{i}") for i in range(3)] + [Worker("t", "torch")]
    resumed = {f"old{i}": EngineTally(received=1) for i in range(MAX_NEW_ENGINES - 1)}
    engines = FleetEngines(lambda: fleet, resumed)
    for w in fleet:
        engines.tally(w.worker_id).received += 1
    assert [engines.engine(w.worker_id) for w in fleet] == ["x0", OTHER_ENGINE, OTHER_ENGINE, "torch"]
    assert set(engines.tallies) == set(resumed) | {"x0", OTHER_ENGINE, "torch"}
    assert engines.tallies[OTHER_ENGINE].received == 2
    assert KNOWN_ENGINES >= {"torch", "vllm", "unknown", OTHER_ENGINE}
    monkeypatch.setattr(engine_stats, "MAX_SAMPLERS_REMEMBERED", 2)
    for w in fleet:
        engines.engine(w.worker_id)
    assert list(engines._engine_of) == ["w2", "t"]  # the two used last
