"""Each architecture in Hugging Face's files: one table of names and layouts, and its config.json, for import
and export alike, so the two cannot drift apart.

    gpt2   names are Hugging Face's GPT-2 names; the four per-block matrices are Conv1D there, whose weight is
           (in, out): nn.Linear's transposed. The attention-mask buffers some versions save are not parameters.
    llama  names are Hugging Face's Llama names and matrices are stored as nn.Linear's: the identity. Qwen2,
           Qwen3 and Mistral, the Llama family's other members, name their tensors the same way (Qwen2's q/k/v
           biases and Qwen3's q_norm / k_norm under the same self_attn. prefix): the identity too. Phi-3 stacks
           q, k and v in one qkv_proj and gate and up in one gate_up_proj (by rows, in that order): zerotrain's
           model keeps them apart, and the table says which rows of the stored tensor each one is. Gemma 2 and
           Gemma 3 (gemma3_text) name theirs as Llama does, with Gemma's two more norms per block: the identity.
           A Gemma 3 folder with a vision tower (model_type gemma3, Gemma3ForConditionalGeneration) is read for its
           language model, under language_model.model. (published files) or model.language_model. (transformers 5);
           the vision tower and its projector are skipped, and it exports as the text model (Gemma3ForCausalLM).
           gpt-oss names its router mlp.router (zerotrain's mlp.gate) and stacks every expert of a layer in one
           tensor per projection (gate and up interleaved by columns, x @ W): StackedExperts splits each expert's
           slice into zerotrain's linears and joins them back; its MXFP4 folders' blocks and scales are
           dequantized (dequantize_mxfp4) to the stacked tensor they hold.
    qwen3_5, qwen3_5_moe
           Qwen3.5's text models (qwen3_5_text, qwen3_5_moe_text) name their tensors as zerotrain's model does, the
           experts one linear each as transformers 5 saves them (its qwen2_moe conversion): the identity. Their
           multi-token-prediction head (mtp.*, mtp_num_hidden_layers blocks under mtp.layers.) is set aside at
           import as DeepSeek-V3's MTP layers are (the config keeps their count, --mtp-layers; mtp_layers.py) with
           --mtp frozen; with --mtp train it is zerotrain's mtp.* (model/mtp.py), by the same names.
    deepseek_v3
           DeepSeek-V3's (and Kimi K2's) names are zerotrain's, the experts one linear each, the router's
           e_score_correction_bias a tensor of the files: the identity. Its multi-token-prediction layers
           (model.layers.{num_hidden_layers}... , num_nextn_predict_layers of them) are set aside at import (the
           config keeps their count, --mtp-layers) with --mtp frozen; with --mtp train they are zerotrain's
           model.mtp_layers.{num_hidden_layers}... (mtp_layers.py).
    mistral4
           Mistral 4's (Mistral4ForCausalLM) names are DeepSeek-V3's without the router's bias, its experts stacked
           in nn.Linear's layout (MISTRAL4_EXPERTS: gate_up_proj (E, 2F, C), down_proj (E, C, F)). Its
           rope_parameters are YaRN's with llama_4_scaling_beta (the queries' position scaling) and the
           partial_rotary_factor that rotates qk_rope_head_dim units; it has no MTP layers. transformers 5.25's
           AutoModelForCausalLM does not list it: load an export with Mistral4ForCausalLM.from_pretrained.
    glm4_moe
           GLM-4.5's (Glm4MoeForCausalLM) names are zerotrain's, as DeepSeek-V3's: the identity, its MTP layers set
           aside at import or trained the same way.
    llama4 Llama 4's text model (llama4_text, Llama4ForCausalLM) names a block's MLP feed_forward (zerotrain's mlp)
           and its router feed_forward.router (mlp.gate); its experts are stacked as x @ W, gate_up_proj (E, C, 2F)
           the gate's columns then the up projection's (LLAMA4_EXPERTS).
    gemma4 Gemma 4's text model (gemma4_text, Gemma4ForCausalLM) names its tensors as zerotrain's model does (the
           per-layer input embedding's, each block's layer_scalar, a buffer there, among them), but its MoE block's:
           router.proj, router.scale, router.per_expert_scale and the experts stacked as Mistral 4's beside the MLP
           (GEMMA4_EXPERTS) are zerotrain's moe.gate, moe.scale, moe.per_expert_scale and moe.experts.{e}.*. Its
           shared-KV layers have no k_proj, v_proj or their norms, in its files as in zerotrain's model.

config.json both ways: each family's Hugging Face fields, read into zerotrain's ModelConfig (model_config_from_hf)
and written from it (hf_config); Llama 3.1's and YaRN's rope scaling are read from `rope_scaling` (older
transformers and the published configs) or `rope_parameters` (what transformers 5 writes), and written as
`rope_scaling`, which both read. A field zerotrain's model does not have (another rope type, Qwen's use_sliding_window) is refused, naming it.

pad_token_id, where the Llama family has it, is the token embedding's padding row both ways (transformers' models build
nn.Embedding with padding_idx = pad_token_id; a config.json without one gets its family's default: OLMoE 1, Phi-3
32000, Gemma 0, the others none); GPT-2's embedding has none.

A tied head is stored once, under the token embedding's name. init_from.py reads each rank's TP slices through
the same table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from zerotrain.config import DEEPSEEK, GEMMA, GEMMA4, GLM, LLAMA4, MOE, QWEN35, WINDOWED, ModelConfig
from zerotrain.errors import CheckpointError
from zerotrain.model.moe import SWIGLU_ALPHA, SWIGLU_LIMIT

from .mtp_layers import TRAINED_PREFIX


@dataclass(frozen=True)
class HFMapping:
    arch: str
    model_type: str  # config.json's model_type
    hf_class: str  # config.json's architectures[0]
    block_prefix: str
    transposed: tuple[str, ...]  # suffixes of per-block matrices stored (in, out)
    ignored: tuple[str, ...]  # suffixes of tensors their files may hold that are not parameters
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (stored suffix, zerotrain's suffixes stacked in it by rows)
    renamed: tuple[tuple[str, str], ...] = ()  # (stored prefix, zerotrain's prefix)
    skipped: tuple[str, ...] = ()  # prefixes of tensors of another model in the same files (a vision tower)
    infixes: tuple[tuple[str, str], ...] = ()  # (stored part of a name, zerotrain's): Mixtral's expert names
    experts: tuple[StackedExperts, ...] = ()  # tensors holding every expert's parameter of a layer (gpt-oss's)
    layers_after: bool = False  # blocks past num_hidden_layers are another model's (DeepSeek-V3's MTP layers)

    def expert_parts(self, name: str, cfg: ModelConfig) -> list[tuple[str, int, int, StackedExperts]]:
        """[(zerotrain's name, its expert, its place in the stacking's parts, the stacking)] for a stored tensor
        (by its canonical name) that holds every expert's parameter of a layer; [] for any other."""
        for stack in self.experts:
            if name.startswith(self.block_prefix) and name.endswith("." + stack.stored):
                base = name[: -len(stack.stored)] + stack.stored.rpartition(".")[0]  # ...mlp.experts
                return [(f"{base}.{e}.{part}", e, i, stack) for e in range(cfg.n_experts)
                        for i, part in enumerate(stack.parts)]
        return []

    def stored_name(self, name: str) -> str:
        """Parameter `name` (zerotrain's) as the files name it, where a part of it differs (infixes; trained MTP layers:
        mtp_layers.py)."""
        if self.layers_after and name.startswith(TRAINED_PREFIX):
            return self.block_prefix + name[len(TRAINED_PREFIX):]
        for stored, ours in self.infixes:
            name = name.replace(ours, stored)
        return name

    def canonical(self, name: str) -> str:
        """A tensor's name as zerotrain's model has it. GPT-2 folders saved from the bare GPT2Model (the original
        `gpt2` files among them) drop the `transformer.` prefix: it is put back. A Gemma 3 language model's
        prefix inside its multimodal model is taken off."""
        if self.arch == "gpt2" and not name.startswith((self.block_prefix.split(".")[0] + ".", "lm_head.")):
            return "transformer." + name
        for stored, ours in self.renamed:
            if name.startswith(stored):
                return ours + name[len(stored):]
        for stored, ours in self.infixes:
            name = name.replace(stored, ours)
        return name

    def is_ignored(self, name: str, cfg: ModelConfig | None = None) -> bool:
        """Whether a stored tensor (by its canonical name) is not one of the model's parameters (with `cfg`: a block
        past the model's layers, where the family's files keep their multi-token-prediction layers)."""
        if self.layers_after and name.startswith(TRAINED_PREFIX):  # read only where the model trains them
            return True
        if cfg is not None and self.layers_after and name.startswith(self.block_prefix):
            layer = name[len(self.block_prefix):].partition(".")[0]
            if layer.isdigit() and int(layer) >= cfg.n_layer:
                return True
        return name.endswith(self.ignored) or (bool(self.skipped) and name.startswith(self.skipped))

    def is_transposed(self, name: str) -> bool:
        return bool(self.transposed) and name.startswith(self.block_prefix) and name.endswith(self.transposed)

    def unfused(self, name: str, cfg: ModelConfig) -> list[tuple[str, int, int | None]]:
        """The parameters a stored tensor holds: [(zerotrain's name, its first row, its rows)]; one tensor stored
        as it is gives [(name, 0, None)]."""
        for stored, parts in self.fused:
            if name.startswith(self.block_prefix) and name.endswith(stored):
                prefix, at, out = name[: -len(stored)], 0, []
                for part in parts:
                    out.append((prefix + part, at, PART_ROWS[part](cfg)))
                    at += out[-1][2]
                return out
        return [(name, 0, None)]

    def to_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """zerotrain's tensors (names -> tensors) in Hugging Face's layout, fp32 and contiguous; fused and stacked
        by zerotrain's names, renamed (infixes) last."""
        out = {n: (t.t() if self.is_transposed(n) else t).detach().float().contiguous() for n, t in tensors.items()}
        for stored, parts in self.fused:
            for name in [n for n in out if n.startswith(self.block_prefix) and n.endswith(parts[0])]:
                prefix = name[: -len(parts[0])]
                out[prefix + stored] = torch.cat([out.pop(prefix + part) for part in parts])
        for stack in self.experts:  # every expert's parts, joined, stacked by expert
            for name in [n for n in out if n.endswith(".experts.0." + stack.parts[0])]:
                base = name[: -len(".0." + stack.parts[0])]
                n_experts = sum(1 for n in out if n.startswith(base + ".") and n.endswith("." + stack.parts[0]))
                out[base[: -len(stack.stored.rpartition(".")[0])] + stack.stored] = torch.stack([
                    stack.join(*(out.pop(f"{base}.{e}.{part}") for part in stack.parts)) for e in range(n_experts)])
        return {self.stored_name(n): t for n, t in out.items()}

    def from_hf(self, tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """Hugging Face's tensors in zerotrain's layout; tensors that are not parameters are dropped."""
        named = dequantized({self.canonical(n): t for n, t in tensors.items()})
        out = {}
        for n, t in named.items():
            if self.is_ignored(n, cfg):
                continue
            if self.is_transposed(n):
                t = t.t().contiguous()
            experts = self.expert_parts(n, cfg)
            for part, e, i, stack in experts:
                out[part] = stack.split(t[e])[i].contiguous()
            if experts:
                continue
            for part, at, rows in self.unfused(n, cfg):
                out[part] = t if rows is None else t[at : at + rows]
        return out


@dataclass(frozen=True)
class StackedExperts:
    """A tensor of every expert's parameter of a layer, as transformers' GptOssExperts holds it: (E, ...), each
    expert's slice `split` into its parts in zerotrain's layout (nn.Linear's), and `join`ed back from them."""

    stored: str  # the stored tensor's suffix
    parts: tuple[str, ...]  # zerotrain's suffixes under mlp.experts.{e}.
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    join: Callable[..., torch.Tensor]


def interleaved(*parts: torch.Tensor) -> torch.Tensor:
    """Columns (last dimension) alternating between the parts: gpt-oss's gate and up in one gate_up_proj."""
    return torch.stack(parts, dim=-1).flatten(-2)


# gpt-oss multiplies x @ W: its expert matrices are nn.Linear's transposed, and gate_up_proj (E, C, 2F) holds the
# gate's and the up projection's columns alternating (gate 0, up 0, gate 1, ...), its bias (E, 2F) as well.
GPT_OSS_EXPERTS = (
    StackedExperts("mlp.experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"),
                   lambda t: (t[:, 0::2].t(), t[:, 1::2].t()), lambda gate, up: interleaved(gate.t(), up.t())),
    StackedExperts("mlp.experts.gate_up_proj_bias", ("gate_proj.bias", "up_proj.bias"),
                   lambda t: (t[0::2], t[1::2]), interleaved),
    StackedExperts("mlp.experts.down_proj", ("down_proj.weight",), lambda t: (t.t(),), lambda down: down.t()),
    StackedExperts("mlp.experts.down_proj_bias", ("down_proj.bias",), lambda t: (t,), lambda bias: bias),
)

# Llama 4 multiplies x @ W as gpt-oss does; its gate_up_proj (E, C, 2F) holds the gate's columns, then the up
# projection's (transformers' Llama4TextExperts chunks it in two); no biases.
LLAMA4_EXPERTS = (
    StackedExperts("mlp.experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"),
                   lambda t: tuple(half.t() for half in t.chunk(2, dim=-1)),
                   lambda gate, up: torch.cat((gate.t(), up.t()), dim=-1)),
    StackedExperts("mlp.experts.down_proj", ("down_proj.weight",), lambda t: (t.t(),), lambda down: down.t()),
)

# Mistral 4 stacks its experts in nn.Linear's layout (transformers 5.25 has no per-expert conversion for it):
# gate_up_proj (E, 2F, C) the gate's rows, then the up projection's; down_proj (E, C, F).
MISTRAL4_EXPERTS = (
    StackedExperts("mlp.experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"), lambda t: t.chunk(2, dim=0),
                   lambda gate, up: torch.cat((gate, up), dim=0)),
    StackedExperts("mlp.experts.down_proj", ("down_proj.weight",), lambda t: (t,), lambda down: down),
)

# Gemma 4 stacks them as Mistral 4 does, beside the block's MLP: layers.{i}.experts.gate_up_proj (E, 2F, C) and
# experts.down_proj (E, C, F), zerotrain's moe.experts (GEMMA4_INFIXES names them)
GEMMA4_EXPERTS = tuple(StackedExperts(s.stored.replace("mlp.", "moe.", 1), s.parts, s.split, s.join) for s in MISTRAL4_EXPERTS)
# Gemma 4's router (router.proj, router.scale, router.per_expert_scale) and experts are zerotrain's moe.gate, moe.scale,
# moe.per_expert_scale and moe.experts; in this order both ways (moe.experts before the rest of moe.)
GEMMA4_INFIXES = ((".router.proj.", ".moe.gate."), (".experts.", ".moe.experts."), (".router.", ".moe."))

# MXFP4 (OCP microscaling, 4-bit floats): gpt-oss's released folders store each expert matrix as `<name>_blocks`
# (E, rows, G, 16) uint8, two FP4 (e2m1) values a byte, low nibble first, and `<name>_scales` (E, rows, G) uint8,
# the power of two (biased by 127) of each block of 32 values along the row; the rows are the matrix's output
# features, so the dequantized (E, rows, 32 G) is transposed to the (E, in, out) the other folders store.
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 matrix (..., 32 G, rows) of MXFP4 `blocks` (..., rows, G, 16) and `scales` (..., rows, G): exact
    (every FP4 value times a power of two is an fp32). One expert's slice or all of them (the leading dimensions)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)  # (..., rows, G, 32)
    return values.flatten(-2).transpose(-1, -2)


def dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with each MXFP4 pair (`X_blocks`, `X_scales`) replaced by X, dequantized to fp32."""
    out = {n: t for n, t in tensors.items() if not (n.endswith(MXFP4_SCALES) and n[: -len(MXFP4_SCALES)] +
                                                     MXFP4_BLOCKS in tensors)}
    for name in [n for n in out if n.endswith(MXFP4_BLOCKS)]:
        base = name[: -len(MXFP4_BLOCKS)]
        if base + MXFP4_SCALES in tensors:
            out[base] = dequantize_mxfp4(out.pop(name), tensors[base + MXFP4_SCALES])
    return out


# The rows of each matrix Phi-3 stacks, from the model's sizes.
PART_ROWS = {
    "self_attn.q_proj.weight": lambda c: c.n_head * c.head_dim,
    "self_attn.k_proj.weight": lambda c: c.kv_heads * c.head_dim,
    "self_attn.v_proj.weight": lambda c: c.kv_heads * c.head_dim,
    "mlp.gate_proj.weight": lambda c: c.ffn_width,
    "mlp.up_proj.weight": lambda c: c.ffn_width,
}
PHI3_FUSED = (("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight")),
              ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")))


MAPPINGS = {
    "gpt2": HFMapping("gpt2", "gpt2", "GPT2LMHeadModel", "transformer.h.",
                      ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"),
                      (".attn.bias", ".attn.masked_bias")),
    **{arch: HFMapping(arch, arch, cls, "model.layers.", (), (".rotary_emb.inv_freq",)) for arch, cls in (
        ("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
        ("mistral", "MistralForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
        ("olmoe", "OlmoeForCausalLM"))},
    # Mixtral's files name the MoE block block_sparse_moe and an expert's gate, down and up projections w1, w2, w3
    "mixtral": HFMapping("mixtral", "mixtral", "MixtralForCausalLM", "model.layers.", (), (".rotary_emb.inv_freq",),
                         infixes=((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
                                  (".w2.weight", ".down_proj.weight"), (".w3.weight", ".up_proj.weight"))),
    "phi3": HFMapping("phi3", "phi3", "Phi3ForCausalLM", "model.layers.", (), (".rotary_emb.inv_freq",), PHI3_FUSED),
    # gpt-oss's router is mlp.router (zerotrain's mlp.gate), its experts stacked (GPT_OSS_EXPERTS)
    "gpt_oss": HFMapping("gpt_oss", "gpt_oss", "GptOssForCausalLM", "model.layers.", (), (".rotary_emb.inv_freq",),
                         infixes=((".mlp.router.", ".mlp.gate."),), experts=GPT_OSS_EXPERTS),
    **{arch: HFMapping(arch, kind, cls, "model.layers.", (), (".rotary_emb.inv_freq",), skipped=("mtp.",))
       for arch, kind, cls in (("qwen3_5", "qwen3_5_text", "Qwen3_5ForCausalLM"),
                               ("qwen3_5_moe", "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"))},
    "deepseek_v3": HFMapping("deepseek_v3", "deepseek_v3", "DeepseekV3ForCausalLM", "model.layers.", (),
                             (".rotary_emb.inv_freq",), layers_after=True),
    "mistral4": HFMapping("mistral4", "mistral4", "Mistral4ForCausalLM", "model.layers.", (),
                          (".rotary_emb.inv_freq",), experts=MISTRAL4_EXPERTS),
    "glm4_moe": HFMapping("glm4_moe", "glm4_moe", "Glm4MoeForCausalLM", "model.layers.", (), (".rotary_emb.inv_freq",),
                          layers_after=True),
    "llama4": HFMapping("llama4", "llama4_text", "Llama4ForCausalLM", "model.layers.", (), (".rotary_emb.inv_freq",),
                        infixes=((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp.")),
                        experts=LLAMA4_EXPERTS),
    "gemma2": HFMapping("gemma2", "gemma2", "Gemma2ForCausalLM", "model.layers.", (), (".rotary_emb.inv_freq",)),
    "gemma4": HFMapping("gemma4", "gemma4_text", "Gemma4ForCausalLM", "model.layers.", (), ("_inv_freq",),
                        infixes=GEMMA4_INFIXES, experts=GEMMA4_EXPERTS),
    "gemma3": HFMapping("gemma3", "gemma3_text", "Gemma3ForCausalLM", "model.layers.", (), (".rotary_emb.inv_freq",),
                        renamed=(("language_model.model.", "model."), ("model.language_model.", "model."),
                                 ("language_model.lm_head.", "lm_head.")),
                        skipped=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                 "model.multi_modal_projector.")),
}
BY_MODEL_TYPE = {m.model_type: m for m in MAPPINGS.values()}
BY_MODEL_TYPE["gemma3"] = MAPPINGS["gemma3"]  # Gemma3ForConditionalGeneration: its language model
MULTIMODAL = {"gemma3": "text_config"}  # model_type -> the key of its language model's config


def hf_config(cfg: ModelConfig, eot_id: int | None) -> dict:
    """The config.json of this model in Hugging Face's format: the architecture zerotrain trains, nothing left to
    defaults that differ."""
    eot = eot_id if eot_id is not None and 0 <= eot_id < cfg.vocab_size else None
    if cfg.arch == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.positions, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_inner": cfg.intermediate_size or None,  # None: 4 * n_embd
            "activation_function": "gelu_new",  # GELU with the tanh approximation, as model.gpt2.MLP
            "layer_norm_epsilon": cfg.norm_eps,
            "tie_word_embeddings": True,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,  # zerotrain trains without dropout
            "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": eot, "eos_token_id": eot,
            "dtype": "float32",
        }
    config = {
        "architectures": [MAPPINGS[cfg.arch].hf_class], "model_type": MAPPINGS[cfg.arch].model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_width,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.positions, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": _rope_scaling(cfg), "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": cfg.padding_idx,  # the embedding's padding row
        "dtype": "float32",
    }
    if cfg.arch in QWEN35:
        return _qwen35_config(cfg, config)
    if cfg.arch in DEEPSEEK:
        return _deepseek_config(cfg, config)
    if cfg.arch in GLM:
        return _glm_config(cfg, config)
    if cfg.arch in LLAMA4:
        return _llama4_config(cfg, config)
    if cfg.arch in GEMMA4:
        return _gemma4_config(cfg, config)
    if cfg.arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif cfg.arch in ("qwen2", "qwen3"):  # every layer attends to every earlier token
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layer)
        if cfg.arch == "qwen3":
            config.update(attention_bias=False)
    elif cfg.gemma:
        config.update(_gemma_config(cfg))
    elif cfg.moe:
        config.update(_moe_config(cfg))
    else:
        config.update(sliding_window=cfg.sliding_window or None)
        if cfg.arch == "phi3":
            config.update(original_max_position_embeddings=cfg.positions, partial_rotary_factor=1.0,
                          resid_pdrop=0.0, embd_pdrop=0.0)
    return config


def _qwen35_config(cfg: ModelConfig, config: dict) -> dict:
    """Qwen3.5's config.json from the Llama family's fields: its layer types, linear-attention sizes, partial rotary
    in rope_parameters (transformers 5's form), and the MoE's experts (every layer's, with the shared expert)."""
    config = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    config.update(layer_types=["linear_attention" if cfg.linear_attention(i) else "full_attention"
                               for i in range(cfg.n_layer)],
                  attention_bias=False, linear_conv_kernel_dim=cfg.linear_conv_kernel,
                  linear_key_head_dim=cfg.linear_key_width, linear_value_head_dim=cfg.linear_value_width,
                  linear_num_key_heads=cfg.linear_key_heads, linear_num_value_heads=cfg.linear_value_heads,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                   "partial_rotary_factor": cfg.partial_rotary})
    if cfg.mtp_layers:  # the head kept from the --init-from folder (mtp_layers.py)
        config.update(mtp_num_hidden_layers=cfg.mtp_layers, mtp_use_dedicated_embeddings=False)
    if cfg.moe:
        del config["intermediate_size"]  # Qwen3_5MoeTextConfig has none: every layer has experts
        config.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                      moe_intermediate_size=cfg.expert_ffn, shared_expert_intermediate_size=cfg.shared_expert_width,
                      router_aux_loss_coef=cfg.router_aux_coef, output_router_logits=False)
    return config


def _deepseek_config(cfg: ModelConfig, config: dict) -> dict:
    """DeepSeek-V3's config.json from the Llama family's fields: the latent attention's sizes, the routing, YaRN's
    mscale pair in rope_parameters (transformers 5's form)."""
    config = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling", "head_dim")}
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        rope.update(_rope_scaling(cfg), rope_theta=cfg.rope_theta, mscale=cfg.rope_mscale,
                    mscale_all_dim=cfg.rope_mscale_all_dim)
    config.update(num_key_value_heads=cfg.n_head, q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                  qk_rope_head_dim=cfg.qk_rope_dim, qk_nope_head_dim=cfg.qk_nope_dim, v_head_dim=cfg.v_head_dim,
                  rope_interleave=cfg.rope_interleave, rope_parameters=rope, attention_bias=False,
                  n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                  moe_intermediate_size=cfg.expert_ffn, n_shared_experts=cfg.shared_experts,
                  n_group=cfg.expert_groups, topk_group=cfg.expert_groups_per_token,
                  norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling,
                  first_k_dense_replace=cfg.first_dense_layers, num_nextn_predict_layers=cfg.mtp_layers)
    if cfg.arch == "mistral4":  # no MTP layers; the query scaling and the rotary share of a head with the rope
        del config["num_nextn_predict_layers"]
        rope.update(llama_4_scaling_beta=cfg.llama4_scaling_beta,
                    partial_rotary_factor=cfg.qk_rope_dim / (cfg.qk_nope_dim + cfg.qk_rope_dim))
    return config


def _glm_config(cfg: ModelConfig, config: dict) -> dict:
    """GLM-4.5's config.json (Glm4MoeConfig) from the Llama family's fields: the partial rotary in rope_parameters
    (transformers 5's form), its attention's options, DeepSeek-V3's routing fields."""
    config = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    config.update(rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                   "partial_rotary_factor": cfg.partial_rotary},
                  attention_bias=cfg.attention_bias, use_qk_norm=cfg.use_qk_norm,
                  n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                  moe_intermediate_size=cfg.expert_ffn, n_shared_experts=cfg.shared_experts,
                  n_group=cfg.expert_groups, topk_group=cfg.expert_groups_per_token,
                  norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling,
                  first_k_dense_replace=cfg.first_dense_layers, num_nextn_predict_layers=cfg.mtp_layers,
                  output_router_logits=False)
    return config


def _llama4_config(cfg: ModelConfig, config: dict) -> dict:
    """Llama 4's config.json (Llama4TextConfig): the experts' width as intermediate_size and the dense layers' as
    intermediate_size_mlp, its layers with experts and with rotary listed, the chunk, the q/k norm, the temperature
    tuning, the rope scaling in rope_parameters (transformers 5's form)."""
    config = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    config.update(intermediate_size=cfg.expert_ffn, intermediate_size_mlp=cfg.ffn_width,
                  num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                  interleave_moe_layer_step=cfg.moe_every,
                  moe_layers=[i for i in range(cfg.n_layer) if cfg.has_experts(i)],
                  no_rope_layer_interval=cfg.nope_every,
                  no_rope_layers=[int(cfg.rotary(i)) for i in range(cfg.n_layer)],
                  attention_chunk_size=cfg.attention_chunk or None, use_qk_norm=cfg.qk_l2_norm,
                  attn_temperature_tuning=cfg.temperature_tuning, floor_scale=cfg.temperature_floor,
                  attn_scale=cfg.temperature_scale, attention_bias=False, router_aux_loss_coef=cfg.router_aux_coef,
                  router_jitter_noise=0.0, output_router_logits=False,
                  rope_parameters={"rope_type": "default", **(_rope_scaling(cfg) or {}), "rope_theta": cfg.rope_theta})
    return config


def _gemma4_config(cfg: ModelConfig, config: dict) -> dict:
    """Gemma 4's config.json (Gemma4TextConfig): its layer types, each kind's rotary in rope_parameters, the global
    layers' shape as per_layer_config (what transformers 5 writes), the shared KV and per-layer input embedding."""
    config = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling", "hidden_act")}
    types = ["sliding_attention" if cfg.sliding(i) else "full_attention" for i in range(cfg.n_layer)]
    heads, width = cfg.attention_shape(cfg.n_layer - 1)  # the last layer is global
    shape = {"head_dim": width, **({"num_key_value_heads": heads} if cfg.k_eq_v else {})}
    config.update(hidden_activation="gelu_pytorch_tanh", layer_types=types, sliding_window=cfg.sliding_window,
                  final_logit_softcapping=cfg.final_softcap or None, attention_bias=False,
                  use_bidirectional_attention=None, attention_k_eq_v=cfg.k_eq_v,
                  num_kv_shared_layers=cfg.kv_shared_layers, use_double_wide_mlp=cfg.double_wide_mlp,
                  hidden_size_per_layer_input=cfg.per_layer_width, vocab_size_per_layer_input=cfg.vocab_size,
                  enable_moe_block=cfg.moe, num_experts=cfg.n_experts or None,
                  top_k_experts=cfg.experts_per_token if cfg.moe else None,
                  moe_intermediate_size=cfg.expert_ffn if cfg.moe else None,
                  per_layer_config={str(i): shape for i, kind in enumerate(types) if kind == "full_attention"},
                  rope_parameters={
                      "sliding_attention": {"rope_type": "default",
                                            "rope_theta": cfg.rope_local_theta or cfg.rope_theta},
                      "full_attention": {"rope_type": "proportional", "partial_rotary_factor": cfg.partial_rotary,
                                         "rope_theta": cfg.rope_theta}})
    return config


def _moe_config(cfg: ModelConfig) -> dict:
    """A mixture of experts' fields: its experts, their routing and where they are, and its attention's options.
    Mixtral's and OLMoE's intermediate_size is their experts' width (every layer has experts)."""
    experts = dict(num_experts_per_tok=cfg.experts_per_token, router_aux_loss_coef=cfg.router_aux_coef,
                   output_router_logits=False)
    if cfg.arch == "gpt_oss":  # its rope as rope_parameters: without them, GptOssConfig would take YaRN's default
        types = ["sliding_attention" if cfg.sliding(i) else "full_attention" for i in range(cfg.n_layer)]
        return dict(experts, num_local_experts=cfg.n_experts, intermediate_size=cfg.expert_ffn, attention_bias=True,
                    swiglu_limit=SWIGLU_LIMIT, swiglu_alpha=SWIGLU_ALPHA, layer_types=types,
                    sliding_window=cfg.sliding_window or cfg.positions, rope_scaling=None,
                    rope_parameters={"rope_type": "default", **(_rope_scaling(cfg) or {}),
                                     "rope_theta": cfg.rope_theta})
    if cfg.arch in ("mixtral", "olmoe"):
        experts.update(intermediate_size=cfg.expert_ffn)
    if cfg.arch == "mixtral":
        return dict(experts, num_local_experts=cfg.n_experts, sliding_window=cfg.sliding_window or None,
                    router_jitter_noise=0.0)
    experts.update(num_experts=cfg.n_experts, norm_topk_prob=cfg.norm_topk_prob)
    if cfg.arch == "olmoe":
        return dict(experts, attention_bias=False, clip_qkv=None)
    experts.update(moe_intermediate_size=cfg.expert_ffn, decoder_sparse_step=cfg.moe_every,
                   mlp_only_layers=list(cfg.dense_layers), use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.n_layer)
    if cfg.arch == "qwen2_moe":
        return dict(experts, shared_expert_intermediate_size=cfg.shared_expert_width, qkv_bias=True,
                    layer_types=["full_attention"] * cfg.n_layer)
    return dict(experts, attention_bias=False)


def _gemma_config(cfg: ModelConfig) -> dict:
    """Gemma's fields: its activation, attention scale, layer types and windows, soft-caps (Gemma 2's), local rotary
    base (Gemma 3's, written as the published configs have it, which transformers 5 reads too)."""
    types = ["sliding_attention" if cfg.sliding(i) else "full_attention" for i in range(cfg.n_layer)]
    config = dict(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
                  query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim, attention_bias=False,
                  layer_types=types, sliding_window=cfg.sliding_window or cfg.positions,  # a number, even unused
                  final_logit_softcapping=cfg.final_softcap or None, attn_logit_softcapping=cfg.attn_softcap or None)
    if cfg.arch == "gemma3":
        config.update(rope_local_base_freq=cfg.rope_local_theta or cfg.rope_theta,
                      sliding_window_pattern=cfg.sliding_window_pattern or cfg.n_layer + 1,
                      use_bidirectional_attention=False)
    return config


def _rope_scaling(cfg: ModelConfig) -> dict | None:
    if cfg.rope_scaling == "none":
        return None
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_factor}
    if cfg.rope_scaling == "yarn":
        return {"rope_type": "yarn", "factor": cfg.rope_factor, "original_max_position_embeddings":
                cfg.rope_original_context, "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
                "truncate": cfg.rope_truncate, **({"attention_factor": cfg.rope_attention_factor}
                                                  if cfg.rope_attention_factor else {})}
    return {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_context}


def model_config_from_hf(config: dict, where: str) -> ModelConfig:
    """zerotrain's ModelConfig for a Hugging Face config.json of a model_type in MAPPINGS; CheckpointError naming
    the first key whose value is of the wrong type or out of range, or a setting zerotrain's architecture does
    not have."""
    kind = config.get("model_type")
    if kind not in BY_MODEL_TYPE:
        raise CheckpointError(f"{where}: model_type {kind!r}; zerotrain builds {', '.join(BY_MODEL_TYPE)}")
    if kind in MULTIMODAL:  # the language model's config, as transformers fills it in
        text = _table(config, MULTIMODAL[kind], where)
        config = {**text, "model_type": BY_MODEL_TYPE[kind].model_type,
                  **{k: config[k] for k in ("tie_word_embeddings",) if k in config}}
        where = f"{where} {MULTIMODAL[kind]}"
    if BY_MODEL_TYPE[kind].arch in QWEN35:
        return _qwen35(config, where)
    if BY_MODEL_TYPE[kind].arch in DEEPSEEK:
        return _deepseek(config, where)
    if BY_MODEL_TYPE[kind].arch in LLAMA4:
        return _llama4(config, where)
    if BY_MODEL_TYPE[kind].arch in GLM:
        return _glm(config, where)
    if BY_MODEL_TYPE[kind].arch in GEMMA4:
        return _gemma4(config, where)
    return _gpt2_config(config, where) if kind == "gpt2" else _llama_config(config, where)


_REQUIRED = object()


def _count(config: dict, key: str, where: str, default=_REQUIRED) -> int:
    """config[key], a positive integer; `default` where it is absent or null (required without one)."""
    if key not in config and default is _REQUIRED:
        raise CheckpointError(f"{where}: no {key!r}")
    value = config.get(key)
    if value is None and default is not _REQUIRED:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _positive(config: dict, key: str, where: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise CheckpointError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def _table(config: dict, key: str, where: str) -> dict:
    value = config.get(key)
    if value is not None and not isinstance(value, dict):
        raise CheckpointError(f"{where}: {key} must be an object or null, got {value!r}")
    return value or {}


def _divides(config: dict, where: str, part: str, whole: str) -> None:
    if config[whole] % config[part]:
        raise CheckpointError(f"{where}: {whole} {config[whole]} is not divisible by {part} {config[part]}")


def _refuse(config: dict, where: str, expected: tuple) -> None:
    for key, default, allowed in expected:
        value = config.get(key, default)
        if not any(type(value) is type(a) and value == a for a in allowed):  # 1 is not True
            raise CheckpointError(f"{where}: {key} = {value!r}; zerotrain's {config['model_type']} has {allowed[0]!r}")


def _gpt2_config(config: dict, where: str) -> ModelConfig:
    _refuse(config, where, (
        ("activation_function", "gelu_new", ("gelu_new", "gelu_pytorch_tanh")),
        ("tie_word_embeddings", True, (True,)), ("scale_attn_weights", True, (True,)),
        ("scale_attn_by_inverse_layer_idx", False, (False,)), ("add_cross_attention", False, (False,))))
    sizes = {key: _count(config, key, where) for key in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")}
    _divides(sizes, where, "n_head", "n_embd")
    inner = _count(config, "n_inner", where, default=0)
    return ModelConfig(arch="gpt2", n_layer=sizes["n_layer"], n_head=sizes["n_head"], n_embd=sizes["n_embd"],
                       intermediate_size=0 if inner == 4 * sizes["n_embd"] else inner,
                       seq_len=sizes["n_positions"], vocab_size=sizes["vocab_size"],
                       norm_eps=_positive(config, "layer_norm_epsilon", where, 1e-5))


# What transformers' Qwen3_5TextConfig and Qwen3_5MoeTextConfig give a field their config.json leaves out.
_QWEN35_DEFAULTS = dict(head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_num_key_heads=16, linear_num_value_heads=32, max_position_embeddings=32768)


def _qwen35(config: dict, where: str) -> ModelConfig:
    """Qwen3.5's ModelConfig (qwen3_5_text or qwen3_5_moe_text): the Llama family's sizes, its layer types as an
    interval, the linear layers' sizes, partial rotary; the MoE's experts, on every layer, with a shared expert."""
    arch = BY_MODEL_TYPE[config["model_type"]].arch
    config = {**_QWEN35_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    _refuse(config, where, (("hidden_act", "silu", ("silu",)), ("attention_bias", False, (False,)),
                            ("mtp_use_dedicated_embeddings", False, (False,))))
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise CheckpointError(f"{where}: tie_word_embeddings must be true or false, got {tied!r}")
    keys = ("num_hidden_layers", "num_attention_heads", "hidden_size", "max_position_embeddings", "vocab_size",
            "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads",
            *(() if arch == "qwen3_5_moe" else ("intermediate_size",)))
    sizes = {key: _count(config, key, where) for key in keys}
    n, heads = sizes["num_hidden_layers"], sizes["num_attention_heads"]
    sizes["num_key_value_heads"] = _count(config, "num_key_value_heads", where, default=heads)
    _divides(sizes, where, "num_key_value_heads", "num_attention_heads")
    _divides(sizes, where, "linear_num_key_heads", "linear_num_value_heads")
    mtp = config.get("mtp_num_hidden_layers", 0)
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise CheckpointError(f"{where}: mtp_num_hidden_layers must be a whole number, got {mtp!r}")
    types = config.get("layer_types")
    interval = config.get("full_attention_interval", 4)
    if types is not None:
        interval = next((i for i in range(1, n + 2) if types == ["full_attention" if (layer + 1) % i == 0 else
                                                                 "linear_attention" for layer in range(n)]), None)
        if interval is None:
            raise CheckpointError(f"{where}: layer_types {types!r} are not every N-th layer full_attention, the others "
                                  "linear_attention, as zerotrain's qwen3_5 has them")
    rope = _table(config, "rope_parameters", where)
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{where}: rope_parameters has rope_type {rope['rope_type']!r}; zerotrain's {arch} has "
                              "'default'")
    theta = _positive(rope, "rope_theta", f"{where} rope_parameters", 10000.0) if "rope_theta" in rope else \
        _positive(config, "rope_theta", where, 10000.0)
    partial = _positive(rope, "partial_rotary_factor", f"{where} rope_parameters",
                        config.get("partial_rotary_factor", 0.25))
    experts = {}
    if arch == "qwen3_5_moe":
        k, e = _count(config, "num_experts_per_tok", where, default=8), _count(config, "num_experts", where)
        if k > e:
            raise CheckpointError(f"{where}: num_experts_per_tok {k} is more than the {e} experts")
        experts = dict(n_experts=e, experts_per_token=k, norm_topk_prob=True,
                       expert_width=_count(config, "moe_intermediate_size", where),
                       shared_expert_width=_count(config, "shared_expert_intermediate_size", where),
                       router_aux_coef=float(config.get("router_aux_loss_coef", 0.001)))
    head_dim = sizes["head_dim"]
    return ModelConfig(arch=arch, n_layer=n, n_head=heads, n_kv_head=sizes["num_key_value_heads"],
                       n_embd=sizes["hidden_size"], pad_token_id=_padding_id(config, where, config["model_type"],
                                                                              sizes["vocab_size"]),
                       head_width=0 if head_dim * heads == sizes["hidden_size"] else head_dim,
                       intermediate_size=sizes.get("intermediate_size", 0), seq_len=sizes["max_position_embeddings"],
                       vocab_size=sizes["vocab_size"], rope_theta=theta, partial_rotary=partial,
                       norm_eps=_positive(config, "rms_norm_eps", where, 1e-6), tie_embeddings=tied,
                       full_attention_interval=interval, linear_conv_kernel=sizes["linear_conv_kernel_dim"],
                       linear_key_heads=sizes["linear_num_key_heads"],
                       linear_value_heads=sizes["linear_num_value_heads"],
                       linear_key_width=sizes["linear_key_head_dim"], linear_value_width=sizes["linear_value_head_dim"],
                       mtp_layers=mtp, **experts)


# What transformers' DeepseekV3Config and Mistral4Config give a field their config.json leaves out (their own sizes).
_DEEPSEEK_DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                          num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                          routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                          v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                          first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096,
                          rope_interleave=True, num_nextn_predict_layers=1)
_MISTRAL4_DEFAULTS = dict(vocab_size=131072, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
                          num_hidden_layers=36, num_attention_heads=32, n_shared_experts=1, n_routed_experts=128,
                          routed_scaling_factor=1.0, kv_lora_rank=256, q_lora_rank=1024, qk_rope_head_dim=64,
                          v_head_dim=128, qk_nope_head_dim=64, n_group=1, topk_group=1, num_experts_per_tok=4,
                          first_k_dense_replace=0, norm_topk_prob=True, max_position_embeddings=1048576,
                          rope_interleave=True, num_nextn_predict_layers=0)


def _deepseek(config: dict, where: str) -> ModelConfig:
    """DeepSeek-V3's ModelConfig (deepseek_v3: V3, V3.1, R1, Kimi K2; mistral4: Mistral 4): the latent attention's
    sizes, the dense first layers, the experts and their group-limited routing, YaRN with DeepSeek's mscale pair, the
    MTP layers' count (Mistral 4: none; its YaRN and query scaling, _mistral4_rope)."""
    arch = BY_MODEL_TYPE[config["model_type"]].arch
    defaults = _MISTRAL4_DEFAULTS if arch == "mistral4" else _DEEPSEEK_DEFAULTS
    q_rank, pad = config.get("q_lora_rank", defaults["q_lora_rank"]), {k: config[k] for k in ("pad_token_id",)
                                                                        if k in config}  # null: none (not 11)
    config = {**defaults, **{k: v for k, v in config.items() if v is not None}}
    if arch == "mistral4":
        config["num_nextn_predict_layers"] = 0  # Mistral4Config has no such field: transformers builds none
    _refuse(config, where, (("hidden_act", "silu", ("silu",)), ("attention_bias", False, (False,))))
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise CheckpointError(f"{where}: tie_word_embeddings must be true or false, got {tied!r}")
    keys = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "max_position_embeddings", "vocab_size", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group")
    sizes = {key: _count(config, key, where) for key in keys}
    heads = sizes["num_attention_heads"]
    if _count(config, "num_key_value_heads", where, default=heads) != heads:
        raise CheckpointError(f"{where}: num_key_value_heads {config['num_key_value_heads']!r} is not "
                              f"num_attention_heads {heads}: latent attention gives every head its keys")
    if q_rank is not None:
        q_rank = _count(config, "q_lora_rank", where)
    dense = config.get("first_k_dense_replace")
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise CheckpointError(f"{where}: first_k_dense_replace must be a whole number, got {dense!r}")
    mtp = config.get("num_nextn_predict_layers")
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise CheckpointError(f"{where}: num_nextn_predict_layers must be a whole number, got {mtp!r}")
    for key in ("rope_interleave", "norm_topk_prob"):
        if not isinstance(config[key], bool):
            raise CheckpointError(f"{where}: {key} must be true or false, got {config[key]!r}")
    key = "rope_scaling" if _table(config, "rope_scaling", where) else "rope_parameters"
    scaling = _table(config, key, where)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    rope = {}
    if kind == "yarn":
        pair = {k: float(scaling.get(k) or 0.0) for k in ("mscale", "mscale_all_dim")}
        rope = dict(_yarn_settings({k: v for k, v in scaling.items() if k not in pair}, f"{where} {key}"),
                    rope_mscale=pair["mscale"], rope_mscale_all_dim=pair["mscale_all_dim"])
    elif kind != "default":
        raise CheckpointError(f"{where}: {key} has rope_type {kind!r}; zerotrain's {arch} has 'default' and "
                              "'yarn'")
    if arch == "mistral4":
        rope.update(_mistral4_rope(scaling, kind, f"{where} {key}", sizes))
    theta = _positive(scaling, "rope_theta", f"{where} {key}", 10000.0) if "rope_theta" in scaling else \
        _positive(config, "rope_theta", where, 10000.0)
    return ModelConfig(arch=arch, n_layer=sizes["num_hidden_layers"], n_head=heads, n_kv_head=heads,
                       n_embd=sizes["hidden_size"], intermediate_size=sizes["intermediate_size"],
                       seq_len=sizes["max_position_embeddings"], vocab_size=sizes["vocab_size"], rope_theta=theta,
                       pad_token_id=_padding_id(pad, where, config["model_type"], sizes["vocab_size"]),
                       norm_eps=_positive(config, "rms_norm_eps", where, 1e-6), tie_embeddings=tied,
                       q_lora_rank=q_rank or 0, kv_lora_rank=sizes["kv_lora_rank"],
                       qk_rope_dim=sizes["qk_rope_head_dim"], qk_nope_dim=sizes["qk_nope_head_dim"],
                       v_head_dim=sizes["v_head_dim"], rope_interleave=config["rope_interleave"],
                       first_dense_layers=min(dense, sizes["num_hidden_layers"]),
                       n_experts=sizes["n_routed_experts"], experts_per_token=sizes["num_experts_per_tok"],
                       expert_width=sizes["moe_intermediate_size"], shared_experts=sizes["n_shared_experts"],
                       expert_groups=sizes["n_group"], expert_groups_per_token=sizes["topk_group"],
                       norm_topk_prob=config["norm_topk_prob"],
                       routed_scaling=_positive(config, "routed_scaling_factor", where, 1.0),
                       router_aux_coef=0.0, mtp_layers=mtp, **rope)


def _mistral4_rope(scaling: dict, kind: str, where: str, sizes: dict) -> dict:
    """Mistral 4's query scaling (llama_4_scaling_beta) from its rope table; CheckpointError naming what transformers'
    Mistral4ForCausalLM cannot compute: a rope type but YaRN (it would rotate the whole head), no beta, or a
    partial_rotary_factor that does not rotate qk_rope_head_dim units."""
    if kind != "yarn":
        raise CheckpointError(f"{where}: rope_type {kind!r}; zerotrain's mistral4 has 'yarn' (transformers' Mistral 4 "
                              "rotates the whole head under any other)")
    beta = scaling.get("llama_4_scaling_beta")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < math.inf:
        raise CheckpointError(f"{where}: llama_4_scaling_beta must be a number of 0 or more, got {beta!r}")
    head = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    partial = scaling.get("partial_rotary_factor", sizes["qk_rope_head_dim"] / head)
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or \
            int(head * partial) != sizes["qk_rope_head_dim"]:
        raise CheckpointError(f"{where}: partial_rotary_factor {partial!r} does not rotate the qk_rope_head_dim "
                              f"{sizes['qk_rope_head_dim']} units of a {head}-unit head")
    return dict(llama4_scaling_beta=float(beta))


# What transformers' Glm4MoeConfig gives a field its config.json leaves out (GLM-4.5-Air's sizes).
_GLM_DEFAULTS = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                     num_attention_heads=96, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                     moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128,
                     routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                     use_qk_norm=False, attention_bias=False, num_nextn_predict_layers=1, partial_rotary_factor=0.5)


def _glm(config: dict, where: str) -> ModelConfig:
    """GLM-4.5's ModelConfig (glm4_moe: GLM-4.5, -Air, 4.6, 4.7): the Llama family's sizes, partial rotary, q/k/v
    biases and q/k norms, the dense first layers, the experts and their group-limited routing, the MTP layers' count.
    transformers' Glm4MoeForCausalLM adds no balancing loss: the model's weight of one is 0."""
    config = {**_GLM_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    _refuse(config, where, (("hidden_act", "silu", ("silu",)),))
    for key in ("tie_word_embeddings", "attention_bias", "use_qk_norm", "norm_topk_prob"):
        if not isinstance(config.get(key, False), bool):
            raise CheckpointError(f"{where}: {key} must be true or false, got {config[key]!r}")
    sizes = {key: _count(config, key, where) for key in (
        "num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "max_position_embeddings", "vocab_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
        "n_group", "topk_group")}
    heads = sizes["num_attention_heads"]
    sizes["num_key_value_heads"] = _count(config, "num_key_value_heads", where, default=heads)
    _divides(sizes, where, "num_key_value_heads", "num_attention_heads")
    head_dim = _count(config, "head_dim", where, default=sizes["hidden_size"] // heads)
    for key in ("first_k_dense_replace", "num_nextn_predict_layers"):
        if isinstance(config[key], bool) or not isinstance(config[key], int) or config[key] < 0:
            raise CheckpointError(f"{where}: {key} must be a whole number, got {config[key]!r}")
    key = "rope_scaling" if _table(config, "rope_scaling", where) else "rope_parameters"
    rope = _table(config, key, where)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"{where}: {key} has rope_type {rope.get('rope_type', rope.get('type'))!r}; zerotrain's "
                              "glm4_moe has 'default'")
    theta = _positive(rope, "rope_theta", f"{where} {key}", 10000.0) if "rope_theta" in rope else \
        _positive(config, "rope_theta", where, 10000.0)
    partial = _positive(rope, "partial_rotary_factor", f"{where} {key}", config["partial_rotary_factor"]) \
        if "partial_rotary_factor" in rope else _positive(config, "partial_rotary_factor", where, 0.5)
    if partial > 1 or int(head_dim * partial) % 2 or int(head_dim * partial) < 2:
        raise CheckpointError(f"{where}: partial_rotary_factor {partial} rotates {int(head_dim * partial)} of the "
                              f"head's {head_dim} units; zerotrain rotates an even number of them, at least 2")
    return ModelConfig(arch="glm4_moe", n_layer=sizes["num_hidden_layers"], n_head=heads,
                       n_kv_head=sizes["num_key_value_heads"], n_embd=sizes["hidden_size"],
                       head_width=0 if head_dim * heads == sizes["hidden_size"] else head_dim,
                       intermediate_size=sizes["intermediate_size"], seq_len=sizes["max_position_embeddings"],
                       vocab_size=sizes["vocab_size"], rope_theta=theta, partial_rotary=partial,
                       pad_token_id=_padding_id(config, where, "glm4_moe", sizes["vocab_size"]),
                       norm_eps=_positive(config, "rms_norm_eps", where, 1e-5),
                       tie_embeddings=config.get("tie_word_embeddings", False),
                       attention_bias=config["attention_bias"], use_qk_norm=config["use_qk_norm"],
                       first_dense_layers=min(config["first_k_dense_replace"], sizes["num_hidden_layers"]),
                       n_experts=sizes["n_routed_experts"], experts_per_token=sizes["num_experts_per_tok"],
                       expert_width=sizes["moe_intermediate_size"], shared_experts=sizes["n_shared_experts"],
                       expert_groups=sizes["n_group"], expert_groups_per_token=sizes["topk_group"],
                       norm_topk_prob=config["norm_topk_prob"],
                       routed_scaling=_positive(config, "routed_scaling_factor", where, 1.0),
                       router_aux_coef=0.0, mtp_layers=config["num_nextn_predict_layers"])


# What transformers' Llama4TextConfig gives a field its config.json leaves out (its sizes are Scout's: required here).
_LLAMA4_DEFAULTS = dict(head_dim=128, num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layer_interval=4,
                        attention_chunk_size=8192, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8192,
                        attn_scale=0.1, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5)


def _llama4(config: dict, where: str) -> ModelConfig:
    """Llama 4's ModelConfig (llama4_text): its sizes, the layers with experts (moe_layers, or every
    interleave_moe_layer_step-th) as --moe-every and --mlp-only-layers, the layers without rotary (no_rope_layers, 0
    for a layer without) as every N-th, the chunk, the q/k norm and the temperature tuning. transformers'
    Llama4ForCausalLM adds no balancing loss: the model's weight of one is 0."""
    config = {**_LLAMA4_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k == "attention_chunk_size"}}
    _refuse(config, where, (("hidden_act", "silu", ("silu",)), ("attention_bias", False, (False,))))
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise CheckpointError(f"{where}: tie_word_embeddings must be true or false, got {tied!r}")
    sizes = {key: _count(config, key, where) for key in (
        "num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "intermediate_size_mlp",
        "max_position_embeddings", "vocab_size", "head_dim", "num_local_experts", "num_experts_per_tok",
        "interleave_moe_layer_step", "no_rope_layer_interval", "floor_scale")}
    n, heads = sizes["num_hidden_layers"], sizes["num_attention_heads"]
    sizes["num_key_value_heads"] = _count(config, "num_key_value_heads", where, default=heads)
    _divides(sizes, where, "num_key_value_heads", "num_attention_heads")
    if sizes["num_experts_per_tok"] > sizes["num_local_experts"]:
        raise CheckpointError(f"{where}: num_experts_per_tok {sizes['num_experts_per_tok']} is more than the "
                              f"{sizes['num_local_experts']} experts")
    rotary = config.get("no_rope_layers") or [int((i + 1) % sizes["no_rope_layer_interval"] != 0) for i in range(n)]
    nope = next((every for every in range(1, n + 2) if rotary == [int((i + 1) % every != 0) for i in range(n)]), None)
    if nope is None:
        raise CheckpointError(f"{where}: no_rope_layers {rotary!r} are not every N-th layer without rotary, as "
                              "zerotrain's llama4 has them")
    chunk = config["attention_chunk_size"]
    chunk = 0 if chunk is None else _count(config, "attention_chunk_size", where)
    types = config.get("layer_types")
    if types is not None and types != ["chunked_attention" if r and chunk else "full_attention" for r in rotary]:
        raise CheckpointError(f"{where}: layer_types {types!r} are not the rotary layers chunked, the others full, "
                              "as zerotrain's llama4 has them")
    step = sizes["interleave_moe_layer_step"]
    every = [i for i in range(n) if (i + 1) % step == 0]
    moe = config.get("moe_layers")
    moe = every if moe is None else moe
    if not (isinstance(moe, list) and all(type(i) is int and 0 <= i < n for i in moe)):
        raise CheckpointError(f"{where}: moe_layers must list layers 0-{n - 1}, got {moe!r}")
    if not set(moe) <= set(every):  # any layers: every layer may have experts, the others listed dense
        step, every = 1, list(range(n))
    flags = {key: config[key] for key in ("use_qk_norm", "attn_temperature_tuning")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise CheckpointError(f"{where}: {key} must be true or false, got {value!r}")
    rope = _table(config, "rope_parameters", where)
    theta = _positive(rope, "rope_theta", where + " rope_parameters", 0.0) if "rope_theta" in rope else \
        _positive(config, "rope_theta", where, 500000.0)
    head_dim = sizes["head_dim"]
    return ModelConfig(arch="llama4", n_layer=n, n_head=heads, n_kv_head=sizes["num_key_value_heads"],
                       n_embd=sizes["hidden_size"], pad_token_id=_padding_id(config, where, "llama4_text",
                                                                              sizes["vocab_size"]),
                       head_width=0 if head_dim * heads == sizes["hidden_size"] else head_dim,
                       intermediate_size=sizes["intermediate_size_mlp"], seq_len=sizes["max_position_embeddings"],
                       vocab_size=sizes["vocab_size"], rope_theta=theta,
                       norm_eps=_positive(config, "rms_norm_eps", where, 1e-5), tie_embeddings=tied,
                       n_experts=sizes["num_local_experts"], experts_per_token=sizes["num_experts_per_tok"],
                       expert_width=sizes["intermediate_size"], shared_expert_width=sizes["intermediate_size"],
                       moe_every=step, mlp_only_layers=",".join(str(i) for i in every if i not in moe),
                       router_aux_coef=0.0, nope_every=nope, attention_chunk=chunk,
                       qk_l2_norm=flags["use_qk_norm"], temperature_tuning=flags["attn_temperature_tuning"],
                       temperature_floor=sizes["floor_scale"],
                       temperature_scale=_positive(config, "attn_scale", where, 0.1) if config["attn_scale"] else 0.0,
                       **_rope_settings(config, where))


# What transformers' Gemma4TextConfig gives a field its config.json leaves out.
_GEMMA4_DEFAULTS = dict(vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=512,
                        hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, attention_k_eq_v=False,
                        num_kv_shared_layers=0, use_double_wide_mlp=False, global_head_dim=512)
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0}}


def _gemma4(config: dict, where: str) -> ModelConfig:
    """Gemma 4's ModelConfig (gemma4_text): its sizes, its layer types as a pattern (the last layer global, as
    transformers forces it), each kind's rotary, the global layers' shape (per_layer_config, which transformers 5
    writes, or the published global_head_dim and num_global_key_value_heads), the shared KV and the per-layer input
    embedding, the MoE block's experts. What zerotrain's gemma4 does not compute (bidirectional attention, biases,
    another activation or rotary) is refused, naming the field."""
    config = {**_GEMMA4_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k not in _GEMMA4_DEFAULTS}}
    _refuse(config, where, (("hidden_activation", "gelu_pytorch_tanh", ("gelu_pytorch_tanh",)),
                            ("attention_bias", False, (False,)), ("use_bidirectional_attention", None, (None,)),
                            ("enable_moe_block", False, (False, True))))
    flags = {key: config[key] for key in ("tie_word_embeddings", "attention_k_eq_v", "use_double_wide_mlp")}
    experts = {}
    if config.get("enable_moe_block"):  # beside the MLP on every layer; transformers adds no balancing loss
        experts = dict(n_experts=_count(config, "num_experts", where),
                       experts_per_token=_count(config, "top_k_experts", where),
                       expert_width=_count(config, "moe_intermediate_size", where), norm_topk_prob=True,
                       router_aux_coef=0.0)
        if experts["experts_per_token"] > experts["n_experts"]:
            raise CheckpointError(f"{where}: top_k_experts {experts['experts_per_token']} is more than the "
                                  f"{experts['n_experts']} experts")
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise CheckpointError(f"{where}: {key} must be true or false, got {value!r}")
    sizes = {key: _count(config, key, where) for key in (
        "num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "max_position_embeddings",
        "vocab_size", "head_dim", "global_head_dim", "sliding_window")}
    n, heads = sizes["num_hidden_layers"], sizes["num_attention_heads"]
    sizes["num_key_value_heads"] = _count(config, "num_key_value_heads", where, default=heads)
    _divides(sizes, where, "num_key_value_heads", "num_attention_heads")
    per_layer, shared = (_count(config, key, where, default=0) if config.get(key) else 0
                         for key in ("hidden_size_per_layer_input", "num_kv_shared_layers"))
    if per_layer and config["vocab_size_per_layer_input"] != sizes["vocab_size"]:
        raise CheckpointError(f"{where}: vocab_size_per_layer_input {config['vocab_size_per_layer_input']!r} differs "
                              f"from vocab_size {sizes['vocab_size']}; zerotrain's gemma4 looks both up by the "
                              "same ids")
    types = config.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                          for i in range(n)]
    types = [*types[:-1], "full_attention"] if isinstance(types, list) and types else types  # as transformers
    pattern = _layer_pattern({"layer_types": types}, where, "gemma4", n)
    width, global_heads = sizes["global_head_dim"], config.get("num_global_key_value_heads")
    overrides = config.get("per_layer_config")
    if overrides is not None:
        shapes = {json_key: _table(overrides, json_key, f"{where} per_layer_config") for json_key in overrides}
        full = [str(i) for i, kind in enumerate(types) if kind == "full_attention"]
        if sorted(shapes, key=int) != full or any(shape != shapes[full[0]] for shape in shapes.values()) or \
                set(shapes[full[0]]) - {"head_dim", "num_key_value_heads"}:
            raise CheckpointError(f"{where}: per_layer_config {overrides!r} does not give every global layer, and only "
                                  "them, one head_dim (and num_key_value_heads), as zerotrain's gemma4 has them")
        shape = shapes[full[0]]
        width = _count(shape, "head_dim", f"{where} per_layer_config", default=sizes["head_dim"])
        global_heads = shape.get("num_key_value_heads")
    if global_heads is not None and not flags["attention_k_eq_v"]:
        global_heads = None  # transformers reads the global KV heads only with attention_k_eq_v
    if global_heads is not None:
        global_heads = _count({"num_global_key_value_heads": global_heads}, "num_global_key_value_heads", where)
    rope = config.get("rope_parameters") or _GEMMA4_ROPE
    local, full_rope = (_table(rope if isinstance(rope, dict) else {}, key, f"{where} rope_parameters")
                        for key in LAYER_TYPES)
    partial = 1.0
    for kind, table in (("sliding_attention", local), ("full_attention", full_rope)):
        rope_type = table.get("rope_type", "default")
        if rope_type not in ("default", "proportional") or (kind == "sliding_attention" and rope_type != "default"):
            raise CheckpointError(f"{where}: rope_parameters {kind} has rope_type {rope_type!r}; zerotrain's gemma4 "
                                  "rotates its sliding layers by 'default' and its global ones by 'proportional'")
        if table.get("factor", 1.0) != 1.0:
            raise CheckpointError(f"{where}: rope_parameters {kind} has factor {table['factor']!r}; zerotrain's "
                                  "gemma4 rotates unscaled (1.0)")
        if rope_type == "proportional":
            partial = _positive(table, "partial_rotary_factor", f"{where} rope_parameters {kind}", 1.0)
    caps = config.get("final_logit_softcapping")
    return ModelConfig(arch="gemma4", n_layer=n, n_head=heads, n_kv_head=sizes["num_key_value_heads"],
                       n_embd=sizes["hidden_size"], pad_token_id=_padding_id(config, where, "gemma4_text",
                                                                              sizes["vocab_size"]),
                       head_width=sizes["head_dim"], intermediate_size=sizes["intermediate_size"],
                       seq_len=sizes["max_position_embeddings"], vocab_size=sizes["vocab_size"],
                       rope_theta=_positive(full_rope, "rope_theta", f"{where} rope_parameters full_attention",
                                            1000000.0),
                       rope_local_theta=_positive(local, "rope_theta", f"{where} rope_parameters sliding_attention",
                                                  10000.0),
                       partial_rotary=partial, norm_eps=_positive(config, "rms_norm_eps", where, 1e-6),
                       tie_embeddings=flags["tie_word_embeddings"], sliding_window=sizes["sliding_window"],
                       sliding_window_pattern=pattern,
                       final_softcap=0.0 if caps is None else _positive(config, "final_logit_softcapping", where, 0.0),
                       global_head_width=width, k_eq_v=flags["attention_k_eq_v"], global_kv_heads=global_heads or 0,
                       kv_shared_layers=shared, per_layer_width=per_layer, double_wide_mlp=flags["use_double_wide_mlp"],
                       **experts)


# Per member of the Llama family: (key, its value when absent, the values zerotrain's model has) for each field that
# says how the model computes, beyond the sizes.
_FIXED = {
    "llama": (("hidden_act", "silu", ("silu",)), ("attention_bias", False, (False,)), ("mlp_bias", False, (False,)),
              ("pretraining_tp", 1, (1,))),
    "qwen2": (("hidden_act", "silu", ("silu",)), ("use_sliding_window", False, (False,))),
    "qwen3": (("hidden_act", "silu", ("silu",)), ("attention_bias", False, (False,)),
              ("use_sliding_window", False, (False,))),
    "mistral": (("hidden_act", "silu", ("silu",)),),
    "phi3": (("hidden_act", "silu", ("silu",)), ("partial_rotary_factor", 1.0, (1.0, 1))),
    **{arch: (("hidden_activation", "gelu_pytorch_tanh", ("gelu_pytorch_tanh",)), ("attention_bias", False, (False,)),
              ("use_bidirectional_attention", None, (None, False))) for arch in GEMMA},
    "qwen3_moe": (("hidden_act", "silu", ("silu",)), ("attention_bias", False, (False,)),
                  ("use_sliding_window", False, (False,))),
    "qwen2_moe": (("hidden_act", "silu", ("silu",)), ("use_sliding_window", False, (False,)),
                  ("qkv_bias", True, (True,))),
    "mixtral": (("hidden_act", "silu", ("silu",)), ("router_jitter_noise", 0.0, (0.0, 0))),
    "olmoe": (("hidden_act", "silu", ("silu",)), ("attention_bias", False, (False,)), ("clip_qkv", None, (None,))),
    "gpt_oss": (("attention_bias", True, (True,)), ("swiglu_limit", SWIGLU_LIMIT, (SWIGLU_LIMIT, 7)),
                ("swiglu_alpha", SWIGLU_ALPHA, (SWIGLU_ALPHA,)), ("norm_topk_prob", None, (None, False))),
}
# What transformers' GptOssConfig gives a field its config.json leaves out: the shape of gpt-oss-20b and its rope
# (YaRN, which a config without rope_scaling or rope_parameters gets), every other layer sliding (layer_types).
_GPT_OSS_DEFAULTS = dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880,
                         intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                         sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         num_experts_per_tok=4, rope_theta=150000.0)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _gpt_oss_defaults(config: dict) -> dict:
    config = {**_GPT_OSS_DEFAULTS, **{k: v for k, v in config.items() if v is not None or k not in _GPT_OSS_DEFAULTS}}
    if not config.get("rope_scaling") and not config.get("rope_parameters"):
        config["rope_parameters"] = {**_GPT_OSS_ROPE, "rope_theta": config["rope_theta"]}
    return config
# What transformers' Gemma2Config and Gemma3TextConfig give a field their config.json leaves out (published Gemma 3
# configs leave out most of their text_config's).
_GEMMA_DEFAULTS = {
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0, rope_theta=10000.0),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                        final_logit_softcapping=None, attn_logit_softcapping=None, rope_theta=1000000.0,
                        rope_local_base_freq=10000.0, sliding_window_pattern=6),
}
LAYER_TYPES = ("sliding_attention", "full_attention")


def _llama_config(config: dict, where: str) -> ModelConfig:
    """A member of the Llama family: llama, qwen2, qwen3, mistral, phi3, gemma2 or gemma3_text (their config.json
    share the size fields)."""
    kind = config["model_type"]
    arch = BY_MODEL_TYPE[kind].arch
    method = _table(config, "quantization_config", where).get("quant_method")
    if method is not None and (method, arch) != ("mxfp4", "gpt_oss"):
        raise CheckpointError(f"{where}: quantization_config has quant_method {method!r}; zerotrain reads unquantized "
                              "weights (and gpt-oss's mxfp4 experts): save the model dequantized first (transformers: "
                              "from_pretrained, then save_pretrained of the dequantized model)")
    if kind in _GEMMA_DEFAULTS:
        config = {**_GEMMA_DEFAULTS[kind], **{k: v for k, v in config.items() if v is not None or k not in (
            "rope_theta", "rope_local_base_freq", "sliding_window_pattern", "head_dim")}}
    if kind == "gpt_oss":
        config = _gpt_oss_defaults(config)
    _refuse(config, where, _FIXED[arch])
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise CheckpointError(f"{where}: tie_word_embeddings must be true or false, got {tied!r}")
    sizes = {key: _count(config, key, where) for key in ("num_hidden_layers", "num_attention_heads", "hidden_size",
                                                           "intermediate_size", "max_position_embeddings",
                                                           "vocab_size")}
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    sizes["num_key_value_heads"] = _count(config, "num_key_value_heads", where, default=heads)
    _divides(sizes, where, "num_key_value_heads", "num_attention_heads")
    if config.get("head_dim") is None:  # heads of hidden_size / num_attention_heads
        _divides(sizes, where, "num_attention_heads", "hidden_size")
    head_dim = _count(config, "head_dim", where, default=hidden // heads)
    if head_dim % 2:
        raise CheckpointError(f"{where}: head_dim {head_dim} must be even (rotary embeddings rotate pairs)")
    window = 0
    if arch in WINDOWED:
        window = _count(config, "sliding_window", where, default=0)
    pad = _padding_id(config, where, kind, sizes["vocab_size"])
    if arch in GEMMA:
        return _gemma(config, where, arch, sizes, head_dim, tied, window, pad)
    rope = _table(config, "rope_parameters", where)
    theta = _positive(rope, "rope_theta", where + " rope_parameters", 0.0) if "rope_theta" in rope else \
        _positive(config, "rope_theta", where, 10000.0)
    experts = _experts(config, where, arch, sizes) if arch in MOE else {}
    if arch == "gpt_oss":  # its sliding and full layers alternate
        pattern = _layer_pattern(config, where, arch, sizes["num_hidden_layers"])
        window, experts["sliding_window_pattern"] = (0, 0) if window == 0 or pattern == 1 else (window, pattern)
    return ModelConfig(arch=arch, n_layer=sizes["num_hidden_layers"], n_head=heads, pad_token_id=pad,
                       n_kv_head=sizes["num_key_value_heads"], n_embd=hidden,
                       head_width=0 if head_dim * heads == hidden else head_dim,
                       intermediate_size=sizes["intermediate_size"], seq_len=sizes["max_position_embeddings"],
                       vocab_size=sizes["vocab_size"], rope_theta=theta,
                       norm_eps=_positive(config, "rms_norm_eps", where, 1e-6),
                       tie_embeddings=tied, sliding_window=window, **_rope_settings(config, where), **experts)


# What transformers' config classes give pad_token_id where config.json leaves it out (the others: None)
_PAD_DEFAULTS = {"olmoe": 1, "phi3": 32000, "gemma2": 0, "gemma3_text": 0, "mistral4": 11, "gemma4_text": 0}


def _padding_id(config: dict, where: str, kind: str, vocab: int) -> int:
    """The embedding's padding row, as transformers builds it from pad_token_id (nn.Embedding's padding_idx: a
    negative id counts from the end); -1 for none."""
    pad = config.get("pad_token_id", _PAD_DEFAULTS.get(kind))
    if pad is None:
        return -1
    if isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab:
        raise CheckpointError(f"{where}: pad_token_id {pad!r} is not an id of the vocabulary of {vocab} (transformers' "
                              "embedding takes it as its padding row)")
    return pad % vocab


def _experts(config: dict, where: str, arch: str, sizes: dict) -> dict:
    """A mixture of experts' settings from its config.json: experts, top-k, their width, renormalisation, the shared
    expert (Qwen2-MoE), which layers have experts (Qwen's decoder_sparse_step and mlp_only_layers), the balancing
    loss's weight."""
    # Published configs name the experts num_experts (Mixtral's num_local_experts); transformers 5 writes the latter
    n = _count(config, next((k for k in ("num_experts", "num_local_experts") if config.get(k) is not None),
                            "num_experts"), where)
    k = _count(config, "num_experts_per_tok", where, default=2)
    if k > n:
        raise CheckpointError(f"{where}: num_experts_per_tok {k} is more than the {n} experts")
    renormalize = config.get("norm_topk_prob", arch == "mixtral")
    if not isinstance(renormalize, bool):
        raise CheckpointError(f"{where}: norm_topk_prob must be true or false, got {renormalize!r}")
    coef = config.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < math.inf:
        raise CheckpointError(f"{where}: router_aux_loss_coef must be a number >= 0, got {coef!r}")
    out = dict(n_experts=n, experts_per_token=k, norm_topk_prob=renormalize or arch == "mixtral",
               router_aux_coef=float(coef))
    if arch in ("qwen3_moe", "qwen2_moe"):
        out.update(expert_width=_count(config, "moe_intermediate_size", where),
                   moe_every=_count(config, "decoder_sparse_step", where, default=1))
        dense = config.get("mlp_only_layers") or []
        if not (isinstance(dense, list) and all(type(i) is int and 0 <= i < sizes["num_hidden_layers"]
                                                for i in dense)):
            raise CheckpointError(f"{where}: mlp_only_layers must list layers 0-{sizes['num_hidden_layers'] - 1}, "
                                  f"got {dense!r}")
        out.update(mlp_only_layers=",".join(str(i) for i in sorted(set(dense))))
    if arch == "qwen2_moe":
        out.update(shared_expert_width=_count(config, "shared_expert_intermediate_size", where))
    return out


def _gemma(config: dict, where: str, arch: str, sizes: dict, head_dim: int, tied: bool, window: int,
           pad: int) -> ModelConfig:
    """Gemma 2's or Gemma 3's ModelConfig: the Llama family's sizes, its layer types as a pattern, attention scale,
    soft-caps and (Gemma 3) two rotary bases."""
    n, heads, hidden = sizes["num_hidden_layers"], sizes["num_attention_heads"], sizes["hidden_size"]
    pattern = _layer_pattern(config, where, arch, n)
    if window == 0 or pattern == 1:  # no layer slides
        window, pattern = 0, 0
    caps = {key: 0.0 if config.get(key) is None else _positive(config, key, where, 0.0)
            for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    if arch == "gemma3" and caps["attn_logit_softcapping"]:  # transformers' Gemma3Attention never applies it
        caps["attn_logit_softcapping"] = 0.0
    theta, local, scaling = _gemma_rope(config, where, arch)
    return ModelConfig(arch=arch, n_layer=n, n_head=heads, n_kv_head=sizes["num_key_value_heads"], n_embd=hidden,
                       pad_token_id=pad,
                       head_width=0 if head_dim * heads == hidden else head_dim,
                       intermediate_size=sizes["intermediate_size"], seq_len=sizes["max_position_embeddings"],
                       vocab_size=sizes["vocab_size"], rope_theta=theta, rope_local_theta=local,
                       norm_eps=_positive(config, "rms_norm_eps", where, 1e-6), tie_embeddings=tied,
                       sliding_window=window, sliding_window_pattern=pattern,
                       query_pre_attn_scalar=_count(config, "query_pre_attn_scalar", where, default=256),
                       attn_softcap=caps["attn_logit_softcapping"], final_softcap=caps["final_logit_softcapping"],
                       **scaling)


def _layer_pattern(config: dict, where: str, arch: str, n: int) -> int:
    """Every how many layers one is global (0: none is), from `layer_types` or, without it, the pattern transformers
    fills it from (Gemma 2: 2; Gemma 3: sliding_window_pattern). CheckpointError for layer types that no pattern
    gives."""
    types = config.get("layer_types")
    if types is None:
        return 2 if arch in ("gemma2", "gpt_oss") else _count(config, "sliding_window_pattern", where, default=6)
    if not (isinstance(types, list) and len(types) == n and all(t in LAYER_TYPES for t in types)):
        raise CheckpointError(f"{where}: layer_types must list {n} of {' or '.join(LAYER_TYPES)}, got {types!r}")
    for pattern in range(n + 1):
        if types == ["full_attention" if pattern and (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(n)]:
            return pattern
    raise CheckpointError(f"{where}: layer_types {types!r} do not alternate as zerotrain's do (every N-th layer "
                          "global, the others sliding)")


def _gemma_rope(config: dict, where: str, arch: str) -> tuple[float, float, dict]:
    """(rope_theta, rope_local_theta, rope scaling settings): from transformers 5's rope_parameters (Gemma 3's per
    layer type) or the published rope_theta, rope_local_base_freq and rope_scaling."""
    rope = _table(config, "rope_parameters", where)
    if arch == "gemma3":
        if "full_attention" in rope or "sliding_attention" in rope:
            full, local = (_table(rope, key, f"{where} rope_parameters") for key in LAYER_TYPES[::-1])
            if local.get("rope_type", "default") != "default":
                raise CheckpointError(f"{where}: rope_parameters sliding_attention has rope_type "
                                      f"{local['rope_type']!r}; zerotrain's gemma3 rotates its sliding layers "
                                      "unscaled ('default')")
            return (_positive(full, "rope_theta", f"{where} rope_parameters full_attention", 1000000.0),
                    _positive(local, "rope_theta", f"{where} rope_parameters sliding_attention", 10000.0),
                    _rope_settings({"rope_parameters": full}, where, gemma=True))
        local_theta = _positive(config, "rope_local_base_freq", where, 10000.0)
    else:
        local_theta = 0.0
    theta = _positive(rope, "rope_theta", where + " rope_parameters", 0.0) if "rope_theta" in rope else \
        _positive(config, "rope_theta", where, 10000.0)
    return theta, local_theta, _rope_settings(config, where, gemma=True)


ROPE_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_settings(config: dict, where: str, gemma: bool = False) -> dict:
    """ModelConfig's rope scaling settings from `rope_scaling` (published configs, older transformers) or, where
    that is absent or null, `rope_parameters` (transformers 5); CheckpointError naming a rope type zerotrain does
    not implement, or a llama3 field missing or out of range."""
    key = "rope_scaling" if _table(config, "rope_scaling", where) else "rope_parameters"
    scaling = _table(config, key, where)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:  # where transformers 5 puts Phi-3's
        raise CheckpointError(f"{where}: {key} has partial_rotary_factor {scaling['partial_rotary_factor']!r}; "
                              "zerotrain rotates the whole head (1.0)")
    if kind == "default":
        return {}
    if kind == "linear" and gemma:
        return dict(rope_scaling="linear", rope_factor=_positive(scaling, "factor", f"{where} {key}", 0.0))
    if kind == "yarn":
        return _yarn_settings(scaling, f"{where} {key}")
    if kind != "llama3":
        raise CheckpointError(f"{where}: {key} has rope_type {kind!r}, which zerotrain does not implement (it has "
                              "'default', 'llama3' and 'yarn')")
    missing = [k for k in ROPE_LLAMA3 if k not in scaling]
    if missing:
        raise CheckpointError(f"{where}: {key} of rope_type 'llama3' has no {missing[0]!r}")
    factors = {k: _positive(scaling, k, f"{where} {key}", 0.0) for k in ROPE_LLAMA3[:3]}
    if factors["low_freq_factor"] >= factors["high_freq_factor"]:
        raise CheckpointError(f"{where}: {key} low_freq_factor {factors['low_freq_factor']} must be below "
                              f"high_freq_factor {factors['high_freq_factor']}")
    return dict(rope_scaling="llama3", rope_factor=factors["factor"], rope_low_freq_factor=factors["low_freq_factor"],
                rope_high_freq_factor=factors["high_freq_factor"],
                rope_original_context=_count(scaling, "original_max_position_embeddings", f"{where} {key}"))


def _yarn_settings(scaling: dict, where: str) -> dict:
    """ModelConfig's settings of a rope_type 'yarn' table, with transformers' defaults (beta_fast 32, beta_slow 1,
    truncate true, attention_factor from the factor); CheckpointError naming a field missing, out of range, or
    DeepSeek's mscale pair, which zerotrain's YaRN does not have."""
    for key in ("mscale", "mscale_all_dim"):
        if scaling.get(key):
            raise CheckpointError(f"{where}: {key} = {scaling[key]!r}; zerotrain's yarn derives the attention factor "
                                  "from the factor alone (or takes attention_factor)")
    for key in ("factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            raise CheckpointError(f"{where}: rope_type 'yarn' has no {key!r}")
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointError(f"{where}: truncate must be true or false, got {truncate!r}")
    beta_fast, beta_slow = (_positive(scaling, key, where, default) if scaling.get(key) is not None else default
                            for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)))
    attention = scaling.get("attention_factor")
    return dict(rope_scaling="yarn", rope_factor=_positive(scaling, "factor", where, 0.0),
                rope_original_context=_count(scaling, "original_max_position_embeddings", where),
                rope_beta_fast=beta_fast, rope_beta_slow=beta_slow, rope_truncate=truncate,
                rope_attention_factor=0.0 if attention is None else _positive(scaling, "attention_factor", where, 0.0))
