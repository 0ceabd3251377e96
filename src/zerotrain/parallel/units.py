"""ZeRO-3's units: which modules run together, which buckets each one's parameters lie in, and what is whole at once.

Units, in forward order: the root (the model itself), with an untied head its embedding, each transformer block, with
--mtp train each MTP depth, with an untied head its final norm and head (why: docs/design.md, "ZeRO-3's units").
"""

from __future__ import annotations

import torch

from .layout import ShardLayout
from .params import flat_layout, frozen_parameters


def model_units(model: torch.nn.Module) -> list[tuple[torch.nn.Module, ...]]:
    """The units in forward order (the module's docstring), each the modules that run it (the first's forward begins
    it, the last's ends it); the blocks are the members of the model's first ModuleList, an MTP depth runs inside an
    untied head's unit (model/mtp.py)."""
    blocks = next((list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)), [])
    inner = [*((b,) for b in blocks), *((d,) for d in mtp_depths(model))]
    if untied_head(model):
        return [(model,), (model.embedding,), *inner, (model.final_norm, model.lm_head)]
    return [(model,), *inner]


def mtp_depths(model: torch.nn.Module) -> list[torch.nn.Module]:
    """--mtp train's depths as units, in forward order (model/mtp.py's depth_units), or none."""
    module = getattr(model, "mtp_module", None)
    return module.depth_units() if module is not None else []


def untied_head(model: torch.nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    return head is not None and head.weight is not model.embedding.weight


def held_into_backward(model: torch.nn.Module) -> set[int]:
    """The units kept whole from their forward into their backward: the root, and an untied head (the last unit)."""
    return {0, len(model_units(model)) - 1} if untied_head(model) else {0}


def unit_parameters(model: torch.nn.Module, trained: bool = True) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Each unit's trained parameters (or with `trained` False its frozen ones), in model_units' order: the other
    units' own; the root's, those in no other."""
    units = model_units(model)
    named = {id(p): n for n, p in model.named_parameters() if p.requires_grad == trained}  # a tied parameter once
    elsewhere = {id(p) for unit in units[1:] for m in unit for p in m.parameters()}
    out = [[(named[id(p)], p) for p in model.parameters() if id(p) in named and id(p) not in elsewhere]]
    out += [[(named[id(p)], p) for m in unit for p in m.parameters() if id(p) in named] for unit in units[1:]]
    return out


def unit_buckets(model: torch.nn.Module, layout: ShardLayout, trained: bool = True) -> list[tuple[int, ...]]:
    """The buckets each unit's parameters lie in (a bucket at a boundary is in both units' lists); `trained` False:
    its frozen parameters' buckets, of their own layout (frozen_layout_of), where it holds them."""
    bucket_of = {s.name: s.bucket for s in layout.slots}
    return [tuple(sorted({bucket_of[n] for n, _ in params if n in bucket_of}))
            for params in unit_parameters(model, trained)]


def numbered_unit_buckets(model: torch.nn.Module, layouts: list[tuple[ShardLayout, bool]]) -> list[tuple[int, ...]]:
    """Each unit's buckets of `layouts` (each with whether it lays out trained parameters), numbered on from one layout
    to the next (bucket i of the second is the first's count + i): what bucket_buffers.UnitBuckets holds."""
    out, first = [()] * len(model_units(model)), 0
    for layout, trained in layouts:
        out = [unit + tuple(first + b for b in own) for unit, own in zip(out, unit_buckets(model, layout, trained))]
        first += len(layout.buckets)
    return out


def bucket_units(model: torch.nn.Module, layout: ShardLayout) -> list[int]:
    """The unit each bucket of `layout` is reduced with: the earliest in forward order of its parameters' units, whose
    backward ends last. A root parameter registered after the blocks (the final norm beside a tied head) counts as the
    last unit's (its gradient is complete before the last block's backward ends)."""
    params = unit_parameters(model)
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}  # registration order
    last = len(params) - 1
    after = max((order[n] for unit in params[1:] for n, _ in unit), default=len(order))
    unit_of = {n: (last if u == 0 and order[n] > after else u) for u, unit in enumerate(params) for n, _ in unit}
    depths = len(mtp_depths(model))
    if depths:
        # The MTP depths read the final norm's output: its gradient is complete only after their backward, which the
        # head's unit encloses. It is reduced with the last block, whose backward begins after it.
        last_block = last - depths - int(untied_head(model))
        norm = {id(p) for p in model.final_norm.parameters()}
        unit_of.update({n: last_block for n, p in model.named_parameters() if id(p) in norm and n in unit_of})
    units = [len(params)] * len(layout.buckets)
    for s in layout.slots:
        units[s.bucket] = min(units[s.bucket], unit_of[s.name])
    return units


def frozen_layout_of(model: torch.nn.Module, world_size: int, bucket_numel: int) -> ShardLayout:
    """The flat layout stage 3 shards a model's frozen parameters in, built as the trained ones' (engine.layout_of):
    an all-frozen copy of a model is laid out exactly as the model that trains."""
    return flat_layout(frozen_parameters(model), world_size, bucket_numel)


def units_whole_bytes(model: torch.nn.Module, layout: ShardLayout, element_size: int = 4,
                      prefetch: bool = False, frozen: ShardLayout | None = None,
                      beside: ShardLayout | None = None) -> int:
    """The most parameter bytes whole at once beyond the shard: the root unit with the largest other unit, or with
    `prefetch` the largest two neighbouring ones (an MTP depth with an untied head's unit too); `frozen`: the frozen
    parameters' layout, `beside`: the expert group's layout over the same units (expert parallelism), whose
    buckets are whole with the unit's."""
    layouts = [(layout, True)] + [(other, trained) for other, trained in ((frozen, False), (beside, True)) if other]
    size = [b.end - b.start for other, _ in layouts for b in other.buckets]
    units = [set(unit) for unit in numbered_unit_buckets(model, layouts)]
    root, last = units[0], len(units) - 1
    windows = [{u, u + 1} for u in range(1, last)] if prefetch and last > 1 else [{u} for u in range(1, last + 1)]
    # An untied head's unit is whole around the MTP depths, in their forward and their backward (model_units)
    depths = set(range(last - len(mtp_depths(model)), last)) if untied_head(model) else set()
    windows = [w | {last} if w & depths else w for w in windows] or [set()]
    return element_size * max(sum(size[b] for b in root.union(*(units[u] for u in w))) for w in windows)
