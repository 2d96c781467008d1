"""The streaming strategy's bookkeeping (heterorl/runtime/rollout_strategies.py) without vLLM: a group whose
request failed is dropped and counted and its permit returned; a refused version leaves the worker on its weights;
a streaming run the loop cannot serve is refused by name. The worker's loop runs it over a fake streaming engine in
tests/runtime/test_worker_loop.py, and on vLLM in the vLLM lane (tests/runtime/test_vllm_fleet.py,
tests/engines/test_vllm_stream.py)."""

import concurrent.futures
from collections import Counter
from types import SimpleNamespace

import pytest

from heterorl.config import load_config
from heterorl.errors import ConfigError, HeteroRLError, SamplingError
from heterorl.runtime.rollout_strategies import StreamingRollouts, check_streaming
from heterorl.tasks import make_task_from


class _Client:
    def __init__(self):
        self.returned, self.held, self.reward_outcomes, self.busy_s = 0, None, {}, 0.0
        self.weights, self.sessions = None, 1

    def return_starts(self, n):
        self.returned += n

    def set_version_held(self, version):
        self.held = version

    def latest_weights(self):
        got, self.weights = self.weights, None
        return got


class _Engine:
    def __init__(self):
        self.stats, self.version, self.loaded = Counter(), 3, []

    def load_version(self, version, state):
        if state == "misfit":
            raise SamplingError("these weights do not fit the engine's model")
        self.loaded.append(version)
        self.version = version


class _Port:
    """A `WorkerPort`: what the strategy may ask of its worker, recorded."""

    worker_id, max_context = "w0", None

    def __init__(self, client, sampler):
        self.client, self.sampler, self.version, self.handed_off = client, sampler, 3, []

    def weights_for_engine(self, state):
        return state

    def hold_version(self, version):
        self.version = version
        self.client.set_version_held(version)

    def hand_off(self, sampled):
        self.handed_off.append(sampled)


def _loop(**runtime):
    cfg = load_config(None, ["runtime.mode=async", *[f"runtime.{k}={v}" for k, v in runtime.items()]])
    engine, client = _Engine(), _Client()
    port = _Port(client, SimpleNamespace(engine=engine, tokenizer=None, version=3))
    return StreamingRollouts(port, cfg, task=None), port, client, engine


def test_a_failed_group_is_dropped_counted_and_its_permit_returned():
    loop, _, client, _ = _loop()
    failed = concurrent.futures.Future()
    failed.set_exception(SamplingError("vLLM failed this group's request: ValueError: boom"))
    loop.in_flight[failed] = SimpleNamespace(index=7, session=1)
    loop.harvest()
    assert loop.counts["request_errors"] == 1 and client.returned == 1 and not loop.in_flight
    assert "request_errors 1" in loop.tally()


def test_a_version_that_does_not_fit_is_refused_and_the_worker_keeps_its_weights():
    loop, worker, client, engine = _loop(inflight_updates="true")
    client.weights = (4, "misfit")
    loop.take_weights()
    assert loop.counts["weights_refused"] == 1 and worker.version == 3 and client.held is None
    client.weights = (5, "fits")
    loop.take_weights()
    assert engine.loaded == [5] and worker.version == 5 and client.held == 5


def test_without_inflight_updates_a_version_waits_for_the_groups_in_flight():
    loop, worker, client, engine = _loop()
    running = concurrent.futures.Future()
    loop.in_flight[running] = object()
    client.weights = (4, "fits")
    loop.take_weights()
    assert engine.loaded == [] and loop._pending is not None  # held back while a group runs on version 3
    loop.in_flight.clear()
    loop.take_weights()
    assert engine.loaded == [4] and worker.version == 4


def test_streaming_runs_the_loop_cannot_serve_are_refused():
    cfg = load_config(None, ["runtime.vllm_streaming=true"])
    with pytest.raises(HeteroRLError, match="--engine vllm"):
        check_streaming(cfg, "torch", make_task_from(cfg.task))
    walk = load_config(None, ["runtime.vllm_streaming=true", "task.name=maze_walk"])
    with pytest.raises(HeteroRLError, match="multi-turn"):
        check_streaming(walk, "vllm", make_task_from(walk.task))
    with pytest.raises(ConfigError, match="vllm_inflight_kv"):
        load_config(None, ["runtime.vllm_inflight_kv=sometimes"])
    with pytest.raises(ConfigError, match="max_versions_per_sample"):
        load_config(None, ["runtime.max_versions_per_sample=-1"])


def test_the_scoring_pipeline_queues_up_to_its_bound_in_order_and_reports_errors():
    import threading

    from heterorl.runtime.rollouts import Pipeline

    pipeline, done, gate = Pipeline(max_pending=2), [], threading.Event()
    pipeline.submit(lambda: (gate.wait(5), done.append(1)))
    pipeline.submit(lambda: done.append(2))  # queued beside the first: the caller did not wait
    assert done == []
    gate.set()
    pipeline.submit(lambda: done.append(3))  # a third waits for the oldest, then queues
    pipeline.drain()
    assert done == [1, 2, 3]

    def fails():
        raise ValueError("scoring failed")

    pipeline.submit(fails)
    with pytest.raises(ValueError, match="scoring failed"):
        pipeline.drain()
    pipeline.close()


def test_a_group_started_before_the_worker_rejoined_is_dropped_not_sent():
    """The learner ends a session when its worker says hello again, and refuses the groups started on its permits
    as over the new session's start limit: a streaming worker drops them (counted) instead of sending them."""
    loop, _, client, _ = _loop()
    ended = concurrent.futures.Future()
    ended.set_result([])
    loop.in_flight[ended] = SimpleNamespace(index=3, session=1)
    client.sessions = 2  # rejoined while the group ran
    loop.harvest()
    assert loop.counts["dropped_at_rejoin"] == 1 and not loop.in_flight and client.returned == 0
    assert loop.port.handed_off == []
