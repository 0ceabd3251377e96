"""Layers shared by every architecture: Megatron's column- and row-parallel linears and the TPSlice they hold,
RMSNorm, rotary position embeddings, the attention core (causal, grouped-query, with a KV cache) and the cache.

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
from torch.utils.checkpoint import checkpoint


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


def copy_to_tp(x: torch.Tensor, comm) -> torch.Tensor:
    """`x` for column-parallel layers of a TP group (`comm`): its gradient is all-reduced; `x` itself without one.

    Several column-parallel layers reading one input (Llama's q, k and v) call this once and share the all-reduce.
    """
    return x if comm is None else _CopyToTP.apply(x, comm)


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: this rank's output features; the input is the full, replicated activation.

    `bias`: None for a layer without one. `comm`: None when the caller applies copy_to_tp to the input itself.
    """

    def __init__(self, full: nn.Linear, weight: TPSlice, bias: TPSlice | None, rank: int, comm):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(weight.take(full.weight.detach(), rank))
        self.bias = nn.Parameter(bias.take(full.bias.detach(), rank)) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.comm), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b: this rank's input features; the bias (if any) is replicated and added once."""

    def __init__(self, full: nn.Linear, weight: TPSlice, rank: int, comm):
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(weight.take(full.weight.detach(), rank))
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias


def blocks(width: int, tp: int, copies: int = 1) -> tuple:
    """Per TP rank: its block of `width` rows in each of `copies` stacked blocks of tp x width (TPSlice parts)."""
    return tuple(tuple((k * width * tp + r * width, k * width * tp + (r + 1) * width) for k in range(copies))
                 for r in range(tp))


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and returned in x's dtype (as Hugging Face's Llama)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def new_positions(idx: torch.Tensor, cache: KVCache | None, seq_len: int) -> torch.Tensor:
    """The positions of `idx`'s tokens, (time,): after those already in `cache`, refused past `seq_len`."""
    T = idx.shape[1]
    past = 0 if cache is None else cache.length
    if past + T > seq_len:
        raise ValueError(f"{past} cached + {T} new positions exceed seq_len {seq_len}")
    return torch.arange(past, past + T, device=idx.device)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, head_dim) of rotary embeddings at `positions`, in fp32, rotate-half layout: frequency i
    at columns i and i + head_dim / 2."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's (x_i, x_{i + D/2}) pairs of x (B, H, T, D) by its position's angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype))


class KVCache:
    """The keys and values of every layer for the first `length` positions, preallocated to seq_len.

    Filled by a model's `forward(idx, cache)`: the new tokens sit at positions length .. length + T - 1,
    and each layer attends over all the positions stored so far. It stores the KV heads only (fewer than
    the query heads under grouped-query attention). It holds at most seq_len positions; the caller decides
    what happens past that (generate.py slides a window and refills the cache).
    """

    def __init__(self, cfg, batch: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        shape = (cfg.n_layer, batch, cfg.kv_heads, cfg.seq_len, cfg.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer`'s keys and values (B, KV, T, D) of the new positions; all of them so far."""
        end = self.length + k.shape[2]
        self.keys[layer, :, :, self.length : end] = k
        self.values[layer, :, :, self.length : end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None = None,
           layer: int = 0) -> torch.Tensor:
    """Causal attention of q (B, H, T, D) over k and v (B, KV, T, D), KV dividing H (each KV head serves H / KV
    query heads); with a cache, k and v are appended to it first and q continues its positions."""
    past = 0
    if cache is not None:
        past = cache.length
        k, v = cache.append(layer, k, v)
    mask = _causal_mask(past, q.shape[2], q.device)
    # enable_gqa: each KV head serves its group of query heads without copies of k and v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past == 0,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _causal_mask(past: int, T: int, device: torch.device) -> torch.Tensor | None:
    """New query i (at position past + i) sees keys 0 .. past + i; None where no mask is needed.

    With nothing cached SDPA's own causal mask is exact; one new query sees every key.
    """
    if past == 0 or T == 1:
        return None
    return torch.ones(T, past + T, dtype=torch.bool, device=device).tril(diagonal=past)


def tied_head_hook(head: str, embedding: str):
    """A load_state_dict pre-hook for a head tied to the token embedding: strict loading accepts a state dict
    without the head (model.safetensors stores the one tensor once, under the embedding's name); one that
    holds both must hold the same values in each."""

    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        h, e = prefix + head, prefix + embedding
        if e not in state_dict:
            return
        if h not in state_dict:
            state_dict[h] = state_dict[e]
        elif state_dict[h] is not state_dict[e] and not torch.equal(state_dict[h], state_dict[e]):
            error_msgs.append(f"{h} differs from {e}, but the two are one tied tensor")

    return hook


def head_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, loss, recompute: bool) -> torch.Tensor:
    """loss(model(idx), targets); with `recompute` (--activation-checkpointing full, while training) the head and
    the loss keep only the final norm's output for the backward, which computes the logits again (same values),
    instead of the loss's fp32 log-probabilities (batch x time x vocab)."""
    if not (recompute and torch.is_grad_enabled()):
        return loss(model(idx), targets)
    return checkpoint(lambda h: loss(model.lm_head(h), targets), model.hidden(idx), use_reentrant=False)


def run_block(block: nn.Module, recompute: bool, x: torch.Tensor, *args) -> torch.Tensor:
    """block(x, *args); with `recompute` (activation checkpointing, while training) only x is kept for the
    backward, which runs the block's forward again to get what it needs (same values: no dropout, and the
    RNG state is restored). Generation (a cache in args) and no-grad evaluation never recompute."""
    if recompute and torch.is_grad_enabled() and x.requires_grad:
        return checkpoint(block, x, *args, use_reentrant=False)
    return block(x, *args)
