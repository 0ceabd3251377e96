"""ZeRO-3's bucket buffers: full-size, their storage held only while gathered; every parameter a view of one."""

from __future__ import annotations

from typing import Callable

import torch

from zerotrain.errors import ZeroTrainError

from .layout import ShardLayout
from .params import adopt_view


class ReleasedParameterError(ZeroTrainError):
    """A parameter was read while its bucket's storage was released (not gathered)."""


def shard_into_buckets(layout: ShardLayout, params: list[torch.nn.Parameter], shard: torch.Tensor, rank: int,
                       values: Callable | None) -> list[torch.Tensor]:
    """Fill `shard` with rank `rank`'s owned chunks of `layout`, `values(name, p, lo, hi)` giving values [lo, hi) of
    parameter p flattened, the only ones read or drawn (None: `shard` holds them already). Every parameter becomes a
    view of its bucket's full-size buffer, released (0 bytes): the buffers, in bucket order."""
    by_bucket: dict[int, list] = {}
    for s, p in zip(layout.slots, params):
        by_bucket.setdefault(s.bucket, []).append((s, p))
    buffers = []
    with torch.no_grad():
        for b in layout.buckets:
            buffer = torch.empty(b.end - b.start, dtype=shard.dtype, device=shard.device)  # never written: no pages
            lo, hi = b.chunk(rank, layout.world_size)
            for s, p in by_bucket[b.index]:
                first, last = max(lo, s.offset), min(hi, s.offset + s.numel)  # its values this rank owns
                if last > first and values is not None:
                    shard[b.shard_offset + first - lo : b.shard_offset + last - lo] = \
                        values(s.name, p, first - s.offset, last - s.offset)
                adopt_view(p, buffer[s.offset - b.start : s.offset - b.start + s.numel].view(s.shape))
            buffer.untyped_storage().resize_(0)  # the views keep their shapes, not its bytes
            buffers.append(buffer)
    return buffers


def gather_bucket(dp, layout: ShardLayout, shard: torch.Tensor, buffer: torch.Tensor, index: int, purpose: str,
                  async_op: bool = False):
    """All-gather bucket `index` of `layout` into its full-size `buffer` (its storage allocated again) from the DP
    group's shards; the work handle with `async_op`."""
    b = layout.buckets[index]
    buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
    c = b.chunk_numel(dp.world_size)
    return dp.all_gather(buffer, shard[b.shard_offset : b.shard_offset + c], purpose, async_op=async_op)
