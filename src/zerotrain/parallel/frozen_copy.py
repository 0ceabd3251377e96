"""A frozen model sharded as ZeRO-3 shards one (DPO's live reference at --zero 3): a unit whole only in its forward."""

from __future__ import annotations

import torch

from zerotrain.errors import ZeroTrainError

from . import units
from .bucket_buffers import UnitBuckets
from .layout import ShardLayout
from .params import param_dtype


class FrozenCopy(UnitBuckets):
    """A frozen module sharded over a DP group (shard_frozen_copy builds it): each rank holds its owned chunks
    (`param_shard`); a unit's buckets are whole only while its forward runs. Forward only, without gradients."""

    def __init__(self, module: torch.nn.Module, dp, layout: ShardLayout, shard: torch.Tensor, values):
        """`values` fill `shard` (bucket_buffers.shard_into_buckets; None: it holds them already)."""
        self.module = module
        self.hold_buckets(module, dp, [(layout, False, shard, values)])
        for index, unit in enumerate(self.units):
            unit[0].register_forward_pre_hook(lambda _m, _a, u=index: self._enter(u))
            unit[-1].register_forward_hook(lambda _m, _a, _o, u=index: self.release_unit(u, "forward"))
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
        self.gather_unit(unit, "forward")
        self.check_whole(unit)


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
    if like is not None:
        if layout.to_dict() != like.layout.to_dict():  # its world size among them
            raise ValueError("shard_frozen_copy(like=engine): the module is not laid out as the engine's model "
                             "(another architecture, world size or bucket_numel)")
        shard = like.placement.param_shard.detach().clone()  # in the engine's precision: what its model computes with
        return FrozenCopy(module, dp, layout, shard, None)
    device = device if device is not None else next((p.device for p in module.parameters() if not p.is_meta), "cpu")

    def values(name: str, p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if p.is_meta:
            return init.flat_values(name, tuple(p.shape), lo, hi)
        return p.detach().reshape(-1)[lo:hi]

    shard = torch.zeros(layout.shard_numel, dtype=param_dtype(precision), device=device)
    return FrozenCopy(module, dp, layout, shard, values)
