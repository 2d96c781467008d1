"""The ratio diagnostics every RL loss logs in the same terms (ratio/token_*, ratio/seq_*), by hand, and the
same for every loss: on-policy they say 1 and 0 whatever weight the loss itself uses."""

import math

import pytest
import torch

import gepo
from gepo.diagnostics import ratio_metrics


def test_ratio_metrics_by_hand():
    # row 0: log p − log q = [log 2, 0] -> token ratios 2, 1, sequence ratio 2; row 1: [0, (padding)] -> 1, 1
    q = torch.tensor([[-1.0, -1.0], [-0.5, -0.5]])
    p = q + torch.tensor([[math.log(2), 0.0], [0.0, float("nan")]])
    batch = gepo.LossBatch(logprobs=p, mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]), behaviour_logprobs=q)
    m = ratio_metrics(batch)
    # tokens [2, 1, 1]: mean 4/3, variance ((2/3)² + 2·(1/3)²)/3 = 2/9; sequences [2, 1]: mean 1.5, var 0.25,
    # ESS (2 + 1)² / (2 · (4 + 1)) = 0.9
    assert m == pytest.approx({"ratio/token_mean": 4 / 3, "ratio/token_var": 2 / 9, "ratio/token_max": 2.0,
                               "ratio/seq_mean": 1.5, "ratio/seq_var": 0.25, "ratio/seq_max": 2.0,
                               "ratio/seq_ess": 0.9})


@pytest.mark.parametrize("name", [n for n in gepo.loss_names() if n not in ("cross_entropy",)])
def test_every_rl_loss_logs_the_common_ratios_and_they_agree_on_policy(name):
    torch.manual_seed(0)
    q = -torch.rand(8, 5) - 0.1
    batch = gepo.LossBatch(logprobs=q.clone().requires_grad_(), mask=torch.ones(8, 5), behaviour_logprobs=q,
                           rewards=torch.tensor([1.0, 0.0] * 4), advantages=torch.tensor([1.0, -1.0] * 4),
                           group_ids=torch.tensor([0] * 4 + [1] * 4),
                           proximal_logprobs=q, policy_versions=torch.zeros(8, 5, dtype=torch.long))
    _, metrics = gepo.get_loss(name).fn(batch, gepo.make_loss_config(name))
    assert metrics["ratio/seq_mean"] == pytest.approx(1.0) and metrics["ratio/seq_var"] == pytest.approx(0.0)
    assert metrics["ratio/token_var"] == pytest.approx(0.0) and metrics["ratio/seq_ess"] == pytest.approx(1.0)
