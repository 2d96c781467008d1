"""Name → loss registry, so configs and ``forward_backward(loss_fn="...")`` select losses by name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gepo.batch import LossBatch

LossFn = Callable[[LossBatch, Any], "tuple[torch.Tensor, dict[str, float]]"]


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: LossFn
    config_cls: type


_LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, config_cls: type):
    """Decorator: register ``fn(batch, config) -> (loss, metrics)`` under ``name``."""

    def decorate(fn: LossFn) -> LossFn:
        if name in _LOSSES:
            raise ValueError(f"a loss named {name!r} is already registered")
        if not dataclasses.is_dataclass(config_cls):
            raise TypeError(f"config_cls for loss {name!r} must be a dataclass")
        _LOSSES[name] = LossSpec(name, fn, config_cls)
        return fn

    return decorate


def loss_names() -> list[str]:
    return sorted(_LOSSES)


def get_loss(name: str) -> LossSpec:
    try:
        return _LOSSES[name]
    except KeyError:
        raise KeyError(f"unknown loss {name!r}; registered losses: {', '.join(loss_names())}") from None


def make_loss_config(name: str, options: dict | None = None):
    """Build the config dataclass of loss ``name`` from ``options``; unknown keys are an error."""
    spec = get_loss(name)
    options = dict(options or {})
    fields = {f.name for f in dataclasses.fields(spec.config_cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"loss {name!r} has no option(s) {unknown}; its options are {sorted(fields)}")
    return spec.config_cls(**options)
