"""The ZeRO engine, one algorithm at stages 1, 2 and 3: flat layout, buckets, reduce-scatter, AdamW.

The trained parameters are laid out in one flat buffer (layout.py), cut into buckets, each padded to a multiple of
W x 256 (whole chunks of the gradient norm's grid, grad_norm.py) and split into W chunks: rank r owns chunk r of
every bucket. Per optimizer step:

    reduce-scatter each bucket's gradients -> this rank's gradient shard  (one round, per bucket)
    one all-reduce of a few scalars       -> global grad norm (clipping; grad_norm.py), loss, flags
    torch.optim.AdamW on the owned chunks  -> updated master values
    the parameters follow                  -> stages 1 and 2: all-gather each bucket in place (one round, per bucket);
                                              stage 3: each unit gathered from the shards when next used

How it composes its parts, and what TP, hybrid sharding and frozen parameters change: docs/design.md.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from zerotrain.config import OptimConfig
from zerotrain.model.moe import moe_layers

from . import experts as expert_parallel, grad_norm
from .comm import Comm
from .gradients import GradientReducer
from .layout import ShardLayout, split_by_tp
from .mesh import Mesh
from .params import Placement, flat_layout, frozen_parameters
from .replicated import ReplicatedParameters
from .sharded import ShardedParameters
from .sharded_adamw import AdamWShard
from .tp_slices import full_tensors

__all__ = ["ZeroEngine", "layout_of"]


def layout_of(model: torch.nn.Module, world_size: int, bucket_numel: int, select=None) -> ShardLayout:
    """The flat layout an engine over `model` uses (a model on the meta device gives the same one): its trainable
    parameters (those `select(name)` takes, where given)."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad and (select is None or select(n))]
    return flat_layout(trained, world_size, bucket_numel)


# Where each stage keeps its parameters (params.Placement: the plan's answers and the run's buffers, one class)
PLACEMENTS = {1: ReplicatedParameters, 2: ReplicatedParameters, 3: ShardedParameters}


class ZeroEngine:
    """ZeRO over a model: call backward inside `no_sync(...)` as needed, then `reduce_grads` and `apply`.

    With --ep the routed experts are one more group of it (`experts`, an engine of their own over dp_shard_mod_ep:
    this rank's block of experts); the step, the norms, the counts and the shard state cover both groups, the layout,
    placement, gradients and AdamW (and master_views) are this group's."""

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
        """ZeRO stage `stage` (1, 2 or 3) over `dp` (`mesh`'s shard group when there is one). `overlap_gathers` must
        be False for a compiled model; a model on the meta device is filled from `init` (SeedValues, FileValues), one
        with values keeps them (nothing is broadcast); `select(name)`: the trained parameters this engine holds."""
        self.model, self.dp, self.optim_cfg = model, dp, optim
        self.mesh = mesh or Mesh.single(dp)
        experts_apart = select is None and self.mesh.ep_size > 1
        if experts_apart:
            select = lambda n: not expert_parallel.is_expert_parameter(n)  # the expert group holds the rest
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
        t, slots = self.mesh.tp_rank, self.layout.slots
        self.sliced_ranges, self.replicated_ranges = split_by_tp(slots, self.tp_slices, self.layout.padded_numel)
        # KV heads held by several TP ranks: checked across those ranks, counted in the norm by the first of them only
        kv_shared = [s for s in slots if s.name in self.tp_slices and self.tp_slices[s.name].holders(t) > 1]
        # The flat ranges of each row of param_digests, which both placements digest
        kv_row = [split_by_tp(kv_shared, self.tp_slices)[0]] if self.mesh.kv_replicas > 1 else []
        self.digest_rows = [[(0, self.layout.padded_numel)]] if self.mesh.tp_size == 1 else \
            [self.replicated_ranges, self.sliced_ranges, *kv_row]
        # Built from the settings as the plan builds it (parts_for), then holding this engine's parameters; it answers
        # the loop too (holds_whole_model, gathers_units, computed_norms)
        self.placement: Placement = PLACEMENTS[stage](bucket_numel, replicas=self.mesh.dp_replicate_size)
        self.placement.build(self, overlap_gathers)
        self.held_params = self.placement.held_params  # the whole flat buffer (stages 1 and 2), or the shard (3)
        self._init = None  # the source is read only while the buffers are built
        # The gradients (their hooks registered before the placement's: Placement.attach), then AdamW
        self.grads = GradientReducer(self, grad_reduce=grad_reduce, reduce_in_backward=reduce_in_backward)
        self.adamw = AdamWShard(self, self.grads, optim)
        self.placement.attach()
        self.experts: ZeroEngine | None = None
        if experts_apart:
            self.experts = ZeroEngine(model, self.mesh.dp_shard_mod_ep, optim,
                                      mesh=expert_parallel.expert_mesh(self.mesh),
                                      select=expert_parallel.is_expert_parameter, bucket_numel=bucket_numel,
                                      precision=precision, reduce_in_backward=reduce_in_backward,
                                      overlap_gathers=overlap_gathers, stage=stage, grad_reduce=grad_reduce, init=init,
                                      device=device)
            self.experts_per_rank = len(moe_layers(model)[0].local_experts())  # of each MoE layer (checkpoints)
            expert_parallel.attach_expert_group(self, self.experts, overlap_gathers)
        self.parts = [self] + ([self.experts] if self.experts else [])
        # What building the buffers took from the source (the run's init_bytes_read and init_values_drawn, per rank;
        # the groups read one source, whose counts run on)
        self.init_bytes_read = getattr(init, "bytes_read", 0)
        self.init_values_drawn = getattr(init, "values_drawn", 0)

    def initial_value(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """Parameter `name`'s initial values on this rank (its TP slice): from the init source for a model on the meta
        device, else its own (broadcasting rank 0's would hide an init that depends on the rank)."""
        return self._init.values(name, tuple(p.shape)) if p.is_meta else p.detach()

    def initial_range(self, name: str, p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Values [lo, hi) of initial_value flattened (the init source reads or draws that range alone)."""
        return self._init.flat_values(name, tuple(p.shape), lo, hi) if p.is_meta else p.detach().reshape(-1)[lo:hi]

    # ---------------------------------------------------------------- backward side: the gradients' part
    @contextlib.contextmanager
    def no_sync(self, enabled: bool = True):
        """Within this context backward communicates nothing: every micro-batch but a window's last, as with DDP."""
        with contextlib.ExitStack() as stack:
            for e in self.parts:
                stack.enter_context(e.grads.no_sync(enabled))
            yield

    def zero_grad(self) -> None:
        """Start a new accumulation window."""
        for e in self.parts:
            e.grads.zero_grad()

    # ---------------------------------------------------------------- optimizer side
    def reduce_grads(self, extras: torch.Tensor | Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Finish the gradient reduce-scatter; all-reduce [the gradient norm's exact partial sum, *extras] in one call.
        Returns the global pre-clip norm (0-d float64) and the extras summed, on the device, unread. `extras` may be a
        function, called once the reduce-scatter is finished (the control flags read as late as they can be)."""
        squares = torch.cat([e.grads.finish_grads().reshape(-1).to(self.device) for e in self.parts])
        limbs = grad_norm.exact_sum_limbs(squares)
        extras = (extras() if callable(extras) else extras).to(self.device, torch.float64).reshape(-1)
        stats = self.mesh.world.all_reduce(torch.cat([limbs.to(self.device), extras]), "all_reduce_stats")
        return grad_norm.norm_tensor(stats[: grad_norm.N_VALUES]), stats[grad_norm.N_VALUES :]

    def apply(self, lr: float, grad_norm: torch.Tensor | float) -> None:
        """Clip by the global norm (on the device), AdamW on this rank's shard, and the parameters follow (the
        placement's after_update); with `gather_behind_forward` the all-gather is still in flight on return
        (wait_params)."""
        for e in self.parts:
            e.placement.before_update()  # AdamW writes the owned chunks, which an unfinished all-gather may be sending
            e.adamw.step(lr, grad_norm)
            e._publish_params(wait=not e.gather_behind_forward)

    def _publish_params(self, wait: bool = True) -> None:
        """The owned values updated or loaded: in bf16 the fp32 masters rounded into them, then the placement's
        after_update (the all-gather of every bucket at stages 1 and 2)."""
        self.adamw.round_into_params()
        self.placement.after_update(wait)

    def register_update_pre_hook(self, hook) -> None:
        """`hook()` runs before every update of this engine's state (AdamW's step on each group's shard)."""
        for e in self.parts:
            e.adamw.register_update_pre_hook(hook)

    def param_norm(self) -> torch.Tensor:
        """The L2 norm of the parameters this rank holds (at ZeRO-3 its shard), float64 [1]; with --ep at stages 1
        and 2 its EP group's experts too, so that the norm is --ep 1's."""
        norm = torch.linalg.vector_norm(self.held_params.float()).reshape(1).to(torch.float64)
        if self.experts is None:
            return norm
        experts = self.experts.param_norm().square()
        if self.stage != 3:
            experts = self.mesh.ep.all_reduce(experts, "all_reduce_expert_norms")
        return (norm.square() + experts).sqrt()

    @property
    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat parameter buffers this rank holds."""
        return [e.held_params for e in self.parts]

    def wait_params(self, buckets=None) -> None:
        """Finish the parameter all-gathers still in flight: those of `buckets`, or all of them."""
        for e in self.parts:
            e.placement.wait(buckets)

    # ---------------------------------------------------------------- state
    def param_digests(self) -> torch.Tensor:
        """Digests (digest.tensor_digest) of [replicated parameters, this rank's TP slices, its KV heads' slices where
        several TP ranks hold them]; without TP everything is in the first row. With --ep the expert group's two
        rows follow (zeros without TP)."""
        rows = self.placement.digests()
        return rows if self.experts is None else torch.cat([rows, self.experts.param_digests()[:2]])

    def memory_held(self) -> dict[str, int]:
        """The bytes this rank holds, both groups together, by summary.json's per_rank names: the parameters' flat
        buffers, the gradients and the frozen parameters (each whole at stages 1 and 2, its shard at stage 3) now, and
        the most parameter and gradient bytes held at once so far (stage 3's units whole, with --ep each gather
        counting the other group's too; the buckets in flight)."""
        parts = self.parts
        return {"param_bytes": sum(b.numel() * b.element_size() for b in self.flat_buffers),
                "param_peak_bytes": (max if self.stage == 3 else sum)(e.placement.param_peak_bytes for e in parts),
                "grad_bytes": sum(e.grads.grad_bytes() for e in parts),
                "grad_peak_bytes": sum(e.grads.grad_peak_bytes for e in parts),
                "frozen_bytes": sum(e.placement.frozen_bytes() for e in parts)}

    # ---------------------------------------------------------------- optimizer state: the sharded AdamW's
    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        return [t for e in self.parts for t in e.adamw.optimizer_state_tensors()]

    def expected_state_bytes(self) -> int:
        """The ZeRO formula for this rank: bytes per owned value (AdamWShard.state_bytes_per_value) x its shards."""
        return sum(e.adamw.state_bytes_per_value * e.layout.shard_numel for e in self.parts)

    def master_views(self) -> list[torch.Tensor]:
        """This rank's fp32 master values where they lie (AdamWShard.master_views). Call wait_params() first."""
        return self.adamw.master_views()

    @property
    def step_count(self) -> int:
        return self.adamw.step_count

    def shard_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shard: its masters (an independent copy in fp32), moments and step count (this group's: with
        --ep a checkpoint holds the expert group's too, checkpoint.homes.shard_parts)."""
        return self.adamw.state_dict()

    def load_shard_state_dict(self, sd: dict) -> None:
        """Restore this rank's shard (same layout), then the parameters follow the masters. `sd["master"]` may be its
        parts in shard order, as master_views() gives them (a resume reads into them; a view onto itself is not
        copied). With --ep the expert group's keys are prefixed expert_."""
        for e in self.parts:
            own = {k.removeprefix("expert_"): v for k, v in sd.items() if k.startswith("expert_") == (e is not self)}
            e.placement.before_update()
            with torch.no_grad():
                e.adamw.load_state_dict(own)
                e._publish_params()

    @property
    def param_count(self) -> int:
        """Parameters of the full model (each TP-sliced tensor counted at its full size)."""
        experts = 0 if self.experts is None else self.experts.param_count * self.mesh.ep_size
        return experts + sum(math.prod(self.tp_slices[s.name].full_shape) if s.name in self.tp_slices else s.numel
                             for s in self.layout.slots)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's parameters in its state_dict names, fp32 on the CPU, one independent tensor each (a
        collective: with TP of the TP group, at stage 3 of the DP group too)."""
        if self.experts is not None:
            raise NotImplementedError("the full model of an expert-parallel run is not gathered yet")
        return self.full_tensors(self.placement.gathered_flat())

    def full_tensors(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The full model's tensors by name, fp32 on the CPU, from a buffer in this rank's flat layout (a collective
        of the TP group, whose split tensors are gathered)."""
        T, gathered = self.mesh.tp_size, flat.detach()
        if T > 1:  # every TP rank's buffer, in TP rank order
            gathered = torch.empty(T * self.layout.padded_numel, dtype=flat.dtype, device=flat.device)
            self.mesh.tp.all_gather(gathered, flat.detach().contiguous(), "all_gather_tp_state")
        ranks = gathered.float().cpu().chunk(T)
        return {name: t.clone() for name, t in full_tensors(self.layout, self.tp_slices, ranks).items()}
