"""The DeepSeek-V3 planning presets: DeepSeek-V3 671B (V3.1 and R1 share its shape) and Kimi K2, their parameters
counted as transformers' DeepseekV3ForCausalLM builds them from the config.json zerotrain writes (671,026,419,200 and
1,026,408,232,448 with the routers' biases, MTP layers not in either), config.json both ways; DeepSeek-V3 planned on
256 GPUs with expert parallelism fits an 80 GiB device.
"""

from __future__ import annotations

import pytest
from preset_checks import assert_config_json_is_transformers_model, planned

pytestmark = pytest.mark.timeout(600)
COUNTS = {"deepseek-v3-671b": 671_026_419_200, "kimi-k2": 1_026_408_232_448}


@pytest.mark.parametrize("preset", list(COUNTS))
def test_the_presets_are_the_models_transformers_builds_from_their_config(preset):
    assert_config_json_is_transformers_model(preset, "DeepseekV3ForCausalLM", COUNTS[preset])


def test_deepseek_v3_on_256_gpus_with_expert_parallelism_fits_80_gib(capsys):
    report = planned(capsys, "deepseek-v3-671b", "--nproc", "256", "--ep", "32")
    assert report["parameters"] == COUNTS["deepseek-v3-671b"] and report["dp"] == 256
    assert report["total"] < 80 * 2**30
