"""Learning-rate schedules."""

from __future__ import annotations

import math


def learning_rate(step: int, base_lr: float, total_steps: int, warmup_steps: int = 0,
                  schedule: str = "constant", min_lr_ratio: float = 0.1) -> float:
    """LR for optimizer step ``step`` (1-based): linear warm-up, then constant, or a cosine or linear decay to
    ``base_lr·min_lr_ratio`` at ``total_steps`` (TRL's default ``linear`` decays to 0: ``min_lr_ratio=0``)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return base_lr * step / warmup_steps
    if schedule == "constant":
        return base_lr
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    if schedule == "linear":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return base_lr * (1 - (1 - min_lr_ratio) * progress)
    raise ValueError(f"unknown learning-rate schedule {schedule!r}: use constant, cosine or linear")
