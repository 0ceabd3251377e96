"""Tensor parallelism for the GPT: Megatron's column- and row-parallel linears, and how each rank's slice maps to the full model.

Each block's two matrix pairs are split across the T ranks of a TP group so that a block costs
one all-reduce forward and one backward per pair:

    attention: c_attn column-parallel (rank r keeps heads r*H/T .. (r+1)*H/T of q, k and v),
               attention over its own heads, c_proj row-parallel (the matching input columns)
    MLP:       c_fc column-parallel (rows r*4C/T ..), GELU, c_proj row-parallel

    column-parallel input:   identity forward, all-reduce of the input gradient backward  (_CopyToTP)
    row-parallel output:     all-reduce of the partial sums forward, identity backward   (_ReduceFromTP)

Everything else (embeddings, position embeddings, layer norms, the tied head, the row-parallel
biases, added once after the all-reduce) is replicated: every TP rank computes it identically, so
the activations, the loss and the replicated gradients are bitwise equal across the TP group.

The model is built whole from the seed and then sliced (`parallelize`), so TP = 1 and TP = T start
from the same parameters; a `TPSlice` says which ranges of the full tensor a rank holds, which is
what checkpoints record and reassemble.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig


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


def plan(cfg: ModelConfig, tp: int) -> dict[str, TPSlice]:
    """The TP slice of every split parameter, by its name in the full model."""
    C = cfg.n_embd
    c, f = C // tp, 4 * C // tp

    def rows(width: int, copies: int = 1) -> tuple:  # per rank: its block of each of `copies` stacked blocks
        return tuple(tuple((k * width * tp + r * width, k * width * tp + (r + 1) * width) for k in range(copies))
                     for r in range(tp))

    slices = {}
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        slices[h + "attn.c_attn.weight"] = TPSlice(0, (3 * C, C), rows(c, 3))  # q, k and v of rank r's heads
        slices[h + "attn.c_attn.bias"] = TPSlice(0, (3 * C,), rows(c, 3))
        slices[h + "attn.c_proj.weight"] = TPSlice(1, (C, C), rows(c))  # the matching input columns
        slices[h + "mlp.c_fc.weight"] = TPSlice(0, (4 * C, C), rows(f))
        slices[h + "mlp.c_fc.bias"] = TPSlice(0, (4 * C,), rows(f))
        slices[h + "mlp.c_proj.weight"] = TPSlice(1, (C, 4 * C), rows(f))
    return slices


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


def parallelize(model: nn.Module, tp_size: int, tp_rank: int, comm) -> dict[str, TPSlice]:
    """Replace the full model's split layers by this rank's parallel ones, in place; return the plan.

    `comm` is the TP group's communicator. The full weights are dropped as each layer is replaced.
    """
    slices = plan(model.cfg, tp_size)
    for i, block in enumerate(model.transformer.h):
        h = f"transformer.h.{i}."
        attn, mlp = block.attn, block.mlp
        attn.c_attn = ColumnParallelLinear(attn.c_attn, slices[h + "attn.c_attn.weight"],
                                           slices[h + "attn.c_attn.bias"], tp_rank, comm)
        attn.c_proj = RowParallelLinear(attn.c_proj, slices[h + "attn.c_proj.weight"], tp_rank, comm)
        attn.n_head = model.cfg.n_head // tp_size
        mlp.c_fc = ColumnParallelLinear(mlp.c_fc, slices[h + "mlp.c_fc.weight"], slices[h + "mlp.c_fc.bias"],
                                        tp_rank, comm)
        mlp.c_proj = RowParallelLinear(mlp.c_proj, slices[h + "mlp.c_proj.weight"], tp_rank, comm)
    model.tp_slices = slices
    return slices


def full_tensors(layout, slices: dict[str, TPSlice], flats) -> dict[str, torch.Tensor]:
    """The full model's tensors by name, from flats[t] = TP rank t's padded flat buffer (T = len(flats)).

    Split parameters are placed from every TP rank's slice; replicated ones are TP rank 0's copy (views
    of flats[0], which every TP rank holds bitwise equal). All in the flats' dtype and device.
    """
    full = {}
    for s in layout.slots:
        local = [flat[s.offset : s.offset + s.numel].view(s.shape) for flat in flats]
        if s.name in slices:
            tp_slice = slices[s.name]
            full[s.name] = torch.empty(tp_slice.full_shape, dtype=flats[0].dtype, device=flats[0].device)
            for t, piece in enumerate(local):
                tp_slice.place(full[s.name], piece, t)
        else:
            full[s.name] = local[0]
    return full


def local_flat(layout, slices: dict[str, TPSlice], full: dict[str, torch.Tensor],
               tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s padded flat buffer in `layout` from the full tensors (zeros in the padding)."""
    first = next(iter(full.values()))
    flat = torch.zeros(layout.padded_numel, dtype=first.dtype, device=first.device)
    for s in layout.slots:
        value = slices[s.name].take(full[s.name], tp_rank) if s.name in slices else full[s.name]
        flat[s.offset : s.offset + s.numel] = value.reshape(-1)
    return flat
