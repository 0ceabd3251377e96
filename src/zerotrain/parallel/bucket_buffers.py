"""ZeRO-3's bucket buffers: full-size, their storage held only while a unit holds them gathered; every parameter a
view of one."""

from __future__ import annotations

from typing import Callable

import torch

from zerotrain.errors import ZeroTrainError

from . import units
from .layout import Bucket, ShardLayout
from .params import StaleParameterError, adopt_view


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


class UnitBuckets:
    """Parameters held as this rank's shards of their layouts, a bucket's buffer whole only while some unit holds it
    (docs/design.md, "Bucket buffers"): ZeRO-3's placement's (sharded.py) and the frozen copy's (frozen_copy.py)."""

    def hold_buckets(self, model: torch.nn.Module, dp, held: list[tuple[ShardLayout, bool, torch.Tensor, Callable]]) \
            -> None:
        """Hold `model`'s parameters over the DP group `dp` as `held`: per layout, whether it lays out the trained
        parameters or the frozen ones, this rank's shard of it, and the values that fill it (shard_into_buckets);
        the first one's shard is `param_shard`. The layouts' buckets are numbered on from one another (bucket i of
        the second is the first's count + i: units.numbered_unit_buckets)."""
        self.dp, self.units = dp, units.model_units(model)
        self.param_shard = held[0][2]
        by_name = dict(model.named_parameters())
        # parameter -> its unit (trained and frozen)
        self._param_unit = {id(p): u for trained in (True, False)
                            for u, unit in enumerate(units.unit_parameters(model, trained)) for _, p in unit}
        self.bucket_params: list[torch.Tensor] = []
        # bucket -> its Bucket in its layout, the shard it is gathered from, and where its layout starts in the
        # digests' positions (a layout's after those before it)
        self.bucket_sources: list[tuple[Bucket, torch.Tensor, int]] = []
        bucket_of, start = {}, 0  # parameter -> its bucket
        for layout, _, shard, values in held:
            params = [by_name[s.name] for s in layout.slots]
            bucket_of.update({id(p): len(self.bucket_params) + s.bucket for s, p in zip(layout.slots, params)})
            self.bucket_sources += [(b, shard, start) for b in layout.buckets]
            self.bucket_params += shard_into_buckets(layout, params, shard, dp.rank, values)
            start += layout.padded_numel
        # each unit's parameters these buckets hold, from its modules' parameters (not the unit's list), as (name,
        # bucket): what check_whole checks
        names = {id(p): n for n, p in by_name.items()}
        self._unit_members = [[(names[id(p)], bucket_of[id(p)]) for module in unit for p in module.parameters()
                               if id(p) in bucket_of and self._param_unit.get(id(p)) == u]
                              for u, unit in enumerate(self.units)]
        self.unit_buckets = units.numbered_unit_buckets(model, [(layout, trained) for layout, trained, *_ in held])
        self.whole: set[int] = set()  # buckets whose buffers hold their values now
        self._in_flight: dict[int, object] = {}  # bucket -> its prefetch's all-gather, not yet waited for
        self._holds: dict[int, set] = {}  # bucket -> the (unit, "forward" | "backward" | "prefetch") holding it whole
        self._updates = 0  # the shard's updates so far (steps applied, checkpoints loaded)
        self._gathered_at: dict[int, int] = {}  # bucket -> self._updates when its gather was launched
        # What another engine over the same units holds whole now (expert parallelism's): in param_peak_bytes too
        self.param_bytes_beside: Callable[[], int] = lambda: 0
        self.param_peak_bytes = self.param_bytes()

    def gather_unit(self, unit: int, phase: str) -> None:
        """Make `unit`'s buckets whole, held for `phase` ("forward" or "backward"): waiting for a prefetch in flight,
        gathering now what is neither whole nor in flight."""
        for b in self.unit_buckets[unit]:
            holders = self._holds.setdefault(b, set())
            holders.discard((unit, "prefetch"))
            if b in self._in_flight:
                self._in_flight.pop(b).wait()
                self.whole.add(b)
            elif b not in self.whole:
                self._gather_bucket(b)
            if self._gathered_at[b] != self._updates:
                raise StaleParameterError(f"bucket {b} of unit {unit} holds values gathered before the shard's last "
                                          "update (a gather that outlived its step)")
            holders.add((unit, phase))

    def prefetch_unit(self, unit: int) -> None:
        """Launch the all-gathers of `unit`'s buckets that are neither whole nor in flight, held for it until it
        gathers them (gather_unit waits for them then)."""
        for b in self.unit_buckets[unit]:
            self._holds.setdefault(b, set()).add((unit, "prefetch"))
            if b not in self.whole and b not in self._in_flight:
                self._gather_bucket(b, async_op=True)

    def check_whole(self, unit: int) -> None:
        """Raise unless every parameter of `unit` is in a gathered bucket (from the modules' parameters, not the unit's
        list)."""
        for name, b in self._unit_members[unit]:
            if b not in self.whole:
                raise ReleasedParameterError(f"{name} was used while its bucket {b} was not gathered (unit {unit})")

    def release_unit(self, unit: int, phase: str) -> None:
        """`unit` no longer needs its buckets for `phase`; a bucket no unit holds is released."""
        for b in self.unit_buckets[unit]:
            holders = self._holds.get(b, set())
            holders.discard((unit, phase))
            if not holders:
                self._release_bucket(b)

    def release_all(self) -> None:
        """Release every bucket, prefetches in flight too (before the optimizer updates the shard: no stale copy
        survives the step)."""
        self._holds.clear()
        self._land_prefetches()
        for b in list(self.whole):
            self._release_bucket(b)

    def _land_prefetches(self) -> None:
        """Wait for every prefetch in flight: its buckets are whole (a buffer is never released while a gather writes
        into it)."""
        for b in list(self._in_flight):
            self._in_flight.pop(b).wait()
            self.whole.add(b)

    def _gather_bucket(self, index: int, async_op: bool = False) -> None:
        """All-gather bucket `index` into its buffer: whole now, or with `async_op` in flight (whole once waited for,
        by gather_unit or release_all), counted as "all_gather_units" or "prefetch_units"."""
        (b, shard, _), buffer = self.bucket_sources[index], self.bucket_params[index]
        self._gathered_at[index] = self._updates
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())  # its storage allocated again
        work = self.dp.all_gather(buffer, shard[b.shard_offset : b.shard_offset + b.chunk_numel(self.dp.world_size)],
                                  "prefetch_units" if async_op else "all_gather_units", async_op=async_op)
        if async_op:
            self._in_flight[index] = work
        else:
            self.whole.add(index)
        self.param_peak_bytes = max(self.param_peak_bytes, self.param_bytes() + self.param_bytes_beside())

    def _release_bucket(self, index: int) -> None:
        """Free bucket `index`'s full-size buffer; a gather still writing into it is waited for first (on CUDA the
        compute stream waits for its `done` event: comm_stream.py), so the memory is reused only after it."""
        if index in self._in_flight:
            self._in_flight.pop(index).wait()
        self.bucket_params[index].untyped_storage().resize_(0)
        self.whole.discard(index)

    def param_bytes(self) -> int:
        """Parameter bytes held now: the shard and the buckets whole or being gathered at the moment."""
        whole = sum(self.bucket_params[b].numel() for b in self.whole | set(self._in_flight))
        return self.param_shard.element_size() * (self.param_shard.numel() + whole)

