"""Each input token's position: after those a KV cache holds, or within its own record for packed records."""

from __future__ import annotations

import torch

from .kv_cache import KVCache


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
