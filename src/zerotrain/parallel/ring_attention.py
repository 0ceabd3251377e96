"""Causal ring attention over a context-parallel group: each rank holds two chunks of every row (the zig-zag split),
the keys and values travel around the ring, and each hop's partial attention is merged by its log-sum-exp.

The split: a row of T tokens is cut into 2C chunks of T / 2C; rank i of C holds chunks i and 2C-1-i, so every rank
has the same causal work (an early chunk sees few keys, its late partner many). Rank i's queries over rank j's keys
(hop h = (i - j) mod C: at hop h rank i holds the keys and values of rank i - h):
  j = i   both chunks over both, causal (in local order the positions increase, so the local causal mask is exact)
  j < i   both query chunks over j's early chunk (wholly earlier); j's late chunk is wholly later
  j > i   the late query chunk over both of j's chunks (wholly earlier); the early query chunk sees neither
so each hop after the first is half the first one's work and needs no causal mask. Packed records: the segment ids
of every rank's tokens (gather_segments, once per forward) restrict each query to its own record's keys on every
hop, so a record split over ranks still attends only to itself. GQA: fewer KV heads travel; each serves its group
of query heads.

A sliding window W (Mistral's, Gemma 3's local layers: query position p sees keys p - W < s <= p) is decided per
block from the chunks' places in the row, on the host: a block whose every query-key distance is W or more is skipped
(its keys and values still travel on), one whose farthest causal pair is nearer than W is computed as without a
window, and one in between is masked by its queries' and keys' positions in the row (window_reach).

Llama 4's chunked attention (its rotary layers: query position p sees the keys s <= p with s // size = p // size) is
decided the same way (attention_chunk_reach): a block whose queries and keys share no attention chunk is skipped, one
wholly within one chunk computed as without chunks, one across a chunk border masked by the positions. Packed records
are chunked from each record's first token: their blocks are masked by every rank's positions within their records
(gathered with the segment ids), never skipped.

Latent attention (DeepSeek-V3, Kimi K2, Mistral 4): q and k of nope + rope units, values of v_head_dim (narrower),
every head its own keys. The keys and values travel at their own widths; the outputs, and so the merge, are at the
values' width. torch's fused CPU kernel takes one width for all three: each hop pads the values with zero units
(their outputs zero, dropped), a copy of the hop's, never of what travels.

Each hop gives its block's output and log-sum-exp; out and lse of the rows merge as
  lse' = logaddexp(lse, lse_h),  out' = out exp(lse - lse') + out_h exp(lse_h - lse'),
which is softmax over the union of the keys. The backward is an autograd.Function of its own (as FlashAttention's):
the forward keeps q, k, v, the output and the log-sum-exp (O(T) per rank), and the backward runs the ring again,
recomputing each hop's probabilities from the final log-sum-exp, while the keys' and values' gradients travel with
them and arrive home after the last hop. A forward of differentiable ops would keep every hop's probabilities
(T/C x T per head per rank over the hops, the memory that splitting the sequence is meant to save), and
torch.distributed's point-to-point ops have no autograd.

The hop (hop_kernel): on the CPU torch's fused flash-attention kernel, which returns the block's log-sum-exp and takes
the final one back in its backward, so no block's scores are held (it has no GQA: each KV head is broadcast to its
group of query heads, a view); elsewhere the scores as tensors, per KV head's group (CUDA's fused kernels take other
arguments: not wired yet). Both in fp32 (float64 inputs: float64), and the merged output and lse kept in it.
Measured (scripts/bench_ring_attention.py, 2 ranks x 4096 tokens, 8 heads over 2 KV heads, fp32): the fused hop
46 MB held per rank, 2.7 s; explicit scores 560 MB, 23 s (docs/design.md).

Transfers: the next hop's keys and values are posted (batch_isend_irecv: gloo and NCCL) before the current hop is
computed, so on a GPU the transfer hides behind the compute.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zerotrain.model.positions import positions_from_segments

# gloo matches a receive to a send by (peer, tag): the keys' and values' transfer of the next hop and the gradients'
# of this hop are in flight at once between the same ranks
TAG_KV, TAG_GRAD = 1, 2


# ---------------------------------------------------------------- the zig-zag split
def zigzag_split(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s part of `x` along `dim` (the sequence) among `cp` ranks: chunks rank and 2cp-1-rank of 2cp."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"a sequence of {x.shape[dim]} tokens does not split into {2 * cp} equal chunks "
                         f"(2 per context-parallel rank of {cp})")
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def zigzag_unsplit(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (`parts[r]`: rank r's zigzag_split), e.g. the outputs put back."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * cp - 1 - rank] = part.chunk(2, dim)
    return torch.cat(chunks, dim)


def rotary_positions(seq_len: int, cp: int, rank: int, segments: torch.Tensor | None = None,
                     device: torch.device | None = None) -> torch.Tensor:
    """The rotary positions of rank `rank`'s tokens: their positions in the whole row, (seq_len / cp,); with the
    whole row's `segments` (batch, seq_len) each token's position within its record, (batch, seq_len / cp)."""
    if segments is not None:
        return zigzag_split(positions_from_segments(segments), cp, rank, dim=1)
    return zigzag_split(torch.arange(seq_len, device=device), cp, rank, dim=0)


def gather_segments(segments: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's segment ids (cp, batch, 2 chunks) from this rank's (batch, 2 chunks): what ring_attention's
    `documents` takes, gathered once per forward and shared by the layers."""
    parts = [torch.empty_like(segments) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, segments.contiguous(), group=group)
    return torch.stack(parts)


# ---------------------------------------------------------------- one hop
def hop_blocks(rank: int, source: int, chunk: int) -> tuple[slice, slice, bool] | None:
    """Which of rank `rank`'s query rows see which of rank `source`'s keys (local indices, chunks of `chunk`), and
    whether the causal mask applies; None where none does (module docstring)."""
    if source == rank:
        return slice(0, 2 * chunk), slice(0, 2 * chunk), True
    if source < rank:
        return slice(0, 2 * chunk), slice(0, chunk), False
    return slice(chunk, 2 * chunk), slice(0, 2 * chunk), False


def chunk_starts(rank: int, cp: int, chunk: int, part: slice) -> list[int]:
    """The row positions at which the chunks of rank `rank`'s local indices `part` (whole chunks of `chunk`) start."""
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return [starts[i] for i in range(part.start // chunk, part.stop // chunk)]


def window_reach(rank: int, source: int, rows: slice, keys: slice, chunk: int, cp: int, window: int) -> str:
    """How a sliding `window` bears on the block of rank `rank`'s query `rows` over rank `source`'s `keys` (local
    indices, whole chunks): "outside" (no query sees any of the keys within the window: the block is skipped),
    "inside" (every query sees every earlier key: the window changes nothing) or "partial". Host arithmetic on the
    chunks' starts: a query chunk at q and a key chunk at k differ by q - k - (chunk - 1) to q - k + chunk - 1."""
    if not window:
        return "inside"
    pairs = [(q - k - (chunk - 1), q - k + chunk - 1) for q in chunk_starts(rank, cp, chunk, rows)
             for k in chunk_starts(source, cp, chunk, keys)]
    if all(far < window for _, far in pairs):
        return "inside"
    if not any(far >= 0 and near < window for near, far in pairs):
        return "outside"
    return "partial"


def window_mask(rank: int, source: int, rows: slice, keys: slice, chunk: int, cp: int, window: int,
                device: torch.device) -> torch.Tensor:
    """(tq, tk): which of the block's keys each query sees, causal and within `window`, from their row positions."""
    distance = row_positions(rank, rows, chunk, cp, device)[:, None] - row_positions(source, keys, chunk, cp,
                                                                                     device)[None, :]
    return (distance >= 0) & (distance < window)


def row_positions(rank: int, part: slice, chunk: int, cp: int, device: torch.device) -> torch.Tensor:
    """The row positions of rank `rank`'s local indices `part` (whole chunks of `chunk`)."""
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in chunk_starts(rank, cp, chunk, part)])


def attention_chunk_reach(rank: int, source: int, rows: slice, keys: slice, chunk: int, cp: int, size: int,
                          packed: bool = False) -> str:
    """How Llama 4's chunked attention (a query at position p sees the keys s <= p of its own chunk of `size`
    positions, p // size = s // size) bears on the block, as window_reach says it: "outside", "inside" or "partial".
    Host arithmetic on the chunks' starts: for query positions [a, b] and key positions [c, d] the farthest causal
    pair (b, c) decides "inside" (c // size = b // size); a key some query sees lies in an attention chunk both
    ranges reach, no later than that chunk's last query. Packed records (`packed`) are chunked by each record's own
    positions, which the row's do not tell: "partial", masked by the positions themselves."""
    if not size:
        return "inside"
    if packed:
        return "partial"
    reaches = set()
    for a in chunk_starts(rank, cp, chunk, rows):
        for c in chunk_starts(source, cp, chunk, keys):
            b, d = a + chunk - 1, c + chunk - 1
            if c > b:  # every key later than every query: the causal mask's, whatever the chunks
                continue
            if c // size == b // size:  # every causal pair within one attention chunk
                reaches.add("inside")
                continue
            shared = range(max(a, c) // size, min(b, d) // size + 1)
            seen = any(max(c, j * size) <= min(b, (j + 1) * size - 1) for j in shared)
            reaches.add("partial" if seen else "outside")
    return reaches.pop() if len(reaches) == 1 else "partial" if reaches else "inside"


def attention_chunk_mask(rank: int, source: int, rows: slice, keys: slice, chunk: int, cp: int, size: int,
                         positions: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Which of the block's keys each query sees within its attention chunk of `size` positions: (tq, tk), causal,
    from the row positions; with `positions` (C, B, T / C: every rank's positions within their records, packed rows)
    (B, 1, tq, tk), the same chunk of the record (the records' own mask, allowed_keys, says which record and causal)."""
    if positions is not None:
        q, k = positions[rank][:, rows] // size, positions[source][:, keys] // size
        return (q[:, :, None] == k[:, None, :])[:, None]
    q, k = row_positions(rank, rows, chunk, cp, device), row_positions(source, keys, chunk, cp, device)
    return (q[:, None] >= k[None, :]) & (q[:, None] // size == k[None, :] // size)


def allowed_keys(segments_q: torch.Tensor | None, segments_k: torch.Tensor | None, causal: bool,
                 tq: int, tk: int, device: torch.device) -> torch.Tensor | None:
    """Where a query may see a key in a hop's block, (batch, 1, tq, tk): the same record and, with `causal`, not
    later. None without segments: the causal mask, where it applies, is then the kernel's own."""
    if segments_q is None:
        return None
    allowed = (segments_q[:, :, None] == segments_k[:, None, :])[:, None]
    return allowed & torch.ones(tq, tk, dtype=torch.bool, device=device).tril() if causal else allowed


def hop_kernel(device: torch.device) -> str:
    """"fused": torch's CPU flash-attention kernel, which returns the log-sum-exp and takes it back in its backward,
    without the block's scores in memory; "explicit": the scores computed as tensors (any device; CUDA's fused
    kernels take other arguments, not wired yet)."""
    return "fused" if device.type == "cpu" else "explicit"


def _hop_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T scale) v, log-sum-exp of the scores) of one block, by KV head's group of query heads: (B, KV,
    G, tq, Dv) and (B, KV, G, tq, 1); q (B, H, tq, D), k (B, KV, tk, D), v (B, KV, tk, Dv); `allowed` (allowed_keys)
    or, where None, causal or every key. A row that sees no key here has lse -inf and output 0, so that the merge
    ignores it. The results are views of what the kernel made, in its layout: nothing copied."""
    B, H, tq, D = q.shape
    KV, Dv = k.shape[1], v.shape[-1]
    if hop_kernel(q.device) == "fused":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_by_kv_head(*_one_width(q, k, v)), 0.0, causal and allowed is None,
            attn_mask=_by_kv_head_mask(allowed, KV, q.dtype), scale=scale)
        lse = lse.view(B, KV, H // KV, tq, 1)
        if allowed is not None:  # the kernel gives a row without keys lse 0
            lse = lse.masked_fill(~_per_group(allowed.any(-1, keepdim=True)), float("-inf"))
        return out.view(B, KV, H // KV, tq, -1)[..., :Dv], lse
    qg = q.view(B, KV, H // KV, tq, D)
    scores = qg @ k.unsqueeze(2).transpose(-1, -2) * scale
    allowed = _causal(tq, k.shape[2], q.device) if allowed is None and causal else allowed
    if allowed is not None:
        scores = scores.masked_fill(~_per_group(allowed), float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    return torch.exp(scores - _finite(lse)) @ v.unsqueeze(2), lse


def _hop_backward(q, k, v, dout, out, lse, allowed, causal, scale):
    """The block's (dq (B, KV, G, tq, D), dk (B, KV, tk, D), dv (B, KV, tk, Dv)) from the final output and lse
    (FlashAttention's backward); dk and dv summed over each KV head's group of query heads."""
    B, H, tq, D = q.shape
    KV, Dv = k.shape[1], v.shape[-1]
    if hop_kernel(q.device) == "fused":
        qw, kw, vw = _one_width(q, k, v)
        W = qw.shape[-1]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _widened(dout, W).reshape(B * KV, H // KV, tq, W), *_by_kv_head(qw, kw, vw),
            _widened(out, W).reshape(B * KV, H // KV, tq, W), lse.reshape(B * KV, H // KV, tq), 0.0,
            causal and allowed is None, attn_mask=_by_kv_head_mask(allowed, KV, q.dtype), scale=scale)
        return (dq.view(B, KV, H // KV, tq, W)[..., :D], dk.sum(1).view(B, KV, -1, W)[..., :D],
                dv.sum(1).view(B, KV, -1, W)[..., :Dv])
    qg, dg = q.view(B, KV, H // KV, tq, D), dout.view(B, KV, H // KV, tq, Dv)
    kk, vv = k.unsqueeze(2), v.unsqueeze(2)
    scores = qg @ kk.transpose(-1, -2) * scale
    allowed = _causal(tq, k.shape[2], q.device) if allowed is None and causal else allowed
    if allowed is not None:
        scores = scores.masked_fill(~_per_group(allowed), float("-inf"))
    p = torch.exp(scores - lse.view(B, KV, H // KV, tq, 1))
    delta = (dg * out.view(B, KV, H // KV, tq, Dv)).sum(-1, keepdim=True)
    ds = p * (dg @ vv.transpose(-1, -2) - delta)
    dq = ds @ kk * scale
    dk = (ds.transpose(-1, -2) @ qg).sum(2) * scale
    dv = (p.transpose(-1, -2) @ dg).sum(2)
    return dq, dk, dv


def _one_width(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v at one head width, as the fused kernel takes them: latent attention's values (narrower than q and
    k) padded with zero units, whose outputs are zero and dropped; or q and k padded where the values are wider (zero
    units add nothing to a score). A hop's copy, never the tensors that travel."""
    W = max(q.shape[-1], v.shape[-1])
    return _widened(q, W), _widened(k, W), _widened(v, W)


def _widened(t: torch.Tensor, width: int) -> torch.Tensor:
    """t with zero units appended to its last dimension up to `width` (t itself at that width)."""
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """t (B, H, ...) as (B, KV, G, ...): a view, each KV head's group of query heads together."""
    return t.unflatten(1, (kv_heads, t.shape[1] // kv_heads))


def _causal(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril()


def _per_group(allowed: torch.Tensor) -> torch.Tensor:
    """allowed (batch, 1, tq, tk) broadcast to the grouped scores (batch, KV, group, tq, tk); (tq, tk) as it is."""
    return allowed if allowed.dim() == 2 else allowed.unsqueeze(1)


def _by_kv_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q (B, H, tq, D), k and v (B, KV, tk, D) as the fused kernel takes them, which has no GQA: a batch of B x KV,
    each KV head's group of query heads over that head's keys, broadcast to the group (views: no copies)."""
    B, H, tq, D = q.shape
    KV, tk = k.shape[1], k.shape[2]
    return (q.reshape(B * KV, H // KV, tq, D),
            *(t.reshape(B * KV, 1, tk, D).expand(B * KV, H // KV, tk, D) for t in (k, v)))


def _by_kv_head_mask(allowed: torch.Tensor | None, kv_heads: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask for _by_kv_head's batch: allowed (B, 1, tq, tk) as 0 / -inf, repeated for each KV head (a
    view for one row)."""
    if allowed is None:
        return None
    mask = torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device),
                       torch.full((), float("-inf"), dtype=dtype, device=allowed.device))
    B, _, tq, tk = mask.shape
    return mask.unsqueeze(1).expand(B, kv_heads, 1, tq, tk).reshape(B * kv_heads, 1, tq, tk)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row without keys) as 0: exp(-inf - 0) = 0 instead of exp(-inf + inf) = nan."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def merge(out: torch.Tensor, lse: torch.Tensor, out_h: torch.Tensor, lse_h: torch.Tensor) -> None:
    """Two partial attentions of the same queries over disjoint keys, as one (module docstring), into out and lse
    (in place: views of the rows' running output and log-sum-exp)."""
    new = torch.logaddexp(lse, lse_h)
    at = _finite(new)
    out.mul_(torch.exp(lse - at)).add_(out_h.mul_(torch.exp(lse_h - at)))
    lse.copy_(new)


# ---------------------------------------------------------------- the ring
def pass_around(tensors: tuple[torch.Tensor, ...], group, tag: int):
    """Send `tensors` to the next rank of the ring and receive the previous rank's: (received, works to wait on)."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    received = tuple(torch.empty_like(t) for t in tensors)
    ops = [dist.P2POp(dist.isend, t.contiguous(), group=group, group_peer=(me + 1) % cp, tag=tag) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, group=group, group_peer=(me - 1) % cp, tag=tag) for r in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, documents, positions, group, scale, window, attention_chunk):
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        T, KV = q.shape[2], k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        qa = q.to(acc)
        # the output at the values' width (latent attention's are narrower than q and k), laid out (B, T, H, Dv) as
        # SDPA's: the output projection reads it as its input without a copy
        B, H = q.shape[:2]
        out = qa.new_zeros(B, T, H, v.shape[-1]).transpose(1, 2)
        lse = torch.full((*q.shape[:3], 1), float("-inf"), dtype=acc, device=q.device)
        kv = (k, v)
        for hop in range(cp):
            source = (me - hop) % cp
            if hop < cp - 1:  # the next hop's keys and values travel while this hop computes
                following, works = pass_around(kv, group, TAG_KV)
            block = _hop(me, source, T // 2, cp, window, attention_chunk, positions is not None)
            if block is not None:
                rows, keys, causal, reach = block
                kk, vv = (t[:, :, keys].to(acc) for t in kv)
                allowed = _allowed(documents, positions, me, source, rows, keys, causal, q, reach, window,
                                   attention_chunk, cp)
                out_h, lse_h = _hop_forward(qa[:, :, rows], kk, vv, allowed, causal, scale)
                merge(_grouped(out[:, :, rows], KV), _grouped(lse[:, :, rows], KV), out_h, lse_h)
            if hop < cp - 1:
                _wait(works)
                kv = following
        ctx.save_for_backward(q, k, v, out, lse, documents, positions)
        ctx.group, ctx.scale, ctx.window, ctx.attention_chunk = group, scale, window, attention_chunk
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, documents, positions = ctx.saved_tensors
        group, scale, window, attention_chunk = ctx.group, ctx.scale, ctx.window, ctx.attention_chunk
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        T, KV = q.shape[2], k.shape[1]
        acc = lse.dtype
        qa, dout = q.to(acc), grad.to(acc).contiguous()
        dq = torch.zeros_like(qa)
        kv, arriving = (k, v), None
        for hop in range(cp):
            source = (me - hop) % cp
            if hop < cp - 1:
                following, works = pass_around(kv, group, TAG_KV)
            dkv = (torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device))
            block = _hop(me, source, T // 2, cp, window, attention_chunk, positions is not None)
            if block is not None:
                rows, keys, causal, reach = block
                kk, vv = (t[:, :, keys].to(acc) for t in kv)
                allowed = _allowed(documents, positions, me, source, rows, keys, causal, q, reach, window,
                                   attention_chunk, cp)
                dq_h, dk_h, dv_h = _hop_backward(qa[:, :, rows], kk, vv, dout[:, :, rows], out[:, :, rows],
                                                 lse[:, :, rows], allowed, causal, scale)
                _grouped(dq[:, :, rows], KV).add_(dq_h)
                dkv[0][:, :, keys] += dk_h
                dkv[1][:, :, keys] += dv_h
            if arriving is not None:  # the source's gradients so far, from the ranks it visited before this one
                _wait(arriving[1])
                dkv = (dkv[0] + arriving[0][0], dkv[1] + arriving[0][1])
            if cp > 1:  # on to the next rank, which holds the source's keys at its next hop (after the last: home)
                arriving = pass_around(dkv, group, TAG_GRAD)
            if hop < cp - 1:
                _wait(works)
                kv = following
        if cp > 1:
            _wait(arriving[1])
            dkv = arriving[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def _hop(me, source, chunk, cp, window, attention_chunk, packed):
    """hop_blocks' (rows, keys, causal) with the reach of the window and of the attention chunks over them (outside
    if either's is, inside if both are), None where nothing is computed."""
    block = hop_blocks(me, source, chunk)
    if block is None:
        return None
    reaches = {window_reach(me, source, block[0], block[1], chunk, cp, window),
               attention_chunk_reach(me, source, block[0], block[1], chunk, cp, attention_chunk, packed)}
    if "outside" in reaches:
        return None
    return (*block, "partial" if "partial" in reaches else "inside")


def _allowed(documents, positions, me, source, rows, keys, causal, q, reach, window, attention_chunk, cp):
    """Where the block's queries see its keys (allowed_keys), with a window and attention chunks that bear on part of
    it (their reach "partial") as more masks: then causal by the row's positions, for each row of the batch (the
    attention chunks by the records' positions for packed rows)."""
    tq, tk = rows.stop - rows.start, keys.stop - keys.start
    segments_q = documents[me][:, rows] if documents is not None else None
    segments_k = documents[source][:, keys] if documents is not None else None
    allowed = allowed_keys(segments_q, segments_k, causal, tq, tk, q.device)
    if reach != "partial":
        return allowed
    chunk = q.shape[2] // 2
    masks = [window_mask(me, source, rows, keys, chunk, cp, window, q.device)] if window else []
    if attention_chunk:
        masks.append(attention_chunk_mask(me, source, rows, keys, chunk, cp, attention_chunk, positions, q.device))
    for within in masks:
        allowed = within.expand(q.shape[0], 1, tq, tk) if allowed is None else allowed & within
    return allowed


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None,
                   documents: torch.Tensor | None = None, scale: float | None = None, window: int = 0,
                   attention_chunk: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries q (B, H, T/C, D) over the whole row's keys and values, of which this
    rank holds k (B, KV, T/C, D) and v (B, KV, T/C, Dv: latent attention's values narrower), KV dividing H; every
    rank of `group` (C ranks, the ring) calls it with its
    zig-zag part (zigzag_split). `documents` (C, B, T/C): every rank's segment ids (gather_segments), for packed
    records; None: one document per row. `scale`: the scores' factor (None: 1 / sqrt(D)). `window`: each query sees
    at most this many keys, its own included (0: all; window_reach). `attention_chunk`: Llama 4's chunked attention,
    each query sees the keys of its own chunk of that many positions (0: all; attention_chunk_reach); for packed
    records the chunks are each record's, by `positions` (C, B, T/C: every rank's tokens' positions within their
    records). Returns this rank's output (B, H, T/C, Dv), in zig-zag order as q."""
    if q.shape[2] % 2:
        raise ValueError(f"a rank's {q.shape[2]} tokens are not two equal chunks (zigzag_split's)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} KV heads do not divide {q.shape[1]} query heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if not attention_chunk or documents is None:
        positions = None  # one document a row: the row's positions, from the chunks' places
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), documents, positions, group, scale, window,
                                attention_chunk)
