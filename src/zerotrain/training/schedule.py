"""Learning-rate schedule: linear warmup, then cosine, linear, constant or warmup-stable-decay; a pure function of
the step."""

from __future__ import annotations

import math

from zerotrain.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate of the update with 0-based index `step`: `optim.lr` reached linearly over the warmup, then
    decayed to `optim.min_lr_ratio` x lr at the last step as `optim.lr_schedule` says (wsd holds lr until the last
    `optim.lr_decay_ratio` of the steps after warmup, then decays linearly, as torchtitan's warmup-stable-decay)."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    span = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    floor = optim.lr * optim.min_lr_ratio
    if optim.lr_schedule == "constant":
        return optim.lr
    if optim.lr_schedule == "linear":
        return optim.lr - (optim.lr - floor) * progress
    if optim.lr_schedule == "wsd":
        stable = 1.0 - optim.lr_decay_ratio
        if progress <= stable:
            return optim.lr
        return optim.lr - (optim.lr - floor) * (progress - stable) / optim.lr_decay_ratio
    return floor + 0.5 * (optim.lr - floor) * (1.0 + math.cos(math.pi * progress))
