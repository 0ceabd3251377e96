"""Mistral 4 (mistral4: DeepSeek-V3's decoder with a softmax router without bias and queries scaled by their
position) against transformers' Mistral4ForCausalLM: tiny models built by transformers with a dense layer and two MoE
layers, random norms, YaRN with an original context of 16 positions (so that the query scaling, 1 + beta ln(1 +
floor(p / 16)), changes positions 16-39 of the 40), read by `load_model` (hub/mapping.py's config and stacked
experts).

Logits within 1e-4 of transformers' with a query rank and without, with YaRN's mscale pair and without, with
rotate-half rotary units, and with one group of experts. Planted in the functions zerotrain runs and caught, one per
part that differs from DeepSeek-V3 or that Mistral 4 configures otherwise: the router's softmax taken as DeepSeek's
sigmoid, the query scaling left out, Llama 4's offset (p + 1) in it, packed records scaled by their row's positions
instead of their own, the group limit dropped from the top-k, rotary on the units without it; in bf16 the router is
transformers' bitwise (an fp32 softmax is caught). An hf export loads in
transformers as Mistral4ForCausalLM with the same logits; what zerotrain does not compute is refused naming it.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_deepseek import CAUGHT, EXACT, SIZES as DEEPSEEK_SIZES, assert_config_refused, assert_refused_in_one_line, \
    decoded, exported_to_transformers, hf_model, kind_folders, logits, no_group_limit, packed_gap, \
    rotary_on_the_wrong_units
from test_gemma import one_thread

import zerotrain
from zerotrain.model import deepseek, group_routing, mla

pytestmark = pytest.mark.timeout(600)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "llama_4_scaling_beta": 0.1}
SIZES = {**{k: v for k, v in DEEPSEEK_SIZES.items() if k != "num_nextn_predict_layers"},
         "routed_scaling_factor": 1.5, "rope_parameters": YARN}
CONFIGS = {
    "low-rank q": dict(),
    "plain q_proj": dict(q_lora_rank=None),
    "yarn's own attention factor": dict(rope_parameters={k: v for k, v in YARN.items() if "mscale" not in k}),
    "rotate-half": dict(rope_interleave=False),
    # the released model's options: one group, routed_scaling_factor 1, its rope base and factor (YaRN x128)
    "one group": dict(n_group=1, topk_group=1, routed_scaling_factor=1.0, rope_parameters={**YARN, "factor": 128.0}),
}


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def mistral4_model(folder, **changes):
    """A tiny random Mistral 4 saved by transformers in `folder` (test_deepseek's hf_model), eval mode."""
    return hf_model(folder, transformers.Mistral4Config, SIZES, **changes)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return kind_folders(tmp_path_factory.mktemp("mistral4"), mistral4_model, CONFIGS)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_load_model_computes_the_logits_transformers_does(folders, kind):
    folder, hf = folders[kind]
    model = zerotrain.load_model(str(folder))
    cfg = model.cfg
    assert (cfg.arch, cfg.first_dense_layers, cfg.n_experts, cfg.head_dim, cfg.rope_original_context,
            cfg.llama4_scaling_beta, cfg.mtp_layers, cfg.pad_token_id) == ("mistral4", 1, 8, 24, 16, 0.1, 0, 11)
    assert [cfg.has_experts(layer) for layer in range(3)] == [False, True, True]
    assert not any(n.endswith("e_score_correction_bias") for n, _ in model.named_parameters())
    gap = (logits(model) - logits(hf)).abs().max()
    assert gap < EXACT, gap


def the_scale_with_llama4s_offset(positions, beta, original):
    """Planted: Llama 4's temperature tuning's positions (p + 1) in Mistral 4's query scaling."""
    return REAL_SCALE(positions + 1, beta, original)


REAL_SCALE = mla.llama4_query_scale
PLANTED = {
    "the router's softmax taken as a sigmoid": lambda mp: mp.setattr(
        group_routing, "softmax_scores", lambda flat, weight: torch.sigmoid(torch.nn.functional.linear(flat, weight))),
    "the query scaling left out": lambda mp: mp.setattr(mla, "llama4_query_scale",
                                                        lambda positions, beta, original: torch.ones(())),
    "the query scaling at Llama 4's positions": lambda mp: mp.setattr(mla, "llama4_query_scale",
                                                                      the_scale_with_llama4s_offset),
    "group top-k without the group limit": lambda mp: mp.setattr(group_routing, "group_limited_top_k",
                                                                 no_group_limit),
    "rotary on the wrong units": lambda mp: mp.setattr(mla, "rotate_units", rotary_on_the_wrong_units),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_changes_the_logits(folders, monkeypatch, bug):
    folder, hf = folders["low-rank q"]
    PLANTED[bug](monkeypatch)
    assert (logits(zerotrain.load_model(str(folder))) - logits(hf)).abs().max() > CAUGHT


def test_the_router_computes_in_bf16_as_transformers_does_and_an_fp32_softmax_is_caught(folders, monkeypatch):
    """In a bf16 run the router's softmax, weights and choice are transformers' Mistral4TopkRouter's bitwise (it
    computes in the activations' dtype, where DeepSeek-V3's router computes in fp32); the softmax taken in fp32 is
    caught."""
    import copy

    folder, hf = folders["low-rank q"]
    theirs = copy.deepcopy(hf.model.layers[1].mlp.gate).to(torch.bfloat16)
    ours = copy.deepcopy(zerotrain.load_model(str(folder)).model.layers[1].mlp.gate).to(torch.bfloat16)
    x = torch.randn(64, SIZES["hidden_size"], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def same() -> bool:
        with torch.no_grad():
            _, their_weights, their_chosen = theirs(x)
            _, our_weights, our_chosen = ours(x)
        order, our_order = their_chosen.sort(dim=-1), our_chosen.sort(dim=-1)
        return torch.equal(order.values, our_order.values) and torch.equal(
            their_weights.gather(1, order.indices), our_weights.gather(1, our_order.indices))

    assert same()
    monkeypatch.setattr(group_routing, "softmax_scores", lambda flat, weight: torch.nn.functional.linear(
        flat, weight).float().softmax(dim=-1))
    assert not same()


def test_decoding_through_the_cache_equals_the_full_forward(folders):
    """The prompt in one forward, then one token per forward (what `sample` does): each query scaled at its own
    position past the cache's."""
    model = zerotrain.load_model(str(folders["low-rank q"][0]))
    assert (decoded(model, 10) - logits(model)).abs().max() < EXACT


def test_packed_records_are_scaled_by_their_own_positions(folders, monkeypatch):
    """Two records in a row (positions restarting at the second, 25 tokens long: past the scaling's period of 16):
    each one's logits as alone, within 1e-5; the queries scaled by the row's positions instead are caught."""
    model = zerotrain.load_model(str(folders["low-rank q"][0]))
    assert packed_gap(model) < 1e-5
    real = deepseek.query_scale
    monkeypatch.setattr(deepseek, "query_scale", lambda cfg, positions: real(cfg, torch.arange(positions.shape[-1])))
    assert packed_gap(model) > CAUGHT


def test_an_hf_export_loads_in_transformers_as_mistral4_with_the_same_logits(folders, tmp_path):
    model, theirs = exported_to_transformers(folders["plain q_proj"][0], tmp_path / "out", "Mistral4ForCausalLM",
                                             loader=transformers.Mistral4ForCausalLM)
    experts = dict(theirs.named_parameters())["model.layers.2.mlp.experts.gate_up_proj"]
    ours = model.model.layers[2].mlp.experts[5]
    assert torch.equal(experts[5], torch.cat([ours.gate_proj.weight, ours.up_proj.weight]).detach())


# What zerotrain does not have for Mistral 4: refused in one line, exit 2 (as DeepSeek-V3's).

@pytest.mark.parametrize("flags, said", [
    # a new model's rotary (a folder's comes with it)
    (["--arch", "mistral4", "--n-experts", "4"], "--rope-scaling none: --arch mistral4 has YaRN rotary "
                                                 "(--rope-scaling yarn)"),
    # its routers have no bias to move
    (["--arch", "mistral4", "--n-experts", "4", "--rope-scaling", "yarn", "--routing-bias-speed", "0.01"],
     "--routing-bias-speed applies to --arch deepseek_v3 or glm4_moe; this run's model is --arch mistral4"),
])
def test_what_zerotrain_does_not_have_for_mistral4_is_refused_in_one_line(folders, flags, said, capsys):
    model = [] if "--arch" in flags else ["--init-from", str(folders["low-rank q"][0])]
    assert_refused_in_one_line(capsys, ["train", *model, "--data", "synthetic", *flags], said)


@pytest.mark.parametrize("field, value, said", [
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4}, "rope_type 'default'; zerotrain's mistral4 has "
                                                                     "'yarn'"),
    ("rope_parameters", {k: v for k, v in YARN.items() if k != "llama_4_scaling_beta"},
     "llama_4_scaling_beta must be a number of 0 or more, got None"),
    ("rope_parameters", {**YARN, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 does not rotate the "
                                                                "qk_rope_head_dim 8 units of a 24-unit head"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("num_key_value_heads", 2, "latent attention gives every head its keys"),
    ("attention_bias", True, "attention_bias = True"),
])
def test_a_config_zerotrain_does_not_compute_is_refused_naming_the_field(field, value, said):
    assert_config_refused(transformers.Mistral4Config(**SIZES), field, value, said)
