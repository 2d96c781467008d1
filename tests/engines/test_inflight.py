"""In-flight weight updates: newer weights taken between decode steps of a generation in progress."""

import copy

import pytest
import torch

from heterorl.engines import SamplingParams, TorchEngine
from heterorl.engines.base import SamplingEngine, WeightUpdates
from heterorl.errors import SamplingError
from heterorl.training.session import SamplingClient
from tests.conftest import perturbed_state, teacher_forced


def test_a_generation_spanning_an_update_carries_both_versions_and_their_logprobs(tiny_policy):
    model, tok = tiny_policy
    old_model = copy.deepcopy(model).eval()
    new_model = copy.deepcopy(model).eval()
    new_model.load_state_dict(perturbed_state(model, 0))
    engine = TorchEngine(copy.deepcopy(model), tok)
    polls = []

    def poll():  # the newer version turns up at the fourth look, after token 3 was drawn
        polls.append(1)
        return (1, new_model.state_dict()) if len(polls) == 4 else None

    prompts = [tok("S.#\n..G\n>")["input_ids"], tok(">")["input_ids"]]  # left-padded
    updates = WeightUpdates(0, poll)
    groups = engine.generate(prompts, SamplingParams(max_tokens=12, seed=3, ignore_eos=True), 4, updates=updates)
    assert updates.version == 1 and updates.applied == 1
    worst = {0: 0.0, 1: 0.0}
    moved = 0.0  # how far the new version's tokens are from what the old weights give them
    for prompt, group in zip(prompts, groups):
        for sample in group:
            assert sample.versions == [0] * 4 + [1] * 8
            logprobs = torch.tensor(sample.logprobs)
            old = teacher_forced(old_model, prompt, sample.tokens)
            new = teacher_forced(new_model, prompt, sample.tokens)
            worst[0] = max(worst[0], (old[:4] - logprobs[:4]).abs().max().item())
            worst[1] = max(worst[1], (new[4:] - logprobs[4:]).abs().max().item())
            moved = max(moved, (old[4:] - logprobs[4:]).abs().max().item())
    print(f"max |logp - teacher-forced logp of the stamped version|: v0 {worst[0]:.2e}, v1 {worst[1]:.2e}; "
          f"v1 tokens under v0: {moved:.2e}")
    assert worst[0] <= 1e-4 and worst[1] <= 1e-4
    assert moved > 1e-2  # the update changed the distribution: the check above could have failed


def test_the_sampler_reports_versions_and_holds_the_newest(tiny_policy):
    model, tok = tiny_policy
    sampler = SamplingClient.for_model(copy.deepcopy(model), tok, version=5)
    newer = perturbed_state(model, 1)
    offers = iter([None, (6, newer), None, (7, newer)])
    [sample] = sampler.sample(tok(">")["input_ids"], 1, SamplingParams(max_tokens=8, seed=0, ignore_eos=True),
                              weight_updates=lambda: next(offers, None)).result()
    assert sample.versions == [5, 5, 6, 6, 7, 7, 7, 7]
    assert sampler.version == 7
    [plain] = sampler.sample(tok(">")["input_ids"], 1, SamplingParams(max_tokens=4, seed=0)).result()
    assert plain.versions is None


def test_an_engine_without_inflight_updates_is_refused(tiny_policy):
    class Plain(SamplingEngine):
        def generate(self, prompts, params, num_samples=1):
            raise AssertionError("not reached")

        def compute_logprobs(self, sequences):
            return []

        def load_state_dict(self, state_dict):
            pass

    sampler = SamplingClient(Plain(), tiny_policy[1])
    with pytest.raises(SamplingError, match="cannot take weights during a generation"):
        sampler.sample([1, 2], weight_updates=lambda: None)
