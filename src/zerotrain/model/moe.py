"""A mixture of experts in place of a block's MLP: the router, the experts, Qwen2-MoE's shared expert, and the routing
each forward leaves for the balancing loss.

    router    logits = gate(x) (E per token), probabilities = softmax in fp32, the top-k of them chosen (ties to the
              lower expert, as torch.topk), renormalised to sum to 1 where the model asks (norm_topk_prob; Mixtral's
              always): transformers' TopKRouter exactly; gpt-oss's gate has a bias and weighs its top-k experts by
              a softmax over their logits in the logits' own dtype (GptOssTopKRouter: bf16 in a bf16 run)
    experts   SwiGLU MLPs; gpt-oss's with biases and a clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 gate) with
              the gate clamped above and up both sides at 7
    dispatch  dropless: the N tokens' N k (token, expert) pairs sorted by expert (stable: by token within one), no
              capacity, no token dropped; `expert_outputs(experts, tokens, counts)` computes every expert on its own
              rows of the sorted tokens: the one seam expert parallelism puts its all-to-all around (send each
              expert's rows to its rank, counts first, and the outputs back)
    combine   each token's k outputs, weighted, summed in slot order (a gather back, no atomics: deterministic on
              every device)
    shared    Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x) added to the routed experts' output

Parameter names are Hugging Face's per-expert names (mlp.gate.weight, mlp.experts.{e}.gate_proj.weight, ...,
mlp.shared_expert.*, mlp.shared_expert_gate.weight), each expert an nn.Linear triple, so that import, export, LoRA
and the engine's flat buffers treat an expert's matrices as any MLP's. An expert no token was routed to is not run:
its parameters get no gradient in that micro-batch, which the engine reduces as zeros.

Two computations of the experts, equal: `expert_loop` (one matmul triple per expert with tokens: the reference) and
`expert_grouped` (torch._grouped_mm over the experts' own weights, one call per projection, keeping no stacked copy
for the backward: GroupedLinear), taken where the
device and dtype have it (`grouped_mm_works`) and the layer's path is "grouped"; torch 2.13's CPU build has it for
fp32 and bf16 with rows of a multiple of 16 bytes.

Under tensor parallelism (`plan`, `parallelize`) the router and the shared expert's gate are replicated (every TP
rank routes the same tokens the same way, from the full hidden state) and each expert is split as the dense MLP is:
gate_proj and up_proj by rows of the hidden width, down_proj by its matching input columns. Each rank combines its
partial expert outputs (weighted, in slot order) and the layer's output is all-reduced once, not once per expert.
The routing weights (and the shared gate's output) multiply partial sums, so their gradients are all-reduced
(copy_to_tp: N k numbers); the experts' input gradient too, as the MLP's. gpt-oss's down_proj biases are added
once, after the all-reduce, as sum_k weight_k bias_{expert_k} computed on every rank alike (under expert
parallelism from every expert's biases, which `exchange.every_expert` gathers from the EP group).

The balancing loss (Switch Transformer's, as transformers' load_balancing_loss_func computes it over one forward)
is taken per row of the batch: `balancing_loss` pools the routing of every MoE layer for the row's tokens; the rows
its caller leaves out (training's rows without a trained token) give zero and no gradient.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotrain.config import ModelConfig

from .recompute import in_backward
from .tensor_parallel import ColumnParallelLinear, TPSlice, blocks, copy_to_tp, reduce_from_tp


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# gpt-oss's clamped SwiGLU (transformers' GptOssExperts: swiglu_limit and swiglu_alpha, fixed by its released models)
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's: the gate clamped above and the up projection both sides at SWIGLU_LIMIT, gate * sigmoid(alpha gate)
    times (up + 1)."""
    gate = gate.clamp(min=None, max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


class Expert(nn.Module):
    """One expert: a SwiGLU MLP of its own width (the shared expert too); gpt-oss's with biases and its clamped
    SwiGLU."""

    def __init__(self, width: int, hidden: int, bias: bool = False, activation=swiglu):
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(width, hidden, bias=bias)
        self.up_proj = nn.Linear(width, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))


def routed_experts(n: int, build) -> list[nn.Module]:
    """`n` experts from `build`: each built on its own, or on the meta device the first built and the others copies
    of it (meta_copy). A plan builds every expert of the largest models on the meta device (DeepSeek-V3-671B: 14,906
    experts, 45k linears), where nn.Linear's construction costs 3x a copy (measured: 49 us of CPU a linear built,
    16 us copied, 2 shared cores)."""
    first = build()
    if not all(p.is_meta for p in first.parameters()):
        return [first] + [build() for _ in range(n - 1)]
    return [first] + [meta_copy(first) for _ in range(n - 1)]


def meta_copy(module: nn.Module) -> nn.Module:
    """A module as `module` (on the meta device) was built: its class and attributes, with containers (its
    parameters', buffers', submodules', hooks') of its own, a fresh meta tensor of each parameter's and buffer's shape
    and dtype, each submodule a meta_copy: nothing is shared with `module` but plain values (widths, the activation
    function)."""
    state = module.__dict__.copy()
    for key, value in state.items():
        if isinstance(value, (dict, set)):
            state[key] = value.copy()
    params, buffers = state["_parameters"], state["_buffers"]
    # torch.empty, not empty_like: on the meta device empty_like runs torch's Python reference (3x the cost)
    for name, p in params.items():
        if p is not None:
            params[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
    for name, b in buffers.items():
        if b is not None:
            buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    modules = state["_modules"]
    for name, child in modules.items():
        if child is not None:
            modules[name] = meta_copy(child)
    copy = object.__new__(type(module))
    copy.__dict__.update(state)
    return copy


class Routing(NamedTuple):
    """What one MoE layer's forward leaves for the balancing loss and the metrics, per row of the batch."""

    probability_sums: torch.Tensor  # (B, E) fp32: each expert's router probability summed over the row's tokens
    counts: torch.Tensor  # (B, E) fp32, no gradient: the row's tokens routed to each expert (top-k choices)
    tokens: int  # tokens per row


class MoE(nn.Module):
    """Router, E experts of width `expert_ffn`, and (Qwen2-MoE) a shared expert behind a sigmoid gate."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k, self.renormalize = cfg.n_experts, cfg.experts_per_token, cfg.renormalizes
        self.softmax_of_top_k = cfg.gpt_oss_experts  # gpt-oss's: the weights are a softmax over the top-k logits
        biased, activation = cfg.gpt_oss_experts, clamped_swiglu if cfg.gpt_oss_experts else swiglu
        self.gate = nn.Linear(cfg.n_embd, cfg.n_experts, bias=biased)
        self.experts = nn.ModuleList(routed_experts(
            cfg.n_experts, lambda: Expert(cfg.n_embd, cfg.expert_ffn, biased, activation)))
        if cfg.shared_expert_width:
            self.shared_expert = Expert(cfg.n_embd, cfg.shared_expert_width)
            self.shared_expert_gate = nn.Linear(cfg.n_embd, 1, bias=False)
        self.tp_comm = None  # under TP: the experts' input gradient and the layer's output summed over it (parallelize)
        self.path = "auto"  # "loop", "grouped", or auto: grouped on CUDA where it works, the loop elsewhere
        self.routing: Routing | None = None  # the last forward's (balancing_loss takes it)
        self.balanced = True  # False: its routing is not recorded (a multi-token-prediction layer's: model/mtp.py)
        # Expert parallelism (parallel/experts.py): `experts` holds this rank's block of them (a ModuleDict keyed by
        # their global index, so names stay Hugging Face's) and `exchange(moe, rows, counts, path)` computes every
        # sorted row's expert output across the EP group. None: every expert here.
        self.exchange = None

    def local_experts(self) -> list[Expert]:
        """The experts this rank holds, in expert order: all of them, or its EP block."""
        return list(self.experts.values()) if isinstance(self.experts, nn.ModuleDict) else list(self.experts)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' output for tokens `x` (B, T, C), routed from `router_input` where the model routes from
        another tensor than the experts read (Gemma 4: the block's un-normed residual), else from `x`."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        weights, chosen = self.route(flat if router_input is None else router_input.reshape(-1, C), B, T)
        order = chosen.reshape(-1).argsort(stable=True)  # the (token, slot) pairs by expert
        counts = torch.bincount(chosen.reshape(-1), minlength=self.n_experts)
        comm = self.tp_comm  # under TP the experts' outputs are this rank's partial sums: see the module docstring
        expert_input = copy_to_tp(flat, comm)
        rows = expert_input[order // self.top_k]
        if self.exchange is not None:  # expert parallelism: the rows go to their experts' ranks and come back
            outputs = self.exchange(self, rows, counts, self.expert_path(flat))
        else:
            outputs = expert_outputs(self.local_experts(), rows, counts, self.expert_path(flat))
        # back to (token, slot) order: each token's k outputs, weighted and summed in slot order
        unsorted = outputs[inverse_order(order)]
        y = (unsorted.view(-1, self.top_k, C) * copy_to_tp(weights.to(x.dtype), comm).unsqueeze(-1)).sum(1)
        shared = self.shared_output(flat, expert_input)
        y = reduce_from_tp(y if shared is None else y + shared, comm)
        down = self.local_experts()[0].down_proj
        if isinstance(down, PartialDown) and down.bias is not None:
            # gpt-oss's down biases, once: each token's weights over the E experts times their biases
            dense = torch.zeros(len(flat), self.n_experts, dtype=x.dtype, device=x.device)
            biases = torch.stack([e.down_proj.bias for e in self.local_experts()])
            if self.exchange is not None:  # expert parallelism: this rank holds its block's; every expert's here
                biases = self.exchange.every_expert(biases)
            y = y + dense.scatter(1, chosen, weights.to(x.dtype)) @ biases
        return y.view(B, T, C)

    def shared_output(self, flat: torch.Tensor, expert_input: torch.Tensor) -> torch.Tensor | None:
        """What the experts every token goes through add (under TP this rank's partial sum, from `expert_input`, the
        tokens whose gradient is summed over the group), or None: Qwen2-MoE's sigmoid-gated shared expert here."""
        if not hasattr(self, "shared_expert"):
            return None
        return copy_to_tp(torch.sigmoid(self.shared_expert_gate(flat)), self.tp_comm) * self.shared_expert(expert_input)

    def route(self, flat: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the top-k weights (N, k): fp32, gpt-oss's in the activations' dtype; the experts chosen (N, k)); records
        the layer's Routing."""
        logits = self.gate(flat)
        probs = torch.softmax(logits.float(), dim=-1)  # the balancing loss's, gpt-oss's too (as transformers')
        if self.softmax_of_top_k:  # the same experts (softmax keeps the order), weighted among themselves
            # in the logits' dtype, as transformers' GptOssTopKRouter: in bf16 an fp32 softmax's weights are up to
            # 2e-3 off bf16's, and their gradient into the router too
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        else:
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.record_routing(probs, chosen, B, T)
        return weights, chosen

    def record_routing(self, probs: torch.Tensor, chosen: torch.Tensor, B: int, T: int) -> None:
        """Keep the forward's Routing (the router's fp32 probabilities (N, E), the experts chosen (N, k)) for the
        balancing loss."""
        if in_backward() or not self.balanced:
            # a forward recomputed for the backward (activation checkpointing): the balancing loss took the
            # forward's routing; recorded again, this one would hold its graph past the backward
            return
        with torch.no_grad():
            counts = torch.zeros(B, self.n_experts, dtype=torch.float32, device=chosen.device)
            counts.scatter_add_(1, chosen.view(B, T * self.top_k), torch.ones(B, T * self.top_k, device=chosen.device))
        self.routing = Routing(probs.view(B, T, -1).sum(1), counts, T)

    def expert_path(self, flat: torch.Tensor) -> str:
        if self.path != "auto":
            return self.path
        return "grouped" if flat.device.type == "cuda" and grouped_mm_works(flat.device.type, flat.dtype) else "loop"


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """The permutation that puts rows taken in `order` back where they came from (rows[order][inverse] == rows)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))


def expert_outputs(experts: nn.ModuleList, tokens: torch.Tensor, counts: torch.Tensor, path: str = "loop",
                   sizes: list[int] | None = None):
    """Each expert's output on its rows of `tokens` (sorted by expert, counts[e] rows for expert e), in that order.

    The seam of expert parallelism: given the tokens routed to this rank's experts, sorted, and their counts. Experts
    with LoRA adapters (model/lora.py: forward hooks on their linears) take the loop, which calls the linears.
    `sizes`: the counts as the host has read them already (expert parallelism reads them with its split sizes)."""
    if path == "grouped" and aligned(tokens, experts) and not hasattr(experts[0].gate_proj, "lora_A"):
        return expert_grouped(experts, tokens, counts)
    return expert_loop(experts, tokens, counts, sizes)


def expert_loop(experts: nn.ModuleList, tokens: torch.Tensor, counts: torch.Tensor,
                sizes: list[int] | None = None) -> torch.Tensor:
    """The reference: one expert at a time on its rows; an expert without rows is not run. It reads the counts
    (the layer's one host read) unless the caller gives them as `sizes`."""
    pieces = tokens.split(counts.tolist() if sizes is None else sizes)
    return torch.cat([expert(rows) for expert, rows in zip(experts, pieces) if len(rows)] or [tokens[:0]])


def expert_grouped(experts: nn.ModuleList, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm over the experts' own weights, one call per projection (GroupedLinear)."""
    offsets = counts.cumsum(0).to(torch.int32)

    def grouped(x: torch.Tensor, name: str) -> torch.Tensor:
        linears = [getattr(e, name) for e in experts]
        biased = linears[0].bias is not None and not isinstance(linears[0], PartialDown)  # PartialDown: after the sum
        biases = [p.bias for p in linears] if biased else []
        return GroupedLinear.apply(x, counts, offsets, len(linears), *(p.weight for p in linears), *biases)

    return grouped(experts[0].activation(grouped(tokens, "gate_proj"), grouped(tokens, "up_proj")), "down_proj")


class GroupedLinear(torch.autograd.Function):
    """Each expert's linear on its rows of x (sorted by expert, `offsets` their ends), as one _grouped_mm.

    _grouped_mm takes the experts' weights as one (E, in, out) tensor; built with torch.stack under autograd, that
    stacked copy is what _grouped_mm saves for its backward: one full copy of the layer's expert weights per
    projection, kept until the backward (ZeRO-3's gathered units freed, yet the copy held). Here the copy is made
    for the call and dropped; the backward keeps the experts' parameters themselves (held anyway) and the offsets,
    and stacks the weights again for its own call. The matmuls are those torch's autograd of _grouped_mm runs:
    dx = grad W, dW^T = x^T grad grouped along the rows; a bias's gradient is each expert's column sums of grad,
    as a grouped product with columns of ones (a matmul's fixed order, where index_add_ would use atomics).
    """

    @staticmethod
    def forward(ctx, x, counts, offsets, n_experts, *weights_and_biases):
        weights, biases = weights_and_biases[:n_experts], weights_and_biases[n_experts:]
        ctx.n_experts = n_experts
        ctx.save_for_backward(x, offsets, *weights)
        y = torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)
        if biases:
            y = y + torch.stack(biases).repeat_interleave(counts, dim=0, output_size=len(x))
        ctx.biased = bool(biases)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch._grouped_mm(grad, torch.stack(weights), offs=offsets) if ctx.needs_input_grad[0] else None
        n = ctx.n_experts
        dw = [None] * n  # frozen experts (a reference copy, a LoRA base) get none
        if any(ctx.needs_input_grad[4:4 + n]):
            dw = torch._grouped_mm(x.t(), grad, offs=offsets).transpose(1, 2).unbind(0)
        db = [None] * n if ctx.biased else []
        if ctx.biased and any(ctx.needs_input_grad[4 + n:]):
            ones = grad.new_ones(len(grad), 16 // grad.element_size())  # _grouped_mm's rows: whole 16 bytes
            db = list(torch._grouped_mm(grad.t(), ones, offs=offsets)[..., 0].unbind(0))
        return dx, None, None, None, *dw, *db


def aligned(tokens: torch.Tensor, experts: nn.ModuleList) -> bool:
    """_grouped_mm's rows must be whole multiples of 16 bytes: the width and the experts' hidden width."""
    per_row = 16 // tokens.element_size()
    return tokens.shape[1] % per_row == 0 and experts[0].gate_proj.weight.shape[0] % per_row == 0


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs, forward and backward, on this device and dtype (tried once, on 2 tiny
    experts)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.ones(4, 16, dtype=dtype, device=device_type, requires_grad=True)
        b = torch.ones(2, 16, 16, dtype=dtype, device=device_type, requires_grad=True)
        out = torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32, device=device_type))
        out.backward(torch.ones_like(out))
        return True
    except (RuntimeError, NotImplementedError):
        return False


class PartialDown(nn.Module):
    """An expert's down_proj under TP: this rank's input columns' partial product, without the bias (replicated),
    which the MoE layer adds once after its all-reduce."""

    def __init__(self, full: nn.Linear, weight: TPSlice, rank: int):
        super().__init__()
        self.weight = nn.Parameter(weight.take(full.weight.detach(), rank))
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def expert_names(cfg: ModelConfig) -> list[str]:
    """The experts of an MoE layer by their names under mlp.: experts.{e}, and shared_expert (Qwen2-MoE)."""
    return [f"experts.{e}" for e in range(cfg.n_experts)] + (["shared_expert"] if cfg.shared_expert_width else [])


def plan(cfg: ModelConfig, tp: int, prefix: str) -> dict[str, TPSlice]:
    """The TP slices of the MoE layer at `prefix` (model.layers.{i}.mlp.): each expert's gate_proj and up_proj by rows
    of its hidden width (their biases alike), down_proj by the matching input columns (its bias replicated); the
    router and the shared expert's gate replicated."""
    C, slices = cfg.n_embd, {}
    for name in expert_names(cfg):
        W = cfg.shared_expert_width if name == "shared_expert" else cfg.expert_ffn
        rows = blocks(W // tp, tp)
        for proj in ("gate_proj", "up_proj"):
            slices[f"{prefix}{name}.{proj}.weight"] = TPSlice(0, (W, C), rows)
            if cfg.gpt_oss_experts and name != "shared_expert":
                slices[f"{prefix}{name}.{proj}.bias"] = TPSlice(0, (W,), rows)
        slices[f"{prefix}{name}.down_proj.weight"] = TPSlice(1, (C, W), rows)
    return slices


def parallelize(moe: MoE, slices: dict[str, TPSlice], prefix: str, rank: int, comm) -> None:
    """Replace the MoE layer's experts' linears by this TP rank's slices of them, in place (`plan`'s slices)."""
    named = [(f"experts.{e}", expert) for e, expert in enumerate(moe.experts)]
    if hasattr(moe, "shared_expert"):
        named.append(("shared_expert", moe.shared_expert))
    for expert_name, expert in named:
        h = f"{prefix}{expert_name}."
        for proj in ("gate_proj", "up_proj"):
            setattr(expert, proj, ColumnParallelLinear(getattr(expert, proj), slices[f"{h}{proj}.weight"],
                                                       slices.get(f"{h}{proj}.bias"), rank, None))
        expert.down_proj = PartialDown(expert.down_proj, slices[h + "down_proj.weight"], rank)
    moe.tp_comm = comm


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def balancing_loss(model: nn.Module, take: bool = True, rows: torch.Tensor | None = None,
                   whole_rows=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(each row's balancing loss (B,), the tokens each expert got per MoE layer (layers, E), summed over the rows)
    from the routing the model's last forward left; None for a model without experts. With `take` the routing is
    cleared (it holds the forward's graph). `rows` (bool (B,)) says which rows count: the others' losses are zeros,
    with no gradient, and their tokens are not in the loads (None: every row).

    Per row b, over its T tokens and the L MoE layers pooled (transformers' load_balancing_loss_func over a forward
    of that one row): f_e = the row's top-k choices of expert e / (L T), P_e = the row's router probabilities of e
    summed / (L T), loss = E sum_e f_e P_e; f carries no gradient, P does.

    Context parallelism (each rank holds a part of every row): `whole_rows` sums a (B, n) tensor without gradient
    over the ranks holding the rows' other parts. f, T and `rows` are then the whole row's, P this part's sum over
    the whole row's L T: the loss returned is this part's share, the parts' shares add up to the whole row's loss and
    each part's P gets the whole row's gradient E f_e / (L T). The loads stay this part's tokens'."""
    layers = [m for m in moe_layers(model) if m.routing is not None]
    if not layers:
        return None
    routings = [m.routing for m in layers]
    if take:
        for m in layers:
            m.routing = None
    counts = sum(r.counts for r in routings)
    tokens = torch.full_like(counts[:, :1], routings[0].tokens)
    if whole_rows is not None:  # one sum of [counts, tokens, trained] per micro-batch over the row's parts
        trained = torch.ones_like(tokens) if rows is None else rows.to(counts.dtype)[:, None]
        counts, tokens, trained = whole_rows(torch.cat([counts, tokens, trained], 1)).split([counts.shape[1], 1, 1], 1)
        rows = None if rows is None else trained[:, 0] > 0
    pooled = len(routings) * tokens
    f = counts / pooled
    p = sum(r.probability_sums for r in routings) / pooled
    per_row = layers[0].n_experts * (f * p).sum(-1)
    counted = torch.ones_like(per_row) if rows is None else rows.to(per_row.dtype)
    loads = torch.stack([(r.counts * counted[:, None]).sum(0) for r in routings])
    # where, not a product: a row left out passes no gradient back, whatever its routing
    return (per_row if rows is None else torch.where(rows, per_row, torch.zeros_like(per_row))), loads
