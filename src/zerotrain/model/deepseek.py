"""DeepSeek-V3's decoder (deepseek_v3: DeepSeek-V3, V3.1, R1, and Kimi K2's shapes), as transformers'
DeepseekV3ForCausalLM computes it; and Mistral 4's (mistral4, Mistral4ForCausalLM), the same decoder with a softmax
router without bias (group_routing.py) and queries scaled by their position (mla.py).

    self_attn   multi-head latent attention (mla.py); under context parallelism (--cp) around the ring
                (parallel/ring_attention.py: q and k of nope + rope units, values of v_head_dim), the rotary units
                and Mistral 4's query scale at the tokens' positions in the whole row
    mlp         layers 0 .. first_k_dense_replace - 1: a SwiGLU MLP of intermediate_size; the others a mixture of
                experts (model/moe.py's experts and sort) routed by group_routing.py's router (sigmoid scores,
                group-limited top-k, the load-balancing bias), plus shared experts: one SwiGLU MLP of n_shared_experts
                x moe_intermediate_size that every token goes through, ungated
    norms       RMSNorms before the attention and the MLP and at the end (rms_norm_eps)

Under tensor parallelism (`plan`, `parallelize`) the attention splits by heads (mla.py), the MLPs and experts by
their width, the router stays replicated.

Parameter names are transformers' (model.layers.{i}.self_attn.kv_b_proj.weight, ...mlp.gate.e_score_correction_bias,
...mlp.shared_experts.gate_proj.weight, ...mlp.experts.{e}.gate_proj.weight as its files store them): hub/mapping.py's
table is the identity. Multi-token-prediction layers (model.layers.{num_hidden_layers}...): with --mtp frozen not part
of this model (hub/mapping.py sets them aside at import and an hf export copies them from the folder); with --mtp
train model.mtp_layers.{num_hidden_layers + k}, trained (model/mtp.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from zerotrain.config import ModelConfig

from . import llama, moe, mtp
from .decoder import Decoder
from .group_routing import GroupLimitedRouter
from .kv_cache import KVCache
from .llama import LlamaMLP, layer_mask, parallelize_mlp, parallelize_vocab
from .mla import LatentAttention, mla_rope_scaling, query_scale
from .moe import Expert, MoE, PartialDown
from .norms import RMSNorm
from .positions import new_positions
from .recompute import run_block
from .rotary import rotary_tables
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPSlice, blocks


class DeepseekMoE(MoE):
    """The experts routed by GroupLimitedRouter (the `gate`), and the shared experts beside them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.gate = GroupLimitedRouter(cfg)
        self.shared_experts = Expert(cfg.n_embd, cfg.expert_ffn * cfg.shared_experts)

    def route(self, flat: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the top-k weights (N, k) fp32, the experts chosen (N, k)); records the layer's Routing (its probabilities
        the scores normalised per token, as DeepSeek-V3's sequence-wise balancing loss takes them)."""
        scores, weights, chosen = self.gate(flat)
        # computed in a recomputed forward too (activation checkpointing), which must save what the first forward
        # saved; recorded by the first only (MoE.record_routing)
        probs = scores.float() / scores.float().sum(dim=-1, keepdim=True)
        self.record_routing(probs, chosen, B, T)
        return weights, chosen

    def shared_output(self, flat: torch.Tensor, expert_input: torch.Tensor) -> torch.Tensor:
        """The shared experts' output, ungated (under TP this rank's partial sum, added before the layer's one
        all-reduce)."""
        return self.shared_experts(expert_input)


class DeepseekBlock(nn.Module):
    """Pre-norm latent attention and MLP (dense or experts, by the layer)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = LatentAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = DeepseekMoE(cfg) if cfg.has_experts(layer) else LlamaMLP(cfg)

    def forward(self, x, rotary, cache: KVCache | None, layer: int, documents=None, query_scale=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, cache, layer, documents, query_scale)
        return x + self.mlp(self.post_attention_layernorm(x))


class Deepseek(Decoder):
    """Token embedding, DeepSeek-V3's blocks, final RMSNorm, LM head (its own unless tied)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, DeepseekBlock, RMSNorm(cfg.n_embd, cfg.norm_eps),
                         mtp_layers=mtp.build_layers(cfg, DeepseekBlock))

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        x = self.model.embed_tokens(idx)
        if self.context_parallel is not None and cache is None:  # this rank's part of each row, the ring's attention
            positions, mask = self.context_parallel.prepare(idx, segments)  # positions in the whole row (or record)
        else:
            positions = new_positions(idx, cache, cfg.positions, segments)
            mask = layer_mask(cfg, idx, x.dtype, cache, segments, 0)
        rotary = rotary_tables(positions, cfg.qk_rope_dim, cfg.rope_theta, mla_rope_scaling(cfg))
        scale = query_scale(cfg, positions)  # Mistral 4's queries by position; None for DeepSeek-V3
        if self.trains_mtp and cache is None:  # the MTP layers read the embeddings and the blocks' arguments too
            self.mtp_inputs = (x, rotary, mask, scale)
        for layer, block in enumerate(self.model.layers):
            x = run_block(block, self.recompute_blocks and cache is None, x, rotary, cache, layer, mask, scale)
        if cache is not None:
            cache.length += idx.shape[1]
        return self.model.norm(x)


def init_rule(cfg: ModelConfig, name: str):
    """How parameter `name` starts (model/init.py draws it), as transformers' _init_weights: N(0, 0.02) matrices
    (the router's too) and embeddings, unit norm gains, the load-balancing bias at zero."""
    if name.endswith("norm.weight"):  # input_layernorm, post_attention_layernorm, q_a_ and kv_a_layernorm, norm
        return "ones"
    if name.endswith("e_score_correction_bias"):
        return "zeros"
    if name.endswith(".bias"):
        return ("uniform", 1 / math.sqrt(cfg.n_embd))
    return ("normal", 0.02)


# Tensor parallelism, as Megatron and torchtitan split MLA: the attention by heads (mla.py: q_b_proj or q_proj and
# kv_b_proj column-parallel, each rank the rows of its heads; o_proj row-parallel over their value columns), the
# low-rank parts every head reads (q_a_proj, kv_a_proj_with_mqa, their norms) replicated; the dense MLPs, each routed
# expert and the shared experts split by rows of their width (Llama's and model/moe.py's plans), the router and its
# e_score_correction_bias replicated (every TP rank routes the same tokens alike; the bias moves with the step's
# loads, which every rank receives alike from the step's all-reduce); the embedding and the head by vocabulary rows.


def plan(cfg: ModelConfig, tp: int) -> dict[str, TPSlice]:
    """The TP slice of every split parameter, by its name in the full model."""
    H, C, v = cfg.n_head, cfg.n_embd, cfg.v_head_dim
    qk, kv = cfg.qk_nope_dim + cfg.qk_rope_dim, cfg.qk_nope_dim + cfg.v_head_dim
    slices = {n: s for n, s in llama.plan(cfg, tp).items() if ".self_attn." not in n}  # MLPs, experts, vocabulary
    for i in range(cfg.n_layer):
        a = f"model.layers.{i}.self_attn."
        q = "q_b_proj" if cfg.q_lora_rank else "q_proj"
        slices[f"{a}{q}.weight"] = TPSlice(0, (H * qk, cfg.q_lora_rank or C), blocks(H // tp * qk, tp))
        slices[a + "kv_b_proj.weight"] = TPSlice(0, (H * kv, cfg.kv_lora_rank), blocks(H // tp * kv, tp))
        slices[a + "o_proj.weight"] = TPSlice(1, (C, H * v), blocks(H // tp * v, tp))
        if cfg.has_experts(i):
            W, m = cfg.expert_ffn * cfg.shared_experts, f"model.layers.{i}.mlp.shared_experts."
            for proj in ("gate_proj", "up_proj"):
                slices[f"{m}{proj}.weight"] = TPSlice(0, (W, C), blocks(W // tp, tp))
            slices[m + "down_proj.weight"] = TPSlice(1, (C, W), blocks(W // tp, tp))
    return slices


def parallelize(model: Deepseek, tp_size: int, tp_rank: int, comm, kv_comm=None) -> dict[str, TPSlice]:
    """Replace the full model's split layers by this rank's parallel ones, in place; return the plan (`kv_comm`:
    unused, every head has its own keys)."""
    slices = plan(model.cfg, tp_size)

    def column(module, name: str, prefix: str) -> None:  # its input's gradient summed by the caller's copy_to_tp
        setattr(module, name, ColumnParallelLinear(getattr(module, name), slices[f"{prefix}{name}.weight"], None,
                                                   tp_rank, None))

    for i, block in enumerate(model.model.layers):
        h = f"model.layers.{i}."
        attn, mlp = block.self_attn, block.mlp
        column(attn, "q_b_proj" if hasattr(attn, "q_b_proj") else "q_proj", h + "self_attn.")
        column(attn, "kv_b_proj", h + "self_attn.")
        attn.o_proj = RowParallelLinear(attn.o_proj, slices[h + "self_attn.o_proj.weight"], tp_rank, comm)
        attn.tp_comm = comm
        if isinstance(mlp, MoE):
            moe.parallelize(mlp, slices, h + "mlp.", tp_rank, comm)
            shared = h + "mlp.shared_experts."
            column(mlp.shared_experts, "gate_proj", shared)
            column(mlp.shared_experts, "up_proj", shared)
            mlp.shared_experts.down_proj = PartialDown(mlp.shared_experts.down_proj,
                                                       slices[shared + "down_proj.weight"], tp_rank)
            continue
        parallelize_mlp(mlp, slices, h + "mlp.", tp_rank, comm)
    parallelize_vocab(model, slices, tp_rank, comm)
    model.tp_slices = slices
    return slices
