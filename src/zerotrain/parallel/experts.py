"""Expert parallelism (--ep E): each MoE layer's experts split over E ranks, tokens sent to them by all-to-all, and the
engine that reduces and shards the expert parameters over the ranks that hold the same experts.

Its groups, the dispatch and the two engines' schedule: docs/design.md, "Expert parallelism".
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from zerotrain.model.recompute import in_backward
from zerotrain.model.moe import expert_outputs, inverse_order, moe_layers

from .comm import Comm
from .engine import ZeroEngine
from .mesh import Mesh
from .units import bucket_units, model_units


def is_expert_parameter(name: str) -> bool:
    """A routed expert's parameter (model/moe.py's mlp.experts.{e}.*), not the router's or the shared expert's."""
    return ".experts." in name


def expert_mesh(mesh: Mesh) -> Mesh:
    """The mesh the expert engine runs over: dp_shard_mod_ep as its shard group, the run's replica groups, TP group
    and `world` (the step's scalar all-reduce is the dense engine's); no KV heads among the experts."""
    return dataclasses.replace(mesh, dp_shard=mesh.dp_shard_mod_ep, kv=None, kv_replicas=1)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with autograd: the backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, comm: Comm, out_splits: list[int], in_splits: list[int], purpose: str):
        ctx.comm, ctx.splits, ctx.purpose = comm, (out_splits, in_splits), purpose
        return comm.all_to_all(rows, out_splits, in_splits, purpose)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return ctx.comm.all_to_all(grad.contiguous(), in_splits, out_splits, ctx.purpose + "_backward"), \
            None, None, None, None


def all_to_all_rows(rows: torch.Tensor, comm: Comm, out_splits: list[int], in_splits: list[int],
                    purpose: str) -> torch.Tensor:
    return _AllToAll.apply(rows.contiguous(), comm, out_splits, in_splits, purpose)


def expert_major_order(per_source: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """The received rows, laid out by (source rank, expert) with per_source[s, j] rows each, as indices in (expert,
    source rank) order: each local expert's rows together, its sources in rank order. `total`: their number, where
    the caller has read it already (else read here)."""
    E, local = per_source.shape
    lengths = per_source.reshape(-1)
    starts = (lengths.cumsum(0) - lengths).view(E, local)
    block_starts, block_lengths = starts.t().reshape(-1), per_source.t().reshape(-1)
    out_starts = block_lengths.cumsum(0) - block_lengths
    total = int(lengths.sum()) if total is None else total
    shift = torch.repeat_interleave(block_starts - out_starts, block_lengths, output_size=total)
    return torch.arange(total, device=per_source.device) + shift


class ExpertExchange:
    """A MoE layer's `exchange` under --ep: its sorted rows to their experts' ranks, computed there, and back."""

    def __init__(self, comm: Comm, n_experts: int):
        self.comm, self.ep = comm, comm.world_size
        self.local = n_experts // self.ep
        # the most bytes of rows one training call sent and received (the memory plan's all-to-all buffers, checked
        # by it)
        self.sent_bytes_most = self.received_bytes_most = 0

    def __call__(self, moe, rows: torch.Tensor, counts: torch.Tensor, path: str) -> torch.Tensor:
        E, local = self.ep, self.local
        # Counts first: rank r gets, from every source, the source's rows for each of r's experts (source order).
        per_source = self.comm.all_to_all(counts.contiguous(), [local] * E, [local] * E,
                                          "all_to_all_expert_counts").view(E, local)
        # the split sizes, sent and received, and the received rows of each local expert (the expert loop's split):
        # the layer's one read of the device
        received_by_expert = per_source.sum(0)
        splits = [int(n) for n in torch.cat([counts.view(E, local).sum(1), per_source.sum(1),
                                             received_by_expert]).tolist()]
        sent, received, by_expert = splits[:E], splits[E:2 * E], splits[2 * E:]
        gathered = all_to_all_rows(rows, self.comm, received, sent, "all_to_all_expert_rows")
        if torch.is_grad_enabled():  # a training micro-batch's (not an evaluation's or a reference's, of other sizes)
            self.sent_bytes_most = max(self.sent_bytes_most, rows.numel() * rows.element_size())
            self.received_bytes_most = max(self.received_bytes_most, gathered.numel() * gathered.element_size())
        order = expert_major_order(per_source, sum(received))
        outputs = expert_outputs(moe.local_experts(), gathered[order], received_by_expert, path, by_expert)
        return all_to_all_rows(outputs[inverse_order(order)], self.comm, sent, received, "all_to_all_expert_outputs")

    def every_expert(self, local: torch.Tensor) -> torch.Tensor:
        """Rows stacked per local expert (gpt-oss's down biases under TP) -> every expert's, in expert order: an
        all-gather over the EP group, as an all-to-all of E copies, whose backward sums each expert's gradient over
        the EP group's tokens (in EP rank order) on the rank that holds it."""
        n = len(local)
        return all_to_all_rows(local.repeat(self.ep, *([1] * (local.dim() - 1))), self.comm, [n] * self.ep,
                               [n] * self.ep, "all_to_all_expert_biases")


def shard_experts(model: torch.nn.Module, mesh: Mesh) -> None:
    """Keep this rank's block of each MoE layer's experts (by their global index, so names stay Hugging Face's) and
    route the layer through the EP group. The model is on the meta device: nothing is allocated or freed."""
    if mesh.ep_size == 1:
        return
    keep_expert_block(model, mesh.ep_size, mesh.ep_rank)
    for moe in moe_layers(model):
        moe.exchange = ExpertExchange(mesh.ep, moe.n_experts)


def expert_bytes(engine) -> int:
    """Bytes this rank holds for the routed experts' parameters and optimizer state: the expert engine's, or their
    slots of the one flat buffer (at ZeRO-3 their owned pieces) and their owned pieces' state. Under TP: 0."""
    if isinstance(engine, ExpertParallelEngine):
        return engine.expert_bytes()
    if engine.mesh.tp_size > 1:
        return 0
    L, rank = engine.layout, engine.dp.rank
    slots = [s for s in L.slots if is_expert_parameter(s.name)]
    owned = sum(p.numel for s in slots for p in L.owned_pieces(rank, s.offset, s.offset + s.numel))
    held = owned if engine.stage == 3 else sum(s.numel for s in slots)
    return held * engine.held_params.element_size() + engine.expected_state_bytes_per_value() * owned


def all_to_all_bytes_most(model: torch.nn.Module) -> tuple[int, int]:
    """The most bytes of rows one MoE layer's exchange has sent and received in one call on this rank (0, 0 without
    --ep)."""
    exchanges = [m.exchange for m in moe_layers(model) if isinstance(getattr(m, "exchange", None), ExpertExchange)]
    return (max((x.sent_bytes_most for x in exchanges), default=0),
            max((x.received_bytes_most for x in exchanges), default=0))


def keep_expert_block(model: torch.nn.Module, ep: int, ep_rank: int = 0) -> None:
    """Keep EP rank `ep_rank`'s block of each MoE layer's experts (a ModuleDict keyed by their global index, so that
    names stay Hugging Face's). On a model on the meta device nothing is allocated or freed."""
    for moe in moe_layers(model):
        local = moe.n_experts // ep
        first = ep_rank * local
        moe.experts = torch.nn.ModuleDict({str(e): moe.experts[e] for e in range(first, first + local)})


class ExpertParallelEngine:
    """Two ZeRO engines over one model, both of the run's stage: `dense` over the shard group, `experts` over
    dp_shard_mod_ep; the engine interface, each member covering both (`layout` is the dense engine's)."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, optim, **kwargs):
        self.dense = ZeroEngine(model, mesh.dp_shard, optim, mesh=mesh, select=lambda n: not is_expert_parameter(n),
                                **kwargs)
        self.experts = ZeroEngine(model, mesh.dp_shard_mod_ep, optim, mesh=expert_mesh(mesh), select=is_expert_parameter,
                                  **kwargs)
        self.model, self.mesh = model, mesh
        self.stage, self.precision, self.device = self.dense.stage, self.dense.precision, self.dense.device
        self.tp_slices = self.dense.tp_slices  # the model's TP plan (both engines')
        self.experts_per_rank = len(moe_layers(model)[0].local_experts())  # of each MoE layer (checkpoints record it)
        self._join_at_moe_output(model)
        if self.dense.stage == 3:
            # the parameter peak is both engines' units whole at once
            self.dense.placement.param_bytes_beside, self.experts.placement.param_bytes_beside = \
                self.experts.param_bytes, self.dense.param_bytes
        elif kwargs.get("overlap_gathers", True):
            # The grouped path reads the experts' weights without calling their linears, whose pre-hooks wait for
            # their all-gathers: each MoE layer waits for its experts' buckets first
            for moe in moe_layers(model):
                moe.register_forward_pre_hook(lambda *_: self.experts.wait_params())
        # Both engines take their values from the one source (kwargs' init), whose counts run on: what it had read
        # and drawn once the second engine was built is both engines' (their sum counted the dense part twice)
        self.init_bytes_read = self.experts.init_bytes_read
        self.init_values_drawn = self.experts.init_values_drawn

    def _join_at_moe_output(self, model: torch.nn.Module) -> None:
        """The experts' unit backward begun (their reductions joined, at ZeRO-3 their gathers) as the gradient of each
        MoE layer's output arrives, the same point of every rank's backward (why: docs/design.md)."""
        units = model_units(model)
        if self.experts.stage != 3:  # (stage 3 schedules its reductions by units itself)
            self.experts.grads.schedule_by_units(bucket_units(model, self.experts.layout))
        for moe in moe_layers(model):
            unit = max(u for u, modules in enumerate(units) if any(moe is m for top in modules for m in top.modules()))
            moe.register_forward_hook(self._on_moe_output(unit))

    def _on_moe_output(self, unit: int):
        """The forward hook of the MoE layer in `unit`: its output's gradient begins the unit's experts' backward
        (their reductions, whether they get gradients or not; at ZeRO-3 their gathers)."""

        def hook(_module, _args, output):
            if torch.is_grad_enabled() and output.requires_grad and not in_backward():
                output.register_hook(lambda _grad: self.experts.grads.begin_unit_backward(unit))

        return hook

    @property
    def holds_whole_model(self) -> bool:
        return self.dense.holds_whole_model  # both engines' placement is the run's stage's

    @property
    def gathers_units(self) -> bool:
        return self.dense.gathers_units

    def computed_norms(self, norms: list[float]) -> list[float]:
        """The norm each world rank computes with, from each rank's param_norm (dense and experts together)."""
        return self.dense.computed_norms(norms)

    @property
    def parts(self) -> list[ZeroEngine]:
        return [self.dense, self.experts]

    @property
    def layout(self):
        """The dense engine's layout (over the DP group); the experts' is experts.layout."""
        return self.dense.layout

    @property
    def flat_buffers(self) -> list[torch.Tensor]:
        return [self.dense.held_params, self.experts.held_params]

    @property
    def step_count(self) -> int:
        return self.dense.step_count  # the two step together

    def register_update_pre_hook(self, hook) -> None:
        """`hook()` runs before every update of either engine's state (an async save's staging copy waits there)."""
        self.dense.register_update_pre_hook(hook)
        self.experts.register_update_pre_hook(hook)

    def param_norm(self) -> torch.Tensor:
        """The L2 norm of the parameters this rank computes with, float64 [1]: its dense values and, at stages 1 and
        2, its EP group's experts (so that the norm is --ep 1's); at ZeRO-3 its dense and expert shards."""
        dense = self.dense.param_norm().square()
        experts = self.experts.param_norm().square()
        if self.stage != 3:
            experts = self.mesh.ep.all_reduce(experts, "all_reduce_expert_norms")
        return (dense + experts).sqrt()

    def frozen_bytes(self) -> int:
        return self.dense.frozen_bytes() + self.experts.frozen_bytes()

    def expected_state_bytes_per_value(self) -> int:
        return self.dense.expected_state_bytes_per_value()  # the run's precision's, both engines'

    @contextlib.contextmanager
    def no_sync(self, enabled: bool = True):
        with self.dense.no_sync(enabled), self.experts.no_sync(enabled):
            yield

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.experts.zero_grad()

    def reduce_grads(self, extras: torch.Tensor):
        return self.dense.reduce_grads(extras, beside=(self.experts,))

    def apply(self, lr: float, grad_norm: float) -> None:
        self.dense.apply(lr, grad_norm)
        self.experts.apply(lr, grad_norm)

    def wait_params(self, buckets=None) -> None:
        self.dense.wait_params(buckets)
        self.experts.wait_params(buckets)

    def param_digests(self) -> torch.Tensor:
        """The dense engine's rows, then the expert engine's two: its experts' replicated values and their TP slices
        (zeros without TP), as invariants.check_no_drift compares them."""
        return torch.cat([self.dense.param_digests(), self.experts.param_digests()[:2]])

    @property
    def param_peak_bytes(self) -> int:
        """The most parameter bytes held at once, both engines' (at ZeRO-3 each gather counts the other's too)."""
        if self.stage != 3:
            return sum(b.numel() * b.element_size() for b in self.flat_buffers)
        return max(self.dense.param_peak_bytes, self.experts.param_peak_bytes)

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.dense.grad_tensors() + self.experts.grad_tensors()

    def grad_bytes(self) -> int:
        return self.dense.grad_bytes() + self.experts.grad_bytes()

    @property
    def grad_peak_bytes(self) -> int:
        return self.dense.grad_peak_bytes + self.experts.grad_peak_bytes

    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        return self.dense.optimizer_state_tensors() + self.experts.optimizer_state_tensors()

    def expected_state_bytes(self) -> int:
        return self.dense.expected_state_bytes() + self.experts.expected_state_bytes()

    def expert_bytes(self) -> int:
        """Bytes this rank holds for its experts: their parameters (at ZeRO-3 their shard) and their optimizer
        state's shard."""
        e = self.experts
        return e.held_params.numel() * e.held_params.element_size() + e.expected_state_bytes()

    @property
    def param_count(self) -> int:
        return self.dense.param_count + self.experts.param_count * self.mesh.ep_size

    def expert_state_dict(self) -> dict[str, torch.Tensor]:
        """The expert engine's shard state, its keys prefixed with expert_ (beside the dense keys in a shard file)."""
        return {f"expert_{k}": v for k, v in self.experts.shard_state_dict().items()}

    def shard_state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.dense.shard_state_dict(), **self.expert_state_dict()}

    def load_shard_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.dense.load_shard_state_dict({k: v for k, v in sd.items() if not k.startswith("expert_")})
        self.experts.load_shard_state_dict({k[len("expert_"):]: v for k, v in sd.items() if k.startswith("expert_")})

    def full_state_dict(self):
        raise NotImplementedError("the full model of an expert-parallel run is not gathered yet")
