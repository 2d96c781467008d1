"""Advantage estimators over groups of completions of the same prompt."""

from __future__ import annotations

import torch


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, index = torch.unique(group_ids, return_inverse=True)
    return index, int(index.max()) + 1


def group_mean(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per row, the mean of ``values`` over the rows of its group."""
    index, n = _group_index(group_ids)
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, index, values)
    counts = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, index, torch.ones_like(values))
    return (sums / counts)[index]


def group_centered(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A_i = r_i − mean_{j in group(i)} r_j  (GEPO, Dr.GRPO)."""
    return rewards - group_mean(rewards, group_ids)


def group_normalized(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i − mean_G r) / (std_G r + eps), std unbiased as in GRPO."""
    centred = group_centered(rewards, group_ids)
    index, n = _group_index(group_ids)
    counts = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add(0, index, torch.ones_like(rewards))
    sq = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add(0, index, centred**2)
    std = (sq / (counts - 1).clamp(min=1)).sqrt()
    return centred / (std[index] + eps)
