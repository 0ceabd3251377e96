"""The GLM-4.5 planning presets: GLM-4.5-Air and GLM-4.5, their parameters counted as transformers'
Glm4MoeForCausalLM builds them from the config.json zerotrain writes (106,852,251,264 and 352,797,829,024 with the
routers' biases; their MTP layer, in neither, makes the released 106B and 355B), config.json both ways; GLM-4.5-Air
planned on 32 GPUs with --ep 8 at ZeRO-3 fits an 80 GiB device (69.0 GiB). Each model is built once, on the meta
device.
"""

from __future__ import annotations

import pytest
from preset_checks import assert_config_json_is_transformers_model, planned

pytestmark = pytest.mark.timeout(600)
COUNTS = {"glm-4.5-air": 106_852_251_264, "glm-4.5": 352_797_829_024}


@pytest.mark.parametrize("preset", list(COUNTS))
def test_the_presets_are_the_models_transformers_builds_from_their_config(preset):
    assert_config_json_is_transformers_model(preset, "Glm4MoeForCausalLM", COUNTS[preset])


def test_glm_4_5_air_on_32_gpus_with_expert_parallelism_fits_80_gib(capsys):
    report = planned(capsys, "glm-4.5-air", "--nproc", "32", "--ep", "8")
    assert report["parameters"] == COUNTS["glm-4.5-air"] and report["dp"] == 32
    assert report["total"] < 80 * 2**30
