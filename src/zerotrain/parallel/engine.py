"""The ZeRO engine, one algorithm at stages 1, 2 and 3: flat layout, buckets, reduce-scatter, AdamW.

The trained parameters are laid out in one flat buffer. The flat buffer is cut into buckets; each bucket is padded
to a multiple of W x 256 (so that each rank's part is whole chunks of the gradient norm's grid, grad_norm.py) and
split into W equal chunks, and rank r owns chunk r of every bucket. Per optimizer step:

    reduce-scatter each bucket's gradients -> this rank's gradient shard  (one round, per bucket)
    one all-reduce of a few scalars       -> global grad norm (clipping; grad_norm.py), loss, flags
    torch.optim.AdamW on the owned chunks  -> updated master values
    the parameters follow                  -> stages 1 and 2: all-gather each bucket in place (one round, per bucket);
                                              stage 3: each unit gathered from the shards when next used

Communication can hide behind compute, each half on its own switch: with `reduce_in_backward` each
bucket's reduce-scatter starts in backward as soon as its gradients are complete; with `overlap_gathers` the
parameters' gathers run behind compute: at stages 1 and 2 the all-gather runs behind the next forward
(`gather_behind_forward`: the buckets are launched in forward order and each module's forward pre-hook waits only for
the buckets holding its own parameters), at stage 3 the next unit's gather is prefetched one unit ahead. Whatever reads parameters outside forward calls `wait_params()` first (the
engine's own readers do).

With tensor parallelism (a `Mesh` with tp > 1) the model holds this rank's TP slices and the
replicated parameters; the flat buffer holds exactly those, and all of the above runs over the DP
group (the ranks holding the same slices: the mesh's shard group). The scalar all-reduce spans the world: the gradient norm
counts each TP slice once (every rank its own; a KV head on several TP ranks, its first rank's) and each
replicated value once (TP rank 0's copy).

With hybrid sharding (--dp-replicate R, FSDP2's HSDP; mesh.py) `dp` is the shard group, W / (R x TP) ranks: all of
the above runs within it, and once the window's reduce-scatters are done the gradient shard is all-reduced across the
R replica groups (all_reduce_replicas: one all-reduce of the shard a step), so that every group holds the whole
batch's gradient and takes the same AdamW step. Replica group 0 alone adds its squares to the norm (each value once).

How gradients are held is the stage's too, in a part of its own (gradients.py's GradientReducer): stage 1 keeps full
gradients, stages 2 and 3 buckets reduced in backward, each reduce-scattered into this rank's fp32 shard; it computes
this rank's share of the norm. The optimizer is a part of its own (sharded_adamw.py's AdamWShard): AdamW on the owned
chunks, its masters and moments, the state a checkpoint stores. The engine composes them with its placement and the
plan-time answers of its parts (parts.py), and calls each at fixed points of the step.

Where the parameters live is the stage's (params.ParameterPlacement): at stages 1 and 2 every rank holds the whole
flat buffer and all-gathers it after each update (replicated.py); at stage 3 a rank holds its owned chunks only and
each unit's buckets are gathered while it runs (sharded.py), whose reductions start by units (schedule_by_units). The
engine calls its placement at fixed points and never asks which stage it has for that; what it does ask the stage
number is how gradients are held: whole (stage 1) or in buckets reduced in backward (stages 2 and 3).

The flat buffer holds the parameters that train: a LoRA run's adapters alone. Frozen parameters (its base) keep
their own tensors (stage 3 shards them too: sharded.py), have no gradients or optimizer state and are never reduced;
invariant (b) checks them too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from zerotrain.config import OptimConfig
from zerotrain.model import is_decayed

from . import grad_norm
from .comm import Comm
from .gradients import GradientReducer
from .layout import ShardLayout
from .mesh import Mesh
from .params import ParameterPlacement, frozen_parameters, trainable_parameters
from .parts import Placement, ReplicatedPlacement, ShardedPlacement
from .replicated import ReplicatedParameters
from .sharded import ShardedParameters
from .sharded_adamw import AdamWShard
from .tp_slices import full_tensors

__all__ = ["ZeroEngine", "layout_of"]


def layout_of(model: torch.nn.Module, world_size: int, bucket_numel: int, select=None) -> ShardLayout:
    """The flat layout an engine over `model` uses (a model on the meta device gives the same one): its trainable
    parameters (those `select(name)` takes, where given); frozen ones (a LoRA run's base) have no gradients, no
    optimizer state and are never reduced."""
    named = trainable_parameters(model, select)  # a tied parameter appears once
    return ShardLayout.build([(n, tuple(p.shape), is_decayed(n, p)) for n, p in named], world_size, bucket_numel)


# Where each stage keeps its parameters (params.ParameterPlacement), and that placement's answers (parts.py)
PLACEMENTS = {1: (ReplicatedParameters, ReplicatedPlacement), 2: (ReplicatedParameters, ReplicatedPlacement),
              3: (ShardedParameters, ShardedPlacement)}


class ZeroEngine:
    """ZeRO over a model: call backward inside `no_sync(...)` as needed, then `reduce_grads` and `apply`."""

    def __init__(
        self,
        model: torch.nn.Module,
        dp: Comm,
        optim: OptimConfig,
        *,
        bucket_numel: int,
        precision: str = "fp32",
        reduce_in_backward: bool = True,
        overlap_gathers: bool = True,
        mesh: Mesh | None = None,
        stage: int = 1,
        grad_reduce: str = "step",
        init=None,
        device: torch.device | str | None = None,
        select=None,
    ):
        """ZeRO stage `stage` (1, 2 or 3) shards over `dp`: `mesh`'s shard group when there is one (with hybrid
        sharding, the gradient shard is then all-reduced across its replica groups, mesh.dp_replicate).

        `overlap_gathers` must be False for a compiled model, whose forward cannot wait midway; at stage 3 it
        prefetches the next unit's gather one unit ahead (--overlap on), and stage 3 always reduces in backward
        (`reduce_in_backward` is stages 1's and 2's). `grad_reduce` "micro-batch" (stages 2 and 3) reduce-scatters
        every micro-batch's buckets into the shard, which accumulates. A model built on the meta device
        (model.meta_model) is filled straight into the placement's buffers on `device` from `init` (model/init.py's
        SeedValues, or --init-from's FileValues): at stages 1 and 2 one parameter at a time, at stage 3 only the
        ranges this rank owns; a model with values keeps them (every rank's must be equal: nothing is broadcast).

        `select(name)`: the trained parameters this engine holds (all by default). Expert parallelism
        (parallel/experts.py) runs two engines over one model: the dense parameters, and the experts over their own
        group; the frozen parameters are the engine's that holds everything or the dense one's.
        """
        self.model, self.dp, self.optim_cfg = model, dp, optim
        self.mesh = mesh or Mesh.single(dp)
        self.precision, self.stage = precision, stage
        # stages 1 and 2: the all-gather after an update runs behind the next forward (stage 3: its placement's prefetch)
        self.gather_behind_forward = overlap_gathers and stage < 3
        self.layout = layout_of(model, dp.world_size, bucket_numel, select)
        self.select = select
        by_name = dict(model.named_parameters())
        self.params = [by_name[s.name] for s in self.layout.slots]
        self.slot_of = {id(p): s for s, p in zip(self.layout.slots, self.params)}
        # name -> TPSlice of the trained parameters this engine holds split by TP; the frozen ones' (model_slices) only
        # for invariant (b)
        self.model_slices = getattr(model, "tp_slices", {})
        self.tp_slices = {n: s for n, s in self.model_slices.items() if n in by_name and by_name[n].requires_grad
                          and (select is None or select(n))}
        self.frozen = [(n, p) for n, p in frozen_parameters(model) if select is None or select(n)]
        self._init, self.device = init, torch.device(device) if device is not None else self.params[0].device
        placement, part = PLACEMENTS[stage]
        self.placement: ParameterPlacement = placement(self, bucket_numel=bucket_numel, overlap_gathers=overlap_gathers)
        # What the placement answers the loop (holds_whole_model, gathers_units, computed_norms): the plan's own part
        self.placement_part: Placement = part(bucket_numel, replicas=self.mesh.dp_replicate_size)
        # this rank's parameter values in the flat layout: the whole buffer at stages 1 and 2, its shard at stage 3
        self.held_params = self.placement.held_params
        # What building this rank's buffers took from the source: bytes read from --init-from's files, values drawn
        # from the seed (the run's init_bytes_read and init_values_drawn, per rank)
        self.init_bytes_read = getattr(init, "bytes_read", 0)
        self.init_values_drawn = getattr(init, "values_drawn", 0)
        self._init = None  # the source is read only while the buffers are built
        self.sliced_ranges, self.replicated_ranges = self._split_by_tp(self.layout.slots)
        # KV heads held by several TP ranks (more TP ranks than KV heads): checked across those ranks, and counted
        # in the norm by the first of them only.
        t = self.mesh.tp_rank
        self.kv_shared_ranges = self._split_by_tp([s for s in self.layout.slots if s.name in self.tp_slices
                                                   and self.tp_slices[s.name].holders(t) > 1])[0]
        # The gradients (their hooks registered before the placement's: ParameterPlacement.attach), then AdamW over
        # their shard
        self.grads = GradientReducer(self, grad_reduce=grad_reduce, reduce_in_backward=reduce_in_backward,
                                     counted_ranges=self._counted_ranges())
        self.adamw = AdamWShard(self, self.grads, optim)
        self.placement.attach()

    @property
    def holds_whole_model(self) -> bool:
        """Whether every replica computes with the same whole model (its digests compare before step 1)."""
        return self.placement_part.holds_whole_model

    @property
    def gathers_units(self) -> bool:
        """Whether each unit's parameters are freed and gathered again every step."""
        return self.placement_part.gathers_units

    def computed_norms(self, norms: list[float]) -> list[float]:
        """The norm of the parameters each world rank computes with, from each rank's param_norm (all gathered)."""
        return self.placement_part.computed_norms(norms, self.mesh.tp_size)

    def initial_value(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """Parameter `name`'s initial values on this rank (its TP slice): from the init source for a model on the meta
        device, else its own. For the placement, while it builds its buffers.

        Nothing is broadcast (a DDP-style broadcast of rank 0's values would be a whole model of traffic at start-up,
        and would hide an init that depends on the rank): every rank computes, or reads, the same values.
        """
        return self._init.values(name, tuple(p.shape)) if p.is_meta else p.detach()

    def initial_range(self, name: str, p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Values [lo, hi) of parameter `name`'s initial values on this rank flattened: from the init source, which
        reads or draws that range alone, for a model on the meta device, else from its own."""
        return self._init.flat_values(name, tuple(p.shape), lo, hi) if p.is_meta else p.detach().reshape(-1)[lo:hi]

    def _counted_ranges(self) -> list[tuple[int, int]]:
        """The shard ranges whose squared gradients this rank adds to the global norm under TP: its TP slices (a KV
        head held by several TP ranks, by the first of them only) and, on TP rank 0 alone, the replicated values."""
        t = self.mesh.tp_rank
        counted = self._split_by_tp([s for s in self.layout.slots if s.name in self.tp_slices
                                     and self.tp_slices[s.name].first_holder(t) == t])[0]
        return self._owned(counted) + (self._owned(self.replicated_ranges) if t == 0 else [])

    def _split_by_tp(self, slots) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The flat buffer's ranges of TP-sliced values and of the rest (replicated values and padding)."""
        cuts = sorted((s.offset, s.offset + s.numel) for s in slots if s.name in self.tp_slices)
        sliced, replicated, at = [], [], 0
        for lo, hi in cuts:
            if lo > at:
                replicated.append((at, lo))
            if sliced and sliced[-1][1] == lo:
                sliced[-1] = (sliced[-1][0], hi)
            else:
                sliced.append((lo, hi))
            at = hi
        if at < self.layout.padded_numel:
            replicated.append((at, self.layout.padded_numel))
        return sliced, replicated

    def _owned(self, flat_ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The parts of `flat_ranges` this rank owns, as ranges of its shard."""
        out = []
        for b in self.layout.buckets:
            lo, hi = b.chunk(self.dp.rank, self.dp.world_size)
            for a, z in flat_ranges:
                a, z = max(a, lo), min(z, hi)
                if z > a:
                    out.append((b.shard_offset + a - lo, b.shard_offset + z - lo))
        return out


    # ---------------------------------------------------------------- backward side: the gradients' part
    def no_sync(self, enabled: bool = True):
        """Within this context, backward accumulates gradients locally and communicates nothing (GradientReducer's).

        Use it for every micro-batch but the last of an accumulation window, as with DDP.
        """
        return self.grads.no_sync(enabled)

    def zero_grad(self) -> None:
        """Start a new accumulation window."""
        self.grads.zero_grad()

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.grads.grad_tensors()

    def grad_bytes(self) -> int:
        return self.grads.grad_bytes()

    @property
    def grad_peak_bytes(self) -> int:
        """The most gradient bytes held at once so far, buckets included."""
        return self.grads.grad_peak_bytes

    # ---------------------------------------------------------------- optimizer side
    def reduce_grads(self, extras: torch.Tensor | Callable[[], torch.Tensor],
                     beside=()) -> tuple[torch.Tensor, torch.Tensor]:
        """Finish the gradient reduce-scatter; all-reduce [the gradient norm's exact partial sum, *extras] in one call.

        Returns the global pre-clip gradient norm (grad_norm.py: the same bits at every world size; 0-d float64) and
        the extras summed over ranks, both on the device and unread (the loop reads them at its log steps). `extras` may be a function, called once the reduce-scatter is finished (the control flags
        are read as late as they can be: a rank waiting there for a slower one can still start a stop's save).
        `beside`: engines over the other parameters of the model (expert parallelism's), whose reductions finish
        here and whose squared gradients join this rank's partial sum.
        """
        squares = torch.cat([self.grads.finish_grads().reshape(-1),
                             *(e.grads.finish_grads().reshape(-1).to(self.device) for e in beside)])
        limbs = grad_norm.exact_sum_limbs(squares)
        extras = (extras() if callable(extras) else extras).to(self.device, torch.float64).reshape(-1)
        stats = self.mesh.world.all_reduce(torch.cat([limbs.to(self.device), extras]), "all_reduce_stats")
        return grad_norm.norm_tensor(stats[: grad_norm.N_VALUES]), stats[grad_norm.N_VALUES :]

    def apply(self, lr: float, grad_norm: torch.Tensor | float) -> None:
        """Clip by the global norm (on the device), AdamW on this rank's shard, and the parameters follow (the placement's
        after_update: stages 1 and 2 all-gather every bucket, stage 3 gathers each unit when next used).

        With `gather_behind_forward` the all-gather is still in flight on return (see `wait_params`).
        """
        self.placement.before_update()  # AdamW writes the owned chunks, which an unfinished all-gather may be sending
        self.adamw.step(lr, grad_norm)
        self._publish_params(wait=not self.gather_behind_forward)

    def _publish_params(self, wait: bool = True) -> None:
        """The owned values updated (or loaded): in bf16 the fp32 masters rounded into them, then the placement's
        after_update (the all-gather of every bucket at stages 1 and 2)."""
        self.adamw.round_into_params()
        self.placement.after_update(wait)

    def register_update_pre_hook(self, hook) -> None:
        """`hook()` runs before every update of this engine's state (AdamW's step on its shard)."""
        self.adamw.register_update_pre_hook(hook)

    def param_norm(self) -> torch.Tensor:
        """The L2 norm of the parameters this rank holds (at ZeRO-3 its shard), float64 [1]."""
        return torch.linalg.vector_norm(self.held_params.float()).reshape(1).to(torch.float64)

    @property
    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat parameter buffers this rank holds."""
        return [self.held_params]

    def wait_params(self, buckets=None) -> None:
        """Finish the parameter all-gathers still in flight: those of `buckets`, or all of them."""
        self.placement.wait(buckets)

    # ---------------------------------------------------------------- state
    def param_digests(self) -> torch.Tensor:
        """Digests of [replicated parameters, this rank's TP slices], one row each, (with KV heads on several TP
        ranks, a third row: this rank's slices of them): equal rows mean bitwise equal values (digest.tensor_digest).
        Replicated rows must match on every rank, sliced rows across each DP group, KV rows across each KV group.
        Without TP everything is in the first row. Each stage digests where its parameters live (its placement)."""
        return self.placement.digests()

    @property
    def param_peak_bytes(self) -> int:
        """The most parameter bytes held at once so far (stage 3: the shard and the units whole)."""
        return self.placement.param_peak_bytes

    def param_bytes(self) -> int:
        """Parameter bytes held now."""
        return self.placement.param_bytes()

    def frozen_bytes(self) -> int:
        """Bytes this rank holds for the frozen parameters (a LoRA run's base): each whole at stages 1 and 2, its
        shard of them at stage 3."""
        return self.placement.frozen_bytes()

    # ---------------------------------------------------------------- optimizer state: the sharded AdamW's
    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        return self.adamw.optimizer_state_tensors()

    def expected_state_bytes(self) -> int:
        return self.adamw.expected_state_bytes()

    def expected_state_bytes_per_value(self) -> int:
        return self.adamw.expected_state_bytes_per_value()

    def master_shard(self) -> torch.Tensor:
        return self.adamw.master_shard()

    def master_views(self) -> list[torch.Tensor]:
        """This rank's fp32 master values where they lie (AdamWShard.master_views). Call wait_params() first."""
        return self.adamw.master_views()

    @property
    def step_count(self) -> int:
        return self.adamw.step_count

    def shard_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shard: its masters (an independent copy in fp32), moments and step count."""
        return self.adamw.state_dict()

    def load_shard_state_dict(self, sd: dict) -> None:
        """Restore this rank's shard (same layout), then the parameters follow the masters. `sd["master"]` may be
        given as its parts in shard order, as master_views() gives them: a resume reads a checkpoint's shard into
        master_views(), exp_avg and exp_avg_sq where they lie and hands those in (a view copied onto itself is not
        copied)."""
        self.adamw.check_shard(sd)
        self.placement.before_update()
        with torch.no_grad():
            self.adamw.load_state_dict(sd)
            self._publish_params()

    @property
    def param_count(self) -> int:
        """Parameters of the full model (each TP-sliced tensor counted at its full size)."""
        return sum(math.prod(self.tp_slices[s.name].full_shape) if s.name in self.tp_slices else s.numel
                   for s in self.layout.slots)

    def gathered_flat(self) -> torch.Tensor:
        """The whole padded flat buffer of parameters (at stage 3 gathered a bucket at a time: a collective of the DP
        group)."""
        return self.placement.gathered_flat()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's parameters in its state_dict names, fp32 on the CPU, one independent tensor each.

        A collective: with TP the split tensors are gathered from the TP group, at stage 3 the buckets from the DP
        group.
        """
        return self.full_tensors(self.gathered_flat())

    def full_tensors(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The full model's tensors, by name, fp32 on the CPU, from a buffer in this rank's flat layout.

        The split tensors are gathered from every rank of the TP group, which all call this together.
        """
        ranks = self.gather_tp(flat, "all_gather_tp_state").float().cpu().chunk(self.mesh.tp_size)
        return {name: t.clone() for name, t in full_tensors(self.layout, self.tp_slices, ranks).items()}

    def gather_tp(self, flat: torch.Tensor, purpose: str) -> torch.Tensor:
        """Every TP rank's buffer in this rank's flat layout, concatenated in TP rank order (`flat` itself without TP).

        A collective of this rank's TP group.
        """
        T = self.mesh.tp_size
        if T == 1:
            return flat.detach()
        gathered = torch.empty(T * self.layout.padded_numel, dtype=flat.dtype, device=flat.device)
        self.mesh.tp.all_gather(gathered, flat.detach().contiguous(), purpose)
        return gathered

