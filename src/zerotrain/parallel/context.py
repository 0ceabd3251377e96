"""Context parallelism (--cp C) wired into a run: the part of each row a rank keeps, and what the model's layers attend
with, over the mesh's cp group (the ring of ring_attention.py).

The C ranks of a DP replica read the same micro-batches; each keeps its zig-zag part of every row (chunks i and
2C-1-i of 2C: inputs, labels and segments alike; the labels were shifted on the whole row, so each is still its
input's next token). The model (Llama.hidden) asks `prepare` once per forward for its tokens' rotary positions (their
places in the whole row, or within their record for packed rows) and for the layers' ring, which carries every rank's
segment ids (gathered once per forward). The loss is each rank's sum over its own tokens over the global token count:
the reduce-scatter over dp_shard x cp adds the CP ranks' partial gradients, so the step is --cp 1's.
"""

from __future__ import annotations

import functools

import torch

from zerotrain.data.batches import MicroBatch
from zerotrain.model.attention import RingAttention
from .comm import Comm
from .ring_attention import gather_segments, ring_attention, rotary_positions, zigzag_split, zigzag_unsplit


class ContextParallel:
    """This rank's place in its cp group, and what the model asks of it (set as `model.context_parallel`)."""

    def __init__(self, comm: Comm, size: int, rank: int):
        self.comm, self.size, self.rank = comm, size, rank

    def part(self, micro: MicroBatch) -> MicroBatch:
        """This rank's zig-zag part of each row of `micro` (B, T) -> (B, T / C)."""
        return MicroBatch(*(None if t is None else zigzag_split(t, self.size, self.rank) for t in micro))

    def prepare(self, idx: torch.Tensor, segments: torch.Tensor | None) -> tuple[torch.Tensor, RingAttention]:
        """The rotary positions of this rank's tokens `idx` (B, T / C) and what the layers attend with. Packed rows
        (`segments`, this rank's part): every rank's parts gathered once, so that each hop masks other records' keys
        and each token's position counts from its record's start in the whole row."""
        T = idx.shape[1] * self.size
        ring = functools.partial(ring_attention, group=self.comm.group)
        if segments is None:
            return rotary_positions(T, self.size, self.rank, device=idx.device), RingAttention(ring)
        documents = gather_segments(segments, self.comm.group)  # (C, B, T / C)
        whole = zigzag_unsplit(list(documents), dim=1)
        return rotary_positions(T, self.size, self.rank, whole), RingAttention(ring, documents)


def context_parallel(mesh) -> ContextParallel | None:
    """The mesh's context parallelism, None at cp 1."""
    return ContextParallel(mesh.cp, mesh.cp_size, mesh.cp_rank) if mesh.cp_size > 1 else None
