"""Llama 4's text decoder (llama4), as transformers' Llama4ForCausalLM computes it.

    attention  grouped-query attention of two kinds, by the layer (config.rotary):
               rotary layers: q and k rotated in the interleaved (complex-number) convention, pairs (x_2i, x_2i+1)
               turned by position p's angle p theta_i (Llama 3.1's rope scaling as configured), then each head
               L2-normalised without a gain (--qk-l2-norm: an RMSNorm of no weight, in fp32); each token sees the
               earlier tokens of its own chunk of --attention-chunk positions only (chunk p // size, as
               transformers' chunked mask)
               no-rope layers (every --nope-every-th): no rotary, no q/k norm, every earlier token; each query scaled
               by 1 + scale ln(1 + floor((p + 1) / floor_scale)) (--temperature-tuning), the longer the context
               the sharper its softmax
    mlp        a SwiGLU of --intermediate-size on the dense layers; on every --moe-every-th layer (but
               --mlp-only-layers) a mixture of experts: the router's top-k logits through a sigmoid (no softmax,
               no renormalising), each score multiplying the token the expert reads (its input, not its output), the
               experts' outputs summed, plus a shared expert of the experts' width every token goes through, ungated
    norms      Llama's RMSNorms before the attention and the MLP and at the end

Packed records (`segments`): positions restart at each record, and a record's tokens see their own record only:
the rotary layers within their chunks of the record's positions (a record alone is chunked from its first token),
the temperature tuning by the record's positions too.

Context parallelism (--cp): each rank's part of the rows around the ring (parallel/ring_attention.py), the rotary
layers' ring cut by their attention chunks of the whole row's (or record's) positions, the others' not; the rotary
angles and the temperature at those positions. No balancing loss is added unless a run asks for one
(--moe-aux-coef): transformers' Llama4ForCausalLM adds none, and import sets the model's weight to 0.

Under tensor parallelism the attention splits by heads and the MLPs and experts by their width, as Llama's and the
MoE families' (llama.plan; the plan's note at the end of this file).

Parameter names are zerotrain's MoE names (model.layers.{i}.mlp.gate.weight, mlp.experts.{e}.gate_proj.weight,
mlp.shared_expert.*); hub/mapping.py maps transformers' feed_forward.router, feed_forward.experts.gate_up_proj
(E, C, 2F: gate then up, x @ W) and feed_forward.experts.down_proj (E, F, C) to them and back.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from zerotrain.config import ModelConfig

from .attention import attend, document_attention
from . import llama
from .decoder import Decoder
from .kv_cache import KVCache
from .llama import LlamaMLP, rope_scaling
from .moe import MoE, expert_outputs, inverse_order
from .norms import RMSNorm
from .positions import new_positions
from .recompute import run_block
from .rotary import rotary_tables
from .tensor_parallel import copy_to_tp, reduce_from_tp


def interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) with each pair (x_2i, x_2i+1) rotated as the complex number x_2i + i x_2i+1 times e^(i angle_i)
    (transformers' Llama 4 apply_rotary_emb), in fp32; cos and sin (T, D/2) or (B, 1, T, D/2)."""
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, in fp32, no gain (Llama4TextL2Norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def temperature(positions: torch.Tensor, floor_scale: int, scale: float) -> torch.Tensor:
    """Each query's factor on the layers without rotary: 1 + scale ln(1 + floor((p + 1) / floor_scale)), fp32,
    shaped to multiply q (B, H, T, D): (1, 1, T, 1), or (B, 1, T, 1) for packed records' positions."""
    factor = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * scale + 1.0
    return factor.view(1, 1, -1, 1) if positions.dim() == 1 else factor[:, None, :, None]


def chunked_mask(positions: torch.Tensor, segments: torch.Tensor | None, chunk: int, dtype: torch.dtype,
                 past: int = 0) -> torch.Tensor | None:
    """What attend takes on the rotary layers: query t sees key s when s is not after t, both are in one record and
    in one chunk of that record's positions (p // chunk). Additive (B, 1, T, T) in `dtype` for packed records; boolean
    (T, past + T) after a cache's `past` positions (the positions are then past .. past + T - 1); None where SDPA's
    causal mask is exact (one record, no cache, all in the first chunk)."""
    if segments is not None:
        T = segments.shape[1]
        same = segments[:, :, None] == segments[:, None, :]
        causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
        allowed = same & causal & (positions[:, :, None] // chunk == positions[:, None, :] // chunk)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
        return mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1)
    T = positions.shape[0]
    if past == 0 and T <= chunk:
        return None
    keys = torch.arange(past + T, device=positions.device)[None, :]
    queries = positions[:, None]
    return (keys <= queries) & (keys // chunk == queries // chunk)


class Llama4Attention(nn.Module):
    """The module docstring's attention: rotary, chunked and L2-normalised, or without rotary, global and tuned."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        C, D = cfg.n_embd, cfg.head_dim
        self.head_dim, self.eps = D, cfg.norm_eps
        self.rotary = cfg.rotary(layer)
        self.qk_norm = cfg.qk_l2_norm and self.rotary
        self.tuned = (cfg.temperature_floor, cfg.temperature_scale) \
            if cfg.temperature_tuning and not self.rotary else None
        # under TP (llama.parallelize): q, k and v share one all-reduce of their input's gradient; Llama 4 has no
        # norm over a whole projection (OLMoE's): its q/k norms and the temperature are each head's own
        self.tp_comm, self.whole_qk_norm = None, False
        self.q_proj = nn.Linear(C, cfg.n_head * D, bias=False)
        self.k_proj = nn.Linear(C, cfg.kv_heads * D, bias=False)
        self.v_proj = nn.Linear(C, cfg.kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * D, C, bias=False)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                cache: KVCache | None, layer: int, mask) -> torch.Tensor:
        B, T, _ = x.shape
        x = copy_to_tp(x, self.tp_comm)
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj,
                                                                                 self.v_proj))
        if self.rotary:
            q, k = interleaved_rotary(q, *rotary), interleaved_rotary(k, *rotary)
        if self.qk_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.tuned is not None:
            q = (q * temperature(positions, *self.tuned)).to(q.dtype)
        if cache is not None and mask is not None:  # a chunked mask over the cache: appended here, masked below
            k, v = cache.append(layer, k, v)
            cache = None
        y = attend(q, k, v, cache, layer, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class Llama4MoE(MoE):
    """The module docstring's mixture of experts: model/moe.py's experts, dispatch and expert parallelism (its
    `exchange`), with Llama 4's router (sigmoid of the top-k logits), the scores on the experts' input, and an
    ungated shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        del self.shared_expert_gate  # Llama 4's shared expert is added as it is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        scores, chosen = self.route(flat, B, T)
        order = chosen.reshape(-1).argsort(stable=True)  # the (token, slot) pairs by expert
        counts = torch.bincount(chosen.reshape(-1), minlength=self.n_experts)
        # under TP each rank's experts give partial outputs (MoE's docstring): the tokens' and the scores' gradients
        # are summed over the TP group, the layer's output once
        expert_input, scores = copy_to_tp(flat, self.tp_comm), copy_to_tp(scores, self.tp_comm)
        # each expert reads its token times the token's score for it (transformers' routed_in)
        rows = expert_input[order // self.top_k] * scores.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
        if self.exchange is not None:  # expert parallelism: the rows go to their experts' ranks and come back
            outputs = self.exchange(self, rows, counts, self.expert_path(flat))
        else:
            outputs = expert_outputs(self.local_experts(), rows, counts, self.expert_path(flat))
        routed = outputs[inverse_order(order)].view(-1, self.top_k, C).sum(1)
        return reduce_from_tp(self.shared_expert(expert_input) + routed, self.tp_comm).view(B, T, C)

    def route(self, flat: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the chosen experts' scores (N, k): sigmoid of their logits, fp32, in the logits' dtype as transformers'
        Llama4Router; the experts chosen (N, k)); records the layer's Routing (softmax probabilities, for a balancing
        loss a run asks for)."""
        logits = self.gate(flat)
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.sigmoid(top.float()).to(top.dtype)
        # computed in a recomputed forward too (activation checkpointing), which must save what the first forward
        # saved; recorded by the first only (MoE.record_routing)
        probs = torch.softmax(logits.float(), dim=-1)
        self.record_routing(probs, chosen, B, T)
        return scores, chosen


class Llama4Block(nn.Module):
    """Pre-RMSNorm attention and MLP (dense or mixture of experts, by the layer)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = Llama4Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = Llama4MoE(cfg) if cfg.has_experts(layer) else LlamaMLP(cfg)

    def forward(self, x, rotary, positions, cache: KVCache | None, layer: int, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, positions, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama4(Decoder):
    """Token embedding, Llama 4's blocks, final RMSNorm, LM head (tied or its own)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, Llama4Block, RMSNorm(cfg.n_embd, cfg.norm_eps))

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        x = self.model.embed_tokens(idx)
        if self.context_parallel is not None and cache is None:  # this rank's part of each row, around the ring
            # positions in the whole row (or record): the rotary angles, the chunks and the temperature take them
            positions, full = self.context_parallel.prepare(idx, segments)
            chunked = dataclasses.replace(full, attention_chunk=cfg.attention_chunk)
        else:
            positions = new_positions(idx, cache, cfg.positions, segments)
            past = 0 if cache is None else cache.length
            # the global layers': the records' mask, or SDPA's causal one; the rotary layers': their chunks' too
            full = document_attention(segments, x.dtype, cfg.head_dim) if segments is not None else None
            chunked = full if not cfg.attention_chunk else \
                chunked_mask(positions, segments, cfg.attention_chunk, x.dtype, past)
        cos, sin = rotary_tables(positions, cfg.head_dim, cfg.rope_theta, rope_scaling(cfg))
        half = cfg.head_dim // 2  # the tables' first half holds each frequency once: the interleaved pairs' angles
        rotary = (cos[..., :half], sin[..., :half])
        for layer, block in enumerate(self.model.layers):
            mask = chunked if cfg.rotary(layer) else full
            x = run_block(block, self.recompute_blocks and cache is None, x, rotary, positions, cache, layer, mask)
        if cache is not None:
            cache.length += idx.shape[1]
        return self.model.norm(x)


# Tensor parallelism is Llama's plan (llama.plan, llama.parallelize): q_proj by q heads, k_proj and v_proj by KV heads,
# o_proj row-parallel (the chunked mask, the L2 norms without a gain and the temperature tuning are each head's own:
# nothing to sum); the dense MLP, each expert and the shared expert split by rows of their width (model/moe.py's
# plan: Llama 4's stacked expert tensors are per-expert parameters here), the router replicated; the embedding and the
# head by vocabulary rows.
plan, parallelize = llama.plan, llama.parallelize
