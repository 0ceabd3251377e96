"""Expert parallelism (--ep E): each MoE layer's experts split over E ranks, tokens sent to them by all-to-all, and the
expert group the engine reduces and shards over the ranks that hold the same experts.

Its groups, the dispatch and the expert group's schedule: docs/design.md, "Expert parallelism".
"""

from __future__ import annotations

import dataclasses

import torch

from zerotrain.model.recompute import in_backward
from zerotrain.model.moe import expert_outputs, inverse_order, moe_layers

from .comm import Comm
from .mesh import Mesh
from .units import bucket_units, model_units


def is_expert_parameter(name: str) -> bool:
    """A routed expert's parameter (model/moe.py's mlp.experts.{e}.*), not the router's or the shared expert's."""
    return ".experts." in name


def expert_mesh(mesh: Mesh) -> Mesh:
    """The mesh the expert group runs over: dp_shard_mod_ep as its shard group, the run's replica groups, TP group
    and `world` (the step's scalar all-reduce is the engine's); no KV heads among the experts."""
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
    """Bytes this rank holds for the routed experts' parameters and optimizer state: the expert group's, or their
    slots of the one flat buffer (at ZeRO-3 their owned pieces) and their owned pieces' state. Under TP: 0."""
    if engine.experts is not None:  # its parameters (at ZeRO-3 their shard) and its optimizer state's shard
        e = engine.experts
        return e.held_params.numel() * e.held_params.element_size() + e.expected_state_bytes()
    if engine.mesh.tp_size > 1:
        return 0
    L, rank = engine.layout, engine.dp.rank
    slots = [s for s in L.slots if is_expert_parameter(s.name)]
    owned = sum(p.numel for s in slots for p in L.owned_pieces(rank, s.offset, s.offset + s.numel))
    held = owned if engine.stage == 3 else sum(s.numel for s in slots)
    return held * engine.held_params.element_size() + engine.adamw.state_bytes_per_value * owned


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


def attach_expert_group(engine, experts, overlap_gathers: bool) -> None:
    """Join the expert group `experts` to `engine`'s step: its unit backward begun at each MoE layer's output
    (join_at_moe_output); at ZeRO-3 the parameter peak is both groups' units whole at once; at stages 1 and 2 with
    the gathers behind the forward, each MoE layer waits for its experts' buckets (the grouped path reads their
    weights without calling their linears, whose pre-hooks wait for their all-gathers)."""
    join_at_moe_output(engine.model, experts)
    if experts.stage == 3:
        engine.placement.param_bytes_beside = experts.placement.param_bytes
        experts.placement.param_bytes_beside = engine.placement.param_bytes
    elif overlap_gathers:
        for moe in moe_layers(engine.model):
            moe.register_forward_pre_hook(lambda *_: experts.wait_params())


def join_at_moe_output(model: torch.nn.Module, experts) -> None:
    """The expert group's unit backward begun (its reductions joined, at ZeRO-3 its gathers) as the gradient of each
    MoE layer's output arrives, the same point of every rank's backward (why: docs/design.md)."""
    units = model_units(model)
    if experts.stage != 3:  # (stage 3 schedules its reductions by units itself)
        experts.grads.schedule_by_units(bucket_units(model, experts.layout))
    for moe in moe_layers(model):
        unit = max(u for u, modules in enumerate(units) if any(moe is m for top in modules for m in top.modules()))
        moe.register_forward_hook(_begins_unit_backward(experts, unit))


def _begins_unit_backward(experts, unit: int):
    """The forward hook of the MoE layer in `unit`: its output's gradient begins the unit's experts' backward
    (their reductions, whether they get gradients or not; at ZeRO-3 their gathers)."""

    def hook(_module, _args, output):
        if torch.is_grad_enabled() and output.requires_grad and not in_backward():
            output.register_hook(lambda _grad: experts.grads.begin_unit_backward(unit))

    return hook
