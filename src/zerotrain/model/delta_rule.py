"""The gated delta rule (Yang et al. 2024, Gated Delta Networks) in plain torch, chunked, with documents: Qwen3.5's
linear attention, and the causal convolution before it.

Per value head, a state S (key width x value width) is decayed, corrected and read at each token t:

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T        o_t = S_t^T q_t

(q and k L2-normalised, q scaled by 1 / sqrt(key width); g_t <= 0 the decay in log space, beta_t in (0, 1) how much
of v_t is written). `chunk_gated_delta_rule` computes it as transformers' torch_chunk_gated_delta_rule does, op for
op: the sequence in chunks of 64, within a chunk the corrections solved at once (a unit lower-triangular system,
the UT transform) and the state read and updated once per chunk.

Documents packed in one row: a document's first token starts from a zero state (the linear layers' equivalent of
the document mask). Within a chunk every pairwise term between tokens of two documents is dropped (the decays'
mask gains the other documents' pairs); a token reads the state the chunk started with only while no document has
started in the chunk up to it; the state the chunk leaves takes only its last document's tokens, and keeps the
state it started with only when no document started in it; the decays are summed from each document's start. With
one document per row (`starts` None) none of this runs: the arithmetic is transformers' own.

`causal_conv` is the depthwise causal convolution (Qwen3.5's linear_conv_kernel_dim taps) over q, k and v,
transformers' F.conv1d with K - 1 zeros of left padding; with documents, each tap reads only its own document's
tokens (one shifted product per tap: the same sum in another order, within float noise of conv1d's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' chunk_size


def record_starts(segments: torch.Tensor) -> torch.Tensor:
    """Each record's first token in `segments` (B, T): where the id changes along the row, and at time 0."""
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return starts


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension, as transformers' (and the FLA library's) l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def document_ids(starts: torch.Tensor) -> torch.Tensor:
    """Each token's document within its row (B, T): how many documents have started up to it."""
    return starts.long().cumsum(dim=1)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor | None = None,
                past: torch.Tensor | None = None) -> torch.Tensor:
    """The depthwise causal convolution of x (B, channels, T) by `weight` (channels, 1, K): output t is
    sum_j weight[:, 0, K - 1 - j] x_{t - j}, x before the row being zeros, or `past` (B, channels, K - 1: the
    inputs before x, a cache's). `starts` (B, T) bool marks each document's first token: a tap reaching into an
    earlier document reads zero there."""
    T, K = x.shape[-1], weight.shape[-1]
    if starts is None:
        if past is not None:  # the cached inputs in place of the zero padding
            return F.conv1d(torch.cat([past, x], dim=-1), weight, groups=x.shape[1])
        return F.conv1d(x, weight, padding=K - 1, groups=x.shape[1])[..., :T]
    if past is not None:
        raise ValueError("documents and a cache cannot be combined: a cache continues one sequence")
    docs = document_ids(starts)
    out = None
    for j in range(K):  # tap j reads x_{t - j}, if it is of t's document
        shifted = F.pad(x, (j, 0))[..., :T]
        same = F.pad(docs, (j, 0), value=-1)[..., :T] == docs
        term = weight[:, 0, K - 1 - j, None] * (shifted * same[:, None, :].to(x.dtype))
        out = term if out is None else out + term
    return out


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, starts: torch.Tensor | None = None,
                           initial_state: torch.Tensor | None = None, chunk_size: int = CHUNK,
                           state_gradient: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule's outputs (B, T, value heads, value width), in query's dtype, and the state after the
    last token (B, value heads, key width, value width), fp32 (fp64 for fp64 inputs).

    query, key (B, T, key heads, key width); value (B, T, value heads, value width), each key head serving a group
    of value heads; g, beta (B, T, value heads); `starts` (B, T) bool: each document's first token (None: one
    document per row); `initial_state`: the state before the first token (None: zeros); `state_gradient`: the
    state after the last token keeps its graph (context parallelism composes it into the next chunks' states; a
    cache's is read without one)."""
    dtype = query.dtype
    B, T, key_heads, key_width = key.shape
    value_heads, value_width = value.shape[-2:]
    if key_heads != value_heads:
        query = query.repeat_interleave(value_heads // key_heads, dim=2)
        key = key.repeat_interleave(value_heads // key_heads, dim=2)
    work = torch.promote_types(dtype, torch.float32)  # fp32, as transformers' (fp64 inputs: fp64)
    # contiguous copies, (B, heads, T, width): Tensor.to with the dtype it has is the tensor itself, whose
    # transposed layout every batched matmul below would copy again (and keep) for its backward
    query, key, value, beta, g = (x.transpose(1, 2).contiguous().to(work) for x in (query, key, value, beta, g))
    query, key = l2norm(query), l2norm(key)
    query = query * query.shape[-1] ** -0.5

    pad = (chunk_size - T % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta))
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk_size)

    excluded = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    if starts is not None:
        docs = document_ids(starts)
        docs = torch.cat([docs, docs[:, -1:].expand(B, pad)], dim=1).view(B, 1, -1, chunk_size)  # padding: the last
        excluded = excluded | (docs.unsqueeze(-1) != docs.unsqueeze(-2))  # pairs of two documents
        padded = F.pad(starts, (0, pad)).view(B, 1, -1, chunk_size)
        continues = (padded.long().cumsum(-1) == 0).to(work)  # no document started in the chunk up to t
        in_last = docs == docs[..., -1:]  # t is of the chunk's last document
    if starts is None:
        cum = g.cumsum(dim=3)  # log of the decay from the chunk's start to each token
    else:  # from the chunk's start or the token's record's, whichever is later: each record's own sums, so that
        # its decays do not carry the rounding of a sum over the records before it (2e-5 of a layer's output, seen)
        cum = (((~excluded).to(g.dtype) @ g.unsqueeze(-1))).squeeze(-1)
    pair_decay = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(excluded, float("-inf")).exp()

    ut_system = (k_beta @ key.transpose(-1, -2)) * pair_decay
    intra = (query @ key.transpose(-1, -2)) * pair_decay
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    if starts is not None:
        decayed_k_beta = decayed_k_beta * continues.unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    state = query.new_zeros(B, value_heads, key_width, value_width) if initial_state is None else \
        initial_state.to(new_values)
    query = query * cum.exp().unsqueeze(-1)
    to_end = cum[..., -1:] - cum
    if starts is not None:
        query = query * continues.unsqueeze(-1)
    outputs, last = [], query.shape[2] - 1
    for i in range(query.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outputs.append(query[:, :, i] @ state + intra[:, :, i] @ v_new)
        # The state after the last chunk is only ever a cache's (read without gradients): no graph is kept for it,
        # so a forward keeps nothing for a backward that never comes (the decayed keys of a one-chunk sequence)
        with torch.set_grad_enabled(torch.is_grad_enabled() and (i < last or state_gradient)):
            state = state * chunk_decay(cum, continues if starts is not None else None, i) + \
                decayed_keys(key, to_end, in_last if starts is not None else None, i).transpose(-1, -2) @ v_new
    out = torch.stack(outputs, dim=2).reshape(B, value_heads, -1, value_width)[:, :, :T]
    return out.transpose(1, 2).contiguous().to(dtype), state


def chunk_decay(cum: torch.Tensor, continues: torch.Tensor | None, i: int) -> torch.Tensor:
    """Chunk i's decay of the state it started with, (B, heads, 1, 1): exp of its summed log decays; 0 where a
    document started in it (`continues`: no document started up to each token)."""
    decay = cum[:, :, i, -1].exp()[..., None, None]
    return decay if continues is None else decay * continues[:, :, i, -1, None, None]


def decayed_keys(key: torch.Tensor, to_end: torch.Tensor, in_last: torch.Tensor | None, i: int) -> torch.Tensor:
    """Chunk i's keys decayed to the chunk's end, as they write the state it leaves; a token of an earlier record
    (not `in_last`) writes nothing (its sum to the end is of another record: it may be positive)."""
    to_end = to_end[:, :, i]
    if in_last is not None:
        to_end = to_end.masked_fill(~in_last[:, :, i], float("-inf"))
    return key[:, :, i] * to_end.exp().unsqueeze(-1)
