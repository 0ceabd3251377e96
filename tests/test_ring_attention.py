"""Ring attention (parallel/ring_attention.py) over 2 and 4 gloo ranks computes what the model's attention computes on
the whole row: outputs and the gradients of q, k and v within 1e-6 (relative to the largest value) of `attend` (SDPA,
with the records' document_mask for packed rows) in float64 and fp32, with GQA (4 query heads over 2 KV heads), one
document per row and packed records of several lengths crossing the chunks' and the ranks' borders, with either hop
kernel (torch's fused CPU kernel, the explicit scores). Planted in the product's own functions (in the ranks, by
mock.patch) and caught: a missing K/V hop, the causal mask on the other ranks' hops instead of the rank's own, the
records' mask ignored across the split. Latent attention's shape (DeepSeek-V3, Mistral 4: q and k of nope + rope units,
values narrower, every head its own keys) the same, the merge on the values' width.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import spawn

from zerotrain.model.attention import attend, document_mask
from zerotrain.model.llama4 import chunked_mask
from zerotrain.model.positions import positions_from_segments
from zerotrain.parallel import ring_attention as ring
from zerotrain.parallel.ring_attention import (gather_segments, ring_attention, rotary_positions, zigzag_split,
                                               zigzag_unsplit)

B, H, KV, D = 2, 4, 2, 8
LATENT = {"heads": (H, H), "widths": (12, 8)}  # latent attention's: (query heads, KV heads), (q/k units, v units)
# Record lengths per row: crossing chunk borders (chunks of 2 at 4 ranks x 16, 4 at 2 ranks x 16) and rank borders.
RECORDS = {16: [[5, 9, 2], [1, 3, 7, 5]], 24: [[7, 10, 2, 5], [13, 11]]}


def segments_of(T: int) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
                        for lengths in RECORDS[T]])


def inputs(T: int, dtype: torch.dtype, latent: bool = False):
    """q, k, v and the loss's weights: GQA's (4 query heads over 2 KV heads of 8 units), or latent attention's (4
    heads, q and k of 12 units, v of 8)."""
    g = torch.Generator().manual_seed(T)
    (h, kv), (dqk, dv) = (LATENT["heads"], LATENT["widths"]) if latent else ((H, KV), (D, D))
    q, k, v = (torch.randn(B, heads, T, width, generator=g, dtype=dtype)
               for heads, width in ((h, dqk), (kv, dqk), (kv, dv)))
    weights = torch.randn(B, h, T, dv, generator=g, dtype=dtype)  # the loss sum(out * weights): every output counts
    return q, k, v, weights


def whole_row(T: int, dtype: torch.dtype, packed: bool, latent: bool = False, chunk: int = 0):
    """The model's attention on the whole row: output and the gradients of q, k, v (`chunk`: Llama 4's attention
    chunks, its own mask of them)."""
    q, k, v, weights = inputs(T, dtype, latent)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    documents = document_mask(segments_of(T), dtype) if packed else None
    if chunk:
        segments = segments_of(T) if packed else None
        positions = positions_from_segments(segments) if packed else torch.arange(T)
        documents = chunked_mask(positions, segments, chunk, dtype)
    out = attend(q, k, v, documents=documents)
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def ring_errors(rank: int, cp: int, T: int, dtype: torch.dtype, packed: bool, latent: bool = False,
                chunk: int = 0) -> float:
    """The largest difference of this rank's output and gradients from the whole row's, and of the outputs put back
    together (every rank's) from the whole row's output, relative to the largest value."""
    q, k, v, weights = (zigzag_split(t, cp, rank, dim=2).requires_grad_() for t in inputs(T, dtype, latent))
    documents = gather_segments(zigzag_split(segments_of(T), cp, rank)) if packed else None
    positions = torch.stack([zigzag_split(positions_from_segments(segments_of(T)), cp, r) for r in range(cp)])
    out = ring_attention(q, k, v, documents=documents, attention_chunk=chunk, positions=positions)
    (out * weights.detach()).sum().backward()
    expected = whole_row(T, dtype, packed, latent, chunk)
    mine = [zigzag_split(t, cp, rank, dim=2) for t in expected]
    errors = [relative(a, b) for a, b in zip((out.detach(), q.grad, k.grad, v.grad), mine)]
    parts = [torch.empty_like(out) for _ in range(cp)]
    dist.all_gather(parts, out.detach().contiguous())
    errors.append(relative(zigzag_unsplit(parts, dim=2), expected[0]))
    return max(errors)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, relative to the largest value of b (fp32 gradients reach ~10)."""
    return ((a - b).abs().max() / b.abs().max()).item()


def skip_a_hop(hop_blocks):
    """Planted: the keys and values of the previous rank (hop 1) never attended to."""
    def planted(rank, source, chunk):
        return None if source == (rank - 1) % dist.get_world_size() != rank else hop_blocks(rank, source, chunk)
    return planted


def causal_on_the_wrong_hops(hop_blocks):
    """Planted: the causal mask on the other ranks' hops, not on the rank's own."""
    def planted(rank, source, chunk):
        rows, keys, causal = hop_blocks(rank, source, chunk) or (None, None, None)
        return None if rows is None else (rows, keys, not causal)
    return planted


def records_only_at_home(allowed_keys):
    """Planted: the records' mask applied on the rank's own hop only, ignored for keys from other ranks."""
    def planted(segments_q, segments_k, causal, tq, tk, device):
        if not causal:
            segments_q = segments_k = None
        return allowed_keys(segments_q, segments_k, causal, tq, tk, device)
    return planted


PLANTS = {"missing hop": ("hop_blocks", skip_a_hop),
          "causal on the wrong hops": ("hop_blocks", causal_on_the_wrong_hops),
          "records' mask ignored across the split": ("allowed_keys", records_only_at_home)}
CASES = [(torch.float64, False), (torch.float64, True), (torch.float32, False), (torch.float32, True)]
LATENT_CASES = [(torch.float64, True), (torch.float32, False)]
CHUNKED = 3  # Llama 4's attention chunks of 3 positions: across the zig-zag chunks (2 or 4 tokens) and the records


def ring_job(rank, comm, tmp_path, cp, T):
    """{case: largest error} honest with each hop kernel, then with each plant (packed float64 rows)."""
    results = {f"fused {dtype} packed={packed}": ring_errors(rank, cp, T, dtype, packed) for dtype, packed in CASES}
    results.update({f"fused latent {dtype} packed={packed}": ring_errors(rank, cp, T, dtype, packed, latent=True)
                    for dtype, packed in LATENT_CASES})
    with mock.patch.object(ring, "hop_kernel", lambda device: "explicit"):
        results.update({f"explicit {dtype} packed={packed}": ring_errors(rank, cp, T, dtype, packed)
                        for dtype, packed in CASES})
        results.update({f"explicit latent {dtype} packed={packed}": ring_errors(rank, cp, T, dtype, packed, True)
                        for dtype, packed in LATENT_CASES})
        results.update({f"explicit chunked {dtype} packed={packed}": ring_errors(rank, cp, T, dtype, packed,
                                                                                 chunk=CHUNKED)
                        for dtype, packed in CASES})
    results.update({f"fused chunked {dtype} packed={packed}": ring_errors(rank, cp, T, dtype, packed, chunk=CHUNKED)
                    for dtype, packed in CASES})
    for plant, (name, wrap) in PLANTS.items():
        with mock.patch.object(ring, name, wrap(getattr(ring, name))):
            results[plant] = ring_errors(rank, cp, T, torch.float64, True)
    return results


@pytest.mark.parametrize("cp,T", [(2, 16), (4, 24)])
def test_ring_attention_equals_whole_row_attention_and_planted_errors_are_caught(tmp_path, cp, T):
    codes, results = spawn(ring_job, cp, tmp_path, cp, T, timeout=150)
    assert codes == [0] * cp, results
    assert all("error" not in r for r in results), results
    for r in results:
        for kernel in ("fused", "explicit"):
            for dtype, packed in CASES:
                assert r[f"{kernel} {dtype} packed={packed}"] < 1e-6, r
            for dtype, packed in LATENT_CASES:
                assert r[f"{kernel} latent {dtype} packed={packed}"] < 1e-6, r
            for dtype, packed in CASES:
                assert r[f"{kernel} chunked {dtype} packed={packed}"] < 1e-6, r
    for plant in PLANTS:
        assert max(r[plant] for r in results) > 1e-2, (plant, results)


def test_zigzag_split_balances_the_chunks_and_unsplit_puts_them_back():
    row = torch.arange(16).unsqueeze(0)
    parts = [zigzag_split(row, 4, r) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    # each rank's causal work (keys before each of its queries) is the same
    assert len({int((p + 1).sum()) for p in parts}) == 1
    assert torch.equal(zigzag_unsplit(parts), row)
    with pytest.raises(ValueError, match="does not split into 8 equal chunks"):
        zigzag_split(torch.arange(12).unsqueeze(0), 4, 0)


def test_rotary_positions_are_the_tokens_positions_in_the_whole_row():
    assert rotary_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    segments = segments_of(16)
    whole = positions_from_segments(segments)
    assert torch.equal(zigzag_unsplit([rotary_positions(16, 2, r, segments) for r in range(2)]), whole)
    assert rotary_positions(16, 2, 0, segments)[0].tolist() == [0, 1, 2, 3, 7, 8, 0, 1]
