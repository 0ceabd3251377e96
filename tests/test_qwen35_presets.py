"""The Qwen3.5 planning presets: Qwen3.5-27B (dense) and Qwen3.5-35B-A3B (MoE), their parameters counted as
transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM build them (on the meta device) from the config.json
zerotrain writes (26,895,998,464 and 34,660,610,688; the MTP layer in neither), config.json both ways; each planned
on 16 GPUs (the 27B at --tp 2, the MoE at --ep 8) fits an 80 GiB device."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from zerotrain.cli import main as cli
from zerotrain.config import PRESETS, ModelConfig
from zerotrain.hub import mapping
from zerotrain.model import param_count

pytestmark = pytest.mark.timeout(600)
COUNTS = {"qwen3.5-27b": 26_895_998_464, "qwen3.5-35b-a3b": 34_660_610_688}
PLANS = {"qwen3.5-27b": ["--nproc", "16", "--tp", "2"], "qwen3.5-35b-a3b": ["--nproc", "16", "--ep", "8"]}


@pytest.mark.parametrize("preset", list(COUNTS))
def test_the_presets_are_the_models_transformers_builds_from_their_config(preset):
    cfg = ModelConfig(**PRESETS[preset])
    config = mapping.hf_config(cfg, None)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    assert type(theirs).__name__ == {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[cfg.arch]
    assert param_count(cfg) == sum(p.numel() for p in theirs.parameters()) == COUNTS[preset]
    assert mapping.model_config_from_hf(config, preset) == dataclasses.replace(cfg, seq_len=cfg.positions, context=0)


@pytest.mark.parametrize("preset", list(PLANS))
def test_each_preset_on_16_gpus_fits_80_gib(preset, capsys):
    assert cli.main(["plan", "--preset", preset, *PLANS[preset], "--zero", "3", "--precision", "bf16", "--device",
                     "cuda", "--data", "synthetic", "--micro-batch", "1", "--activation-checkpointing", "blocks",
                     "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] == COUNTS[preset]
    assert report["total"] < 80 * 2**30
