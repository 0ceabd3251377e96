"""Each architecture in Hugging Face's files: one table of names and layouts, and its config.json, for import
and export alike, so the two cannot drift apart.

    gpt2   names are Hugging Face's GPT-2 names; the four per-block matrices are Conv1D there, whose weight is
           (in, out): nn.Linear's transposed. The attention-mask buffers some versions save are not parameters.
    llama  names are Hugging Face's Llama names and matrices are stored as nn.Linear's: the identity.

A tied head is stored once, under the token embedding's name. init_from.py reads each rank's TP slices through
the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotrain.config import ModelConfig
from zerotrain.errors import CheckpointError


@dataclass(frozen=True)
class HFMapping:
    arch: str
    model_type: str  # config.json's model_type
    hf_class: str  # config.json's architectures[0]
    block_prefix: str
    transposed: tuple[str, ...]  # suffixes of per-block matrices stored (in, out)
    ignored: tuple[str, ...]  # suffixes of tensors their files may hold that are not parameters

    def canonical(self, name: str) -> str:
        """A tensor's name as zerotrain's model has it. GPT-2 folders saved from the bare GPT2Model (the original
        `gpt2` files among them) drop the `transformer.` prefix: it is put back."""
        if self.arch == "gpt2" and not name.startswith((self.block_prefix.split(".")[0] + ".", "lm_head.")):
            return "transformer." + name
        return name

    def is_transposed(self, name: str) -> bool:
        return bool(self.transposed) and name.startswith(self.block_prefix) and name.endswith(self.transposed)

    def to_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """zerotrain's tensors (names -> tensors) in Hugging Face's layout, fp32 and contiguous."""
        return {n: (t.t() if self.is_transposed(n) else t).detach().float().contiguous() for n, t in tensors.items()}

    def from_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face's tensors in zerotrain's layout; tensors that are not parameters are dropped."""
        named = {self.canonical(n): t for n, t in tensors.items()}
        return {n: (t.t().contiguous() if self.is_transposed(n) else t) for n, t in named.items()
                if not n.endswith(self.ignored)}


MAPPINGS = {
    "gpt2": HFMapping("gpt2", "gpt2", "GPT2LMHeadModel", "transformer.h.",
                      ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"),
                      (".attn.bias", ".attn.masked_bias")),
    "llama": HFMapping("llama", "llama", "LlamaForCausalLM", "model.layers.", (), (".rotary_emb.inv_freq",)),
}
BY_MODEL_TYPE = {m.model_type: m for m in MAPPINGS.values()}


def hf_config(cfg: ModelConfig, eot_id: int | None) -> dict:
    """The config.json of this model in Hugging Face's format: the architecture zerotrain trains, nothing left to
    defaults that differ."""
    eot = eot_id if eot_id is not None and 0 <= eot_id < cfg.vocab_size else None
    if cfg.arch == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
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
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_width,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "pretraining_tp": 1, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot,
        "dtype": "float32",
    }


def model_config_from_hf(config: dict, where: str) -> ModelConfig:
    """zerotrain's ModelConfig for a Hugging Face config.json of model_type gpt2 or llama; CheckpointError naming
    the first setting zerotrain's architecture does not have."""
    kind = config.get("model_type")
    if kind not in BY_MODEL_TYPE:
        raise CheckpointError(f"{where}: model_type {kind!r}; zerotrain builds {' and '.join(BY_MODEL_TYPE)}")
    try:
        return _gpt2_config(config, where) if kind == "gpt2" else _llama_config(config, where)
    except KeyError as e:
        raise CheckpointError(f"{where}: no {e.args[0]!r}") from None


def _refuse(config: dict, where: str, expected: tuple) -> None:
    for key, default, allowed in expected:
        if config.get(key, default) not in allowed:
            raise CheckpointError(f"{where}: {key} = {config.get(key, default)!r}; zerotrain's "
                                  f"{config['model_type']} has {allowed[0]!r}")


def _gpt2_config(config: dict, where: str) -> ModelConfig:
    _refuse(config, where, (
        ("activation_function", "gelu_new", ("gelu_new", "gelu_pytorch_tanh")),
        ("tie_word_embeddings", True, (True,)), ("scale_attn_weights", True, (True,)),
        ("scale_attn_by_inverse_layer_idx", False, (False,)), ("add_cross_attention", False, (False,))))
    inner = config.get("n_inner")
    return ModelConfig(arch="gpt2", n_layer=config["n_layer"], n_head=config["n_head"], n_embd=config["n_embd"],
                       intermediate_size=0 if inner in (None, 4 * config["n_embd"]) else inner,
                       seq_len=config["n_positions"], vocab_size=config["vocab_size"],
                       norm_eps=config.get("layer_norm_epsilon", 1e-5))


def _llama_config(config: dict, where: str) -> ModelConfig:
    _refuse(config, where, (
        ("hidden_act", "silu", ("silu",)), ("attention_bias", False, (False,)), ("mlp_bias", False, (False,)),
        ("pretraining_tp", 1, (1,))))
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise CheckpointError(f"{where}: rope scaling {scaling.get('rope_type', scaling.get('type'))!r}; zerotrain's "
                              "llama has plain rotary embeddings")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim", hidden // heads) != hidden // heads:
        raise CheckpointError(f"{where}: head_dim = {config['head_dim']}; zerotrain's llama has hidden_size / "
                              f"num_attention_heads = {hidden // heads}")
    return ModelConfig(arch="llama", n_layer=config["num_hidden_layers"], n_head=heads,
                       n_kv_head=config.get("num_key_value_heads") or heads, n_embd=hidden,
                       intermediate_size=config["intermediate_size"], seq_len=config["max_position_embeddings"],
                       vocab_size=config["vocab_size"], rope_theta=float(rope.get("rope_theta",
                                                                                  config.get("rope_theta", 10000.0))),
                       norm_eps=config.get("rms_norm_eps", 1e-6), tie_embeddings=config.get("tie_word_embeddings",
                                                                                            False))
