"""The memory plan: what each rank will hold, before the run (`zerotrain plan`), checked by the run itself.

State bytes come from the layout the engine will build (the model built on the meta device, split as the
rank's TP slice, laid out in buckets over the DP ranks), so they are exact:

    parameters           padded P x (4 fp32, 2 bf16)                          the flat parameter buffer
                         stage 3: shard x (4 | 2)                             the owned chunks (fp32: the masters)
    parameter units      stage 3 only, during a step: the root unit's buckets with the largest block's x (4 | 2),
                         the frozen base's buckets among them (with --ep the block's experts: the expert engine's
                         buckets of EP rank 0's block, over its replica group)
                         (units.units_whole_bytes: the most that is whole at once)
    frozen base          a LoRA run's base, B x (4 | 2): no gradients, no optimizer state (0 without LoRA)
                         stage 3: its own layout's shard x (4 | 2), gathered with the units (parameter units)
    gradients            stage 1: padded P x (4 | 2) (+ padded P x 4 in bf16: the fp32 accumulator) + shard x 4
                         (on one DP rank no shard: it is the fp32 buffer itself; on one rank in fp32, no
                         buffer: unpadded P x 4, autograd's own gradients)
                         stage 2: shard x 4                                   held between steps
    gradient buckets     stages 2 and 3, during a step: the two largest buckets x 4 at --accum 1 (the buckets in
                         their reduce-scatters and the one filling fit in it), and at any accumulation with
                         --grad-reduce micro-batch (stage 3's default: each micro-batch's reduced into the shard);
                         with --grad-reduce step (stage 2's default) every bucket (padded P x 4) through a window
    optimizer state      shard x 8                                            AdamW's exp_avg and exp_avg_sq
    master weights       shard x 4 in bf16; 0 in fp32, where the masters are the parameter buffer's chunks
    activations          model.activation_memory.activation_bytes, one micro-batch   what autograd keeps for backward
                         (--offload-activations: 0 on the device, the row below holds them)
                         (with packed records also their document mask: B T T a on CPU, a block mask on CUDA;
                         --method dpo: a micro-batch of B pairs is 2B sequences, chosen and rejected, whose
                         head keeps its input, each token's log-sum-exp and the targets: vocab.token_logps)
    activations on host  --offload-activations: the activations row's bytes, in host memory (training/offload.py's
                         hooks copy each saved tensor as it is saved; each storage is counted once here, its
                         packed_bytes count each saved tensor's copy: 1.06x on the tiny GPT-2, 1.35x on the tiny
                         Llama, measured on CPU); the device keeps what is saved outside the model's forward: nothing
                         (the head and the loss run inside it). Not in the device's total with CUDA
    reference            --method dpo, precomputed: 16 bytes per pair (two float64 log-probs), on every rank;
                         with --eval-every, the held-out pairs' too
    reference model      --method dpo --dpo-reference live, or --method grpo --grpo-beta > 0, in full fine-tuning: the
                         frozen copy of the initial policy (training/reference_model.py), M x (4 | 2), M the rank's
                         parameters unpadded (its TP slices and the replicated ones; a tied head once); no
                         gradients, no optimizer state
                         stage 3: shard x (4 | 2), the policy's layout; its units are whole only in its forward, when
                         the policy's are not, and never more than the policy's (parameter units)
    KV cache             --method grpo: the cache of the rank's largest sampling batch, 2 L rows KV_rank (prompt +
                         completion) head_dim x (4 | 2): rows its completions (micro-batch x accum, its prompts of one
                         length in one batch), at ZeRO-3 and with --ep G (a batch per prompt); positions --seq-len
                         (the most a prompt and its completion take: exact when the longest prompt leaves exactly
                         --max-completion-length); KV_rank the rank's KV heads under TP. Held while it samples, before
                         the loss's forward: the total counts the larger of it and the activations with the loss's
                         working set
    loss working set     activation_bytes' `working`: one chunk's fp32 logits (of this rank's vocabulary rows under
                         TP), while the loss runs; kept by nothing (--method dpo: the backward's, one chunk's
                         logits made again and the gradients of the head's input and weight)
    communication        gloo with more than 2 DP ranks: (DP - 2) x shard x 4 receive buffers; else 0
    all-to-all buffers   --ep E: one MoE layer's rows in flight at once, N k rows of C values sent and, at balanced
                         routing, N k received (N = B T tokens, top-k; parallel/experts.py's ExpertExchange), in the
                         activations' dtype: 2 N k C a. Dropless: a rank sends exactly N k rows whatever the routing,
                         and the EP group receives E N k in all, so the mean rank receives N k; one rank receives up
                         to E N k (every token of its group routed to its experts: `all_to_all_most`). A run checks
                         the rows sent exactly and the rows received against that most.
    checkpoint staging   --async-save: shard x 12, the rank's share of a checkpoint (host memory with CUDA); with
                         --dp-replicate R replica group 0's ranks (rank 0's among them) stage, the others nothing

With --dp-replicate R (hybrid sharding) every row above is ZeRO's over a replica group's S = DP / R ranks (the
layouts' world: shard = padded P / S), but autograd's own gradients (stage 1, fp32), which only one DP rank of all
keeps; `traffic` adds the all-reduce of the gradient shard across the groups, shard x 4 x 2 (R - 1) / R bytes a
step at any accumulation (with --ep the expert shard's too).

Of which experts (`experts`, not rows of their own: they are inside the rows above), with --ep and without: the
routed experts' parameters (EP rank 0's block, over its replica group, or their slots of the one flat layout at --ep
1), their gradients and their optimizer state (moments, and masters in bf16) on each rank: `expert_bytes_by_rank`,
parameters plus optimizer state, is what summary.json's per_rank expert_bytes counts, rank by rank.

where P is the rank's trained parameters (its TP slices and the replicated ones; a LoRA run's adapters), B the
rank's frozen ones and shard = padded P / DP. Where a row differs by stage, it is the answer of a part
(parallel/parts.py: the parameters' placement, the gradients' holding, the sharded AdamW, the experts), which the
plan adds up without asking the stage. Figures
are rank 0's, for the peak of a step; torch's own runtime (the interpreter and its
libraries on CPU, the CUDA context and allocator slack on a GPU) is not in them.

A run checks the plan once, after its first step (`check`): the state bytes against the tensors its engine
holds, exactly (a gradient bucket never freed, or an extra buffer, shows), and the activation bytes against the
saved-tensor count of its first micro-batch, within 10%. Under the test suite (ZEROTRAIN_STRICT_PLAN=1) a difference
is an error; in a run it is an event and a console line, and only a measured peak above the device's memory stops
it.
The state is measured twice: row by row through the engine's own accounting (its buffers, which the plan
derives from the same layout), and as one total found by walking every tensor the engine, the model's
parameters and gradients and the optimizer's state hold (`held_state_bytes`), which shares no function with
the plan: a mistake in the layout or the bucket budget that both would make alike fails the total.

With a device's memory, `zerotrain plan` also says what fits in it: the largest micro-batch (bisecting the
activations over a fixed state), and the largest model of the run's shape family (`largest_model`): the same
model with another --n-layer, every other setting as given. A plan's total grows with the depth, nearly linearly,
so the search takes Newton's steps on it from the given depth, then brackets and bisects: its answer's plan fits
and one layer more's does not, both computed by memory_plan, not extrapolated. Where the run does not fit,
`fit_advice` says which part does not (the state and its buffers, or the activations) and which settings would
make it fit, in order of cost (HOLDS_LESS), each planned by memory_plan with that setting changed.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from zerotrain.config import LORA_EXPERTS, REFERENCE_FREE, Config, validate
from zerotrain.data.jsonl import iter_records
from zerotrain.errors import ConfigError
from zerotrain.model import build_model, collection_paused, parallelize, param_count
from zerotrain.model.activation_memory import FP32, INDEX, activation_bytes, explicit_scores
from zerotrain.model.tensor_parallel import kv_heads_per_rank
from zerotrain.model.lora import adapted_modules, add_adapters, routed_expert_linears
from zerotrain.model.vocab import splits_vocab, vocab_rows
from zerotrain.parallel import Comm, ShardLayout, ZeroEngine, layout_of, units as unit_rules
from zerotrain.parallel.context import context_parallel_rows
from zerotrain.parallel.experts import all_to_all_bytes_most, is_expert_parameter, keep_expert_block
from zerotrain.parallel.params import storage_bytes
from zerotrain.parallel.parts import parts_for

from .invariants import InvariantError, held_bytes

# The rows of the table, in order: (key, label). The first four are the state a run checks exactly.
ROWS = (("parameters", "parameters"), ("parameter_units", "parameter units whole (ZeRO-3)"),
        ("frozen_base", "frozen base (LoRA)"), ("gradients", "gradients (between steps)"),
        ("optimizer_state", "optimizer state"), ("master_weights", "master weights"),
        ("gradient_buckets", "gradient buckets in flight"), ("activations", "activations (one micro-batch)"),
        ("activations_host", "activations on the host (offloaded)"),
        ("reference", "reference log-probs (DPO)"), ("reference_model", "reference model (DPO live, full FT)"),
        ("kv_cache", "KV cache while sampling (GRPO)"),
        ("loss_working_set", "loss working set (one chunk of logits)"),
        ("communication", "communication buffers"), ("all_to_all", "all-to-all buffers (EP, balanced)"),
        ("checkpoint_staging", "checkpoint staging"))
# The expert rows: what of the state rows above the routed experts are (rank 0's).
EXPERT_ROWS = (("parameters", "of which experts: parameters"), ("gradients", "of which experts: gradients"),
               ("optimizer_state", "of which experts: optimizer state"))
STATE = ("parameters", "frozen_base", "gradients", "optimizer_state", "master_weights", "reference_model")
HOST_ROWS = ("activations_host", "checkpoint_staging")  # in host memory with CUDA, not in the device's total
ACTIVATION_TOLERANCE = 0.10
# The deepest model `largest_model` searches: deeper than any transformer trained at scale (Llama 3's 405B has 126
# layers; DeepNet's deepest, 1,000). A plan of 1,024 Llama-3-8B blocks takes ~1.6 s to build on the meta device
# (2 CPU cores), one of 4,096 ~4.7 s: the cap bounds the search's cost where a small shape fits without end.
DEPTH_CAP = 1024


@dataclass
class MemoryPlan:
    """Bytes per rank by row (ROWS), and what they were computed for."""

    rows: dict[str, int]
    micro_batch: int
    dp: int
    tp: int
    device: str
    ep: int = 1
    experts: dict[str, int] | None = None  # EXPERT_ROWS' bytes, rank 0's; None for a model without experts
    expert_bytes_by_rank: list[int] | None = None  # parameters + optimizer state of the experts, each DP rank's
    all_to_all_most: int = 0  # the all-to-all buffers when one rank receives every row of its EP group
    replicas: int = 1  # --dp-replicate R: the replica groups, each of dp / R ranks holding the sharded state
    # bytes a rank sends a step by purpose (Comm's names), of what the parts beyond ZeRO add: with --dp-replicate R
    # the all-reduce of each gradient shard across the replica groups, once a step at any accumulation
    traffic: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """The peak of a step on the device: staging and offloaded activations are host memory with CUDA; GRPO's
        KV cache is gone before the loss's forward saves activations."""
        rows = self.rows.get
        beside = max(0, rows("kv_cache", 0) - rows("activations", 0) - rows("loss_working_set", 0))
        return sum(v for k, v in self.rows.items() if (k not in HOST_ROWS or self.device == "cpu")
                   and k != "kv_cache") + beside

    def summary(self) -> str:
        return f"plan {gib(self.total)} per rank (zerotrain plan)"


def gib(n: float) -> str:
    if n == 0:
        return "0"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_plan(cfg: Config, micro_batch: int | None = None, world_size: int | None = None,
                documents: bool = False, planned: PlannedModel | None = None) -> MemoryPlan:
    """What a rank of `cfg`'s run will hold (rank 0's figures; the state is every rank's), on --nproc ranks or
    `world_size`, with --micro-batch sequences or `micro_batch`; `documents`: its micro-batches carry segments
    (packed records), whose attention mask the activations then count; `planned`: planned_layouts' answer for this
    run, where the caller has it already (a huge model's build takes seconds: DeepSeek-V3-671B's 1.4 s, load 4)."""
    p, tp = cfg.parallel, cfg.parallel.tp
    parts = parts_for(cfg)  # each part answers for its own rows; the plan adds them up
    place = parts.placement
    dp = (world_size or cfg.launch.nproc) // tp
    S = parts.shard_ranks(dp)  # the ranks the state is sharded over: with --dp-replicate R, a replica group's
    B = micro_batch or cfg.loop.micro_batch
    sequences = 2 * B if cfg.objective.method == "dpo" else B  # a micro-batch of B pairs is 2B sequences
    model, _, L, experts = planned or planned_layouts(cfg, dp)
    psize = 2 if p.precision == "bf16" else 4
    padded, shard = L.padded_numel, L.shard_numel
    # with --ep the units' experts are the expert engine's buckets, whole with the rest
    units = place.units_whole_bytes(model, L, psize, prefetch=cfg.gather_in_forward, beside=experts)
    grads, buckets, communication = gradient_bytes(cfg, L, dp, psize)
    if cfg.loop.compile and place.gathers_units:
        buckets = max(buckets, compiled_block_buckets(model, L))
    if experts is not None:  # the expert engine's, over its group (x the replica groups: whether one rank keeps all)
        more = gradient_bytes(cfg, experts, experts.world_size * p.dp_replicate, psize)
        grads, buckets, communication = grads + more[0], buckets + more[1], communication + more[2]
        padded, shard = padded + experts.padded_numel, shard + experts.shard_numel
    staging = shard * 12 if cfg.checkpoint.async_save else 0  # rank 0 is in replica group 0, which writes
    activations = activation_bytes(cfg.model, sequences, cfg.model.seq_len, tp=tp, precision=p.precision,
                                   recompute=p.activation_checkpointing, device=cfg.launch.device, documents=documents,
                                   objective=cfg.objective.method, ep=p.ep)
    saved = activations["total"] + adapter_activations(cfg, model, sequences)
    rows = {
        "parameters": place.held(padded, shard) * psize,
        "parameter_units": units,
        "frozen_base": place.frozen_numel(model, S) * psize,
        "gradients": grads,
        "optimizer_state": parts.optimizer.moment_bytes(shard),
        "master_weights": parts.optimizer.master_bytes(shard),
        "gradient_buckets": buckets,
        **activation_rows(cfg, saved),
        "reference": reference_bytes(cfg),
        "reference_model": reference_model_bytes(cfg, model, L, psize, S),
        "kv_cache": kv_cache_bytes(cfg, model, psize),
        "loss_working_set": activations["working"],
        "communication": communication,
        "all_to_all": 0,
        "checkpoint_staging": staging,
    }
    most = 0
    if parts.experts is not None:  # one MoE layer's rows at once: N k sent, N k received at balanced routing
        rows["all_to_all"], most = parts.experts.all_to_all_bytes(all_to_all_row_bytes(cfg, sequences))
    for key, value in parts.more_rows(cfg=cfg, model=model, layout=L, dp=dp, psize=psize, sequences=sequences,
                                      documents=documents).items():
        rows[key] += value
    expert_rows, by_rank = expert_bytes_planned(cfg, model, L, experts, dp, psize)
    traffic = parts.traffic([L] + ([experts] if experts is not None else []))
    return MemoryPlan(rows, B, dp, tp, cfg.launch.device, p.ep, expert_rows, by_rank, most, p.dp_replicate, traffic)


def activation_rows(cfg: Config, saved: int) -> dict[str, int]:
    """Where the `saved` bytes of a micro-batch's activations wait for the backward: on the device, or with
    --offload-activations on the host (training/offload.py's hooks around the model's forward), the device keeping
    what is saved outside that forward: nothing (the head and the loss run inside the model's call)."""
    if cfg.parallel.offload_activations:
        return {"activations": 0, "activations_host": saved}
    return {"activations": saved, "activations_host": 0}


class PlannedModel(NamedTuple):
    """The model a rank of a run builds, on the meta device, and the layouts its engines lay it out in."""

    model: torch.nn.Module  # TP rank 0's slices, a LoRA run's adapters, with --ep EP rank 0's block of experts
    full_shapes: dict[str, tuple[int, ...]]  # each parameter's shape in the full model, before the TP split
    layout: ShardLayout  # the flat layout over the DP ranks (with --ep: of the parameters that are not experts)
    experts: ShardLayout | None  # --ep E: the expert engine's, EP rank 0's block over its replica group of DP / E

    @property
    def parameters(self) -> int:
        """The full model's parameters (a tied head counted once): model.param_count, without building it again."""
        return sum(math.prod(shape) for shape in self.full_shapes.values())


def planned_layouts(cfg: Config, dp: int) -> PlannedModel:
    """`cfg`'s model as a rank of a run over `dp` DP ranks lays it out (what the memory and I/O plans count): built on
    the meta device, split as TP rank 0's slice, with a LoRA run's adapters; with --ep E EP rank 0's block of experts,
    in a layout of its own over its replica group of dp / E ranks, the rest of the model in the flat layout. Every TP
    rank's slices have TP rank 0's shapes, every EP rank's block EP rank 0's."""
    p = cfg.parallel
    with collection_paused():  # the TP split replaces every split linear: as many objects again as the build
        with torch.device("meta"):
            model = build_model(cfg.model, cfg.loop.seed)
            shapes = {n: tuple(t.shape) for n, t in model.named_parameters()}
            if p.tp > 1:
                parallelize(model, p.tp, 0, None)
            if cfg.lora.rank:  # the adapters train, the base is frozen
                add_adapters(model, cfg.lora, cfg.loop.seed)
        if p.ep > 1:
            keep_expert_block(model, p.ep)
        parts = parts_for(cfg)
        shards = parts.shard_ranks(dp)
        L = layout_of(model, shards, p.bucket_numel, (lambda n: not is_expert_parameter(n)) if p.ep > 1 else None)
        experts = layout_of(model, parts.experts.replica_ranks(shards), p.bucket_numel, is_expert_parameter) \
            if parts.experts is not None else None
    return PlannedModel(model, shapes, L, experts)


def all_to_all_row_bytes(cfg: Config, sequences: int) -> int:
    """The rows one MoE layer's all-to-all sends from a rank, whatever the routing (dropless): each of the micro-batch's
    N = B T tokens' k (token, expert) rows, its C hidden values in the activations' dtype; with --cp the rank's T / cp
    tokens of each row."""
    return sequences * (cfg.model.seq_len // cfg.parallel.cp) * cfg.model.experts_per_token * cfg.model.n_embd * \
        (2 if cfg.parallel.precision == "bf16" else 4)


def expert_bytes_planned(cfg: Config, model: torch.nn.Module, L, experts, dp: int,
                         psize: int) -> tuple[dict[str, int] | None, list[int] | None]:
    """The routed experts' part of the state rows (EXPERT_ROWS, rank 0's) and each DP rank's parameters plus
    optimizer state of them (parallel/experts.py's expert_bytes, summary.json's per_rank expert_bytes): with --ep the
    expert engine's buffer (ZeRO-3: its shard) and its shard's state, equal on every rank; at --ep 1 the experts'
    slots of the one flat buffer (ZeRO-3: the rank's owned pieces of them) and the state of its owned pieces, which
    differ by rank. None for a model without experts."""
    parts = parts_for(cfg)
    place, per_value = parts.placement, parts.optimizer.state_bytes_per_value
    if experts is not None:
        grads = gradient_bytes(cfg, experts, experts.world_size * cfg.parallel.dp_replicate, psize)[0]
        params = place.held(experts.padded_numel, experts.shard_numel) * psize
        state = per_value * experts.shard_numel
        rows = {"parameters": params, "gradients": grads, "optimizer_state": state}
        return rows, [params + state] * dp
    slots = [s for s in L.slots if is_expert_parameter(s.name)]
    if not slots:
        return None, None
    held, S = sum(s.numel for s in slots), L.world_size  # every replica group's DP rank d holds what d mod S does
    owned_by = [sum(end - start for s, start, end in L.owned_slots(d) if is_expert_parameter(s.name))
                for d in range(min(S, dp))]
    owned = [owned_by[r % S] for r in range(dp)]
    by_rank = [place.held(held, o) * psize + per_value * o for o in owned]
    rows = {"parameters": place.held(held, owned[0]) * psize,
            "gradients": held_gradient_bytes(cfg, held, held, owned[0], dp, psize, S),  # the slots unpadded
            "optimizer_state": per_value * owned[0]}
    return rows, by_rank


def compiled_block_buckets(model: torch.nn.Module, L: ShardLayout) -> int:
    """The gradient buckets open at once when each block is compiled (--compile at ZeRO-3, model/compiled.py): a
    compiled block's backward is one node that gives all of its gradients together, in an order of its own, so every
    bucket of a unit may be open before the first is complete (measured on one rank, a tiny Llama in buckets of 3.3K
    to 4.4K values: its first block's three buckets open at once, 48,128 bytes, where eager opens at most the two
    largest, 34,816). At most the largest unit's buckets, in fp32."""
    return max((4 * sum(L.buckets[b].end - L.buckets[b].start for b in unit)
                for unit in unit_rules.unit_buckets(model, L)), default=0)


def gradient_bytes(cfg: Config, L, dp: int, psize: int) -> tuple[int, int, int]:
    """(gradients, gradient buckets, gloo's reduce-scatter scratch) of an engine with layout `L` over its
    L.world_size ranks (its shard group: with --dp-replicate R a replica group's, of the `dp` DP ranks)."""
    padded, shard, S = L.padded_numel, L.shard_numel, L.world_size
    grads = held_gradient_bytes(cfg, L.numel, padded, shard, dp, psize, S)
    buckets = parts_for(cfg).gradients.bucket_bytes(L)
    communication = (S - 2) * shard * 4 if cfg.launch.device == "cpu" and S > 2 else 0  # a reduce-scatter's ranks
    return grads, buckets, communication


def held_gradient_bytes(cfg: Config, numel: int, padded: int, shard: int, dp: int, psize: int,
                        shard_ranks: int | None = None) -> int:
    """The gradients a rank holds between steps for `numel` trained values over `dp` DP ranks (sharded over
    `shard_ranks` of them: with --dp-replicate R, dp / R), `padded` with their buckets' padding, `shard` of them its
    own (an engine's layout; or at --ep 1 the experts' slots of it and the rank's owned pieces of them): the
    gradient-holding part's answer (parallel/parts.py)."""
    return parts_for(cfg).gradients.held_bytes(numel, padded, shard, dp, psize, shard_ranks)


def reference_bytes(cfg: Config) -> int:
    """--method dpo with a precomputed reference: every pair's two log-probs (float64) on every rank; 0 otherwise
    (a live reference is the LoRA base with its adapters off: no memory of its own)."""
    o = cfg.objective
    if o.method != "dpo" or o.dpo_loss in REFERENCE_FREE or o.dpo_reference != "precomputed":
        return 0
    try:
        held_out = [cfg.data.val_data] if cfg.loop.eval_every and cfg.data.val_data else []  # their reference too
        return 16 * sum(1 for path in [cfg.data.source, *held_out] for _ in iter_records(path))
    except (ConfigError, OSError):  # a plan made where the data is not
        return 0


def reference_model_bytes(cfg: Config, model: torch.nn.Module, layout, psize: int, shards: int) -> int:
    """--method dpo --dpo-reference live, or --method grpo --grpo-beta > 0, in full fine-tuning: the frozen copy of
    the initial policy, laid out as the rank's policy (`model`: its TP slice, on the meta device; `layout`: its flat
    layout over the DP ranks), in the run's precision: whole at stages 1 and 2, at stage 3 the shard
    (frozen_copy.shard_frozen_copy lays an all-frozen copy out as the model trains); 0 otherwise (a precomputed
    reference is `reference_bytes`; LoRA's live reference is its base with the adapters off). Under --ep the copy
    holds every expert (`shards`: the ranks a stage-3 copy is sharded over)."""
    o = cfg.objective
    live = o.method == "dpo" and o.dpo_loss not in REFERENCE_FREE and o.dpo_reference == "live"
    if not (live or o.method == "grpo" and o.grpo_beta > 0) or cfg.lora.rank:
        return 0
    p = cfg.parallel
    if p.ep > 1:  # the copy scores without the experts' all-to-all: every expert on every rank (hub.initial_model)
        with torch.device("meta"), collection_paused():
            model = build_model(cfg.model, cfg.loop.seed)
            if p.tp > 1:
                parallelize(model, p.tp, 0, None)
        layout = unit_rules.frozen_layout_of(model, shards, p.bucket_numel)
    return parts_for(cfg).placement.copy_numel(model, layout) * psize


def kv_cache_bytes(cfg: Config, model: torch.nn.Module, psize: int) -> int:
    """--method grpo: the KV cache of the rank's largest sampling batch (model/kv_cache.py's keys and values, as
    training/grpo.py batches its prompts), at --seq-len positions; 0 otherwise."""
    o, p = cfg.objective, cfg.parallel
    if o.method != "grpo":
        return 0
    # a batch per prompt where every rank must run the same forwards (units gathered in turn, experts' all-to-all)
    per_prompt = parts_for(cfg).placement.gathers_units or p.ep > 1
    rows = o.num_generations if per_prompt else cfg.loop.micro_batch * cfg.loop.accum
    m = model.cfg
    return 2 * m.n_layer * rows * kv_heads_per_rank(m.kv_heads, p.tp) * cfg.model.seq_len * m.head_dim * psize


def adapter_activations(cfg: Config, model: torch.nn.Module, micro_batch: int) -> int:
    """What a LoRA run saves for the backward beyond (+) or short of (-) the model's formula, which is full
    training's (activation_memory.py):

        + each adapter's A output (R values for each row it reads: B T, a routed expert's projection N k over the
          layer's experts, N = B T tokens, top-k)
        + with --lora-dropout, what the dropped inputs add (`dropped_inputs`)
        - what only a trained base weight's gradient needs: the token ids (and GPT-2's positions, and under a TP
          split of the vocabulary the ids outside the rank's rows) of the frozen embedding; the frozen head's weight
          gradient (the loss computes none); the Llama family's normalized inputs of its RMSNorms (a frozen gain's;
          Qwen3's and OLMoE's q/k norms' too); a linear's input that no adapter reads (the norms' outputs, before
          q/k/v and gate/up, or a mixture of experts' router and shared expert; the MLP's down-projection input; a
          mixture of experts' routed rows, N k C, and their experts' down-projection inputs, N k W, unless
          --lora-targets experts adapts them; a shared expert's down-projection input); the first norm's internals
          (its input, the embedding's output, needs no gradient); Gemma's (1 + w) norms keep their normalized input
          in fp32 (its q/k norms' too), which a frozen gain does not need either

    Recomputed blocks keep only their inputs: then the embedding's ids and the head's weight gradient alone differ.
    """
    if not cfg.lora.rank:
        return 0
    m, size, tp = cfg.model, 2 if cfg.parallel.precision == "bf16" else 4, cfg.parallel.tp
    B, T, C = micro_batch, m.seq_len, m.n_embd
    BTC, BTF = B * T * C * size, B * T * m.ffn_width // tp * size
    fewer = B * T * INDEX + (T * INDEX if m.arch == "gpt2" else 0)  # the embedding's ids and positions
    fewer += B * T if splits_vocab(m.vocab_size, tp) else 0  # the ids outside the rank's rows
    normalized = B * T * C * FP32 if m.gemma else BTC  # what an RMSNorm keeps for its gain's gradient alone
    fewer += normalized if m.llama_family else 0  # the final RMSNorm's normalized input
    if cfg.parallel.activation_checkpointing == "full":
        return -fewer  # the head runs under a checkpoint too, which saves its input either way
    if cfg.objective.method != "dpo":  # DPO's head keeps no gradient (activation_memory.token_logps)
        fewer += vocab_rows(m.vocab_size, tp) * C * size  # the head's weight gradient
    if cfg.parallel.activation_checkpointing == "blocks":
        return -fewer
    targets = set(cfg.lora.modules(m.arch))
    heads = m.n_head // tp + kv_heads_per_rank(m.kv_heads, tp)  # the q and k heads a rank normalizes
    if m.gemma:  # four norms a block; the first's input, rsqrt and gain (1 + w); q/k norms per head
        fewer += (4 * m.n_layer - 1) * normalized + 2 * B * T * C * FP32 + B * T * FP32 + C * FP32
        if m.qk_norm:
            fewer += m.n_layer * B * T * heads * m.head_dim * FP32
    elif m.llama_family:
        fewer += 2 * m.n_layer * BTC + B * T * C * FP32 + B * T * FP32  # normalized; the first's input and rsqrt
        if m.qk_norm or m.qk_norm_whole:  # Qwen3's per head, OLMoE's of the whole q and k: their normalized inputs
            fewer += m.n_layer * B * T * heads * m.head_dim * size
    else:
        fewer += BTC + 2 * B * T * size  # the first LayerNorm's input, mean and rstd
    if m.qk_norm or m.qk_norm_whole:
        fewer += first_block_qk_norms(cfg, B, targets)
    if m.llama_family:
        attention, mlp, down = {"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, "down_proj"
    else:
        attention, mlp, down = {"c_attn"}, {"c_fc"}, "c_proj"
    for layer in range(m.n_layer):
        fewer += BTC * (not targets & attention)
        if not m.has_experts(layer):
            fewer += BTC * (not targets & mlp) + BTF * (down not in targets)
            continue
        # a mixture of experts: the router's linear is frozen; the shared expert (Qwen2-MoE) is adapted as an MLP
        shared = m.shared_expert_width // tp
        fewer += BTC * (not (shared and targets & mlp)) + B * T * shared * size * (down not in targets)
        if LORA_EXPERTS not in targets:  # the rows routed to the experts and their products, N k (C + W)
            fewer += B * T * m.experts_per_token * (C + m.expert_ffn // tp) * size
    adapted = adapted_modules(model, cfg.lora.modules(m.arch))
    keeps_output = not explicit_scores(m, cfg.launch.device)
    dropped = dropped_inputs(model, adapted, size, keeps_output) if cfg.lora.dropout else 0
    return B * T * (adapter_rows(model, adapted) * cfg.lora.rank * size + dropped) - fewer


def first_block_qk_norms(cfg: Config, B: int, targets: set[str]) -> int:
    """What the first block's q or k norm keeps for the backward that a LoRA run's does not, where that projection
    has no adapter: its input (the frozen embedding's projection) needs no gradient, so the norm keeps nothing: its
    fp32 input and rsqrt (Gemma's gain 1 + w too; the normalized input is not kept in any block)."""
    m, tp, T = cfg.model, cfg.parallel.tp, cfg.model.seq_len
    fewer = 0
    for projection, heads in (("q_proj", m.n_head // tp), ("k_proj", kv_heads_per_rank(m.kv_heads, tp))):
        if projection not in targets:
            rsqrts = 1 if m.qk_norm_whole else heads  # OLMoE's: one per token of the whole projection
            fewer += B * T * heads * m.head_dim * FP32 + B * T * rsqrts * FP32 + (m.head_dim * FP32 if m.gemma else 0)
    return fewer


def adapter_rows(model: torch.nn.Module, adapted: list) -> int:
    """The rows the adapters' A read per token: one for each linear every token goes through; k (top-k) for each
    projection of a mixture of experts' routed experts, over all of them (each reads only the rows routed to it)."""
    routed = routed_expert_linears(model)
    projections = {(name.split(".")[2], name.rsplit(".", 1)[-1]) for name, module in adapted if id(module) in routed}
    return sum(id(module) not in routed for _, module in adapted) + model.cfg.experts_per_token * len(projections)


# The linears of a block that read one input, in the order of the forward: the attention's, then the MLP's (a
# dense one's, a shared expert's, or a routed expert's on its rows); the attention's output projection is read from
# the attention's output, which the attention keeps for its own backward once its inputs need gradients.
INPUT_GROUPS = {"llama": ((("q_proj", "k_proj", "v_proj"), ("o_proj",)), (("gate_proj", "up_proj"), ("down_proj",))),
                "gpt2": ((("c_attn",), ("attn.c_proj",)), (("c_fc",), ("mlp.c_proj",)))}
AFTER_ATTENTION = ("o_proj",), ("attn.c_proj",)


def dropped_inputs(model: torch.nn.Module, adapted: list, size: int, keeps_output: bool = True) -> int:
    """Bytes per token that --lora-dropout saves beyond the adapters' inputs without it.

    Without dropout, the adapters of one input share it: A's backward keeps it once. With dropout each adapter
    keeps its own dropped copy (w values of `size` bytes, its rank's share of the input's width w), and the mask
    its dropout needs (w bytes), but only where the input needs a gradient: after an adapted linear upstream in the
    forward (the frozen base's activations before the first one need none). The attention's output, a copy of
    which the output projection's adapter keeps, the attention then keeps as well where its backward needs its
    output (`keeps_output`: SDPA's and FlexAttention's, not explicit scores'). A mixture of experts' routed
    experts read their rows, k per token (top-k) over the layer's experts, beside the shared expert's tokens: each
    its own branch from the layer's input.
    """
    routed = routed_expert_linears(model)
    k = model.cfg.experts_per_token
    attention, mlp = INPUT_GROUPS["llama" if model.cfg.llama_family else "gpt2"]  # Qwen, Mistral, Phi-3: Llama's
    blocks: dict[int, list] = {}
    for name, module in adapted:  # model.layers.<i>., transformer.h.<i>.
        blocks.setdefault(int(name.split(".")[2]), []).append((name, module))
    extra, upstream = 0, False
    for block in sorted(blocks):
        linears = [(n, m) for n, m in blocks[block] if id(m) not in routed]
        one_expert = {n.rsplit(".", 1)[-1]: (n, m) for n, m in reversed(blocks[block]) if id(m) in routed}
        more, upstream = chain_of_inputs(attention, linears, upstream, 1, size, keeps_output)
        extra += more
        after = upstream
        for branch, rows in ((linears, 1), (list(one_expert.values()), k)):  # from the MLP's input, side by side
            more, needed = chain_of_inputs(mlp, branch, upstream, rows, size)
            extra, after = extra + more, after or needed
        upstream = after
    return extra


def chain_of_inputs(groups, linears: list, needs_grad: bool, rows: int, size: int,
                    keeps_output: bool = False) -> tuple[int, bool]:
    """`dropped_inputs` of one chain of inputs (`groups`, each read by the linears whose names end in one of its
    names), `rows` per token; the bytes per token, and whether the chain's output needs a gradient."""
    extra = 0
    for group in groups:
        widths = [module.weight.shape[1] for name, module in linears if any(name.endswith("." + n) for n in group)]
        if not widths:
            continue
        w = widths[0]
        extra += rows * (len(widths) - 1) * w * size
        if needs_grad:
            extra += rows * (len(widths) * w + (w * size if keeps_output and group in AFTER_ATTENTION else 0))
        needs_grad = True
    return extra, needs_grad


def largest_micro_batch(cfg: Config, device_bytes: int, limit: int = 1 << 16, documents: bool = False,
                        planned: PlannedModel | None = None) -> int:
    """The largest micro-batch whose plan fits in `device_bytes` (0 if not even 1 does); `planned`: as memory_plan's."""
    planned = planned or planned_layouts(cfg, cfg.launch.nproc // cfg.parallel.tp)
    fixed = memory_plan(cfg, 1, documents=documents, planned=planned)
    if fixed.total > device_bytes:
        return 0
    # A LoRA run's adapters change what is saved (adapter_activations), from the model the plan builds
    model = planned.model if cfg.lora.rank else None
    base = fixed.total - micro_batch_bytes(cfg, 1, documents, model)
    lo, hi = 1, limit
    while lo < hi:  # activations grow with the micro-batch: bisect
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if base + micro_batch_bytes(cfg, mid, documents, model) <= device_bytes else (lo, mid - 1)
    return lo


def micro_batch_bytes(cfg: Config, micro_batch: int, documents: bool, model: torch.nn.Module | None) -> int:
    """What of memory_plan's total grows with the micro-batch: the activations (a LoRA run's adapters' share of them
    from `model`, the planned one), the loss working set, with --ep the all-to-all buffers and with --cp the ring's."""
    sequences = 2 * micro_batch if cfg.objective.method == "dpo" else micro_batch  # b pairs are 2b sequences
    a = activation_bytes(cfg.model, sequences, cfg.model.seq_len, tp=cfg.parallel.tp,
                         precision=cfg.parallel.precision, recompute=cfg.parallel.activation_checkpointing,
                         device=cfg.launch.device, documents=documents, objective=cfg.objective.method,
                         ep=cfg.parallel.ep)
    adapters = adapter_activations(cfg, model, sequences) if model is not None else 0
    all_to_all = 2 * all_to_all_row_bytes(cfg, sequences) if cfg.parallel.ep > 1 else 0
    kept = 0 if cfg.parallel.offload_activations and cfg.launch.device != "cpu" else a["total"] + adapters
    # --cp: a rank's T / C tokens a row (its rows' differences from the whole row's) and the ring's buffers, as the
    # plan's total counts them
    split = sum(v for part in context_parallel_rows(cfg.parallel.cp)
                for k, v in part.rows(cfg=cfg, sequences=sequences, documents=documents).items()
                if k not in HOST_ROWS or cfg.launch.device == "cpu")
    return kept + a["working"] + all_to_all + split


# What holds less, in order of what it costs the run: (flag, the setting's section and name, its values to try, smallest
# change first, what it costs). A smaller micro-batch, cheaper than all of them, is largest_micro_batch's answer.
HOLDS_LESS = (
    ("--zero", "parallel", "zero", (2,), "the same traffic as stage 1: a reduce-scatter and an all-gather a step"),
    ("--activation-checkpointing", "parallel", "activation_checkpointing", ("selective",),
     "each block's element-wise ops again in the backward (its matmuls kept): a few percent more compute"),
    ("--activation-checkpointing", "parallel", "activation_checkpointing", ("blocks",),
     "each block's forward again in the backward: about a third more compute"),
    ("--activation-checkpointing", "parallel", "activation_checkpointing", ("full",),
     "the blocks', the head's and the loss's forward again in the backward"),
    ("--zero", "parallel", "zero", (3,), "each block gathered for its forward and its backward: about 1.5x stage 2's "
     "traffic"),
    ("--precision", "parallel", "precision", ("bf16",), "bf16 parameters and activations (fp32 masters and moments): "
     "the numerics change"),
    ("--ep", "parallel", "ep", (2, 4, 8), "the tokens' rows exchanged (all-to-all) in every MoE layer"),
    ("--tp", "parallel", "tp", (2, 4, 8), "an all-reduce in every block's forward and backward: GPUs of one node"),
    ("--nproc", "launch", "nproc", (2, 4, 8), "more devices (the state shards over them; the activations do not)"),
)


@dataclass
class Remedy:
    """A change of settings that makes a plan fit: its flags, what it costs, the total at the run's micro-batch and the
    largest micro-batch that fits with it (both computed by memory_plan with the settings changed)."""

    flags: str
    cost: str
    total: int
    largest_micro_batch: int


@dataclass
class FitAdvice:
    """What does not fit in a device, and what would: `remedies` each alone, in order of cost (HOLDS_LESS, after a
    smaller micro-batch); `together` where none alone does, the first of them that fit when taken in that order
    (None: not even all of them)."""

    short: str  # which part does not fit, in words
    state: int  # the plan at micro-batch 1 but its activations and loss working set: the state and its buffers
    activations: int  # the activations and the loss working set at the run's micro-batch
    remedies: list[Remedy]
    together: Remedy | None

    def to_dict(self) -> dict:
        return {"short": self.short, "state": self.state, "activations": self.activations,
                "remedies": [vars(r) for r in self.remedies],
                "together": vars(self.together) if self.together else None}


def fit_advice(cfg: Config, device_bytes: int, documents: bool = False,
               planned: PlannedModel | None = None) -> FitAdvice | None:
    """None where `cfg`'s plan fits in `device_bytes`; else which part does not (the state and its buffers alone, the
    activations at micro-batch 1, or at the run's micro-batch) and each setting of HOLDS_LESS that makes it fit,
    every figure a plan of the run with that setting changed; `planned`: as memory_plan's."""
    B = cfg.loop.micro_batch
    planned = planned or planned_layouts(cfg, cfg.launch.nproc // cfg.parallel.tp)
    plan = memory_plan(cfg, documents=documents, planned=planned)
    if plan.total <= device_bytes:
        return None
    one = memory_plan(cfg, 1, documents=documents, planned=planned)
    state = one.total - one.rows["activations"] - one.rows["loss_working_set"]
    at_one = one.total - state
    activations = plan.rows["activations"] + plan.rows["loss_working_set"]
    room = gib(device_bytes)
    if state > device_bytes:
        short = f"the state and its buffers alone ({gib(state)}) do not fit in {room}"
    elif one.total > device_bytes:
        short = (f"the state and its buffers ({gib(state)}) fit in {room}; the activations at micro-batch 1 "
                 f"({gib(at_one)} with the loss working set) do not")
    else:
        short = (f"the activations at micro-batch {B} ({gib(activations)} with the loss working set) do not fit in "
                 f"{room}")

    def remedy(changed: Config, flags: str, cost: str) -> Remedy | None:
        mine = planned_layouts(changed, changed.launch.nproc // changed.parallel.tp)  # built once for both
        fits = largest_micro_batch(changed, device_bytes, documents=documents, planned=mine)
        return Remedy(flags, cost, memory_plan(changed, documents=documents, planned=mine).total, fits) if fits \
            else None

    remedies = []
    smaller = largest_micro_batch(cfg, device_bytes, documents=documents, planned=planned)
    if smaller:
        remedies.append(Remedy(f"--micro-batch {smaller}", "the same batch in more micro-batches (raise --accum)",
                               memory_plan(cfg, smaller, documents=documents, planned=planned).total, smaller))
    tried = []  # the settings planned alone: none of them fits where `remedies` is empty
    for flag, section, name, values, cost in HOLDS_LESS:
        for value in _values_beyond(cfg, section, name, values):
            changed = _changed(cfg, section, name, value)
            found = remedy(changed, f"{flag} {value}", cost) if _valid(changed) else None
            tried.append(changed)
            if found:
                remedies.append(found)
                break
    together = None
    if not remedies:  # each taken with the ones before it, cheapest first, until they fit
        changed, flags = cfg, {}
        for flag, section, name, values, _ in HOLDS_LESS:
            for value in _values_beyond(changed, section, name, values):
                trial = _changed(changed, section, name, value)
                if _valid(trial):
                    changed, flags[flag] = trial, f"{flag} {value}"
                    # the first is one of those planned alone, which did not fit: not built again
                    together = remedy(changed, " ".join(flags.values()), "") if changed not in tried else None
                if together:
                    break
            if together:
                break
    return FitAdvice(short, state, activations, remedies, together)


def _values_beyond(cfg: Config, section: str, name: str, values: tuple) -> list:
    """The values of HOLDS_LESS's row that hold less than `cfg`'s own (a larger stage, TP, EP or world; a setting it
    does not have yet)."""
    mine = getattr(getattr(cfg, section), name)
    order = {"activation_checkpointing": ("none", "selective", "blocks", "full"),
             "precision": ("fp32", "bf16")}.get(name)
    if order:
        return [v for v in values if order.index(v) > order.index(mine)]
    return [v * mine if name == "nproc" else v for v in values if name == "nproc" or v > mine]


def _changed(cfg: Config, section: str, name: str, value) -> Config:
    return replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})


def _valid(cfg: Config) -> bool:
    try:
        validate(cfg)
    except ConfigError:
        return False
    return True


@dataclass
class LargestModel:
    """The deepest model of a run's shape family whose plan fits: its depth and parameters; `capped`: the search
    stopped at its cap (DEPTH_CAP), which fits, so deeper ones may too."""

    n_layer: int
    parameters: int
    capped: bool


def with_depth(cfg: Config, n_layer: int) -> Config:
    """`cfg` with `n_layer` blocks and every other setting as it is (no setting is checked against the depth)."""
    return replace(cfg, model=replace(cfg.model, n_layer=n_layer))


SEQ_LEN_CAP = 1 << 24  # tokens a row: the search's end for a model whose context does not bound it


def length_changes_no_parameter(m) -> bool:
    """Whether a model's parameters are the same at every --seq-len: where its positions are its --context (the
    positions a model holds, ModelConfig.positions, are the one parameter shape a length sets: GPT-2's learned
    position embedding's rows)."""
    return bool(m.context)


def largest_seq_len(cfg: Config, device_bytes: int, documents: bool = False,
                    planned: PlannedModel | None = None) -> tuple[int, bool]:
    """(the longest --seq-len whose plan, at --micro-batch and every other setting as given, fits in `device_bytes`,
    0 if not even the shortest does; whether the model's --context stopped the search, not the memory). The lengths
    are multiples of 2 x --cp (each CP rank holds 2 equal chunks of a row), up to --context where the model has one.
    Each length's plan is the plan's own total (memory_plan, ~40 ms for Llama-3.1-8B's shape): doubling from --seq-len
    to a length that does not fit, then bisected. `planned`: as memory_plan's, for the probe of --seq-len itself."""
    step = 2 * cfg.parallel.cp
    cap = (cfg.model.context or SEQ_LEN_CAP) // step * step
    # where the length changes no parameter every probe's model and layouts are the run's, built once (DeepSeek-V3-
    # 671B's search probes ~20 lengths, its build takes seconds)
    same_model = length_changes_no_parameter(cfg.model)
    if same_model and planned is None:
        planned = planned_layouts(cfg, cfg.launch.nproc // cfg.parallel.tp)

    def fits(n: int) -> bool:
        probe = replace(cfg, model=replace(cfg.model, seq_len=n * step))
        mine = planned if probe == cfg or same_model else None  # the run's model and layouts, as built
        return memory_plan(probe, documents=documents, planned=mine).total <= device_bytes

    if not cap or not fits(1):
        return 0, False
    lo, hi = 1, max(1, min(cfg.model.seq_len // step, cap // step))  # in steps of 2 x cp; lo fits, hi + 1 may not
    while hi < cap // step and fits(hi):
        lo, hi = hi, min(2 * hi, cap // step)
    if hi == cap // step and fits(hi):
        return cap, True
    while lo + 1 < hi:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step, False


def largest_model(cfg: Config, device_bytes: int, documents: bool = False,
                  cap: int = DEPTH_CAP, planned: PlannedModel | None = None) -> LargestModel | None:
    """The most blocks `cfg`'s model can have, every other setting as given, with its plan (at --micro-batch) in
    `device_bytes`, up to `cap`; None if not even one block fits.

    Each plan builds the model on the meta device, ~1.5 ms a block, so the search probes few depths, most of them
    near its answer (`planned`: as memory_plan's, for the probe of the run's own depth). First Newton's steps on the
    total, from the given depth: n + (device - total(n)) / (total(n + 1) - total(n)) blocks next. The total is
    linear in the depth but for its first few blocks and the buckets' padding, so they land on the answer in a step
    or two (Llama-3-8B's shape at stage 3 on 64 ranks in 80 GiB: 32, 33, then 573 and 574, the answer, in ~1.3 s on
    2 CPU cores). Then a bracket, whatever the steps did: steps of 1, 2, 4... from their last depth to one that fits
    and one that does not, bisected. Where Newton's steps converged, those are already probed, n and n + 1, and the
    bracket costs nothing.
    """
    totals: dict[int, int] = {}

    def total(n: int) -> int:
        if n not in totals:
            probe = with_depth(cfg, n)
            mine = planned if probe == cfg else None  # the run's own settings: its model and layouts as built
            totals[n] = memory_plan(probe, documents=documents, planned=mine).total
        return totals[n]

    def fits(n: int) -> bool:
        return total(n) <= device_bytes

    n = min(cfg.model.n_layer, cap)
    for _ in range(4):  # the step is 0 where n fits and n + 1 does not
        if n == cap and fits(n):
            break
        a = max(1, min(n, cap - 1))  # the slope between a and a + 1, within the cap
        step = (device_bytes - total(n)) // max(1, total(a + 1) - total(a))
        n, was = min(cap, max(1, n + step)), n
        if n == was:
            break
    if not fits(n) and not fits(1):
        return None
    if fits(n):
        lo, hi, step = n, None, 1
        while hi is None and lo < cap:
            probe = min(cap, lo + step)
            lo, hi, step = (probe, None, 2 * step) if fits(probe) else (lo, probe, step)
        if hi is None:
            return LargestModel(cap, param_count_at_depth(cfg, cap), capped=True)
    else:
        hi, step = n, 1
        while not fits(max(1, hi - step)):  # 1 fits: this ends
            hi, step = hi - step, 2 * step
        lo = max(1, hi - step)
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return LargestModel(lo, param_count_at_depth(cfg, lo), capped=False)


def param_count_at_depth(cfg: Config, n_layer: int) -> int:
    """param_count of `cfg`'s model with `n_layer` blocks, from its counts at 1 and 2: every block has the same
    shapes, and counting them on a model of hundreds of blocks would cost as much as a plan of it."""
    one, two = (param_count(with_depth(cfg, n).model) for n in (1, 2))
    return one + (n_layer - 1) * (two - one)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str = "--device-memory") -> int:
    """'80GiB', '80 GB', '512MiB', '1.5TiB' or a byte count; ConfigError naming the value otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{flag} {text!r} is not a size: give a positive number with a unit, e.g. 80GiB, 40GB "
                          "or 512MiB")
    if unit == "" and float(m.group(1)) < _UNITS["mib"]:  # '80' meant 80GiB, not 80 bytes: no device is that small
        raise ConfigError(f"{flag} {text!r} is {m.group(1)} bytes: give a unit, e.g. {m.group(1)}GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def measured_state(engine: ZeroEngine, outside: dict | None = None) -> dict[str, int]:
    """The state rows as the engine holds them now (between steps); `outside`: what the objective holds beyond the
    engine (its held_state: DPO's live reference copy, reference_model.ReferenceCopy)."""
    parts = engine.parts  # with --ep: the expert group too
    master = sum(e.adamw.master.numel() * 4 for e in parts if e.adamw.master is not None)
    optimizer = held_bytes(engine.optimizer_state_tensors(), exclude=engine.flat_buffers)
    copy, held = (outside or {}).get("reference_model"), engine.memory_held()
    return {"parameters": held["param_bytes"], "frozen_base": held["frozen_bytes"],
            "gradients": held["grad_bytes"], "optimizer_state": optimizer - master, "master_weights": master,
            "reference_model": copy.held_bytes() if copy is not None else 0}


def held_state_bytes(engine: ZeroEngine, outside: dict | None = None) -> int:
    """Bytes of the distinct storages behind every tensor the engine's attributes, its model's parameters and
    their gradients, and its optimizer's state hold now (and those of the copies in `outside`): found by
    walking them, not through the engine's accounting or its layout. AdamW's 0-dim step counters are left out, as
    the plan leaves them out."""
    found: list[torch.Tensor] = []

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            walk(list(value.values()))

    for part in engine.parts:  # with --ep: the expert group too
        for held in (part, part.grads, part.adamw):  # the engine, its gradients, its AdamW's masters and moments
            walk(list(vars(held).values()))
        walk(list(vars(part.placement).values()))  # where its parameters live (stage 3: the shards, the units)
        walk(list(part.adamw.optimizer.state.values()))
    walk([(p, p.grad) for p in engine.model.parameters()])
    walk([copy.tensors() for copy in (outside or {}).values()])
    return storage_bytes(t for t in found if t.dim() > 0)


# Set to 1 by the test suite (tests/conftest.py): a difference between the plan and what a run holds is an error.
STRICT_ENV = "ZEROTRAIN_STRICT_PLAN"


def strict() -> bool:
    """Whether a run's difference from the plan stops it (the tests), or is reported and the run goes on."""
    return os.environ.get(STRICT_ENV, "") == "1"


def device_memory(device: torch.device) -> int:
    """The bytes of `device`: a GPU's total memory, or on the CPU the machine's physical memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class PlanDifference:
    """A row a rank measured other than planned (or above the plan's most): what the metrics' event records."""

    rank: int
    row: str
    measured: int
    planned: int
    what: str  # the difference in words, after "rank R"

    def line(self, step: int, stops: bool = True) -> str:
        if stops:
            return f"memory plan failed at step {step}: rank {self.rank} {self.what}"
        return f"memory plan: at step {step} rank {self.rank} {self.what} (the run goes on)"

    def event(self, step: int) -> dict:
        return {"event": "plan_difference", "step": step, "rank": self.rank, "row": self.row,
                "measured": self.measured, "planned": self.planned}


def check(plan: MemoryPlan, engine: ZeroEngine, comm: Comm, saved_bytes: int | None, step: int,
          on_difference=None, outside: dict | None = None) -> str | None:
    """Check the plan against what every rank holds after `step`: the state exactly, row by row and as the total
    of the tensors found (`held_state_bytes`); the parameter and gradient peaks within the planned most.

    A difference is InvariantError naming the rank and row under the test suite (`strict`); in a run it is
    `on_difference(record, line)` (the loop's event in the metrics and a console line), and the run goes on: an
    accounting difference is not a shortage. What a rank measured at its peak (its state, the parameters and
    gradients it held at once, the plan's activations and buffers) above its device's memory stops the run
    either way. Returns a warning line when the first micro-batch's saved activations (`saved_bytes`, rank 0's;
    None: not counted) are off by more than 10%. `outside`: what the objective holds beyond the engine (DPO's live
    reference copy), measured as the engine's state is."""
    held = measured_state(engine, outside)
    peaks = engine.memory_held()  # ZeRO-3's parameters: the shard and units whole
    copy = (outside or {}).get("reference_model")  # its units whole in its forward, beyond its shard (ZeRO-3)
    copy_units = copy.peak_bytes() - copy.held_bytes() if copy is not None else 0
    row = [held[k] for k in STATE] + [held_state_bytes(engine, outside), *all_to_all_bytes_most(engine.model),
                                      copy_units, peaks["param_peak_bytes"], peaks["grad_peak_bytes"]]
    rows = comm.all_gather_rows(torch.tensor(row, dtype=torch.int64), "all_gather_plan").tolist()
    differences = differences_from(plan, rows)
    if differences and (strict() or on_difference is None):
        raise InvariantError(differences[0].line(step))
    for difference in differences:
        on_difference(difference.event(step), difference.line(step, stops=False))
    rest = sum(v for k, v in plan.rows.items() if k in ("activations", "reference", "loss_working_set", "communication",
                                                        "all_to_all")
               or k == "checkpoint_staging" and plan.device == "cpu")
    device = device_memory(engine.device)
    for rank, measured in enumerate(rows):
        values = dict(zip(STATE, measured))
        peak = measured[-2] + measured[-1] + values["frozen_base"] + values["optimizer_state"] + \
            values["master_weights"] + values["reference_model"] + rest
        if peak > device:
            raise InvariantError(f"memory plan failed at step {step}: rank {rank} held {peak:,} bytes at its peak "
                                 f"(measured state, parameters and gradients at once; planned activations and "
                                 f"buffers), above its device's {device:,}")
    if saved_bytes is None:
        return None
    planned = plan.rows["activations"]
    if abs(saved_bytes - planned) > ACTIVATION_TOLERANCE * saved_bytes:
        return (f"memory plan: the first micro-batch saved {gib(saved_bytes)} of activations for the backward, "
                f"the plan {gib(planned)} ({(planned - saved_bytes) / saved_bytes:+.0%}, beyond "
                f"{ACTIVATION_TOLERANCE:.0%})")
    return None


def differences_from(plan: MemoryPlan, rows: list[list[int]]) -> list[PlanDifference]:
    """Every rank's rows (the state rows, the total found, the most bytes of rows one all-to-all sent and received
    (--ep), the reference copy's units whole at once, the parameter and gradient peaks) against the plan."""
    out = []
    peak = plan.rows["gradients"] + plan.rows["gradient_buckets"]
    state = sum(plan.rows[k] for k in STATE)
    params = plan.rows["parameters"] + plan.rows["parameter_units"]
    for rank, measured in enumerate(rows):
        for key, value in zip(STATE, measured):
            if value != plan.rows[key]:
                out.append(PlanDifference(rank, key, value, plan.rows[key],
                                          f"holds {value:,} bytes of {key.replace('_', ' ')}, the plan "
                                          f"{plan.rows[key]:,}"))
        if measured[len(STATE)] != state:
            out.append(PlanDifference(rank, "state", measured[len(STATE)], state,
                                      f"holds {measured[len(STATE)]:,} bytes in the tensors of its engine, model and "
                                      f"optimizer, the plan's state {state:,}"))
        sent, received = measured[len(STATE) + 1 : len(STATE) + 3]
        if sent and sent != plan.rows["all_to_all"] // 2:  # N k rows, whatever the routing
            out.append(PlanDifference(rank, "all_to_all_sent", sent, plan.rows["all_to_all"] // 2,
                                      f"sent {sent:,} bytes of rows in one MoE layer's all-to-all, the plan "
                                      f"{plan.rows['all_to_all'] // 2:,}"))
        if received > plan.all_to_all_most - plan.rows["all_to_all"] // 2:  # E N k rows at most
            out.append(PlanDifference(rank, "all_to_all_received", received,
                                      plan.all_to_all_most - plan.rows["all_to_all"] // 2,
                                      f"received {received:,} bytes of rows in one MoE layer's all-to-all, the plan "
                                      f"at most {plan.all_to_all_most - plan.rows['all_to_all'] // 2:,}"))
        if measured[-3] > plan.rows["parameter_units"]:  # the copy's units: whole when the policy's are not
            out.append(PlanDifference(rank, "reference_units", measured[-3], plan.rows["parameter_units"],
                                      f"held {measured[-3]:,} bytes of its reference copy's units whole at once, the "
                                      f"plan's parameter units at most {plan.rows['parameter_units']:,}"))
        if measured[-2] > params:
            out.append(PlanDifference(rank, "parameter_peak", measured[-2], params,
                                      f"held {measured[-2]:,} bytes of parameters at once, the plan at most "
                                      f"{params:,}"))
        if measured[-1] > peak:
            out.append(PlanDifference(rank, "gradient_peak", measured[-1], peak,
                                      f"held {measured[-1]:,} bytes of gradients at once, the plan at most {peak:,}"))
    return out


def out_of_memory(plan: MemoryPlan, cfg: Config, step: int, error: BaseException) -> str:
    """The line a rank that ran out of memory says: what failed, what the plan expected, and what holds less."""
    said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    largest = sorted(((v, k) for k, v in plan.rows.items() if v), reverse=True)[:3]
    held = ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for v, k in largest)
    zero2_holds_less = parts_for(cfg).gradients.buckets_hold_less(plan.dp)  # the gradients in buckets (stage 2)
    less = [f for f, on in (("--zero 2", zero2_holds_less),
                             ("--activation-checkpointing full", cfg.parallel.activation_checkpointing != "full"),
                             (f"--micro-batch {cfg.loop.micro_batch // 2}", cfg.loop.micro_batch > 1),
                             ("--precision bf16", cfg.parallel.precision == "fp32")) if on]
    return (f"out of memory in step {step} ({said}); the plan for this run is {gib(plan.total)} per rank, mostly "
            f"{held}" + (f"; {', '.join(less)} hold less" if less else "") +
            " (zerotrain plan with these flags and --device-memory shows what fits)")
