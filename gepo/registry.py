"""Name → loss registry, so configs and ``forward_backward(loss_fn="...")`` select losses by name.

Without torch: a loss's name and config are known (``loss_names``, ``make_loss_config``) before the modules that
register the built-in losses' functions (gepo.losses, gepo.trust_region_losses) are imported; ``get_loss`` imports
them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from gepo.loss_configs import BUILTIN_LOSS_CONFIGS

if TYPE_CHECKING:
    import torch

    from gepo.batch import LossBatch

LossFn = Callable[["LossBatch", Any], "tuple[torch.Tensor, dict[str, float]]"]
_BUILTIN_MODULES = ("gepo.losses", "gepo.trust_region_losses")  # together, every loss of BUILTIN_LOSS_CONFIGS


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: LossFn
    config_cls: type

    @property
    def description(self) -> str:
        """The first paragraph of the loss function's docstring on one line: what it is and where it comes from."""
        summary = (self.fn.__doc__ or "").strip().split("\n\n", 1)[0]
        return " ".join(line.strip() for line in summary.splitlines())


_LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, config_cls: type):
    """Decorator: register ``fn(batch, config) -> (loss, metrics)`` under ``name``.

    The registered (and returned) function raises ``LossInputError`` rather than
    return a loss that is NaN or inf, so no loss, built-in or yours, fails silently.
    """

    def decorate(fn: LossFn) -> LossFn:
        builtin = name in BUILTIN_LOSS_CONFIGS and fn.__module__ not in _BUILTIN_MODULES
        if name in _LOSSES or builtin:
            raise ValueError(f"a loss named {name!r} is already registered")
        if not dataclasses.is_dataclass(config_cls):
            raise TypeError(f"config_cls for loss {name!r} must be a dataclass")

        @functools.wraps(fn)
        def checked(batch: LossBatch, config):
            import torch

            from gepo.batch import LossInputError

            loss, metrics = fn(batch, config)
            if not bool(torch.isfinite(loss.detach())):
                raise LossInputError(f"loss {name!r} is {float(loss.detach())} (not finite) on this batch; "
                                     f"metrics: {metrics}")
            return loss, metrics

        _LOSSES[name] = LossSpec(name, checked, config_cls)
        return checked

    return decorate


def loss_names() -> list[str]:
    return sorted(set(_LOSSES) | set(BUILTIN_LOSS_CONFIGS))


def _unknown(name: str) -> KeyError:
    return KeyError(f"unknown loss {name!r}; registered losses: {', '.join(loss_names())}")


def get_loss(name: str) -> LossSpec:
    if name in BUILTIN_LOSS_CONFIGS and name not in _LOSSES:
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)
    try:
        return _LOSSES[name]
    except KeyError:
        raise _unknown(name) from None


def loss_config_class(name: str) -> type:
    """The config dataclass of loss ``name`` (without importing the built-in losses)."""
    if name in _LOSSES:
        return _LOSSES[name].config_cls
    if name in BUILTIN_LOSS_CONFIGS:
        return BUILTIN_LOSS_CONFIGS[name]
    raise _unknown(name)


def make_loss_config(name: str, options: dict | None = None):
    """Build the config dataclass of loss ``name`` from ``options``; unknown keys are an error."""
    config_cls = loss_config_class(name)
    options = dict(options or {})
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"loss {name!r} has no option(s) {unknown}; its options are {sorted(fields)}")
    return config_cls(**options)
