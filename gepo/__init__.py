"""gepo: staleness-tolerant policy losses (GEPO and baselines), pure torch, no I/O.

Losses are looked up by name: ``get_loss("gepo").fn(batch, make_loss_config("gepo", {...}))``
returns ``(loss, metrics)``. ``loss_names()`` lists them; ``register_loss`` adds yours.

Importing gepo does not import torch: the names, configs and registry are torch-free (gepo.loss_configs,
gepo.registry), so a process that only checks a run's config never pays for it; the losses, estimators and batch
(everything else below) are imported on first use.
"""

from __future__ import annotations

import importlib

from gepo.loss_configs import ADVANTAGE_CHOICES, ADVANTAGE_NAMES, RLLossConfig
from gepo.registry import LossSpec, get_loss, loss_config_class, loss_names, make_loss_config, register_loss

_LAZY = {  # name -> the module that defines it (imports torch)
    "ADVANTAGE_ESTIMATORS": "gepo.advantages",
    "advantages_for": "gepo.advantages",
    "bnpo": "gepo.advantages",
    "group_centered": "gepo.advantages",
    "group_mean": "gepo.advantages",
    "group_normalized": "gepo.advantages",
    "raw_reward": "gepo.advantages",
    "LossBatch": "gepo.batch",
    "LossInputError": "gepo.batch",
    "masked_mean": "gepo.batch",
}

__all__ = [
    "ADVANTAGE_CHOICES",
    "ADVANTAGE_NAMES",
    "LossSpec",
    "RLLossConfig",
    "get_loss",
    "loss_config_class",
    "loss_names",
    "make_loss_config",
    "register_loss",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gepo' has no attribute {name!r}")
