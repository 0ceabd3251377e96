"""The models zerotrain trains: GPT-2 (gpt2.py) and the Llama family (llama.py: Llama, Qwen2, Qwen3, Mistral, Phi-3,
Gemma 2 and 3, with Gemma's own pieces in gemma.py), Qwen3.5's hybrid (qwen35.py, its linear attention in
delta_rule.py), DeepSeek-V3's and Mistral 4's (deepseek.py: latent attention in mla.py, its router in
group_routing.py), GLM-4.5's (glm.py: Llama's decoder with DeepSeek-V3's experts), Llama 4's text decoder
(llama4.py), Gemma 4's (gemma4.py), the multi-token-prediction layers DeepSeek-V3's, GLM-4.5's and Qwen3.5's train
with --mtp train (mtp.py), the layers they share
(tensor_parallel.py, norms.py, positions.py, rotary.py, attention.py, kv_cache.py, recompute.py), the embedding,
head and loss (vocab.py, loss.py), and sampling (generate.py).
`build_model`, `plan` and `parallelize` pick the architecture from the config's `arch`."""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.nn as nn

from zerotrain.config import DEEPSEEK, GEMMA4, GLM, LLAMA4, LLAMA_FAMILY, QWEN35, ModelConfig

from . import deepseek, gemma4, glm, gpt2, llama, llama4, qwen35
from .gemma4 import Gemma4
from .gpt2 import GPT
from .init import SeedValues, materialise
from .kv_cache import KVCache
from .llama import Llama
from .llama4 import Llama4
from .loss import summed_token_loss
from .qwen35 import Qwen35
from .tensor_parallel import TPSlice

# Each member of the Llama family is the one Llama decoder with the options its arch implies (config.ModelConfig).
ARCHITECTURES = {"gpt2": (GPT, gpt2), **{arch: (Llama, llama) for arch in LLAMA_FAMILY},
                 **{arch: (Qwen35, qwen35) for arch in QWEN35},  # Qwen3.5's hybrid: a decoder of its own
                 **{arch: (deepseek.Deepseek, deepseek) for arch in DEEPSEEK},
                 **{arch: (glm.Glm, glm) for arch in GLM},  # Llama's decoder with DeepSeek-V3's experts
                 **{arch: (Llama4, llama4) for arch in LLAMA4},  # Llama 4's chunked attention and routing: its own
                 **{arch: (Gemma4, gemma4) for arch in GEMMA4}}  # Gemma 4's layer shapes, shared KV: its own
ARCH_NAMES = {"gpt2": "GPT-2", "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
              "phi3": "Phi-3", "gemma2": "Gemma 2", "gemma3": "Gemma 3", "qwen3_moe": "Qwen3-MoE",
              "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral", "olmoe": "OLMoE",
              "gpt_oss": "gpt-oss", "qwen3_5": "Qwen3.5", "qwen3_5_moe": "Qwen3.5-MoE",
              "deepseek_v3": "DeepSeek-V3", "mistral4": "Mistral 4", "glm4_moe": "GLM-4.5", "llama4": "Llama 4",
              "gemma4": "Gemma 4"}  # how messages name them


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    return ARCHITECTURES[cfg.arch][0]


# The initialisers torch's layers call as they are built (nn.Linear's kaiming_uniform_, nn.Embedding's normal_): on
# the meta device they draw nothing, slowly (a DeepSeek-V3-671B build, 135k linears, measured on 2 shared cores:
# 18-20 s with them, 8-9 s without); every value comes from model/init.py later. Skipped while building, as
# transformers' no_init_weights does.
DRAWS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
         "xavier_normal_")


@contextlib.contextmanager
def draws_skipped():
    """torch.nn.init's random initialisers do nothing inside (they return their tensor as it is)."""
    saved = {name: getattr(nn.init, name) for name in DRAWS}
    for name in DRAWS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, draw in saved.items():
            setattr(nn.init, name, draw)


# Building a huge model's modules allocates hundreds of thousands of Python objects, none of them garbage, and each
# of Python's full collections walks them all again: paused while building, what the build leaves is the same object
# graph (the measurements: docs/benchmarks.md, "Measurements behind choices in the code").
@contextlib.contextmanager
def collection_paused():
    """Python's cyclic garbage collector off inside (as it was before, after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def meta_model(cfg: ModelConfig) -> nn.Module:
    """The model's modules on the meta device: shapes, no values (the engine fills them, model/init.py)."""
    with torch.device("meta"), draws_skipped(), collection_paused():
        return model_class(cfg)(cfg)


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The whole model on the CPU, each parameter from (seed, its name) alone (model/init.py): bitwise what the
    engine's shards hold at any world size, TP degree and stage. Under `torch.device("meta")`, shapes only."""
    model = meta_model(cfg)
    if torch.get_default_device().type == "meta":
        return model
    return materialise(model, SeedValues(cfg, seed))


def plan(cfg: ModelConfig, tp: int) -> dict[str, TPSlice]:
    """The architecture's TP slice of every split parameter, by its name in the full model."""
    return ARCHITECTURES[cfg.arch][1].plan(cfg, tp)


def parallelize(model: nn.Module, tp_size: int, tp_rank: int, comm, kv_comm=None) -> dict[str, TPSlice]:
    """Replace the full model's split layers by this rank's parallel ones, in place; return the plan.

    `comm`: the TP group; `kv_comm`: the TP ranks that hold this rank's KV heads too (more TP ranks than KV heads).
    """
    return ARCHITECTURES[model.cfg.arch][1].parallelize(model, tp_size, tp_rank, comm, kv_comm)


def param_count(cfg: ModelConfig) -> int:
    """The full model's parameters (a tied head counted once), from shapes alone."""
    return sum(p.numel() for p in meta_model(cfg).parameters())


def is_decayed(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices only: not on biases, norm gains or GPT-2's position embedding.

    The token embedding (tied to the head in GPT-2) is a matrix of a matmul and is decayed.
    """
    return p.dim() >= 2 and not name.endswith("wpe.weight")


__all__ = ["ARCHITECTURES", "ARCH_NAMES", "GPT", "KVCache", "Llama", "TPSlice", "build_model", "collection_paused",
           "is_decayed", "meta_model", "model_class", "param_count", "parallelize", "plan", "summed_token_loss"]
