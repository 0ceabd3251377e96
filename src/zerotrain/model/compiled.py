"""torch.compile applied to a model (--compile): its whole forward, or each transformer block's forward alone."""

from __future__ import annotations

import torch
import torch.nn as nn


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: the members of its first ModuleList."""
    return next((list(m) for m in model.modules() if isinstance(m, nn.ModuleList)), [])


def keep_eager(model: nn.Module) -> None:
    """Each module of `model` whose class says `eager_under_compile` (LoRA's dropout) runs eagerly inside the compiled
    model: its forward disabled in dynamo, on the instance, as `@torch.compiler.disable` on its class would. Here, as
    the model is compiled, rather than by that decorator: torch.compiler.disable imports torch._dynamo, which at the
    class's import every zerotrain command paid for, most of them never compiling (docs/benchmarks.md)."""
    for module in model.modules():
        if getattr(module, "eager_under_compile", False):
            module.forward = torch.compiler.disable(module.forward)


def compile_blocks(model: nn.Module) -> nn.Module:
    """Each transformer block's forward compiled on its own, in place (as torchtitan compiles each block), and the
    rest of the model left eager; returns the model.

    The block's forward is compiled, not its call: the module's forward pre-hooks and forward hooks still run eagerly
    around the compiled graph. That is where ZeRO-3 gathers a block's parameters and releases them
    (parallel/sharded.py), so no collective and no hook falls inside a graph: one graph per block, without a break,
    in which inductor fuses the norms, the rotary embedding and the gated MLP's element-wise ops. The saved-tensor
    hooks around the model's forward see what the compiled block saves for its backward (its weights kept as where
    they lie, gathered again when unpacked) as they see an eager block's. The blocks share one compiled code (same
    class, same forward): a model compiles once per kind of block, not once per layer. The parameters keep their
    names (no wrapper module in between): checkpoints, layouts and units are the eager model's."""
    for block in transformer_blocks(model):
        block.forward = torch.compile(block.forward)
    return model


def compiled(model: nn.Module, per_block: bool) -> nn.Module:
    """What the step runs under --compile: with `per_block` (a placement that gathers each block's parameters for it,
    ZeRO-3) the model with each block compiled (compile_blocks), else the whole model's forward and backward compiled
    into one graph (torch.compile's module wrapper; the parameters stay the engine's)."""
    keep_eager(model)
    return compile_blocks(model) if per_block else torch.compile(model)
