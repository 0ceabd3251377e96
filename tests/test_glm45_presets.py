"""The GLM-4.5 planning presets: GLM-4.5-Air and GLM-4.5, their parameters counted as transformers'
Glm4MoeForCausalLM builds them from the config.json zerotrain writes (106,852,251,264 and 352,797,829,024 with the
routers' biases; their MTP layer, in neither, makes the released 106B and 355B), config.json both ways; GLM-4.5-Air
planned on 32 GPUs with --ep 8 at ZeRO-3 fits an 80 GiB device (69.0 GiB). Each model is built once, on the meta
device.
"""

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
COUNTS = {"glm-4.5-air": 106_852_251_264, "glm-4.5": 352_797_829_024}


@pytest.mark.parametrize("preset", list(COUNTS))
def test_the_presets_are_the_models_transformers_builds_from_their_config(preset):
    cfg = ModelConfig(**PRESETS[preset])
    config = mapping.hf_config(cfg, None)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    assert type(theirs).__name__ == "Glm4MoeForCausalLM"
    biases = sum(b.numel() for n, b in theirs.named_buffers() if n.endswith("e_score_correction_bias"))
    assert param_count(cfg) == sum(p.numel() for p in theirs.parameters()) + biases == COUNTS[preset]
    assert mapping.model_config_from_hf(config, preset) == dataclasses.replace(cfg, seq_len=cfg.positions, context=0)


def test_glm_4_5_air_on_32_gpus_with_expert_parallelism_fits_80_gib(capsys):
    assert cli.main(["plan", "--preset", "glm-4.5-air", "--nproc", "32", "--ep", "8", "--zero", "3",
                     "--precision", "bf16", "--device", "cuda", "--data", "synthetic", "--micro-batch", "1",
                     "--activation-checkpointing", "blocks", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] == COUNTS["glm-4.5-air"] and report["dp"] == 32
    assert report["total"] < 80 * 2**30
