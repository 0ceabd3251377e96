"""The parameters an engine trains, and the seam between the engine and its stage: where those parameters live.

A ZeRO engine (engine.py) is one algorithm at every stage: a flat layout, gradients reduce-scattered into this rank's
shard, AdamW on the shard. What a stage decides about the parameters is a `ParameterPlacement`: the whole flat buffer
on every rank, all-gathered after each update (stages 1 and 2: replicated.py), or only the owned chunks, each unit's
buckets gathered while it runs (stage 3: sharded.py). The engine calls its placement at fixed points of the step and
never asks which one it has. A placement reads the engine's public attributes (layout, params, slot_of, dp, mesh,
frozen, the TP ranges) and calls its public methods (initial_value, initial_range) and its gradients' (engine.grads,
gradients.py: begin_unit_backward, schedule_by_units, reached_parameters), never a private one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from zerotrain.errors import ZeroTrainError


class StaleParameterError(ZeroTrainError):
    """A parameter was used while the all-gather bringing its new value was still in flight."""


@dataclass
class OwnedPiece:
    """A run of this rank's owned values with one weight-decay setting: one AdamW 'parameter'. [flat_lo, flat_hi) of
    the flat layout, at [shard_lo, shard_hi) of this rank's shard."""

    flat_lo: int
    flat_hi: int
    shard_lo: int
    decay: bool

    @property
    def shard_hi(self) -> int:
        return self.shard_lo + self.flat_hi - self.flat_lo


class ParameterPlacement(Protocol):
    """Where an engine's parameters live, and what is gathered when: the part of a ZeRO stage that varies.

    Built by the engine once its layout is known (the placement fills its buffers from the engine's init source and
    makes every parameter a view of them), then `attach`ed once the engine's own hooks are registered (so that its
    hooks run after the engine's). The engine then calls:

        in_flight          as each parameter's gradient is accumulated: whether its bucket was still being gathered
        gradient_arrived   then, once the engine has taken it (into its bucket, counted)
        end_backward       as a backward ends, after the engine launched its reductions
        reset_window       as an accumulation window starts again
        release            before the reduction: nothing stays gathered for a backward
        before_update      before AdamW writes the owned values (an all-gather still sending them finished)
        after_update       after the owned values were written (an update, a loaded checkpoint): the parameters follow
        enter_backward     a unit's backward begins (engine.grads.begin_unit_backward)
    """

    held_params: torch.Tensor  # this rank's values in the engine's flat layout: the whole buffer, or its owned chunks
    param_peak_bytes: int  # the most parameter bytes held at once so far

    def attach(self) -> None: ...
    def owned_values(self, piece: OwnedPiece) -> torch.Tensor: ...
    def owned_views(self) -> list[torch.Tensor]: ...
    def owned_shard(self, copy: bool) -> torch.Tensor: ...
    def in_flight(self, bucket: int) -> bool: ...
    def gradient_arrived(self, p: torch.Tensor) -> None: ...
    def enter_backward(self, unit: int) -> None: ...
    def end_backward(self) -> None: ...
    def reset_window(self) -> None: ...
    def release(self) -> None: ...
    def before_update(self) -> None: ...
    def after_update(self, wait: bool) -> None: ...
    def wait(self, buckets=None) -> None: ...
    def gathered_flat(self) -> torch.Tensor: ...
    def digests(self) -> torch.Tensor: ...
    def param_bytes(self) -> int: ...
    def frozen_bytes(self) -> int: ...

    @property
    def gathers_units(self) -> bool: ...


def adopt_view(p: torch.nn.Parameter, view: torch.Tensor) -> None:
    """Make parameter `p` a view of `view`'s storage, in place (a parameter on the meta device is swapped for one:
    its identity, the tie of a tied head and every reference to it stay)."""
    if p.is_meta:
        torch.utils.swap_tensors(p, torch.nn.Parameter(view, requires_grad=p.requires_grad))
    else:
        p.data = view


def trainable_parameters(model: torch.nn.Module, select=None) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and (select is None or select(n))]


def frozen_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if not p.requires_grad]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a released bucket's view: none)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def materialise_outside_layout(engine, held: set[str]) -> None:
    """The parameters of `engine`'s model it holds (its `select`) that its placement's layouts do not (`held`, the
    names they do): one on the meta device gets its own tensor on the engine's device, a frozen one with values is
    cast, both in the run's precision."""
    dtype = param_dtype(engine.precision)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if name in held or (engine.select is not None and not engine.select(name)):
                continue  # the placement's, or another engine's
            if p.is_meta:
                adopt_view(p, engine.initial_value(name, p).to(engine.device, dtype))
            elif not p.requires_grad:
                p.data = p.data.to(dtype)


def param_dtype(precision: str) -> torch.dtype:
    """The dtype parameters are held and computed with in `precision` (bf16 keeps an fp32 master shard beside)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32
