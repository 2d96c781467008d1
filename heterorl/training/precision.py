"""What else sets the learner's memory, besides micro-batches (`heterorl.training.microbatches`): activation
checkpointing (`policy.activation_checkpointing`: each decoder layer's activations recomputed in the backward
instead of kept) and the training dtype (`policy.train_dtype`: ``bfloat16`` runs the learner's forward and
backward under autocast, the weights and Adam's state staying float32).

Both change what the learner computes only within float error; bfloat16 changes its log-probs against the
sampler's float32 ones (the training–inference mismatch: `heterorl bench learner` prints it)."""

from __future__ import annotations

import contextlib

import torch

from heterorl.errors import ConfigError

TRAIN_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def checkpoint_activations(model) -> None:
    """Turn on a Hugging Face model's activation checkpointing (non-reentrant; the model must be in training
    mode for it to act). `ConfigError` for a model that has none."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"policy.activation_checkpointing: {type(model).__name__} does not support activation "
                          "checkpointing; set it to false")
    enable = getattr(model, "activation_checkpointing_enable", None)  # (transformers >= 5.x; the older name before)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def autocast(device: torch.device | str, train_dtype: str):
    """The context the learner's forward and backward run in: autocast to ``train_dtype`` (float32: none)."""
    if train_dtype not in TRAIN_DTYPES:
        raise ConfigError(f"policy.train_dtype={train_dtype!r}: give one of {', '.join(TRAIN_DTYPES)}")
    dtype = TRAIN_DTYPES[train_dtype]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)
