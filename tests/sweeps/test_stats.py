"""The statistics of sweep claims, checked against hand calculations and published t tables."""

import math

import pytest

from heterorl.sweeps.stats import Interval, eval_auc, last_evals_mean, mean_ci, paired_ci, t_quantile


@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (29, 2.045),
                                          (1000, 1.962)])
def test_t_quantiles_match_the_published_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-3)


def test_mean_ci_by_hand():
    # mean 0.7; sample std sqrt(0.025) = 0.158114; se = 0.070711; t(0.975, 4) = 2.776445 -> half 0.196324
    interval = mean_ci([0.5, 0.6, 0.7, 0.8, 0.9])
    assert (interval.mean, interval.n) == (pytest.approx(0.7), 5)
    assert (interval.low, interval.high) == (pytest.approx(0.503676, abs=1e-5), pytest.approx(0.896324, abs=1e-5))
    assert interval.excludes_zero() and str(interval) == "0.700 [0.504, 0.896]"
    one = mean_ci([0.4])
    assert one == Interval(0.4, 0.4, 0.4, 1) and math.isnan(one.half_width) and not one.excludes_zero()
    with pytest.raises(ValueError):
        mean_ci([])


def test_paired_ci_uses_the_shared_seeds_only():
    # differences on seeds 0-3: 0.05, 0.03, 0.07, 0.05 -> mean 0.05, std 0.016330, se 0.008165,
    # t(0.975, 3) = 3.182446 -> half 0.025984; seed 9 has no partner and is left out
    a = {0: 0.60, 1: 0.58, 2: 0.65, 3: 0.55, 9: 0.99}
    b = {0: 0.55, 1: 0.55, 2: 0.58, 3: 0.50}
    interval = paired_ci(a, b)
    assert interval.n == 4 and interval.mean == pytest.approx(0.05)
    assert interval.high - interval.mean == pytest.approx(0.025984, abs=1e-5) and interval.excludes_zero()
    assert not paired_ci({0: 0.5, 1: 0.6}, {0: 0.6, 1: 0.5}).excludes_zero()  # +0.1 and -0.1: undecided


def test_scores_that_average_out_eval_noise():
    history = [{"step": 0, "eval/success": 0.2}, {"step": 10, "eval/success": 0.4}, {"step": 20, "eval/success": 0.8},
               {"step": 30, "eval/success": 0.6}]
    assert last_evals_mean(history, 2) == pytest.approx(0.7)
    assert last_evals_mean(history, 10) == pytest.approx(0.6)  # fewer evals than asked: all after the base
    # trapezoids: (0.2+0.4)/2*10 + (0.4+0.8)/2*10 + (0.8+0.6)/2*10 = 3 + 6 + 7 = 16 over 30 steps
    assert eval_auc(history) == pytest.approx(16 / 30)
    with pytest.raises(ValueError):
        eval_auc(history[:1])
