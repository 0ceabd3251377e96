"""A frozen model sharded as ZeRO-3 shards one (DPO's live reference at --zero 3): a unit whole only in its forward."""

from __future__ import annotations

import torch

from zerotrain.errors import ZeroTrainError

from . import units
from .bucket_buffers import ReleasedParameterError, gather_bucket, shard_into_buckets
from .layout import ShardLayout
from .params import param_dtype, storage_bytes


class FrozenCopy:
    """A frozen module sharded over a DP group (shard_frozen_copy builds it): each rank holds its owned chunks
    (`shard`); a unit's buckets are whole only while its forward runs. Forward only, without gradients."""

    def __init__(self, module: torch.nn.Module, dp, layout: ShardLayout, shard: torch.Tensor,
                 buffers: list[torch.Tensor]):
        self.module, self.dp, self.layout, self.shard, self.buffers = module, dp, layout, shard, buffers
        self.units = units.model_units(module)
        self.unit_buckets = units.unit_buckets(module, layout, trained=False)
        self._holds = [0] * len(buffers)  # bucket -> the units running that hold it
        self.peak_bytes = self.held_bytes()
        bucket_of = {s.name: s.bucket for s in layout.slots}
        self._checked = [[(n, p, bucket_of[n]) for n, p in unit]
                         for unit in units.unit_parameters(module, trained=False)]
        for index, unit in enumerate(self.units):
            unit[0].register_forward_pre_hook(lambda _m, _a, u=index: self._enter(u))
            unit[-1].register_forward_hook(lambda _m, _a, _o, u=index: self._leave(u))
        forward = module.forward

        def forward_then_release(*args, **kwargs):
            try:
                return forward(*args, **kwargs)
            finally:  # whether it returns or raises: nothing stays whole
                self.release_all()

        module.forward = forward_then_release

    def _enter(self, unit: int) -> None:
        if torch.is_grad_enabled():
            raise ZeroTrainError("a frozen copy computes without gradients (its units are released after their "
                                 "forward): call it under torch.no_grad()")
        for b in self.unit_buckets[unit]:
            if not self._holds[b]:
                gather_bucket(self.dp, self.layout, self.shard, self.buffers[b], b, "all_gather_units")
            self._holds[b] += 1
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())
        for name, _, b in self._checked[unit]:
            if not self._holds[b]:
                raise ReleasedParameterError(f"{name} of a frozen copy was used while its bucket {b} was not "
                                             f"gathered (unit {unit})")

    def _leave(self, unit: int) -> None:
        for b in self.unit_buckets[unit]:
            self._holds[b] = max(self._holds[b] - 1, 0)
            if not self._holds[b]:
                self.buffers[b].untyped_storage().resize_(0)

    def release_all(self) -> None:
        """Release every bucket (a forward that raised midway leaves none whole)."""
        self._holds = [0] * len(self.buffers)
        for buffer in self.buffers:
            buffer.untyped_storage().resize_(0)

    def held_bytes(self) -> int:
        """Bytes held now: the shard and the buckets whole at the moment."""
        return storage_bytes([self.shard, *self.buffers])


def shard_frozen_copy(module: torch.nn.Module, dp, *, bucket_numel: int, precision: str = "fp32", device=None,
                      init=None, like=None) -> FrozenCopy:
    """Shard `module`, whose every parameter is frozen, over the DP group `dp` as ZeRO-3 shards a model, in
    `precision`, for forwards under torch.no_grad(). The values: with `like` (the stage-3 ZeroEngine of the model this
    copies) that engine's shard as it is now, copied; else `init`'s for a module on the meta device (owned ranges
    alone); else the module's own. Keep the returned FrozenCopy: its shard is what the parameters hold."""
    trained = [n for n, p in module.named_parameters() if p.requires_grad]
    if trained:
        raise ValueError(f"shard_frozen_copy takes a module whose every parameter is frozen; {trained[0]} "
                         f"requires grad (call module.requires_grad_(False) first)")
    layout = units.frozen_layout_of(module, dp.world_size, bucket_numel)
    dtype = param_dtype(precision)
    by_name = dict(module.named_parameters())
    params = [by_name[s.name] for s in layout.slots]
    if like is not None:
        same = [(s.name, s.shape, s.offset) for s in layout.slots] == \
            [(s.name, s.shape, s.offset) for s in like.layout.slots] and layout.buckets == like.layout.buckets
        if not same or like.dp.world_size != dp.world_size:
            raise ValueError("shard_frozen_copy(like=engine): the module is not laid out as the engine's model "
                             "(another architecture, world size or bucket_numel)")
        shard = like.placement.param_shard.detach().clone()  # in the engine's precision: what its model computes with
        return FrozenCopy(module, dp, layout, shard, shard_into_buckets(layout, params, shard, dp.rank, None))
    device = device if device is not None else next((p.device for p in params if not p.is_meta), "cpu")

    def values(name: str, p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if p.is_meta:
            return init.flat_values(name, tuple(p.shape), lo, hi)
        return p.detach().reshape(-1)[lo:hi]

    shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
    return FrozenCopy(module, dp, layout, shard, shard_into_buckets(layout, params, shard, dp.rank, values))
