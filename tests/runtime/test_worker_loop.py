"""The rollout worker's one loop (`RolloutWorker.run_rollouts`) over both of its strategies, without sockets or
vLLM: a fake learner that grants a fixed number of admission permits and ends the run once each has become a group
sent or a permit returned, and, for the streaming strategy, a fake streaming engine whose groups end on a timer
thread. The same loop must number the groups, keep the sync shares, exit on a silent learner, and count its time,
whichever way the groups are sampled."""

import threading
import time
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from heterorl.config import load_config
from heterorl.engines.base import SampleOutput
from heterorl.runtime.rollouts import sampling_params
from heterorl.runtime.worker import RolloutWorker, WorkerOptions
from heterorl.tasks import make_task_from
from heterorl.training.session import SamplingClient


class _Learner:
    """The part of a `WorkerClient` the loop uses, over a learner that grants ``permits`` starts in all, publishes
    version v + 1 once ``share`` × (v + 1) groups have come in or been given back (when a sync worker waits for it),
    and ends the run when every permit is accounted for."""

    def __init__(self, permits: int, share: int = 0, alive: bool = True) -> None:
        self.permits, self.total, self.share = permits, permits, share
        self.learner_alive, self.advised_threads, self.refused, self.sessions = alive, 0, None, 1
        self.finished, self.lock = threading.Event(), threading.Lock()
        self.sent, self.returned, self.held, self.asked = [], 0, None, 0
        self.reward_outcomes, self.busy_s, self.idle_s, self.stats = {}, 0.0, 0.0, Counter()
        self.state: dict = {}

    def _account(self) -> int:
        done = len(self.sent) + self.returned
        if done >= self.total:
            self.finished.set()
        return done

    def latest_weights(self):
        return None

    def wait_weights(self, after: int, timeout_s: float):
        with self.lock:
            if self._account() >= self.share * (after + 1):
                return after + 1, self.state
        time.sleep(0.01)
        return None

    def acquire_starts(self, wanted: int, timeout_s: float) -> int:
        self.asked += 1
        granted = min(wanted, self.permits)
        self.permits -= granted
        if not granted:
            time.sleep(min(timeout_s, 0.01))
        return granted

    def send_many(self, group, timeout_s: float) -> int:
        with self.lock:
            self.sent.append(list(group))
            self._account()
        return len(group)

    def return_starts(self, n: int) -> None:
        with self.lock:
            self.returned += n
            self._account()

    def set_version_held(self, version: int) -> None:
        self.held = version

    def close(self, reason: str) -> None:
        pass


class _StreamingEngine:
    """The part of a `StreamingVLLMEngine` the streaming strategy uses: each group ends on a timer thread, every
    token stamped with the version loaded when it was submitted."""

    def __init__(self) -> None:
        self.version, self.stats, self.loaded, self.seeds = 0, Counter(), [], []

    def submit(self, prompt, params, num_samples: int) -> Future:
        future, version = Future(), self.version
        samples = [SampleOutput(tokens=[5, 6, 7], logprobs=[-0.5] * 3, stop_reason="stop", versions=[version] * 3)
                   for _ in range(num_samples)]
        self.seeds.append(params.seed)
        threading.Timer(0.01, future.set_result, (samples,)).start()
        return future

    def load_version(self, version: int, state) -> None:
        self.loaded.append(version)
        self.version = version


def _worker(strategy: str, learner: _Learner, tiny_policy, *overrides: str):
    cfg = load_config(None, ["runtime.workers=1", "runtime.groups_per_call=2", "rollout.group_size=2",
                             "rollout.max_tokens=6", f"runtime.vllm_streaming={strategy == 'streaming'}",
                             *overrides])
    model, tokenizer = tiny_policy
    if strategy == "streaming":
        sampler = SimpleNamespace(engine=_StreamingEngine(), tokenizer=tokenizer, version=0, close=lambda: None)
    else:
        sampler = SamplingClient.for_model(model, tokenizer, version=0)
        learner.state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    worker = RolloutWorker(WorkerOptions("tcp://127.0.0.1:9", "w0", allow_plaintext=True), client=learner)
    worker.sampler = sampler
    worker.hold_version(0)
    return worker, cfg, make_task_from(cfg.task)


def _group_number(group) -> int:
    return int(group[0].group_id.rsplit("-", 1)[1])


@pytest.mark.parametrize("strategy", ["batch", "streaming"])
def test_every_permit_becomes_a_group_sent_or_given_back_numbered_in_order(strategy, tiny_policy):
    learner = _Learner(permits=5)
    worker, cfg, task = _worker(strategy, learner, tiny_policy, "runtime.mode=async")
    try:
        assert worker.run_rollouts(cfg, task) == 0
    finally:
        worker.close()
    numbers = sorted(_group_number(group) for group in learner.sent)
    assert worker.groups_sent == 5 and len(numbers) + learner.returned == 5 and learner.permits == 0
    assert len(set(numbers)) == len(numbers) and set(numbers) <= set(range(5))
    assert all(group[0].group_id.startswith(f"w0-{worker.session}-") for group in learner.sent)
    assert worker.busy_s > 0 and learner.busy_s == worker.busy_s and learner.idle_s == worker.idle_s
    if strategy == "streaming":  # each group seeded by its number, as a batch worker's call is by its first
        assert worker.sampler.engine.seeds == [sampling_params(cfg, "w0", n).seed for n in range(5)]
        assert "streaming: no incidents" in worker.tally()
    else:
        assert "streaming" not in worker.tally()


@pytest.mark.parametrize("strategy", ["batch", "streaming"])
def test_a_sync_worker_samples_each_share_with_the_next_version(strategy, tiny_policy):
    """Sync mode, 2 groups a share: groups 0-1 drawn by version 0, groups 2-3 by version 1, which the learner
    publishes only once the first share is in."""
    learner = _Learner(permits=4, share=2)
    worker, cfg, task = _worker(strategy, learner, tiny_policy, "runtime.mode=sync", "rl.prompts_per_step=2")
    try:
        assert worker.run_rollouts(cfg, task) == 0
    finally:
        worker.close()
    versions = {_group_number(group): set(group[0].policy_versions.tolist()) for group in learner.sent}
    assert versions and all(v == ({0} if n < 2 else {1}) for n, v in versions.items()), versions
    assert worker.version == learner.held == 1


@pytest.mark.parametrize("strategy", ["batch", "streaming"])
def test_a_learner_silent_past_its_timeout_ends_the_loop_with_1(strategy, tiny_policy):
    learner = _Learner(permits=5, alive=False)
    worker, cfg, task = _worker(strategy, learner, tiny_policy, "runtime.mode=async",
                                "runtime.learner_timeout_s=0.3")
    started = time.monotonic()
    try:
        assert worker.run_rollouts(cfg, task) == 1
    finally:
        worker.close()
    assert 0.3 <= time.monotonic() - started < 5 and learner.asked == 0 and worker.groups_sent == 0
    assert worker.idle_s >= 0.3 and worker.busy_s == 0  # out of touch, nothing in flight: idle
