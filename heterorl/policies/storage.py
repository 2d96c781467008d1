"""Which tensors of a model are the same memory (tied embeddings), for every place that keeps them one: weight
packing, copies of a state dict, digests, saved files, LoRA."""

from __future__ import annotations

import torch


def storage_key(tensor: torch.Tensor) -> tuple | None:
    """What makes two tensors the same bytes (None for an empty one): tied weights share it. Every place that
    keeps tied tensors one (packing, copies of a state dict, digests, saved files) keys them by it."""
    if tensor.numel() == 0:
        return None
    return (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
