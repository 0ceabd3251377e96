"""The Mistral 4 planning preset: Mistral Small 4 (mistralai/Mistral-Small-4-119B-2603's language model, transformers'
Mistral4Config defaults), its parameters counted as transformers' Mistral4ForCausalLM builds them from the config.json
zerotrain writes (118,972,826,624), config.json both ways; planned on 32 GPUs with expert parallelism it fits an
80 GiB device.
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
PRESET, COUNT = "mistral-small-4-119b", 118_972_826_624


def test_the_preset_is_the_model_transformers_builds_from_its_defaults():
    """transformers' Mistral4Config with no field given (the checkpoint its docstring names) is the preset read
    through hub/mapping.py (its pad_token_id 11 aside), with the same parameters; and the config.json zerotrain
    writes reads back as the preset."""
    cfg = ModelConfig(**PRESETS[PRESET])
    released = transformers.Mistral4Config()
    assert param_count(cfg) == parameters_of(on_meta(transformers.Mistral4ForCausalLM, released)) == COUNT
    read = as_read(cfg)
    assert mapping.model_config_from_hf(released.to_dict(), PRESET) == dataclasses.replace(read, pad_token_id=11)
    assert mapping.model_config_from_hf(mapping.hf_config(cfg, None), PRESET) == read


def test_mistral_small_4_on_32_gpus_with_expert_parallelism_fits_80_gib(capsys):
    report = planned(capsys, PRESET, "--nproc", "32", "--ep", "8")
    assert report["parameters"] == COUNT and report["dp"] == 32
    assert report["total"] < 80 * 2**30
