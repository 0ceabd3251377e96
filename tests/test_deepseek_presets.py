"""The DeepSeek-V3 planning presets: DeepSeek-V3 671B (V3.1 and R1 share its shape) and Kimi K2, their parameters
counted as transformers' DeepseekV3ForCausalLM builds them from the config.json zerotrain writes (671,026,419,200 and
1,026,408,232,448 with the routers' biases, MTP layers not in either), config.json both ways; DeepSeek-V3 planned on
256 GPUs with expert parallelism fits an 80 GiB device.
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
COUNTS = {"deepseek-v3-671b": 671_026_419_200, "kimi-k2": 1_026_408_232_448}


@pytest.mark.parametrize("preset", list(COUNTS))
def test_the_presets_are_the_models_transformers_builds_from_their_config(preset):
    cfg = ModelConfig(**PRESETS[preset])
    config = mapping.hf_config(cfg, None)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    biases = sum(b.numel() for n, b in theirs.named_buffers() if n.endswith("e_score_correction_bias"))
    assert param_count(cfg) == sum(p.numel() for p in theirs.parameters()) + biases == COUNTS[preset]
    assert mapping.model_config_from_hf(config, preset) == dataclasses.replace(cfg, seq_len=cfg.positions, context=0)


def test_deepseek_v3_on_256_gpus_with_expert_parallelism_fits_80_gib(capsys):
    assert cli.main(["plan", "--preset", "deepseek-v3-671b", "--nproc", "256", "--ep", "32", "--zero", "3",
                     "--precision", "bf16", "--device", "cuda", "--data", "synthetic", "--micro-batch", "1",
                     "--activation-checkpointing", "blocks", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] == COUNTS["deepseek-v3-671b"] and report["dp"] == 256
    assert report["total"] < 80 * 2**30
