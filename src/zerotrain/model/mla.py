"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), as transformers' DeepseekV3Attention computes it.

    queries   q_proj x, or with a query rank q_b_proj(RMSNorm(q_a_proj x)): per head qk_nope_dim units without rotary
              and qk_rope_dim units with it
    keys      kv_a_proj_with_mqa x gives a latent of kv_lora_rank units (RMSNorm'd) and ONE rotary key of qk_rope_dim
              units that every head shares; kv_b_proj(latent) gives each head's key units without rotary and its value
    rotary    on the rotary units only (the decoupled rotary key); DeepSeek's files store each rotary pair adjacent,
              (x0, x1), (x2, x3), ... (rope_interleave): the units are de-interleaved (evens, then odds) and rotated
              rotate-half style, transformers' bit-identical form; the same permutation of q's and k's units leaves
              every score as it was
    scale     1 / sqrt(qk_nope_dim + qk_rope_dim), times mscale^2 under YaRN with mscale_all_dim (mscale = 0.1
              mscale_all_dim ln(factor) + 1: transformers' yarn_apply_mscale); the rotary tables themselves carry
              YaRN's attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim)

    queries   Mistral 4's (mistral4) are scaled by their position, 1 + beta ln(1 + floor(p / original context)) at
              position p (llama4_query_scale: transformers' get_llama_4_attn_scale), every unit of them

The q and kv latents' RMSNorms take transformers' fixed epsilon 1e-6, not the model's rms_norm_eps.

Under tensor parallelism (deepseek.py's plan, as Megatron and torchtitan split MLA) the low-rank parts every head
reads (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm) are replicated; q_b_proj (q_proj) and kv_b_proj
are column-parallel by heads, o_proj row-parallel over its heads' value columns: one all-reduce forward (o_proj's)
and one backward (to_heads') per layer, as Llama's attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from zerotrain.config import ModelConfig

from .attention import attend
from .kv_cache import KVCache
from .norms import RMSNorm
from .rotary import YarnScaling, apply_rotary
from .tensor_parallel import copy_to_tp

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which transformers' attention builds its latent norms with


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 at factor <= 1): transformers' yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_rope_scaling(cfg: ModelConfig) -> YarnScaling | None:
    """The rotary scaling of DeepSeek-V3's config: YaRN with its attention factor from mscale and mscale_all_dim
    (both set: their ratio; else YaRN's own), or none."""
    if cfg.rope_scaling == "none":
        return None
    factor = cfg.rope_attention_factor
    if not factor and cfg.rope_mscale and cfg.rope_mscale_all_dim:
        factor = yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return YarnScaling(cfg.rope_factor, cfg.rope_original_context, cfg.rope_theta, cfg.rope_beta_fast,
                       cfg.rope_beta_slow, cfg.rope_truncate, factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """The scores' factor: 1 / sqrt(q/k head width), times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = cfg.head_dim ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def llama4_query_scale(positions: torch.Tensor, beta: float, original: int) -> torch.Tensor:
    """Each query's factor 1 + beta ln(1 + floor(p / original)) at positions p, in fp32 as transformers computes it,
    shaped to multiply q (B, H, T, D): (1, 1, T, 1), or (B, 1, T, 1) for packed records' positions."""
    scale = 1 + beta * torch.log(1 + torch.floor(positions / original))
    return scale.view(1, 1, -1, 1) if positions.dim() == 1 else scale[:, None, :, None]


def query_scale(cfg: ModelConfig, positions: torch.Tensor) -> torch.Tensor | None:
    """Mistral 4's query factors at `positions` (llama4_query_scale, the period YaRN's original context); None for
    DeepSeek-V3, whose queries are not scaled."""
    if cfg.arch != "mistral4" or not cfg.llama4_scaling_beta:
        return None
    return llama4_query_scale(positions, cfg.llama4_scaling_beta, cfg.rope_original_context)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Adjacent rotary pairs (x0, x1), (x2, x3), ... laid out as rotate-half's (x0, x2, ..., x1, x3, ...)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def rotate_units(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary on the rotary units x (B, H, T, qk_rope_dim), stored interleaved or rotate-half."""
    return apply_rotary(deinterleave(x) if interleaved else x, cos, sin)


class LatentAttention(nn.Module):
    """MLA (the module docstring): parameter names are transformers' (q_a_proj, q_a_layernorm, q_b_proj or q_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, H = cfg.n_embd, cfg.n_head
        self.nope, self.rope, self.value = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim
        self.rank, self.interleaved, self.scale = cfg.kv_lora_rank, cfg.rope_interleave, softmax_scale(cfg)
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(C, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(C, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(C, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.value), bias=False)
        self.o_proj = nn.Linear(H * self.value, C, bias=False)
        self.tp_comm = None  # under TP: the TP group the per-head inputs' gradients are summed over (to_heads)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None,
                layer: int, documents=None, query_scale: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        q_in = x if hasattr(self, "q_proj") else self.q_a_layernorm(self.q_a_proj(x))
        q_in, latent, k_rot = to_heads(self.tp_comm, q_in, self.kv_a_layernorm(latent), k_rot)
        q = (self.q_proj if hasattr(self, "q_proj") else self.q_b_proj)(q_in)
        q = q.view(B, T, -1, self.nope + self.rope).transpose(1, 2)
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)
        kv = self.kv_b_proj(latent).view(B, T, -1, self.nope + self.value).transpose(1, 2)
        k_pass, v = kv.split([self.nope, self.value], dim=-1)
        H = k_pass.shape[1]  # under TP: this rank's heads
        q_rot = rotate_units(q_rot, *rotary, self.interleaved)
        k_rot = rotate_units(k_rot.reshape(B, 1, T, self.rope), *rotary, self.interleaved)
        q = torch.cat([q_pass, q_rot], dim=-1)
        if query_scale is not None:
            q = q * query_scale.to(q.dtype)
        k = torch.cat([k_pass, k_rot.expand(B, H, T, self.rope)], dim=-1)
        if cache is not None and self.value < q.shape[-1]:
            # the cache holds keys and values of one width: values padded with zeros, whose outputs are dropped
            v = torch.nn.functional.pad(v, (0, q.shape[-1] - self.value))
        y = attend(q, k, v, cache, layer, documents, scale=self.scale)[..., : self.value]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def to_heads(comm, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The replicated low-rank parts' outputs as the per-head projections read them (`inputs`, on the last dimension:
    the query latent, or x without one; the KV latent; the shared rotary key): themselves, or under TP (`comm`) one
    copy_to_tp of them all. Each rank's heads give only part of their gradients; summed here, once per micro-batch,
    they reach q_a_proj, kv_a_proj_with_mqa and the latent norms whole, so those stay replicated, equal on every rank,
    with no all-reduce of their own (x's gradient through them is whole too: only the heads' parts are summed)."""
    if comm is None:
        return inputs
    joined = copy_to_tp(torch.cat(inputs, dim=-1), comm)
    return joined.split([t.shape[-1] for t in inputs], dim=-1)
