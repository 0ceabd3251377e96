"""ZeRO stage 3's parameters: each DP rank holds only its owned chunks; a unit's buckets are whole only while used.

ShardedParameters is stage 3's ParameterPlacement (params.py): the engine (engine.py) is the same algorithm as at
stages 1 and 2 and calls it at the same points. The flat layout is stage 1's and 2's (same buckets, same padding,
same owned chunks), so the optimizer shard, the gradient norm's grid and the checkpoint are theirs too. What changes
is where the parameters live:

    between steps          this rank's owned chunks only (`flat_params` is the shard: in fp32 the masters themselves;
                           in bf16 the values gathered, rounded from an fp32 master shard after each update)
    a unit's forward       its buckets all-gathered into their full-size buffers (module forward pre-hook), and
                           their storage released after it (forward hook)
    a unit's backward      gathered again when autograd first unpacks a weight the unit's forward saved
                           (saved-tensor hooks, entered and left around the model's forward in one place, so a
                           forward that raises leaves none behind: the saved weight is kept as a reference, not
                           the tensor), and released once every parameter of the unit has its gradient (or as
                           the backward ends, where a parameter got none)
    gradients              stage 2's: each bucket reduce-scattered into this rank's shard, its full-size buffer
                           freed; with accumulation, by default, every micro-batch's (--grad-reduce auto is
                           micro-batch here: the fp32 shard accumulates, and no full gradient is held through the
                           window beside a sharded model); when, below

Units, in forward order: the root (the model itself), then each transformer block. With a tied head (GPT-2, the
small Llamas) the root holds the embeddings, the final norm and the head, and is whole from the model's forward to
the end of its backward: the head needs the embedding again at the end of the forward, the head's backward comes
first, and the tied weight's gradient is complete only at the end (kept whole rather than gathered again: on 2 CPU
ranks, 8 blocks of width 256, 1 MiB buckets, the step went from 1.30x stage 2's time to 1.26x). With an untied
head the embedding and the head are units of their own, the two largest tensors of a large-vocabulary model never
whole together: the embedding before the first block (released after its forward: its backward reads no weight),
the final norm with the head after the last block (whole from the norm's forward into their backward, which comes
first). A bucket that straddles two units is whole while either needs it. Every parameter is a permanent view of its
bucket's buffer; releasing a bucket resizes that buffer's storage to 0 bytes, so the views keep their shapes but hold
nothing.

The reduce-scatters share the DP group's communicator with the units' gathers, so where each starts is a function of
the model, not of which gradients arrived: every rank issues the same collectives in the same order. Each bucket has
a unit (bucket_units: the earliest in forward order of its parameters' units, whose backward ends last; a root
parameter registered after the blocks, the final norm beside a tied head, the last unit's). Launched in bucket order,
a bucket starts
    - once its unit's backward has begun on this rank (its gather for backward; an untied head's from the start) and
      the gradients this rank's forward reached are in (none reached, an expert with no rows here: at once), so
      between that gather (with the prefetch it launches) and the next unit's on every rank, whatever arrived;
    - at the latest when the gradient of its unit's input is complete (a hook on it, FSDP2's post-backward point,
      counted over the forwards of the backward): its gradients that did not arrive are zeros;
    - else as the backward ends (the root's, a unit whose input needs no gradient: the embedding, a LoRA run's first
      block), in bucket order.
Where every gradient arrives this is where the last one arrives, as at stage 2, and the additions are stage 2's.
Launched where its last expected gradient arrived instead, a bucket that a rank's experts got no rows for went out at
another point among the units' gathers than on a rank whose experts did, and the group's messages parted ways (gloo
aborts on a message of another size; a test plants it).

With --activation-checkpointing blocks a block's forward runs again in its backward (torch.utils.checkpoint, whose
saved-tensor hooks then hold what the block saves): the forward pre-hook gathers it again, held for its backward.
`full` recomputes the head and the loss too, inside the model's call (layers.head_loss), so in the root unit's hold.

With --overlap on (the default with CUDA) the next unit is prefetched one unit ahead: entering the root's forward
launches block 1's all-gather, entering block u's forward launches block u+1's, and gathering block u for its backward
launches block u-1's; the unit waits for it when it runs. So at most the root and two neighbouring blocks are whole or
in flight at once (units_whole_bytes). With NCCL an async all-gather runs on NCCL's own stream, behind the compute on
the default stream, which waits for it only when the unit needs it. Every gather is tagged with the number of updates
the shard has had: a unit that would compute with values gathered before the last update (a prefetch that outlived
a step) raises StaleParameterError instead. On CPU the prefetch is off unless asked for: measured on 2 CPU ranks (gloo
over loopback, 2 cores), width 256, a forward prefetch gave 1.07x stage 2's step against 1.09x (4 blocks, 4 MiB
buckets), 1.23x against 1.25x (8 blocks, 1 MiB), within the rounds' noise, as DESIGN.md says of overlap on 2 cores.

Frozen parameters (a LoRA run's base) are sharded alike, in a flat layout of their own (frozen_layout_of: built as
the trained one is), in the run's precision from the first value read or drawn: each rank holds its owned chunks of
them (`frozen_shard`), and their buckets are gathered and released with the units they belong to, never reduced,
with no gradient or optimizer state. No gradient says when a unit's backward has read its last frozen weight (one is
read for its input's gradient alone), so a unit with frozen parameters is released for its backward as the previous
unit's backward begins: that backward reads the gradient of the later unit's input, complete only once every node of
the later unit that reads a weight has run. shard_frozen_copy shards a module whose every parameter is frozen the
same way, with no engine (a preference run's live reference for full fine-tuning).

With --tp the model holds this rank's TP slices and the replicated parameters, and all of the above runs over the DP
group (the ranks holding the same slices), exactly as at TP 1; the KV replicas' gradient sum (model/tensor_parallel.py) runs
in the block's backward, before the gradient reaches its bucket.

The gradient path is the engine's, stage 2's addition for addition (the reductions only scheduled by units:
engine.schedule_by_units), so stage 3 computes bitwise the same step as stage 2 in the same
--grad-reduce mode (step or micro-batch, at any accumulation).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from zerotrain.errors import ZeroTrainError

from zerotrain.model import is_decayed
from zerotrain.model.recompute import in_backward

from .digest import moved, tensor_digest
from .layout import ShardLayout
from .params import (OwnedPiece, StaleParameterError, adopt_view, frozen_parameters, materialise_outside_layout,
                     param_dtype, storage_bytes)


class ReleasedParameterError(ZeroTrainError):
    """A parameter was read while its bucket's storage was released (not gathered)."""


@dataclass(frozen=True)
class _SavedWeight:
    """Where a parameter view saved for backward lies: its unit, its bucket, and its place in the bucket's buffer."""

    unit: int
    bucket: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _Outer:
    """A tensor packed by the saved-tensor hooks that were active around the model's forward."""

    unpack: Callable
    packed: object


def _current_saved_tensors_hooks():
    """The (pack, unpack) saved-tensor hooks active now, or None: the engine's own hooks pass what is not a weight
    on to them (the innermost hooks are the only ones torch calls)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks if hooks is not None and hooks[0] is not None else None


def model_units(model: torch.nn.Module) -> list[tuple[torch.nn.Module, ...]]:
    """The units in forward order, each the modules that run it (the first's forward begins it, the last's ends
    it): the root model; with an untied head its embedding; every transformer block (the members of the model's
    first ModuleList); with an untied head its final norm and head."""
    blocks = next((list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)), [])
    if untied_head(model):
        return [(model,), (model.embedding,), *((b,) for b in blocks), (model.final_norm, model.lm_head)]
    return [(model,), *((b,) for b in blocks)]


def untied_head(model: torch.nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    return head is not None and head.weight is not model.embedding.weight


def held_into_backward(model: torch.nn.Module) -> set[int]:
    """The units kept whole from their forward into their backward, which follows at once: the root, and the
    untied head (the last unit)."""
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


def bucket_units(model: torch.nn.Module, layout: ShardLayout) -> list[int]:
    """The unit each bucket of `layout` is reduced with, a function of the model alone (see the module docstring):
    the earliest in forward order of its parameters' units, whose backward ends last. A root parameter registered
    after the blocks (the final norm beside a tied head) counts as the last unit's: its gradient is complete before
    the last block's backward ends; the root's others (the embeddings, a tied head) as the root's."""
    params = unit_parameters(model)
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}  # registration order
    last = len(params) - 1
    after = max((order[n] for unit in params[1:] for n, _ in unit), default=len(order))
    unit_of = {n: (last if u == 0 and order[n] > after else u) for u, unit in enumerate(params) for n, _ in unit}
    units = [len(params)] * len(layout.buckets)
    for s in layout.slots:
        units[s.bucket] = min(units[s.bucket], unit_of[s.name])
    return units


def frozen_layout_of(model: torch.nn.Module, world_size: int, bucket_numel: int) -> ShardLayout:
    """The flat layout stage 3 shards a model's frozen parameters in (a LoRA run's base, a frozen copy's every
    parameter): built as the trained parameters' is (engine.layout_of), so an all-frozen copy of a model is laid out
    exactly as the model that trains, bucket for bucket and rank for rank."""
    named = frozen_parameters(model)
    return ShardLayout.build([(n, tuple(p.shape), is_decayed(n, p)) for n, p in named], world_size, bucket_numel)


def units_whole_bytes(model: torch.nn.Module, layout: ShardLayout, element_size: int = 4,
                      prefetch: bool = False, frozen: ShardLayout | None = None,
                      beside: ShardLayout | None = None) -> int:
    """The most parameter bytes whole at once beyond the shard: the root unit (whole through the forward and
    the backward) with the largest other unit, or with `prefetch` the largest two neighbouring ones (the one running
    and the one being gathered for next). A unit's backward gathers it after the next unit's last gradient has
    arrived (autograd runs a parameter's gradient accumulation as soon as it is ready), or with frozen parameters
    (`frozen`, their layout) after the next unit's release (ShardedParameters.enter_backward), so without a
    prefetch two of them are never whole together; the run's check of the plan would say so if they were.
    `beside`: the layout of a second engine over the same units (expert parallelism's experts), whose buckets are
    whole with the unit's."""
    size = {("t", b.index): b.end - b.start for b in layout.buckets}
    units = [{("t", b) for b in unit} for unit in unit_buckets(model, layout)]
    for key, other, trained in (("f", frozen, False), ("e", beside, True)):
        if other is not None:
            size.update({(key, b.index): b.end - b.start for b in other.buckets})
            units = [u | {(key, b) for b in o} for u, o in zip(units, unit_buckets(model, other, trained))]
    root, others = units[0], units[1:] or [set()]
    if prefetch and len(others) > 1:
        others = [a | b for a, b in zip(others, others[1:])]
    return element_size * max(sum(size[b] for b in root | unit) for unit in others)


def shard_into_buckets(layout: ShardLayout, params: list[torch.nn.Parameter], shard: torch.Tensor, rank: int,
                       values: Callable | None) -> list[torch.Tensor]:
    """Fill `shard` with rank `rank`'s owned chunks of `layout`, `values(name, p, lo, hi)` giving values [lo, hi) of
    parameter p flattened (this rank's TP slice of it), the only ones read or drawn (None: `shard` holds them
    already); a parameter with nothing owned here is never computed or read. Every parameter becomes a view of its
    bucket's full-size buffer, whose storage is released (0 bytes): the buffers, in bucket order."""
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


class ShardedParameters:
    """The parameters of ZeRO stage 3 (params.ParameterPlacement): each rank holds its owned chunks, a unit's buckets
    whole only while it runs (see the module docstring)."""

    gathers_units = True

    def __init__(self, engine, *, bucket_numel: int, overlap_gathers: bool):
        """`overlap_gathers` (--overlap on): prefetch the next unit's gather one unit ahead. An engine over a
        selection of the parameters (expert parallelism's two) gathers, counts and releases only its own parameters'
        buckets in the units, and holds no frozen ones."""
        self.engine = engine
        self.prefetch = overlap_gathers
        model, dp = engine.model, engine.dp
        if engine.select is not None and frozen_parameters(model):
            raise ValueError("a stage-3 engine over a selection of the parameters takes a model without frozen ones")
        # The frozen parameters (a LoRA run's base) in a layout of their own, sharded like the trained ones
        self.frozen_layout = frozen_layout_of(model, dp.world_size, bucket_numel)
        # What other engines over the same units hold whole now (expert parallelism's other engine): counted into
        # param_peak_bytes at each gather, so that the peak is the units' whole at once, both engines' together
        self.param_bytes_beside: Callable[[], int] = lambda: 0
        # a parameter neither layout holds gets its own tensor (the frozen ones are sharded: _build_shards)
        materialise_outside_layout(engine, {s.name for s in engine.layout.slots} |
                                   {s.name for s in self.frozen_layout.slots})
        self._build_shards()

    # ---------------------------------------------------------------- building
    def _build_shards(self) -> None:
        """The shard: for each parameter, its values (this rank's TP slice of them) where its flat range lies in
        this rank's owned chunks, and only those read or drawn (the engine's initial_range); a parameter with nothing
        owned here is never computed or read. Every parameter becomes a view of its bucket's full-size buffer, whose
        storage is held only while gathered. The frozen parameters alike, in their own layout and shard
        (`frozen_shard`, in the run's precision from the first value), gathered with the units they belong to and
        never reduced: bucket i of frozen_layout is bucket len(layout.buckets) + i of the placement's lists."""
        e = self.engine
        L, device, rank = e.layout, e.device, e.dp.rank
        # The owned chunks: in fp32 the masters themselves; in bf16 what is gathered, beside an fp32 master shard.
        dtype = param_dtype(e.precision)
        self.flat_params = torch.zeros(L.shard_numel, dtype=dtype, device=device)
        self.frozen_shard = torch.zeros(self.frozen_layout.shard_numel, dtype=dtype, device=device)
        by_name = dict(e.model.named_parameters())
        frozen = [by_name[s.name] for s in self.frozen_layout.slots]
        # each bucket's full-size buffer (the trained buckets', then the frozen ones'), its storage held while whole
        self.bucket_params: list[torch.Tensor] = \
            shard_into_buckets(L, e.params, self.flat_params, rank, e.initial_range) + \
            shard_into_buckets(self.frozen_layout, frozen, self.frozen_shard, rank, e.initial_range)
        self.whole: set[int] = set()  # buckets whose buffers hold their values now
        self._in_flight: dict[int, object] = {}  # bucket -> its prefetch's all-gather, not yet waited for
        self._updates = 0  # the shard's updates so far (steps applied, checkpoints loaded)
        self._gathered_at: dict[int, int] = {}  # bucket -> self._updates when its gather was launched
        # Invariant (b) (digests): what the gathers after a check must give, and what they gave otherwise
        self._expected_gathers = None
        self._gather_drift = self._no_drift(1 if e.mesh.tp_size == 1 else 2 + (e.mesh.kv_replicas > 1))
        self.param_peak_bytes = self.param_bytes()

    def attach(self) -> None:
        """The units' gather and release hooks, the saved-tensor hooks around the model's forward, and the engine's
        reductions scheduled by units (engine.schedule_by_units)."""
        e = self.engine
        model = e.model
        self.units = model_units(model)
        B = len(e.layout.buckets)
        frozen_buckets = unit_buckets(model, self.frozen_layout, trained=False)
        self.unit_buckets = [t + tuple(B + f for f in fb) for t, fb in zip(unit_buckets(model, e.layout),
                                                                          frozen_buckets)]
        # Units with frozen parameters: no gradient says when their backward has read their last weight (a frozen
        # weight is read for its input's gradient alone), so each is released as an earlier unit's backward begins
        self._frozen_units = [u for u, fb in enumerate(frozen_buckets) if fb]
        # parameter -> its bucket in the placement's lists, and its unit (the frozen ones too: check_whole)
        self._bucket_index = {id(p): s.bucket for s, p in zip(e.layout.slots, e.params)}
        by_name = dict(model.named_parameters())
        self._param_name = {id(p): n for n, p in by_name.items()}
        self._bucket_index.update({id(by_name[s.name]): B + s.bucket for s in self.frozen_layout.slots})
        self._param_unit = {id(p): u for trained in (True, False)
                            for u, unit in enumerate(unit_parameters(model, trained)) for _, p in unit}
        held = held_into_backward(model)
        self._held_into_backward = held
        first, end = (2, len(self.units) - 1) if untied_head(model) else (1, len(self.units))
        self._blocks = set(range(first, end))  # the transformer blocks' units
        params = [[(n, p) for n, p in unit if id(p) in e.slot_of] for unit in unit_parameters(model)]  # ours
        self._unit_of = {id(p): index for index, unit in enumerate(params) for _, p in unit}  # parameter -> unit
        self._unit_sizes = [len(unit) for unit in params]
        self._waits: list[int] | None = None  # _unit_waits of this backward, once asked
        self._unit_params = [[id(p) for _, p in unit] for unit in params]
        self._holds: dict[int, set] = {}  # bucket -> the (unit, "forward" | "backward") holding it whole
        self._arrived = [0] * len(self.units)  # parameters of each unit whose gradient arrived this backward
        self._current: list[int] = []  # the units whose forward is running, innermost last
        self._outer_hooks = None
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        for index, unit in enumerate(self.units):
            unit[0].register_forward_pre_hook(lambda _m, args, u=index: self._enter_unit(u))
            unit[-1].register_forward_hook(lambda _m, _a, _o, u=index: self._leave_unit(u))
        # Each bucket's reduce-scatter starts once its unit's backward has begun (the root's and an untied head's
        # from the start: held whole into it), at the latest when the gradient of its unit's input is complete
        e.schedule_by_units(bucket_units(model, e.layout), open_units=held - {0}, units=self.units)
        # The head runs in the backward too with --activation-checkpointing full (recomputed inside its unit's hold).
        head = self._param_unit[id(model.lm_head.weight)]
        model.lm_head.register_forward_pre_hook(lambda _m, _a: self.check_whole(head))
        # The saved-tensor hooks are entered and left around the model's own forward, in one place: an exception
        # in it (out of memory, a refused batch) leaves none on the thread's stack (hooks entered by the root's
        # pre-hook and left by its forward hook stayed there when the forward raised between them).
        forward = model.forward

        def forward_with_saved_tensor_hooks(*args, **kwargs):
            with self.saved_tensor_hooks():
                return forward(*args, **kwargs)

        model.forward = forward_with_saved_tensor_hooks

    def _bucket_source(self, index: int) -> tuple[ShardLayout, int, torch.Tensor, int]:
        """Bucket `index` of the placement's lists: its layout, its index there, the shard it is gathered from, and
        where its layout starts in the digests' positions (the frozen layout's after the trained one's)."""
        L = self.engine.layout
        B = len(L.buckets)
        if index < B:
            return L, index, self.flat_params, 0
        return self.frozen_layout, index - B, self.frozen_shard, L.padded_numel

    # ---------------------------------------------------------------- the engine's owned values
    def owned_values(self, piece: OwnedPiece) -> torch.Tensor:
        return self.flat_params[piece.shard_lo : piece.shard_hi]  # flat_params is the shard

    def owned_views(self) -> list[torch.Tensor]:
        return [self.flat_params.detach()]

    def owned_shard(self, copy: bool) -> torch.Tensor:
        return self.flat_params.clone() if copy else self.flat_params

    @contextlib.contextmanager
    def saved_tensor_hooks(self):
        """Within: a forward that will be differentiated saves the unit weights it uses as where they lie (_pack),
        left as the block is left, whether it returns or raises; what a forward that raised had gathered and held
        for itself is released. Outside a differentiated forward (no grad, or a recompute in the backward, whose
        hooks are the checkpoint's) nothing is entered."""
        if not torch.is_grad_enabled() or in_backward():
            yield
            return
        self._outer_hooks = _current_saved_tensors_hooks()
        try:
            with self._saved_hooks:
                yield
        except BaseException:
            self._abandon_forward()
            raise

    def _abandon_forward(self) -> None:
        """A forward raised: no unit is running, and the buckets only its units held for it are released (those
        held for a backward stay, released as the next backward ends or by the reduction)."""
        self._current.clear()
        for b, holders in self._holds.items():
            holders.difference_update({h for h in holders if h[1] == "forward"})
            if not holders and b in self.whole:
                self._release_bucket(b)

    # ---------------------------------------------------------------- gather and release
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
            self._verify_gather(b)
            holders.add((unit, phase))

    def prefetch_unit(self, unit: int) -> None:
        """Launch the all-gathers of `unit`'s buckets that are neither whole nor in flight, held for it until it
        gathers them (gather_unit waits for them then)."""
        for b in self.unit_buckets[unit]:
            self._holds.setdefault(b, set()).add((unit, "prefetch"))
            if b not in self.whole and b not in self._in_flight:
                self._gather_bucket(b, async_op=True)

    def _prefetch_after(self, unit: int, backward: bool) -> None:
        """With prefetch on, launch the gather of the unit that runs after `unit`: the next one in the forward, the
        previous block in the backward (the root and an untied head are held from their forward; an untied
        embedding's backward reads no weight)."""
        after = unit - 1 if backward else unit + 1
        if self.prefetch and (after in self._blocks if backward else after < len(self.units)):
            self.prefetch_unit(after)

    def check_whole(self, unit: int) -> None:
        """Raise unless every parameter of `unit` is in a gathered bucket (from the modules' parameters, not the unit's
        list)."""
        for p in (p for module in self.units[unit] for p in module.parameters()):
            b = self._bucket_index.get(id(p))
            if b is not None and self._param_unit.get(id(p)) == unit and b not in self.whole:
                raise ReleasedParameterError(f"{self._param_name[id(p)]} was used while its bucket {b} was not "
                                             f"gathered (unit {unit})")

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
        self._arrived = [0] * len(self.units)

    def _land_prefetches(self) -> None:
        """Wait for every prefetch in flight: its buckets are whole (a buffer is never released while a gather writes
        into it)."""
        for b in list(self._in_flight):
            self._in_flight.pop(b).wait()
            self.whole.add(b)

    def _gather_bucket(self, index: int, async_op: bool = False) -> None:
        """All-gather bucket `index` into its buffer: whole now, or with `async_op` in flight (whole once waited for,
        by gather_unit or release_all). Counted apart from stages 1 and 2's one round per step ("all_gather_params"),
        which stage 3 never runs: a gather a unit waits for at once as "all_gather_units", a prefetch as
        "prefetch_units" (invariant (b) gathers nothing: digests)."""
        layout, local, shard, _ = self._bucket_source(index)
        self._gathered_at[index] = self._updates
        work = gather_bucket(self.engine.dp, layout, shard, self.bucket_params[index], local,
                             "prefetch_units" if async_op else "all_gather_units", async_op=async_op)
        if async_op:
            self._in_flight[index] = work
        else:
            self.whole.add(index)
        self.param_peak_bytes = max(self.param_peak_bytes, self.param_bytes() + self.param_bytes_beside())

    def _release_bucket(self, index: int) -> None:
        self.bucket_params[index].untyped_storage().resize_(0)
        self.whole.discard(index)

    def param_bytes(self) -> int:
        """Parameter bytes held now: the shard and the buckets whole or being gathered at the moment."""
        whole = sum(self.bucket_params[b].numel() for b in self.whole | set(self._in_flight))
        return self.flat_params.element_size() * (self.flat_params.numel() + whole)

    def frozen_bytes(self) -> int:
        """Bytes this rank holds for the frozen parameters now: its frozen shard, and whatever storage the frozen
        parameters have of their own (none between steps: their buckets are released)."""
        return storage_bytes([self.frozen_shard, *(p for _, p in self.engine.frozen)])

    # ---------------------------------------------------------------- hooks
    def _enter_unit(self, unit: int) -> None:
        if in_backward():
            # A block's forward recomputed for its backward (activation checkpointing), which torch may stop as soon
            # as it has what the backward needs, before the forward hook: held for the backward, released with it.
            self.engine.begin_unit_backward(unit)
            return
        self._current.append(unit)
        self.gather_unit(unit, "forward")
        self.check_whole(unit)
        self._prefetch_after(unit, backward=False)

    def enter_backward(self, unit: int) -> None:
        """`unit`'s backward begins (engine.begin_unit_backward): hold it whole for it (once), and prefetch the unit
        whose backward comes next. Called on the first unpack of a weight the unit saved; a caller that knows where
        every rank's backward of the unit begins may begin it there first, so that every rank of the DP group gathers
        it (expert parallelism: a rank whose experts got no rows saves none of their weights, and releases them at
        once)."""
        if all((unit, "backward") in self._holds.get(b, ()) for b in self.unit_buckets[unit]):
            return
        if unit > 0:
            # The later units' backward has ended: this one's reads their gradient of its output, complete only
            # once every node of theirs that reads a weight has run. A unit with frozen weights goes now (a
            # bucket this unit shares with it, whole, is claimed first: kept, not gathered again).
            for b in self.whole.intersection(self.unit_buckets[unit]):
                self._holds.setdefault(b, set()).add((unit, "backward"))
            for later in (u for u in self._frozen_units if u > unit):
                self.release_unit(later, "backward")
        self.gather_unit(unit, "backward")
        self.check_whole(unit)
        if not self._unit_waits()[unit] and unit not in self._frozen_units:
            # no parameter of it had a part in the forward, so no gradient would release it: nothing of it is
            # read (gathered for the collective's sake: the caller's, see the docstring)
            self.release_unit(unit, "backward")
        self._prefetch_after(unit, backward=True)

    def _leave_unit(self, unit: int) -> None:
        if in_backward():
            return
        self._current.pop()
        if unit in self._held_into_backward and torch.is_grad_enabled():
            # The head's backward comes first and needs its unit (and a tied one the root) again: it stays whole for
            # it, not gathered twice.
            self.gather_unit(unit, "backward")
        self.release_unit(unit, "forward")

    def _pack(self, tensor: torch.Tensor):
        """A tensor saved for backward that is a view of a bucket buffer is kept as where it lies, not as itself:
        its bucket is released after the forward, and gathered again when backward unpacks it."""
        if self._current and tensor.device == self.flat_params.device and tensor.untyped_storage().size():
            ptr = tensor.untyped_storage().data_ptr()
            for b in self.whole:
                if self.bucket_params[b].untyped_storage().data_ptr() == ptr:
                    unit = self._unit_owning(b)
                    return _SavedWeight(unit, b, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        if self._outer_hooks is not None:  # hooks around the model's forward (activations.py counts the bytes saved)
            return _Outer(self._outer_hooks[1], self._outer_hooks[0](tensor))
        return tensor

    def _unit_owning(self, bucket: int) -> int:
        """The innermost running unit that holds `bucket` (the one whose weight is being saved)."""
        for unit in reversed(self._current):
            if bucket in self.unit_buckets[unit]:
                return unit
        return self._current[-1]

    def _unpack(self, packed):
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        if not isinstance(packed, _SavedWeight):
            return packed
        unit, b, offset, shape, stride = packed.unit, packed.bucket, packed.offset, packed.shape, packed.stride
        self.engine.begin_unit_backward(unit)
        if b not in self.whole:
            raise ReleasedParameterError(f"bucket {b} of unit {unit} was read in backward while released")
        return self.bucket_params[b].as_strided(shape, stride, offset)

    # ---------------------------------------------------------------- the step's points
    def in_flight(self, bucket: int) -> bool:
        """A unit waits for its gathers before it computes (gather_unit): no parameter is read in flight."""
        return False

    def gradient_arrived(self, p: torch.Tensor) -> None:
        """A unit whose trained parameters all have their gradients is released for its backward."""
        unit = self._unit_of[id(p)]
        self._arrived[unit] += 1
        if self._arrived[unit] == self._unit_waits()[unit]:  # the unit's trained parameters have their gradients
            self._arrived[unit] = 0
            if unit not in self._frozen_units:  # else its frozen weights may still be read (enter_backward)
                self.release_unit(unit, "backward")

    def _unit_waits(self) -> list[int]:
        """How many gradients each unit waits for in this backward: its parameters the forward reached (every one
        when no forward said), so a unit with a parameter that gets none is released with the rest of its
        gradients, not held to the end of the backward beside the units gathered after it."""
        if self._waits is None:
            reached = self.engine.reached_parameters
            self._waits = list(self._unit_sizes) if reached is None else \
                [sum(p in reached for p in unit) for unit in self._unit_params]
        return self._waits

    def end_backward(self) -> None:
        """Every unit released: a unit with a parameter that got no gradient in this backward never counted all its
        gradients, and would stay whole into the next micro-batch (where its count, carried over, would release it
        early). After a backward where every gradient arrived nothing is whole by now, and this releases nothing."""
        self.release_all()
        self._waits = None

    def reset_window(self) -> None:
        """No unit running or counting gradients (after a step that ended normally, none is)."""
        self._current.clear()
        self._arrived = [0] * len(self.units)
        self._waits = None

    def release(self) -> None:
        self.release_all()

    def before_update(self) -> None:
        self.release_all()

    def after_update(self, wait: bool) -> None:
        """Nothing to send: the shard is updated (in bf16 its master rounded into it), and every unit is gathered
        from it when next used; the gathers from before are stale from now."""
        self._updates += 1

    def wait(self, buckets=None) -> None:
        """Gathers are synchronous: nothing is ever in flight."""

    def gathered_flat(self) -> torch.Tensor:
        """The whole padded flat buffer, gathered a bucket at a time (a collective of the DP group)."""
        L, dp = self.engine.layout, self.engine.dp
        flat = torch.empty(L.padded_numel, dtype=self.flat_params.dtype, device=self.flat_params.device)
        for b in L.buckets:
            c = b.chunk_numel(dp.world_size)
            dp.all_gather(flat[b.start : b.end], self.flat_params[b.shard_offset : b.shard_offset + c],
                          "all_gather_state")
        return flat

    # ---------------------------------------------------------------- invariant (b)
    def digests(self) -> torch.Tensor:
        """Invariant (b) for sharded parameters, from what each rank holds, gathering nothing: the rows are stage 1's
        and 2's (one without TP; with TP the replicated values, this rank's TP slices, and with KV groups the KV
        heads' slices), each the digest of the flat buffer the DP group's shards make, bitwise what stages 1 and 2
        report for the same values.

        Each rank digests its owned chunks where they lie in the flat buffer (digest.moved), bucket by bucket and row
        by row; one all-reduce of those few integers over the DP group sums them into each bucket's digest as a
        gather would make it (digests of disjoint pieces add up). With TP the replicated row is then checked across
        the TP ranks, and the KV row across each KV group: their DP groups own and update the same chunks apart, so
        a gradient that differs between them (the KV replicas' sum skipped, say) shows as differing shards. The frozen
        shards (a LoRA run's base) are digested alike, their buffer placed after the trained one in the digests'
        positions, and their gathers checked the same way.

        What a rank computes with is checked too, one check later: the buckets' digests are kept as what the units'
        next gathers must give (until the next update), and the first gather of each bucket after a check is digested
        as gathered (no traffic: the unit gathers it anyway); what differs (a stale or wrong copy) is added to this
        rank's rows at the next check, which then differ from its DP group's.
        """
        kinds = self._digest_kinds()
        self._land_prefetches()
        W, rank = self.engine.dp.world_size, self.engine.dp.rank
        per_bucket = torch.zeros(len(self.bucket_params), len(kinds[0]), 2, dtype=torch.int64,
                                 device=self.flat_params.device)
        for index in range(len(self.bucket_params)):
            layout, local, shard, start = self._bucket_source(index)
            b = layout.buckets[local]
            lo, hi = b.chunk(rank, W)
            for k, ranges in enumerate(kinds[index >= len(self.engine.layout.buckets)]):
                inside = [(max(a, lo) - lo + b.shard_offset, min(z, hi) - lo + b.shard_offset)
                          for a, z in ranges if a < hi and z > lo]  # where in the shard
                if inside:
                    per_bucket[index, k] = moved(tensor_digest(shard.detach(), inside), start + lo - b.shard_offset)
        self.engine.dp.all_reduce(per_bucket, "all_reduce_digests")  # each bucket's digest as the DP group gathers it
        rows = per_bucket.sum(0) + torch.stack([torch.stack(pair) for pair in self._gather_drift])
        self._gather_drift = self._no_drift(len(kinds[0]))
        # What the next gathers must give, as integers (the check reads its rows on the host anyway)
        self._expected_gathers = (self._updates, kinds, per_bucket.tolist(), set())
        if len(rows) == 1:
            rows = torch.cat([rows, torch.zeros_like(rows)])
        return rows

    def _digest_kinds(self) -> tuple[list, list]:
        """The flat ranges of each row of param_digests, in the trained layout and in the frozen one: everything in
        one row without TP; with TP the replicated values, this rank's TP slices and with KV groups the KV heads'
        slices (the frozen base's KV slices are in the sliced row, as stages 1 and 2 digest them)."""
        e = self.engine
        if e.mesh.tp_size == 1:
            return [[(0, e.layout.padded_numel)]], [[(0, self.frozen_layout.padded_numel)]]
        trained = [e.replicated_ranges, e.sliced_ranges] + ([e.kv_shared_ranges] if e.mesh.kv_replicas > 1 else [])
        sliced = sorted((s.offset, s.offset + s.numel) for s in self.frozen_layout.slots
                        if s.name in e.model_slices)
        replicated, at = [], 0
        for lo, hi in sliced + [(self.frozen_layout.padded_numel, self.frozen_layout.padded_numel)]:
            if lo > at:
                replicated.append((at, lo))
            at = hi
        return trained, [replicated, sliced] + [[]] * (len(trained) - 2)

    def _verify_gather(self, index: int) -> None:
        """The first gather of bucket `index` since the last check, before the shard's next update: its digest as
        gathered, by row, against the DP group's shards' at the check; the difference is kept for the next check."""
        expected = self._expected_gathers
        if expected is None or expected[0] != self._updates or index in expected[3]:
            return
        _, kinds, per_bucket, verified = expected
        verified.add(index)
        layout, local, _, start = self._bucket_source(index)
        b, buffer = layout.buckets[local], self.bucket_params[index].detach()
        for k, ranges in enumerate(kinds[index >= len(self.engine.layout.buckets)]):
            inside = [(max(lo, b.start) - b.start, min(hi, b.end) - b.start) for lo, hi in ranges
                      if lo < b.end and hi > b.start]  # positions counted from the bucket's start
            if inside:
                drift = moved(tensor_digest(buffer, inside), start + b.start) - \
                    torch.tensor(per_bucket[index][k], device=buffer.device)
                self._gather_drift[k][0] += drift[0]
                self._gather_drift[k][1] += drift[1]

    def _no_drift(self, rows: int) -> list[list[torch.Tensor]]:
        """What the gathers since the last check differed by, per row: [plain, poly] as 0-dim int64 tensors (summed
        on the device, read at the next check: a few scalars, beside AdamW's step counters outside the plan's state)."""
        zero = torch.zeros((), dtype=torch.int64, device=self.flat_params.device)
        return [[zero.clone(), zero.clone()] for _ in range(rows)]


class FrozenCopy:
    """A module whose every parameter is frozen, sharded over a DP group as stage 3 shards a model (shard_frozen_copy
    builds it): each rank holds its owned chunks (`shard`); a unit's buckets are whole only while its forward runs,
    and nothing is whole between forwards. Forward only, without gradients."""

    def __init__(self, module: torch.nn.Module, dp, layout: ShardLayout, shard: torch.Tensor,
                 buffers: list[torch.Tensor]):
        self.module, self.dp, self.layout, self.shard, self.buffers = module, dp, layout, shard, buffers
        self.units = model_units(module)
        self.unit_buckets = unit_buckets(module, layout, trained=False)
        self._holds = [0] * len(buffers)  # bucket -> the units running that hold it
        self.peak_bytes = self.held_bytes()
        bucket_of = {s.name: s.bucket for s in layout.slots}
        self._checked = [[(n, p, bucket_of[n]) for n, p in unit] for unit in unit_parameters(module, trained=False)]
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
    """Shard `module`, whose every parameter is frozen (a model of zerotrain's, this rank's TP slice of it under TP),
    over the DP group `dp` as ZeRO-3 shards a model: each rank keeps its owned chunks of the module's flat layout
    (frozen_layout_of: the layout a model of the same architecture trains in at this world size and `bucket_numel`),
    in `precision`; the module's units (model_units) gather their buckets for their forward and release them after
    it, as the engine's do. No gradients, no optimizer, nothing reduced; the module runs under torch.no_grad(). A
    preference run's live reference for full fine-tuning is such a copy of the policy, sharded like it.

    The values: with `like`, the stage-3 ZeroEngine of the model this copies (same architecture, same `dp`, the same
    layout), that engine's shard as it is now, in its precision, copied on each rank (nothing read, drawn or sent;
    under TP, `module` is this rank's TP slice, parallelized as the engine's model is); else, for a module
    on the meta device, `init`'s (model/init.py's SeedValues, --init-from's FileValues: the owned ranges alone read
    or drawn); else the module's own values (every rank's must be equal). The module's parameters become views of
    the copy's buckets: keep the returned FrozenCopy (its shard is what the module holds).
    """
    trained = [n for n, p in module.named_parameters() if p.requires_grad]
    if trained:
        raise ValueError(f"shard_frozen_copy takes a module whose every parameter is frozen; {trained[0]} "
                         f"requires grad (call module.requires_grad_(False) first)")
    layout = frozen_layout_of(module, dp.world_size, bucket_numel)
    dtype = param_dtype(precision)
    by_name = dict(module.named_parameters())
    params = [by_name[s.name] for s in layout.slots]
    if like is not None:
        same = [(s.name, s.shape, s.offset) for s in layout.slots] == \
            [(s.name, s.shape, s.offset) for s in like.layout.slots] and layout.buckets == like.layout.buckets
        if not same or like.dp.world_size != dp.world_size:
            raise ValueError("shard_frozen_copy(like=engine): the module is not laid out as the engine's model "
                             "(another architecture, world size or bucket_numel)")
        shard = like.flat_params.detach().clone()  # in the engine's precision: what its model computes with
        return FrozenCopy(module, dp, layout, shard, shard_into_buckets(layout, params, shard, dp.rank, None))
    device = device if device is not None else next((p.device for p in params if not p.is_meta), "cpu")

    def values(name: str, p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if p.is_meta:
            return init.flat_values(name, tuple(p.shape), lo, hi)
        return p.detach().reshape(-1)[lo:hi]

    shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
    return FrozenCopy(module, dp, layout, shard, shard_into_buckets(layout, params, shard, dp.rank, values))
