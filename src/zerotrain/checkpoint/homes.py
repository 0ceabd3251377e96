"""Where each parameter of a checkpoint lives: its slot in one of the checkpoint's layouts, its TP slice, the shard
files that hold its DP ranks' chunks, and the keys they hold it under.

A checkpoint has one flat layout, TP rank t's local parameters sharded over the DP ranks: world rank d x T + t wrote
DP rank d's chunk of each bucket, under master, exp_avg, exp_avg_sq. With --ep E it has an expert layout beside it:
EP rank 0's block of each MoE layer's experts over its replica group, under the expert_ keys of the same files, each
expert TP-split as EP rank 0's (expert_tp_slices, by EP rank 0's names). EP rank e holds the experts
[e x per_rank, (e + 1) x per_rank) of each MoE layer, laid out and split as EP rank 0's (the names shifted by
e x per_rank), and its replica k's chunks at TP index t are world rank (k x E + e) x T + t's (expert_shard_rank).
`CheckpointHomes.home` answers for any parameter by its global (Hugging Face) name, whatever the EP degree that wrote
it; the reshard (reshard.shard_reads) and the model's reader (model.ShardedModel) ask it, so the arithmetic has one
place."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from zerotrain.errors import CheckpointError
from zerotrain.model.tensor_parallel import TPSlice
from zerotrain.parallel import ParamSlot, ShardLayout

from .format import MANIFEST, ep_of, layout_of, mesh_of, tp_slices_of

EXPERT_TP_SLICES = "expert_tp_slices"  # the manifest's key of the experts' TP slices (EP rank 0's names)

EXPERT_PREFIX = "expert_"  # the expert engine's keys in a shard file, beside the dense engine's
_EXPERT = re.compile(r"(.*\.experts\.)(\d+)(\..*)")  # model/moe.py's mlp.experts.{e}.*: the expert's global index


@dataclass(frozen=True)
class Home:
    """Parameter `slot.name`'s place: `slot` of `layout`, TP-split by `tp_slice` (None: whole on every TP rank), under
    the state keys prefixed `prefix`; `ep_rank`: the EP rank whose block holds it (None: a parameter of the flat
    layout). `world_rank` says which shard holds a DP rank's chunk of it at a TP index."""

    layout: ShardLayout
    slot: ParamSlot
    tp_slice: TPSlice | None
    prefix: str
    tp: int
    ep: int = 1
    ep_rank: int | None = None

    def world_rank(self, dp_rank: int, tp_rank: int) -> int:
        """The world rank whose shard holds DP rank `dp_rank`'s chunk of `layout` at TP index `tp_rank` (for an expert
        `dp_rank` is its replica: its rank in its EP rank's replica group)."""
        if self.ep_rank is None:
            return dp_rank * self.tp + tp_rank
        return expert_shard_rank(dp_rank, self.ep_rank, tp_rank, self.ep, self.tp)


def expert_shard_rank(replica: int, ep_rank: int, tp_rank: int, ep: int, tp: int) -> int:
    """The world rank whose shard holds replica `replica`'s chunks of EP rank `ep_rank`'s experts at TP index
    `tp_rank`: DP rank replica x E + ep_rank (the replica group of an EP rank: every E-th DP rank), TP-adjacent
    ranks (world rank = DP rank x T + TP rank)."""
    return (replica * ep + ep_rank) * tp + tp_rank


class CheckpointHomes:
    """Every parameter of a checkpoint by global name: its Home, and its full shape (`shapes`, in layout order).
    `tp_slices`: the flat layout's (the experts' are their Homes')."""

    def __init__(self, layout: ShardLayout, tp_slices: dict[str, TPSlice], tp: int,
                 expert_layout: ShardLayout | None = None, ep: int = 1, per_rank: int = 0,
                 expert_tp_slices: dict[str, TPSlice] | None = None):
        self.layout, self.tp_slices, self.tp = layout, tp_slices, tp
        self.expert_layout, self.ep, self.per_rank = expert_layout, ep, per_rank
        self.expert_tp_slices = expert_tp_slices or {}  # by EP rank 0's names: every EP rank's experts split alike
        self._homes = {s.name: Home(layout, s, tp_slices.get(s.name), "", tp) for s in layout.slots}
        self.shapes = full_shapes(layout, tp_slices)
        if expert_layout is None:
            return
        local = {s.name: s for s in expert_layout.slots}
        self.shapes.update(expert_shapes(expert_layout, self.expert_tp_slices, ep, per_rank))
        for name in expert_names(expert_layout, ep, per_rank):
            ep_rank, local_name = expert_home(name, per_rank)
            self._homes[name] = Home(expert_layout, local[local_name], self.expert_tp_slices.get(local_name),
                                     EXPERT_PREFIX, tp, ep, ep_rank)

    @classmethod
    def of(cls, manifest: dict, path: str) -> "CheckpointHomes":
        """The homes of the checkpoint at `path` (its manifest read); CheckpointError if its layouts do not make
        them. A reader builds them once per checkpoint and asks them for every parameter."""
        ep = ep_of(manifest)
        experts = (expert_layout_of(manifest, path), ep, experts_per_rank(manifest, path),
                   tp_slices_of(manifest, EXPERT_TP_SLICES)) if ep > 1 else ()
        return cls(layout_of(manifest, path), tp_slices_of(manifest), mesh_of(manifest)[0], *experts)

    def home(self, name: str) -> Home:
        return self._homes[name]

    def step_key(self, prefix: str) -> str:
        """The key of the step count for the state keys prefixed `prefix` of a new shard: the expert engine's own
        where the checkpoint has one, else the one engine's."""
        return prefix + "step" if prefix and self.expert_layout is not None else "step"


def full_shapes(layout: ShardLayout, slices: dict[str, TPSlice]) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape in the full model, by name (a split parameter's full shape, not its slice's)."""
    return {s.name: tuple(slices[s.name].full_shape) if s.name in slices else s.shape for s in layout.slots}


def shard_parts(engine) -> list[tuple[str, object]]:
    """(key prefix, ZeRO engine group) of each shard a rank's file holds: the engine's; with --ep, under expert_ keys,
    its expert group's too (its block of experts over its replica group)."""
    return list(zip(("", EXPERT_PREFIX), engine.parts))


def engine_shapes(engine) -> dict[str, tuple[int, ...]]:
    """The full model `engine` trains, by global name: its parameters' full shapes and, with --ep, every EP rank's
    experts (this rank's block, the index shifted to each block; full shapes under TP), so that it compares with
    CheckpointHomes.shapes."""
    shapes = {}
    for prefix, part in shard_parts(engine):
        if not prefix:
            shapes.update(full_shapes(part.layout, part.tp_slices))
            continue
        per_rank, ep = engine.experts_per_rank, engine.mesh.ep_size
        for name, shape in full_shapes(part.layout, part.tp_slices).items():
            head, index, tail = _EXPERT.fullmatch(name).groups()
            shapes.update({f"{head}{int(index) % per_rank + e * per_rank}{tail}": shape for e in range(ep)})
    return shapes


def expert_shapes(layout: ShardLayout, slices: dict[str, TPSlice], ep: int, per_rank: int) -> dict[str, tuple]:
    """Every EP rank's experts' full shapes by global name, from EP rank 0's expert layout and TP slices."""
    full = full_shapes(layout, slices)
    return {name: full[expert_home(name, per_rank)[1]] for name in expert_names(layout, ep, per_rank)}


def expert_numel(manifest: dict) -> int | None:
    """An expert-parallel checkpoint's expert shard length (each rank's), or None."""
    return manifest["expert_layout"]["shard_numel"] if "expert_layout" in manifest else None


def expert_layout_of(manifest: dict, path: str) -> ShardLayout:
    """An --ep checkpoint's expert layout (EP rank 0's, over its replica group) as a ShardLayout."""
    try:
        return ShardLayout.from_dict(manifest["expert_layout"])
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: written with --ep "
                              f"{ep_of(manifest)}, its expert_layout does not describe a ShardLayout "
                              f"({e})") from None


def experts_per_rank(manifest: dict, path: str) -> int:
    """The experts of each MoE layer an EP rank holds: the manifest's `experts_per_rank`, or (a checkpoint written
    before it was recorded) the model's n_experts over --ep."""
    per_rank = manifest.get("experts_per_rank")
    if per_rank is None:
        n = ((manifest.get("config") or {}).get("model") or {}).get("n_experts")
        per_rank = n // ep_of(manifest) if isinstance(n, int) else None
    if not isinstance(per_rank, int) or isinstance(per_rank, bool) or per_rank < 1:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: written with --ep {ep_of(manifest)}, it says "
                              f"not how many experts each EP rank holds (experts_per_rank {per_rank!r})")
    return per_rank


def expert_home(name: str, per_rank: int) -> tuple[int, str]:
    """(EP rank, name in EP rank 0's expert layout) of expert parameter `name` (its global Hugging Face name): EP rank
    e holds the experts [e x per_rank, (e + 1) x per_rank) of each MoE layer, laid out as EP rank 0's are."""
    head, index, tail = _EXPERT.fullmatch(name).groups()
    ep_rank, local = divmod(int(index), per_rank)
    return ep_rank, f"{head}{local}{tail}"


def expert_names(layout: ShardLayout, ep: int, per_rank: int) -> list[str]:
    """Every EP rank's expert parameters by global name, each MoE layer's experts in index order: EP rank 0's names
    (`layout`'s) with the index shifted by e x per_rank for EP rank e. CheckpointError if EP rank 0's layout does
    not hold per_rank experts of each layer, numbered from 0."""
    layers: dict[str, list[tuple[str, str, str]]] = {}  # a MoE layer's prefix -> its slots' (head, index, tail)
    for slot in layout.slots:
        match = _EXPERT.fullmatch(slot.name)
        if match is None:
            raise CheckpointError(f"the expert layout holds {slot.name}, not an expert's parameter")
        layers.setdefault(match.group(1), []).append(match.groups())
    out = []
    for head, slots in layers.items():
        held = sorted({int(index) for _, index, _ in slots})
        if held != list(range(per_rank)):
            raise CheckpointError(f"the expert layout holds experts {held} of {head.rstrip('.')}, EP rank 0 holds "
                                  f"experts 0 to {per_rank - 1}")
        out += [f"{h}{int(i) + e * per_rank}{t}" for e in range(ep) for h, i, t in slots]
    return out


def same_expert_layout(homes: CheckpointHomes, engine) -> bool:
    """Whether `engine`'s expert shard loads as the checkpoint's own is (the same EP degree, replica group size,
    expert layout and TP slices, its names EP rank 0's); True for two runs without --ep."""
    parts = dict(shard_parts(engine))
    mine = parts.get(EXPERT_PREFIX)
    if mine is None or homes.expert_layout is None:
        return mine is None and homes.expert_layout is None
    old = homes.expert_layout
    local = [(expert_home(s.name, engine.experts_per_rank)[1], s.shape, s.offset, s.bucket) for s in mine.layout.slots]
    return (homes.ep == engine.mesh.ep_size and homes.per_rank == engine.experts_per_rank
            and old.world_size == mine.layout.world_size and old.buckets == mine.layout.buckets
            and local == [(s.name, s.shape, s.offset, s.bucket) for s in old.slots]
            and {expert_home(n, engine.experts_per_rank)[1]: s for n, s in mine.tp_slices.items()}
            == homes.expert_tp_slices)

