"""The flat layout ZeRO shards: where each parameter lives, the buckets, and which ranges each rank owns.

`ShardLayout` is the one owner of "which rank holds which flat range, and where in its shard": `owned_pieces(rank)`
(what a rank holds, and where each piece sits in its shard) and `pieces(start, end)` (who holds a flat range, cut
where the ranks' chunks meet). The engine's buffers, checkpoint reads, reshards and verification ask it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass

import torch

# Values per chunk of the gradient norm's grid (grad_norm.py). Every bucket is padded to a multiple of
# world_size x NORM_CHUNK, so each rank's share of a bucket is whole chunks of one grid, the same at every
# world size: at most world_size x 256 - 1 values of padding per bucket (0.05% of a 4 MiB bucket at 8 ranks).
NORM_CHUNK = 256


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    numel: int
    offset: int  # in the padded flat buffer
    flat_offset: int  # in the unpadded concatenation of parameters, in layout order
    bucket: int
    decay: bool


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int  # [start, end) of the padded flat buffer; (end - start) % (world_size * NORM_CHUNK) == 0
    end: int
    decay_end: int  # [start, decay_end) holds decayed params; the rest no-decay params and padding
    shard_offset: int  # where this bucket's owned chunk sits in each rank's shard

    def chunk_numel(self, world_size: int) -> int:
        return (self.end - self.start) // world_size

    def chunk(self, rank: int, world_size: int) -> tuple[int, int]:
        c = self.chunk_numel(world_size)
        return self.start + rank * c, self.start + (rank + 1) * c


@dataclass(frozen=True)
class ShardPiece:
    """Values [start, end) of the padded flat buffer, held by rank `rank` (of the layout's DP group) at
    [shard_offset, shard_offset + numel) of its shard."""

    rank: int
    start: int
    end: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class ShardLayout:
    """Where every parameter lives in the flat buffer, and which flat ranges each rank owns.

    Parameters are laid out in reverse of the model's order, so buckets fill in the order backward
    produces gradients; within a bucket decayed parameters come first, so each rank's chunk of a
    bucket splits into at most one decayed and one non-decayed piece for AdamW's param groups.
    Buckets are grouped by `bucket_numel` alone, so a bucket holds the same parameters at every world size.
    """

    def __init__(self, slots: list[ParamSlot], buckets: list[Bucket], world_size: int):
        self.slots, self.buckets, self.world_size = slots, buckets, world_size
        self.numel = sum(s.numel for s in slots)
        self.padded_numel = buckets[-1].end if buckets else 0
        self.shard_numel = self.padded_numel // world_size
        self._starts = [b.start for b in buckets]
        self._slot_offsets = [slot.offset for slot in slots]  # in flat order: layout order

    @classmethod
    def build(cls, params: list[tuple[str, tuple[int, ...], bool]], world_size: int, bucket_numel: int):
        groups, current, size = [], [], 0
        for name, shape, decay in reversed(params):
            current.append((name, tuple(shape), decay))
            size += math.prod(shape)
            if size >= bucket_numel:
                groups.append(current)
                current, size = [], 0
        if current:
            groups.append(current)
        slots, buckets, offset, flat_offset, shard_offset = [], [], 0, 0, 0
        for index, group in enumerate(groups):
            start = offset
            ordered = [p for p in group if p[2]] + [p for p in group if not p[2]]
            decay_end = start + sum(math.prod(s) for _, s, d in group if d)
            for name, shape, decay in ordered:
                slots.append(ParamSlot(name, shape, math.prod(shape), offset, flat_offset, index, decay))
                offset += math.prod(shape)
                flat_offset += math.prod(shape)
            unit = world_size * NORM_CHUNK  # every rank's share is whole norm chunks
            end = start + -(-(offset - start) // unit) * unit
            buckets.append(Bucket(index, start, end, decay_end, shard_offset))
            shard_offset += (end - start) // world_size
            offset = end
        return cls(slots, buckets, world_size)

    def owned_ranges(self, rank: int) -> list[tuple[int, int]]:
        return [b.chunk(rank, self.world_size) for b in self.buckets]

    def owned_pieces(self, rank: int, start: int = 0, end: int | None = None) -> list[ShardPiece]:
        """What rank `rank` holds of [start, end) of the padded flat buffer (all of it by default), in flat order,
        each piece with where it sits in the rank's shard: one piece per bucket met, at most."""
        end = self.padded_numel if end is None else end
        out = []
        for b in self.buckets[self._bucket_at(start):]:
            if b.start >= end:
                break
            lo, hi = b.chunk(rank, self.world_size)
            a, z = max(lo, start), min(hi, end)
            if a < z:
                out.append(ShardPiece(rank, a, z, b.shard_offset + a - lo))
        return out

    def owned_slots(self, rank: int) -> list[tuple[ParamSlot, int, int]]:
        """(slot, start, end) for each parameter rank `rank` holds a part of, [start, end) of the flat buffer, in flat
        order: what owned_pieces(rank, slot's range) gives for every slot, without a call a slot (a slot lies in one
        bucket, so its part is one range; a plan of DeepSeek-V3-671B asks for every slot of 264 ranks' layouts)."""
        out = []
        for b in self.buckets:
            lo, hi = b.chunk(rank, self.world_size)
            i = max(0, bisect.bisect_right(self._slot_offsets, lo) - 1)
            while i < len(self.slots) and self.slots[i].offset < hi:
                s = self.slots[i]
                a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < z:
                    out.append((s, a, z))
                i += 1
        return out

    def pieces(self, start: int, end: int) -> list[ShardPiece]:
        """Who holds [start, end) of the padded flat buffer: the range cut where the ranks' chunks meet, in flat
        order, each piece with its rank and where it sits in that rank's shard."""
        out, at = [], start
        index = self._bucket_at(start)
        while at < end:
            b = self.buckets[index]
            if at >= b.end:
                index += 1
                continue
            chunk = b.chunk_numel(self.world_size)
            rank, offset = divmod(at - b.start, chunk)  # rank `rank`'s chunk holds `at`, `offset` into it
            n = min(end - at, chunk - offset, b.end - at)
            out.append(ShardPiece(rank, at, at + n, b.shard_offset + offset))
            at += n
        return out

    def _bucket_at(self, index: int) -> int:
        """The bucket holding flat index `index` (the first one for an index before it)."""
        return max(0, bisect.bisect_right(self._starts, index) - 1)

    def assemble(self, shards) -> torch.Tensor:
        """The padded flat buffer from every rank's shard (shards[r] is rank r's, in shard order)."""
        flat = torch.zeros(self.padded_numel, dtype=shards[0].dtype)
        for rank, shard in enumerate(shards):
            for p in self.owned_pieces(rank):
                flat[p.start : p.end] = shard[p.shard_offset : p.shard_offset + p.numel]
        return flat

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard of a padded flat buffer: its owned pieces, concatenated."""
        return torch.cat([flat[p.start : p.end] for p in self.owned_pieces(rank)])

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "shard_numel": self.shard_numel,
            "params": [{**asdict(s), "shape": list(s.shape)} for s in self.slots],
            "buckets": [asdict(b) for b in self.buckets],
            "owned_ranges": [[list(r) for r in self.owned_ranges(k)] for k in range(self.world_size)],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ShardLayout":
        slots = [ParamSlot(**{**s, "shape": tuple(s["shape"])}) for s in d["params"]]
        return cls(slots, [Bucket(**b) for b in d["buckets"]], d["world_size"])


def shard_values(shard, lo: int, hi: int) -> torch.Tensor:
    """Values [lo, hi) of a rank's shard given as one tensor or as its 1-D parts in shard order (the engine's
    master_views: at stages 1 and 2 its owned runs of the flat buffer): a view where one part holds them all."""
    if not isinstance(shard, (list, tuple)):
        return shard[lo:hi]
    out, at = [], 0
    for part in shard:
        a, z = max(lo, at), min(hi, at + part.numel())
        if a < z:
            out.append(part[a - at : z - at])
        at += part.numel()
    return out[0] if len(out) == 1 else torch.cat(out)


def split_by_tp(slots, sliced: dict, padded_numel: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The flat ranges of `slots` split by TP (`sliced`: the names of the TP-sliced parameters) and the ranges of the
    rest up to `padded_numel` (replicated values and padding)."""
    cuts = sorted((s.offset, s.offset + s.numel) for s in slots if s.name in sliced)
    tp_ranges, rest, at = [], [], 0
    for lo, hi in cuts:
        if lo > at:
            rest.append((at, lo))
        if tp_ranges and tp_ranges[-1][1] == lo:
            tp_ranges[-1] = (tp_ranges[-1][0], hi)
        else:
            tp_ranges.append((lo, hi))
        at = hi
    if at < padded_numel:
        rest.append((at, padded_numel))
    return tp_ranges, rest
