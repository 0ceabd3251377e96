"""The parameters an engine trains, and the seam between the engine and its stage: where those parameters live
(Placement; when the engine calls each of its methods: docs/design.md, "The placements' seam").
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from zerotrain.errors import ZeroTrainError
from zerotrain.model import is_decayed

from .layout import ShardLayout


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


class Placement:
    """Where a run's parameters live, one class per ZeRO stage (engine.PLACEMENTS). Built from the run's settings
    alone, it answers the planners before the run (parts_for(cfg).placement: `held`, `frozen_numel`,
    `units_whole_bytes`, `copy_numel`, `read_rows`, `computed_norms`, `notes`). At run time `build` over an engine's
    layout holds the parameters (every one a view of its buffers: `owned_values`, `owned_views`, `gathered_flat`,
    `digests`, `param_bytes`, `frozen_bytes`), `attach` follows the engine's own hooks, and the engine calls
    `before_update`, `after_update` and the step's points below, which do nothing where a placement has nothing to do
    at them (docs/design.md, "The placements' seam")."""

    holds_whole_model: bool  # replicas compute with the same whole model: their digests compare before step 1
    gathers_units: bool  # each unit's parameters freed and gathered again every step (the allocator's choice)
    read_how: str  # what a rank reads (and draws) at start-up, in `zerotrain plan`'s words
    drawn_how: str
    held_params: torch.Tensor  # once built: this rank's values in the flat layout, the whole buffer or its shard
    param_peak_bytes: int  # the most parameter bytes held at once so far

    def __init__(self, bucket_numel: int, replicas: int = 1) -> None:
        self.bucket_numel = bucket_numel  # the frozen base's layout is bucketed as the trained parameters' are
        self.replicas = replicas  # --dp-replicate R: the replica groups, each holding the whole sharded state

    # The step's points
    def in_flight(self, bucket: int) -> bool:
        return False

    def gradient_arrived(self, p: torch.Tensor) -> None: ...
    def enter_backward(self, unit: int) -> None: ...
    def end_backward(self) -> None: ...
    def reset_window(self) -> None: ...
    def release(self) -> None: ...
    def wait(self, buckets=None) -> None: ...


def adopt_view(p: torch.nn.Parameter, view: torch.Tensor) -> None:
    """Make parameter `p` a view of `view`'s storage, in place (a parameter on the meta device is swapped for one:
    its identity, the tie of a tied head and every reference to it stay)."""
    if p.is_meta:
        torch.utils.swap_tensors(p, torch.nn.Parameter(view, requires_grad=p.requires_grad))
    else:
        p.data = view


def flat_layout(named: list[tuple[str, torch.nn.Parameter]], world_size: int, bucket_numel: int) -> ShardLayout:
    """The flat layout of the parameters `named` (engine.layout_of's trained ones, units.frozen_layout_of's frozen)."""
    return ShardLayout.build([(n, tuple(p.shape), is_decayed(n, p)) for n, p in named], world_size, bucket_numel)


def frozen_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if not p.requires_grad]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a released bucket's view: none)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def materialise_outside_layout(engine, held: set[str]) -> None:
    """The parameters of `engine`'s model (its `select`) outside its placement's layouts (`held`: their names): one on
    the meta device gets its own tensor on the engine's device, a frozen one is cast, in the run's precision."""
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
