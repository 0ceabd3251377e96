"""Between each TP rank's local flat buffer and the full model's tensors: how checkpoints cross meshes.

TP rank t's flat buffer (its parameters in the local ShardLayout, the same layout on every TP rank)
holds t's slice of each split parameter, which its `TPSlice` places in the full tensor (a KV head on
several TP ranks: the same rows on each), and a copy of every replicated parameter. The model file is
written from the full tensors, verified against them, and optimizer state moves to another mesh through
them: old shards -> each old TP rank's flat buffer -> full tensors -> this rank's slices -> its new flat
buffer -> its new shard.
"""

from __future__ import annotations

import torch

from zerotrain.model.layers import TPSlice
from zerotrain.parallel import ShardLayout


def full_shapes(layout: ShardLayout, slices: dict[str, TPSlice]) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape in the full model, by name (a split parameter's full shape, not its slice's)."""
    return {s.name: tuple(slices[s.name].full_shape) if s.name in slices else s.shape for s in layout.slots}


def replicated_mismatch(layout: ShardLayout, slices: dict[str, TPSlice],
                        flats) -> tuple[str, int, int, int] | None:
    """(name, TP rank, flat index, TP rank it should equal) of the first replicated value whose copy differs bitwise
    from TP rank 0's, or value of a KV head on several TP ranks that differs from the first of them's."""
    for s in layout.slots:
        for t, flat in enumerate(flats[1:], start=1):
            ref = slices[s.name].first_holder(t) if s.name in slices else 0
            if ref == t:
                continue
            want, got = flats[ref][s.offset : s.offset + s.numel], flat[s.offset : s.offset + s.numel]
            differs = (got.view(torch.uint8) != want.view(torch.uint8)).view(-1, want.element_size()).any(1)
            if differs.any():
                return s.name, t, s.offset + int(differs.nonzero()[0]), ref
    return None
