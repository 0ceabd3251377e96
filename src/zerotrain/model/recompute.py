"""Activation checkpointing of a model's blocks (--activation-checkpointing), and how code running inside autograd's
backward (a recomputed forward among it) knows it is there."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread now (a checkpointed forward recomputed there, too)."""
    return torch._C._current_graph_task_id() != -1


def run_block(block: nn.Module, recompute: bool, x: torch.Tensor, *args) -> torch.Tensor:
    """block(x, *args); with `recompute` (activation checkpointing, while training) only x is kept for the
    backward, which runs the block's forward again to get what it needs (same values: no dropout, and the
    RNG state is restored). Generation (a cache in args) and no-grad evaluation never recompute. The first block's
    input needs no gradient under a frozen embedding (LoRA), and is recomputed all the same."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(block, x, *args, use_reentrant=False)
    return block(x, *args)
