"""The torch sampling engine: log-probs of what it sampled, stop handling, seeds, bad input."""

import math

import pytest
import torch

from heterorl.engines import SamplingParams, TorchEngine
from heterorl.engines.logprobs import pad_right, selected_logprobs
from heterorl.engines.torch_engine import _filter_logits
from heterorl.errors import SamplingError
from tests.conftest import teacher_forced


@pytest.fixture(scope="module")
def engine(tiny_policy):
    model, tok = tiny_policy
    return TorchEngine(model, tok)


def _prompts(tok):
    # different lengths, so the batch is left-padded
    return [tok("S.#\n..G\n>")["input_ids"], tok("S.\n.G\n>R")["input_ids"], tok(">")["input_ids"]]



def test_logprobs_match_teacher_forcing_fp32(engine, tiny_policy):
    model, tok = tiny_policy
    prompts = _prompts(tok)
    groups = engine.generate(prompts, SamplingParams(max_tokens=20, seed=7), num_samples=4)
    worst = 0.0
    for prompt, group in zip(prompts, groups):
        assert len(group) == 4
        for sample in group:
            assert len(sample.tokens) == len(sample.logprobs) >= 1
            expected = teacher_forced(model, prompt, sample.tokens)
            worst = max(worst, (expected - torch.tensor(sample.logprobs)).abs().max().item())
            # the engine's own teacher-forced path agrees too
            tf = engine.compute_logprobs([prompt + sample.tokens])[0][len(prompt) - 1 :]
            assert max(abs(a - b) for a, b in zip(tf, sample.logprobs)) <= 1e-4
    assert worst <= 1e-4


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.7, seed=1),
    SamplingParams(max_tokens=12, temperature=1.3, top_k=3, seed=2),
    SamplingParams(max_tokens=12, temperature=1.0, top_p=0.6, seed=3),
])
def test_logprobs_are_of_the_distribution_sampled_from(engine, tiny_policy, params):
    model, tok = tiny_policy
    prompts = _prompts(tok)
    for prompt, group in zip(prompts, engine.generate(prompts, params, num_samples=3)):
        for s in group:
            expected = teacher_forced(model, prompt, s.tokens, params.temperature, params.top_k, params.top_p)
            assert torch.isfinite(expected).all()  # never a token outside the top-k / nucleus set
            assert torch.allclose(expected, torch.tensor(s.logprobs), atol=1e-4)


def test_top_k_one_is_greedy(engine, tiny_policy):
    _, tok = tiny_policy
    prompts = _prompts(tok)
    greedy = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    topk1 = engine.generate(prompts, SamplingParams(max_tokens=10, top_k=1, seed=5))
    assert [g[0].tokens for g in greedy] == [g[0].tokens for g in topk1]
    assert all(abs(lp) < 1e-6 for g in topk1 for lp in g[0].logprobs)  # a point mass: log 1 = 0


def test_filter_logits_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept_p = torch.isfinite(_filter_logits(logits, 0, 0.7))  # 0.5 < 0.7, 0.5 + 0.3 ≥ 0.7: keep two
    assert kept_p.tolist() == [[True, True, False, False]]
    kept_k = torch.isfinite(_filter_logits(logits, 3, 1.0))
    assert kept_k.tolist() == [[True, True, True, False]]


def test_same_seed_same_samples_and_different_seed_differs(engine, tiny_policy):
    _, tok = tiny_policy
    prompts = _prompts(tok)
    a = engine.generate(prompts, SamplingParams(max_tokens=16, seed=11), num_samples=4)
    b = engine.generate(prompts, SamplingParams(max_tokens=16, seed=11), num_samples=4)
    c = engine.generate(prompts, SamplingParams(max_tokens=16, seed=12), num_samples=4)
    tokens = lambda out: [s.tokens for g in out for s in g]
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)


def test_a_prompt_prefilled_once_samples_as_if_every_row_were_prefilled(engine, tiny_policy):
    """num_samples > 1 prefills each prompt once and repeats its KV cache; the rows then draw the same
    tokens with the same log-probs as the same rows prefilled one by one (same seed, same row order)."""
    _, tok = tiny_policy
    prompts = _prompts(tok)  # different lengths: the repeated cache carries the left padding too
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5)
    shared = [s for g in engine.generate(prompts, params, num_samples=4) for s in g]
    rows = [p for p in prompts for _ in range(4)]
    alone = [g[0] for g in engine.generate(rows, params, num_samples=1)]
    assert [s.tokens for s in shared] == [s.tokens for s in alone]
    for a, b in zip(shared, alone):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert len({tuple(s.tokens) for s in shared}) > 3  # the samples of a prompt differ


def test_stop_reasons_and_stop_tokens(engine, tiny_policy):
    _, tok = tiny_policy
    prompts = _prompts(tok)
    out = engine.generate(prompts, SamplingParams(max_tokens=6, seed=0, ignore_eos=True), num_samples=2)
    assert all(len(s.tokens) == 6 and s.stop_reason == "length" for g in out for s in g)
    stop_id = tok.convert_tokens_to_ids("U")
    vocab = list(range(2, len(tok)))
    out = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=5.0, seed=0,
                                                  stop_token_ids=(stop_id,)), num_samples=8)
    for g in out:
        for s in g:
            assert s.tokens.count(stop_id) <= 1 and tok.eos_token_id not in s.tokens[:-1]
            if s.stop_reason == "stop":
                assert s.tokens[-1] == stop_id
            elif s.stop_reason == "eos":
                assert s.tokens[-1] == tok.eos_token_id
            else:
                assert len(s.tokens) == 40 and set(s.tokens) <= set(vocab)
    assert {s.stop_reason for g in out for s in g} >= {"stop"}


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, "top_k"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts(engine):
    with pytest.raises(SamplingError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(SamplingError, match="no prompts"):
        engine.generate([], SamplingParams())
    with pytest.raises(SamplingError, match="outside the vocabulary"):
        engine.generate([[3, 99999]], SamplingParams())
    with pytest.raises(SamplingError, match="num_samples"):
        engine.generate([[3]], SamplingParams(), num_samples=0)
    with pytest.raises(SamplingError, match="max_position_embeddings"):
        engine.generate([[3]], SamplingParams(max_tokens=10_000))


def test_selected_logprobs_and_padding():
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(selected_logprobs(logits, targets), expected, atol=1e-6)
    ids, mask = pad_right([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
