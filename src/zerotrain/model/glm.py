"""GLM-4.5's decoder (glm4_moe: GLM-4.5, GLM-4.5-Air, GLM-4.6 and 4.7), as transformers' Glm4MoeForCausalLM computes
it: the Llama decoder (llama.py) with DeepSeek-V3's experts.

    self_attn   Llama's grouped-query attention, with biases on q, k and v (--attention-bias, attention_bias), an
                RMSNorm of each q and k head before rotary (--use-qk-norm, use_qk_norm), and rotary on the first
                --partial-rotary share of each head's units only (partial_rotary_factor, 0.5 in the releases), in the
                rotate-half convention on those units: pairs (x_i, x_{i + R/2}) of the first R = rotary_dim units,
                the other units passed through (transformers' apply_rotary_pos_emb)
    mlp         layers 0 .. first_k_dense_replace - 1: a SwiGLU MLP of intermediate_size; the others DeepSeek-V3's
                mixture of experts (deepseek.DeepseekMoE: sigmoid scores, group-limited top-k on the scores plus
                e_score_correction_bias, routed_scaling_factor, n_shared_experts shared experts), whose bias moves
                by the auxiliary-loss-free rule (training/routing_bias.py)
    norms       RMSNorms before the attention and the MLP and at the end

Parameter names are transformers' (the experts one linear each, as transformers 5 saves them, and the router's
e_score_correction_bias a tensor of the files): hub/mapping.py's table is the identity. Its multi-token-prediction
layers (model.layers.{num_hidden_layers}...) are set aside at import and copied into an hf export with --mtp frozen,
trained as DeepSeek-V3's with --mtp train (model/mtp.py: GlmBlocks after the same enorm, hnorm and eh_proj; vLLM's
glm4_moe_mtp.py reads them so).

Tensor parallelism is Llama's (llama.plan: attention by heads, the dense MLP and each routed expert by their hidden
width, the router and its bias replicated) with the shared experts split as a dense MLP's slices: gate_proj and up_proj
by rows, down_proj by the matching input columns, its partial sums added to the routed experts' before the layer's one
all-reduce (DeepseekMoE.shared_output), as deepseek.parallelize splits them.
"""

from __future__ import annotations

from zerotrain.config import ModelConfig

from . import deepseek, llama
from .deepseek import DeepseekMoE
from .llama import Llama, LlamaBlock
from .moe import PartialDown
from .tensor_parallel import ColumnParallelLinear, TPSlice, blocks


class GlmBlock(LlamaBlock):
    """Llama's pre-norm attention and MLP, the MLP of the layers after the dense ones DeepSeek-V3's experts."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__(cfg, layer, experts=DeepseekMoE)


class Glm(Llama):
    """Llama's decoder of GlmBlocks (its forward: Llama's, with rotary tables of rotary_dim units)."""

    block = GlmBlock


# DeepSeek-V3's rule: N(0, 0.02) matrices, unit norm gains, the load-balancing bias at zero, nn.Linear's biases
init_rule = deepseek.init_rule


def plan(cfg: ModelConfig, tp: int) -> dict[str, TPSlice]:
    """Llama's slices, and each MoE layer's shared experts' as a dense MLP's."""
    slices = llama.plan(cfg, tp)
    C, W = cfg.n_embd, cfg.expert_ffn * cfg.shared_experts
    rows = blocks(W // tp, tp)
    for i in range(cfg.n_layer):
        if cfg.has_experts(i):
            h = f"model.layers.{i}.mlp.shared_experts."
            slices[h + "gate_proj.weight"] = TPSlice(0, (W, C), rows)
            slices[h + "up_proj.weight"] = TPSlice(0, (W, C), rows)
            slices[h + "down_proj.weight"] = TPSlice(1, (C, W), rows)
    return slices


def parallelize(model: Glm, tp_size: int, tp_rank: int, comm, kv_comm=None) -> dict[str, TPSlice]:
    """Llama's parallel layers, and each MoE layer's shared experts split (MoE.forward gives them the experts' input,
    through copy_to_tp, so that its gradient is summed over the group)."""
    llama.parallelize(model, tp_size, tp_rank, comm, kv_comm)
    slices = plan(model.cfg, tp_size)
    for i, block in enumerate(model.model.layers):
        if not isinstance(block.mlp, DeepseekMoE):
            continue
        h, shared = f"model.layers.{i}.mlp.shared_experts.", block.mlp.shared_experts
        for name in ("gate_proj", "up_proj"):
            setattr(shared, name, ColumnParallelLinear(getattr(shared, name), slices[f"{h}{name}.weight"], None,
                                                       tp_rank, None))
        shared.down_proj = PartialDown(shared.down_proj, slices[h + "down_proj.weight"], tp_rank)
    model.tp_slices = slices
    return slices
