"""The one calling convention every loss shares, validated once.

Bad input is a ``LossInputError`` that names the field and the fix, never a
silent NaN loss. Rows whose behaviour log-probs are NaN/inf on a completion
token are an error, not a silent drop: a sampler that sends them is broken,
and dropping rows would quietly change group sizes and advantages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class LossInputError(ValueError):
    """A loss was called with inputs of the wrong shape, dtype or content."""


# What each optional input is, for errors that say how to fix a missing one.
_HOW_TO_GIVE = {
    "behaviour_logprobs": "the sampler's per-token log-probs of the completion, (B, T)",
    "advantages": "(B,) per-sequence advantages; or leave the config `advantage` at an estimator and give rewards",
    "rewards": "(B,) rewards, from which the loss estimates advantages; or give advantages and set the config "
               "option advantage='given'",
    "group_ids": "(B,) integer id of the prompt each row came from",
    "policy_versions": "(B, T) policy version that produced each token",
    "proximal_logprobs": "(B, T) proximal-policy log-probs",
}


@dataclass
class LossBatch:
    """B padded sequences; every per-token tensor is (B, T) over *completion* tokens.

    logprobs            learner log p(y_t | ·), with gradient
    mask                > 0 for completion tokens that count (its value weights the token), 0 for padding;
                        padding positions of every field have no influence, whatever they hold (NaN included)
    behaviour_logprobs  sampler log q(y_t | ·) (data), needed by importance-weighted losses
    advantages          (B,) per-sequence advantage, used when a loss's config says advantage="given"
    rewards             (B,) raw rewards, from which losses estimate advantages (the default)
    group_ids           (B,) integer, which prompt each row came from
    policy_versions     (B, T) integer policy version that produced each token
    proximal_logprobs   (B, T) proximal policy log-probs (decoupled PPO)
    current_version     version of the learner's weights now, i.e. the last version it published; a token's
                        staleness is current_version − its policy version (0 on-policy). None: taken to be
                        the newest version among the batch's tokens (so staleness is a lower bound).
    group_size          completions sampled per prompt (G). Given, every group must have exactly G rows: a
                        prompt split unevenly across group ids, or a group missing rows, is an error naming the
                        group. None (the default) accepts groups of any size, e.g. partial groups released
                        after a timeout; a group of one row then gets advantage 0.
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    behaviour_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    policy_versions: torch.Tensor | None = None
    proximal_logprobs: torch.Tensor | None = None
    current_version: int | None = None
    group_size: int | None = None
    keep: torch.Tensor = field(init=False, repr=False)  # (B, T) bool: mask > 0

    def __post_init__(self):
        if self.logprobs.dim() != 2:
            raise LossInputError(f"logprobs must be (B, T), got shape {tuple(self.logprobs.shape)}")
        shape = self.logprobs.shape
        if self.mask.shape != shape:
            raise LossInputError(f"mask shape {tuple(self.mask.shape)} != logprobs shape {tuple(shape)}")
        self.mask = self.mask.to(self.logprobs.dtype)
        self.keep = self.mask > 0
        for name in ("behaviour_logprobs", "policy_versions", "proximal_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise LossInputError(f"{name} shape {tuple(value.shape)} != logprobs shape {tuple(shape)}")
        for name in ("advantages", "rewards", "group_ids"):
            value = getattr(self, name)
            if value is not None and value.shape != (shape[0],):
                raise LossInputError(f"{name} must be ({shape[0]},), got shape {tuple(value.shape)}")
        for name in ("group_ids", "policy_versions"):
            value = getattr(self, name)
            if value is not None and (value.dtype.is_floating_point or value.dtype == torch.bool):
                raise LossInputError(f"{name} must hold integers, got dtype {value.dtype}")
        if self.group_size is not None:
            self._check_group_sizes()
        empty = ~self.keep.any(-1)
        if bool(empty.any()):
            raise LossInputError(
                f"rows {empty.nonzero().flatten().tolist()[:5]} have no completion token in their mask; "
                "drop empty completions before computing a loss"
            )
        if bool((self.mask < 0).any()):
            raise LossInputError("mask has negative entries; use 0 for padding and > 0 for tokens that count")
        for name in ("behaviour_logprobs", "proximal_logprobs"):
            value = getattr(self, name)
            if value is not None:
                bad = (~torch.isfinite(value) & self.keep).any(-1)
                if bool(bad.any()):
                    raise LossInputError(
                        f"{name} is NaN/inf on completion tokens of rows {bad.nonzero().flatten().tolist()[:5]}; "
                        "drop those trajectories (their sampler produced no valid log-prob) or mask those tokens"
                    )
        for name in ("advantages", "rewards"):
            value = getattr(self, name)
            if value is not None and not bool(torch.isfinite(value).all()):
                bad = (~torch.isfinite(value)).nonzero().flatten().tolist()[:5]
                raise LossInputError(f"{name} is NaN/inf in rows {bad}; every row needs a finite {name[:-1]}")
        if self.policy_versions is not None and self.current_version is not None:
            newest = int(torch.where(self.keep, self.policy_versions, self.policy_versions.new_tensor(-2**62)).max())
            if newest > self.current_version:
                raise LossInputError(
                    f"policy_versions has version {newest} > current_version {self.current_version}: a token "
                    "cannot come from a policy newer than the learner; check how versions are stamped"
                )

    def require(self, *names: str) -> None:
        """Raise naming the loss input that is missing and how to give it."""
        for name in names:
            if getattr(self, name) is None:
                raise LossInputError(f"this loss needs `{name}`, which was not given: pass {_HOW_TO_GIVE[name]}")

    def token(self, name: str) -> torch.Tensor:
        """The (B, T) field ``name`` with padding replaced by 0.

        Losses read per-token inputs through this, *before* any exp/log, so that
        padding garbage (NaN, ±inf) cannot reach a value or a gradient: torch.where
        blocks it, a multiplication by 0 would not (0 · inf = NaN).
        """
        self.require(name)
        value = getattr(self, name)
        return torch.where(self.keep, value, torch.zeros_like(value))

    def _check_group_sizes(self) -> None:
        if self.group_ids is None:
            raise LossInputError("group_size is given but group_ids is not: give the (B,) prompt id of each row")
        ids, counts = torch.unique(self.group_ids, return_counts=True)
        wrong = (counts != self.group_size).nonzero().flatten().tolist()
        if wrong:
            sizes = ", ".join(f"group {int(ids[i])} has {int(counts[i])}" for i in wrong[:5])
            raise LossInputError(f"group_size is {self.group_size} but {sizes} rows: each prompt's completions "
                                 "must share one group id, all of them; or leave group_size None to allow "
                                 "partial groups")

    def resolved_current_version(self) -> int:
        """``current_version``, or the newest version among the completion tokens when it was not given."""
        self.require("policy_versions")
        if self.current_version is not None:
            return self.current_version
        return int(torch.where(self.keep, self.policy_versions, self.policy_versions.new_tensor(-2**62)).max())


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Σ m·x / Σ m over entries with m > 0. Padding values, even NaN/inf, have no influence on the value."""
    values = torch.where(mask > 0, values * mask, torch.zeros_like(values))
    if dim is None:
        return values.sum() / mask.sum()
    return values.sum(dim) / mask.sum(dim)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Σ m·x over entries with m > 0 (padding has no influence)."""
    values = torch.where(mask > 0, values * mask, torch.zeros_like(values))
    return values.sum() if dim is None else values.sum(dim)
