"""How a ZeRO engine holds its gradients and reduce-scatters them into this rank's shard, and its share of the norm.

Whole or bucketed, where each reduce-scatter starts, and a parameter with no gradient: docs/design.md, "Gradients".
"""

from __future__ import annotations

import contextlib

import torch

from zerotrain.errors import ZeroTrainError
from zerotrain.model.recompute import in_backward

from . import grad_norm
from .layout import ShardLayout, split_by_tp
from .params import StaleParameterError, param_dtype


class GradientOrderError(ZeroTrainError):
    """A gradient arrived for a bucket whose reduce-scatter had already started."""


def stage2_bucket_budget(layout: ShardLayout) -> int:
    """Stage 2's most bytes of full-size gradient buckets at once, at accumulation 1: the two largest buckets."""
    sizes = sorted(b.end - b.start for b in layout.buckets)
    return 4 * sum(sizes[-2:])


def keeps_autograd_grads(stage: int, precision: str, dp_size: int, tp_size: int) -> bool:
    """One rank (one DP rank without TP), stage 1 in fp32: autograd's gradients are the gradients, read where they
    are (a flat buffer would copy them each step: at 124M, 476 MiB and 100 ms). The reducer and the plan ask this."""
    return stage == 1 and precision == "fp32" and dp_size == 1 and tp_size == 1


class GradientReducer:
    """An engine's gradients: whole (stage 1) or in buckets reduced in backward (stages 2 and 3), reduce-scattered into
    this rank's fp32 shard (`grad_shard`), and the squares this rank adds to the global norm."""

    def __init__(self, engine, *, grad_reduce: str, reduce_in_backward: bool):
        self.model, self.layout, self.params, self.slot_of = engine.model, engine.layout, engine.params, engine.slot_of
        self.dp, self.mesh, self.device, self.placement = engine.dp, engine.mesh, engine.device, engine.placement
        self.stage, self.precision = engine.stage, engine.precision
        self.bucketed = self.stage >= 2  # buckets reduced in backward (stages 2 and 3), or whole gradients (1)
        self.per_micro_batch = grad_reduce == "micro-batch" and self.bucketed
        self.reduce_in_backward = reduce_in_backward or self.bucketed
        # Hybrid sharding: the ranks holding this rank's shard in the other replica groups (None: one group)
        self.replicate = self.mesh.dp_replicate
        # Whether this rank's gradients stay in its parameters (keeps_autograd_grads), decided once
        self.grads_in_params = keeps_autograd_grads(self.stage, self.precision,
                                                    self.dp.world_size * self.mesh.dp_replicate_size,
                                                    self.mesh.tp_size)
        self._sumsq_ranges = self._counted_ranges(engine)
        self._build_grad_buffers()
        self._register_hooks(engine.gather_behind_forward)

    def _build_grad_buffers(self) -> None:
        """Whole gradients: views into one flat buffer (no per-step copies). Buckets: _bucket_grads while they fill."""
        L, device = self.layout, self.device
        flat_grads = not self.bucketed and not self.grads_in_params
        self.flat_grads = torch.zeros(L.padded_numel if flat_grads else 0, dtype=param_dtype(self.precision),
                                      device=device)
        # In fp32 the window's first gradient is copied into the view (_on_grad_ready): no zeroing, no addition to
        # zeros (at 124M on one thread, two passes over 476 MiB a step fewer)
        self._grad_views: dict[int, torch.Tensor] | None = {} if flat_grads and self.precision == "fp32" else None
        if flat_grads:
            for s, p in zip(L.slots, self.params):
                p.grad = self.flat_grads[s.offset : s.offset + s.numel].view(s.shape)
                if self._grad_views is not None:
                    self._grad_views[id(p)] = p.grad
        # A window's first gradient is autograd's tensor, kept or copied in: zero_grad drops the parameters' gradients
        # and finish_grads gives zeros to those that got none (_zero_grads_not_given); nothing else is zeroed
        self._keeps_first_grad = self.grads_in_params or self._grad_views is not None
        # In bf16, stage 1 accumulates gradients across micro-batches in fp32 before the reduce-scatter.
        self.grad_accum = self.flat_grads if self.precision == "fp32" or self.bucketed else \
            torch.zeros(L.padded_numel, device=device)
        # One DP rank at stage 1 reduces nothing: its shard is the fp32 gradient buffer itself (at 124M: 476 MiB of
        # gradients instead of 951)
        owns_whole_buckets = not self.bucketed and self.dp.world_size == 1
        self.grad_shard = self.grad_accum if owns_whole_buckets else torch.zeros(L.shard_numel, device=device)
        self._bucket_grads: dict[int, torch.Tensor] = {}  # bucket -> its fp32 gradients, while held
        self._bucket_budget = stage2_bucket_budget(self.layout)
        self.grad_peak_bytes = self.grad_bytes()  # the most gradient bytes held at once, buckets included

    def _register_hooks(self, gather_behind_forward: bool) -> None:
        """Bucket bookkeeping, and the hooks that take each gradient (before the placement's: its attach)."""
        self._sync = True
        self._bucket_members: list[list[int]] = [[] for _ in self.layout.buckets]  # each bucket's parameters, by id
        for s, p in zip(self.layout.slots, self.params):
            self._bucket_members[s.bucket].append(id(p))
        # schedule_by_units: bucket -> the unit whose backward must have begun first (None: no such wait)
        self._bucket_unit: list[int] | None = None
        self._open_units: set[int] = set()  # units whose buckets may start from the backward's beginning
        # per unit: the forwards whose unit input will get a gradient less those whose backward ended (_unit_done)
        self._awaiting: list[int] = []
        self._pending: list = []  # the launched reduce-scatters' (bucket, work handle), dropped once waited for
        self._start_window()
        if self.reduce_in_backward or self.precision == "bf16" or gather_behind_forward or self._grad_views is not None:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if self.bucketed:
            self.model.register_forward_hook(self._reached_by_forward)

    @contextlib.contextmanager
    def no_sync(self, enabled: bool = True):
        """Within this context backward accumulates locally and communicates nothing (a window's micro-batches but
        the last, as with DDP)."""
        previous, self._sync = self._sync, not enabled
        try:
            yield
        finally:
            self._sync = previous

    def _start_window(self) -> None:
        """The window's counts start: no bucket launched, no gradient counted, no backward reduced (_start_backward)."""
        self._ready = [0] * len(self.layout.buckets)
        self._launched = 0  # buckets whose reduce-scatter has started this window, in bucket order
        self._reduces_now = False  # this backward reduces (the window's last, or every one per micro-batch)
        self._window_reduced = False  # a backward has reduced this window (a later one is too late)
        self._start_backward()

    def _start_backward(self) -> None:
        """What a backward counts starts again: no end queued, no unit begun, every gradient expected."""
        self._end_queued = False  # _end_backward is queued to run as this backward ends
        self._begun: set[int] = set()  # the units whose backward has begun in this backward
        # The gradients each bucket waits for in the next reducing backward (_reached_by_forward; all when not said)
        self._reached = None
        self._expected = self.reached_counts(self._bucket_members)
        self._awaiting = [0] * len(self._awaiting)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self._grad_views is not None and p.grad is not self._grad_views[id(p)]:
            # the window's first gradient, copied into its view of flat_grads, which accumulates the later ones
            with torch.no_grad():
                self._grad_views[id(p)].copy_(p.grad)
            p.grad = self._grad_views[id(p)]
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
        """Add `p`'s gradient into its bucket (or in bf16 stage 1's fp32 accumulator), count it, and launch the
        buckets now complete, where this backward reduces."""
        if self.bucketed:
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
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the buckets whose expected gradients are all in, and that may start (_may_start)."""
        self._launch_in_order(lambda i: self._ready[i] == self._expected[i] and self._may_start(i))

    def _may_start(self, index: int) -> bool:
        """The reduce schedule's gate: with schedule_by_units, bucket `index` starts only once its unit's backward has
        begun (or from the start, where its unit is open)."""
        unit = None if self._bucket_unit is None else self._bucket_unit[index]
        return unit is None or unit in self._begun or unit in self._open_units

    def _launch_in_order(self, may_launch=lambda index: True) -> None:
        """Launch the next buckets while `may_launch(index)`, in bucket order only (every rank issues the same
        reduce-scatters in the same order)."""
        while self._launched < len(self.layout.buckets) and may_launch(self._launched):
            self._launch(self._launched)

    def schedule_by_units(self, bucket_units: list[int], *, open_units=(), units=None) -> None:
        """Start bucket i's reduce-scatter only once unit bucket_units[i]'s backward has begun on this rank (from the
        start for `open_units`); with `units` (units.model_units), at the latest when the gradient of the unit's input
        is complete (FSDP2's post-backward point)."""
        self._bucket_unit = list(bucket_units)
        self._open_units = set(open_units)
        if units is not None:
            self._awaiting = [0] * len(units)
            for index, unit in enumerate(units):
                unit[0].register_forward_pre_hook(lambda _m, args, u=index: self._watch_unit_input(u, args))

    def begin_unit_backward(self, unit: int) -> None:
        """`unit`'s backward begins, at the same point on every rank: the placement holds it (stage 3 gathers it), and
        the buckets that may start now are launched."""
        self.placement.enter_backward(unit)
        if unit not in self._begun:
            self._begun.add(unit)
            if self.join_backward():
                self._launch_ready()

    def _watch_unit_input(self, unit: int, args) -> None:
        """A differentiated forward of `unit`: the gradient of its input says where its backward ended (_unit_done)."""
        if in_backward() or not torch.is_grad_enabled():
            return
        x = args[0] if args else None
        if unit > 0 and isinstance(x, torch.Tensor) and x.requires_grad:
            self._awaiting[unit] += 1
            x.register_hook(lambda _grad, u=unit: self._unit_done(u))

    def _unit_done(self, unit: int) -> None:
        """The gradient of `unit`'s input is complete (in every forward of this backward): every bucket of it and of
        the units after it is launched now, in bucket order."""
        self._awaiting[unit] -= 1
        self._at_end_of_backward()
        if self._awaiting[unit] or not self.join_backward():
            return
        self._begun.add(unit)
        self._launch_in_order(lambda i: self._bucket_unit[i] >= unit)

    def join_backward(self) -> bool:
        """Whether this backward reduces (the window's last, or each with --grad-reduce micro-batch), and if so its end
        queued (_end_backward). Called by a parameter's first gradient, and by a caller whose parameters may get none
        here while its group's others get some (expert parallelism), so that every rank launches the same reductions."""
        if not ((self._sync or self.per_micro_batch) and self.reduce_in_backward):
            return False
        self._reduces_now = True
        self._at_end_of_backward()
        return True

    def reached_counts(self, groups: list[list[int]]) -> list[int]:
        """How many of each group's parameters (by id) get a gradient in this backward: those the forwards since the
        last backward reached (_reached_by_forward), every one when no forward said."""
        reached = self._reached
        return [len(group) if reached is None else sum(p in reached for p in group) for group in groups]

    def _reached_by_forward(self, _module, _args, output) -> None:
        """After a forward whose backward reduces (at stage 3, every forward): the trained parameters its output's
        autograd graph reaches, the ones backward will give a gradient, each bucket's count (docs/design.md)."""
        if not (torch.is_grad_enabled() and (self._sync or self.per_micro_batch or self.placement.gathers_units)) or \
                in_backward() or torch.compiler.is_compiling():
            return
        reached = self._reached if self._reached is not None else set()
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor)]
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
        self._expected = self.reached_counts(self._bucket_members)

    def _at_end_of_backward(self) -> None:
        """Have `_end_backward` run when this backward ends (once; outside a backward nothing is queued)."""
        if not self._end_queued and in_backward():
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """The end of a backward (docs/design.md, "Gradients"): where it reduces, the buckets still waiting are
        launched in bucket order (stage 1 leaves them to finish_grads), then the placement is told (stage 3 releases
        every unit); a gradient of another backward before zero_grad is then late (_late_gradient)."""
        reduced, self._reduces_now = self._reduces_now, False
        if reduced and self.bucketed:
            self._launch_in_order()
        if reduced and self.per_micro_batch:  # this micro-batch's share is sent: the window's counts start again
            self._finish_reduces()
            self._start_window()
        else:
            self._window_reduced |= reduced
            self._start_backward()
        self.placement.end_backward()

    def _late_gradient(self, name: str, bucket: int) -> str:
        """What GradientOrderError says: the caller's mistake when an earlier backward already reduced the window,
        else the engine's own."""
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
        grads = self.grad_accum[b.start : b.end] if not self.bucketed else self._bucket_grad(index)
        if self.per_micro_batch:
            # The shard accumulates over the window: its sum so far goes into this rank's own chunk of the bucket
            # (which it does not send), so the reduce-scatter's result is the sum so far plus every rank's part.
            lo, hi = b.chunk(self.dp.rank, self.dp.world_size)
            grads[lo - b.start : hi - b.start].add_(out)
        work = self.dp.reduce_scatter(out, grads, "reduce_scatter_grads", async_op=True)
        self._pending.append((index, work))
        self._launched += 1

    def _finish_reduces(self, keep: int = 0) -> None:
        """Wait for the launched reduce-scatters but the newest `keep`, and free their buckets."""
        while len(self._pending) > keep:
            index, work = self._pending.pop(0)
            # Gloo's work objects hold tensors; one that outlives the process group aborts the process at exit.
            work.wait()
            self._release(index)

    def _bucket_grad(self, index: int) -> torch.Tensor:
        """Bucket `index`'s fp32 gradient buffer, allocated (zeroed) when its first gradient arrives."""
        grads = self._bucket_grads.get(index)
        if grads is None:
            b = self.layout.buckets[index]
            # Reduce-scatters in flight keep their buckets: wait for the oldest until this one fits in the budget
            while self._pending and 4 * (sum(g.numel() for g in self._bucket_grads.values()) + b.end - b.start) > \
                    self._bucket_budget:
                self._finish_reduces(keep=len(self._pending) - 1)
            grads = self._bucket_grads[index] = torch.zeros(b.end - b.start, device=self.device)
            self.grad_peak_bytes = max(self.grad_peak_bytes, self.grad_bytes())
        return grads

    def _release(self, index: int) -> None:
        """Bucket `index`'s gradients are in the shard; its full-size buffer goes."""
        self._bucket_grads.pop(index, None)

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient tensor held now: the whole buffers, the buckets in use, the shard."""
        held = {id(t): t for t in (self.flat_grads, self.grad_accum, self.grad_shard, *self._bucket_grads.values())}
        if self.grads_in_params:
            held.update((id(p.grad), p.grad) for p in self.params if p.grad is not None)
        return list(held.values())

    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.grad_tensors())

    def zero_grad(self) -> None:
        """Start a new accumulation window."""
        self._reset_window()  # first: a reduce-scatter a failed step left in flight still reads the buffers
        if self._keeps_first_grad:
            for p in self.params:
                # autograd's first gradient becomes .grad (and, with a flat buffer, _on_grad_ready copies it in)
                p.grad = None
        else:
            self.flat_grads.zero_()
        if self.grad_accum is not self.flat_grads:
            self.grad_accum.zero_()
        if self.per_micro_batch:
            self.grad_shard.zero_()

    def _reset_window(self) -> None:
        """The per-window bookkeeping starts again, whatever a step that raised midway left: its reduce-scatters
        finished (every rank launched them; their results are overwritten), its buckets gone, nothing counted."""
        self._finish_reduces()
        self._bucket_grads.clear()
        self._start_window()
        self.placement.reset_window()  # no unit running or counting gradients (after a normal step, none is)

    def finish_grads(self) -> torch.Tensor:
        """Finish this window's gradient reduction; the squares this rank adds to the global norm (reduce_grads)."""
        self.placement.release()  # nothing stays gathered past the backward (stage 3)
        if self._keeps_first_grad:
            self._zero_grads_not_given()
        # Buckets were launched as the reducing backwards ended (unless the hook was called outside a backward);
        # whole gradients are launched here where backward did not
        if not self.grads_in_params and (not self.per_micro_batch or any(self._ready)):
            self._launch_in_order()
        self._finish_reduces()
        self.all_reduce_replicas()
        return self._counted_grad_sumsq()

    def all_reduce_replicas(self) -> None:
        """Hybrid sharding: the shard summed across the replica groups (one all-reduce of 1/dp_shard of the
        gradients), so that every replica takes the same AdamW step on the whole batch's gradient."""
        if self.replicate is not None:
            self.replicate.all_reduce(self.grad_shard, "all_reduce_replicas")

    def _zero_grads_not_given(self) -> None:
        """A parameter autograd gave no gradient in the window reads zero: its view of flat_grads (the last window's
        values) zeroed, or with grads_in_params a tensor of zeros."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p) if self.grads_in_params else self._grad_views[id(p)].zero_()
        self.grad_peak_bytes = max(self.grad_peak_bytes, self.grad_bytes())

    def _param_grads(self) -> list[tuple[int, torch.Tensor]]:
        """With grads_in_params: each parameter's gradient, flat, at its offset in the layout."""
        return [(s.offset, p.grad.reshape(-1)) for s, p in zip(self.layout.slots, self.params)]

    def gradient_shard(self) -> torch.Tensor:
        """This rank's reduced gradient shard, after reduce_grads (with grads_in_params: assembled, a copy)."""
        if not self.grads_in_params:
            return self.grad_shard
        shard = torch.zeros(self.layout.shard_numel, device=self.device)
        for offset, grad in self._param_grads():
            shard[offset : offset + grad.numel()] = grad
        return shard

    def _counted_ranges(self, engine) -> list[tuple[int, int]]:
        """The shard ranges whose squared gradients this rank adds to the global norm under TP: its TP slices (a KV
        head held by several TP ranks, by the first of them only) and, on TP rank 0 alone, the replicated values."""
        t, slices = self.mesh.tp_rank, engine.tp_slices
        firsts = [s for s in self.layout.slots if s.name in slices and slices[s.name].first_holder(t) == t]
        counted = split_by_tp(firsts, slices)[0]
        return self._owned(counted) + (self._owned(engine.replicated_ranges) if t == 0 else [])

    def _owned(self, flat_ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The parts of `flat_ranges` (sorted, disjoint) this rank owns, as ranges of its shard, in flat order."""
        return [(p.shard_offset, p.shard_offset + p.numel) for a, z in flat_ranges
                for p in self.layout.owned_pieces(self.dp.rank, a, z)]

    def _counted_grad_sumsq(self) -> torch.Tensor:
        """This rank's share of the global squared gradient norm, so that the world's sum counts every value once
        (under TP its _counted_ranges): the sums of squares of its pieces of the norm's chunk grid (grad_norm.py),
        summed exactly by reduce_grads."""
        if self.grads_in_params:  # the flat buffer's rows, put together where they span parameters: the same bits
            return grad_norm.scattered_chunk_squares(self._param_grads())
        ranges = [(0, self.layout.shard_numel)] if self.mesh.tp_size == 1 else self._sumsq_ranges
        squares = grad_norm.chunk_squares(self.grad_shard, ranges)
        # Hybrid sharding: every replica group holds the same shard after all_reduce_replicas; the first counts it
        return squares if self.replicate is None or self.replicate.rank == 0 else torch.zeros_like(squares)
