"""gepo: staleness-tolerant policy losses (GEPO and baselines), pure torch, no I/O.

Losses are looked up by name: ``get_loss("grpo").fn(batch, config)``.
"""

from gepo import losses as _losses  # noqa: F401  (registers the built-in losses)
from gepo.advantages import group_centered, group_mean, group_normalized
from gepo.batch import LossBatch, LossInputError, masked_mean
from gepo.registry import LossSpec, get_loss, loss_names, make_loss_config, register_loss

__all__ = [
    "LossBatch",
    "LossInputError",
    "LossSpec",
    "get_loss",
    "group_centered",
    "group_mean",
    "group_normalized",
    "loss_names",
    "make_loss_config",
    "masked_mean",
    "register_loss",
]
