"""Advantage estimators over groups of completions of the same prompt.

Every RL loss's config has an ``advantage`` field naming one of
``ADVANTAGE_ESTIMATORS`` (the loss then estimates A from ``batch.rewards`` and
``batch.group_ids``) or ``"given"`` (use ``batch.advantages`` as they are).
"""

from __future__ import annotations

import torch

from gepo.batch import LossBatch, LossInputError
from gepo.groups import group_index, segment_mean, segment_sum
from gepo.loss_configs import ADVANTAGE_CHOICES, ADVANTAGE_NAMES, check_advantage_name


def group_mean(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per row, the mean of ``values`` over the rows of its group."""
    index, n = group_index(group_ids)
    return segment_mean(values, index, n)[index]


def group_centered(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = r_i − mean_{j in group(i)} r_j  (GEPO, Dr.GRPO: no std division)."""
    return rewards - group_mean(rewards, group_ids)


def group_normalized(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i − mean_G r) / (std_G r + eps), std unbiased as in GRPO (arXiv 2402.03300)."""
    centred = group_centered(rewards, group_ids)
    index, n = group_index(group_ids)
    counts = segment_sum(torch.ones_like(rewards), index, n)
    std = (segment_sum(centred**2, index, n) / (counts - 1).clamp(min=1)).sqrt()
    return centred / (std[index] + eps)


def raw_reward(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = r_i: REINFORCE without a baseline. With 0/1 rewards only the successful completions carry
    gradient, so the update is cross-entropy on them (rejection-sampling fine-tuning, RAFT / ReST-EM): it
    never pushes probability away from a failed completion's tokens, which tolerates larger learning rates."""
    return rewards.clone()


def bnpo(rewards: torch.Tensor, group_ids: torch.Tensor, max_weight: float = 1e6) -> torch.Tensor:
    """BNPO's Beta re-weighting (Xiao et al. 2025, arXiv 2506.02864), as the GEPO authors ran it.

    A_i = w_g · (r_i − μ_g),  w_g = 1 / BetaPDF(μ_g; α, β) clamped to [0, max_weight], μ_g = mean_G r
    From the mean μ and (unbiased) variance σ² of the batch's group means μ_g:
      k = μ(1−μ)/σ² − 1,  a = k·μ,  b = k·(1−μ),  α = max(1 + a/3, 1),  β = max(1 + b/3, 1)
    Rewards must lie in [0, 1] (the Beta's support). With fewer than two groups, or group means that
    are all equal (σ² = 0), the fit is undefined and α = β = 1 (uniform: w = 1, plain group centring).
    """
    if bool(((rewards < 0) | (rewards > 1)).any()):
        raise LossInputError("advantage='bnpo' needs rewards in [0, 1] (the Beta's support); rescale the "
                             "rewards or pick another estimator (group_centered, group_normalized)")
    index, n = group_index(group_ids)
    means = segment_mean(rewards, index, n).double()
    alpha = beta = means.new_tensor(1.0)
    if n > 1 and float(means.var()) > 0:
        mu, var = means.mean(), means.var()
        k = mu * (1 - mu) / var - 1
        alpha = torch.clamp(1 + k * mu / 3, min=1.0)
        beta = torch.clamp(1 + k * (1 - mu) / 3, min=1.0)
    # log BetaPDF in log space; xlogy gives 0·log 0 = 0 where α = 1 or β = 1
    log_pdf = (torch.xlogy(alpha - 1, means) + torch.xlogy(beta - 1, 1 - means)
               + torch.lgamma(alpha + beta) - torch.lgamma(alpha) - torch.lgamma(beta))
    weight = torch.exp(-log_pdf).clamp(0.0, max_weight).to(rewards.dtype)
    return weight[index] * (rewards - means.to(rewards.dtype)[index])


ADVANTAGE_ESTIMATORS = dict(zip(ADVANTAGE_NAMES, (group_centered, group_normalized, bnpo, raw_reward), strict=True))
__all__ = ["ADVANTAGE_CHOICES", "ADVANTAGE_ESTIMATORS", "advantages_for", "check_advantage_name"]


def advantages_for(batch: LossBatch, estimator: str) -> torch.Tensor:
    """(B,) advantages: ``batch.advantages`` if ``estimator == "given"``, else estimated from rewards by group."""
    check_advantage_name(estimator)
    if estimator == "given":
        batch.require("advantages")
        return batch.advantages.to(batch.logprobs.dtype)
    batch.require("rewards", "group_ids")
    return ADVANTAGE_ESTIMATORS[estimator](batch.rewards.to(batch.logprobs.dtype), batch.group_ids)
