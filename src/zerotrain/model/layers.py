"""Layers shared by every architecture: Megatron's column- and row-parallel linears and the TPSlice they hold,
RMSNorm, rotary position embeddings (with Llama 3's frequency scaling), the attention core (causal, grouped-query,
document-masked, windowed, with a KV cache) and the cache.

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

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention
from torch.utils._triton import has_triton
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


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and returned in x's dtype (as Hugging Face's Llama)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: the gain as the caller passes it (Qwen3's q/k norms under TP: see LlamaAttention), else own."""
        xf = x.float()
        gain = self.weight if weight is None else weight
        return gain * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def new_positions(idx: torch.Tensor, cache: KVCache | None, seq_len: int,
                  segments: torch.Tensor | None = None) -> torch.Tensor:
    """The positions of `idx`'s tokens: (time,) after those already in `cache`, refused past `seq_len`; with
    `segments` (batch, time), each token's position within its record (positions_from_segments)."""
    T = idx.shape[1]
    if segments is not None:
        if cache is not None:
            raise ValueError("segments and a KV cache cannot be combined: a cache continues one sequence")
        if segments.shape != idx.shape:
            raise ValueError(f"segments of shape {tuple(segments.shape)} do not match the inputs' {tuple(idx.shape)}")
        if T > seq_len:
            raise ValueError(f"{T} positions exceed seq_len {seq_len}")
        return positions_from_segments(segments)
    past = 0 if cache is None else cache.length
    if past + T > seq_len:
        raise ValueError(f"{past} cached + {T} new positions exceed seq_len {seq_len}")
    return torch.arange(past, past + T, device=idx.device)


def positions_from_segments(segments: torch.Tensor) -> torch.Tensor:
    """Each token's position within its record, (batch, time): 0 at a record's first token (where the segment
    id changes along time, and at time 0), counting up to its last."""
    steps = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, steps, 0).cummax(dim=1).values  # the latest record start at or before each token
    return steps - first


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's rope scaling: wavelengths longer than original_context / low_freq_factor turn `factor` times
    slower, those shorter than original_context / high_freq_factor stay, and those between are interpolated
    smoothly; the context grows without retraining the high frequencies that encode nearby order."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int

    def rescale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        wavelength = 2 * math.pi / inv_freq
        slowed = inv_freq / self.factor
        smooth = (self.original_context / wavelength - self.low_freq_factor) / \
            (self.high_freq_factor - self.low_freq_factor)
        between = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        out = torch.where(wavelength > self.original_context / self.low_freq_factor, slowed, inv_freq)
        in_between = (wavelength >= self.original_context / self.high_freq_factor) & \
            (wavelength <= self.original_context / self.low_freq_factor)
        return torch.where(in_between, between, out)


@dataclass(frozen=True)
class LinearScaling:
    """Linear rope scaling (Gemma 3's global layers): every frequency `factor` times slower, positions interpolated."""

    factor: float

    def rescale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        return inv_freq / self.factor


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023), as transformers' rope_type "yarn" computes it (gpt-oss, long-context Qwen): the
    frequencies that turn more than beta_fast times over the original context are kept, those turning fewer than
    beta_slow times are slowed by `factor`, and a linear ramp over the dimensions between blends the two; cos and
    sin are multiplied by `magnitude` (transformers' attention_factor: 0.1 ln(factor) + 1 unless given), which
    scales every q.k score by its square. `truncate` rounds the ramp's ends to whole dimensions. The ramp's ends
    depend on the rotary base, which the scaling therefore holds."""

    factor: float
    original_context: int
    theta: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 0.0  # 0: YaRN's own, from the factor

    @property
    def magnitude(self) -> float:
        if self.attention_factor:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def rescale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        dim = 2 * inv_freq.numel()

        def dimension(turns: float) -> float:  # the dimension whose frequency turns `turns` times over the context
            return dim * math.log(self.original_context / (turns * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv_freq.device)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2, device=inv_freq.device).float() / dim)
        kept = 1 - ramp  # 1: the frequency as it was (extrapolated), 0: slowed by the factor (interpolated)
        return 1.0 / (self.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  scaling: Llama3Scaling | LinearScaling | YarnScaling | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary embeddings at `positions`, in fp32, rotate-half layout: frequency i at columns i and
    i + head_dim / 2. Positions (T,) give tables (T, head_dim), shared by the batch; positions (B, T) of packed
    records give (B, 1, T, head_dim), one table per row, shared by its heads. `scaling` rescales the
    frequencies (Llama 3.1's, YaRN's), and YaRN's also the tables (its magnitude)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim))
    if scaling is not None:
        inv_freq = scaling.rescale(inv_freq)
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    if positions.dim() == 2:
        angles = angles.unsqueeze(1)
    magnitude = getattr(scaling, "magnitude", 1.0)
    if magnitude != 1.0:
        return angles.cos() * magnitude, angles.sin() * magnitude
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's (x_i, x_{i + D/2}) pairs of x (B, H, T, D) by its position's angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype))


class KVCache:
    """The keys and values of every layer for the first `length` positions, preallocated to `positions` (at most the
    model's context; generate.py asks for the prompt and the new tokens only).

    Filled by a model's `forward(idx, cache)`: the new tokens sit at positions length .. length + T - 1,
    and each layer attends over all the positions stored so far. It stores the KV heads only (fewer than
    the query heads under grouped-query attention). It holds at most seq_len positions; the caller decides
    what happens past that (generate.py slides a window and refills the cache).
    """

    def __init__(self, cfg, batch: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 positions: int | None = None, kv_heads: int | None = None):
        """`kv_heads`: the KV heads this rank computes (fewer under TP: kv_heads_per_rank), default all of them."""
        self.positions = cfg.positions if positions is None else min(positions, cfg.positions)
        shape = (cfg.n_layer, batch, kv_heads or cfg.kv_heads, self.positions, cfg.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer`'s keys and values (B, KV, T, D) of the new positions; all of them so far."""
        end = self.length + k.shape[2]
        if end > self.positions:
            raise ValueError(f"the KV cache holds {self.positions} positions; {end} do not fit")
        self.keys[layer, :, :, self.length : end] = k
        self.values[layer, :, :, self.length : end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
           documents: torch.Tensor | BlockMask | None = None, window: int = 0, scale: float | None = None,
           softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q (B, H, T, D) over k and v (B, KV, T, D), KV dividing H (each KV head serves H / KV
    query heads); with a cache, k and v are appended to it first and q continues its positions. `documents`
    (from document_attention or window_attention, built once per forward) restricts each token to the earlier
    tokens of its own record and of its window. `window` applies to a cache's positions: each query sees at most
    this many keys, its own included (0: all); without a cache the window is the `documents` mask's, built once.
    `scale`: the scores' factor (None: 1 / sqrt(D)); `softcap`: the scores soft-capped (Gemma 2's), which SDPA
    cannot do: FlexAttention's score_mod with a block mask, else the explicit scores (softcapped_attention).
    `sinks` (heads,): gpt-oss's attention sinks, one logit per query head in each softmax's denominator, which SDPA
    cannot take either: FlexAttention's output renormalized by its log-sum-exp (with_sinks), else the explicit
    scores with a sink column."""
    past = 0
    if cache is not None:
        if documents is not None:
            raise ValueError("document masks and a KV cache cannot be combined: a cache continues one sequence")
        past = cache.length
        k, v = cache.append(layer, k, v)
    grouped = k.shape[1] != q.shape[1]
    if isinstance(documents, BlockMask):
        # Inside a compiled model (--compile) the model's graph compiles flex_attention with it.
        flex = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
        score_mod = tanh_score_mod(softcap) if softcap else None
        if sinks is None:
            return flex(q, k, v, block_mask=documents, enable_gqa=grouped, scale=scale, score_mod=score_mod)
        out, aux = flex(q, k, v, block_mask=documents, enable_gqa=grouped, scale=scale, score_mod=score_mod,
                        return_aux=AuxRequest(lse=True))
        return with_sinks(out, aux.lse, sinks)
    mask = documents if documents is not None else \
        _causal_mask(past, q.shape[2], q.device, window if cache is not None else 0)
    if softcap or sinks is not None:
        if mask is None:  # every earlier key: the scores are explicit here, so is the causal mask
            mask = torch.ones(q.shape[2], past + q.shape[2], dtype=torch.bool, device=q.device).tril(past)
        if sinks is not None:
            return softcapped_attention(q, k, v, mask, scale, softcap, sinks=sinks)
        return softcapped_attention(q, k, v, mask, scale, softcap)
    if grouped and repeats_kv_heads(q.device.type, q.dtype, masked=mask is not None):
        k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
        grouped = False
    # enable_gqa: each KV head serves its group of query heads without copies of k and v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and past == 0,
                                          enable_gqa=grouped, scale=scale)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): x squashed into (-cap, cap), near x where |x| << cap (Gemma 2's attention scores and
    logits); x itself for cap 0. In transformers' order of operations, so that the values are its own."""
    return torch.tanh(x / cap) * cap if cap else x


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
                         cap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(soft_cap(q k^T scale, cap) + mask) v with the scores explicit, as transformers' eager attention: the
    kernel of soft-capped scores (and of attention sinks) where FlexAttention does not run (CPU, narrow heads, the KV
    cache). `mask`: additive (document_mask) or boolean (True: attend). `sinks` (heads,): one more logit per head
    in every row's softmax, whose probability is dropped (gpt-oss's: each row's weights sum to less than 1). Costs
    the scores: autograd keeps the capped scores and the fp32 probabilities (B, H, T, T; with sinks a column more)
    and k and v copied to the query heads (activation_memory.softcapped_attention)."""
    n = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n), repeat_kv(v, n)
    scores = soft_cap(torch.matmul(q, k.transpose(2, 3)) * (scale or q.shape[-1] ** -0.5), cap)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)
    return torch.matmul(probs[..., :-1].to(q.dtype), v)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention `out` (B, H, T, D) renormalized as if each row's softmax had one more logit, its head's sink:
    sum_j e^s_j v_j / (sum_j e^s_j + e^sink) is out times sigmoid(lse - sink), from the row's log-sum-exp `lse`
    (B, H, T, fp32, which FlexAttention returns and differentiates)."""
    factor = torch.sigmoid(lse - sinks.float().view(1, -1, 1))
    return out * factor.unsqueeze(-1).to(out.dtype)


@functools.cache
def tanh_score_mod(cap: float):
    """FlexAttention's score_mod for soft-capped scores (one function per cap, so compiled once)."""

    def capped(score, b, h, q, kv):
        return torch.tanh(score / cap) * cap

    return capped


def repeats_kv_heads(device_type: str, dtype: torch.dtype, masked: bool = False) -> bool:
    """Whether attend copies each KV head to its query heads before SDPA instead of passing enable_gqa: where
    no fused kernel takes grouped-query attention, so that SDPA's math kernel (T x T memory) does not run.

    CPU: the flash kernel takes GQA, masks, fp32 and bf16 (what autograd saves is measured in
    test_activation_bytes: k and v at KV heads), so never. CUDA: only the flash kernel takes enable_gqa, and it
    takes neither fp32 nor an explicit mask; the memory-efficient kernel takes both, but not GQA.
    """
    return device_type == "cuda" and (dtype == torch.float32 or masked)


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (B, KV, T, D) as (B, KV * n, T, D): KV head j serves query heads j * n .. (j + 1) * n - 1, the grouping
    enable_gqa uses."""
    return x.repeat_interleave(n, dim=1)


def _causal_mask(past: int, T: int, device: torch.device, window: int = 0) -> torch.Tensor | None:
    """New query i (at position past + i) sees keys 0 .. past + i, and with a window only the last `window` of
    them; None where no mask is needed.

    With nothing cached SDPA's own causal mask is exact; one new query sees every key. The cache keeps every
    position (generate.py refills it past the context), so the window is the mask's, never the cache's shape.
    """
    windowed = 0 < window < past + T
    if (past == 0 or T == 1) and not windowed:
        return None
    query = torch.arange(past, past + T, device=device)[:, None]
    key = torch.arange(past + T, device=device)[None, :]
    allowed = key <= query
    return allowed & (key > query - window) if windowed else allowed


# FlexAttention's Triton kernels refuse heads narrower than this (torch/_inductor/kernel/flex/flex_attention.py:
# "tl.dot does not support embedding size less than 16"): the tiny presets' heads of 8 take the mask.
FLEX_MIN_HEAD_DIM = 16


def document_kernel(device_type: str, head_dim: int) -> str:
    """The kernel packed records (and a sliding window) attend with: "flex" (FlexAttention over a block mask, which
    never builds the T x T mask) on CUDA for heads of at least FLEX_MIN_HEAD_DIM, "mask" (SDPA with document_mask)
    elsewhere: FlexAttention has no backward on CPU, and its CUDA kernels refuse narrower heads.

    FlexAttention's CUDA kernels are compiled by Triton: a CUDA device Triton cannot compile for (or a torch
    without it) takes the mask. Planned from a machine without CUDA, a CUDA run is taken to have Triton, which
    CUDA builds of torch ship.
    """
    if device_type != "cuda" or head_dim < FLEX_MIN_HEAD_DIM:
        return "mask"
    return "mask" if torch.cuda.is_available() and not has_triton() else "flex"


def document_attention(segments: torch.Tensor, dtype: torch.dtype, head_dim: int,
                       window: int = 0) -> torch.Tensor | BlockMask:
    """What attend takes for the records in `segments` (B, T), for activations of `dtype` and heads of `head_dim`:
    built once per forward and shared by every layer, and by every head (and so by every TP rank's heads). With a
    `window` each token sees at most that many of its record's tokens, itself included."""
    if document_kernel(segments.device.type, head_dim) == "flex":
        return document_block_mask(segments, window)
    return document_mask(segments, dtype, window)


def window_attention(T: int, window: int, dtype: torch.dtype, device: torch.device,
                     head_dim: int) -> torch.Tensor | BlockMask | None:
    """What attend takes for one sequence per row under a sliding window, built once per forward and shared by the
    rows: None where the window holds the whole sequence (SDPA's causal mask is exact), else FlexAttention's block
    mask (CUDA, document_kernel) or the mask of one record spanning the row (1, 1, T, T)."""
    if not 0 < window < T:
        return None
    if document_kernel(device.type, head_dim) == "flex":
        return window_block_mask(T, window, device)
    return document_mask(torch.zeros(1, T, dtype=torch.long, device=device), dtype, window)


def document_mask(segments: torch.Tensor, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
    """SDPA's additive mask (B, 1, T, T) for block-diagonal causal attention: 0 where query t may see key s
    (s <= t and both in one record, and t - s < window if there is one), -inf elsewhere.

    Additive in the activations' dtype rather than boolean: SDPA's CPU kernel converts a boolean mask to this
    form in every call and saves the copy for the backward (n_layer x B T T x 4 bytes, measured); one mask
    of the right dtype is saved as it is, by every layer, once.
    """
    T = segments.shape[1]
    same_record = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    if window:
        causal = causal.triu(diagonal=1 - window)  # key s within the last `window` positions of query t
    allowed = (same_record & causal).unsqueeze(1)
    return torch.zeros(allowed.shape, dtype=dtype, device=segments.device).masked_fill_(~allowed, float("-inf"))


def document_block_mask(segments: torch.Tensor, window: int = 0) -> BlockMask:
    """FlexAttention's block mask for block-diagonal causal attention over `segments` (B, T), one per row and
    shared by the heads (H None); compiled, so the T x T mask is never built, only its 128 x 128 blocks' lists.
    A `window` is one more term of the mask_mod, so its blocks beyond the window are skipped."""
    B, T = segments.shape

    def same_record_causal(b, h, q, kv):
        allowed = (segments[b, q] == segments[b, kv]) & (q >= kv)
        return allowed & (q - kv < window) if window else allowed

    return create_block_mask(same_record_causal, B, None, T, T, device=segments.device,
                             _compile=segments.device.type == "cuda" and not torch.compiler.is_compiling())


def window_block_mask(T: int, window: int, device: torch.device) -> BlockMask:
    """FlexAttention's block mask for causal attention within a sliding window, shared by the batch and the heads
    (B and H None): blocks wholly outside the window are skipped."""

    def causal_in_window(b, h, q, kv):
        return (q >= kv) & (q - kv < window)

    return create_block_mask(causal_in_window, None, None, T, T, device=device,
                             _compile=device.type == "cuda" and not torch.compiler.is_compiling())


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once per process: uncompiled it runs a reference implementation that builds
    the T x T scores."""
    return torch.compile(flex_attention, dynamic=False)


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


def head_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, loss, recompute: bool,
              segments: torch.Tensor | None = None) -> torch.Tensor:
    """loss(model(idx, segments=segments), targets). A loss the head computes itself (`computed_by_head`: the summed
    token loss) is the model's, given the targets (vocab.LMHead, inside the model's call, so hooks around the head,
    ZeRO-3's units, see it): chunked over tokens, vocab-parallel under TP, without the full logits; any other loss
    takes the logits (all-gathered under TP). A loss `from_token_logps` (DPO's sequence log-probs) takes each token's
    log-prob of its target instead, which the head computes the same way (vocab.token_logps).

    With `recompute` (--activation-checkpointing full, while training) the head and the loss keep only the final
    norm's output for the backward, which runs them again (same values): the summed token loss computes its gradients
    there, once (vocab.token_loss's recompute; under a checkpoint they were computed in the forward, dropped, and
    computed again), any other under a checkpoint. `segments` (batch, time): the record each input token belongs to,
    for packed records (None: one document per row)."""
    by_head = getattr(loss, "computed_by_head", False)
    if getattr(loss, "from_token_logps", False):  # loss(each token's log p(target), targets): the head computes them
        def scored(h: torch.Tensor) -> torch.Tensor:
            return loss(model.lm_head(h, targets=targets, per_token=True), targets)

        recomputed = recompute and torch.is_grad_enabled()
        return model(idx, segments=segments,
                     head=(lambda h: checkpoint(scored, h, use_reentrant=False)) if recomputed else scored)
    if not (recompute and torch.is_grad_enabled()):  # the model's own call, as a compiled model traces it
        return model(idx, segments=segments, targets=targets) if by_head else loss(model(idx, segments=segments),
                                                                                   targets)

    if by_head:
        return model(idx, segments=segments, head=lambda h: model.lm_head(h, targets=targets, recompute=True))

    def run(h: torch.Tensor) -> torch.Tensor:
        return loss(model.lm_head(h), targets)

    return model(idx, segments=segments, head=lambda h: checkpoint(run, h, use_reentrant=False))


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
