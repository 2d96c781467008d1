"""The one calling convention every loss shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class LossInputError(ValueError):
    """A loss was called with inputs of the wrong shape, dtype or content."""


@dataclass
class LossBatch:
    """B padded sequences; every per-token tensor is (B, T) over *completion* tokens.

    logprobs            learner log p(y_t | ·), with gradient
    mask                1 for completion tokens that count, 0 for padding
    behaviour_logprobs  sampler log q(y_t | ·) (data), needed by importance-weighted losses
    advantages          (B,) per-sequence advantage (already estimated)
    rewards             (B,) raw rewards, for losses that estimate advantages themselves
    group_ids           (B,) long, which prompt each row came from
    policy_versions     (B, T) policy version that produced each token
    proximal_logprobs   (B, T) proximal policy log-probs (decoupled PPO)
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    behaviour_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    policy_versions: torch.Tensor | None = None
    proximal_logprobs: torch.Tensor | None = None

    def __post_init__(self):
        if self.logprobs.dim() != 2:
            raise LossInputError(f"logprobs must be (B, T), got shape {tuple(self.logprobs.shape)}")
        shape = self.logprobs.shape
        if self.mask.shape != shape:
            raise LossInputError(f"mask shape {tuple(self.mask.shape)} != logprobs shape {tuple(shape)}")
        self.mask = self.mask.to(self.logprobs.dtype)
        for name in ("behaviour_logprobs", "policy_versions", "proximal_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise LossInputError(f"{name} shape {tuple(value.shape)} != logprobs shape {tuple(shape)}")
        for name in ("advantages", "rewards", "group_ids"):
            value = getattr(self, name)
            if value is not None and value.shape != (shape[0],):
                raise LossInputError(f"{name} must be ({shape[0]},), got shape {tuple(value.shape)}")
        empty = self.mask.sum(-1) == 0
        if bool(empty.any()):
            raise LossInputError(
                f"rows {empty.nonzero().flatten().tolist()[:5]} have no completion token in their mask; "
                "drop empty completions before computing a loss"
            )

    def require(self, *names: str) -> None:
        """Raise naming the loss input that is missing."""
        for name in names:
            if getattr(self, name) is None:
                raise LossInputError(f"this loss needs `{name}`, which was not given")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1. Padding values, even NaN/inf, have no influence."""
    values = torch.where(mask > 0, values, torch.zeros_like(values))
    if dim is None:
        return values.sum() / mask.sum()
    return values.sum(dim) / mask.sum(dim)
