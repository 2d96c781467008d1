"""The staleness-tolerant losses of 2026 that the main RL systems ship: DPPO (prime-rl's default loss; verl,
SkyRL), VESPO (TRL), SAPO (verl, AReaL, SkyRL, TRL) and Trust Region Masking (verl's rollout correction).

Notation as in gepo.losses: r_it = exp(log p_it − log q_it), sg(·) = stop-gradient, A_i the advantage, m_it the
mask, |y_i| = Σ_t m_it; here also p_it = exp(log p_it) and q_it = exp(log q_it), the probabilities of the sampled
token themselves. Each body is the formula in its docstring, written from the formula as the loss's authors state
it in their code and documentation (the papers themselves could not be read here); what could not be established
that way is said in the docstring.
"""

from __future__ import annotations

import math

import torch

from gepo.advantages import advantages_for
from gepo.batch import LossBatch, masked_mean, masked_sum
from gepo.diagnostics import SEQ_LOG_RATIO_CLIP, rl_metrics
from gepo.loss_configs import DPPOKLConfig, DPPOTVConfig, SAPOConfig, TRMConfig, VESPOConfig
from gepo.losses import clipped_surrogate, sequence_mean, token_fraction
from gepo.registry import register_loss

# log r above which SAPO's gate reads r clamped: for any τ above 1e-6, σ(τ·(e^20 − 1)) rounds to 1 and its slope to 0
# in double precision, so the clamp changes no value and no gradient, and keeps exp finite in float32
LOG_RATIO_SATURATED = 20.0


# ---------------------------------------------------------------------------- DPPO: a trust region on probabilities


def binary_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """KL(Bern(q) ‖ Bern(p)) = q·(log q − log p) + (1 − q)·(log(1 − q) − log(1 − p)): "this token or another" under
    the sampler and the learner. xlogy makes 0·log 0 = 0 (q = 1); a learner at p = 1 with q < 1 gives inf."""
    not_q, not_p = -torch.expm1(log_q), -torch.expm1(log_p)
    return torch.exp(log_q) * (log_q - log_p) + torch.xlogy(not_q, not_q) - torch.xlogy(not_q, not_p)


def _dppo(batch: LossBatch, config: DPPOTVConfig, divergence: str):
    """The DPPO objective with the mask of ``divergence`` ("tv" or "kl"); see ``dppo_tv`` and ``dppo_kl``."""
    logp, logq = batch.token("logprobs"), batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)[:, None]
    log_ratio = (logp - logq).detach()
    moved = torch.exp(logp.detach()) - torch.exp(logq)  # p − q
    if divergence == "tv":
        up, down = moved > config.delta_high, moved < -config.delta_low
    else:
        kl = binary_kl(logq, logp.detach())
        up, down = (moved > 0) & (kl > config.delta_high), (moved < 0) & (kl > config.delta_low)
    masked = torch.where(advantages > 0, up, down)
    log_cap = math.log(config.ratio_cap)
    weight = torch.exp(log_ratio.clamp(max=log_cap))
    per_token = torch.where(masked, torch.zeros_like(logp), -weight * advantages * logp)
    loss = masked_mean(per_token, batch.mask)
    fractions = {"is/mask_frac": token_fraction(masked, batch.mask),
                 "is/clip_frac": token_fraction(log_ratio > log_cap, batch.mask)}  # r above the cap C
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, fractions)


@register_loss("dppo_tv", DPPOTVConfig)
def dppo_tv(batch: LossBatch, config: DPPOTVConfig):
    """DPPO-Binary-TV (Qi et al. 2026, arXiv 2602.04879): mask a token once its probability, not its ratio, has moved
    past δ in the direction its advantage pushes.

    M_it = 1[p_it − q_it > δ_high] if A_i > 0,  1[p_it − q_it < −δ_low] otherwise       (no gradient)
    L = Σ_{i,t} m_it · −(1 − M_it) · sg(min(r_it, C)) · A_i · log p_it / Σ_{i,t} m_it
    |p − q| is the total variation between "this token or another" under the sampler and the learner: a rare token
    may move far in ratio, a likely one only a little. Its gradient is −(1 − M)·min(r, C)·A·∇log p, PPO's
    unclipped one where the token is inside the region. The paper's Top-K variants need the sampler's top-K
    log-probs of every position, which trajectories do not carry: only the binary ones are here.
    """
    return _dppo(batch, config, "tv")


@register_loss("dppo_kl", DPPOKLConfig)
def dppo_kl(batch: LossBatch, config: DPPOKLConfig):
    """DPPO-Binary-KL (Qi et al. 2026, arXiv 2602.04879): DPPO's mask with the binary KL in place of the TV.

    D_it = q_it·log(q_it/p_it) + (1 − q_it)·log((1 − q_it)/(1 − p_it))                  (KL_bin(q‖p), no gradient)
    M_it = 1[p_it > q_it and D_it > δ_high] if A_i > 0,  1[p_it < q_it and D_it > δ_low] otherwise
    L = Σ_{i,t} m_it · −(1 − M_it) · sg(min(r_it, C)) · A_i · log p_it / Σ_{i,t} m_it
    """
    return _dppo(batch, config, "kl")


# ---------------------------------------------------------------------------- soft reshaping of the ratio


@register_loss("vespo", VESPOConfig)
def vespo(batch: LossBatch, config: VESPOConfig):
    """VESPO (Shen et al. 2026, arXiv 2602.10693): a gamma-shaped weight of the whole sequence's importance ratio,
    not length-normalised, in place of any clip.

    log w_i = Σ_t log r_it                       (the sequence ratio w_i = Π_t r_it, in log space, no gradient)
    φ(w) = w^k · e^{λ·(1 − w)},  (k, λ) = (k_pos, λ_pos) if A_i ≥ 0, else (k_neg, λ_neg);   φ(1) = 1
    L = Σ_{i,t} m_it · −sg(φ(w_i)) · A_i · log p_it / Σ_{i,t} m_it
    log φ = k·log w + λ·(1 − w) is formed in log space, so a far-off sequence gets φ → 0, never inf. The authors
    also clamp each log r_it and log w_i to [−20, 20] (TRL: [log 1e-8, 20]); that changes φ only where |log w| > 20,
    where at their k and λ it is below 1e-14 either way.
    """
    logp, logq = batch.token("logprobs"), batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    log_w = masked_sum(logp - logq, batch.mask, dim=-1).detach()
    positive = advantages >= 0
    k = torch.full_like(log_w, config.k_neg).masked_fill(positive, config.k_pos)
    lam = torch.full_like(log_w, config.lambda_neg).masked_fill(positive, config.lambda_pos)
    phi = torch.exp(k * log_w + lam * (1 - torch.exp(log_w)))
    loss = masked_mean(-(phi * advantages)[:, None] * logp, batch.mask)
    rows = torch.ones_like(positive)
    shown = log_w.clamp(-SEQ_LOG_RATIO_CLIP, SEQ_LOG_RATIO_CLIP)  # as ratio/seq_*: e^50 stands for any larger w
    return loss, rl_metrics(batch, loss, shown, rows, {"is/phi_mean": phi.mean()})


@register_loss("sapo", SAPOConfig)
def sapo(batch: LossBatch, config: SAPOConfig):
    """SAPO (Qwen team 2025, arXiv 2511.20347): a smooth, temperature-controlled gate on the token ratio in place of
    PPO's hard clip.

    f(r) = (4/τ) · σ(τ·(r − 1)),   τ = τ_pos if A_i > 0, else τ_neg
    L = mean_i (1/|y_i|) Σ_t −f(r_it) · A_i
    Its gradient is −4·σ(1 − σ)·r·A·∇log p: on-policy (r = 1, σ = ½) exactly GRPO's, fading smoothly as r leaves 1,
    faster for negative advantages (τ_neg > τ_pos). is/gate_mean is the mean of 4·σ(1 − σ), 1 on-policy.
    """
    log_ratio = batch.token("logprobs") - batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)[:, None]
    tau = torch.full_like(advantages, config.tau_neg).masked_fill(advantages > 0, config.tau_pos)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio.clamp(max=LOG_RATIO_SATURATED)) - 1))
    loss = sequence_mean(-(4 / tau) * gate * advantages, batch.mask).mean()
    slope = (4 * gate * (1 - gate)).detach()
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, {"is/gate_mean": masked_mean(slope, batch.mask)})


# ---------------------------------------------------------------------------- sequence masking


@register_loss("trm", TRMConfig)
def trm(batch: LossBatch, config: TRMConfig):
    """Trust Region Masking (Li et al. 2025, arXiv 2512.23075): GRPO's clipped surrogate, with a whole sequence
    dropped once any of its tokens has left the trust region.

    D_i = max_t ½(log r_it)²                     (detects the largest token KL; symmetric in r ↔ 1/r)
    K_i = (1/|y_i|) Σ_t (r_it − 1 − log r_it)     (k3: the mean token KL(q‖p), unbiased; only if δ_mean is set)
    M_i = 1[D_i ≤ δ_max] · 1[K_i ≤ δ_mean]       (no gradient)
    L = Σ_{i,t} m_it · M_i · −min(r_it·A_i, clip(r_it, 1−ε, 1+ε_high)·A_i) / Σ_{i,t} m_it
    The paper's guarantee is for the exact KL of the next-token distributions, which needs the sampler's logits;
    from the sampled tokens alone its authors use such detectors (verl PR #4544). Which statistic and threshold the
    paper's experiments used could not be established here: the defaults are verl's (see TRMConfig). A dropped
    sequence's tokens stay in the denominator, so dropping one never raises the weight of the others.
    """
    log_ratio = batch.token("logprobs") - batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    eps_high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
    per_token, clipped = clipped_surrogate(log_ratio, advantages[:, None], config.clip_eps, eps_high)
    drift = log_ratio.detach()
    masked = torch.zeros_like(advantages, dtype=torch.bool)
    if config.max_divergence is not None:
        masked |= (0.5 * drift**2).amax(dim=-1) > config.max_divergence  # padding's log r is 0
    if config.mean_divergence is not None:
        masked |= sequence_mean(torch.expm1(drift) - drift, batch.mask) > config.mean_divergence
    per_token = torch.where(masked[:, None], torch.zeros_like(per_token), per_token)
    loss = masked_mean(per_token, batch.mask)
    fractions = {"is/clip_frac": token_fraction(clipped, batch.mask),
                 "is/mask_frac": masked.to(drift.dtype).mean()}  # of sequences
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, fractions)
