"""gepo: staleness-tolerant policy losses (GEPO and baselines), pure torch, no I/O.

Losses are looked up by name: ``get_loss("gepo").fn(batch, make_loss_config("gepo", {...}))``
returns ``(loss, metrics)``. ``loss_names()`` lists them; ``register_loss`` adds yours.
"""

from gepo import losses as _losses  # noqa: F401  (registers the built-in losses)
from gepo.advantages import (
    ADVANTAGE_CHOICES,
    ADVANTAGE_ESTIMATORS,
    advantages_for,
    bnpo,
    group_centered,
    group_mean,
    group_normalized,
    raw_reward,
)
from gepo.batch import LossBatch, LossInputError, masked_mean
from gepo.losses import RLLossConfig
from gepo.registry import LossSpec, get_loss, loss_names, make_loss_config, register_loss

__all__ = [
    "ADVANTAGE_CHOICES",
    "ADVANTAGE_ESTIMATORS",
    "LossBatch",
    "LossInputError",
    "LossSpec",
    "RLLossConfig",
    "advantages_for",
    "bnpo",
    "get_loss",
    "group_centered",
    "group_mean",
    "group_normalized",
    "loss_names",
    "make_loss_config",
    "masked_mean",
    "raw_reward",
    "register_loss",
]
