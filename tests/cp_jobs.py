"""Jobs of the context-parallelism tests (--cp), run by spawned ranks; planted bugs patch the product's own functions."""

from __future__ import annotations

import os
import re
from unittest import mock

import dpo_jobs
import torch
from dist_jobs import summary

from zerotrain import checkpoint, load_model
from zerotrain.checkpoint import homes
from zerotrain.config import Config
from zerotrain.model import deepseek, delta_rule_cp, gemma4, lora
from zerotrain.model.positions import positions_from_segments
from zerotrain.model.recompute import in_backward
from zerotrain.parallel import Comm, GradientReducer, context, ring_attention
from zerotrain.training import grpo, invariants, preference
from zerotrain.training.loop import train
from zerotrain.training.rollouts import FILE as ROLLOUTS_FILE
from zerotrain.training.rollouts import read_rollouts


def trained_job(cfg: Config, comm: Comm) -> dict:
    """Train; the log, the final parameters (the last checkpoint's), the memory plan's rows and the activations the
    first micro-batch saved."""
    result = train(cfg, comm)
    out = summary(result)
    out["plan"] = result.plan
    final = load_model(os.path.join(cfg.checkpoint.dir, checkpoint.step_name(cfg.loop.steps)))
    out["params"] = {name: p.detach().clone() for name, p in final.named_parameters()}
    out["sent"] = dict(result.comm_bytes)
    return out


def ring_measured_job(cfg: Config, comm: Comm) -> dict:
    """trained_job (moe_trained_job for a mixture), with what the ring held in flight, measured: over each layer's
    ring backward, the most bytes of keys and values received for the next hop, of key and value gradients received
    (the ones being summed are their twins: x 2), and of the fused hop kernel's k and v gradients per query head; the
    largest layer's sum (the plan's --cp communication row)."""
    kernel = "_scaled_dot_product_flash_attention_for_cpu_backward"
    real_backward, real_pass, real_kernel = (ring_attention._RingAttention.backward, ring_attention.pass_around,
                                             getattr(torch.ops.aten, kernel))
    layers = []  # each ring backward's most bytes: {TAG_KV: ..., TAG_GRAD: ..., "kernel": ...}

    def backward(ctx, grad):
        layers.append({ring_attention.TAG_KV: 0, ring_attention.TAG_GRAD: 0, "kernel": 0})
        return real_backward(ctx, grad)

    def pass_around(tensors, group, tag):
        received, works = real_pass(tensors, group, tag)
        if layers:
            layers[-1][tag] = max(layers[-1][tag], sum(t.nbytes for t in received))
        return received, works

    def hop_kernel_backward(*args, **kwargs):
        dq, dk, dv = real_kernel(*args, **kwargs)
        layers[-1]["kernel"] = max(layers[-1]["kernel"], dk.nbytes + dv.nbytes)
        return dq, dk, dv

    job = moe_trained_job if cfg.model.n_experts else trained_job
    with mock.patch.object(ring_attention._RingAttention, "backward", staticmethod(backward)), \
            mock.patch.object(ring_attention, "pass_around", pass_around), \
            mock.patch.object(torch.ops.aten, kernel, hop_kernel_backward):
        out = job(cfg, comm)
    out["ring_measured"] = max(held[ring_attention.TAG_KV] + 2 * held[ring_attention.TAG_GRAD] + held["kernel"]
                               for held in layers)
    return out


def missing_hop_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the ring computes each rank's own hop only (the keys and values that travel are dropped)."""
    real = ring_attention.hop_blocks

    def own_hop_only(rank, source, chunk):
        return real(rank, source, chunk) if source == rank else None

    with mock.patch.object(ring_attention, "hop_blocks", own_hop_only):
        return trained_job(cfg, comm)


def local_positions_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: rotary positions counted within this rank's two chunks, not in the whole row."""

    def local(seq_len, cp, rank, segments=None, device=None):
        if segments is None:
            return torch.arange(seq_len // cp, device=device)
        return positions_from_segments(ring_attention.zigzag_split(segments, cp, rank))

    with mock.patch.object(context, "rotary_positions", local):
        return trained_job(cfg, comm)


def moe_trained_job(cfg: Config, comm: Comm) -> dict:
    """trained_job with the mixture's figures of every step: its balancing loss and expert loads (and the plan)."""
    result = train(cfg, comm)
    out = summary(result)
    out["aux_losses"] = [r["aux_loss"] for r in result.records]
    out["expert_loads"] = [r["expert_load"] for r in result.records]
    out["plan"] = result.plan
    final = load_model(os.path.join(cfg.checkpoint.dir, checkpoint.step_name(cfg.loop.steps)))
    out["params"] = {name: p.detach().clone() for name, p in final.named_parameters()}
    return out


def per_chunk_balancing_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: each CP rank's balancing loss over its own part of the row (its counts, tokens and trained flags
    never summed over the cp group): a loss per chunk, not the whole row's."""
    with mock.patch.object(context.ContextParallel, "sum_over_rows", lambda self, x: x):
        return moe_trained_job(cfg, comm)


def whole_row_dropout_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: LoRA's dropout masks drawn as if each rank's part were a whole row (the masks of positions 0 to
    T / C - 1, not of this rank's positions)."""
    real = lora.DropoutRows.__init__

    def unsplit(self, seed, context_parallel=None):
        real(self, seed)

    with mock.patch.object(lora.DropoutRows, "__init__", unsplit):
        return trained_job(cfg, comm)


def unreplicated_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the gradient shard not all-reduced across the replica groups (each steps on its own half of the
    batch), invariant (b) not checked: what the run trains."""
    with mock.patch.object(GradientReducer, "all_reduce_replicas", lambda self: None), \
            mock.patch.object(invariants, "check_no_drift", lambda *args: []):
        return trained_job(cfg, comm)


def dpo_trained_job(cfg: Config, comm: Comm) -> dict:
    """Train --method dpo; the log with the preference figures (and the validation's) of each step, and the final
    parameters (the last checkpoint's)."""
    result = train(cfg, comm)
    out = dpo_jobs.log_of(result)
    final = load_model(os.path.join(cfg.checkpoint.dir, checkpoint.step_name(cfg.loop.steps)))
    out["params"] = {name: p.detach().clone() for name, p in final.named_parameters()}
    out["sent"] = dict(result.comm_bytes)
    return out


def dpo_parts_unsummed_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: each CP rank's sequence log-probs are its own part's (the all-reduce over the cp group skipped),
    the policy's and the reference's alike."""
    with mock.patch.object(context.ContextParallel, "sum_over_parts", lambda self, x: x):
        return dpo_trained_job(cfg, comm)


def dpo_reference_of_one_chunk_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the precomputed reference's log-probs are scored over each rank's own part of the rows only (the
    first CP rank's are stored), the policy's over the whole rows."""
    real = preference.Preference.score_reference

    def of_one_part(self, engine, faults=None):
        with mock.patch.object(context.ContextParallel, "sum_over_parts", lambda self, x: x):
            return real(self, engine, faults)

    with mock.patch.object(preference.Preference, "score_reference", of_one_part):
        return dpo_trained_job(cfg, comm)


def grpo_trained_job(cfg: Config, comm: Comm) -> dict:
    """trained_job with the completions of every step (rollouts.jsonl, which rank 0 writes)."""
    out = trained_job(cfg, comm)
    if comm.rank == 0:
        out["rollouts"] = [r["completion_ids"] for r in read_rollouts(os.path.join(cfg.logging.out, ROLLOUTS_FILE))]
    return out


def grpo_rank_order_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a completion's token log-probs gathered in the ranks' order (rank 0's two chunks, then rank 1's),
    not put back in the row's zig-zag order."""
    def in_rank_order(self, x):
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.comm.group)
        parts[self.rank] = x  # this rank's part keeps its gradient
        return torch.cat(parts, dim=1)

    with mock.patch.object(context.ContextParallel, "whole_rows", in_rank_order):
        return grpo_trained_job(cfg, comm)


def grpo_reference_of_one_part_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the reference's token log-probs of this rank's part of each row only (the other ranks' parts left
    at 0, nothing gathered), the policy's of the whole rows."""
    real = grpo.GroupRelative.reference_logps

    def own_part(self, x):
        parts = [x if r == self.rank else torch.zeros_like(x) for r in range(self.size)]
        return ring_attention.zigzag_unsplit(parts, dim=1)

    def of_one_part(self, engine, micro):
        with mock.patch.object(context.ContextParallel, "whole_rows", own_part):
            return real(self, engine, micro)

    with mock.patch.object(grpo.GroupRelative, "reference_logps", of_one_part):
        return grpo_trained_job(cfg, comm)


def neighbour_expert_resume_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a resume reads every expert's state from the next expert of its EP rank's block (checkpoint/
    homes.py's expert_home, which the load asks where each expert's shard is)."""
    real = homes.expert_home

    def neighbour(name, per_rank):
        ep_rank, local = real(name, per_rank)
        head, index, tail = re.fullmatch(r"(.*\.experts\.)(\d+)(\..*)", local).groups()
        return ep_rank, f"{head}{(int(index) + 1) % per_rank}{tail}"

    with mock.patch.object(homes, "expert_home", neighbour):
        return moe_trained_job(cfg, comm)


def window_everywhere_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the ring ignores the sliding window (every block computed as if the window held it whole)."""
    with mock.patch.object(ring_attention, "window_reach", lambda *args: "inside"):
        return trained_job(cfg, comm)


def window_in_local_positions_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a partial block's window measured in the rank's local indices, not the row's positions."""
    def local(rank, source, rows, keys, chunk, cp, window, device):
        distance = torch.arange(rows.start, rows.stop, device=device)[:, None] - \
            torch.arange(keys.start, keys.stop, device=device)[None, :]
        return (distance >= 0) & (distance < window)

    with mock.patch.object(ring_attention, "window_mask", local):
        return trained_job(cfg, comm)


def attention_chunks_ignored_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the ring ignores Llama 4's attention chunks (every block computed as if one chunk held it)."""
    with mock.patch.object(ring_attention, "attention_chunk_reach", lambda *args: "inside"):
        return trained_job(cfg, comm)


def attention_chunks_of_the_row_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: packed records' attention chunks cut by the row's positions, not each record's own."""
    real = ring_attention.attention_chunk_mask

    def by_row(rank, source, rows, keys, chunk, cp, size, positions, device):
        return real(rank, source, rows, keys, chunk, cp, size, None, device)

    with mock.patch.object(ring_attention, "attention_chunk_mask", by_row):
        return trained_job(cfg, comm)


def routing_skipped_in_recompute_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: DeepSeek-V3's router skips its routing probabilities in a forward recomputed for the backward
    (activation checkpointing), which then saves fewer tensors than the first forward did; the error the run stops
    with, as {"error": ...}."""
    real = deepseek.DeepseekMoE.route

    def skipping(self, flat, B, T):
        return self.gate(flat)[1:] if in_backward() else real(self, flat, B, T)

    with mock.patch.object(deepseek.DeepseekMoE, "route", skipping):
        try:
            return trained_job(cfg, comm)
        except Exception as e:  # noqa: BLE001 - what stopped the run is the result
            return {"error": f"{type(e).__name__}: {e}"}


def shared_kv_off_the_ring_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: Gemma 4's shared-KV layers attend over this rank's part of their source layer's keys and values
    only, as if it were the whole row (causal in local order), not around the ring with them."""
    real = gemma4.attend

    def local(q, k, v, cache=None, layer=0, documents=None, **kw):
        shared = layer >= cfg.model.n_layer - cfg.model.kv_shared_layers
        return real(q, k, v, cache, layer, None if shared else documents, **{**kw, "window": 0} if shared else kw)

    with mock.patch.object(gemma4, "attend", local):
        return trained_job(cfg, comm)


def chunk_starts_seen_job(cfg: Config, comm: Comm) -> dict:
    """trained_job, with how many record starts the linear layers' split saw among this rank's tokens: at a chunk's
    first token (a record starting at a chunk boundary, the row's first excluded) and inside a chunk."""
    real, seen = context.part_record_starts, {"at a boundary": 0, "inside": 0}

    def counting(segments, cp, rank, reach):
        starts, before = real(segments, cp, rank, reach)
        firsts = starts[:, [0, starts.shape[1] // 2]]
        seen["at a boundary"] += int(firsts[:, 1].sum()) + (int(firsts[:, 0].sum()) if rank else 0)
        seen["inside"] += int(starts.sum()) - int(firsts.sum())
        return starts, before

    with mock.patch.object(context, "part_record_starts", counting):
        out = trained_job(cfg, comm)
    out["starts seen"] = comm.all_gather_json(seen, "test")
    return out


def chunk_state_ignored_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: each chunk of a split row runs the linear layers' delta rule from a zero state (the earlier
    chunks' states never composed into it)."""
    def zeros(M, B, chunks):
        return torch.zeros_like(B[:2])

    with mock.patch.object(delta_rule_cp, "states_before", zeros):
        return trained_job(cfg, comm)


def conv_boundary_dropped_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the linear layers' convolution reads zeros before each chunk of a split row (the previous chunk's
    last inputs never exchanged)."""
    def zeros(tails, chunks):
        return torch.zeros_like(tails[:2])

    with mock.patch.object(delta_rule_cp, "inputs_before", zeros):
        return trained_job(cfg, comm)


def boundary_reset_dropped_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a record starting at a chunk's first token does not reset the linear layers there (the split's
    record starts lose each chunk's first)."""
    with mock.patch.object(context, "part_record_starts", without_chunk_firsts(context.part_record_starts)):
        return trained_job(cfg, comm)


def without_chunk_firsts(real):
    """context.part_record_starts (`real`) losing the start of each chunk's first token."""
    def planted(segments, cp, rank, reach):
        starts, before = real(segments, cp, rank, reach)
        starts = starts.clone()
        starts[:, [0, starts.shape[1] // 2]] = False
        return starts, before

    return planted
