"""Policy losses. Each body is the formula in its docstring.

Notation: per completion token t of sequence i, log p = learner (with gradient),
log q = behaviour (sampler), r_t = exp(log p − log q), m = completion mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gepo.batch import LossBatch, masked_mean
from gepo.registry import register_loss


def _kl_metrics(batch: LossBatch) -> dict[str, float]:
    """Learner↔sampler KL(q‖p) per token, estimated on the sampled tokens (Schulman's k1, k3).

    k1 = mean(log q − log p);  k3 = mean(ρ − 1 − log ρ) with ρ = p/q (unbiased, never negative).
    """
    delta = (batch.behaviour_logprobs - batch.logprobs).detach()  # log q − log p
    k3 = torch.expm1(-delta) + delta  # r − 1 − log r with r = p/q
    return {
        "kl/k1": float(masked_mean(delta, batch.mask)),
        "kl/k3": float(masked_mean(k3, batch.mask)),
    }


@dataclass
class CrossEntropyConfig:
    """No options: supervised next-token loss."""


@register_loss("cross_entropy", CrossEntropyConfig)
def cross_entropy(batch: LossBatch, config: CrossEntropyConfig):
    """L = − Σ_{i,t} m_it · log p_it / Σ m   (token mean over the batch)."""
    loss = -masked_mean(batch.logprobs, batch.mask)
    return loss, {"loss/nll": float(loss.detach()), "tokens": float(batch.mask.sum())}


@dataclass
class ImportanceSamplingConfig:
    """No options: the plain (unclipped) importance-sampling policy gradient."""


@register_loss("importance_sampling", ImportanceSamplingConfig)
def importance_sampling(batch: LossBatch, config: ImportanceSamplingConfig):
    """L = − Σ m_it · r_it · A_i / Σ m,  r = exp(log p − log q).

    Its gradient is the on-policy policy gradient re-weighted to the sampler's
    distribution; with p = q it is the REINFORCE gradient with baseline.
    """
    batch.require("behaviour_logprobs", "advantages")
    ratio = torch.exp(batch.logprobs - batch.behaviour_logprobs)
    loss = -masked_mean(ratio * batch.advantages[:, None], batch.mask)
    metrics = {"loss/policy": float(loss.detach()), "is/ratio_mean": float(masked_mean(ratio.detach(), batch.mask))}
    return loss, metrics | _kl_metrics(batch)


@dataclass
class GRPOConfig:
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # asymmetric clip (DAPO "clip-higher"); None = clip_eps


@register_loss("grpo", GRPOConfig)
def grpo(batch: LossBatch, config: GRPOConfig):
    """GRPO (Shao et al. 2024, DeepSeekMath) with a PPO token-level clip.

    L = mean_i [ (1/|y_i|) Σ_t −min(r_it·A_i, clip(r_it, 1−ε, 1+ε_high)·A_i) ]
    A_i must already be group-normalised ((r − mean_G) / std_G).
    """
    batch.require("behaviour_logprobs", "advantages")
    eps_high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
    ratio = torch.exp(batch.logprobs - batch.behaviour_logprobs)
    advantages = batch.advantages[:, None]
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - config.clip_eps, 1 + eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = masked_mean(per_token, batch.mask, dim=-1).mean()
    clipped_frac = masked_mean((clipped < unclipped).to(ratio.dtype).detach(), batch.mask)
    metrics = {
        "loss/policy": float(loss.detach()),
        "is/ratio_mean": float(masked_mean(ratio.detach(), batch.mask)),
        "is/ratio_max": float(torch.where(batch.mask > 0, ratio.detach(), torch.zeros_like(ratio)).max()),
        "is/clip_frac": float(clipped_frac),
    }
    return loss, metrics | _kl_metrics(batch)
