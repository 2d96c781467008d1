"""Rows grouped by prompt: segment reductions over a (B,) vector of group ids.

Groups may have any sizes and need not be contiguous: every reduction goes
through ``index`` (row → group slot), never through a (P, G) reshape.
"""

from __future__ import annotations

import torch


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(index, n): ``index[i]`` in [0, n) is the slot of row i's group."""
    _, index = torch.unique(group_ids, return_inverse=True)
    return index, int(index.max()) + 1


def segment_sum(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) sums of ``values`` (B,) over the rows of each group."""
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, index, values)


def segment_mean(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) means of ``values`` (B,) over the rows of each group."""
    return segment_sum(values, index, n) / segment_sum(torch.ones_like(values), index, n)


def segment_logsumexp(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) log Σ_{i in group} exp(values_i), stable: the group max is taken out before exp."""
    peak = torch.full((n,), -torch.inf, dtype=values.dtype, device=values.device)
    peak = peak.scatter_reduce(0, index, values, reduce="amax").detach()
    return peak + torch.log(segment_sum(torch.exp(values - peak[index]), index, n))
