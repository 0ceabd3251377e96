"""ZeRO stage 3's parameters: each DP rank holds only its owned chunks; a unit's buckets are whole only while used.

When each bucket is gathered, prefetched and released, and why: docs/design.md, "Stage 3's placement".
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from zerotrain.model.recompute import in_backward

from . import units
from .bucket_buffers import ReleasedParameterError, UnitBuckets
from .digest import moved, tensor_digest
from .layout import ShardLayout, split_by_tp
from .params import OwnedPiece, Placement, frozen_parameters, materialise_outside_layout, param_dtype, storage_bytes


def _current_saved_tensors_hooks():
    """The (pack, unpack) saved-tensor hooks active now, or None: the engine's own hooks pass what is not a weight
    on to them (the innermost hooks are the only ones torch calls)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks if hooks is not None and hooks[0] is not None else None


class ShardedParameters(Placement, UnitBuckets):
    """ZeRO-3: a rank holds its owned chunks of the trained parameters and of the frozen ones (in a layout of their
    own), and gathers each unit for its forward and its backward (docs/design.md)."""

    holds_whole_model = False  # each rank holds its shard: no rank computes with a model it holds whole
    gathers_units = True  # each unit's parameters freed and gathered again every step
    read_how, drawn_how = "the rows of its owned ranges", "its owned values"

    # ---------------------------------------------------------------- before the run
    def held(self, whole: int, owned: int) -> int:
        return owned

    def frozen_numel(self, model: torch.nn.Module, dp: int) -> int:
        return units.frozen_layout_of(model, dp, self.bucket_numel).shard_numel

    def units_whole_bytes(self, model, layout, element_size, prefetch, beside=None) -> int:
        """The most parameter bytes whole at once beyond the shard (units.units_whole_bytes), the frozen base's
        buckets among them; `beside`: the expert group's layout, whose buckets are whole with the units'."""
        frozen = units.frozen_layout_of(model, layout.world_size, self.bucket_numel)
        return units.units_whole_bytes(model, layout, element_size, prefetch=prefetch, frozen=frozen, beside=beside)

    def copy_numel(self, model: torch.nn.Module, layout: ShardLayout) -> int:
        """Sharded as the policy (frozen_copy.shard_frozen_copy): its shard of the policy's layout."""
        return layout.shard_numel

    def read_rows(self, layout: ShardLayout, dp_rank: int) -> list[tuple[int, int]]:
        """Its owned ranges widened to whole rows, as FileValues reads them (a range that cuts a row reads it)."""
        out = []
        for s, start, end in layout.owned_slots(dp_rank):  # a slot's owned part is one range
            width = math.prod(s.shape[1:])  # a 1-D tensor's rows are its values
            a, z = start - s.offset, end - s.offset
            out.append(((-(-z // width) - a // width) * width, z - a))
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

    # ---------------------------------------------------------------- the run
    def build(self, engine, overlap_gathers: bool) -> None:
        """The shards (owned ranges alone read or drawn), every parameter a view of its bucket's buffer, the frozen
        ones in frozen_layout (its buckets after the trained layout's); `overlap_gathers` (--overlap on): prefetch
        the next unit one unit ahead."""
        self.engine = engine
        self.prefetch = overlap_gathers
        model, dp = engine.model, engine.dp
        if engine.select is not None and frozen_parameters(model):
            raise ValueError("a stage-3 engine over a selection of the parameters takes a model without frozen ones")
        # The frozen parameters (a LoRA run's base) in a layout of their own, sharded like the trained ones
        self.frozen_layout = units.frozen_layout_of(model, dp.world_size, self.bucket_numel)
        # a parameter neither layout holds gets its own tensor
        materialise_outside_layout(engine, {s.name for s in engine.layout.slots} |
                                   {s.name for s in self.frozen_layout.slots})
        L, dtype = engine.layout, param_dtype(engine.precision)
        self.held_params = torch.zeros(L.shard_numel, dtype=dtype, device=engine.device)
        self.frozen_shard = torch.zeros(self.frozen_layout.shard_numel, dtype=dtype, device=engine.device)
        self.hold_buckets(model, dp, [(L, True, self.held_params, engine.initial_range),
                                      (self.frozen_layout, False, self.frozen_shard, engine.initial_range)])
        # Units with frozen parameters, released as an earlier unit's backward begins (docs/design.md)
        self._frozen_units = [u for u, unit in enumerate(self.unit_buckets) if any(b >= len(L.buckets) for b in unit)]
        # Invariant (b) (digests): the flat ranges of each row of param_digests, in the trained layout
        # (engine.digest_rows) and in the frozen one (the frozen base's KV slices in the sliced row, as stages 1 and 2
        # digest them); what the gathers after a check must give, and what they differed by, per row [plain, poly]
        if engine.mesh.tp_size == 1:
            self._digest_kinds = engine.digest_rows, [[(0, self.frozen_layout.padded_numel)]]
        else:
            sliced, replicated = split_by_tp(self.frozen_layout.slots, engine.model_slices,
                                             self.frozen_layout.padded_numel)
            self._digest_kinds = engine.digest_rows, [replicated, sliced] + [[]] * (len(engine.digest_rows) - 2)
        self._expected_gathers: dict[int, list] = {}
        self._gather_drift = self._no_drift()

    def attach(self) -> None:
        """The units' gather and release hooks, the saved-tensor hooks around the model's forward, and the engine's
        reductions scheduled by units (gradients.GradientReducer.schedule_by_units)."""
        e = self.engine
        model = e.model
        self._held_into_backward = held = units.held_into_backward(model)
        first, end = (2, len(self.units) - 1) if units.untied_head(model) else (1, len(self.units))
        self._blocks = set(range(first, end))  # the transformer blocks' units
        self._waits: list[int] | None = None  # _unit_waits of this backward, once asked
        # each unit's trained parameters that this engine holds, by id
        self._unit_params = [[id(p) for _, p in unit if id(p) in e.slot_of] for unit in units.unit_parameters(model)]
        self._arrived = [0] * len(self.units)  # parameters of each unit whose gradient arrived this backward
        self._current: list[int] = []  # the units whose forward is running, innermost last
        self._outer_hooks = None
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        for index, unit in enumerate(self.units):
            unit[0].register_forward_pre_hook(lambda _m, args, u=index: self._enter_unit(u))
            unit[-1].register_forward_hook(lambda _m, _a, _o, u=index: self._leave_unit(u))
        # Each bucket's reduce-scatter starts once its unit's backward has begun (the root's and an untied head's
        # from the start: held whole into it), at the latest when the gradient of its unit's input is complete
        e.grads.schedule_by_units(units.bucket_units(model, e.layout), open_units=held - {0}, units=self.units)
        # The head runs in the backward too with --activation-checkpointing full (recomputed inside its unit's hold).
        head = self._param_unit[id(model.lm_head.weight)]
        model.lm_head.register_forward_pre_hook(lambda _m, _a: self.check_whole(head))
        # The saved-tensor hooks are entered and left around the model's own forward, in one place: a forward that
        # raises (out of memory, a refused batch) leaves none on the thread's stack.
        forward = model.forward

        def forward_with_saved_tensor_hooks(*args, **kwargs):
            with self.saved_tensor_hooks():
                return forward(*args, **kwargs)

        model.forward = forward_with_saved_tensor_hooks

    # ---------------------------------------------------------------- the engine's owned values
    def owned_values(self, piece: OwnedPiece) -> torch.Tensor:
        return self.param_shard[piece.shard_lo : piece.shard_hi]

    def owned_views(self) -> list[torch.Tensor]:
        return [self.param_shard.detach()]

    @contextlib.contextmanager
    def saved_tensor_hooks(self):
        """Within a differentiated forward (not a recompute): the unit weights it saves kept as where they lie
        (_pack); what a forward that raised had gathered for itself is released."""
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

    # ---------------------------------------------------------------- gather and release (UnitBuckets')
    def gather_unit(self, unit: int, phase: str) -> None:
        """UnitBuckets.gather_unit, each bucket's first gather since the last check verified (_verify_gather)."""
        super().gather_unit(unit, phase)
        for b in self.unit_buckets[unit]:
            self._verify_gather(b)

    def _prefetch_after(self, unit: int, backward: bool) -> None:
        """With prefetch on, launch the gather of the unit that runs after `unit`: the next one in the forward, the
        previous block in the backward (the root and an untied head are held from their forward; an untied
        embedding's backward reads no weight)."""
        after = unit - 1 if backward else unit + 1
        if self.prefetch and (after in self._blocks if backward else after < len(self.units)):
            self.prefetch_unit(after)

    def release(self) -> None:
        self.release_all()  # nothing stays gathered into the reduction

    def before_update(self) -> None:
        self.release_all()  # nor into an update: no stale copy survives the step

    def frozen_bytes(self) -> int:
        """Bytes this rank holds for the frozen parameters now: its frozen shard, and whatever storage the frozen
        parameters have of their own (none between steps: their buckets are released)."""
        return storage_bytes([self.frozen_shard, *(p for _, p in self.engine.frozen)])

    # ---------------------------------------------------------------- hooks
    def _enter_unit(self, unit: int) -> None:
        if in_backward():
            # A block's forward recomputed for its backward (activation checkpointing), which torch may stop as soon
            # as it has what the backward needs, before the forward hook: held for the backward, released with it.
            self.engine.grads.begin_unit_backward(unit)
            return
        self._current.append(unit)
        self.gather_unit(unit, "forward")
        self.check_whole(unit)
        self._prefetch_after(unit, backward=False)

    def enter_backward(self, unit: int) -> None:
        """`unit`'s backward begins (GradientReducer.begin_unit_backward, at the first unpack of a weight it saved, or
        where expert parallelism knows every rank's begins): hold it whole for it (once), prefetch the next one."""
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
            # read (gathered so that every rank of the DP group gathers it: expert parallelism begins it on each)
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
        """A tensor saved for backward that is a view of a bucket buffer is kept as where it lies, not as itself: its
        bucket is released after the forward, and gathered again when backward unpacks it (_unpack_weight). A tensor
        packed by hooks around the model's forward (activations.py counts the bytes saved) is kept with their unpack:
        either way, a call that gives it back."""
        if self._current and tensor.device == self.param_shard.device and tensor.untyped_storage().size():
            ptr = tensor.untyped_storage().data_ptr()
            for b in self.whole:
                if self.bucket_params[b].untyped_storage().data_ptr() == ptr:
                    # the innermost running unit that holds the bucket: the one whose weight is being saved
                    unit = next((u for u in reversed(self._current) if b in self.unit_buckets[u]), self._current[-1])
                    return functools.partial(self._unpack_weight, unit, b, tuple(tensor.shape), tuple(tensor.stride()),
                                             tensor.storage_offset())
        if self._outer_hooks is not None:
            return functools.partial(self._outer_hooks[1], self._outer_hooks[0](tensor))
        return tensor

    @staticmethod
    def _unpack(packed):
        return packed() if isinstance(packed, functools.partial) else packed

    def _unpack_weight(self, unit: int, b: int, shape, stride, offset: int) -> torch.Tensor:
        """A weight `unit` saved, read by its backward (which begins here): the view of bucket `b`'s buffer it was."""
        self.engine.grads.begin_unit_backward(unit)
        if b not in self.whole:
            raise ReleasedParameterError(f"bucket {b} of unit {unit} was read in backward while released")
        return self.bucket_params[b].as_strided(shape, stride, offset)

    # ---------------------------------------------------------------- the step's points
    def gradient_arrived(self, p: torch.Tensor) -> None:
        """A unit whose trained parameters all have their gradients is released for its backward."""
        unit = self._param_unit[id(p)]
        self._arrived[unit] += 1
        if self._arrived[unit] == self._unit_waits()[unit]:  # the unit's trained parameters have their gradients
            self._arrived[unit] = 0
            if unit not in self._frozen_units:  # else its frozen weights may still be read (enter_backward)
                self.release_unit(unit, "backward")

    def _unit_waits(self) -> list[int]:
        """How many gradients each unit waits for in this backward: its parameters the forward reached (every one
        when no forward said)."""
        if self._waits is None:
            self._waits = self.engine.grads.reached_counts(self._unit_params)
        return self._waits

    def end_backward(self) -> None:
        """Every unit released, and none counts gradients (one with a parameter that got no gradient never counted
        them all)."""
        self.release_all()
        self._arrived = [0] * len(self.units)
        self._waits = None

    def reset_window(self) -> None:
        """No unit running or counting gradients (after a step that ended normally, none is)."""
        self._current.clear()
        self._arrived = [0] * len(self.units)
        self._waits = None

    def after_update(self, wait: bool) -> None:
        """Nothing to send: the shard is updated (in bf16 its master rounded into it), and every unit is gathered
        from it when next used; the gathers from before are stale from now, and no longer verified (digests)."""
        self._updates += 1
        self._expected_gathers = {}

    def gathered_flat(self) -> torch.Tensor:
        """The whole padded flat buffer, gathered a bucket at a time (a collective of the DP group)."""
        L, dp = self.engine.layout, self.engine.dp
        flat = torch.empty(L.padded_numel, dtype=self.param_shard.dtype, device=self.param_shard.device)
        for b in L.buckets:
            c = b.chunk_numel(dp.world_size)
            dp.all_gather(flat[b.start : b.end], self.param_shard[b.shard_offset : b.shard_offset + c],
                          "all_gather_state")
        return flat

    # ---------------------------------------------------------------- invariant (b)
    def digests(self) -> torch.Tensor:
        """Invariant (b) from what each rank holds, gathering nothing: stage 1's and 2's rows, bitwise, from the DP
        group's shards, plus what the gathers since the last check differed by (docs/design.md)."""
        self._land_prefetches()
        W, rank = self.engine.dp.world_size, self.engine.dp.rank
        per_bucket = torch.zeros(len(self.bucket_params), len(self.engine.digest_rows), 2, dtype=torch.int64,
                                 device=self.param_shard.device)
        for index, (b, shard, _) in enumerate(self.bucket_sources):
            lo, hi = b.chunk(rank, W)
            for k, digest in self._row_digests(index, shard.detach(), lo, hi, b.shard_offset):
                per_bucket[index, k] = digest
        self.engine.dp.all_reduce(per_bucket, "all_reduce_digests")  # each bucket's digest as the DP group gathers it
        rows = per_bucket.sum(0) + torch.stack([torch.stack(pair) for pair in self._gather_drift])
        self._gather_drift = self._no_drift()
        # What each bucket's next gather must give until the shard's next update (after_update), as integers (the
        # check reads its rows on the host anyway)
        self._expected_gathers = dict(enumerate(per_bucket.tolist()))
        if len(rows) == 1:
            rows = torch.cat([rows, torch.zeros_like(rows)])
        return rows

    def _row_digests(self, index: int, values: torch.Tensor, lo: int, hi: int, at: int):
        """(row, digest) for each row of param_digests with values in [lo, hi) of bucket `index`'s layout (the flat
        ranges of _digest_kinds), which `values` holds from its position `at` on (its layout's digest positions)."""
        start = self.bucket_sources[index][2]
        for k, ranges in enumerate(self._digest_kinds[index >= len(self.engine.layout.buckets)]):
            inside = [(max(a, lo) - lo + at, min(z, hi) - lo + at) for a, z in ranges if a < hi and z > lo]
            if inside:
                yield k, moved(tensor_digest(values, inside), start + lo - at)

    def _verify_gather(self, index: int) -> None:
        """The first gather of bucket `index` since the last check, before the shard's next update: its digest as
        gathered, by row, against the DP group's shards' at the check; the difference is kept for the next check."""
        expected = self._expected_gathers.pop(index, None)
        if expected is None:
            return
        b = self.bucket_sources[index][0]
        for k, digest in self._row_digests(index, self.bucket_params[index].detach(), b.start, b.end, 0):
            drift = digest - torch.tensor(expected[k], device=digest.device)
            self._gather_drift[k][0] += drift[0]
            self._gather_drift[k][1] += drift[1]

    def _no_drift(self) -> list[list[torch.Tensor]]:
        """What the gathers since the last check differed by, per row: [plain, poly] as 0-dim int64 tensors (summed
        on the device, read at the next check: a few scalars, beside AdamW's step counters outside the plan's state)."""
        zero = torch.zeros((), dtype=torch.int64, device=self.param_shard.device)
        return [[zero.clone(), zero.clone()] for _ in self.engine.digest_rows]
