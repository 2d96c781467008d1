"""Multi-turn episodes reach the losses as rows whose mask is 0 on the environment's tokens: every loss then treats
an episode as the sequence of its policy tokens (docs/LOSSES.md, "Multi-turn episodes")."""

import math

import pytest
import torch

import gepo

F64 = torch.float64
# two policy turns of 3 and 2 tokens around an environment answer of 4 tokens, then padding: the layout of an
# episode on the learner (the answer's behaviour log-prob is 0, as the wire carries it)
LAYOUT = [1, 1, 1, 0, 0, 0, 0, 1, 1, 0]


def _episode_batch(seed: int, rows: int = 6):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([LAYOUT] * rows, dtype=F64)
    mask[1, 7:] = 0  # one episode whose second turn is a single token
    mask[1, 7] = 1
    lq = -3 * torch.rand(rows, len(LAYOUT), generator=gen, dtype=F64)
    lq[mask == 0] = 0.0
    lp = lq + 0.3 * torch.randn(rows, len(LAYOUT), generator=gen, dtype=F64)
    lp[:, 3:7] = -40.0  # the learner's log-probs of the environment's tokens: anything, they must not count
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0], dtype=F64)[:rows]
    return lp, lq, mask, rewards, torch.arange(rows) // 3


def _compact(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The policy's tokens of each row moved together (the single-turn layout of the same tokens)."""
    out = torch.zeros(values.shape[0], int(mask.sum(-1).max()), dtype=values.dtype)
    for i in range(values.shape[0]):
        kept = values[i][mask[i] > 0]
        out[i, :len(kept)] = kept
    return out


@pytest.mark.parametrize("name", [n for n in gepo.loss_names() if n != "cross_entropy"])
def test_every_loss_sees_an_episode_as_its_policy_tokens_and_never_trains_the_answers(name):
    lp, lq, mask, rewards, groups = _episode_batch(0)
    options = {"max_completion_len": 8} if name == "dr_grpo" else {}  # (its normaliser is a length, not a mean)
    config = gepo.make_loss_config(name, options)
    spec = gepo.get_loss(name)
    lp = lp.clone().requires_grad_(True)
    versions = torch.zeros_like(mask, dtype=torch.long)
    loss, _ = spec.fn(gepo.LossBatch(lp, mask, lq, advantages=rewards - 0.5, rewards=rewards, group_ids=groups,
                                     policy_versions=versions, current_version=1), config)
    loss.backward()
    assert (lp.grad[mask == 0] == 0).all()  # the answers (and padding): exactly zero gradient
    assert lp.grad[mask > 0].abs().sum() > 0

    packed_mask = _compact(mask, mask)
    packed_lp = _compact(lp.detach(), mask).requires_grad_(True)
    packed, _ = spec.fn(gepo.LossBatch(packed_lp, packed_mask, _compact(lq, mask), advantages=rewards - 0.5,
                                       rewards=rewards, group_ids=groups, policy_versions=_compact(versions, mask),
                                       current_version=1), config)
    packed.backward()
    assert float(loss.detach()) == pytest.approx(float(packed.detach()), abs=1e-12)
    assert torch.allclose(lp.grad[mask > 0], packed_lp.grad[packed_mask > 0], atol=1e-12)


def test_gepo_of_two_episodes_by_hand():
    """GEPO's weight of an episode: the length-normalised log-prob of its policy tokens, over the group's
    expectation of q computed from the same tokens; written out for a group of two."""
    # episode 1: policy tokens (log q) -1, -2 | answer | -3 ; episode 2: -1 | answer | -1
    mask = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 0, 1, 0]], dtype=F64)
    lq = torch.tensor([[-1.0, -2.0, 0.0, 0.0, -3.0], [-1.0, 0.0, 0.0, -1.0, 0.0]], dtype=F64)
    lp = torch.tensor([[-0.9, -2.1, -9.0, -9.0, -2.7], [-1.2, 0.0, -9.0, -0.8, 0.0]], dtype=F64)
    rewards = torch.tensor([1.0, 0.0], dtype=F64)
    batch = gepo.LossBatch(lp, mask, lq, rewards=rewards, group_ids=torch.tensor([0, 0]))
    loss, metrics = gepo.get_loss("gepo").fn(batch, gepo.make_loss_config("gepo"))
    lq1, lq2 = (-1 - 2 - 3) / 3, (-1 - 1) / 2  # mean log q of each episode's policy tokens
    lp1, lp2 = (-0.9 - 2.1 - 2.7) / 3, (-1.2 - 0.8) / 2
    q1, q2 = math.exp(lq1), math.exp(lq2)
    log_d = math.log((q1 * q1 + q2 * q2) / (q1 + q2))
    w1, w2 = math.exp(lp1 - log_d), math.exp(lp2 - log_d)
    a1, a2 = 0.5, -0.5  # group-centred
    term = [-min(w * a, min(max(w, 0.8), 1.2) * a) for w, a in ((w1, a1), (w2, a2))]
    assert float(loss) == pytest.approx(sum(term) / 2, abs=1e-12)
    assert metrics["is/weight_mean_qweighted"] == pytest.approx((q1 * w1 + q2 * w2) / (q1 + q2), abs=1e-12)
