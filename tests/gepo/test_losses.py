"""The loss library pinned by hand-computed values, invariants, safety cases, bad input and the registry.

Hand values are worked out in the comments; float64 throughout so they hold to 1e-12.
"""

import math
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import gepo
from tests.conftest import REPO

F64 = torch.float64
LN = math.log


def run(name, batch, **options):
    return gepo.get_loss(name).fn(batch, gepo.make_loss_config(name, options))


def leaf(rows):
    return torch.tensor(rows, dtype=F64, requires_grad=True)


def batch_of(lp, lq, mask=None, **kw):
    lp = leaf(lp) if not isinstance(lp, torch.Tensor) else lp
    lq = torch.tensor(lq, dtype=F64) if not isinstance(lq, torch.Tensor) else lq
    mask = torch.ones_like(lq) if mask is None else torch.tensor(mask, dtype=F64)
    kw = {k: torch.tensor(v, dtype=torch.long if k in ("group_ids", "policy_versions") else F64)
          if isinstance(v, list) else v for k, v in kw.items()}
    return gepo.LossBatch(logprobs=lp, mask=mask, behaviour_logprobs=lq, **kw)


# ------------------------------------------------------------------------------------------------ GEPO by hand


def gepo_example():
    # length-normalised q = (0.5, 0.25, 0.25); row 2 has a padded second token full of garbage
    nan = float("nan")
    lq = [[LN(.5), LN(.5)], [LN(.25), LN(.25)], [LN(.25), nan]]
    return batch_of([row[:] for row in lq], lq, [[1, 1], [1, 1], [1, 0]], rewards=[1.0, 0.0, 1.0], group_ids=[4, 4, 4])


def test_gepo_by_hand():
    batch = gepo_example()
    loss, m = run("gepo", batch)
    # D = Σq²/Σq = (.25 + .0625 + .0625)/1 = .375;  w = q/D = (4/3, 2/3, 2/3)  (on-policy, yet w ≠ 1)
    # A = r − mean r = (1/3, −2/3, 1/3)
    # row 0: w > 1.2, A > 0  → clipped: −1.2·(1/3) = −0.4
    # row 1: w < 0.8, A < 0  → clipped: −min(−4/9, 0.8·(−2/3)) = +8/15
    # row 2: inside the band → −w·A = −2/9
    assert loss.item() == pytest.approx((-0.4 + 8 / 15 - 2 / 9) / 3, abs=1e-12)  # = −4/135
    assert m["is/clip_frac"] == pytest.approx(2 / 3)
    assert m["is/weight_mean"] == pytest.approx(8 / 9)  # (Σq)²/(G·Σq²) = 1/(3·.375)
    assert m["is/weight_mean_qweighted"] == pytest.approx(1.0)  # .5·4/3 + .25·2/3 + .25·2/3
    assert m["is/weight_var"] == pytest.approx(8 / 81)  # ((4/9)² + 2·(2/9)²)/3
    assert m["is/weight_var_qweighted"] == pytest.approx(1 / 9)  # .5·(1/3)² + .5·(1/3)²
    assert m["is/weight_max"] == pytest.approx(4 / 3)
    assert m["is/ess"] == pytest.approx(8 / 9)  # (8/3)² / (3·(16/9 + 4/9 + 4/9))
    loss.backward()
    # clipped rows have no gradient; row 2: dL/dlog p = −(1/B)·w·A/|y| = −(1/3)(2/3)(1/3)/1
    expected = torch.tensor([[0, 0], [0, 0], [-2 / 27, 0]], dtype=F64)
    assert torch.equal(batch.logprobs.grad == 0, expected == 0)
    assert torch.allclose(batch.logprobs.grad, expected, atol=1e-15)


def test_gepo_kl_term_by_hand():
    # equal rewards: A = 0, so only β·KL moves the gradient
    batch = batch_of([[-1.0, -1.0]], [[-1.5, -0.5]], rewards=[1.0], group_ids=[0])
    loss, m = run("gepo", batch, kl_beta=0.005)
    kl = ((math.exp(-0.5) + 0.5 - 1) + (math.exp(0.5) - 0.5 - 1)) / 2  # mean_t e^{q−p} − (q−p) − 1
    assert m["loss/kl"] == pytest.approx(kl)
    assert loss.item() == pytest.approx(m["loss/policy"] + 0.005 * kl)
    loss.backward()
    # d/dlog p [e^{q−p} − (q−p) − 1] = 1 − e^{q−p}, times β/|y|
    expected = 0.005 * (1 - torch.exp(torch.tensor([[-0.5, 0.5]], dtype=F64))) / 2
    assert torch.allclose(batch.logprobs.grad, expected, atol=1e-15)


def test_gepo_on_policy_invariants_random():
    gen = torch.Generator().manual_seed(3)
    lq = -3 * torch.rand(12, 5, generator=gen, dtype=F64)
    groups = torch.arange(12) // 4
    batch = batch_of(lq.clone(), lq, rewards=torch.rand(12, generator=gen, dtype=F64), group_ids=groups)
    _, m = run("gepo", batch)
    q = lq.mean(-1).exp().view(3, 4)
    plain = ((q.sum(-1) ** 2) / (4 * (q**2).sum(-1))).mean()  # per group (Σq)²/(G·Σq²), equal groups
    assert m["is/weight_mean"] == pytest.approx(float(plain), rel=1e-12)
    assert m["is/weight_mean_qweighted"] == pytest.approx(1.0, rel=1e-12)


def test_group_by_prompt_never_mixes_prompts():
    gen = torch.Generator().manual_seed(0)
    lq = -2 * torch.rand(6, 4, generator=gen, dtype=F64)
    lp = lq + 0.1 * torch.randn(6, 4, generator=gen, dtype=F64)
    rewards, groups = torch.tensor([1.0, 0, 1, 0, 1, 1], dtype=F64), torch.tensor([0, 0, 0, 1, 1, 1])
    perturbed = lq.clone()
    perturbed[3:] -= 1.5  # prompt 1's sampler was very different

    def grads(behaviour, group_by):
        batch = batch_of(lp.clone().requires_grad_(True), behaviour, rewards=rewards, group_ids=groups)
        loss, _ = run("gepo", batch, group_by=group_by, clip_eps=10.0)  # no clipping: every grad depends on w
        loss.backward()
        return batch.logprobs.grad

    assert torch.equal(grads(lq, "prompt")[:3], grads(perturbed, "prompt")[:3])
    # the authors' batch-wide normaliser does mix them (so the check above can fail)
    assert not torch.allclose(grads(lq, "batch")[:3], grads(perturbed, "batch")[:3])


def test_uneven_non_contiguous_groups_are_each_their_own_group():
    gen = torch.Generator().manual_seed(1)
    lq = -2 * torch.rand(8, 3, generator=gen, dtype=F64)
    lp = lq + 0.2 * torch.randn(8, 3, generator=gen, dtype=F64)
    rewards = torch.rand(8, generator=gen, dtype=F64)
    groups = torch.tensor([5, 9, 5, 9, 9, 5, 9, 9])  # 3 rows of prompt 5, 5 of prompt 9, interleaved
    whole, _ = run("gepo", batch_of(lp.clone().requires_grad_(True), lq, rewards=rewards, group_ids=groups))
    parts = []
    for g in (5, 9):
        rows = groups == g
        loss, _ = run("gepo", batch_of(lp[rows].clone().requires_grad_(True), lq[rows], rewards=rewards[rows],
                                       group_ids=groups[rows]))
        parts.append(int(rows.sum()) * loss.item())
    assert whole.item() == pytest.approx(sum(parts) / 8, rel=1e-12)  # L = mean over rows


def test_gepo_defensive_switches_per_sequence():
    gen = torch.Generator().manual_seed(2)
    lq = -2 * torch.rand(4, 6, generator=gen, dtype=F64)
    rewards, groups = torch.tensor([1.0, 0, 0, 1], dtype=F64), torch.zeros(4, dtype=torch.long)
    # on-policy: every KL_i = 0 < 0.002 → GSPO weight p/q = 1 exactly
    _, m = run("gepo_defensive", batch_of(lq.clone(), lq, rewards=rewards, group_ids=groups))
    assert m["is/defensive_frac"] == 1.0 and m["is/weight_mean"] == 1.0 and m["is/weight_max"] == 1.0
    # far off-policy: every KL_i ≫ 0.002 → exactly GEPO
    lp = lq + torch.randn(4, 6, generator=gen, dtype=F64)
    drifted, m = run("gepo_defensive", batch_of(lp.clone().requires_grad_(True), lq, rewards=rewards, group_ids=groups))
    plain, _ = run("gepo", batch_of(lp.clone().requires_grad_(True), lq, rewards=rewards, group_ids=groups))
    assert m["is/defensive_frac"] == 0.0 and drifted.item() == plain.item()


# ------------------------------------------------------------------------------------------------ baselines by hand


def test_on_policy_grpo_and_gspo_ratios_are_exactly_one():
    gen = torch.Generator().manual_seed(4)
    lq = -5 * torch.rand(6, 7, generator=gen)
    for name in ("grpo", "gspo"):
        _, m = run(name, batch_of(lq.clone().requires_grad_(True), lq, rewards=torch.rand(6, generator=gen),
                                  group_ids=torch.arange(6) // 3))
        assert (m["is/weight_mean"], m["is/weight_max"], m["is/weight_var"], m["is/ess"]) == (1.0, 1.0, 0.0, 1.0)
        assert m["is/clip_frac"] == 0.0 and m["kl/k1"] == 0.0 and m["kl/k3"] == 0.0


def test_gspo_by_hand():
    log_r = [[0.001, 0.0], [-0.0002, 0.0]]
    lq = [[-1.0, -1.0], [-1.0, -1.0]]
    batch = batch_of([[q + r for q, r in zip(qs, rs)] for qs, rs in zip(lq, log_r)], lq, rewards=[1.0, 0.0],
                     group_ids=[0, 0])
    loss, m = run("gspo", batch)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # group-normalised: ±0.5 / (unbiased std of (1, 0) + 1e-6)
    s1 = math.exp(-0.0001)  # s_i = exp(mean_t log r): s_0 = e^0.0005 > 1 + 4e-4 (clipped), s_1 inside
    assert loss.item() == pytest.approx((-(1 + 4e-4) * a + s1 * a) / 2, abs=1e-12)
    assert m["is/clip_frac"] == 0.5
    loss.backward()
    # row 1: dL/dlog p_t = −(1/B)·s·A/|y| = s1·a/4 on both tokens; row 0 clipped, no gradient
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[0, 0], [s1 * a / 4] * 2], dtype=F64), atol=1e-15)
    # its own defaults are GSPO's 3e-4/4e-4; overridable, e.g. to the GEPO paper's 0.2
    assert (gepo.make_loss_config("gspo").clip_eps_low, gepo.make_loss_config("gspo").clip_eps_high) == (3e-4, 4e-4)
    loss, m = run("gspo", batch, clip_eps_low=0.2, clip_eps_high=0.2)
    assert m["is/clip_frac"] == 0.0


def test_dr_grpo_by_hand():
    batch = batch_of([[-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0]], [[-1.0, -1.0, 5.0], [-2.0, -2.0, -2.0]],
                     [[1, 1, 0], [1, 1, 1]], rewards=[1.0, 0.0], group_ids=[0, 0])
    # on-policy (r = 1), A = (0.5, −0.5): Σ token losses = 2·(−0.5) + 3·(+0.5) = 0.5
    assert run("dr_grpo", batch)[0].item() == pytest.approx(0.5 / (2 * 3))  # B · T
    loss, _ = run("dr_grpo", batch, max_completion_len=4)
    assert loss.item() == pytest.approx(0.5 / (2 * 4))
    loss.backward()
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[-0.5 / 8] * 2 + [0], [0.5 / 8] * 3], dtype=F64))


def test_bnpo_advantages_by_hand():
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 1, 1, 1, 0], dtype=F64)
    groups = torch.arange(16) // 4  # group means .25, .5, .5, .75
    # μ = .5, σ² = (.25² + 0 + 0 + .25²)/3 = 1/24; k = μ(1−μ)/σ² − 1 = 5; a = b = 2.5; α = β = 1 + 2.5/3
    alpha = 1 + 2.5 / 3
    log_beta_fn = 2 * math.lgamma(alpha) - math.lgamma(2 * alpha)

    def weight(mean):  # 1 / BetaPDF(mean; α, α)
        return math.exp(log_beta_fn - (alpha - 1) * (LN(mean) + LN(1 - mean)))

    adv = gepo.bnpo(rewards, groups)
    assert adv[0].item() == pytest.approx(weight(0.25) * 0.75)
    assert adv[5].item() == pytest.approx(weight(0.5) * 0.5)
    assert adv[15].item() == pytest.approx(weight(0.75) * -0.75)
    # one group: no spread of group means to fit a Beta → α = β = 1, plain centring
    assert torch.allclose(gepo.bnpo(rewards[:4], groups[:4]), rewards[:4] - 0.25)


def test_raw_reward_advantage_is_cross_entropy_on_the_successes():
    """A = r with 0/1 rewards: on-policy GRPO's gradient is minus the mean-token log-prob gradient of the
    successful rows only; failed rows get none."""
    lp = torch.tensor([[-0.5, -1.0], [-0.2, -0.3], [-2.0, -0.1]], dtype=F64, requires_grad=True)
    batch = gepo.LossBatch(logprobs=lp, mask=torch.ones(3, 2, dtype=F64), behaviour_logprobs=lp.detach().clone(),
                           rewards=torch.tensor([1.0, 0.0, 1.0], dtype=F64), group_ids=torch.tensor([0, 0, 1]))
    assert torch.equal(gepo.raw_reward(batch.rewards, batch.group_ids), batch.rewards)
    loss, _ = run("grpo", batch, advantage="raw_reward")
    loss.backward()
    rows = lp.grad.abs().sum(-1)
    assert rows[1].item() == 0 and rows[0].item() > 0 and rows[2].item() > 0
    assert torch.allclose(lp.grad[0], lp.grad[2]) and (lp.grad[[0, 2]] < 0).all()


def test_bnpo_loss_by_hand():
    batch = batch_of([[-1.0, -1.0], [-1.0, 0.0]], [[-1.0, -1.0], [-1.0, 0.0]], [[1, 1], [1, 0]],
                     advantages=[2.0, -1.0])
    # on-policy: Σ token losses / Σ tokens = (−2 − 2 + 1)/3
    assert run("bnpo", batch, advantage="given")[0].item() == pytest.approx(-1.0)


def test_dapo_is_the_token_mean_with_clip_higher_and_bnpo_with_group_normalized_advantages():
    batch = batch_of([[-1.0, -1.0], [-1.0, 0.0]], [[-1.0, -1.0], [-1.0, 0.0]], [[1, 1], [1, 0]],
                     advantages=[2.0, -1.0])
    # every token weighs the same: (−2 − 2 + 1) / 3, where GRPO's per-sequence mean gives (−2 + 1) / 2
    assert run("dapo", batch, advantage="given")[0].item() == pytest.approx(-1.0)
    assert run("grpo", batch, advantage="given")[0].item() == pytest.approx(-0.5)
    gen = torch.Generator().manual_seed(8)
    lq = -torch.rand(6, 4, generator=gen, dtype=F64)
    lp = lq + 0.3 * torch.randn(6, 4, generator=gen, dtype=F64)
    mask = (torch.rand(6, 4, generator=gen) > 0.2).to(F64).tolist()
    rewards, groups = torch.tensor([1.0, 0, 0, 1, 1, 0], dtype=F64), torch.tensor([0, 0, 0, 1, 1, 1])
    dapo, _ = run("dapo", batch_of(lp, lq, mask, rewards=rewards, group_ids=groups))
    bnpo, _ = run("bnpo", batch_of(lp, lq, mask, rewards=rewards, group_ids=groups), advantage="group_normalized")
    assert dapo.item() == pytest.approx(bnpo.item(), abs=1e-14)
    # clip-higher: a ratio of 1.25 on a positive advantage is clipped at 1.2 by default, not at 1.28
    high = batch_of([[LN(1.25)]], [[0.0]], advantages=[1.0])
    assert run("dapo", high, advantage="given")[1]["is/clip_frac"] == 1.0
    assert run("dapo", high, advantage="given", clip_eps_high=0.28)[1]["is/clip_frac"] == 0.0


def test_tis_by_hand():
    lp = [[-1.0, -2.0]]
    lq = [[-1.0 - LN(3), -2.0]]  # r = (3, 1)
    batch = batch_of(lp, lq, advantages=[0.5])
    loss, m = run("tis", batch, advantage="given")
    # token: mean_t −min(r, 2)·A·log p = (−2·.5·(−1) − 1·.5·(−2))/2 = 1
    assert loss.item() == pytest.approx(1.0) and m["is/clip_frac"] == 0.5
    loss.backward()
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[-2 * 0.5 / 2, -1 * 0.5 / 2]], dtype=F64))
    batch = batch_of(lp, lq, advantages=[0.5])
    loss, m = run("tis", batch, advantage="given", level="sequence")
    # sequence: ρ = 3·1 → 2;  −2·.5·mean(−1, −2) = 1.5
    assert loss.item() == pytest.approx(1.5) and m["is/clip_frac"] == 1.0
    loss.backward()
    assert torch.allclose(batch.logprobs.grad, torch.full((1, 2), -0.5, dtype=F64))


def test_icepop_by_hand():
    lp = [[-1.0, -1.0, -1.0, -1.0]]
    lq = [[-1.0 - LN(r) for r in (0.4, 1.0, 6.0, 2.0)]]
    batch = batch_of(lp, lq, advantages=[1.0])
    loss, m = run("icepop", batch, advantage="given")
    # keep r in [0.5, 5]: tokens 1 and 3;  mean_t −M·r·A = (−1 − 2)/4
    assert loss.item() == pytest.approx(-0.75) and m["is/mask_frac"] == 0.5
    loss.backward()
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[0, -0.25, 0, -0.5]], dtype=F64))


def test_m2po_by_hand():
    log_r = [0.1, -0.2, 0.3, 1.0]  # (log r)² = .01, .04, .09, 1: running means .01, .025, .0467, … → keep 2
    batch = batch_of([[-1.0 + x for x in log_r]], [[-1.0] * 4], advantages=[1.0])
    loss, m = run("m2po", batch, advantage="given")
    assert loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(-0.2)) / 4)  # Σ kept −r·A / Σ tokens
    assert m["is/mask_frac"] == 0.5
    loss.backward()
    assert torch.allclose(batch.logprobs.grad,
                          torch.tensor([[-math.exp(0.1) / 4, -math.exp(-0.2) / 4, 0, 0]], dtype=F64))
    _, m = run("m2po", batch_of([[-1.0 + x for x in log_r]], [[-1.0] * 4], advantages=[1.0]),
               advantage="given", m2_threshold=1.0)
    assert m["is/mask_frac"] == 0.0  # mean (log r)² = .285 ≤ 1: nothing dropped


def test_opsm_by_hand():
    # three rows, two tokens each, advantages given (1, -1, -1); clip 0.2
    # row 0: A > 0, drifted (KL = .5 > δ)        → kept:   log r = (−.5, −.5), r = e^−.5 < .8 → −min(rA, .8A) = −r
    # row 1: A < 0, drifted (KL = mean(.3, .1) = .2) → masked: contributes 0 (and no gradient)
    # row 2: A < 0, on-policy (KL = 0 ≤ δ)       → kept:   r = 1 → −min(−1, −1) = +1 per token
    lq = [[-1.0, -1.0], [-1.0, -1.0], [-2.0, -2.0]]
    lp = [[-1.5, -1.5], [-1.3, -1.1], [-2.0, -2.0]]
    batch = batch_of(lp, lq, advantages=[1.0, -1.0, -1.0])
    loss, m = run("opsm", batch, advantage="given")
    assert loss.item() == pytest.approx((-math.exp(-0.5) + 0 + 1) / 3, abs=1e-12)
    assert m["is/mask_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # row 0: d/dlogp of −r over its mean of 2 tokens, /3 rows; row 1: zero; row 2: −r·A/2/3 = +1/6 per token
    expected = torch.tensor([[-math.exp(-0.5) / 6] * 2, [0.0, 0.0], [1 / 6, 1 / 6]], dtype=F64)
    assert torch.allclose(batch.logprobs.grad, expected, atol=1e-12)
    # with δ above row 1's KL nothing is masked and OPSM is exactly GRPO
    same = dict(advantages=[1.0, -1.0, -1.0])
    loose, m = run("opsm", batch_of(lp, lq, **same), advantage="given", delta=0.25)
    plain, _ = run("grpo", batch_of(lp, lq, **same), advantage="given")
    assert m["is/mask_frac"] == 0.0 and loose.item() == plain.item()
    # a drifted row with a positive advantage is never masked, however far it drifted
    _, m = run("opsm", batch_of([[-9.0, -9.0]], [[-1.0, -1.0]], advantages=[1.0]), advantage="given")
    assert m["is/mask_frac"] == 0.0


def test_cispo_by_hand():
    lp = [[-0.5, -1.0, -2.0]]
    batch = batch_of(lp, [[p - LN(r) for p, r in zip(lp[0], (5.0, 0.1, 1.0))]], advantages=[1.0])
    loss, m = run("cispo", batch, advantage="given")
    # weights clip(r, 0, 4) = (4, .1, 1): no lower bound by default; Σ −w·A·log p / 3
    assert loss.item() == pytest.approx(-(4 * -0.5 + 0.1 * -1.0 + 1 * -2.0) / 3)
    assert m["is/clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[-4 / 3, -0.1 / 3, -1 / 3]], dtype=F64))


def test_decoupled_ppo_by_hand():
    # proximal given: u = p/π_prox = e^{0.1}, b = π_prox/q = e^{0.5}, A = 1 → inside the clip: −b·u·A
    batch = batch_of([[-1.0]], [[-1.6]], advantages=[1.0], proximal_logprobs=torch.tensor([[-1.1]], dtype=F64))
    loss, m = run("decoupled_ppo", batch, advantage="given")
    assert loss.item() == pytest.approx(-math.exp(0.5) * math.exp(0.1))
    assert m["is/behaviour_weight_mean"] == pytest.approx(math.exp(0.5))
    loss.backward()
    assert batch.logprobs.grad.item() == pytest.approx(-math.exp(0.6))  # b is a stop-gradient
    assert run("decoupled_ppo", batch_of([[-1.0]], [[-1.6]], advantages=[1.0], proximal_logprobs=torch.tensor(
        [[-1.1]], dtype=F64)), advantage="given", behaviour_weight_cap=1.5)[1]["is/mask_frac"] == 1.0


def test_decoupled_ppo_interpolates_the_proximal_policy_by_version():
    gen = torch.Generator().manual_seed(5)
    lq = -2 * torch.rand(2, 3, generator=gen, dtype=F64)
    lp = lq + 0.3 * torch.randn(2, 3, generator=gen, dtype=F64)
    versions = [[1, 1, 2], [3, 3, 3]]  # current version 3: staleness 2, 2, 1 / 0, 0, 0
    got, _ = run("decoupled_ppo", batch_of(lp.clone().requires_grad_(True), lq, advantages=[1.0, -1.0],
                                           policy_versions=versions, current_version=3), advantage="given")
    alpha = torch.tensor([[2 / 3, 2 / 3, 1 / 2], [0, 0, 0]], dtype=F64)  # (v − v_t)/(v + 1 − v_t)
    proximal = lq + alpha * (lp - lq)
    want, _ = run("decoupled_ppo", batch_of(lp.clone().requires_grad_(True), lq, advantages=[1.0, -1.0],
                                            proximal_logprobs=proximal), advantage="given")
    assert got.item() == pytest.approx(want.item(), abs=1e-14)
    # all tokens on-policy → π_prox = q, b = 1: exactly the token-mean clipped loss (BNPO's form)
    on_policy = batch_of(lp.clone().requires_grad_(True), lq, advantages=[1.0, -1.0], policy_versions=[[3] * 3] * 2)
    bnpo_form = batch_of(lp.clone().requires_grad_(True), lq, advantages=[1.0, -1.0])
    assert run("decoupled_ppo", on_policy, advantage="given")[0].item() == \
        pytest.approx(run("bnpo", bnpo_form, advantage="given")[0].item(), abs=1e-14)


def test_grpo_default_estimates_group_normalized_advantages():
    gen = torch.Generator().manual_seed(6)
    lq = -torch.rand(6, 4, generator=gen, dtype=F64)
    lp = lq + 0.1 * torch.randn(6, 4, generator=gen, dtype=F64)
    rewards, groups = torch.tensor([1.0, 0, 0, 1, 1, 0], dtype=F64), torch.tensor([0, 0, 0, 1, 1, 1])
    est, _ = run("grpo", batch_of(lp.clone().requires_grad_(True), lq, rewards=rewards, group_ids=groups))
    given, _ = run("grpo", batch_of(lp.clone().requires_grad_(True), lq, advantages=gepo.group_normalized(
        rewards, groups)), advantage="given")
    centred, _ = run("grpo", batch_of(lp.clone().requires_grad_(True), lq, rewards=rewards, group_ids=groups),
                     advantage="group_centered")
    assert est.item() == given.item() and est.item() != centred.item()


def test_clipping_zeroes_the_gradient_exactly_where_the_rule_says():
    gen = torch.Generator().manual_seed(7)
    lq = -torch.rand(40, 3, generator=gen, dtype=F64)
    lp = lq + 0.4 * torch.randn(40, 3, generator=gen, dtype=F64)
    adv = torch.randn(40, generator=gen, dtype=F64)
    eps = 0.2
    for name, opts in (("grpo", {}), ("dr_grpo", {}), ("bnpo", {}), ("dapo", {})):
        batch = batch_of(lp.clone().requires_grad_(True), lq, advantages=adv)
        loss, m = run(name, batch, advantage="given", **opts)
        loss.backward()
        r, a = (lp - lq).exp(), adv[:, None]
        rule = ((a > 0) & (r > 1 + eps)) | ((a < 0) & (r < 1 - eps))
        assert 0 < rule.sum() < rule.numel()
        assert torch.equal(batch.logprobs.grad == 0, rule), name
        assert m["is/clip_frac"] == pytest.approx(float(rule.double().mean()))
    # sequence-level: GSPO's s_i and GEPO's w_i obey the same rule per row
    groups = torch.arange(40) // 4
    for name, opts in (("gspo", {"clip_eps_low": 0.05, "clip_eps_high": 0.05}), ("gepo", {})):
        batch = batch_of(lp.clone().requires_grad_(True), lq, advantages=adv, group_ids=groups)
        loss, _ = run(name, batch, advantage="given", **opts)
        loss.backward()
        if name == "gspo":
            w, lo, hi = (lp - lq).mean(-1).exp(), 0.95, 1.05
        else:
            lq_seq = lq.mean(-1).view(10, 4)
            log_d = (torch.logsumexp(2 * lq_seq, -1) - torch.logsumexp(lq_seq, -1)).repeat_interleave(4)
            w, lo, hi = (lp.mean(-1) - log_d).exp(), 0.8, 1.2
        rule = ((adv > 0) & (w > hi)) | ((adv < 0) & (w < lo))
        assert 0 < rule.sum() < rule.numel(), name
        assert torch.equal((batch.logprobs.grad == 0).all(-1), rule), name


# ------------------------------------------------------------------------------------------------ safety


def all_losses():
    return [n for n in gepo.loss_names()]


def long_hostile_batch(garbage: bool, dtype=torch.float32):
    """T = 4096, behaviour log-probs down to −50 per token, one sequence dominating its group."""
    gen = torch.Generator().manual_seed(8)
    B, T = 8, 4096
    lengths = torch.tensor([4096, 4000, 3000, 17, 4096, 1, 2048, 100])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(dtype)
    lq = -50 * torch.rand(B, T, generator=gen).to(dtype)
    lq[0] = -0.01  # dominates group 0: q_0 = e^{−0.01}, the others ≈ e^{−25}
    lp = (-10 * torch.rand(B, T, generator=gen)).to(dtype)
    versions = torch.randint(0, 5, (B, T), generator=gen)
    if garbage:
        pad = mask == 0
        lp, lq = lp.masked_fill(pad, float("nan")), lq.masked_fill(pad, float("-inf"))
        lp[pad & (torch.arange(T) % 2 == 0)] = float("inf")
        versions = versions.masked_fill(pad, 10**9)
    return dict(logprobs=lp, mask=mask, behaviour_logprobs=lq, rewards=torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1]),
                group_ids=torch.arange(B) // 4, policy_versions=versions, current_version=4,
                advantages=torch.tensor([1.0, -1, -1, 1, 0.5, 0.5, -1.5, 0.5]))


@pytest.mark.parametrize("name", all_losses())
def test_long_hostile_batches_give_finite_losses_and_padding_has_no_influence(name):
    results = []
    for garbage in (False, True):
        fields = long_hostile_batch(garbage)
        fields["logprobs"].requires_grad_(True)
        loss, metrics = gepo.get_loss(name).fn(gepo.LossBatch(**fields), gepo.make_loss_config(name))
        loss.backward()
        grad = fields["logprobs"].grad
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), name
        assert all(math.isfinite(v) for v in metrics.values()), (name, metrics)
        assert (grad[fields["mask"] == 0] == 0).all()
        results.append((loss.item(), grad))
    assert results[0][0] == results[1][0]  # garbage in padding changes nothing, to the last bit
    assert torch.equal(results[0][1], results[1][1])


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_inputs_are_errors_naming_the_field_and_the_fix():
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(gepo.LossInputError, match="behaviour_logprobs shape"):
        gepo.LossBatch(logprobs=lp, mask=mask, behaviour_logprobs=torch.zeros(2, 4))
    with pytest.raises(gepo.LossInputError, match=r"rewards must be \(2,\)"):
        gepo.LossBatch(logprobs=lp, mask=mask, rewards=torch.zeros(2, 1))
    with pytest.raises(gepo.LossInputError, match="no completion token"):
        gepo.LossBatch(logprobs=lp, mask=torch.zeros(2, 3))
    nan_rows = torch.zeros(2, 3)
    nan_rows[1, 0] = float("nan")
    with pytest.raises(gepo.LossInputError, match=r"behaviour_logprobs is NaN/inf on completion tokens of rows \[1\]"):
        gepo.LossBatch(logprobs=lp, mask=mask, behaviour_logprobs=nan_rows)
    gepo.LossBatch(logprobs=lp, mask=torch.tensor([[1.0, 1, 1], [0, 1, 1]]), behaviour_logprobs=nan_rows)  # padding
    with pytest.raises(gepo.LossInputError, match="rewards is NaN/inf"):
        gepo.LossBatch(logprobs=lp, mask=mask, rewards=torch.tensor([1.0, float("inf")]))
    with pytest.raises(gepo.LossInputError, match="group_ids must hold integers"):
        gepo.LossBatch(logprobs=lp, mask=mask, group_ids=torch.tensor([0.0, 1.0]))
    with pytest.raises(gepo.LossInputError, match="newer than the learner"):
        gepo.LossBatch(logprobs=lp, mask=mask, policy_versions=torch.full((2, 3), 5), current_version=4)
    lp4, mask4 = torch.zeros(4, 3), torch.ones(4, 3)
    with pytest.raises(gepo.LossInputError, match="group_size is 2 but group 7 has 3, group 9 has 1 rows"):
        gepo.LossBatch(logprobs=lp4, mask=mask4, group_ids=torch.tensor([7, 7, 9, 7]), group_size=2)
    with pytest.raises(gepo.LossInputError, match="group_size is given but group_ids is not"):
        gepo.LossBatch(logprobs=lp4, mask=mask4, group_size=2)
    gepo.LossBatch(logprobs=lp4, mask=mask4, group_ids=torch.tensor([7, 9, 9, 7]), group_size=2)  # even: fine

    batch = gepo.LossBatch(logprobs=lp, mask=mask, rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]))
    with pytest.raises(gepo.LossInputError, match="needs `behaviour_logprobs`.*sampler's per-token log-probs"):
        run("grpo", batch)
    batch = gepo.LossBatch(logprobs=lp, mask=mask, behaviour_logprobs=lp, advantages=torch.ones(2),
                           group_ids=torch.tensor([0, 0]))
    with pytest.raises(gepo.LossInputError, match="needs `rewards`.*advantage='given'"):
        run("gepo", batch)
    batch = gepo.LossBatch(logprobs=lp, mask=mask, behaviour_logprobs=lp, advantages=torch.ones(2))
    with pytest.raises(gepo.LossInputError, match="needs `group_ids`"):
        run("gepo", batch, advantage="given")
    with pytest.raises(gepo.LossInputError, match="`proximal_logprobs`.*or `policy_versions`"):
        run("decoupled_ppo", batch, advantage="given")
    batch = gepo.LossBatch(logprobs=lp, mask=mask, behaviour_logprobs=lp, rewards=torch.tensor([2.0, 0.0]),
                           group_ids=torch.tensor([0, 0]))
    with pytest.raises(gepo.LossInputError, match=r"rewards in \[0, 1\]"):
        run("bnpo", batch)


def test_bad_options_are_errors_listing_the_choices():
    with pytest.raises(ValueError, match="advantage='std'.*group_centered, group_normalized, bnpo, raw_reward, given"):
        gepo.make_loss_config("gepo", {"advantage": "std"})
    with pytest.raises(ValueError, match="group_by='prompts'.*'prompt', 'batch'"):
        gepo.make_loss_config("gepo", {"group_by": "prompts"})
    with pytest.raises(ValueError, match="level='seq'"):
        gepo.make_loss_config("tis", {"level": "seq"})
    with pytest.raises(ValueError, match="clip_eps=-0.1: must be >= 0"):
        gepo.make_loss_config("grpo", {"clip_eps": -0.1})
    with pytest.raises(ValueError, match=r"no option\(s\) \['eps'\]; its options are"):
        gepo.make_loss_config("gepo", {"eps": 0.1})


# ------------------------------------------------------------------------------------------------ registry


def test_registry_lists_names_and_takes_user_losses():
    for name in ("gepo", "gepo_defensive", "grpo", "dapo", "dr_grpo", "bnpo", "gspo", "tis", "icepop", "m2po", "cispo",
                 "opsm", "decoupled_ppo", "importance_sampling", "cross_entropy"):
        assert name in gepo.loss_names()
    with pytest.raises(KeyError, match="unknown loss 'gepo2'; registered losses: bnpo, cispo"):
        gepo.get_loss("gepo2")

    @dataclass
    class DoubledConfig:
        factor: float = 2.0

    @gepo.register_loss("test_doubled_nll", DoubledConfig)
    def doubled(batch, config):
        loss = -config.factor * gepo.masked_mean(batch.token("logprobs"), batch.mask)
        return loss, {"loss/doubled": float(loss.detach())}

    batch = gepo.LossBatch(logprobs=torch.tensor([[-1.0, -3.0]]), mask=torch.ones(1, 2))
    assert "test_doubled_nll" in gepo.loss_names()
    assert run("test_doubled_nll", batch, factor=3.0)[0].item() == pytest.approx(6.0)
    with pytest.raises(ValueError, match="already registered"):
        gepo.register_loss("test_doubled_nll", DoubledConfig)(doubled)

    @gepo.register_loss("test_nan_loss", DoubledConfig)
    def broken(batch, config):
        return batch.logprobs.sum() * float("nan"), {}

    with pytest.raises(gepo.LossInputError, match="loss 'test_nan_loss' is nan"):
        run("test_nan_loss", batch)


def test_every_rl_loss_reports_the_stable_diagnostics():
    fields = long_hostile_batch(False)
    fields = {k: (v[:, :64] if isinstance(v, torch.Tensor) and v.dim() == 2 else v) for k, v in fields.items()}
    fields["mask"][:, 0] = 1
    common = {"loss/policy", "is/weight_mean", "is/weight_var", "is/weight_max", "is/ess", "kl/k1", "kl/k3",
              "staleness/mean", "staleness/max"}
    for name in gepo.loss_names():
        if name in ("cross_entropy",) or name.startswith("test_"):
            continue
        _, m = run(name, gepo.LossBatch(**fields))
        assert common <= set(m), (name, common - set(m))
        soft = {"sapo": "is/gate_mean", "vespo": "is/phi_mean"}.get(name)  # reshape every weight: no clip, no mask
        assert "is/clip_frac" in m or "is/mask_frac" in m or soft in m or name == "importance_sampling", name
        assert 0 <= m["is/ess"] <= 1
    _, m = run("gepo", gepo.LossBatch(**fields))
    assert {"is/weight_mean_qweighted", "is/weight_var_qweighted"} <= set(m)
    # staleness = current_version − token version over completion tokens
    versions, keep = fields["policy_versions"], fields["mask"] > 0
    assert m["staleness/mean"] == pytest.approx(float((4 - versions[keep]).double().mean()))
    assert m["staleness/max"] == float((4 - versions[keep]).max())


def test_a_config_is_checked_without_torch_and_the_builtin_names_stay_reserved():
    """The names, configs and registry import no torch: a process that only checks a run's config (``heterorl
    train``'s launcher, ``heterorl tasks``, a refused command line) never pays for it. The built-in losses register
    on the first ``get_loss``; a loss of your own cannot take a built-in name even before that."""
    code = """
import sys
from dataclasses import dataclass
import gepo, heterorl.cli
from heterorl.config import load_config
cfg = load_config(overrides=["loss.name=dr_grpo", "loss.options.clip_eps=0.3"])
assert gepo.make_loss_config("gepo_defensive", {"kl_threshold": 0.01}).kl_threshold == 0.01
assert "m2po" in gepo.loss_names() and "torch" not in sys.modules, sorted(m for m in sys.modules if "torch" in m)
@dataclass
class Mine:
    pass
try:
    gepo.register_loss("gepo", Mine)(lambda batch, config: None)
    raise SystemExit("a built-in name was taken")
except ValueError as exc:
    assert "already registered" in str(exc)
assert gepo.get_loss("gepo").config_cls is gepo.loss_config_class("gepo") and "torch" in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
