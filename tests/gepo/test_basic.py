"""The losses the foundation needs (cross_entropy, importance_sampling, grpo) and the advantage estimators."""

import math

import pytest
import torch

import gepo


def _batch(**kw):
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return gepo.LossBatch(logprobs=lp, mask=mask, **kw)


def test_cross_entropy_by_hand():
    batch = _batch()
    loss, _ = gepo.get_loss("cross_entropy").fn(batch, gepo.make_loss_config("cross_entropy"))
    assert loss.item() == pytest.approx((1 + 2 + 0.5 * 3) / 5)  # token mean over the 5 unmasked tokens


def test_grpo_on_policy_ratio_is_one_and_gradient_is_policy_gradient():
    batch = _batch(behaviour_logprobs=torch.tensor([[-1.0, -2.0, 7.0], [-0.5, -0.5, -0.5]]),
                   advantages=torch.tensor([1.0, -2.0]))
    loss, metrics = gepo.get_loss("grpo").fn(batch, gepo.make_loss_config("grpo", {"advantage": "given"}))
    assert metrics["is/weight_mean"] == pytest.approx(1.0)
    assert metrics["is/clip_frac"] == 0.0
    # on-policy: L = mean_i −A_i (seq-mean of ratios = 1) = −(1 − 2)/2
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    # dL/dlogp_it = −A_i · r_it / |y_i| / B with r = 1
    expected = torch.tensor([[-1 / 2 / 2, -1 / 2 / 2, 0.0], [2 / 3 / 2] * 3])
    assert torch.allclose(batch.logprobs.grad, expected)


def test_grpo_clip_zeroes_gradient_where_the_rule_says():
    # ratio e^{0.5} ≈ 1.65 > 1.2 with A > 0: clipped, no gradient. Same ratio with A < 0: unclipped, gradient.
    lp = torch.tensor([[0.0], [0.0]], requires_grad=True)
    batch = gepo.LossBatch(logprobs=lp, mask=torch.ones(2, 1), behaviour_logprobs=torch.full((2, 1), -0.5),
                           advantages=torch.tensor([1.0, -1.0]))
    config = gepo.make_loss_config("grpo", {"clip_eps": 0.2, "advantage": "given"})
    loss, metrics = gepo.get_loss("grpo").fn(batch, config)
    loss.backward()
    assert lp.grad[0, 0] == 0.0
    assert lp.grad[1, 0].item() == pytest.approx(math.exp(0.5) / 2)
    assert loss.item() == pytest.approx((-1.2 + math.exp(0.5)) / 2)
    assert metrics["is/clip_frac"] == pytest.approx(0.5)


def test_padding_garbage_has_no_influence():
    clean = _batch(behaviour_logprobs=torch.zeros(2, 3), advantages=torch.tensor([1.0, -1.0]))
    dirty_lp = clean.logprobs.detach().clone()
    dirty_lp[0, 2] = float("nan")
    dirty_lp.requires_grad_(True)
    behaviour = torch.zeros(2, 3)
    behaviour[0, 2] = float("inf")
    dirty = gepo.LossBatch(logprobs=dirty_lp, mask=clean.mask, behaviour_logprobs=behaviour,
                           advantages=clean.advantages)
    for name, options in (("cross_entropy", {}), ("importance_sampling", {}), ("grpo", {"advantage": "given"})):
        a, _ = gepo.get_loss(name).fn(clean, gepo.make_loss_config(name, options))
        b, _ = gepo.get_loss(name).fn(dirty, gepo.make_loss_config(name, options))
        assert torch.isfinite(b) and b.item() == pytest.approx(a.item())


def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 7, 7, 7])
    centred = gepo.group_centered(rewards, groups)
    assert torch.allclose(centred, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))
    normed = gepo.group_normalized(rewards, groups)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased std of (1, 0, 0)
    assert normed[0].item() == pytest.approx((2 / 3) / (std + 1e-6))
    assert torch.all(normed[3:] == 0)  # a group that scored alike has no signal


def test_bad_inputs_are_named():
    with pytest.raises(gepo.LossInputError, match="mask shape"):
        gepo.LossBatch(logprobs=torch.zeros(2, 3), mask=torch.ones(2, 2))
    with pytest.raises(gepo.LossInputError, match="no completion token"):
        gepo.LossBatch(logprobs=torch.zeros(2, 3), mask=torch.tensor([[1.0, 0, 0], [0, 0, 0]]))
    with pytest.raises(gepo.LossInputError, match="advantages must be"):
        gepo.LossBatch(logprobs=torch.zeros(2, 3), mask=torch.ones(2, 3), advantages=torch.zeros(3))
    with pytest.raises(KeyError, match="registered losses"):
        gepo.get_loss("nope")
    with pytest.raises(ValueError, match="no option"):
        gepo.make_loss_config("grpo", {"eps": 0.1})
