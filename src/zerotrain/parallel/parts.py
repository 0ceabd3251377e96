"""What each part of a run's parallelism holds, gathers and reads, answered before the run from its settings.

The planners ask `parts_for(cfg)`, the one place outside the engine that reads the stage number; each part, and how a
new one joins: docs/design.md, "The plan-time parts".
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from zerotrain.config import Config

from .context import context_parallel_rows
from .gradients import keeps_autograd_grads, stage2_bucket_budget
from .layout import ShardLayout
from .params import frozen_parameters
from .sharded_adamw import MOMENT_BYTES, state_bytes_per_value
from .units import frozen_layout_of, units_whole_bytes


class Placement:
    """Where a run's parameters live, before the run: what a rank holds of the trained and frozen parameters, what
    it gathers and when, what it reads at start-up, the norm of what it computes with, and its words for them."""

    holds_whole_model: bool  # replicas compute with the same whole model: their digests compare before step 1
    gathers_units: bool  # each unit's parameters freed and gathered again every step (the allocator's choice)
    read_how: str  # what a rank reads (and draws) at start-up, in `zerotrain plan`'s words
    drawn_how: str

    def __init__(self, bucket_numel: int, replicas: int = 1) -> None:
        self.bucket_numel = bucket_numel  # the frozen base's layout is bucketed as the trained parameters' are
        self.replicas = replicas  # --dp-replicate R: the replica groups, each holding the whole sharded state


class ReplicatedPlacement(Placement):
    """ZeRO-1 and 2: every rank holds every parameter of its TP slice whole (the trained ones in the flat buffer, the
    frozen ones in their own tensors) and all-gathers the buffer after each update."""

    holds_whole_model = True
    gathers_units = False  # nothing is freed and gathered again within a step: the heap serves the next step
    read_how = drawn_how = "its TP slice of every parameter"

    def held(self, whole: int, owned: int) -> int:
        """Of values a rank owns `owned` of, the ones it holds between steps: all of them."""
        return whole

    def frozen_numel(self, model: torch.nn.Module, dp: int) -> int:
        return sum(p.numel() for _, p in frozen_parameters(model))  # whole, in their own tensors

    def units_whole_bytes(self, model, layout, element_size, prefetch, beside=None) -> int:
        return 0  # no unit is gathered: every parameter is whole all along

    def copy_numel(self, model: torch.nn.Module, layout: ShardLayout) -> int:
        """A frozen copy of the model (DPO's live reference): its parameters, unpadded (a tied head once)."""
        return sum(p.numel() for p in model.parameters())

    def read_rows(self, layout: ShardLayout, dp_rank: int) -> list[tuple[int, int]]:
        """(values read, values drawn or owned) per parameter at start-up: its TP slice of every parameter."""
        return [(s.numel, s.numel) for s in layout.slots]

    def computed_norms(self, norms: list[float], tp_size: int) -> list[float]:
        """The norm of the parameters each world rank computes with, from each rank's norm of what it holds: those."""
        return norms

    def notes(self, bf16: bool, prefetch: bool) -> dict[str, str]:
        """`zerotrain plan`'s words for the placement's rows."""
        size = 2 if bf16 else 4
        return {"params": f"P x {size}", "units": "none: every parameter is held whole (ZeRO-3 gathers units)",
                "frozen": "", "copy": f"M x {size}, M unpadded"}


class ShardedPlacement(Placement):
    """ZeRO-3: a rank holds its owned chunks of the trained parameters and of the frozen ones (in a layout of their
    own), and gathers each unit for its forward and its backward."""

    holds_whole_model = False  # each rank holds its shard: no rank computes with a model it holds whole
    gathers_units = True  # each unit's parameters freed and gathered again every step
    read_how, drawn_how = "the rows of its owned ranges", "its owned values"

    def held(self, whole: int, owned: int) -> int:
        return owned

    def frozen_numel(self, model: torch.nn.Module, dp: int) -> int:
        return frozen_layout_of(model, dp, self.bucket_numel).shard_numel

    def units_whole_bytes(self, model, layout, element_size, prefetch, beside=None) -> int:
        """The most parameter bytes whole at once beyond the shard (units.units_whole_bytes), the frozen base's
        buckets among them; `beside`: the expert group's layout, whose buckets are whole with the units'."""
        frozen = frozen_layout_of(model, layout.world_size, self.bucket_numel)
        return units_whole_bytes(model, layout, element_size, prefetch=prefetch, frozen=frozen, beside=beside)

    def copy_numel(self, model: torch.nn.Module, layout: ShardLayout) -> int:
        """Sharded as the policy (frozen_copy.shard_frozen_copy): its shard of the policy's layout."""
        return layout.shard_numel

    def read_rows(self, layout: ShardLayout, dp_rank: int) -> list[tuple[int, int]]:
        """Its owned ranges widened to whole rows, as FileValues reads them (a range that cuts a row reads it)."""
        out = []
        for s in layout.slots:
            width = math.prod(s.shape[1:])  # a 1-D tensor's rows are its values
            owned = [(max(p.start, s.offset), min(p.end, s.offset + s.numel))
                     for p in layout.owned_pieces(dp_rank, s.offset, s.offset + s.numel)]
            owned = [(a - s.offset, z - s.offset) for a, z in owned if z > a]
            if owned:
                rows = sum(-(-z // width) - a // width for a, z in owned)
                out.append((rows * width, sum(z - a for a, z in owned)))
        return out

    def computed_norms(self, norms: list[float], tp_size: int) -> list[float]:
        """Each rank holds its shard: what it computes with is its shard group's shards together, the ranks of its
        replica group with its TP index (world rank (g S + s) T + t); another replica group holds copies of them."""
        group = len(norms) // self.replicas  # S x T world ranks a replica group
        return [math.sqrt(sum(n * n for q, n in enumerate(norms)
                              if q % tp_size == r % tp_size and q // group == r // group))
                for r in range(len(norms))]

    def notes(self, bf16: bool, prefetch: bool) -> dict[str, str]:
        size = 2 if bf16 else 4
        return {"params": f"shard x {size} (this rank's chunks{'' if bf16 else ': the fp32 masters'})",
                "units": (f"the root unit and the largest "
                          f"{'two neighbouring units (prefetch: --overlap)' if prefetch else 'other unit'} "
                          f"(blocks; an untied head's embedding, final norm with head), gathered x {size}"),
                "frozen": " / DP (ZeRO-3: its shard, gathered with the units)",
                "copy": f"shard x {size}, its units gathered as the policy's are not"}


class GradientHolding:
    """How a rank holds gradients, before the run, as GradientReducer does: ZeRO-1 a full gradient buffer (in bf16
    with an fp32 accumulator) reduce-scattered once a step into the shard, on one rank in fp32 autograd's own
    gradients (keeps_autograd_grads); ZeRO-2 and 3 (`bucketed`) the fp32 shard between steps, full-size buckets only
    in flight: each micro-batch's (at --accum 1, or --grad-reduce micro-batch) through the two largest buckets, else
    every bucket kept through the accumulation window. And its words for them."""

    def __init__(self, stage: int, precision: str, tp: int, accum: int, grad_reduce: str) -> None:
        self.stage, self.precision, self.tp, self.accum, self.grad_reduce = stage, precision, tp, accum, grad_reduce
        self.bucketed = stage >= 2

    def autograd_grads(self, dp: int) -> bool:
        """Whether autograd's own gradients are the gradients (the engine's grads_in_params, its own rule)."""
        return keeps_autograd_grads(self.stage, self.precision, dp, self.tp)

    def held_bytes(self, numel: int, padded: int, shard: int, dp: int, psize: int, shard_ranks: int | None = None) \
            -> int:
        """The gradients a rank holds between steps for `numel` trained values over `dp` DP ranks, `padded` with
        their buckets' padding, `shard` of them its own; `shard_ranks`: the ranks they are sharded over (with
        --dp-replicate R, dp / R), `dp` where not given."""
        if self.bucketed:
            return shard * 4  # the fp32 shard the buckets are reduce-scattered into
        if self.autograd_grads(dp):  # of every DP rank: one rank of R replica groups still all-reduces a buffer
            return numel * 4  # one per parameter: no flat buffer
        # On one shard rank the shard is the fp32 gradient buffer itself (as GradientReducer builds it).
        shards = dp if shard_ranks is None else shard_ranks
        return padded * psize + (padded * 4 if self.precision == "bf16" else 0) + (shard * 4 if shards > 1 else 0)

    def bucket_bytes(self, layout: ShardLayout) -> int:
        """The most bytes of full-size buckets held at once (whole gradients: none beyond them)."""
        per_micro_batch = self.accum == 1 or self.grad_reduce == "micro-batch"  # the two largest buckets in flight
        return 0 if not self.bucketed else stage2_bucket_budget(layout) if per_micro_batch else 4 * layout.padded_numel

    def buckets_hold_less(self, dp: int) -> bool:
        """Whether bucketed gradients (ZeRO-2) would hold less than whole ones: where they free buckets in the
        backward, at accumulation 1 over more than one DP rank (through a window every bucket is kept, and one rank's
        whole gradients are a single buffer already)."""
        return not self.bucketed and self.accum == 1 and dp > 1

    @property
    def reduce_choice(self) -> bool:
        """Whether --grad-reduce chooses anything: with buckets, accumulating (whole gradients: one round a step
        either way)."""
        return self.bucketed and self.accum > 1

    def notes(self, bf16: bool, dp: int) -> dict[str, str]:
        if self.bucketed:
            return {"grads": "shard x 4",
                    "buckets": "two largest buckets x 4" if self.accum == 1 else
                               "two largest buckets x 4 (each micro-batch's reduced into the shard)"
                               if self.grad_reduce == "micro-batch" else "every bucket, through the window"}
        if self.autograd_grads(dp):
            grads = "P x 4 (autograd's own, one per parameter, on one rank: no flat buffer)"
        else:
            grads = (f"P x {2 if bf16 else 4}{' + P x 4 (fp32 accumulator)' if bf16 else ''}"
                     f"{' + shard x 4' if dp > 1 else ' (the shard, on one DP rank)'}")
        return {"grads": grads, "buckets": "none: stage 1 keeps full gradients"}


@dataclass(frozen=True)
class ShardedAdamW:
    """AdamW on the owned values: its two fp32 moments, and in bf16 the fp32 master (sharded_adamw's rule)."""

    precision: str

    @property
    def state_bytes_per_value(self) -> int:
        return state_bytes_per_value(self.precision)

    def moment_bytes(self, owned: int) -> int:
        return owned * MOMENT_BYTES

    def master_bytes(self, owned: int) -> int:
        return owned * (self.state_bytes_per_value - MOMENT_BYTES)


@dataclass(frozen=True)
class ExpertParallel:
    """--ep E: each EP rank's block of experts in a layout of its own over its replica group (DP / E ranks), and one
    MoE layer's all-to-all: N k rows sent, N k received at balanced routing, E N k at most."""

    ep: int

    def replica_ranks(self, dp: int) -> int:
        return dp // self.ep

    def all_to_all_bytes(self, row_bytes: int) -> tuple[int, int]:
        """(sent and received at balanced routing, sent and received where one rank receives its group's every row)
        of one MoE layer, whose rows sent are `row_bytes`."""
        return 2 * row_bytes, (1 + self.ep) * row_bytes


@dataclass(frozen=True)
class HybridSharding:
    """--dp-replicate R (FSDP2's HSDP): the state sharded over each of R replica groups of S = DP / R ranks as ZeRO
    over S ranks would, each gradient shard all-reduced across the R groups once a step; group 0 writes the saves."""

    replicas: int

    def rows(self, **planned) -> dict[str, int]:
        """No memory of its own: the all-reduce runs in place on the gradient shard."""
        return {}

    def traffic(self, layouts: list) -> dict[str, int]:
        """Bytes a rank sends a step by purpose (Comm's names): each fp32 gradient shard's ring all-reduce over the R
        replica groups, 2 (R - 1) / R of it (as Comm.all_reduce counts it, per tensor)."""
        R = self.replicas
        return {"all_reduce_replicas": sum(int(L.shard_numel * 4 * 2 * (R - 1) / R) for L in layouts)}


@dataclass
class RunParts:
    """The parts a run composes, each answering for its own rows, reads and words."""

    placement: Placement
    gradients: GradientHolding
    optimizer: ShardedAdamW
    experts: ExpertParallel | None = None
    more: list = field(default_factory=list)  # parts with rows of their own (context parallelism): `more_rows`

    def shard_ranks(self, dp: int) -> int:
        """The ranks the flat layout is split over: every DP rank, or with hybrid sharding (--dp-replicate R, the
        placement's replicas) its replica group's, DP / R."""
        return dp // self.placement.replicas

    def writes_shard(self, dp_rank: int, dp: int) -> bool:
        """Whether DP rank `dp_rank` writes (and with --async-save stages) its shard at a save: replica group 0's
        ranks, every rank without hybrid sharding."""
        return dp_rank < self.shard_ranks(dp)

    def traffic(self, layouts: list) -> dict[str, int]:
        """The bytes a rank sends a step that the parts to come add, by purpose: each such part's `traffic`."""
        return _summed(part.traffic(layouts) for part in self.more)

    def more_rows(self, **planned) -> dict[str, int]:
        """The bytes the parts to come add to the memory plan's rows, by row: each such part's `rows(**planned)`."""
        return _summed(part.rows(**planned) for part in self.more)


def _summed(answers) -> dict[str, int]:
    """The parts' answers added up by key (a key that answers 0 kept)."""
    out: Counter[str] = Counter()
    for answer in answers:
        out.update(answer)
    return dict(out)


def parts_for(cfg: Config) -> RunParts:
    """The parts `cfg`'s run composes: the one place outside the engine that turns the ZeRO stage into parts."""
    p = cfg.parallel
    placement = (ShardedPlacement if p.zero == 3 else ReplicatedPlacement)(p.bucket_numel, p.dp_replicate)
    gradients = GradientHolding(p.zero, p.precision, p.tp, cfg.loop.accum, cfg.grad_reduce)
    more = context_parallel_rows(p.cp) + ([HybridSharding(p.dp_replicate)] if p.dp_replicate > 1 else [])
    return RunParts(placement, gradients, ShardedAdamW(p.precision), ExpertParallel(p.ep) if p.ep > 1 else None,
                    more)
