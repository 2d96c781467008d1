"""The values the training-session primitives take and give (`heterorl.training.session`): a datum, Adam's
parameters, and the outputs of forward_backward and optim_step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from heterorl.errors import ConfigError, HeteroRLError


def check_datums(datums: Sequence[Datum], temperature: float) -> None:
    if not datums:
        raise HeteroRLError("forward/forward_backward got no datums")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise HeteroRLError(f"temperature={temperature!r}: give the sampling temperature (> 0) the "
                            "completions were drawn at")
    for i, datum in enumerate(datums):
        datum.validate(i)


MAX_LEARNING_RATE = 10.0  # AdamW moves each weight by about the learning rate a step: far past any sane run


@dataclass
class Datum:
    """One training sequence: ``tokens`` = prompt + completion; the loss covers ``tokens[prompt_len:]``.

    Per-completion-token lists (``behaviour_logprobs``, ``policy_versions``,
    ``weights``) have ``len(tokens) - prompt_len`` entries; ``weights`` scales
    each token's mask (default 1). RL losses estimate advantages from ``reward``
    by ``group_id`` (their config's ``advantage``), or take ``advantage`` as it
    is with ``loss_config={"advantage": "given"}``; give either to all datums of a call or to none.
    """

    tokens: list[int]
    prompt_len: int
    advantage: float | None = None
    reward: float | None = None
    group_id: int = 0
    behaviour_logprobs: list[float] | None = None
    policy_versions: list[int] | None = None
    weights: list[float] | None = None

    @property
    def completion_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    def validate(self, index: int) -> None:
        if not 1 <= self.prompt_len < len(self.tokens):
            raise HeteroRLError(
                f"datum {index}: prompt_len={self.prompt_len} must be in [1, len(tokens)={len(self.tokens)}) "
                "so that at least one completion token is trained on"
            )
        for name in ("behaviour_logprobs", "policy_versions", "weights"):
            values = getattr(self, name)
            if values is not None and len(values) != self.completion_len:
                raise HeteroRLError(
                    f"datum {index}: {name} has {len(values)} entries but the completion has "
                    f"{self.completion_len} tokens"
                )


@dataclass
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float | None = 1.0  # None disables clipping

    def __post_init__(self) -> None:
        """A `ConfigError` naming the field for a value AdamW cannot take or that would ruin the model for good:
        a learning rate of 1e30 was taken, and every weight was NaN after one step."""
        bounds = {"learning_rate": (0.0, MAX_LEARNING_RATE, "[0, 10]"), "beta1": (0.0, 1.0, "[0, 1)"),
                  "beta2": (0.0, 1.0, "[0, 1)"), "eps": (0.0, 1.0, "(0, 1]"), "weight_decay": (0.0, 1.0, "[0, 1]")}
        for name, (low, high, shown) in bounds.items():
            value = getattr(self, name)
            ok = type(value) in (int, float) and math.isfinite(value) and low <= value <= high
            if ok and name in ("beta1", "beta2"):
                ok = value < 1.0
            if ok and name == "eps":
                ok = value > 0.0
            if not ok:
                raise ConfigError(f"AdamParams.{name}={str(value)[:40]}: must be a finite number in {shown}")
        clip = self.grad_clip_norm
        if clip is not None and not (type(clip) in (int, float) and math.isfinite(clip) and clip > 0):
            raise ConfigError(f"AdamParams.grad_clip_norm={str(clip)[:40]}: must be a finite number > 0, or None "
                              "for no clipping")


@dataclass
class ForwardBackwardOutput:
    loss: float
    metrics: dict[str, float]
    logprobs: list[list[float]] = field(repr=False)  # learner log-probs of each datum's completion tokens


@dataclass
class OptimStepOutput:
    grad_norm: float  # before clipping
    step: int
    skipped: bool = False  # the gradient norm was not finite: no step was taken and the gradients were zeroed
