"""What each part of a run's parallelism holds, gathers and reads, answered before the run from its settings.

The planners ask `parts_for(cfg)`, the one place outside the engine that reads the stage number; each part, and how a
new one joins: docs/design.md, "The plan-time parts".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from zerotrain.config import Config

from .context import context_parallel_rows
from .gradients import keeps_autograd_grads, stage2_bucket_budget
from .layout import ShardLayout
from .engine import PLACEMENTS
from .params import Placement
from .sharded_adamw import MOMENT_BYTES, state_bytes_per_value


class GradientHolding:
    """How a rank holds gradients, before the run, as GradientReducer does (docs/design.md, "The plan-time parts"; on
    one rank in fp32 autograd's own gradients, keeps_autograd_grads), and its words for them."""

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
    placement = PLACEMENTS[p.zero](p.bucket_numel, p.dp_replicate)  # the class the engine builds, for the plan
    gradients = GradientHolding(p.zero, p.precision, p.tp, cfg.loop.accum, cfg.grad_reduce)
    more = context_parallel_rows(p.cp) + ([HybridSharding(p.dp_replicate)] if p.dp_replicate > 1 else [])
    return RunParts(placement, gradients, ShardedAdamW(p.precision), ExpertParallel(p.ep) if p.ep > 1 else None,
                    more)
