"""The streaming vLLM engine (`make test-vllm`, in ``.venv-vllm``): groups end one by one, weights load while
requests run with every token's log-prob exact for the version stamped on it, partial rollouts are bounded, and a
version that does not fit leaves the requests in flight on the old weights.

One engine serves most of the module (starting vLLM takes ~30 s here); the partial-rollout bound has its own.
"""

import time

import pytest
import torch

from heterorl.engines import SamplingParams
from heterorl.errors import SamplingError
from heterorl.policies import load_policy, shipped_policy
from heterorl.rollout.textcodec import encode_prompt

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="the vLLM lane: `make vllm`, then `make test-vllm`")

from heterorl.engines.vllm_stream import StreamingVLLMEngine  # noqa: E402
from tests.conftest import teacher_forced  # noqa: E402

POLICY = "add3-sft-base"
LONG = SamplingParams(max_tokens=120, temperature=1.0, ignore_eos=True, seed=5)


@pytest.fixture(scope="module")
def policy():
    return load_policy(POLICY)


@pytest.fixture(scope="module")
def perturbed(policy):
    """A second version: the policy's weights moved by 2 % noise (greedy answers change)."""
    model, _ = load_policy(POLICY)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():  # (a tied embedding is one parameter)
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    return {name: t.clone() for name, t in model.state_dict().items()}


def _engine(policy, **kwargs):
    return StreamingVLLMEngine(shipped_policy(POLICY), eos_token_id=policy[1].eos_token_id, kv_cache_gib=0.25,
                               max_num_batched_tokens=512, **kwargs)


@pytest.fixture(scope="module")
def engine(policy):
    engine = _engine(policy)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(policy):
    return encode_prompt(policy[1], "123+456=")



def _wait_for_tokens(engine, at_least: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (engine.in_flight_tokens() and min(engine.in_flight_tokens()) >= at_least):
        assert time.monotonic() < deadline, "the groups drew no tokens"
        time.sleep(0.01)


def test_groups_end_one_by_one_without_a_batch_barrier(engine, prompt):
    """A short group submitted beside a long one is done while the long one still runs."""
    long = engine.submit(prompt, LONG, num_samples=2)
    short = engine.submit(prompt, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, seed=1), 2)
    done_first = None
    while done_first is None:
        done_first = short if short.done() else (long if long.done() else None)
        time.sleep(0.005)
    assert done_first is short and not long.done()
    assert [len(s.tokens) for s in short.result()] == [3, 3]
    assert [len(s.tokens) for s in long.result(timeout=120)] == [120, 120]
    assert all(s.versions == [engine.version] * 120 for s in long.result())


def test_a_version_loaded_mid_generation_stamps_each_token_and_its_logprob_is_exact(engine, policy, perturbed, prompt):
    """Weights change while four groups are ~20 tokens in: each token carries the version that drew it, and its
    log-prob is the teacher-forced log-prob of that version given everything before it (recompute)."""
    model, _ = policy
    old_state = {name: t.clone() for name, t in model.state_dict().items()}
    before = engine.version
    futures = [engine.submit(prompt, SamplingParams(max_tokens=120, temperature=1.0, ignore_eos=True, seed=s), 2)
               for s in range(4)]
    _wait_for_tokens(engine, 20)
    engine.load_version(before + 1, perturbed)
    samples = [s for f in futures for s in f.result(timeout=120)]
    copy, _ = load_policy(POLICY)
    worst, spanned = 0.0, 0
    for sample in samples:
        assert set(sample.versions) <= {before, before + 1} and sample.versions == sorted(sample.versions)
        spanned += len(set(sample.versions)) == 2
        by_version = {}
        for version, state in ((before, old_state), (before + 1, perturbed)):
            copy.load_state_dict(state)
            by_version[version] = teacher_forced(copy, prompt, sample.tokens).tolist()
        worst = max(worst, max(abs(lp - by_version[v][i]) for i, (lp, v) in
                               enumerate(zip(sample.logprobs, sample.versions))))
    assert spanned == len(samples)  # every sample was ~20 tokens in when the version changed
    assert worst < 1e-4, worst
    assert engine.stats["updates_in_flight"] >= 1
    engine.load_version(before + 2, old_state)  # back to the policy for the tests after this one


def test_a_version_that_does_not_fit_is_refused_and_the_requests_finish_on_the_old_weights(engine, policy, prompt):
    model, _ = policy
    version = engine.version
    future = engine.submit(prompt, LONG, num_samples=2)
    _wait_for_tokens(engine, 5)
    bad = dict(model.state_dict())
    bad["model.embed_tokens.weight"] = torch.zeros(3, 3)
    refused = engine.stats["weights_refused"]
    with pytest.raises(SamplingError, match="do not fit"):
        engine.load_version(version + 1, bad)
    assert engine.stats["weights_refused"] == refused + 1 and engine.version == version
    assert all(s.versions == [version] * 120 for s in future.result(timeout=120))


def test_a_bad_request_fails_alone(engine, prompt):
    with pytest.raises(SamplingError, match="outside the vocabulary"):
        engine.submit([1, 2, 10**6], LONG)
    good = engine.submit(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=2), 2)
    assert len(good.result(timeout=60)) == 2


def test_generate_takes_weights_in_flight(engine, policy, perturbed, prompt):
    """`generate` with in-flight updates (the `SamplingEngine` contract): the version polled mid-generation is
    loaded at once and stamped on the tokens after it."""
    from heterorl.engines.base import WeightUpdates

    model, _ = policy
    version = engine.version
    offered = []

    def poll():
        if not offered and engine.in_flight_tokens() and min(engine.in_flight_tokens()) >= 10:
            offered.append(version + 1)
            return version + 1, perturbed
        return None

    groups = engine.generate([prompt, prompt], LONG, num_samples=2, updates=WeightUpdates(version, poll))
    assert offered and all(s.versions[0] == version and s.versions[-1] == version + 1 for g in groups for s in g)
    engine.load_version(version + 2, model.state_dict())


def test_partial_rollouts_over_the_bound_start_again_on_the_new_weights(policy, perturbed, prompt):
    """max_versions_per_sample=1: a group in flight when the version changes is aborted and drawn again, whole, by
    the new version; it is counted."""
    engine = _engine(policy, max_versions_per_sample=1)
    try:
        futures = [engine.submit(prompt, LONG, num_samples=2) for _ in range(3)]
        _wait_for_tokens(engine, 10)
        engine.load_version(1, perturbed)
        samples = [s for f in futures for s in f.result(timeout=120)]
        assert all(s.versions == [1] * 120 for s in samples)
        assert engine.stats["restarted"] == 3
    finally:
        engine.close()
