"""Learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio x lr; a pure function of the step."""

from __future__ import annotations

import math

from zerotrain.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate of the update with 0-based index `step`."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    span = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    floor = optim.lr * optim.min_lr_ratio
    return floor + 0.5 * (optim.lr - floor) * (1.0 + math.cos(math.pi * progress))
