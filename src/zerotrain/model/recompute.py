"""Activation checkpointing of a model's blocks (--activation-checkpointing), and how code running inside autograd's
backward (a recomputed forward among it) knows it is there.

Two ways to recompute a block: whole (`blocks`, `full`): only its input is kept and its forward runs again in the
backward; or selectively (`selective`, torchtitan's per-op policy): the outputs of its matmuls and of its attention
kernel are kept as the forward made them, and only the cheap element-wise ops between them (norms, rotary, the gated
unit's activation and product, the residual adds) run again. A matmul is the FLOPs of a block; what lies between
them is most of its saved bytes (each norm's fp32 copies, the gated unit's four tensors).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
# The ops whose outputs a selective checkpoint keeps: the matmuls (a linear is mm, or addmm with a bias; batched
# matmuls bmm; grouped experts _grouped_mm) and the fused attention kernels (their output and logsumexp), whatever
# the device picked. Every other op is recomputed.
KEPT_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten._grouped_mm.default, aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default,
    aten._flash_attention_forward.default, aten._efficient_attention_forward.default,
})

_observers = threading.local()  # what is told of each output a selective checkpoint keeps (kept_outputs_seen_by)


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread now (a checkpointed forward recomputed there, too)."""
    return torch._C._current_graph_task_id() != -1


def keep_matmul_outputs(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: keep what KEPT_OPS give (told to the observers: the bytes they hold wait for the
    backward outside any saved-tensor hook), recompute the rest."""
    if func in KEPT_OPS:
        for observe in getattr(_observers, "stack", ()):
            for out in (ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)):
                if isinstance(out, torch.Tensor):
                    observe(out)
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The checkpoint's context_fn for --activation-checkpointing selective: keep_matmul_outputs' policy."""
    return create_selective_checkpoint_contexts(keep_matmul_outputs)


@contextlib.contextmanager
def kept_outputs_seen_by(observe: Callable[[torch.Tensor], None]):
    """Within, `observe(tensor)` is called for each op output a selective checkpoint keeps for the backward (those
    are held by the checkpoint itself, which no saved-tensor hook sees: training/activations.py counts them so)."""
    stack = _observers.__dict__.setdefault("stack", [])
    stack.append(observe)
    try:
        yield
    finally:
        stack.remove(observe)


def run_block(block: nn.Module, recompute: bool | str, x: torch.Tensor, *args) -> torch.Tensor:
    """block(x, *args); with `recompute` (activation checkpointing, while training) only x is kept for the
    backward, which runs the block's forward again to get what it needs (same values: no dropout, and the
    RNG state is restored); with recompute "selective" its matmuls' and attention's outputs are kept too, and only
    the ops between them run again. Generation (a cache in args) and no-grad evaluation never recompute. The first
    block's input needs no gradient under a frozen embedding (LoRA), and is recomputed all the same."""
    if recompute == "selective" and torch.is_grad_enabled():
        return checkpoint(block, x, *args, use_reentrant=False, context_fn=selective_contexts)
    if recompute and torch.is_grad_enabled():
        return checkpoint(block, x, *args, use_reentrant=False)
    return block(x, *args)
