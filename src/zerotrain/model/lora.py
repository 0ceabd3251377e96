"""LoRA adapters on a model's linears: y = W x + (alpha / R) B A dropout(x), the base W frozen.

Each adapted linear keeps its own parameters and names; it gains two children, `lora_A` (R x in, initialised as
peft does: kaiming-uniform with a = sqrt(5)) and `lora_B` (out x R, zero, so the first forward is the base's),
and a forward hook that adds their product. The adapters' names are therefore peft's without its
`base_model.model.` prefix (`model.layers.0.self_attn.q_proj.lora_A.weight`): the export is a rename.

Under tensor parallelism the adapters follow their base's split (Megatron's rules, applied to B A):

    column-parallel base (y_r = W_r x):  A replicated, B split on the output like W.  Each rank's gradient of A is
        a partial sum over its output slice, so it is all-reduced over the TP group (tensor_parallel's
        sum_over_replicas); the gradient of x through A stays partial like the base's, for the copy_to_tp all-reduce
        that sums the input's.
        A KV head's base replicated on several TP ranks has its B replicated with it, its gradient summed likewise.
    row-parallel base (y = sum_r W_r x_r):  A split on the input like W, B replicated.  A's output is a partial
        sum, all-reduced before B (as the base's output is, by ReduceFromTP); B then sees the full, replicated input.

The full A is drawn from the seed on every rank and each rank keeps its slice, so the adapters are the same at
every TP degree and world size.

Dropout (peft's: on the adapters' input only) draws each row's mask from a generator seeded by (seed, step, the row's
index in the step's global batch, the adapter's name) alone, over the full model's input features. So the masks do
not depend on how the global batch is split (ranks, micro-batches, TP degree: the TP ranks of a replica agree on a
replicated input, and a row-parallel base's slice of the input gets its slice of the full mask) nor on which other
linears have adapters, a recomputed forward (activation checkpointing) draws what the first did, and a resumed run
what the uninterrupted one did. A mixture of experts' shared expert reads the layer's tokens flattened (rows x
positions, features): the same masks, per row and position. Under --cp each rank draws its rows' whole masks and
keeps its part of the positions (model.context_parallel, set before the adapters are added). A routed expert
(--lora-targets experts) reads only the rows routed to it, whose tokens it does not know: each call draws its rows'
masks from one generator seeded by (every key of the micro-batch's rows, the adapter's name), so a recomputed forward
and a resumed run draw what the first did at the same split, but another split (which decides what a micro-batch
routes to the expert) draws others. The masks apply only inside `dropout_rows`, which the training loop opens around
each micro-batch's forward and backward: validation, evaluation and generation never drop.
"""

from __future__ import annotations

import math
import zlib
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotrain.config import LORA_EXPERTS, LoraConfig

from .tensor_parallel import (ColumnParallelLinear, ReduceFromTP, RowParallelLinear, TPSlice, copy_to_tp,
                              sum_over_replicas)
from .moe import moe_layers


def lora_scale(cfg: LoraConfig) -> float:
    """What the adapters' product is multiplied by: alpha / rank (LoRA's, and peft's without rslora)."""
    return cfg.alpha / cfg.rank


class LoRADown(nn.Module):
    """A: the rank-R projection of the input; `split` says how its base is split over the TP group `comm`."""

    def __init__(self, weight: torch.Tensor, split: str | None, comm):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.split, self.comm = split, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split == "column":
            return F.linear(x, sum_over_replicas(self.weight, self.comm, "all_reduce_tp_grads"))
        h = F.linear(x, self.weight)
        return ReduceFromTP.apply(h, self.comm) if self.split == "row" else h


class LoRAUp(nn.Module):
    """B: back from rank R to the base's output features (this rank's slice of them under a column split).

    `replicas`: the TP ranks holding the same output features (a KV head replicated on several ranks, as its base
    is), over which B's gradient is summed as the base's would be; None when no other rank holds them."""

    def __init__(self, weight: torch.Tensor, replicas=None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.replicas = replicas

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, sum_over_replicas(self.weight, self.replicas))


_MASK32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    """A bijection of 32-bit values whose every output bit depends on every input bit (Wellons' lowbias32)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seed: int, step: int, rows) -> list[int]:
    """Each row's dropout key (32 bits) from the seed, the optimizer step and the row's index in the global batch."""
    base = _mix32(_mix32(_mix32((seed & _MASK32) ^ 0x243F6A88) ^ ((seed >> 32) & _MASK32)) ^ (step & _MASK32))
    return [_mix32((row & _MASK32) ^ base) for row in rows]


def adapter_key(name: str) -> int:
    """An adapter's 32 bits in the dropout's seeds: from its linear's name, so not from which others are adapted."""
    return zlib.crc32(name.encode())


def _generator(key: int, adapter: int, device: torch.device) -> torch.Generator:
    seed = (_mix32(key ^ _mix32(adapter ^ 0x9E3779B9)) << 32) | _mix32(key ^ _mix32(adapter ^ 0x85EBCA6B))
    return torch.Generator(device).manual_seed(seed)


def keep_mask(keys: list[int], adapter: int, features: torch.Tensor | None, in_features: int, positions: int,
              p: float, device: torch.device) -> torch.Tensor:
    """Which inputs an adapter keeps: [rows, positions, features] bools, each False with probability p.

    Row b's [positions, in_features] draws come from a generator seeded by (keys[b], the adapter's key) alone, so
    they are the same on every rank and split, and as often as they are asked for; `features`: the indices of those
    this rank holds (a row-parallel base's input slice), None for all.
    """
    drawn = torch.empty(len(keys), positions, in_features, device=device)
    for row, key in zip(drawn, keys):
        row.uniform_(generator=_generator(key, adapter, device))
    return (drawn if features is None else drawn[..., features]) >= p


def routed_keep_mask(keys: list[int], adapter: int, features: torch.Tensor | None, in_features: int, rows: int,
                     p: float, device: torch.device) -> torch.Tensor:
    """Which inputs a routed expert's adapter keeps of the `rows` routed to it: [rows, features] bools, each False
    with probability p, drawn by one generator seeded by every key of the micro-batch's rows and the adapter's key
    (the expert does not know its rows' tokens: the masks follow the split, see the module docstring)."""
    folded = 0
    for key in keys:
        folded = _mix32(folded ^ key)
    drawn = torch.empty(rows, in_features, device=device).uniform_(generator=_generator(folded, adapter, device))
    return (drawn if features is None else drawn[..., features]) >= p


class DropoutRows:
    """What the adapters' dropout draws for, shared by them: the seed, and while a training micro-batch runs, its
    rows (their indices in the step's global batch) and their keys; else None: no dropout."""

    def __init__(self, seed: int, context_parallel=None):
        self.seed = seed
        self.rows: range | None = None
        self.keys: list[int] | None = None
        # --cp: each row's positions are split over the cp group (parallel/context.py's ContextParallel: its size, and
        # row_part, this rank's part of a whole row's positions); each rank draws the whole row's mask and keeps its
        # part, so the masks are --cp 1's. None: rows are whole.
        self.context_parallel = context_parallel


class LoRADropout(nn.Module):
    """Dropout on an adapter's input, its masks drawn per row by generators keyed by the micro-batch's rows
    (keep_mask; a routed expert's by routed_keep_mask), never by torch's global generator; none outside a training
    micro-batch (`dropout_rows`)."""

    # eager under --compile (model/compiled.py's keep_eager): the keys change every micro-batch and the generators
    # are made per row, which a compiled graph would guard on and recompile for
    eager_under_compile = True

    def __init__(self, p: float, adapter: int, features: torch.Tensor | None, in_features: int, rows: DropoutRows,
                 routed: bool = False):
        super().__init__()
        self.p, self.adapter, self.features, self.in_features, self.rows = p, adapter, features, in_features, rows
        self.routed = routed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = self.rows.keys
        if keys is None or not self.training:
            return x
        if self.routed:  # (routed rows, features)
            keep = routed_keep_mask(keys, self.adapter, self.features, self.in_features, len(x), self.p, x.device)
        else:  # (rows, positions, features), or a shared expert's (rows x positions, features)
            positions, cp = x[..., 0].numel() // len(keys), self.rows.context_parallel
            if cp is None:
                keep = keep_mask(keys, self.adapter, self.features, self.in_features, positions, self.p, x.device)
            else:  # the whole row's masks, this rank's part of them
                keep = cp.row_part(keep_mask(keys, self.adapter, self.features, self.in_features, positions * cp.size,
                                             self.p, x.device))
            keep = keep.view(x.shape)
        return (x * keep).mul_(1 / (1 - self.p))  # saves the bool mask for the backward, as nn.Dropout does

    def extra_repr(self) -> str:
        return f"p={self.p}"


@contextmanager
def dropout_rows(model: nn.Module, step: int, rows: range):
    """Within: the adapters' dropout masks are those of rows `rows` of step `step`'s global batch (a no-op for a
    model without adapter dropout). Open it around a micro-batch's forward and its backward, which may recompute."""
    holder = getattr(model, "lora_rows", None)
    if holder is None:
        yield
        return
    holder.rows, holder.keys = rows, row_keys(holder.seed, step, rows)
    try:
        yield
    finally:
        holder.rows = holder.keys = None


def adapted_modules(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """(name, module) of the blocks' linears named in `targets` (their last name part), in the model's order; a
    mixture of experts' routed experts' linears where `targets` names them (LORA_EXPERTS), and only then."""
    kinds = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
    routed = routed_expert_linears(model)
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, kinds) and n != "lm_head"
            and (LORA_EXPERTS in targets if id(m) in routed else n.rsplit(".", 1)[-1] in targets)]


def routed_expert_linears(model: nn.Module) -> set[int]:
    """The ids of the routed experts' linears (not the routers', nor a shared expert's)."""
    return {id(m) for moe in moe_layers(model) for expert in moe.local_experts() for m in expert.modules()
            if isinstance(m, nn.Linear)}


def add_adapters(model: nn.Module, cfg: LoraConfig, seed: int, tp_rank: int = 0, comm=None, device=None,
                 dtype=None) -> dict[str, TPSlice]:
    """Freeze `model` and give each target linear its adapters, in place; the TP slices of the split adapters.

    `comm`: the TP group under tensor parallelism (model.tp_slices holds its plan), else None. The adapters'
    slices are added to model.tp_slices, and model.lora records `cfg`. The adapters are made on their base's device
    in its dtype, or on `device` in `dtype` where given (a base left on the meta device, which ZeRO-3 fills shard by
    shard: the adapters have their values at once).
    """
    freeze_base(model)
    base_slices = getattr(model, "tp_slices", {})
    generator = torch.Generator().manual_seed(seed)
    slices = {}
    rows = DropoutRows(seed, getattr(model, "context_parallel", None))
    routed = routed_expert_linears(model)
    for name, module in adapted_modules(model, cfg.modules(model.cfg.arch)):
        base_slice = base_slices.get(name + ".weight")
        out_full, in_full = base_slice.full_shape if base_slice is not None else tuple(module.weight.shape)
        down = torch.empty(cfg.rank, in_full, device="cpu")  # drawn on the CPU also for a model on the meta device
        # peft's init (nn.Linear's): kaiming-uniform, a = sqrt(5), drawn whole so that every TP degree gets the same A
        nn.init.kaiming_uniform_(down, a=math.sqrt(5), generator=generator)
        split = None
        if isinstance(module, ColumnParallelLinear):
            split = "column"
            slices[name + ".lora_B.weight"] = TPSlice(0, (out_full, cfg.rank), base_slice.parts)
        elif isinstance(module, RowParallelLinear):
            split = "row"
            slices[name + ".lora_A.weight"] = TPSlice(1, (cfg.rank, in_full), base_slice.parts)
            down = slices[name + ".lora_A.weight"].take(down, tp_rank)
        at, kind = device or module.weight.device, dtype or module.weight.dtype
        module.lora_A = LoRADown(down.to(at, kind), split, comm)
        module.lora_B = LoRAUp(initial_up(module.weight.shape[0], cfg.rank).to(at, kind),
                               getattr(module, "replicas", None))
        # the full model's indices of the input features this rank holds: a row-parallel base's slice of them
        features = None
        if split == "row":
            features = torch.cat([torch.arange(lo, hi, device=at) for lo, hi in base_slice.parts[tp_rank]])
        # as peft: no dropout module at 0 (a dropout of 0 still copies its input in training)
        module.lora_dropout = (LoRADropout(cfg.dropout, adapter_key(name), features, in_full, rows,
                                           routed=id(module) in routed) if cfg.dropout else nn.Identity())
        module.lora_scale = lora_scale(cfg)
        module.lora_hooks = [module.register_forward_hook(_add_adapter_output)]
        if split == "column" and module.comm is not None:
            # GPT-2's column-parallel linears sum their input's gradient themselves: here the input is copied to
            # the TP group once, before the base and the adapters both read it, so that one all-reduce sums both.
            module.lora_input_comm, module.comm = module.comm, None
            module.lora_hooks.append(module.register_forward_pre_hook(
                lambda m, args: (copy_to_tp(args[0], m.lora_input_comm), *args[1:])))
    model.tp_slices = {**base_slices, **slices}
    model.lora = cfg
    if cfg.dropout:
        model.lora_rows = rows
    return slices


def freeze_base(model: nn.Module) -> None:
    """Every parameter the model has before its adapters: no gradients, so no optimizer state or reduction."""
    model.requires_grad_(False)


def initial_up(out_features: int, rank: int) -> torch.Tensor:
    """B at the start: zero, so that B A adds nothing and the first forward is the base's (LoRA's and peft's init)."""
    return torch.zeros(out_features, rank)


def _add_adapter_output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    x = module.lora_dropout(args[0])
    return out + module.lora_scale * module.lora_B(module.lora_A(x))


def adapter_names(model: nn.Module) -> list[str]:
    """The adapters' parameter names, in the model's order."""
    return [n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W + alpha / R B A) and remove it: the plain architecture again.

    A model without TP only (load_model's, export's).
    """
    for module in [m for m in model.modules() if hasattr(m, "lora_hooks")]:
        delta = module.lora_B.weight.float() @ module.lora_A.weight.float()
        module.weight.copy_((module.weight.float() + module.lora_scale * delta).to(module.weight.dtype))
        for hook in module.lora_hooks:
            hook.remove()
        del module.lora_A, module.lora_B, module.lora_dropout, module.lora_hooks
    model.__dict__.pop("lora", None)
    model.__dict__.pop("lora_rows", None)
    return model


@contextmanager
def adapters_off(model: nn.Module):
    """Within: every adapter adds nothing (its scale 0: the base's output plus zero is the base's, to the bit), so the
    model computes as its frozen base: a LoRA run's live preference reference."""
    modules = [m for m in model.modules() if hasattr(m, "lora_hooks")]
    scales = [m.lora_scale for m in modules]
    for m in modules:
        m.lora_scale = 0.0
    try:
        yield
    finally:
        for m, scale in zip(modules, scales):
            m.lora_scale = scale
