"""Layers shared by every architecture: Megatron's column- and row-parallel linears and the TPSlice they hold.

Each block's two matrix pairs are split across the T ranks of a TP group so that a block costs
one all-reduce forward and one backward per pair:

    column-parallel input:   identity forward, all-reduce of the input gradient backward  (_CopyToTP)
    row-parallel output:     all-reduce of the partial sums forward, identity backward   (_ReduceFromTP)

A `TPSlice` says which ranges of the full tensor a rank holds; an architecture's TP plan maps its
split parameters to slices, which is what the layers take and what checkpoints record and reassemble.
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
        return torch.cat([full.narrow(self.dim, lo, hi - lo) for lo, hi in self.parts[rank]], dim=self.dim)

    def place(self, full: torch.Tensor, local: torch.Tensor, rank: int) -> None:
        """Write rank `rank`'s slice `local` into its place in `full`."""
        at = 0
        for lo, hi in self.parts[rank]:
            full.narrow(self.dim, lo, hi - lo).copy_(local.narrow(self.dim, at, hi - lo))
            at += hi - lo

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
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, "all_reduce_tp_grads")
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """After a row-parallel layer: the output is the sum of every rank's partial product."""

    @staticmethod
    def forward(ctx, x, comm):
        y = x.contiguous().clone()
        comm.all_reduce(y, "all_reduce_tp_activations")
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: this rank's output features; the input is the full, replicated activation."""

    def __init__(self, full: nn.Linear, weight: TPSlice, bias: TPSlice, rank: int, comm):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(weight.take(full.weight.detach(), rank))
        self.bias = nn.Parameter(bias.take(full.bias.detach(), rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTP.apply(x, self.comm), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b: this rank's input features; the bias is replicated and added once."""

    def __init__(self, full: nn.Linear, weight: TPSlice, rank: int, comm):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(weight.take(full.weight.detach(), rank))
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.comm) + self.bias
