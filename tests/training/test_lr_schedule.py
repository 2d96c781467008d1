"""Learning-rate schedules: warm-up, then constant, cosine or linear decay to lr * min_lr_ratio."""

import pytest

from heterorl.config import load_config
from heterorl.errors import ConfigError
from heterorl.training.lr_schedule import learning_rate


def test_warm_up_then_each_schedule_ends_where_it_says():
    lr = lambda step, schedule, ratio=0.1: learning_rate(step, 1.0, 110, 10, schedule, ratio)  # noqa: E731
    for schedule in ("constant", "cosine", "linear"):
        assert [lr(s, schedule) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])  # linear warm-up
    assert lr(60, "constant") == lr(110, "constant") == 1.0
    assert lr(60, "cosine") == pytest.approx(0.55) and lr(110, "cosine") == pytest.approx(0.1)
    # linear: 100 steps after warm-up from 1.0 to 0.1, so 0.991 at the 11th, 0.55 half-way, 0.1 at the end
    assert [lr(s, "linear") for s in (11, 60, 110, 500)] == pytest.approx([0.991, 0.55, 0.1, 0.1])
    assert lr(60, "linear", 0.0) == pytest.approx(0.5) and lr(110, "linear", 0.0) == 0.0  # TRL's: to 0
    with pytest.raises(ValueError, match="use constant, cosine or linear"):
        lr(20, "step")


@pytest.mark.parametrize("ratio", ["-0.1", "1.5"])
def test_min_lr_ratio_must_be_a_fraction(ratio):
    with pytest.raises(ConfigError, match=r"`optim.min_lr_ratio` = .*must be in \[0, 1\]"):
        load_config(None, [f"optim.min_lr_ratio={ratio}"])
