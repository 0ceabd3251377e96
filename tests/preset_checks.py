"""What each planning preset's test does alike: transformers' model of a config built on the meta device (no memory),
its parameters counted as zerotrain counts them, config.json read back as the preset, and `zerotrain plan` of the
preset at ZeRO-3, bf16, on CUDA."""

from __future__ import annotations

import dataclasses
import json

import torch
import transformers

from zerotrain.cli import main as cli
from zerotrain.config import PRESETS, ModelConfig
from zerotrain.hub import mapping
from zerotrain.model import param_count


def on_meta(build, config):
    """`build(config)` (transformers' model class, or AutoModelForCausalLM.from_config) on the meta device."""
    with torch.device("meta"):
        return build(config)


def parameters_of(model) -> int:
    """transformers' `model`'s parameters as zerotrain counts them: the routers' e_score_correction_bias
    (buffers in transformers, parameters in zerotrain) among them."""
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + biases


def as_read(cfg: ModelConfig) -> ModelConfig:
    """The preset `cfg` as hub/mapping.py reads a config.json of it: the sequence length its positions, no context
    length of its own."""
    return dataclasses.replace(cfg, seq_len=cfg.positions, context=0)


def assert_config_json_is_transformers_model(preset: str, hf_class: str, count: int):
    """transformers builds `hf_class` from the config.json zerotrain writes for `preset`, with the preset's `count`
    parameters (zerotrain's count too), and that config.json reads back as the preset."""
    cfg = ModelConfig(**PRESETS[preset])
    config = mapping.hf_config(cfg, None)
    theirs = on_meta(transformers.AutoModelForCausalLM.from_config, transformers.AutoConfig.for_model(**config))
    assert type(theirs).__name__ == hf_class
    assert param_count(cfg) == parameters_of(theirs) == count
    assert mapping.model_config_from_hf(config, preset) == as_read(cfg)


def planned(capsys, preset: str, *flags: str) -> dict:
    """`zerotrain plan --preset PRESET FLAGS` at ZeRO-3 in bf16 on CUDA devices, one row a micro-batch, blocks
    recomputed: its --json report."""
    assert cli.main(["plan", "--preset", preset, *flags, "--zero", "3", "--precision", "bf16", "--device", "cuda",
                     "--data", "synthetic", "--micro-batch", "1", "--activation-checkpointing", "blocks",
                     "--json"]) == 0
    return json.loads(capsys.readouterr().out)
