"""Name → loss registry, so configs and ``forward_backward(loss_fn="...")`` select losses by name."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gepo.batch import LossBatch, LossInputError

LossFn = Callable[[LossBatch, Any], "tuple[torch.Tensor, dict[str, float]]"]


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: LossFn
    config_cls: type


_LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, config_cls: type):
    """Decorator: register ``fn(batch, config) -> (loss, metrics)`` under ``name``.

    The registered (and returned) function raises ``LossInputError`` rather than
    return a loss that is NaN or inf, so no loss, built-in or yours, fails silently.
    """

    def decorate(fn: LossFn) -> LossFn:
        if name in _LOSSES:
            raise ValueError(f"a loss named {name!r} is already registered")
        if not dataclasses.is_dataclass(config_cls):
            raise TypeError(f"config_cls for loss {name!r} must be a dataclass")

        @functools.wraps(fn)
        def checked(batch: LossBatch, config):
            loss, metrics = fn(batch, config)
            if not bool(torch.isfinite(loss.detach())):
                raise LossInputError(f"loss {name!r} is {float(loss.detach())} (not finite) on this batch; "
                                     f"metrics: {metrics}")
            return loss, metrics

        _LOSSES[name] = LossSpec(name, checked, config_cls)
        return checked

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
