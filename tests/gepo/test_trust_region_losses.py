"""DPPO (TV, KL), VESPO, SAPO and TRM (gepo.trust_region_losses): each against an independent float64 transcription of
its formula, a plain loop over tokens with scalar math (the gradient through it by autograd), on random batches;
by hand where a rule is sharp (masks, caps, gates); against GRPO/DAPO on-policy, where each reduces to the plain
policy gradient; the authors' defaults pinned; bad options refused."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gepo
from gepo.trust_region_losses import binary_kl
from tests.gepo.test_properties import centred, ppo_term, random_batch, tokens

F64 = torch.float64
NEW = ("dppo_tv", "dppo_kl", "vespo", "sapo", "trm")


def run(name, batch, **options):
    return gepo.get_loss(name).fn(batch, gepo.make_loss_config(name, options))


def batch_of(lp, lq, advantages, mask=None):
    lp = torch.tensor(lp, dtype=F64, requires_grad=True)
    lq = torch.tensor(lq, dtype=F64)
    mask = torch.ones_like(lq) if mask is None else torch.tensor(mask, dtype=F64)
    return gepo.LossBatch(logprobs=lp, mask=mask, behaviour_logprobs=lq,
                          advantages=torch.tensor(advantages, dtype=F64))


# ------------------------------------------------------------------------------------------------ transcriptions


def ref_dppo(lp, lq, mask, rewards, group_ids, divergence="tv", low=0.15, high=0.15, cap=1e4):
    total, count = 0, 0
    for i in range(lp.shape[0]):
        a = centred(rewards, group_ids, i, normalise=False)
        for t in tokens(mask, i):
            p, q = math.exp(lp[i, t].item()), math.exp(lq[i, t].item())
            if divergence == "tv":
                out = p - q > high if a > 0 else p - q < -low
            else:
                kl = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
                out = (p > q and kl > high) if a > 0 else (p < q and kl > low)
            if not out:
                total = total - min(p / q, cap) * a * lp[i, t]
            count += 1
    return total / count


def ref_vespo(lp, lq, mask, rewards, group_ids, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    total, count = 0, 0
    for i in range(lp.shape[0]):
        a = centred(rewards, group_ids, i, normalise=True)
        w = 1.0
        for t in tokens(mask, i):
            w *= math.exp(lp[i, t].item() - lq[i, t].item())  # Π_t r_t (small batches: no overflow)
        k, lam = (k_pos, lam_pos) if a >= 0 else (k_neg, lam_neg)
        phi = w**k * math.exp(lam * (1 - w))
        for t in tokens(mask, i):
            total, count = total - phi * a * lp[i, t], count + 1
    return total / count


def ref_sapo(lp, lq, mask, rewards, group_ids, tau_pos=1.0, tau_neg=1.05):
    B = lp.shape[0]
    total = 0
    for i in range(B):
        a = centred(rewards, group_ids, i, normalise=True)
        tau = tau_pos if a > 0 else tau_neg
        ts = tokens(mask, i)
        gates = [(4 / tau) / (1 + torch.exp(-tau * (torch.exp(lp[i, t] - lq[i, t]) - 1))) for t in ts]
        total = total + sum(-g * a for g in gates) / len(ts)
    return total / B


def ref_trm(lp, lq, mask, rewards, group_ids, max_divergence=2.5, mean_divergence=None, eps=0.2):
    total, count = 0, 0
    for i in range(lp.shape[0]):
        a = centred(rewards, group_ids, i, normalise=True)
        ts = tokens(mask, i)
        log_r = [lp[i, t].item() - lq[i, t].item() for t in ts]
        dropped = max_divergence is not None and max(x * x / 2 for x in log_r) > max_divergence
        k3 = sum(math.exp(x) - 1 - x for x in log_r) / len(ts)
        dropped = dropped or (mean_divergence is not None and k3 > mean_divergence)
        for t in ts:
            if not dropped:
                total = total + ppo_term(torch.exp(lp[i, t] - lq[i, t]), a, 1 - eps, 1 + eps)
            count += 1
    return total / count


def log_probs(lp, lq, *rest):
    """The random batch with the learner's log-probs below 0, as log-probs are (the binary KL needs p < 1)."""
    return lp.clamp(max=-1e-3), lq, *rest


CASES = {  # name: (loss, reference, options); small thresholds so that the masks act on drift-0.3 batches
    "dppo_tv": ("dppo_tv", ref_dppo, {}),
    "dppo_tv_tight": ("dppo_tv", lambda *x: ref_dppo(*x, low=0.03, high=0.05, cap=1.2),
                      {"delta_low": 0.03, "delta_high": 0.05, "ratio_cap": 1.2}),
    "dppo_kl": ("dppo_kl", lambda *x: ref_dppo(*x, divergence="kl", low=0.05, high=0.05), {}),
    "dppo_kl_tight": ("dppo_kl", lambda *x: ref_dppo(*x, divergence="kl", low=0.002, high=0.004),
                      {"delta_low": 0.002, "delta_high": 0.004}),
    "vespo": ("vespo", ref_vespo, {}),
    "vespo_other": ("vespo", lambda *x: ref_vespo(*x, k_pos=0.5, lam_pos=0.7, k_neg=5.0, lam_neg=4.0),
                    {"k_pos": 0.5, "lambda_pos": 0.7, "k_neg": 5.0, "lambda_neg": 4.0}),
    "sapo": ("sapo", ref_sapo, {}),
    "sapo_hot": ("sapo", lambda *x: ref_sapo(*x, tau_pos=3.0, tau_neg=8.0), {"tau_pos": 3.0, "tau_neg": 8.0}),
    "trm": ("trm", ref_trm, {}),
    "trm_tight": ("trm", lambda *x: ref_trm(*x, max_divergence=0.1, mean_divergence=0.03),
                  {"max_divergence": 0.1, "mean_divergence": 0.03}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), groups=st.integers(1, 3), group_size=st.integers(1, 4),
       length=st.integers(1, 6))
def test_loss_and_gradient_match_the_transcription(case, seed, groups, group_size, length):
    name, reference, options = CASES[case]
    lp, lq, mask, rewards, group_ids = log_probs(*random_batch(seed, groups, group_size, length))
    lp_ref = lp.clone().requires_grad_(True)
    want = reference(lp_ref, lq, mask, rewards, group_ids)
    want = torch.as_tensor(want, dtype=F64)
    want_grad = torch.autograd.grad(want, lp_ref, allow_unused=True)[0] if want.requires_grad else None
    want_grad = torch.zeros_like(lp) if want_grad is None else want_grad

    lp_fast = lp.clone().requires_grad_(True)
    batch = gepo.LossBatch(logprobs=lp_fast, mask=mask, behaviour_logprobs=lq, rewards=rewards, group_ids=group_ids)
    got, _ = run(name, batch, **options)
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(lp_fast.grad, want_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["dppo_tv_tight", "dppo_kl_tight", "trm_tight"])
def test_the_transcription_cases_exercise_the_masks(case):
    """On one fixed batch of the random kind above, the tight settings mask some tokens (sequences) and keep
    others, so the equality above covers both branches."""
    name, _, options = CASES[case]
    lp, lq, mask, rewards, group_ids = log_probs(*random_batch(11, 3, 4, 6))
    batch = gepo.LossBatch(logprobs=lp, mask=mask, behaviour_logprobs=lq, rewards=rewards, group_ids=group_ids)
    _, m = run(name, batch, **options)
    assert 0 < m["is/mask_frac"] < 1


# ------------------------------------------------------------------------------------------------ on-policy


@pytest.mark.parametrize("name, same_as, same_value", [
    ("dppo_tv", "dapo", False), ("dppo_kl", "dapo", False),  # −A·log p: another value, the same gradient
    ("vespo", "dapo", False),
    ("sapo", "grpo", False),  # f(1) = 2/τ: another value, the same gradient
    ("trm", "dapo", True),  # nothing dropped: exactly DAPO's token-mean clipped loss
])
def test_on_policy_each_is_the_plain_policy_gradient(name, same_as, same_value):
    gen = torch.Generator().manual_seed(5)
    lq = -3 * torch.rand(8, 5, generator=gen, dtype=F64)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 4, 5, 2, 5, 3])[:, None]).to(F64)
    rewards = torch.tensor([1.0, 0, 0.5, 1, 0, 0, 1, 0.5], dtype=F64)
    groups = torch.arange(8) // 4
    advantage = gepo.make_loss_config(name).advantage  # compare at the new loss's own estimator

    def grad(loss_name):
        lp = lq.clone().requires_grad_(True)
        batch = gepo.LossBatch(logprobs=lp, mask=mask, behaviour_logprobs=lq, rewards=rewards, group_ids=groups)
        value, metrics = run(loss_name, batch, advantage=advantage)
        value.backward()
        return value, lp.grad, metrics

    value, got, metrics = grad(name)
    plain_value, want, _ = grad(same_as)
    assert want.abs().sum() > 0
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-15)
    assert (value.item() == pytest.approx(plain_value.item(), abs=1e-15)) == same_value
    assert metrics.get("is/mask_frac", 0.0) == 0.0
    assert metrics.get("is/phi_mean", 1.0) == 1.0 and metrics.get("is/gate_mean", 1.0) == 1.0


# ------------------------------------------------------------------------------------------------ by hand


def test_dppo_tv_masks_by_probability_in_the_advantage_direction_and_caps_the_ratio():
    # q = .5 everywhere; p = .7, .6, .3, .01 → p − q = .2, .1, −.2, −.49 (ratios 1.4, 1.2, .6, .02)
    ln = math.log
    p = [0.7, 0.6, 0.3, 0.01]
    batch = batch_of([[ln(x) for x in p]] * 2, [[ln(0.5)] * 4] * 2, advantages=[1.0, -1.0])
    loss, m = run("dppo_tv", batch, advantage="given")
    # A > 0 (row 0): token 0 moved up by .2 > .15 → masked; A < 0 (row 1): tokens 2, 3 moved down past −.15 → masked
    kept = [[False, True, True, True], [True, True, False, False]]
    assert m["is/mask_frac"] == pytest.approx(3 / 8)
    loss.backward()
    # d/dlog p of −sg(r)·A·log p over 8 tokens: −r·A/8 where kept, exactly 0 where masked
    ratios = [x / 0.5 for x in p]
    want = torch.tensor([[-r * a / 8 if keep else 0.0 for r, keep in zip(ratios, row)]
                         for a, row in zip((1.0, -1.0), kept)], dtype=F64)
    assert torch.equal(batch.logprobs.grad == 0, want == 0)
    assert torch.allclose(batch.logprobs.grad, want, atol=1e-15)
    assert loss.item() == pytest.approx(sum(-r * a * ln(x) / 8 for a, row in zip((1.0, -1.0), kept)
                                            for r, x, keep in zip(ratios, p, row) if keep))
    # a cap of 1.3 truncates row 0's kept ratio 1.4 → 1.3 (no gradient through the cap) and only it
    batch = batch_of([[ln(x) for x in p]] * 2, [[ln(0.5)] * 4] * 2, advantages=[1.0, -1.0])
    loss, m = run("dppo_tv", batch, advantage="given", ratio_cap=1.3, delta_high=0.3)
    loss.backward()
    assert batch.logprobs.grad[0, 0].item() == pytest.approx(-1.3 / 8) and m["is/clip_frac"] == pytest.approx(2 / 8)


def test_dppo_kl_masks_by_the_binary_kl_by_hand():
    ln = math.log
    q, p_up, p_down = 0.5, 0.7, 0.3
    kl_up = q * ln(q / p_up) + (1 - q) * ln((1 - q) / (1 - p_up))  # = .0872 (and the same for .3, by symmetry)
    assert kl_up == pytest.approx(0.08718, abs=1e-5)
    rows = [[ln(p_up), ln(p_down)], [ln(p_up), ln(p_down)]]
    batch = batch_of(rows, [[ln(q)] * 2] * 2, advantages=[1.0, -1.0])
    _, m = run("dppo_kl", batch, advantage="given")  # δ = .05 < .087: only the move the advantage pushes is masked
    assert m["is/mask_frac"] == pytest.approx(2 / 4)
    batch = batch_of(rows, [[ln(q)] * 2] * 2, advantages=[1.0, -1.0])
    loss, m = run("dppo_kl", batch, advantage="given", delta_low=0.09, delta_high=0.09)
    assert m["is/mask_frac"] == 0.0
    # a sampler certain of its token (q = 1): the KL's 0·log 0 is 0, finite, and p < q masks it for A < 0 only
    assert binary_kl(torch.tensor([0.0], dtype=F64), torch.tensor([ln(0.9)], dtype=F64)).item() == \
        pytest.approx(-ln(0.9))


def test_vespo_weights_the_whole_sequence_by_hand():
    # row 0: log r = (.1, .2), w = e^.3, A = 1 ≥ 0: φ = w²·e^{3(1 − w)}; row 1: on-policy, A = −1: φ(1) = 1
    w = math.exp(0.3)
    phi = w**2 * math.exp(3 * (1 - w))
    batch = batch_of([[-1.0, -2.0], [-0.5, -0.5]], [[-1.1, -2.2], [-0.5, -0.5]], advantages=[1.0, -1.0])
    loss, m = run("vespo", batch, advantage="given")
    assert loss.item() == pytest.approx((-phi * (-1.0 - 2.0) + 1.0 * (-0.5 - 0.5)) / 4)
    assert m["is/phi_mean"] == pytest.approx((phi + 1) / 2)
    loss.backward()
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[-phi / 4] * 2, [0.25] * 2], dtype=F64))
    # the negative-advantage kernel (k, λ) = (3, 2) for the same drifted row
    batch = batch_of([[-1.0, -2.0]], [[-1.1, -2.2]], advantages=[-1.0])
    _, m = run("vespo", batch, advantage="given")
    assert m["is/phi_mean"] == pytest.approx(w**3 * math.exp(2 * (1 - w)))
    # far off (Σ log r = 60): φ underflows to 0, no inf, no NaN, no gradient
    batch = batch_of([[-1.0] * 3], [[-21.0] * 3], advantages=[1.0])
    loss, m = run("vespo", batch, advantage="given")
    loss.backward()
    assert m["is/phi_mean"] == 0.0 and (batch.logprobs.grad == 0).all()


def test_sapo_gate_by_hand():
    # one token, r = 2: A = 1 → τ = 1, f = 4σ(1); A = −1 → τ = 1.05, f = (4/1.05)σ(1.05)
    ln, sig = math.log, (lambda x: 1 / (1 + math.exp(-x)))
    for a, tau in ((1.0, 1.0), (-1.0, 1.05)):
        batch = batch_of([[ln(0.5)]], [[ln(0.25)]], advantages=[a])
        loss, m = run("sapo", batch, advantage="given")
        assert loss.item() == pytest.approx(-(4 / tau) * sig(tau) * a)
        loss.backward()
        # d/dlog p = −4σ(1 − σ)·r·A
        assert batch.logprobs.grad.item() == pytest.approx(-4 * sig(tau) * (1 - sig(tau)) * 2 * a)
        assert m["is/gate_mean"] == pytest.approx(4 * sig(tau) * (1 - sig(tau)))
    # a ratio of e^30 (saturated gate): finite, and exactly no gradient
    batch = batch_of([[0.0]], [[-30.0]], advantages=[1.0])
    loss, _ = run("sapo", batch, advantage="given")
    loss.backward()
    assert loss.item() == pytest.approx(-4.0) and batch.logprobs.grad.item() == 0.0


def test_trm_drops_the_whole_sequence_of_one_far_token():
    # row 0: one token at log r = 2.3 (½·2.3² = 2.645 > 2.5) and one on-policy: both lose their gradient;
    # row 1: log r = (2.2, 0): ½·2.2² = 2.42, kept, the clip acting as in DAPO
    batch = batch_of([[-1.0, -1.0], [-1.0, -1.0]], [[-3.3, -1.0], [-3.2, -1.0]], advantages=[-1.0, -1.0])
    loss, m = run("trm", batch, advantage="given")
    assert m["is/mask_frac"] == 0.5
    loss.backward()
    assert (batch.logprobs.grad[0] == 0).all()
    r = math.exp(2.2)  # A < 0, r > 1 − ε: unclipped, −min(−r, −0.8) = r, gradient r/4; the on-policy token: 1/4
    assert loss.item() == pytest.approx((r + 1) / 4)
    assert torch.allclose(batch.logprobs.grad[1], torch.tensor([r / 4, 1 / 4], dtype=F64))
    # the mean criterion alone: row 1's mean k3 = (e^2.2 − 3.2)/2 = 2.91 > 1; off by default
    batch = batch_of([[-1.0, -1.0]], [[-3.2, -1.0]], advantages=[-1.0])
    assert run("trm", batch, advantage="given", max_divergence=None, mean_divergence=1.0)[1]["is/mask_frac"] == 1.0
    assert run("trm", batch, advantage="given", max_divergence=None)[1]["is/mask_frac"] == 0.0


# ------------------------------------------------------------------------------------------------ configs


def test_the_authors_defaults():
    """Pinned, so that a change is deliberate: where each was read is in gepo/loss_configs.py and docs/LOSSES.md."""
    def options(name):
        config = gepo.make_loss_config(name)
        return {k: v for k, v in vars(config).items()}

    assert options("dppo_tv") == {"delta_low": 0.15, "delta_high": 0.15, "ratio_cap": 1e4,
                                  "advantage": "group_centered"}
    assert options("dppo_kl") == {"delta_low": 0.05, "delta_high": 0.05, "ratio_cap": 1e4,
                                  "advantage": "group_centered"}
    assert options("vespo") == {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0,
                                "advantage": "group_normalized"}
    assert options("sapo") == {"tau_pos": 1.0, "tau_neg": 1.05, "advantage": "group_normalized"}
    assert options("trm") == {"clip_eps": 0.2, "clip_eps_high": None, "max_divergence": 2.5,
                              "mean_divergence": None, "advantage": "group_normalized"}


@pytest.mark.parametrize("name, options, message", [
    ("dppo_tv", {"ratio_cap": 0.0}, "ratio_cap=0.0: must be > 0"),
    ("dppo_tv", {"delta_high": -0.1}, "delta_high=-0.1: must be >= 0"),
    ("dppo_kl", {"divergence": "tv"}, r"no option\(s\) \['divergence'\]"),
    ("vespo", {"lambda_neg": 0.0}, "lambda_neg=0.0: must be > 0"),
    ("vespo", {"k_pos": -1.0}, "k_pos=-1.0: must be >= 0"),
    ("sapo", {"tau_neg": 0.0}, "tau_neg=0.0: must be > 0"),
    ("sapo", {"advantage": "std"}, "advantage='std' is not an estimator"),
    ("trm", {"max_divergence": -1.0}, "max_divergence=-1.0: must be >= 0"),
])
def test_bad_options_are_refused_naming_them(name, options, message):
    with pytest.raises(ValueError, match=message):
        gepo.make_loss_config(name, options)


def test_each_is_registered_with_a_one_line_description_naming_its_paper():
    papers = {"dppo_tv": "2602.04879", "dppo_kl": "2602.04879", "vespo": "2602.10693", "sapo": "2511.20347",
              "trm": "2512.23075"}
    for name in NEW:
        spec = gepo.get_loss(name)
        assert name in gepo.loss_names() and spec.config_cls is gepo.loss_config_class(name)
        assert papers[name] in spec.description and "\n" not in spec.description
        assert spec.fn.__module__ == "gepo.trust_region_losses"
