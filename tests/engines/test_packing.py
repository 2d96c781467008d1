"""Padding-free rows (`heterorl.engines.packing`): every layout gives the log-probs and gradients of one
right-padded row per sequence, on ``sdpa`` and ``eager``; `plan` picks shared prompts, position-id packing or
neither, and places units first-fit in rows no longer than the longest."""

import random

import pytest
import torch

from heterorl.engines import logprobs as lp
from heterorl.engines import packing


def _batch(vocab: int, group_sizes=(1, 3, 1, 4, 2), seed: int = 0):
    """Groups of ``group_sizes`` completions behind prompts of varied lengths, completions of varied lengths."""
    rng = random.Random(seed)
    sequences, prompt_lens = [], []
    for size in group_sizes:
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(3, 9))]
        for _ in range(size):
            sequences.append(prompt + [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 14))])
            prompt_lens.append(len(prompt))
    return sequences, prompt_lens


def _grads_of(model, out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    (out * weights * mask).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _layouts(sequences, prompt_lens):
    groups = packing.prompt_groups(sequences, prompt_lens)
    singles = [[i] for i in range(len(sequences))]
    total = sum(len(s) for s in sequences)
    return {
        "shared prompts, a row per group": packing.layout(sequences, prompt_lens, groups, True),
        "shared prompts, groups sharing rows": packing.layout(sequences, prompt_lens, groups, True, width=40),
        "position ids, rows of the longest": packing.layout(sequences, prompt_lens, singles, False),
        "position ids, one row (variable-length attention)": packing.layout(sequences, prompt_lens, singles, False,
                                                                            width=total),
    }


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_every_layout_gives_the_log_probs_and_gradients_of_padded_rows(tiny_policy, attention):
    model = type(tiny_policy[0])(tiny_policy[0].config)
    model.load_state_dict(tiny_policy[0].state_dict())
    model.config._attn_implementation = attention
    sequences, prompt_lens = _batch(model.config.vocab_size)
    lengths = torch.tensor([len(s) - n for s, n in zip(sequences, prompt_lens)])
    padded = lp.completion_logprobs(model, sequences, prompt_lens, 0, temperature=0.7)
    mask = torch.arange(padded.shape[1])[None] < lengths[:, None]
    expected = _grads_of(model, padded, mask)
    for name, rows in _layouts(sequences, prompt_lens).items():
        assert sorted(i for row in rows.rows for unit in row for i in unit) == list(range(len(sequences)))
        out = packing.packed_completion_logprobs(model, sequences, prompt_lens, rows, 0, temperature=0.7)
        assert out.shape == padded.shape
        assert torch.allclose(out[mask], padded[mask], atol=1e-5), (name, (out - padded)[mask].abs().max())
        assert (out[~mask] == 0).all()
        error = float((_grads_of(model, out, mask) - expected).norm() / expected.norm())
        assert error < 1e-5, (name, error)


def test_units_go_first_fit_into_rows_no_longer_than_the_longest():
    sequences = [[1] * 10, [2] * 4, [3] * 6, [4] * 3, [5] * 7]
    rows = packing.layout(sequences, [1] * 5, [[i] for i in range(5)], False)
    assert rows.width == 10
    assert rows.rows == (((0,),), ((4,), (3,)), ((2,), (1,)))  # 10 | 7 + 3 | 6 + 4
    assert rows.cells == 30  # padded: 5 rows x 10
    wide = packing.layout(sequences, [1] * 5, [[i] for i in range(5)], False, width=4)
    assert wide.width == 10  # (never narrower than the longest unit)
    shared = packing.layout([[9, 9, 1], [9, 9, 2, 2], [8, 3]], [2, 2, 1], [[0, 1], [2]], True)
    assert shared.width == 5 and shared.rows == (((0, 1),), ((2,),))  # the group's prompt counted once: 2 + 1 + 2


def test_plan_picks_shared_prompts_then_position_ids_then_padded_rows(tiny_policy, monkeypatch):
    model = tiny_policy[0]
    monkeypatch.setattr(model.config, "_attn_implementation", "sdpa")
    grouped, grouped_lens = _batch(model.config.vocab_size, group_sizes=(4, 4, 4))
    assert packing.plan(model, grouped, grouped_lens).shared_prompts
    varied = [[k + 1] * n for k, n in enumerate((20, 5, 5, 5, 10, 10))]  # no prompt shared; padded: 6 x 20 cells
    flat = packing.plan(model, varied, [1] * 6)
    assert not flat.shared_prompts and flat.width == 20 and flat.cells == 60  # 20 | 10 + 10 | 5 + 5 + 5
    assert not getattr(packing.plan(model, grouped, grouped_lens, share_prompts=False), "shared_prompts", False)
    equal = [[1, 2, 3, 4]] * 3 + [[5, 6, 7, 8]] * 2  # nothing to share (one token of prompt), nothing padded
    assert packing.plan(model, equal, [1] * 5) is None
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
    varlen = packing.plan(model, grouped, grouped_lens)  # no custom mask: position ids, every sequence in one row
    assert not varlen.shared_prompts and len(varlen.rows) == 1 and varlen.width == sum(map(len, grouped))
    monkeypatch.setattr(model.config, "_attn_implementation", "sdpa")
    monkeypatch.setattr(model.config, "model_type", "some_new_model")  # masks from position ids not known to hold
    assert packing.plan(model, varied, [1] * 6) is None
    monkeypatch.setattr(packing, "PACK_MAX_MASK", 10)
    monkeypatch.setattr(model.config, "model_type", "qwen2")
    assert packing.plan(model, grouped, grouped_lens) is None  # every mask past its memory budget
