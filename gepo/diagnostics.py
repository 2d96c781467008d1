"""Diagnostics every RL loss returns, with stable names grouped by `/`.

    is/weight_mean, is/weight_var, is/weight_max   the loss's raw importance weights (per token or per
                                                   sequence, see each loss) before any clip, truncation or
                                                   mask; how often the loss intervened is is/clip_frac or
                                                   is/mask_frac
    is/ess                                         effective sample size normalised to [0, 1]: (Σw)² / (N·Σw²)
    ratio/token_mean, _var, _max                   the token ratio p/q (learner over sampler) of every kept token,
    ratio/seq_mean, _var, _max, _ess               the sequence ratio Π_t p/q of every row (its log clipped to
                                                   ±50): the same quantities for
                                                   every loss, whatever weight it uses (is/* is each loss's own,
                                                   e.g. GEPO's group weight, GRPO's token ratio), so losses compare
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


SEQ_LOG_RATIO_CLIP = 50.0


def ratio_metrics(batch: LossBatch) -> dict[str, float]:
    """The learner/sampler ratio p/q, per token and per sequence (Π over the row's kept tokens), in the same
    terms for every loss: mean, variance and max (and the sequence ratio's normalised ESS)."""
    delta = (batch.token("logprobs") - batch.token("behaviour_logprobs")).detach().double()  # log p − log q
    delta = torch.where(batch.keep, delta, torch.zeros_like(delta))
    rows = batch.keep.any(dim=1)
    token = weight_metrics(delta, batch.keep)
    # a long row's log ratio can pass ±700, where exp overflows even float64: clipped at ±50, a ratio beyond
    # e^50 ≈ 5·10^21 reads as e^50 (and its variance stays finite)
    sequence = weight_metrics(delta.sum(dim=1).clamp(-SEQ_LOG_RATIO_CLIP, SEQ_LOG_RATIO_CLIP), rows)
    return {**{name.replace("is/weight_", "ratio/token_"): value for name, value in token.items() if name != "is/ess"},
            **{name.replace("is/weight_", "ratio/seq_").replace("is/ess", "ratio/seq_ess"): value
               for name, value in sequence.items()}}


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
        **ratio_metrics(batch),
        **kl_metrics(batch),
        **staleness_metrics(batch),
    }
