"""The attention core every architecture calls (`attend`): causal, grouped-query, over a KV cache, and the kernel
each case takes (SDPA, FlexAttention over a block mask, or explicit scores for soft-caps and sinks), with the masks
of packed records and sliding windows, built once per forward and shared by the layers; under context parallelism
(--cp) the ring over the ranks holding the rest of the sequence instead."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention
from torch.utils._triton import has_triton

from .kv_cache import KVCache


@dataclass
class RingAttention:
    """What the layers attend with when the sequence is split over a context-parallel group (--cp): `ring(q, k, v,
    documents=, scale=)` is parallel/ring_attention.py's ring_attention over the group (the model holds no process
    group of its own: parallel/context.py makes this once per forward); `documents` every rank's segment ids (C, B,
    T/C) for packed rows, else None; `attention_chunk` Llama 4's chunked attention on the layers that take this one
    (0: none) and `positions` every rank's positions within their records (C, B, T/C), which packed rows are chunked
    by."""

    ring: Callable[..., torch.Tensor]
    documents: torch.Tensor | None = None
    attention_chunk: int = 0
    positions: torch.Tensor | None = None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
           documents: torch.Tensor | BlockMask | RingAttention | None = None, window: int = 0, scale: float | None = None,
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
    scores with a sink column. A RingAttention as `documents`: this rank's queries over the whole row's keys,
    around the ring (causal, its records' masks, the window, Llama 4's attention chunks; no soft-cap or sinks: --cp
    refuses those models)."""
    if isinstance(documents, RingAttention):
        return documents.ring(q, k, v, documents=documents.documents, scale=scale, window=window,
                              attention_chunk=documents.attention_chunk, positions=documents.positions)
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
