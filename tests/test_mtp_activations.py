"""The activations --mtp train adds (model/activation_memory.mtp_depths: each depth's input norms and projection,
its block whole on every TP rank, its output norm, the head's loss over the depths' rows) equal what autograd saves,
to the byte, for DeepSeek-V3's, GLM-4.5's and Qwen3.5's (dense and MoE) tiny models with one MTP layer: fp32 and
bf16, blocks recomputed or not, packed records or not, and one rank of TP 2. Planted in the plan's own terms and
caught: the depths counted as nothing, the block counted at the TP rank's share of heads and widths."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
import transformers
from test_activation_bytes import _OneRankOfTwo, hf_config_of, latent_configs, measured_bytes, packed_segments
from test_gemma import one_thread
from test_glm45 import SIZES as GLM45_SIZES
from test_qwen35 import CONFIGS as QWEN35_CONFIGS

from zerotrain.model import activation_memory as memory
from zerotrain.model import build_model, parallelize
from zerotrain.model.activation_memory import activation_bytes

pytestmark = pytest.mark.timeout(600)
FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_5", "qwen3_5_moe")


def config(family: str):
    """The family's tiny model (its tests' shapes) with one MTP layer, trained."""
    base = {"deepseek_v3": lambda: latent_configs()["deepseek_v3"],
            "glm4_moe": lambda: hf_config_of(transformers.Glm4MoeConfig(**GLM45_SIZES)),
            "qwen3_5": lambda: hf_config_of(QWEN35_CONFIGS["qwen3_5"]()),
            "qwen3_5_moe": lambda: hf_config_of(QWEN35_CONFIGS["qwen3_5_moe"]())}[family]()
    return dataclasses.replace(base, mtp_layers=1, mtp="train")


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("recompute", ["none", "blocks"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_mtp_layers_activations_are_counted_to_the_byte_and_leaving_them_out_is_caught(family, precision,
                                                                                          recompute, packed):
    cfg = config(family)
    segments = packed_segments(2, 16) if packed else None
    measured = measured_bytes(build_model(cfg, seed=0), 2, 16, precision, recompute, segments)
    kw = dict(precision=precision, recompute=recompute, documents=packed)
    planned = activation_bytes(cfg, 2, 16, **kw)
    assert planned["total"] == measured and planned["mtp"] > 0
    with mock.patch.object(memory, "mtp_depths", lambda *args, **kwargs: 0):
        assert activation_bytes(cfg, 2, 16, **kw)["total"] != measured


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tp2_rank_saves_what_the_plan_counts_for_its_whole_mtp_block_and_a_split_block_is_caught(family):
    cfg = config(family)
    model = build_model(cfg, seed=0)
    parallelize(model, 2, 0, _OneRankOfTwo())
    measured = measured_bytes(model, 2, 16, "fp32", "none")
    assert activation_bytes(cfg, 2, 16, tp=2)["total"] == measured
    with mock.patch.object(memory, "mtp_block_shape", lambda s, cfg: s):
        assert activation_bytes(cfg, 2, 16, tp=2)["total"] != measured
