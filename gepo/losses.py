"""Policy losses. Each body is the formula in its docstring.

Notation: sequence i (of B) in group g(i) (the rows of one prompt), completion
token t, m_it the mask (padding has no influence), |y_i| = Σ_t m_it;
log p = learner (with gradient), log q = behaviour (sampler, data);
r_it = exp(log p_it − log q_it); sg(·) = stop-gradient; A_i the advantage,
from the estimator named by the config's ``advantage`` (see gepo.advantages).

Every loss returns (loss, metrics); the RL ones report the metrics of
gepo.diagnostics (loss/policy, is/*, kl/*, staleness/*). Per-token inputs are
read through ``batch.token(...)``, which zeroes padding before any exp.
"""

from __future__ import annotations

import torch

from gepo.advantages import advantages_for
from gepo.batch import LossBatch, LossInputError, masked_mean, masked_sum
from gepo.diagnostics import rl_metrics
from gepo.groups import group_index, segment_logsumexp
from gepo.loss_configs import (
    BNPOConfig,
    CISPOConfig,
    CrossEntropyConfig,
    DAPOConfig,
    DecoupledPPOConfig,
    DrGRPOConfig,
    GEPOConfig,
    GEPODefensiveConfig,
    GRPOConfig,
    GSPOConfig,
    IcePopConfig,
    ImportanceSamplingConfig,
    M2POConfig,
    OPSMConfig,
    TISConfig,
)
from gepo.registry import register_loss


def clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float):
    """PPO's clipped objective, negated: −min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A), ρ = exp(log_ratio).

    Also returns where the clip is active, i.e. where the gradient is exactly zero:
    (A > 0 and ρ > 1+ε_high) or (A < 0 and ρ < 1−ε_low).
    """
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def token_fraction(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The (mask-weighted) fraction of completion tokens where ``flags`` holds: a clip or mask fraction."""
    return masked_mean(flags.to(mask.dtype), mask)


# ---------------------------------------------------------------------------- session primitives


@register_loss("cross_entropy", CrossEntropyConfig)
def cross_entropy(batch: LossBatch, config: CrossEntropyConfig):
    """Supervised next-token cross-entropy (SFT), the session primitive.

    L = − Σ_{i,t} m_it · log p_it / Σ m   (token mean over the batch)
    """
    loss = -masked_mean(batch.token("logprobs"), batch.mask)
    return loss, {"loss/nll": float(loss.detach()), "tokens": float(batch.mask.sum())}


@register_loss("importance_sampling", ImportanceSamplingConfig)
def importance_sampling(batch: LossBatch, config: ImportanceSamplingConfig):
    """The plain importance-sampling policy gradient, unclipped, the session primitive.

    L = − Σ m_it · r_it · A_i / Σ m
    Its gradient is the on-policy policy gradient re-weighted to the sampler's
    distribution; with p = q it is the REINFORCE gradient with baseline.
    """
    log_ratio = batch.token("logprobs") - batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    loss = -masked_mean(torch.exp(log_ratio) * advantages[:, None], batch.mask)
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, {})


# ---------------------------------------------------------------------------- token-ratio PPO family


@register_loss("grpo", GRPOConfig)
def grpo(batch: LossBatch, config: GRPOConfig):
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300) with a PPO token-level clip.

    L = mean_i (1/|y_i|) Σ_t −min(r_it·A_i, clip(r_it, 1−ε, 1+ε_high)·A_i),  A = (r − mean_G) / std_G
    """
    log_ratio = batch.token("logprobs") - batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    eps_high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
    per_token, clipped = clipped_surrogate(log_ratio, advantages[:, None], config.clip_eps, eps_high)
    loss = masked_mean(per_token, batch.mask, dim=-1).mean()
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, {"is/clip_frac": token_fraction(clipped, batch.mask)})


@register_loss("opsm", OPSMConfig)
def opsm(batch: LossBatch, config: OPSMConfig):
    """GRPO with off-policy sequence masking (DeepSeek-AI 2025, DeepSeek-V3.2, arXiv 2512.02556).

    KL_i = (1/|y_i|) Σ_t (log q_it − log p_it)       (sampler ‖ learner, per token, from the data itself)
    M_i  = 0 if A_i < 0 and sg(KL_i) > δ, else 1      (a stale sequence that would push probability down)
    L = mean_i M_i · (1/|y_i|) Σ_t −min(r_it·A_i, clip(r_it, 1−ε, 1+ε_high)·A_i)
    """
    log_ratio = batch.token("logprobs") - batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    eps_high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
    per_token, clipped = clipped_surrogate(log_ratio, advantages[:, None], config.clip_eps, eps_high)
    sequence_kl = -masked_mean(log_ratio.detach(), batch.mask, dim=-1)
    masked = (advantages < 0) & (sequence_kl > config.delta)
    loss = torch.where(masked, torch.zeros_like(sequence_kl), masked_mean(per_token, batch.mask, dim=-1)).mean()
    rows = batch.mask.sum(dim=-1) > 0
    fractions = {"is/clip_frac": token_fraction(clipped, batch.mask),
                 "is/mask_frac": masked[rows].to(batch.mask.dtype).mean()}  # of sequences
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, fractions)


@register_loss("dapo", DAPOConfig)
def dapo(batch: LossBatch, config: DAPOConfig):
    """DAPO's token-level policy loss (Yu et al. 2025, arXiv 2503.14476): every token of the batch weighs the same,
    so long completions are not down-weighted as in GRPO's per-sequence mean.

    L = Σ_{i,t} m_it · −min(r_it·A_i, clip(r_it, 1−ε, 1+ε_high)·A_i) / Σ_{i,t} m_it
    A = (r − mean_G) / std_G
    (TRL normalises by the active tokens of the whole accumulated batch; here, of the minibatch the loss sees.)
    """
    log_ratio = batch.token("logprobs") - batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    eps_high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
    per_token, clipped = clipped_surrogate(log_ratio, advantages[:, None], config.clip_eps, eps_high)
    loss = masked_mean(per_token, batch.mask)
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, {"is/clip_frac": token_fraction(clipped, batch.mask)})


@register_loss("dr_grpo", DrGRPOConfig)
def dr_grpo(batch: LossBatch, config: DrGRPOConfig):
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783).

    L = Σ_{i,t} −min(r_it·A_i, clip(r_it, 1−ε, 1+ε)·A_i) / (B · max_completion_len),  A = r − mean_G r
    A constant normaliser, so neither long nor short completions are favoured.
    """
    log_ratio = batch.token("logprobs") - batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    per_token, clipped = clipped_surrogate(log_ratio, advantages[:, None], config.clip_eps, config.clip_eps)
    length = config.max_completion_len or batch.logprobs.shape[1]
    loss = masked_sum(per_token, batch.mask) / (batch.logprobs.shape[0] * length)
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, {"is/clip_frac": token_fraction(clipped, batch.mask)})


@register_loss("bnpo", BNPOConfig)
def bnpo(batch: LossBatch, config: BNPOConfig):
    """BNPO (Xiao et al. 2025, arXiv 2506.02864), in the GEPO authors' form (arXiv 2508.17850).

    L = Σ_{i,t} m_it · −min(r_it·A_i, clip(r_it, 1−ε, 1+ε)·A_i) / Σ_{i,t} m_it
    A_i = w·(r_i − mean_G r), w = 1 / BetaPDF(mean_G r; α, β): see gepo.advantages.bnpo.
    """
    log_ratio = batch.token("logprobs") - batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    per_token, clipped = clipped_surrogate(log_ratio, advantages[:, None], config.clip_eps, config.clip_eps)
    loss = masked_mean(per_token, batch.mask)
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, {"is/clip_frac": token_fraction(clipped, batch.mask)})


def proximal_logprobs(batch: LossBatch, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """log π_prox per token (no gradient): ``batch.proximal_logprobs`` when given, else AReaL's log-linear
    interpolation by version between the behaviour policy and the current learner (its "loglinear" method):

      log π_prox = log q + α_t · (sg(log p) − log q),  α_t = (v − v_t) / (v + 1 − v_t)

    v = batch.current_version (the version of the weights the learner holds now, which is the proximal
    policy: π_θ becomes version v + 1 after this step), v_t = the token's version. On-policy tokens
    (v_t = v) get α = 0 and π_prox = q; older tokens lean toward the current learner.
    """
    if batch.proximal_logprobs is not None:
        return batch.token("proximal_logprobs")
    if batch.policy_versions is None:
        raise LossInputError("decoupled_ppo needs `proximal_logprobs` (B, T), or `policy_versions` (B, T) "
                             "(with `current_version`) to interpolate them; pass one of the two")
    staleness = (batch.resolved_current_version() - batch.policy_versions).to(logp.dtype)
    alpha = torch.where(batch.keep, staleness / (staleness + 1), torch.zeros_like(staleness))
    return logq + alpha * (logp.detach() - logq)


@register_loss("decoupled_ppo", DecoupledPPOConfig)
def decoupled_ppo(batch: LossBatch, config: DecoupledPPOConfig):
    """Decoupled PPO (Fu et al. 2025, AReaL, arXiv 2505.24298): trust region around a proximal policy,
    off-policy correction from the behaviour policy μ = q.

    u_it = exp(log p_it − log π_prox,it)          b_it = sg(exp(log π_prox,it − log q_it))
    L = Σ_{i,t} m_it · −b_it · min(u_it·A_i, clip(u_it, 1−ε, 1+ε)·A_i) / Σ_{i,t} m_it
    π_prox: see ``proximal_logprobs``. With behaviour_weight_cap c, tokens with b_it > c count as padding.
    """
    logp, logq = batch.token("logprobs"), batch.token("behaviour_logprobs")
    log_prox = proximal_logprobs(batch, logp, logq)
    advantages = advantages_for(batch, config.advantage)
    per_token, clipped = clipped_surrogate(logp - log_prox, advantages[:, None], config.clip_eps, config.clip_eps)
    behaviour_weight = torch.exp(log_prox - logq).detach()
    capped = torch.zeros_like(batch.keep)
    if config.behaviour_weight_cap is not None:
        capped = behaviour_weight > config.behaviour_weight_cap
    per_token = torch.where(capped, torch.zeros_like(per_token), behaviour_weight * per_token)
    loss = masked_mean(per_token, batch.mask)
    return loss, rl_metrics(batch, loss, logp - logq, batch.keep, {
        "is/clip_frac": token_fraction(clipped, batch.mask),
        "is/behaviour_weight_mean": masked_mean(behaviour_weight, batch.mask),
        "is/mask_frac": token_fraction(capped, batch.mask),
    })


# ---------------------------------------------------------------------------- importance-weight reshaping


@register_loss("tis", TISConfig)
def tis(batch: LossBatch, config: TISConfig):
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training", blog, no arXiv id; truncation after Ionides 2008) on the policy gradient.

    token:    L = mean_i (1/|y_i|) Σ_t −sg(min(r_it, C)) · A_i · log p_it
    sequence: L = mean_i −sg(min(ρ_i, C)) · A_i · (1/|y_i|) Σ_t log p_it,   ρ_i = Π_t r_it
    ρ_i is formed in log space, min(Σ_t log r_it, log C), and exponentiated only after the cap.
    """
    logp, logq = batch.token("logprobs"), batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    log_ratio = (logp - logq).detach()
    cap = torch.tensor(config.cap, dtype=logp.dtype).log()
    if config.level == "token":
        weight = torch.exp(log_ratio.clamp(max=cap))
        loss = masked_mean(-weight * advantages[:, None] * logp, batch.mask, dim=-1).mean()
        clipped = {"is/clip_frac": token_fraction(log_ratio > cap, batch.mask)}
        return loss, rl_metrics(batch, loss, log_ratio, batch.keep, clipped)
    log_rho = masked_sum(log_ratio, batch.mask, dim=-1)
    weight = torch.exp(log_rho.clamp(max=cap))
    loss = (-weight * advantages * masked_mean(logp, batch.mask, dim=-1)).mean()
    rows = torch.ones_like(log_rho, dtype=torch.bool)
    return loss, rl_metrics(batch, loss, log_rho, rows, {"is/clip_frac": (log_rho > cap).to(logp.dtype).mean()})


@register_loss("icepop", IcePopConfig)
def icepop(batch: LossBatch, config: IcePopConfig):
    """IcePop (Ling Team 2025, Ring-1T, arXiv 2510.18855): mask the tokens whose ratio left a band.

    M_it = 1[α ≤ sg(r_it) ≤ β]   (α = 0.5, β = 5)
    L = mean_i (1/|y_i|) Σ_t −M_it · r_it · A_i
    The gradient of a kept token is r_it·A_i·∇log p_it; masked tokens contribute nothing.
    """
    log_ratio = batch.token("logprobs") - batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    ratio = torch.exp(log_ratio)
    kept = (ratio.detach() >= config.ratio_low) & (ratio.detach() <= config.ratio_high)
    per_token = torch.where(kept, -ratio * advantages[:, None], torch.zeros_like(ratio))
    loss = masked_mean(per_token, batch.mask, dim=-1).mean()
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, {"is/mask_frac": token_fraction(~kept, batch.mask)})


def second_moment_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B, T) bool: the tokens M2PO keeps. Sort tokens by (log r)²; keep the longest prefix of the
    smallest whose (mask-weighted) mean (log r)² is ≤ threshold, i.e. drop the largest until it holds."""
    keep = mask > 0
    m2 = torch.where(keep, log_ratio.detach() ** 2, torch.full_like(log_ratio, torch.inf)).flatten()
    m2_sorted, order = m2.sort()
    weights = mask.flatten()[order]
    running_mean = torch.cumsum(torch.where(weights > 0, weights * m2_sorted, 0.0), 0) / \
        torch.cumsum(weights, 0).clamp(min=torch.finfo(mask.dtype).tiny)
    count = int(((running_mean <= threshold) & (weights > 0)).sum())  # running mean is non-decreasing
    kept = torch.zeros_like(m2, dtype=torch.bool)
    kept[order[:count]] = True
    return kept.view_as(log_ratio)


@register_loss("m2po", M2POConfig)
def m2po(batch: LossBatch, config: M2POConfig):
    """M2PO (Zheng et al. 2025, "Prosperity before Collapse", arXiv 2510.01161).

    M2_it = (log r_it)²;  M_it = 1 for the tokens kept by dropping the largest M2 until
    mean_{kept} M2 ≤ τ (τ = 0.04), over the whole batch
    L = Σ_{i,t} m_it · −M_it · r_it · A_i / Σ_{i,t} m_it      (no clip)
    """
    log_ratio = batch.token("logprobs") - batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    kept = second_moment_mask(log_ratio, batch.mask, config.m2_threshold)
    per_token = torch.where(kept, -torch.exp(log_ratio) * advantages[:, None], torch.zeros_like(log_ratio))
    loss = masked_mean(per_token, batch.mask)
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, {"is/mask_frac": token_fraction(~kept, batch.mask)})


@register_loss("cispo", CISPOConfig)
def cispo(batch: LossBatch, config: CISPOConfig):
    """CISPO (MiniMax 2025, MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update.

    L = Σ_{i,t} m_it · −sg(clip(r_it, 1−ε_low, 1+ε_high)) · A_i · log p_it / Σ_{i,t} m_it
    Every token keeps a gradient; the clip only bounds its coefficient.
    """
    logp, logq = batch.token("logprobs"), batch.token("behaviour_logprobs")
    advantages = advantages_for(batch, config.advantage)
    log_ratio = (logp - logq).detach()
    ratio = torch.exp(log_ratio)
    low, high = 1 - config.clip_eps_low, 1 + config.clip_eps_high
    loss = masked_mean(-ratio.clamp(low, high) * advantages[:, None] * logp, batch.mask)
    clipped = (ratio < low) | (ratio > high)
    return loss, rl_metrics(batch, loss, log_ratio, batch.keep, {"is/clip_frac": token_fraction(clipped, batch.mask)})


# ---------------------------------------------------------------------------- sequence-level weights


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) length-normalised sum: (1/|y_i|) Σ_t m_it · values_it."""
    return masked_mean(values, mask, dim=-1)


@register_loss("gspo", GSPOConfig)
def gspo(batch: LossBatch, config: GSPOConfig):
    """GSPO (Zheng et al. 2025, Qwen, arXiv 2507.18071): one length-normalised ratio per sequence.

    s_i = exp((1/|y_i|) Σ_t log r_it)
    L = mean_i −min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i)
    """
    log_s = sequence_mean(batch.token("logprobs") - batch.token("behaviour_logprobs"), batch.mask)
    advantages = advantages_for(batch, config.advantage)
    per_seq, clipped = clipped_surrogate(log_s, advantages, config.clip_eps_low, config.clip_eps_high)
    loss = per_seq.mean()
    rows = torch.ones_like(clipped)
    return loss, rl_metrics(batch, loss, log_s, rows, {"is/clip_frac": clipped.to(log_s.dtype).mean()})


def gepo_log_denominator(lq: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) log Ê_q[q] = log(Σ_j q_j² / Σ_j q_j) = logsumexp(2·ℓq) − logsumexp(ℓq), per group (no gradient)."""
    return segment_logsumexp(2 * lq, index, n) - segment_logsumexp(lq, index, n)


def _gepo_groups(batch: LossBatch, group_by: str) -> tuple[torch.Tensor, int]:
    if group_by == "batch":
        return torch.zeros(batch.logprobs.shape[0], dtype=torch.long, device=batch.logprobs.device), 1
    batch.require("group_ids")
    return group_index(batch.group_ids)


def _sequence_kl(logp: torch.Tensor, logq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) KL_i = (1/|y_i|) Σ_t [exp(log q − log p) − (log q − log p) − 1]   (the GEPO paper's learner↔sampler
    KL term, β = 0.005 in its heterogeneous runs; with gradient)."""
    delta = logq - logp
    return sequence_mean(torch.expm1(delta) - delta, mask)


def _gepo_objective(batch: LossBatch, config: GEPOConfig, logp, logq, log_w, index, n, extra: dict):
    """L = mean_i −min(w_i·A_i, clip(w_i, 1−ε, 1+ε)·A_i) + β · mean_i KL_i, and GEPO's metrics."""
    advantages = advantages_for(batch, config.advantage)
    per_seq, clipped = clipped_surrogate(log_w, advantages, config.clip_eps, config.clip_eps)
    policy = per_seq.mean()
    loss = policy
    if config.kl_beta > 0:  # skipped, not multiplied by 0, so that an overflowing KL cannot make 0·inf
        kl = _sequence_kl(logp, logq, batch.mask).mean()
        loss = policy + config.kl_beta * kl
        extra = extra | {"loss/kl": float(kl.detach())}
    # q̂-weighted moments: row i has probability q̂_i / n, q̂_i = q_i / Σ_{j in g(i)} q_j
    lq = sequence_mean(logq, batch.mask).detach().double()
    prob = torch.exp(lq - segment_logsumexp(lq, index, n)[index]) / n
    weights = torch.exp(log_w.detach().double())
    q_mean = (prob * weights).sum()
    rows = torch.ones_like(clipped)
    metrics = rl_metrics(batch, policy, log_w, rows, {"is/clip_frac": clipped.to(log_w.dtype).mean()})
    return loss, metrics | {
        "is/weight_mean_qweighted": float(q_mean),
        "is/weight_var_qweighted": float((prob * (weights - q_mean) ** 2).sum()),
    } | extra


@register_loss("gepo", GEPOConfig)
def gepo(batch: LossBatch, config: GEPOConfig):
    """GEPO (Zhang et al. 2025, arXiv 2508.17850): a group-expectation importance weight.

    ℓp_i = (1/|y_i|) Σ_t log p_it,   ℓq_i = (1/|y_i|) Σ_t log q_it       (length-normalised)
    log D_g = logsumexp_{j∈g}(2·ℓq_j) − logsumexp_{j∈g}(ℓq_j)             (= log Σq²/Σq, no gradient)
    w_i = exp(ℓp_i − log D_g(i))
    L = mean_i −min(w_i·A_i, clip(w_i, 1−ε, 1+ε)·A_i) + β · mean_i KL_i
    KL_i = (1/|y_i|) Σ_t [exp(log q − log p) − (log q − log p) − 1],  A_i = r_i − mean_G r
    g = the rows of one prompt (group_by="prompt") or the whole batch (group_by="batch").
    On-policy (p = q) w ≠ 1: its q̂-weighted mean is 1, its plain mean (Σq)²/(G·Σq²).
    """
    logp, logq = batch.token("logprobs"), batch.token("behaviour_logprobs")
    lp, lq = sequence_mean(logp, batch.mask), sequence_mean(logq, batch.mask)
    index, n = _gepo_groups(batch, config.group_by)
    log_w = lp - gepo_log_denominator(lq, index, n)[index]
    return _gepo_objective(batch, config, logp, logq, log_w, index, n, {})


@register_loss("gepo_defensive", GEPODefensiveConfig)
def gepo_defensive(batch: LossBatch, config: GEPODefensiveConfig):
    """Defensive GEPO (the GEPO authors' "gepo+", arXiv 2508.17850): per sequence, the GSPO weight
    while the learner is still close to the sampler on it, the GEPO weight once it has drifted.

    w_i = exp(ℓp_i − ℓq_i)        if sg(KL_i) < κ   (κ = 0.002)
    w_i = exp(ℓp_i − log D_g(i))  otherwise
    KL_i, ℓp, ℓq, log D and L as in ``gepo``.
    """
    logp, logq = batch.token("logprobs"), batch.token("behaviour_logprobs")
    lp, lq = sequence_mean(logp, batch.mask), sequence_mean(logq, batch.mask)
    index, n = _gepo_groups(batch, config.group_by)
    close = _sequence_kl(logp, logq, batch.mask).detach() < config.kl_threshold
    log_w = torch.where(close, lp - lq, lp - gepo_log_denominator(lq, index, n)[index])
    return _gepo_objective(batch, config, logp, logq, log_w, index, n,
                           {"is/defensive_frac": float(close.to(lp.dtype).mean())})

