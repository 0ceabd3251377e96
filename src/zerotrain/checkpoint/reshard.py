"""How checkpoints cross meshes: where each value of a rank's new shard lives in the old shards, read by ranges.

A rank's new shard is its owned chunk of each bucket of its local flat buffer (its TP slices of the full model, in
the run's layout; with --ep also its expert engine's shard: its block of experts over its replica group). `shard_reads`
walks the parameters those chunks meet and follows each value back: to its place in the local tensor of the old TP
rank that holds it, then through the checkpoint's layout that holds the parameter (homes.CheckpointHomes: the flat
layout, or an --ep checkpoint's expert layout of the EP rank that held that expert) to the old DP rank whose chunk
holds it, the world rank that wrote that chunk and the offset in its shard (the layouts answer where:
ShardLayout.owned_pieces and .pieces). So one walk reshards across world sizes, TP degrees and EP degrees (an --ep 1
checkpoint's experts are in its flat layout; an --ep E one's in its expert layout, under expert_ keys). A parameter
sliced the same way in both (no TP, or the same TP slices) maps its positions straight across; one whose TP slicing
changes is followed along its split dimension (a KV head on several old TP ranks is read from the first of them, as
the full model takes it). The result is a list of contiguous copies, the same for every state key, so the loader
reads each old shard's bytes that this rank will own and nothing else: no whole shard, no full flat buffer, no full
parameter. Padding is not read (zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotrain.errors import CheckpointError
from zerotrain.model.tensor_parallel import TPSlice
from zerotrain.parallel import ShardLayout

from .homes import CheckpointHomes


@dataclass(frozen=True)
class Read:
    """Values [src, src + numel) of old world rank `rank`'s shard, under its state keys prefixed `prefix` ("" or
    expert_), go to [dst, dst + numel) of the new shard."""

    rank: int
    src: int
    dst: int
    numel: int
    prefix: str = ""


def shard_reads(old: CheckpointHomes, new: ShardLayout, new_slices: dict[str, TPSlice], tp_rank: int,
                dp_rank: int) -> list[Read]:
    """The copies that fill the new shard of (`tp_rank`, `dp_rank`) in layout `new` from the old checkpoint's shards,
    in order.

    `new` is a local layout (sharded over the new DP size, or with --ep the expert engine's over its replica group,
    `dp_rank` its rank there); `old` says where each parameter of it lives in the checkpoint, by name. The caller
    checked that both hold the same model.
    """
    reads: list[Read] = []
    for s in new.slots:
        home = old.home(s.name)
        was = home.slot
        for mine in new.owned_pieces(dp_rank, s.offset, s.offset + s.numel):  # what of s this rank will own, and where
            for t, src, dst, n in _local_runs(s.name, mine.start - s.offset, mine.end - s.offset,
                                              home.tp_slice, new_slices.get(s.name), tp_rank):
                at = was.offset + src  # [at, at + n) of old TP rank t's flat buffer, held by the old DP ranks' pieces
                reads += [Read(home.world_rank(p.rank, t), p.shard_offset, mine.shard_offset + dst + p.start - at,
                               p.numel, home.prefix) for p in home.layout.pieces(at, at + n)]
    return _merged(reads)


def _local_runs(name: str, lo: int, hi: int, old: TPSlice | None, new: TPSlice | None, tp_rank: int):
    """(old TP rank, index in its local tensor, index from `lo`, length): where values [lo, hi) of the new local
    tensor of `name` lie in the old TP ranks' local tensors, in contiguous runs."""
    if old == new:  # sliced alike (or not at all): the same local tensor, held by TP rank tp_rank's first replica
        yield (old.first_holder(tp_rank) if old else 0), lo, 0, hi - lo
        return
    if old is not None and new is not None and old.dim != new.dim:
        raise CheckpointError(f"{name} is split along dim {old.dim} in the checkpoint and {new.dim} in this run")
    split = new or old
    dim, shape = split.dim, split.full_shape
    extent = shape[dim]
    inner = 1
    for size in shape[dim + 1 :]:
        inner *= size
    new_parts = new.parts[tp_rank] if new else ((0, extent),)
    new_width = sum(b - a for a, b in new_parts)
    old_width = sum(b - a for a, b in old.parts[0]) if old else extent
    segments = _dim_segments(new_parts, _old_holders(old, extent))
    row = new_width * inner  # values of one index of the dims before `dim`, in the new local tensor
    for outer in range(lo // row, (hi - 1) // row + 1):
        for k, n, t, k_old in segments:
            a = (outer * new_width + k) * inner
            b = a + n * inner
            start, end = max(a, lo), min(b, hi)
            if start < end:
                yield t, (outer * old_width + k_old) * inner + start - a, start - lo, end - start


def _old_holders(old: TPSlice | None, extent: int) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
    """(TP rank, its ranges along the split dim) of the old TP ranks the full tensor is taken from: each range once
    (a KV head on several TP ranks from the first of them); an unsplit parameter whole from TP rank 0."""
    if old is None:
        return [(0, ((0, extent),))]
    return [(t, ranges) for t, ranges in enumerate(old.parts) if old.first_holder(t) == t]


def _dim_segments(new_parts, holders) -> list[tuple[int, int, int, int]]:
    """(index in the new local tensor along the split dim, length, old TP rank, its index there): the new ranges
    cut where the old TP ranks' ranges meet them, in the new tensor's order."""
    segments, k = [], 0
    for lo, hi in new_parts:
        for t, ranges in holders:
            k_old = 0
            for a, b in ranges:
                start, end = max(lo, a), min(hi, b)
                if start < end:
                    segments.append((k + start - lo, end - start, t, k_old + start - a))
                k_old += b - a
        k += hi - lo
    return sorted(segments)


def _merged(reads: list[Read]) -> list[Read]:
    """Consecutive reads continuing one another (same shard, both ranges contiguous) as one."""
    out: list[Read] = []
    for r in reads:
        last = out[-1] if out else None
        if (last and (last.rank, last.prefix) == (r.rank, r.prefix) and last.src + last.numel == r.src
                and last.dst + last.numel == r.dst):
            out[-1] = Read(r.rank, last.src, last.dst, last.numel + r.numel, r.prefix)
        else:
            out.append(r)
    return out
