"""Tensor parallelism's building blocks: Megatron's column- and row-parallel linears, the TPSlice each rank holds,
and the autograd functions that place the TP group's all-reduces around them.

Each block's two matrix pairs are split across the T ranks of a TP group so that a block costs
one all-reduce forward and one backward per pair:

    column-parallel input:   identity forward, all-reduce of the input gradient backward  (_CopyToTP)
    row-parallel output:     all-reduce of the partial sums forward, identity backward   (ReduceFromTP)

A `TPSlice` says which ranges of the full tensor a rank holds; an architecture's TP plan maps its
split parameters to slices, which is what the layers take and what checkpoints record and reassemble.

With more TP ranks than KV heads (tp a multiple of them) each KV head is replicated on tp / KV heads
consecutive ranks, as Megatron does: their k and v slices are the same rows. Each replica computes only
its own query heads' part of the head's weight gradient, so the weights pass through `sum_over_replicas`,
whose backward all-reduces that gradient over the replica group (per micro-batch, like the activations'
all-reduces); their input-gradient parts stay partial and are summed by the block's copy_to_tp as every
other rank's are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TPSlice:
    """Rank r holds full.narrow(dim, lo, hi - lo) for each (lo, hi) of parts[r], concatenated along dim."""

    dim: int
    full_shape: tuple[int, ...]
    parts: tuple[tuple[tuple[int, int], ...], ...]  # per TP rank, its ranges along dim

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s slice of the full tensor (a copy)."""
        if full.is_meta:  # shapes alone (a plan): torch.cat's meta kernel would import torch._dynamo, ~1.5 s
            shape = list(full.shape)
            shape[self.dim] = sum(hi - lo for lo, hi in self.parts[rank])
            return full.new_empty(shape)
        return torch.cat([full.narrow(self.dim, lo, hi - lo) for lo, hi in self.parts[rank]], dim=self.dim)

    def place(self, full: torch.Tensor, local: torch.Tensor, rank: int) -> None:
        """Write rank `rank`'s slice `local` into its place in `full`."""
        at = 0
        for lo, hi in self.parts[rank]:
            full.narrow(self.dim, lo, hi - lo).copy_(local.narrow(self.dim, at, hi - lo))
            at += hi - lo

    def first_holder(self, rank: int) -> int:
        """The first TP rank holding the same ranges as `rank` (itself unless its slice is replicated)."""
        return self.parts.index(self.parts[rank])

    def holders(self, rank: int) -> int:
        """How many TP ranks hold `rank`'s ranges: 1, or the replicas of a KV head on several ranks."""
        return self.parts.count(self.parts[rank])

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = sum(hi - lo for lo, hi in self.parts[0])
        return tuple(shape)

    def to_dict(self) -> dict:
        return {"dim": self.dim, "full_shape": list(self.full_shape),
                "parts": [[list(r) for r in ranges] for ranges in self.parts]}

    @classmethod
    def from_dict(cls, d: dict) -> "TPSlice":
        return cls(d["dim"], tuple(d["full_shape"]), tuple(tuple(tuple(r) for r in ranges) for ranges in d["parts"]))


class _CopyToTP(torch.autograd.Function):
    """Before a column-parallel layer: each rank's input gradient is a partial sum over its slice."""

    @staticmethod
    def forward(ctx, x, comm, purpose):
        ctx.comm, ctx.purpose = comm, purpose
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, ctx.purpose)
        return grad, None, None


class ReduceFromTP(torch.autograd.Function):
    """After a row-parallel layer: the output is the sum of every rank's partial product."""

    @staticmethod
    def forward(ctx, x, comm, purpose="all_reduce_tp_activations"):
        y = x.contiguous().clone()
        comm.all_reduce(y, purpose)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _SumOverReplicas(torch.autograd.Function):
    """A weight replicated on the ranks of `comm` of which each rank computes only part of the gradient (a KV head
    on several ranks: its own query heads' part; a LoRA A on a column-parallel base: its own output slice's part):
    identity forward, the weight's gradient all-reduced over `comm` backward (the input's gradient stays partial,
    for the block's copy_to_tp all-reduce).

    Summed here, per micro-batch, rather than by the engine once per step: every reader of .grad (ZeRO stage 1 or
    2, bf16's fp32 accumulation, activation checkpointing, a frozen base) then sees the whole gradient. The cost is
    small beside the TP all-reduces it sits among: one head's k or v rows per layer (measured on a tiny Llama at
    TP 4 over 2 KV heads: 32 KB per step beside 393 KB of activation and input-gradient all-reduces).
    """

    @staticmethod
    def forward(ctx, weight, comm, collective):
        ctx.comm, ctx.collective = comm, collective
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, ctx.collective)
        return grad, None, None


def sum_over_replicas(weight: torch.Tensor | None, comm, collective: str = "all_reduce_kv_replica_grads"
                      ) -> torch.Tensor | None:
    """`weight` (replicated on the ranks of `comm`, each computing part of its gradient), whose gradient is summed
    over those ranks (the all-reduce counted as `collective`); itself without replicas (`comm` None) or without a
    gradient (a frozen weight: nothing to sum)."""
    if comm is None or weight is None or not weight.requires_grad:
        return weight
    return _SumOverReplicas.apply(weight, comm, collective)


def copy_to_tp(x: torch.Tensor, comm, purpose: str = "all_reduce_tp_grads") -> torch.Tensor:
    """`x` for column-parallel layers of a TP group (`comm`): its gradient is all-reduced (counted as `purpose`); `x`
    itself without one.

    Several column-parallel layers reading one input (Llama's q, k and v) call this once and share the all-reduce.
    """
    return x if comm is None else _CopyToTP.apply(x, comm, purpose)


def reduce_from_tp(x: torch.Tensor, comm) -> torch.Tensor:
    """The sum over the TP group (`comm`) of each rank's partial `x` (a row-parallel product's), identity backward;
    `x` itself without one."""
    return x if comm is None else ReduceFromTP.apply(x, comm)


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: this rank's output features; the input is the full, replicated activation.

    `bias`: None for a layer without one. `comm`: None when the caller applies copy_to_tp to the input itself.
    `replicas`: the TP ranks holding the same output features (a KV head on several ranks), whose weight
    and bias gradients are summed over them; None when no other rank holds them.
    """

    def __init__(self, full: nn.Linear, weight: TPSlice, bias: TPSlice | None, rank: int, comm, replicas=None):
        super().__init__()
        self.comm, self.replicas = comm, replicas
        self.weight = nn.Parameter(weight.take(full.weight.detach(), rank))
        self.bias = nn.Parameter(bias.take(full.bias.detach(), rank)) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = sum_over_replicas(self.weight, self.replicas), sum_over_replicas(self.bias, self.replicas)
        return F.linear(copy_to_tp(x, self.comm), weight, bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b: this rank's input features; the bias (if any) is replicated and added once."""

    def __init__(self, full: nn.Linear, weight: TPSlice, rank: int, comm):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(weight.take(full.weight.detach(), rank))
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ReduceFromTP.apply(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias


def blocks(width: int, tp: int, copies: int = 1) -> tuple:
    """Per TP rank: its block of `width` rows in each of `copies` stacked blocks of tp x width (TPSlice parts)."""
    return tuple(tuple((k * width * tp + r * width, k * width * tp + (r + 1) * width) for k in range(copies))
                 for r in range(tp))


def kv_replicas(kv_heads: int, tp: int) -> int:
    """How many TP ranks hold each KV head: 1 when tp divides the KV heads, tp / KV heads when tp is a multiple of
    them (ValueError otherwise)."""
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tp {tp} neither divides the KV heads ({kv_heads}) nor is a multiple of them")
    return max(1, tp // kv_heads)


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """The KV heads each of `tp` TP ranks holds: kv_heads / tp, or 1 (a replicated head) past the KV heads."""
    return kv_heads * kv_replicas(kv_heads, tp) // tp


def kv_head_blocks(kv_heads: int, head_dim: int, tp: int) -> tuple:
    """Per TP rank: the rows of its KV heads in k_proj or v_proj (TPSlice parts). Rank r holds the KV heads its
    query heads attend with: the r-th block of kv_heads / tp heads, or, with more ranks than KV heads, head
    r // replicas, the same rows as the other ranks of its replica group."""
    replicas, width = kv_replicas(kv_heads, tp), kv_heads_per_rank(kv_heads, tp) * head_dim
    return tuple(((r // replicas * width, (r // replicas + 1) * width),) for r in range(tp))
