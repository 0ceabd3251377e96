"""Context parallelism (--cp C) wired into a run: the part of each row a rank keeps, and what the model's layers attend
with, over the mesh's cp group (the ring of ring_attention.py).

The C ranks of a DP replica read the same micro-batches; each keeps its zig-zag part of every row (chunks i and 2C-1-i
of 2C: inputs, labels and segments alike; the labels were shifted on the whole row, so each is still its input's next
token). The model (Llama.hidden, Deepseek.hidden, Llama4.hidden) asks `prepare` once per forward for its tokens' rotary
positions (their places in the whole row, or within their record for packed rows: the rotary units, Mistral 4's query
scale and Llama 4's temperature take them) and for the layers' ring, which carries every rank's segment ids and
positions (gathered once per forward). The loss is each rank's sum over its own tokens over the global token count: the
reduce-scatter over dp_shard x cp adds the CP ranks' partial gradients, so the step is --cp 1's.

A loss of whole sequences (DPO's, of each sequence's summed log-prob; GRPO's, of each completion's tokens) is not a
sum over tokens: each rank makes its part's figures whole (sum_over_parts: the per-row sums all-reduced; whole_rows:
the per-token figures all-gathered), each gradient-carrying with this rank's part of the gradient backward, and every
rank of the group computes the same loss, counted once (counted_once). Its gradient on each rank is then the whole
loss's with respect to that rank's tokens, and the reduce-scatter adds them up as for the token loss.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from zerotrain.config import DEEPSEEK, GEMMA4, LLAMA4, QWEN35
from zerotrain.data.batches import MicroBatch
from zerotrain.model.activation_memory import (ACTIVATION_BYTES, RankShape, activation_bytes, gated_delta_net,
                                               math_attention, rotary_bases)
from zerotrain.model.attention import RingAttention
from zerotrain.model.delta_rule_cp import SplitRows, split_starts
from zerotrain.model.positions import positions_from_segments
from zerotrain.model.qwen35 import record_starts
from zerotrain.model.tensor_parallel import ReduceFromTP, kv_heads_per_rank
from .comm import Comm
from .ring_attention import gather_segments, ring_attention, rotary_positions, zigzag_split, zigzag_unsplit


class ContextParallel:
    """This rank's place in its cp group, and what the model asks of it (set as `model.context_parallel`)."""

    def __init__(self, comm: Comm, size: int, rank: int):
        self.comm, self.size, self.rank = comm, size, rank

    def part(self, micro: MicroBatch, reach: int | None = None) -> MicroBatch:
        """This rank's zig-zag part of each row of `micro` (B, T) -> (B, T / C). `reach`: where Qwen3.5's linear
        layers run fla, their convolution's (K - 1): the record starts its kernels take for this rank's chunks, which
        need the whole rows, are computed here on the host and left on the part's segments as `split_starts`
        (fused_delta_rule.segment_bounds reads them)."""
        part = MicroBatch(*(None if t is None else self.row_part(t) for t in micro))
        if reach is not None and micro.segments is not None:
            part.segments.split_starts = split_starts(*part_record_starts(micro.segments, self.size, self.rank, reach))
        return part

    def row_part(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of whole rows `x` (B, T, ...) -> (B, T / C, ...): e.g. LoRA's dropout masks, drawn whole."""
        return zigzag_split(x, self.size, self.rank)

    def prepare(self, idx: torch.Tensor, segments: torch.Tensor | None) -> tuple[torch.Tensor, RingAttention]:
        """The rotary positions of this rank's tokens `idx` (B, T / C) and what the layers attend with. Packed rows
        (`segments`, this rank's part): every rank's parts gathered once, so that each hop masks other records' keys
        and each token's position counts from its record's start in the whole row."""
        T = idx.shape[1] * self.size
        ring = functools.partial(ring_attention, group=self.comm.group)
        if segments is None:
            return rotary_positions(T, self.size, self.rank, device=idx.device), RingAttention(ring)
        documents = gather_segments(segments, self.comm.group)  # (C, B, T / C)
        whole = zigzag_unsplit(list(documents), dim=1)
        # every rank's positions within their records: what Llama 4's attention chunks of packed rows are cut by
        every = torch.stack([zigzag_split(positions_from_segments(whole), self.size, r) for r in range(self.size)])
        return rotary_positions(T, self.size, self.rank, whole), RingAttention(ring, documents, positions=every)

    def split_rows(self, documents: torch.Tensor | None, reach: int, bounds=None) -> SplitRows:
        """What linear-attention layers compute with (model/delta_rule_cp.py): every chunk's figures gathered in row
        order, and for packed rows (`documents`, every rank's segment ids as `prepare`'s ring holds them) the record
        starts among this rank's tokens and among the `reach` tokens before each of its chunks; `bounds`, fla's
        boundaries of their segments where they came with the micro-batch (`part`)."""
        chunks = (self.rank, 2 * self.size - 1 - self.rank)
        gather = functools.partial(_GatherChunks.apply, cp=self)
        if documents is None:
            return SplitRows(gather, chunks)
        starts, before = part_record_starts(zigzag_unsplit(list(documents), dim=1), self.size, self.rank, reach)
        return SplitRows(gather, chunks, starts, before, bounds)

    def sum_over_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (B, n), figures of this rank's part of each row, summed over the cp group: the whole rows' (a mixture of
        experts' routing counts for its balancing loss: model.moe.balancing_loss's whole_rows)."""
        return self.comm.all_reduce(x.contiguous(), "all_reduce_row_parts")

    def sum_over_parts(self, x: torch.Tensor) -> torch.Tensor:
        """`x`, sums over this rank's part of each row (DPO's sequence log-probs and token counts, [2, rows]), summed
        over the cp group: the whole rows', with their gradient (one all-reduce forward; backward each rank's part
        takes the whole sums' gradient, nothing sent: every rank computes the same loss of them)."""
        return ReduceFromTP.apply(x, self.comm, "all_reduce_sequence_parts")

    def whole_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (B, T / C), a figure of each of this rank's tokens (GRPO's log-probs), as the whole rows' (B, T): every
        rank's part all-gathered in place (zigzag_unsplit), with its gradient (backward: this rank's part of it)."""
        return _WholeRows.apply(x, self)

    def counted_once(self, x: torch.Tensor) -> torch.Tensor:
        """`x`, a figure every rank of the group computed whole (a loss of whole sequences), on the group's first rank
        and 0 on the others, so that the step's all-reduce counts it once (as TP's first rank; NaN stays NaN)."""
        return x * (self.rank == 0)


class _WholeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp: ContextParallel):
        ctx.cp = cp
        parts = x.new_empty((cp.size * x.shape[0], *x.shape[1:]))  # rank r's part: rows r B to (r + 1) B
        cp.comm.all_gather(parts, x.contiguous(), "all_gather_row_parts")
        return zigzag_unsplit(list(parts.chunk(cp.size)), dim=1)

    @staticmethod
    def backward(ctx, grad):
        return ctx.cp.row_part(grad).contiguous(), None


class _GatherChunks(torch.autograd.Function):
    """Every rank's figures of its two chunks (2, ...) as every chunk's in row order (2C, ...); backward, each rank's
    gradients of every chunk's summed and this rank's two taken (one reduce-scatter: every rank composes the states
    of the chunks before its own from all of them)."""

    @staticmethod
    def forward(ctx, x, cp: ContextParallel):
        ctx.cp = cp
        parts = x.new_empty((cp.size, *x.shape))  # rank r's two chunks: r and 2C-1-r
        cp.comm.all_gather(parts.view(-1), x.contiguous().view(-1), "all_gather_chunk_states")
        return zigzag_unsplit(list(parts.unbind()), dim=0)

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        by_rank = torch.stack([zigzag_split(grad, cp.size, r, dim=0) for r in range(cp.size)])
        mine = grad.new_empty(by_rank.shape[1:])
        cp.comm.reduce_scatter(mine.view(-1), by_rank.view(-1), "reduce_scatter_chunk_states")
        return mine, None


def part_record_starts(segments: torch.Tensor, cp: int, rank: int, reach: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The record starts of rank `rank`'s tokens in the whole rows' `segments` (B, T) -> (B, T / cp), and of the
    `reach` tokens before each of its two chunks (2, B, reach; none before the row's first)."""
    starts = record_starts(segments)
    chunks = starts.chunk(2 * cp, dim=1)
    before = [chunks[j - 1][:, chunks[0].shape[1] - reach:] if j else torch.zeros_like(chunks[0][:, :reach])
              for j in (rank, 2 * cp - 1 - rank)]
    return zigzag_split(starts, cp, rank), torch.stack(before)


def context_parallel(mesh) -> ContextParallel | None:
    """The mesh's context parallelism, None at cp 1."""
    return ContextParallel(mesh.cp, mesh.cp_size, mesh.cp_rank) if mesh.cp_size > 1 else None


class ContextParallelRows:
    """--cp C's share of the memory plan (RunParts.more): a rank's activations are those of T / C tokens of each row
    (every block's, the embedding's, the head's and the loss's), without the records', the window's or Llama 4's
    chunks' T x T mask (each hop builds its block's and drops it), plus what the ring keeps: every rank's segment
    ids (C x B x T / C, int64) and, for packed rows, rotary tables per row (their positions differ by row; Gemma
    3's two bases; Mistral 4's query scale; Llama 4's temperature, and every rank's positions for its chunks:
    per_row_positions). Latent attention's core is the ring's (q, k, v, output, log-sum-exp), not the math kernel a
    rank would take for the whole row on CPU, and Llama 4's output is o_proj's input as it is
    (ring_core_difference); in bf16 the ring keeps its fp32 output for the backward beside the copy o_proj reads,
    and packed rows' rotary casts are per row. The ring's buffers in flight are the communication row's: at most,
    in a layer's backward, the next hop's k and v, the gradients of k and v being summed and those arriving (fp32),
    and the fused kernel's k and v gradients per query head before they are summed over the group. Qwen3.5's linear
    layers run on the rank's two chunks apart (activation_memory.gated_delta_net's cp: each chunk's state map, the
    gathered maps and the composed states; only its attention layers have a ring); their exchange's gradients in
    flight are the communication row's where they are larger than the ring's. Each row is the difference from the
    whole row's, which the plan counts first."""

    def __init__(self, cp: int):
        self.cp = cp

    def rows(self, *, cfg, sequences: int, documents: bool, **_) -> dict[str, int]:
        m, p = cfg.model, cfg.parallel
        T, B, C = m.seq_len, sequences, self.cp
        common = dict(tp=p.tp, precision=p.precision, recompute=p.activation_checkpointing, device=cfg.launch.device,
                      objective=cfg.objective.method, ep=p.ep)  # (with --ep: the exchange's indices of T / C tokens)
        whole = activation_bytes(m, B, T, documents=documents, **common)
        # the ring takes no mask, a sliding window's or Llama 4's attention chunks' neither (each hop masks its block
        # and drops it): the window lifted to the row, the sliding layers still sliding (Gemma 3's local rotary
        # tables); the chunks lifted
        ring_model = dataclasses.replace(m, sliding_window=T) if m.sliding_window else m
        ring_model = dataclasses.replace(ring_model, attention_chunk=0) if m.arch in LLAMA4 else ring_model
        part = activation_bytes(ring_model, B, T // C, **common)
        recompute, a, Tc = p.activation_checkpointing, ACTIVATION_BYTES[p.precision], T // C
        attending = [layer for layer in range(m.n_layer) if not m.linear_attention(layer)]  # the layers with a ring
        held = part["total"] + ring_core_difference(m, B, Tc, p.tp, p.precision, recompute, cfg.launch.device)
        if recompute == "none" and m.arch in QWEN35:  # the linear layers on two chunks of T / 2C (gated_delta_net's
            # cp), their records' terms among them (`part` counts T / C tokens of one document a row)
            s = RankShape(B=B, T=Tc, C=m.n_embd, heads=0, kv_heads=0, head_dim=0, ffn=0, vocab=0, act=a)
            split = gated_delta_net(s, m, documents, p.tp, C) - gated_delta_net(s, m, False, p.tp)
            held += split * sum(map(m.linear_attention, range(m.n_layer)))
        if recompute == "none" and p.precision != "fp32":
            # the ring merges in fp32 and keeps that output for its backward beside the copy o_proj reads
            held += sum(B * Tc * (m.n_head // p.tp) * head_widths(m, layer)[1] * 4 for layer in attending)
        if documents:
            if recompute not in ("blocks", "full"):  # recomputed blocks: their rings' saves are the backward's
                held += C * B * Tc * 8  # gather_segments: every rank's segment ids
            if recompute == "none" and (p.precision == "fp32" or m.arch in LLAMA4):
                # the rotations' fp32 cos and sin, one pair per row (of the rotated units: GLM-4.5's partial share,
                # DeepSeek-V3's rotary units; Llama 4 rotates in fp32 in every precision)
                windows = [m.sliding_window if m.sliding(layer) else 0 for layer in range(m.n_layer)]
                held += (B - 1) * Tc * rotated_units(m, windows) * 4 * 2
            elif recompute == "none":  # each block's casts of them, for q and for k (Gemma 4's shared-KV layers
                # rotate no keys), one per row
                held += sum((B - 1) * 2 * (1 + (m.kv_source(layer) == layer)) * Tc * head_widths(m, layer)[0] * a
                            for layer in attending)
            held += per_row_positions(m, C, B, Tc, p.precision, recompute)
        ring = max((ring_buffers(m, layer, B, Tc, p.tp, p.precision) for layer in attending), default=0)
        if m.arch in QWEN35:  # or a linear layer's exchange, in its backward: the gradients of every chunk's (M, B)
            # (or convolution tails), those put in rank order and this rank's summed part (_GatherChunks)
            ring = max(ring, (4 * C + 2) * B * linear_exchange_bytes(m, p.tp, a))
        # where the activations wait for the backward: with --offload-activations the host row (memory_plan's
        # activation_rows), which the whole row's activations are in
        saved = "activations_host" if p.offload_activations else "activations"
        return {saved: held - whole["total"], "loss_working_set": part["working"] - whole["working"],
                "communication": ring}

    def traffic(self, layouts: list) -> dict[str, int]:
        """The step's traffic the plan adds for it: none yet (the ring's point-to-point hops are not planned by
        purpose; their buffers are the communication row's)."""
        return {}


def ring_buffers(m, layer: int, B: int, T: int, tp: int, precision: str) -> int:
    """The ring's buffers in flight in `layer`'s backward, B rows of this rank's T tokens: the next hop's k and v as
    they travel (latent attention: every head its own keys, values of v_head_dim), the gradients of k and v being
    summed and those arriving (fp32), and the fused hop kernel's k and v gradients per query head at the wider of the
    two widths (values padded to q's), fp32. Each layer at its own shape (ring_shape): the row is the largest."""
    kv_heads, k_width, v_width = ring_shape(m, layer)
    kv_heads = kv_heads_per_rank(kv_heads, tp)
    k_units, v_units = B * kv_heads * T * k_width, B * kv_heads * T * v_width
    group = m.n_head // tp // kv_heads  # the query heads each KV head serves
    return ((k_units + v_units) * ACTIVATION_BYTES[precision] + 2 * (k_units + v_units) * 4
            + 2 * max(k_units, v_units) * 4 * group)


def ring_shape(m, layer: int) -> tuple[int, int, int]:
    """(KV heads, the keys' width, the values' width) of what `layer`'s ring carries: Gemma 4's global layers' own
    heads (attention_shape; with --k-eq-v the keys travel as the values too), latent attention's narrower values."""
    if m.arch in GEMMA4:
        kv_heads, width = m.attention_shape(layer)
        return kv_heads, width, width
    return m.kv_heads, m.head_dim, m.v_head_dim if m.arch in DEEPSEEK else m.head_dim


def ring_core_difference(m, B: int, T: int, tp: int, precision: str, recompute: str, device: str) -> int:
    """What the attention core saves around the ring (B rows of this rank's T tokens) less what the plan of T tokens
    in one rank counts for it, where they differ (0 for recomputed blocks: their input alone is kept):
      latent attention  on CPU one rank takes SDPA's math kernel (values narrower than q and k: fp32 q, k, v and the
                        T x T probabilities, the output copied for o_proj), the ring saves what the fused kernels do
                        (q, k, v, the output o_proj reads as it is, the log-sum-exp: activation_memory.
                        latent_attention's other branch)
      Llama 4           its rotary layers' SDPA output is copied for o_proj (activation_memory.llama4_attention); the
                        ring's output, laid out (B, T, H, D), is o_proj's input as it is
      Qwen3.5           its attention layers' SDPA output is copied for the output gate (activation_memory.
                        gated_attention); the ring's is the gate's input as it is"""
    if recompute != "none":
        return 0
    H, D, a = m.n_head // tp, m.head_dim, ACTIVATION_BYTES[precision]
    if m.arch in LLAMA4:
        return -sum(map(m.rotary, range(m.n_layer))) * B * T * H * D * a
    if m.arch in QWEN35:
        return -sum(not m.linear_attention(layer) for layer in range(m.n_layer)) * B * T * H * D * a
    if not math_attention(m, device):
        return 0
    Dv = m.v_head_dim
    math_kernel = B * H * T * (2 * D + Dv) * 4 + B * H * T * T * 4 + B * T * H * Dv * a
    fused = B * T * H * (2 * D + Dv) * a + B * T * H * Dv * a + B * H * T * 4
    return m.n_layer * (fused - math_kernel)


def linear_exchange_bytes(m, tp: int, a: int) -> int:
    """The larger of what a Qwen3.5 linear layer gathers of one chunk of one row at a time (delta_rule_cp.py): its
    (M, B), Hv dk (dk + dv) fp32, or its convolution's last K - 1 inputs (W channels, `a` bytes each); under TP this
    rank's heads'."""
    Hk, Hv, dk, dv = m.linear_key_heads // tp, m.linear_value_heads // tp, m.linear_key_width, m.linear_value_width
    return max(Hv * dk * (dk + dv) * 4, (2 * Hk * dk + Hv * dv) * (m.linear_conv_kernel - 1) * a)


def head_widths(m, layer: int) -> tuple[int, int]:
    """(the rotated units, the values' units) of each of `layer`'s heads: Gemma 4's global layers' own width (their
    proportional rotary's tables span it), latent attention's narrower values, GLM-4.5's partial rotary."""
    if m.arch in GEMMA4:
        width = m.attention_shape(layer)[1]
        return width, width
    return m.rotary_dim, m.v_head_dim if m.arch in DEEPSEEK else m.head_dim


def rotated_units(m, windows: list[int]) -> int:
    """The units of one position's rotary tables, over the tables the layers rotate with: Gemma 3's two bases;
    Gemma 4's two kinds of layer, each of its own head width (gemma4.Gemma4.hidden's tables)."""
    if m.arch in GEMMA4:
        kinds = {m.global_layer(layer) for layer in range(m.n_layer)}
        return sum(m.global_head_width if kind else m.head_dim for kind in kinds)
    return m.rotary_dim * rotary_bases(m, windows)


def per_row_positions(m, C: int, B: int, T: int, precision: str, recompute: str) -> int:
    """What packed rows keep by position beyond one row's (their positions differ by row), for B rows of this rank's
    T tokens among C: Mistral 4's query scale (fp32 saved as it is or a recomputed block's argument, in bf16 each
    block's cast: activation_memory's terms); Llama 4's temperature (each layer without rotary its own fp32 factors)
    or, recomputed, its positions (each block's argument, int64), and every rank's positions, which its rotary layers'
    rings keep for their attention chunks (C B T int64, once)."""
    rows = B - 1
    if m.arch == "mistral4" and m.llama4_scaling_beta:
        if recompute != "none" or precision == "fp32":
            return rows * T * 4
        return m.n_layer * rows * T * ACTIVATION_BYTES[precision]
    if m.arch in LLAMA4:
        if recompute != "none":
            return rows * T * 8
        without_rotary = sum(not m.rotary(layer) for layer in range(m.n_layer))
        chunked = m.attention_chunk and without_rotary < m.n_layer
        return without_rotary * rows * T * 4 * bool(m.temperature_tuning) + (C * B * T * 8 if chunked else 0)
    return 0


def context_parallel_rows(cp: int) -> list:
    """The parts RunParts.more gets for --cp `cp`."""
    return [ContextParallelRows(cp)] if cp > 1 else []
