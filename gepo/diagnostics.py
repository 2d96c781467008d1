"""Diagnostics every RL loss returns, with stable names grouped by `/`.

    is/weight_mean, is/weight_var, is/weight_max   the loss's raw importance weights (per token or per
                                                   sequence, see each loss) before any clip, truncation or
                                                   mask; how often the loss intervened is is/clip_frac or
                                                   is/mask_frac
    is/ess                                         effective sample size normalised to [0, 1]: (Σw)² / (N·Σw²)
    kl/k1, kl/k3                                   learner↔sampler KL(q‖p) per token, Schulman's estimators
    staleness/mean, staleness/max                  current_version − token version, when versions are given

All are computed without gradient, in float64 and from log weights, so that a
weight of e^50 gives a large number, not inf or NaN.
"""

from __future__ import annotations

import math

import torch

from gepo.batch import LossBatch


def weight_metrics(log_weights: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    """Mean, variance, max and normalised ESS of w = exp(log_weights) over the entries where ``keep``."""
    log_w = log_weights.detach().double()[keep]
    n = log_w.numel()
    log_sum = torch.logsumexp(log_w, 0)
    mean = torch.exp(log_sum - math.log(n))
    weights = torch.exp(log_w)
    ess = torch.exp(2 * log_sum - math.log(n) - torch.logsumexp(2 * log_w, 0))
    return {
        "is/weight_mean": float(mean),
        "is/weight_var": float(((weights - mean) ** 2).mean()),
        "is/weight_max": float(weights.max()),
        "is/ess": float(ess),
    }


def kl_metrics(batch: LossBatch) -> dict[str, float]:
    """KL(q‖p) per token on the sampled tokens: k1 = mean(log q − log p); k3 = mean(ρ − 1 − log ρ), ρ = p/q.

    k3 is unbiased and never negative (Schulman 2020, "Approximating KL divergence").
    """
    delta = (batch.token("behaviour_logprobs") - batch.token("logprobs")).detach().double()  # log q − log p
    mask = batch.mask.double()
    k1 = (delta * mask).sum() / mask.sum()
    k3 = ((torch.expm1(-delta) + delta) * mask).sum() / mask.sum()
    return {"kl/k1": float(k1), "kl/k3": float(k3)}


def staleness_metrics(batch: LossBatch) -> dict[str, float]:
    """Token staleness in versions, current_version − policy_version; {} when versions were not given."""
    if batch.policy_versions is None:
        return {}
    staleness = (batch.resolved_current_version() - batch.policy_versions[batch.keep]).double()
    return {"staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max())}


def rl_metrics(batch: LossBatch, policy_loss: torch.Tensor, log_weights: torch.Tensor, keep: torch.Tensor,
               fractions: dict[str, torch.Tensor]) -> dict[str, float]:
    """The common set: loss/policy, is/*, kl/*, staleness/*, and the loss's clip/mask fractions."""
    return {
        "loss/policy": float(policy_loss.detach()),
        **weight_metrics(log_weights, keep),
        **{name: float(value) for name, value in fractions.items()},
        **kl_metrics(batch),
        **staleness_metrics(batch),
    }
