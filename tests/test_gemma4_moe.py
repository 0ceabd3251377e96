"""Gemma 4's MoE block (enable_moe_block, Gemma 4 26B-A4B's) against transformers' Gemma4ForCausalLM: test_gemma4's
tiny model with every kind of layer (sliding, global, shared-KV), its norms, the router's scales and the layer
scalars moved off 1, and on every layer 4 experts of width 32, top-2, beside the MLP; read by `load_model` and
--init-from.

Logits within 1e-4 of transformers' (measured 1.8e-5). Planted in the functions zerotrain runs and caught (the logits
move by more than 1e-2): the router reading the experts' normed input instead of the residual, the router's
1 / sqrt(width) left out, the per-expert scale left out, the experts' output norm (post_feedforward_layernorm_2) left
out.

Training: 8 AdamW steps of --init-from at 1 rank (in this process), at ZeRO-3 on 2 ranks and at --ep 2 (one start of
2 ranks for both) equal a plain transformers + AdamW loop (test_qwen35's, no balancing loss: transformers'
Gemma4ForCausalLM adds none; over its SDPA attention, as test_gemma4's): losses, gradient norms and final weights
within 1e-5 relative (measured at 1 rank / ZeRO-3 / --ep 2: losses 2.0e-7 / 1.3e-7 / 1.7e-7, gradient norms 4.7e-6 /
4.7e-6 / 4.4e-6, weights 1.3e-6 each; against the eager loop the gradient norms are 6.6e-6 / 7.1e-6 / 6.8e-6). The
trained model exports with --format hf to Gemma4ForCausalLM computing the run's logits, its experts stacked as
transformers holds them, config.json both ways. Decoding through the KV cache equals the full forward (test_gemma4
shows a cache losing its earlier positions caught). A random model's router scales start at 1; experts on some layers
only (--moe-every, --mlp-only-layers) are refused in one line. The gemma4-26b-a4b planning preset is the model
transformers builds from its config.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from test_gemma import one_thread
from test_gemma4 import CAUGHT, EXACT, IDS, LIMIT, UNGUARDED, cached_logits, hf_model, logits
from test_qwen35 import STEPS, ZERO3_EP2, gaps, one_folder_runs

import zerotrain
from zerotrain.hub import mapping
from zerotrain.hub.export import export_model
from zerotrain.model import gemma4

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-moe")
    with one_thread():
        return root / "gemma4", hf_model(root / "gemma4", moe=True)


def test_load_model_computes_the_logits_transformers_does_with_the_moe_block(folder):
    path, hf = folder
    model = zerotrain.load_model(str(path))
    cfg = model.cfg
    assert (cfg.n_experts, cfg.experts_per_token, cfg.expert_width, cfg.router_aux_coef) == (4, 2, 32, 0.0)
    assert all(isinstance(block.moe, gemma4.Gemma4MoE) for block in model.model.layers)
    assert {float(s) for b in model.model.layers for s in b.moe.per_expert_scale} != {1.0}
    assert (logits(model) - logits(hf)).abs().max() < EXACT


_route, _forward, _init = gemma4.Gemma4MoE.route, gemma4.MoE.forward, gemma4.Gemma4MoE.__init__


def unscaled_router(self, cfg):
    _init(self, cfg)
    self.root_width = 1.0


def without_per_expert_scale(self, flat, B, T):
    weights, chosen = _route(self, flat, B, T)
    return weights / self.per_expert_scale[chosen], chosen


PLANTED = {
    "the router reading the experts' normed input": (gemma4.MoE, "forward",
                                                     lambda self, x, router_input=None: _forward(self, x)),
    "the router's 1 / sqrt(width) left out": (gemma4.Gemma4MoE, "__init__", unscaled_router),
    "the per-expert scale left out": (gemma4.Gemma4MoE, "route", without_per_expert_scale),
}


@pytest.mark.parametrize("bug", [*PLANTED, "the experts' output norm left out"])
def test_a_planted_bug_in_the_moe_block_changes_the_logits(folder, monkeypatch, bug):
    path, hf = folder
    if bug in PLANTED:
        monkeypatch.setattr(*PLANTED[bug])
        model = zerotrain.load_model(str(path))
    else:  # post_feedforward_layernorm_2 of every block passing the experts' output as it is
        model = zerotrain.load_model(str(path))
        for block in model.model.layers:
            monkeypatch.setattr(block.post_feedforward_layernorm_2, "forward", lambda x: x)
    assert (logits(model) - logits(hf)).abs().max() > CAUGHT


def test_decoding_through_the_cache_equals_the_full_forward_with_the_moe_block(folder):
    """Each token routed alone as in the whole sequence (in fp64, as test_gemma4's)."""
    model = zerotrain.load_model(str(folder[0])).double()
    assert (cached_logits(model, IDS) - logits(model)).abs().max() < 1e-9


@pytest.fixture(scope="module")
def training_folder(tmp_path_factory):
    """test_gemma4's training model (transformers' initialisation scale, q and k gains about 0.3) with the block."""
    root = tmp_path_factory.mktemp("gemma4-moe-training")
    with one_thread():
        return root / "gemma4", hf_model(root / "gemma4", 0.02, qk_gain=0.3, moe=True)


@pytest.fixture(scope="module")
def runs(training_folder, tmp_path_factory):
    """{"1 rank" | "zero3" | "ep2" | "transformers": {"loss", "grad_norm", "weights"}, "folder": the 1-rank run's}."""
    return one_folder_runs(training_folder[0], tmp_path_factory.mktemp("gemma4-moe-runs"), ZERO3_EP2, LIMIT,
                           *UNGUARDED, attention="sdpa")


@pytest.mark.parametrize("run", ["1 rank", "zero3", "ep2"])
def test_eight_steps_with_the_moe_block_train_as_transformers_and_adamw_do(runs, run):
    theirs, ours = runs["transformers"], runs[run]
    assert len(ours["loss"]) == STEPS
    gap = gaps(ours, theirs)
    assert gap["loss"] <= 1e-5 and gap["grad_norm"] <= 1e-5 and gap["weights"] <= 1e-5, gap
    assert max(theirs["loss"]) != min(theirs["loss"])  # it trained


def test_a_trained_export_with_the_moe_block_is_loaded_by_transformers_as_gemma4(training_folder, runs, tmp_path):
    trained = zerotrain.load_model(str(runs["folder"]))
    ours = logits(trained)
    assert (ours - logits(training_folder[1])).abs().max() > 1e-3  # it moved from where it started
    out = tmp_path / "hf"
    export_model(trained, str(out), "hf", tokenizer_folder=None, eot_id=None)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(loaded).__name__ == "Gemma4ForCausalLM" and loaded.config.enable_moe_block
    assert (logits(loaded) - ours).abs().max() < EXACT
    # the experts stacked back as transformers holds them: expert 3's up projection is the second half of its rows
    up = trained.model.layers[1].moe.experts[3].up_proj.weight
    assert torch.equal(loaded.model.layers[1].experts.gate_up_proj[3, 32:], up)
    config = json.loads((out / "config.json").read_text())
    cfg = trained.cfg
    assert mapping.model_config_from_hf(config, "config.json") == dataclasses.replace(cfg, seq_len=cfg.positions,
                                                                                      context=0)


TINY = ["--arch", "gemma4", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--head-width", "16",
        "--global-head-width", "32", "--sliding-window", "8", "--sliding-window-pattern", "2", "--n-experts", "4",
        "--expert-width", "32", "--vocab-size", "300"]


def test_a_random_moe_block_starts_as_transformers_initialises_it():
    """The router's scales at 1 (transformers' _init_weights), its projection and the experts N(0, 0.02)."""
    from zerotrain.cli.flags import config_from_args
    from zerotrain.cli.main import build_parser
    from zerotrain.model import build_model

    cfg = config_from_args(build_parser().parse_args(["train", *TINY, "--data", "synthetic"]))
    moe = build_model(cfg.model, 0).model.layers[0].moe
    assert torch.equal(moe.scale, torch.ones(64)) and torch.equal(moe.per_expert_scale, torch.ones(4))
    assert 0.015 < moe.experts[0].gate_proj.weight.std() < 0.025 and 0.015 < moe.gate.weight.std() < 0.025


@pytest.mark.parametrize("flags, said", [
    (["--moe-every", "2"], "--moe-every 2: --arch gemma4's MoE block is on every layer: give --moe-every 1 and no "
                           "--mlp-only-layers"),
    (["--mlp-only-layers", "1"], "--mlp-only-layers 1: --arch gemma4's MoE block is on every layer: give "
                                 "--moe-every 1 and no --mlp-only-layers"),
])
def test_experts_on_some_layers_only_are_refused_in_one_line(flags, said, capsys, tmp_path):
    from zerotrain.cli.main import main

    assert main(["train", *TINY, "--data", "synthetic", "--out", str(tmp_path), *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"zerotrain: error: {said}"]


# google/gemma-4-26B-A4B's text model as transformers builds it from the config.json zerotrain writes: its parameters
# and the 30 layer scalars (buffers there, parameters here)
GEMMA4_26B_A4B = 25_233_141_790


def test_the_26b_a4b_preset_is_the_model_transformers_builds_from_its_config():
    from zerotrain.config import PRESETS, ModelConfig
    from zerotrain.model import param_count

    cfg = ModelConfig(**PRESETS["gemma4-26b-a4b"])
    config = mapping.hf_config(cfg, None)
    assert (config["enable_moe_block"], config["num_experts"], config["top_k_experts"],
            config["moe_intermediate_size"]) == (True, 128, 8, 704)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    scalars = sum(b.numel() for n, b in theirs.named_buffers() if n.endswith("layer_scalar"))
    assert param_count(cfg) == sum(p.numel() for p in theirs.parameters()) + scalars == GEMMA4_26B_A4B
    assert [i for i in range(cfg.n_layer) if cfg.global_layer(i)] == [5, 11, 17, 23, 29]
    assert mapping.model_config_from_hf(config, "gemma4-26b-a4b") == dataclasses.replace(cfg, seq_len=cfg.positions,
                                                                                          context=0)
