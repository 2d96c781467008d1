"""Property tests: every vectorised loss against a slow, direct, loop-per-token float64 reference.

The references are written from the papers' formulas, one scalar at a time, with no
masking tricks (padding is simply skipped); autograd through them gives the reference
gradient. Random batches come from hypothesis-drawn seeds and shapes.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gepo

F64 = torch.float64


def random_batch(seed: int, groups: int, group_size: int, length: int, drift: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    B = groups * group_size
    lengths = torch.randint(1, length + 1, (B,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]).to(F64)
    lq = -3 * torch.rand(B, length, generator=gen, dtype=F64)
    lp = lq + drift * torch.randn(B, length, generator=gen, dtype=F64)
    rewards = torch.randint(0, 3, (B,), generator=gen).to(F64) / 2
    group_ids = torch.arange(B) // group_size
    return lp, lq, mask, rewards, group_ids


def tokens(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t] > 0]


def centred(rewards, group_ids, i, normalise):
    members = [j for j in range(len(rewards)) if group_ids[j] == group_ids[i]]
    mean = sum(float(rewards[j]) for j in members) / len(members)
    if not normalise:
        return float(rewards[i]) - mean
    var = sum((float(rewards[j]) - mean) ** 2 for j in members) / max(len(members) - 1, 1)
    return (float(rewards[i]) - mean) / (math.sqrt(var) + 1e-6)


def ppo_term(w, a, low, high):
    """−min(w·A, clip(w)·A) for one scalar tensor w: the clipped branch is a constant."""
    value = w.item()
    clipped = w if low <= value <= high else torch.tensor(min(max(value, low), high), dtype=F64)
    return -torch.minimum(w * a, clipped * a)


def ref_grpo(lp, lq, mask, rewards, group_ids, eps=0.2):
    B = lp.shape[0]
    total = 0
    for i in range(B):
        a = centred(rewards, group_ids, i, normalise=True)
        ts = tokens(mask, i)
        total = total + sum(ppo_term(torch.exp(lp[i, t] - lq[i, t]), a, 1 - eps, 1 + eps) for t in ts) / len(ts)
    return total / B


def ref_gspo(lp, lq, mask, rewards, group_ids, low=3e-4, high=4e-4):
    B = lp.shape[0]
    total = 0
    for i in range(B):
        ts = tokens(mask, i)
        s = torch.exp(sum(lp[i, t] - lq[i, t] for t in ts) / len(ts))
        total = total + ppo_term(s, centred(rewards, group_ids, i, normalise=True), 1 - low, 1 + high)
    return total / B


def ref_gepo(lp, lq, mask, rewards, group_ids, eps=0.2, group_by="prompt"):
    B = lp.shape[0]
    seq_p = [sum(lp[i, t] for t in tokens(mask, i)) / len(tokens(mask, i)) for i in range(B)]
    q = [math.exp(sum(lq[i, t].item() for t in tokens(mask, i)) / len(tokens(mask, i))) for i in range(B)]
    total = 0
    for i in range(B):
        members = [j for j in range(B) if group_by == "batch" or group_ids[j] == group_ids[i]]
        expected_q = sum(q[j] ** 2 for j in members) / sum(q[j] for j in members)  # Ê_q[q] = Σq²/Σq
        w = torch.exp(seq_p[i]) / expected_q
        total = total + ppo_term(w, centred(rewards, group_ids, i, normalise=False), 1 - eps, 1 + eps)
    return total / B


def ref_tis(lp, lq, mask, rewards, group_ids, cap=2.0, level="token"):
    B = lp.shape[0]
    total = 0
    for i in range(B):
        a = centred(rewards, group_ids, i, normalise=True)
        ts = tokens(mask, i)
        if level == "token":
            total = total + sum(-min(math.exp((lp[i, t] - lq[i, t]).item()), cap) * a * lp[i, t] for t in ts) / len(ts)
        else:
            rho = math.exp(sum((lp[i, t] - lq[i, t]).item() for t in ts))  # Π_t r_t (small here, no overflow)
            total = total - min(rho, cap) * a * sum(lp[i, t] for t in ts) / len(ts)
    return total / B


def ref_cispo(lp, lq, mask, rewards, group_ids, low=0.0, high=4.0):
    total, count = 0, 0
    for i in range(lp.shape[0]):
        a = centred(rewards, group_ids, i, normalise=True)
        for t in tokens(mask, i):
            weight = min(max(math.exp((lp[i, t] - lq[i, t]).item()), low), high)
            total, count = total - weight * a * lp[i, t], count + 1
    return total / count


CASES = {
    "grpo": (ref_grpo, {}),
    "gspo": (ref_gspo, {}),
    "gspo_wide": (lambda *x: ref_gspo(*x, low=0.2, high=0.2), {"clip_eps_low": 0.2, "clip_eps_high": 0.2}),
    "gepo": (ref_gepo, {}),
    "gepo_batch": (lambda *x: ref_gepo(*x, group_by="batch"), {"group_by": "batch"}),
    "tis": (ref_tis, {}),
    "tis_sequence": (lambda *x: ref_tis(*x, level="sequence"), {"level": "sequence"}),
    "cispo": (ref_cispo, {}),
}

shapes = dict(seed=st.integers(0, 2**31 - 1), groups=st.integers(1, 3), group_size=st.integers(1, 4),
              length=st.integers(1, 6))


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=25, deadline=None)
@given(**shapes)
def test_loss_and_gradient_match_the_direct_reference(case, seed, groups, group_size, length):
    reference, options = CASES[case]
    name = case.split("_")[0]
    lp, lq, mask, rewards, group_ids = random_batch(seed, groups, group_size, length)

    lp_ref = lp.clone().requires_grad_(True)
    want = reference(lp_ref, lq, mask, rewards, group_ids)
    want_grad = torch.autograd.grad(want, lp_ref, allow_unused=True)[0]
    want_grad = torch.zeros_like(lp) if want_grad is None else want_grad

    lp_fast = lp.clone().requires_grad_(True)
    batch = gepo.LossBatch(logprobs=lp_fast, mask=mask, behaviour_logprobs=lq, rewards=rewards, group_ids=group_ids)
    got, _ = gepo.get_loss(name).fn(batch, gepo.make_loss_config(name, options))
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(lp_fast.grad, want_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", [n for n in gepo.loss_names() if not n.startswith("test_")])
@settings(max_examples=10, deadline=None)
@given(**shapes)
def test_padding_garbage_never_changes_loss_or_gradient(name, seed, groups, group_size, length):
    lp, lq, mask, rewards, group_ids = random_batch(seed, groups, group_size, length)
    versions = torch.randint(0, 3, lp.shape, generator=torch.Generator().manual_seed(seed))
    out = []
    for dirty in (False, True):
        pad = mask == 0
        lp_i = lp.masked_fill(pad, float("nan")) if dirty else lp.clone()
        lq_i = lq.masked_fill(pad, float("inf")) if dirty else lq
        v_i = versions.masked_fill(pad, 999) if dirty else versions
        lp_i.requires_grad_(True)
        batch = gepo.LossBatch(logprobs=lp_i, mask=mask, behaviour_logprobs=lq_i, rewards=rewards,
                               group_ids=group_ids, policy_versions=v_i, current_version=2, advantages=rewards - 0.5)
        loss, _ = gepo.get_loss(name).fn(batch, gepo.make_loss_config(name))
        loss.backward()
        out.append((loss.item(), lp_i.grad))
    assert out[0][0] == out[1][0]
    assert torch.equal(out[0][1], out[1][1])
    assert (out[1][1][mask == 0] == 0).all()


@settings(max_examples=25, deadline=None)
@given(**shapes)
def test_gepo_on_policy_qweighted_mean_is_one(seed, groups, group_size, length):
    _, lq, mask, rewards, group_ids = random_batch(seed, groups, group_size, length)
    batch = gepo.LossBatch(logprobs=lq.clone(), mask=mask, behaviour_logprobs=lq, rewards=rewards,
                           group_ids=group_ids)
    _, m = gepo.get_loss("gepo").fn(batch, gepo.make_loss_config("gepo"))
    assert m["is/weight_mean_qweighted"] == pytest.approx(1.0, rel=1e-12)
    assert m["is/weight_mean"] <= 1.0 + 1e-12  # (Σq)²/(G·Σq²) ≤ 1 by Cauchy–Schwarz
