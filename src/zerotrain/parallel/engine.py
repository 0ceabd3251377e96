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

Stage 1 keeps full gradients too, views into one flat gradient buffer; but one rank (one DP rank without TP, in
fp32) has nothing to reduce and keeps no flat gradient buffer: each parameter's gradient is autograd's own tensor,
as in a plain PyTorch loop, read where it is by the norm and AdamW (grads_in_params). Stage 2 keeps no gradients
between steps: backward's gradient of each parameter is added into its bucket's own fp32 buffer, allocated when
the bucket's first gradient arrives, and the parameter's .grad is dropped. In the
backward of the last micro-batch a complete bucket is reduce-scattered into this rank's shard and its buffer freed
once the reduce-scatter is done, so a rank holds its 1/W of the gradients plus the buckets in flight, as many as
fit in the bytes of the two largest buckets: a bucket's buffer, when its first gradient arrives, waits for the
oldest reduce-scatters until it fits (stage 2 reduces in backward whatever `reduce_in_backward` says: holding every
bucket until after backward would be stage 1's memory). With accumulation the buffers stay through the window (one
reduce-scatter round per step, as in stage 1); the additions are the ones stage 1 makes, in the same order, so both
stages compute bitwise the same shard. With `grad_reduce="micro-batch"` every micro-batch's buckets are
reduce-scattered and freed instead, into the shard, which accumulates over the window: the two buckets' memory at any
accumulation, for accumulation x the reduce-scatter traffic (and another order of the additions: not bitwise).

A parameter that gets no gradient in a backward (a conditional module's, an expert no token was routed to) has gradient
zero: stage 1 reads zeros from its flat buffer; at stages 2 and 3 a bucket waits only for the parameters the
forward's output reaches (_reached_by_forward), and the end of a backward that reduces launches the buckets still
waiting, in bucket order on every rank (_end_backward). Where another collective shares the backward with the
reduce-scatters (stage 3's gathers, expert parallelism's all-to-alls), a bucket also waits until its unit's backward
has begun on this rank (schedule_by_units, begin_unit_backward): a point every rank reaches in the same order, so that a
rank expecting fewer gradients than another does not send the bucket earlier.

Where the parameters live is the stage's (params.ParameterPlacement): at stages 1 and 2 every rank holds the whole
flat buffer and all-gathers it after each update (replicated.py); at stage 3 a rank holds its owned chunks only and
each unit's buckets are gathered while it runs (zero3.py), whose reductions start by units (schedule_by_units). The
engine calls its placement at fixed points and never asks which stage it has for that; what it does ask the stage
number is how gradients are held: whole (stage 1) or in buckets reduced in backward (stages 2 and 3).

The flat buffer holds the parameters that train: a LoRA run's adapters alone. Frozen parameters (its base) keep
their own tensors (stage 3 shards them too: zero3.py), have no gradients or optimizer state and are never reduced;
invariant (b) checks them too.

Optimizer state is the exp_avg and exp_avg_sq of the shard. In fp32 the master values *are* the
owned chunks of the parameter buffer (views, no copy), so state is 8 bytes per owned value; in bf16
the parameters are bf16 and an fp32 master shard is kept, 12 bytes per owned value.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from zerotrain.config import OptimConfig
from zerotrain.errors import ZeroTrainError
from zerotrain.model import is_decayed
from zerotrain.model.recompute import in_backward

from . import grad_norm
from .comm import Comm
from .layout import ShardLayout, shard_values
from .mesh import Mesh
from .optim import build_adamw
from .params import (OwnedPiece, ParameterPlacement, StaleParameterError, frozen_parameters, param_dtype,
                     trainable_parameters)
from .replicated import ReplicatedParameters
from .tp_slices import full_tensors
from .zero3 import ShardedParameters

__all__ = ["GradientOrderError", "StaleParameterError", "ZeroEngine", "keeps_autograd_grads", "layout_of",
           "stage2_bucket_budget"]


class GradientOrderError(ZeroTrainError):
    """A gradient arrived for a bucket whose reduce-scatter had already started."""


def stage2_bucket_budget(layout: ShardLayout) -> int:
    """Stage 2's most bytes of full-size gradient buckets at once, at accumulation 1: the two largest buckets."""
    sizes = sorted(b.end - b.start for b in layout.buckets)
    return 4 * sum(sizes[-2:])


def layout_of(model: torch.nn.Module, world_size: int, bucket_numel: int, select=None) -> ShardLayout:
    """The flat layout an engine over `model` uses (a model on the meta device gives the same one): its trainable
    parameters (those `select(name)` takes, where given); frozen ones (a LoRA run's base) have no gradients, no
    optimizer state and are never reduced."""
    named = trainable_parameters(model, select)  # a tied parameter appears once
    return ShardLayout.build([(n, tuple(p.shape), is_decayed(n, p)) for n, p in named], world_size, bucket_numel)


def keeps_autograd_grads(stage: int, precision: str, dp_size: int, tp_size: int) -> bool:
    """One rank (one DP rank without TP), stage 1 in fp32: autograd's gradients are the gradients, read where they
    are. A flat buffer would be a copy of them each step, held through the forward too (at 124M on one thread:
    476 MiB, and a 100 ms copy a step). The engine (grads_in_params) and the memory plan both ask this."""
    return stage == 1 and precision == "fp32" and dp_size == 1 and tp_size == 1


# Where each stage keeps its parameters (params.ParameterPlacement)
PLACEMENTS = {1: ReplicatedParameters, 2: ReplicatedParameters, 3: ShardedParameters}


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
        self.per_micro_batch = grad_reduce == "micro-batch" and stage >= 2
        self.reduce_in_backward = reduce_in_backward or stage == 3
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
        # Hybrid sharding: the ranks holding this rank's shard in the other replica groups (None: one group)
        self.replicate = self.mesh.dp_replicate
        self._grads_in_params = keeps_autograd_grads(stage, precision, dp.world_size * self.mesh.dp_replicate_size,
                                                     self.mesh.tp_size)
        self.placement: ParameterPlacement = PLACEMENTS[stage](self, bucket_numel=bucket_numel,
                                                               overlap_gathers=overlap_gathers)
        self.flat_params = self.placement.flat_params
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
        counted = self._split_by_tp([s for s in self.layout.slots if s.name in self.tp_slices
                                     and self.tp_slices[s.name].first_holder(t) == t])[0]
        # The shard ranges whose squared gradients this rank adds to the global norm (_counted_grad_sumsq).
        self._sumsq_ranges = self._owned(counted) + (self._owned(self.replicated_ranges) if t == 0 else [])
        self._build_grad_buffers()
        self._build_optimizer()
        self._register_hooks()
        self.placement.attach()

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

    def _build_grad_buffers(self) -> None:
        """Stage 1's gradients: views into one flat buffer (no per-step copies or allocations). Stages 2 and 3 keep a
        bucket's gradients in _bucket_grads[index] while it fills, and the shard."""
        L, device = self.layout, self.device
        flat_grads = self.stage == 1 and not self.grads_in_params
        self.flat_grads = torch.zeros(L.padded_numel if flat_grads else 0, dtype=param_dtype(self.precision),
                                      device=device)
        # Stage 1 in fp32: each parameter's .grad is its view of flat_grads, except in the first micro-batch of a
        # window, where autograd's own gradient is copied in (_take_first_grad): no zeroing and no addition to zeros
        # (at 124M on one thread, two passes over 476 MiB a step fewer)
        self._grad_views: dict[int, torch.Tensor] | None = {} if flat_grads and self.precision == "fp32" else None
        self._awaiting: set[int] = set()  # the parameters whose first gradient of the window has not arrived
        if flat_grads:
            for s, p in zip(L.slots, self.params):
                p.grad = self.flat_grads[s.offset : s.offset + s.numel].view(s.shape)
                if self._grad_views is not None:
                    self._grad_views[id(p)] = p.grad
        # In bf16, stage 1 accumulates gradients across micro-batches in fp32 before the reduce-scatter.
        self.grad_accum = self.flat_grads if self.precision == "fp32" or self.stage >= 2 else \
            torch.zeros(L.padded_numel, device=device)
        # A rank that owns every bucket whole (one DP rank) reduces nothing: in stage 1 its shard is the fp32
        # gradient buffer itself, not a copy of it (at 124M: 476 MiB of gradients instead of 951); without TP,
        # the parameters' own gradients (grads_in_params), and no shard tensor.
        self.grad_shard = self.grad_accum if self.owns_whole_buckets else torch.zeros(L.shard_numel, device=device)
        self._bucket_grads: dict[int, torch.Tensor] = {}  # stages 2 and 3: bucket -> its fp32 gradients, while held
        self._bucket_budget = stage2_bucket_budget(self.layout)
        self.grad_peak_bytes = self.grad_bytes()  # the most gradient bytes held at once, buckets included

    @property
    def owns_whole_buckets(self) -> bool:
        """Stage 1 on one DP rank: the gradient shard is the whole fp32 gradient buffer (a view, no copy)."""
        return self.stage == 1 and self.dp.world_size == 1

    @property
    def grads_in_params(self) -> bool:
        """Whether this rank's gradients stay in its parameters, with no flat gradient buffer (keeps_autograd_grads):
        decided once, as the engine is built."""
        return self._grads_in_params

    def _build_optimizer(self) -> None:
        """AdamW over this rank's owned chunks: master views, moments as views of two flat shard tensors."""
        L, device = self.layout, self.flat_params.device
        W, rank = self.dp.world_size, self.dp.rank
        self._pieces: list[OwnedPiece] = []
        if self.grads_in_params:  # one piece per parameter, whose .grad is its gradient (the shard is the buffer)
            self._pieces = [OwnedPiece(s.offset, s.offset + s.numel, s.offset, s.decay) for s in L.slots]
        else:
            for b in L.buckets:
                lo, hi = b.chunk(rank, W)
                for a, z, decay in ((lo, min(hi, b.decay_end), True), (max(lo, b.decay_end), hi, False)):
                    if z > a:
                        self._pieces.append(OwnedPiece(a, z, b.shard_offset + a - lo, decay))
        self.master = None
        if self.precision == "bf16":
            self.master = torch.empty(L.shard_numel, device=device)
            for pc in self._pieces:
                self.master[pc.shard_lo : pc.shard_hi] = self.placement.owned_values(pc).float()
        self.exp_avg = torch.zeros(L.shard_numel, device=device)
        self.exp_avg_sq = torch.zeros(L.shard_numel, device=device)
        self._master_views = []
        decayed, plain = [], []
        for pc in self._pieces:
            m = self._master_of(pc)
            if not self.grads_in_params:  # otherwise each step's are the parameters' (apply)
                m.grad = self.grad_shard[pc.shard_lo : pc.shard_hi]
            self._master_views.append(m)
            (decayed if pc.decay else plain).append(m)
        groups = [g for g in ({"params": decayed, "weight_decay": self.optim_cfg.weight_decay},
                              {"params": plain, "weight_decay": 0.0}) if g["params"]]
        self.optimizer = build_adamw(groups, self.optim_cfg)
        # Fused AdamW keeps its step counters on the parameters' device, the others on the CPU.
        self._step_device = device if self.optimizer.defaults.get("fused") else torch.device("cpu")
        # AdamW's moments become views into two flat shard tensors: one allocation each, and the
        # shard's state is exactly what a checkpoint stores. AdamW uses state it finds present.
        for pc, m in zip(self._pieces, self._master_views):
            self.optimizer.state[m] = {
                "step": torch.tensor(0.0, device=self._step_device),
                "exp_avg": self.exp_avg[pc.shard_lo : pc.shard_hi],
                "exp_avg_sq": self.exp_avg_sq[pc.shard_lo : pc.shard_hi],
            }

    def _master_of(self, pc: OwnedPiece) -> torch.Tensor:
        """The fp32 master values of piece `pc`: in fp32 the owned parameter values themselves (an alias)."""
        if self.master is None:
            return self.placement.owned_values(pc)
        return self.master[pc.shard_lo : pc.shard_hi]

    def _register_hooks(self) -> None:
        """Bucket bookkeeping, and the hooks that take each gradient and launch reduce-scatters in backward (the
        placement registers its own after these: ParameterPlacement.attach)."""
        L = self.layout
        self._sync = True
        self._ready = [0] * len(L.buckets)
        self._bucket_sizes = [0] * len(L.buckets)
        for s in L.slots:
            self._bucket_sizes[s.bucket] += 1
        self._launched = 0  # buckets whose reduce-scatter has started this window, in bucket order
        self._end_queued = False  # _end_backward is queued to run as this backward ends
        self._reduces_now = False  # this backward reduces (the window's last, or every one per micro-batch)
        self._window_reduced = False  # a backward has reduced this window (a later one is too late)
        # The gradients each bucket waits for in the next reducing backward: its parameters that the forward's
        # output reaches (_reached_by_forward); every one of them when no forward said.
        self._expected = list(self._bucket_sizes)
        self._reached: set[int] | None = None
        # Where a bucket may start (schedule_by_units): the unit whose backward must have begun on this rank first, a
        # point every rank of the group reaches in the same order; None: wherever its gradients are in
        self._bucket_unit: list[int] | None = None
        self._open_units: set[int] = set()  # units whose buckets may start from the backward's beginning
        self._begun: set[int] = set()  # the units whose backward has begun in this backward
        # per unit: the forwards since the last backward whose unit input will get a gradient, and of those the ones
        # whose unit's backward has ended (_unit_done); empty unless schedule_by_units watches the units' inputs
        self._forwards: list[int] = []
        self._done: list[int] = []
        self._pending: list = []  # their async work handles, dropped once waited for
        if self.reduce_in_backward or self.precision == "bf16" or self.gather_behind_forward or self.stage >= 2 or \
                self._grad_views is not None:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if self.stage >= 2:
            self.model.register_forward_hook(self._reached_by_forward)

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

    # ---------------------------------------------------------------- backward side
    @contextlib.contextmanager
    def no_sync(self, enabled: bool = True):
        """Within this context, backward accumulates gradients locally and communicates nothing.

        Use it for every micro-batch but the last of an accumulation window, as with DDP.
        """
        previous, self._sync = self._sync, not enabled
        try:
            yield
        finally:
            self._sync = previous

    def _take_first_grad(self, p: torch.Tensor) -> None:
        """The window's first gradient of `p`, autograd's own tensor, copied into its view of flat_grads (which then
        accumulates the later micro-batches' in place)."""
        view = self._grad_views[id(p)]
        if p.grad is not view:
            with torch.no_grad():
                view.copy_(p.grad)
            p.grad = view
        self._awaiting.discard(id(p))

    def _zero_grads_not_taken(self) -> None:
        """A parameter with no gradient in the whole window: its view of flat_grads, holding the last window's, is
        zeroed before anything reads it."""
        for p in self.params:
            if id(p) in self._awaiting:
                view = self._grad_views[id(p)]
                view.zero_()
                p.grad = view
        self._awaiting.clear()

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self._grad_views is not None:
            self._take_first_grad(p)
        s = self.slot_of[id(p)]
        if self.placement.in_flight(s.bucket):
            # Forward read this parameter before its all-gather finished: the gradient is of stale values.
            raise StaleParameterError(
                f"{s.name} was used while its all-gather was in flight: call engine.wait_params() "
                "before reading parameters outside the model's forward")
        self._at_end_of_backward()  # every backward ends in _end_backward, which tells the placement
        if not self.grads_in_params:  # else autograd's gradient is the gradient: nothing to take, add or send
            self._take_into_bucket(p, s)
        self.placement.gradient_arrived(p)

    def _take_into_bucket(self, p: torch.Tensor, s) -> None:
        """Add `p`'s gradient where this stage keeps it (stage 2 and 3's bucket buffer, stage 1's fp32 accumulator in
        bf16) and count it; launch the buckets now complete, where this backward reduces."""
        if self.stage >= 2:
            b = self.layout.buckets[s.bucket]
            with torch.no_grad():
                self._bucket_grad(s.bucket)[s.offset - b.start : s.offset - b.start + s.numel].add_(
                    p.grad.reshape(-1).float())
            p.grad = None  # autograd's gradient tensor goes; the bucket holds the sum
        elif self.precision == "bf16":
            with torch.no_grad():
                self.grad_accum[s.offset : s.offset + s.numel].add_(p.grad.reshape(-1).float())
                p.grad.zero_()
        if self.join_backward():
            if s.bucket < self._launched:
                # Without this, the gradient would silently miss the reduction.
                raise GradientOrderError(self._late_gradient(s.name, s.bucket))
            if self._reached is not None and id(p) not in self._reached:  # a gradient no forward foresaw: waited for
                self._reached.add(id(p))
                self._expected[s.bucket] += 1
            self._ready[s.bucket] += 1
            self.launch_ready()

    def launch_ready(self) -> None:
        """Launch the buckets whose expected gradients are all in (none expected: at once), in bucket order only, so
        that every rank issues the same reduce-scatters in the same order; with schedule_by_units, only those whose
        unit's backward has begun (begin_unit_backward, which calls this for a rank whose parameters may get no
        gradient)."""
        while self._launched < len(self._ready) and self._ready[self._launched] == self._expected[self._launched] \
                and self._may_start(self._launched):
            self._launch(self._launched)

    def schedule_by_units(self, bucket_units: list[int], *, open_units=(), units=None) -> None:
        """Start bucket i's reduce-scatter only once the backward of unit bucket_units[i] has begun on this rank
        (begin_unit_backward), a point every rank of the group reaches in the same order, or from the backward's
        beginning for a unit in `open_units`: so that a rank expecting fewer gradients than another (an expert with no
        rows here) does not send a bucket earlier, where another collective shares the backward (stage 3's gathers,
        expert parallelism's all-to-alls). With `units` (each unit's modules, in forward order: zero3.model_units),
        every bucket of a unit and of the units after it starts at the latest when the gradient of the unit's input is
        complete (FSDP2's post-backward point, counted over the forwards of the backward): its gradients that did not
        arrive are zeros."""
        self._bucket_unit = list(bucket_units)
        self._open_units = set(open_units)
        if units is not None:
            self._forwards, self._done = [0] * len(units), [0] * len(units)
            for index, unit in enumerate(units):
                unit[0].register_forward_pre_hook(lambda _m, args, u=index: self._watch_unit_input(u, args))

    def begin_unit_backward(self, unit: int) -> None:
        """`unit`'s backward begins here, at the same point of every rank's backward: the placement holds it for its
        backward (stage 3 gathers it), the backward is joined (join_backward) and the buckets that may start now
        are launched (launch_ready)."""
        self.placement.enter_backward(unit)
        if unit not in self._begun:
            self._begun.add(unit)
            if self.join_backward():
                self.launch_ready()

    def _may_start(self, index: int) -> bool:
        if self._bucket_unit is None:
            return True
        unit = self._bucket_unit[index]
        return unit in self._begun or unit in self._open_units

    def _watch_unit_input(self, unit: int, args) -> None:
        """A forward of `unit` that will be differentiated: the gradient of its input says where every rank's backward
        of the unit has ended (_unit_done)."""
        if in_backward() or not torch.is_grad_enabled():
            return
        x = args[0] if args else None
        if unit > 0 and isinstance(x, torch.Tensor) and x.requires_grad:
            self._forwards[unit] += 1
            x.register_hook(lambda _grad, u=unit: self._unit_done(u))

    def _unit_done(self, unit: int) -> None:
        """The gradient of `unit`'s input is complete (in every forward of this backward): every bucket of it and of
        the units after it is launched now, in bucket order, whatever gradients this rank got (none: zeros)."""
        self._done[unit] += 1
        self._at_end_of_backward()
        if self._done[unit] != self._forwards[unit] or not self.join_backward():
            return
        self._begun.add(unit)
        while self._launched < len(self._ready) and self._bucket_unit[self._launched] >= unit:
            self._launch(self._launched)

    def _reset_unit_counts(self) -> None:
        self._forwards = [0] * len(self._forwards)
        self._done = [0] * len(self._done)

    def join_backward(self) -> bool:
        """In a backward: whether it reduces (the window's last, or each with --grad-reduce micro-batch, where buckets
        are reduced in backward), and if so its end queued (_end_backward). A parameter's first gradient calls it; so
        does a caller whose parameters may get none on this rank while its group's others get some (expert
        parallelism: a rank whose experts got no rows), so that every rank of the group launches the same
        reductions."""
        if not ((self._sync or self.per_micro_batch) and (self.reduce_in_backward or self.stage >= 2)):
            return False
        self._reduces_now = True
        self._at_end_of_backward()
        return True

    @property
    def reached_parameters(self) -> set[int] | None:
        """The ids of the trained parameters the forwards since the last backward reached (None: not walked)."""
        return self._reached

    def _reached_by_forward(self, _module, _args, output) -> None:
        """Stages 2 and 3, after a forward whose backward reduces (at stage 3, every forward: its units are released
        by their gradients): the trained parameters its output's autograd graph reaches, the ones backward will give a
        gradient (as DDP's find_unused_parameters finds them). A bucket then waits only for those: one holding a
        parameter that no gradient will reach (a skipped module's, an unrouted expert's) is reduced as soon as the
        ones that will are in, not held (with every bucket after it) to the end of the backward. In the usual step,
        which reaches every parameter, this changes nothing. Several forwards before one backward add up; a compiled
        forward is not walked (every parameter is waited for, as before)."""
        if not (torch.is_grad_enabled() and (self._sync or self.per_micro_batch or self.placement.gathers_units)) or \
                in_backward() or torch.compiler.is_compiling():
            return
        reached = self._reached if self._reached is not None else set()
        stack = [t.grad_fn for t in (output if isinstance(output, (tuple, list)) else (output,))
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set = set()
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)  # an AccumulateGrad node: the leaf it accumulates into
            if variable is not None:
                reached.add(id(variable))
            else:
                stack.extend(next_fn for next_fn, _ in fn.next_functions)
        self._reached = reached
        expected = [0] * len(self._expected)
        for s, p in zip(self.layout.slots, self.params):
            if id(p) in reached:
                expected[s.bucket] += 1
        self._expected = expected

    def _at_end_of_backward(self) -> None:
        """Have `_end_backward` run when this backward ends (once per backward; outside one, as a test's direct
        call of the hook is, nothing is queued)."""
        if not self._end_queued and in_backward():
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """The end of a backward: where it reduces (the window's last, or each with --grad-reduce micro-batch), its
        reductions are all launched; then the placement is told (stage 3 releases every unit).

        A parameter that got no gradient in it (a conditional module's, an expert no token was routed to) never
        completed its bucket: its gradient is zero. Stages 2 and 3 launch the buckets still waiting now, in bucket
        order, as every rank does whatever its own parameters got (a bucket with no gradient here is sent as zeros:
        the other ranks' may have some). Stage 1 leaves them to reduce_grads, which first zeroes the flat buffer's
        views no gradient was taken into. With --grad-reduce micro-batch the counts start again for the next
        micro-batch's backward; otherwise the window is reduced, and a gradient of another backward before
        zero_grad is the caller's mistake (_late_gradient)."""
        self._end_queued = False
        self._begun.clear()
        if self._reduces_now:
            self._reduces_now = False
            if self.stage >= 2:
                while self._launched < len(self._ready):
                    self._launch(self._launched)
            if self.per_micro_batch:  # this micro-batch's share is sent
                self._finish_reduces()
                self._ready = [0] * len(self._ready)
                self._launched = 0
            else:
                self._window_reduced = True
        self._expected, self._reached = list(self._bucket_sizes), None
        self._reset_unit_counts()
        self.placement.end_backward()

    def _late_gradient(self, name: str, bucket: int) -> str:
        """What GradientOrderError says: the caller's mistake when an earlier backward already reduced the window
        (a micro-batch outside no_sync, or no zero_grad before the next window); else the engine's own."""
        if self._window_reduced:
            return (f"the gradient of {name} arrived after its bucket was reduced: run the backward of every "
                    "micro-batch but the last inside engine.no_sync(), and engine.zero_grad() before the next "
                    "window")
        return (f"the gradient of {name} arrived after its bucket {bucket} was reduced, though no earlier backward "
                f"reduced this window: the engine launched the bucket before its gradients were complete "
                f"({self._ready[bucket]} of {self._expected[bucket]} counted); an engine error, not the caller's")

    def _launch(self, index: int) -> None:
        b = self.layout.buckets[index]
        c = b.chunk_numel(self.dp.world_size)
        out = self.grad_shard[b.shard_offset : b.shard_offset + c]
        grads = self.grad_accum[b.start : b.end] if self.stage == 1 else self._bucket_grad(index)
        if self.per_micro_batch:
            # The shard accumulates over the window: its sum so far goes into this rank's own chunk of the bucket
            # (which it does not send), so the reduce-scatter's result is the sum so far plus every rank's part.
            lo, hi = b.chunk(self.dp.rank, self.dp.world_size)
            grads[lo - b.start : hi - b.start].add_(out)
        work = self.dp.reduce_scatter(out, grads, "reduce_scatter_grads", async_op=True)
        self._pending.append((index, work))
        self._launched += 1

    def _finish_reduces(self, keep: int = 0) -> None:
        """Wait for the launched reduce-scatters but the newest `keep`; stage 2 frees their buckets' gradients."""
        while len(self._pending) > keep:
            index, work = self._pending.pop(0)
            # Gloo's work objects hold tensors; one that outlives the process group aborts the process at exit.
            work.wait()
            self._release(index)

    def _bucket_grad(self, index: int) -> torch.Tensor:
        """Stages 2 and 3: bucket `index`'s fp32 gradient buffer, allocated (zeroed) when its first gradient arrives."""
        grads = self._bucket_grads.get(index)
        if grads is None:
            b = self.layout.buckets[index]
            # Reduce-scatters in flight keep their buckets until waited for: wait for the oldest until this one
            # fits in the budget (the first micro-batches of a window launch none, and keep every bucket).
            while self._pending and self._bucket_bytes() + 4 * (b.end - b.start) > self._bucket_budget:
                self._finish_reduces(keep=len(self._pending) - 1)
            grads = self._bucket_grads[index] = torch.zeros(b.end - b.start, device=self.flat_params.device)
            self.grad_peak_bytes = max(self.grad_peak_bytes, self.grad_bytes())
        return grads

    def _bucket_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._bucket_grads.values())

    def _release(self, index: int) -> None:
        """Stages 2 and 3: bucket `index`'s gradients are in the shard; its full-size buffer goes."""
        self._bucket_grads.pop(index, None)

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient tensor the engine holds now: stage 1's full buffers, stage 2's buckets in use, the shard."""
        held = {id(t): t for t in (self.flat_grads, self.grad_accum, self.grad_shard, *self._bucket_grads.values())}
        if self.grads_in_params:
            held.update((id(p.grad), p.grad) for p in self.params if p.grad is not None)
        return list(held.values())

    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.grad_tensors())

    def zero_grad(self) -> None:
        """Start a new accumulation window."""
        self._reset_window()  # first: a reduce-scatter a failed step left in flight still reads the buffers
        if self.grads_in_params or self._grad_views is not None:
            for p in self.params:
                # autograd's first gradient becomes .grad (and, with a flat buffer, _take_first_grad copies it in)
                p.grad = None
            self._awaiting = set(self._grad_views or ())
        else:
            self.flat_grads.zero_()
        if self.grad_accum is not self.flat_grads:
            self.grad_accum.zero_()
        if self.per_micro_batch:
            self.grad_shard.zero_()

    def _reset_window(self) -> None:
        """The per-window bookkeeping starts again, whatever the last window left (a step that raised midway
        included): the reduce-scatters it left in flight finished (every rank launched them, in bucket order; their
        results are overwritten or zeroed), its bucket buffers gone (a late gradient was added into one), no bucket
        counted or launched, no end of backward queued. After a step that ended normally there is nothing to
        finish or drop."""
        self._finish_reduces()
        self._bucket_grads.clear()
        self._ready = [0] * len(self._ready)
        self._launched = 0
        self._end_queued = self._reduces_now = self._window_reduced = False
        self._expected, self._reached = list(self._bucket_sizes), None
        self._begun.clear()
        self._reset_unit_counts()
        self.placement.reset_window()  # no unit running or counting gradients (after a normal step, none is)

    # ---------------------------------------------------------------- optimizer side
    def reduce_grads(self, extras: torch.Tensor | Callable[[], torch.Tensor], beside=()) -> tuple[float, torch.Tensor]:
        """Finish the gradient reduce-scatter; all-reduce [the gradient norm's exact partial sum, *extras] in one call.

        Returns the global pre-clip gradient norm (grad_norm.py: the same bits at every world size) and the extras
        summed over ranks. `extras` may be a function, called once the reduce-scatter is finished (the control flags
        are read as late as they can be: a rank waiting there for a slower one can still start a stop's save).
        `beside`: engines over the other parameters of the model (expert parallelism's), whose reductions finish
        here and whose squared gradients join this rank's partial sum.
        """
        squares = torch.cat([self.finish_grads().reshape(-1),
                             *(e.finish_grads().reshape(-1).to(self.grad_shard.device) for e in beside)])
        limbs = grad_norm.exact_sum_limbs(squares)
        extras = (extras() if callable(extras) else extras).to(dtype=torch.float64).reshape(-1).cpu()
        stats = self.mesh.world.all_reduce(torch.cat([limbs, extras]).to(self.grad_shard.device),
                                           "all_reduce_stats").cpu()
        return grad_norm.norm_of_limbs(stats[: grad_norm.N_VALUES]), stats[grad_norm.N_VALUES :]

    def finish_grads(self) -> torch.Tensor:
        """Finish this window's gradient reduction; the squares this rank adds to the global norm (reduce_grads)."""
        self.placement.release()  # nothing stays gathered past the backward (stage 3)
        if self.grads_in_params:
            self._zero_grads_not_given()
        if self._awaiting:
            self._zero_grads_not_taken()
        # Stages 2 and 3 launched every bucket as the reducing backwards ended (_end_backward), unless the hook was
        # called outside a backward; stage 1 launches here what backward did not. One rank's gradients in its
        # parameters have nothing to reduce.
        while self._launched < len(self.layout.buckets) and (not self.per_micro_batch or any(self._ready)) and \
                not self.grads_in_params:
            self._launch(self._launched)
        self._finish_reduces()
        self.all_reduce_replicas()
        return self._counted_grad_sumsq()

    def all_reduce_replicas(self) -> None:
        """Hybrid sharding: every replica group reduced its own ranks' gradients into the shard; the shard summed
        across the groups (one all-reduce of 1/dp_shard of the gradients), so that every replica holds the whole
        batch's gradient shard and takes the same AdamW step."""
        if self.replicate is not None:
            self.replicate.all_reduce(self.grad_shard, "all_reduce_replicas")

    def _zero_grads_not_given(self) -> None:
        """One rank's gradients in its parameters: a parameter autograd gave no gradient in the window reads zero,
        as its view of a flat buffer would (AdamW still decays it, as on more ranks)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.grad_peak_bytes = max(self.grad_peak_bytes, self.grad_bytes())

    def gradient_shard(self) -> torch.Tensor:
        """This rank's reduced gradient shard, after reduce_grads (with grads_in_params: assembled, a copy)."""
        if not self.grads_in_params:
            return self.grad_shard
        shard = torch.zeros(self.layout.shard_numel, device=self.device)
        for s, p in zip(self.layout.slots, self.params):
            shard[s.offset : s.offset + s.numel] = p.grad.reshape(-1)
        return shard

    def _counted_grad_sumsq(self) -> torch.Tensor:
        """This rank's share of the global squared gradient norm, so that the world's sum counts every value once: the
        sums of squares of its pieces of the norm's chunk grid (grad_norm.py), summed exactly by reduce_grads.

        Every rank's TP slices are its own values: each counts its owned chunk of them. Every DP group
        owns the same chunks of the replicated values, one copy per TP rank: only TP rank 0's group counts them.
        """
        if self.grads_in_params:  # the flat buffer's rows, put together where they span parameters: the same bits
            return grad_norm.scattered_chunk_squares([(s.offset, p.grad.reshape(-1))
                                                      for s, p in zip(self.layout.slots, self.params)])
        if self.mesh.tp_size == 1:
            squares = grad_norm.chunk_squares(self.grad_shard, [(0, self.layout.shard_numel)])
        else:
            squares = grad_norm.chunk_squares(self.grad_shard, self._sumsq_ranges)
        # Hybrid sharding: every replica group holds the same shard after all_reduce_replicas; the first group's
        # count it
        return squares if self.replicate is None or self.replicate.rank == 0 else torch.zeros_like(squares)

    def apply(self, lr: float, grad_norm: float) -> None:
        """Clip by the global norm, AdamW on this rank's shard, and the parameters follow (the placement's
        after_update: stages 1 and 2 all-gather every bucket, stage 3 gathers each unit when next used).

        With `gather_behind_forward` the all-gather is still in flight on return (see `wait_params`).
        """
        self.placement.before_update()  # AdamW writes the owned chunks, which an unfinished all-gather may be sending
        clip = self.optim_cfg.grad_clip
        if self.grads_in_params:
            for m, p in zip(self._master_views, self.params):
                m.grad = p.grad.reshape(-1)
        if clip > 0 and grad_norm > clip:
            for g in [m.grad for m in self._master_views] if self.grads_in_params else [self.grad_shard]:
                g.mul_(clip / (grad_norm + 1e-6))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.grads_in_params:
            for m in self._master_views:
                m.grad = None  # the parameters' .grad alone hold them, until zero_grad lets them go
        self._publish_params(wait=not self.gather_behind_forward)

    def _publish_params(self, wait: bool = True) -> None:
        """The owned values updated (or loaded): in bf16 the fp32 masters rounded into them, then the placement's
        after_update (the all-gather of every bucket at stages 1 and 2)."""
        if self.master is not None:
            for pc in self._pieces:
                self.placement.owned_values(pc).copy_(self.master[pc.shard_lo : pc.shard_hi])
        self.placement.after_update(wait)

    def register_update_pre_hook(self, hook) -> None:
        """`hook()` runs before every update of this engine's state (AdamW's step on its shard)."""
        self.optimizer.register_step_pre_hook(lambda *_: hook())

    def param_norm(self) -> torch.Tensor:
        """The L2 norm of the parameters this rank holds (at ZeRO-3 its shard), float64 [1]."""
        return torch.linalg.vector_norm(self.flat_params.float()).reshape(1).to(torch.float64)

    @property
    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat parameter buffers this rank holds."""
        return [self.flat_params]

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

    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        """Every tensor held for the optimizer of this rank's shard: the master values, whatever state AdamW keeps
        for each of them now (after updates it may have replaced or added tensors), and the engine's flat moments.

        AdamW's 0-dim step counters are left out: the ZeRO formula counts per-value state.
        """
        out = [*self._master_views, self.exp_avg, self.exp_avg_sq]
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                out += [t for t in self.optimizer.state.get(p, {}).values()
                        if isinstance(t, torch.Tensor) and t.dim() > 0]
        return out

    def expected_state_bytes(self) -> int:
        """The ZeRO formula for this rank: bytes per owned value x the shard."""
        return self.expected_state_bytes_per_value() * self.layout.shard_numel

    def expected_state_bytes_per_value(self) -> int:
        """ZeRO formula: 8 bytes (moments) per owned value in fp32, 12 (plus fp32 master) in bf16."""
        return 8 if self.master is None else 12

    def master_shard(self) -> torch.Tensor:
        """This rank's fp32 master values as one shard-length tensor (in fp32 at stages 1 and 2 a copy; at stage 3 the
        shard itself)."""
        return self.master if self.master is not None else self.placement.owned_shard(copy=False)

    def master_views(self) -> list[torch.Tensor]:
        """This rank's fp32 master values, in shard order, as views where they lie (no copy): the fp32 master shard,
        or in fp32 the owned parts of the parameters (a checkpoint writes them as they are). Call wait_params() first:
        a background save reads them on its own thread."""
        return [self.master] if self.master is not None else self.placement.owned_views()

    @property
    def param_count(self) -> int:
        """Parameters of the full model (each TP-sliced tensor counted at its full size)."""
        return sum(math.prod(self.tp_slices[s.name].full_shape) if s.name in self.tp_slices else s.numel
                   for s in self.layout.slots)

    @property
    def step_count(self) -> int:
        m = self._master_views[0] if self._master_views else None
        return int(self.optimizer.state[m]["step"]) if m is not None else 0

    def shard_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shard: its masters (an independent copy in fp32), moments and step count."""
        master = self.master if self.master is not None else self.placement.owned_shard(copy=True)
        return {
            "master": master.float().contiguous(),
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "step": torch.tensor([self.step_count], dtype=torch.int64),
        }

    def load_shard_state_dict(self, sd: dict) -> None:
        """Restore this rank's shard (same layout), then the parameters follow the masters. `sd["master"]` may be
        given as its parts in shard order, as master_views() gives them: a resume reads a checkpoint's shard into
        master_views(), exp_avg and exp_avg_sq where they lie and hands those in (a view copied onto itself is not
        copied)."""
        self._check_shard(sd)
        self.placement.before_update()
        with torch.no_grad():
            self._restore_optimizer_state(sd)
            if self.master is None:
                for pc in self._pieces:
                    self.placement.owned_values(pc).copy_(shard_values(sd["master"], pc.shard_lo, pc.shard_hi))
            self._publish_params()

    def _check_shard(self, sd: dict) -> None:
        """ValueError unless `sd`'s master and moments are this rank's shard of this layout."""
        for key in ("master", "exp_avg", "exp_avg_sq"):
            given = sd[key]
            shape = (sum(p.numel() for p in given),) if isinstance(given, (list, tuple)) else tuple(given.shape)
            if shape != (self.layout.shard_numel,):
                raise ValueError(f"optimizer shard {key} has shape {shape}, expected ({self.layout.shard_numel},)")

    def _restore_optimizer_state(self, sd: dict[str, torch.Tensor]) -> None:
        """AdamW's moments and step count from `sd`, and the fp32 master shard where one is kept apart."""
        self.exp_avg.copy_(sd["exp_avg"])
        self.exp_avg_sq.copy_(sd["exp_avg_sq"])
        step = float(sd["step"].item())
        for m in self._master_views:
            self.optimizer.state[m]["step"] = torch.tensor(step, device=self._step_device)
        if self.master is not None:
            self.master.copy_(shard_values(sd["master"], 0, self.layout.shard_numel))

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
