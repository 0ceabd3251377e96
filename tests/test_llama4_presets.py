"""The Llama 4 planning presets: Scout (transformers' Llama4TextConfig defaults, which are Scout's) and Maverick (the
same with 128 experts on every second layer), their parameters counted as transformers' Llama4ForCausalLM builds them
(107,769,861,120 and 400,711,848,960), config.json both ways; planned with expert parallelism each fits an 80 GiB
device (Scout on 32 GPUs, Maverick on 128).
"""

from __future__ import annotations

import dataclasses

import pytest
import transformers
from preset_checks import as_read, on_meta, parameters_of, planned

from zerotrain.config import PRESETS, ModelConfig
from zerotrain.hub import mapping
from zerotrain.model import param_count

pytestmark = pytest.mark.timeout(600)
SHAPES = {"llama-4-scout": ({}, 107_769_861_120, 32),
          "llama-4-maverick": (dict(num_local_experts=128, interleave_moe_layer_step=2), 400_711_848_960, 128)}


@pytest.mark.parametrize("preset", SHAPES)
def test_the_preset_is_the_model_transformers_builds(preset):
    """transformers' Llama4TextConfig (Scout's defaults; Maverick's expert count and interleave) is the preset read
    through hub/mapping.py (its padding row aside), with the same parameters; and the config.json zerotrain writes
    reads back as the preset."""
    fields, count, _ = SHAPES[preset]
    cfg = ModelConfig(**PRESETS[preset])
    released = transformers.Llama4TextConfig(**fields)
    assert param_count(cfg) == parameters_of(on_meta(transformers.Llama4ForCausalLM, released)) == count
    read = as_read(cfg)
    # transformers' defaults name no padding row (-1: none); the released folders' config.json give their own
    assert mapping.model_config_from_hf(released.to_dict(), preset) == dataclasses.replace(read, pad_token_id=-1)
    assert mapping.model_config_from_hf(mapping.hf_config(cfg, None), preset) == read


@pytest.mark.parametrize("preset", SHAPES)
def test_llama_4_with_expert_parallelism_fits_80_gib(preset, capsys):
    _, count, gpus = SHAPES[preset]
    report = planned(capsys, preset, "--nproc", str(gpus), "--ep", "8")
    assert report["parameters"] == count and report["dp"] == gpus
    assert report["total"] < 80 * 2**30
