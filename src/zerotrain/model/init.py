"""Every parameter's initial values from the seed and its name alone, whoever holds which part of it.

A parameter's full tensor is drawn from its own generator, seeded from (seed, its name in the full model) through a
stable hash, by its architecture's rule (gpt2.init_rule, llama.init_rule). Nothing depends on the order the modules
are built in, on the world size, the TP degree or the ZeRO stage: a rank that trains a TP slice, or owns a part of a
parameter's flat range, draws the whole tensor and keeps its part, so every split starts from the same model.

The engine fills its flat buffers from a source of initial values: `SeedValues` here, or --init-from's files
(hub/init_from.FileValues); both answer `values(name, shape)` with this rank's (TP slice of the) tensor.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch
import torch.nn as nn

from zerotrain.config import LLAMA_FAMILY, ModelConfig

from . import gpt2, llama
from .layers import TPSlice

RULES = {"gpt2": gpt2.init_rule, **{arch: llama.init_rule for arch in LLAMA_FAMILY}}


class InitialValues(Protocol):
    def values(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's tensor of parameter `name` (its TP slice, of `shape`, when the parameter is split)."""


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """The generator of one parameter: seeded from (seed, name) by sha256 (Python's hash() changes per process)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def initial_value(cfg: ModelConfig, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The full fp32 tensor parameter `name` (of full shape `shape`) starts from."""
    rule = RULES[cfg.arch](cfg, name)
    if rule == "zeros":
        return torch.zeros(shape)
    if rule == "ones":
        return torch.ones(shape)
    kind, a = rule
    t = torch.empty(shape)
    if kind == "normal":
        return t.normal_(0.0, a, generator=parameter_generator(seed, name))
    return t.uniform_(-a, a, generator=parameter_generator(seed, name))  # "uniform": U(-a, a)


class SeedValues:
    """Initial values from the seed: each parameter drawn whole (initial_value), then this rank's TP slice of it."""

    def __init__(self, cfg: ModelConfig, seed: int, tp_slices: dict[str, TPSlice] | None = None, tp_rank: int = 0):
        self.cfg, self.seed, self.tp_slices, self.tp_rank = cfg, seed, tp_slices or {}, tp_rank

    def values(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        split = self.tp_slices.get(name)
        if split is None:
            return initial_value(self.cfg, self.seed, name, tuple(shape))
        return split.take(initial_value(self.cfg, self.seed, name, split.full_shape), self.tp_rank)


@torch.no_grad()
def materialise(model: nn.Module, source: InitialValues, device: torch.device | str = "cpu") -> nn.Module:
    """Move a model built on the meta device to `device`, every parameter filled from `source` (one tensor at a
    time beyond the model itself); a tied head is tied again. Non-parameter state: the models have none (rotary
    tables are computed in forward), so to_empty leaves nothing uninitialised."""
    model.to_empty(device=device)
    model.tie_weights()
    for name, p in model.named_parameters():  # a tied parameter once, under the embedding's name
        p.copy_(source.values(name, tuple(p.shape)))
    return model
