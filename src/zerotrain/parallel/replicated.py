"""Where ZeRO stages 1 and 2 keep the parameters: the whole flat buffer on every rank, all-gathered after an update."""

from __future__ import annotations

import torch

from .digest import tensor_digest
from .layout import ShardLayout
from .params import OwnedPiece, Placement, adopt_view, frozen_parameters, materialise_outside_layout, param_dtype, \
    storage_bytes


class ReplicatedParameters(Placement):
    """ZeRO-1 and 2: every rank holds every parameter of its TP slice whole (the trained ones in the flat buffer, the
    frozen ones in their own tensors) and all-gathers the buffer after each update."""

    holds_whole_model = True
    gathers_units = False  # nothing is freed and gathered again within a step: the heap serves the next step
    read_how = drawn_how = "its TP slice of every parameter"

    # ---------------------------------------------------------------- before the run
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

    # ---------------------------------------------------------------- the run
    def build(self, engine, overlap_gathers: bool) -> None:
        """The whole flat buffer in `engine`'s layout, filled from its initial values, every parameter a view of it."""
        self.engine = engine
        self.gather_behind_forward = overlap_gathers
        self._gathering: dict[int, object] = {}  # bucket -> its all-gather still in flight
        # a parameter the flat buffer will not hold (a frozen one) gets or keeps its own tensor, in the run's precision
        materialise_outside_layout(engine, {s.name for s in engine.layout.slots})
        L, dtype = engine.layout, param_dtype(engine.precision)
        self.param_buffer = torch.zeros(L.padded_numel, dtype=dtype, device=engine.device)  # the whole flat buffer
        self.held_params = self.param_buffer
        with torch.no_grad():
            for s, p in zip(L.slots, engine.params):
                view = self.param_buffer[s.offset : s.offset + s.numel].view(s.shape)
                view.copy_(engine.initial_value(s.name, p))
                adopt_view(p, view)
        self.param_peak_bytes = self.param_bytes()

    def attach(self) -> None:
        """With `gather_behind_forward`: each module's forward waits for the buckets holding its own parameters."""
        if not self.gather_behind_forward:
            return
        slot_of = self.engine.slot_of
        for module in self.engine.model.modules():
            buckets = sorted({slot_of[id(p)].bucket for p in module.parameters(recurse=False) if id(p) in slot_of})
            if buckets:
                module.register_forward_pre_hook(lambda _m, _args, b=tuple(buckets): self.wait(b))

    # ---------------------------------------------------------------- the engine's owned values
    def owned_values(self, piece: OwnedPiece) -> torch.Tensor:
        """The parameter values of `piece` (a view of the flat buffer)."""
        return self.param_buffer[piece.flat_lo : piece.flat_hi]

    def owned_views(self) -> list[torch.Tensor]:
        """This rank's owned values in shard order, adjacent pieces as one view (after the all-gathers)."""
        runs: list[list[int]] = []
        for p in self.engine.layout.owned_pieces(self.engine.dp.rank):
            if runs and runs[-1][1] == p.start:
                runs[-1][1] = p.end
            else:
                runs.append([p.start, p.end])
        return [self.param_buffer.detach()[a:z] for a, z in runs]

    # ---------------------------------------------------------------- the step's points
    def in_flight(self, bucket: int) -> bool:
        """Whether `bucket`'s all-gather is still in flight (a gradient of values read now is refused)."""
        return bucket in self._gathering

    def before_update(self) -> None:
        self.wait()  # AdamW writes the owned chunks, which an unfinished all-gather may be sending

    def after_update(self, wait: bool) -> None:
        """All-gather every bucket, in forward order (the first module's parameters arrive first); with `wait` False
        still in flight on return."""
        dp = self.engine.dp
        for b in reversed(self.engine.layout.buckets):
            lo, hi = b.chunk(dp.rank, dp.world_size)
            bucket = self.param_buffer[b.start : b.end]
            self._gathering[b.index] = dp.all_gather(bucket, self.param_buffer[lo:hi], "all_gather_params",
                                                     async_op=True)
        if wait:
            self.wait()

    def wait(self, buckets=None) -> None:
        """Finish the parameter all-gathers still in flight: those of `buckets`, or all of them."""
        if not self._gathering:
            return
        for index in list(self._gathering) if buckets is None else buckets:  # launch order: forward order
            work = self._gathering.pop(index, None)
            if work is not None:
                work.wait()

    def gathered_flat(self) -> torch.Tensor:
        self.wait()
        return self.param_buffer

    # ---------------------------------------------------------------- checks and counts
    def digests(self) -> torch.Tensor:
        """The engine's param_digests rows, from the whole buffer."""
        e = self.engine
        self.wait()
        flat = self.param_buffer.detach()
        rows = [tensor_digest(flat, ranges) for ranges in e.digest_rows]
        if len(rows) == 1:  # without TP: the second row zeros
            rows.append(torch.zeros(2, dtype=torch.int64, device=flat.device))
        if e.frozen:  # a LoRA run's base: the trained values' digest and each frozen tensor's, digested again
            for row, sliced in enumerate((False, True)):
                held = [tensor_digest(p.detach().reshape(-1)) for n, p in e.frozen
                        if (n in e.model_slices) == sliced]
                if held:
                    rows[row] = tensor_digest(torch.cat([rows[row], *held]))
        return torch.stack(rows)

    def param_bytes(self) -> int:
        return self.param_buffer.numel() * self.param_buffer.element_size()

    def frozen_bytes(self) -> int:
        """The distinct storages of the frozen parameters' tensors, each whole."""
        return storage_bytes(p for _, p in self.engine.frozen)
