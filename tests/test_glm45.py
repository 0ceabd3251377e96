"""GLM-4.5 (glm4_moe: grouped-query attention with partial rotary, q/k/v biases and optional per-head q/k norms; a
dense first layer, then DeepSeek-V3's experts: sigmoid group-limited routing with a load-balancing bias, shared
experts, routed_scaling_factor) against transformers' Glm4MoeForCausalLM: tiny models built by transformers with a
dense layer and two MoE layers in 4 groups, random norms and biases and a non-zero e_score_correction_bias, read by
`load_model` (hub/mapping.py's config and weights).

Logits within 1e-4 of transformers' with q/k norms and without, with biases and without, with GQA. Planted in the
functions zerotrain runs and caught: rotary on the whole head, rotary on the head's second half instead of its first,
the group limit dropped from the top-k. An hf export loads in transformers as Glm4MoeForCausalLM with the same
logits, and its config.json reads back as the same model; MTP layers in a folder are set aside at import and kept
bitwise through an export; a config field zerotrain does not compute is refused naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_deepseek import CAUGHT, EXACT, VOCAB, add_mtp_layer, assert_config_refused, assert_refused_in_one_line, \
    decoded, exported_to_transformers, hf_model as deepseek_hf_model, kind_folders, logits, no_group_limit
from test_gemma import one_thread

import zerotrain
from zerotrain.model import group_routing, llama, rotary

pytestmark = pytest.mark.timeout(600)

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=24, n_shared_experts=2, n_routed_experts=8,
             n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5,
             norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
             tie_word_embeddings=False, attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
CONFIGS = {
    "qk norm": dict(),
    "no qk norm": dict(use_qk_norm=False),  # GLM-4.5-Air's
    "no biases, one group": dict(attention_bias=False, n_group=1, topk_group=1, norm_topk_prob=False,
                                 routed_scaling_factor=1.0),
}


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def hf_model(folder, **changes):
    """A tiny random GLM-4.5 saved by transformers in `folder` (test_deepseek's hf_model: its norms and biases moved
    off their starts and its routing bias large enough to change which experts are chosen), eval mode."""
    return deepseek_hf_model(folder, transformers.Glm4MoeConfig, SIZES, **changes)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return kind_folders(tmp_path_factory.mktemp("glm45"), hf_model, CONFIGS)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_load_model_computes_the_logits_transformers_does(folders, kind):
    folder, hf = folders[kind]
    model = zerotrain.load_model(str(folder))
    cfg = model.cfg
    assert (cfg.arch, cfg.first_dense_layers, cfg.n_experts, cfg.head_dim, cfg.rotary_dim, cfg.kv_heads) == \
        ("glm4_moe", 1, 8, 24, 12, 2)
    assert [cfg.has_experts(layer) for layer in range(3)] == [False, True, True]
    assert (cfg.use_qk_norm, cfg.attention_bias) == (kind != "no qk norm", kind != "no biases, one group")
    biases = [b for n, b in model.named_parameters() if n.endswith("e_score_correction_bias")]
    assert len(biases) == 2 and all(b.abs().min() > 0 for b in biases)
    gap = (logits(model) - logits(hf)).abs().max()
    assert gap < EXACT, gap


def rotary_on_the_whole_head(positions, width, theta, scaling=None):
    """Planted: tables as wide as the head (24), so that rotary turns every unit, not the first half."""
    return rotary.rotary_tables(positions, 2 * width, theta, scaling)


def rotary_on_the_second_half(x, cos, sin):
    """Planted: the rotary units taken from the head's end."""
    width = cos.shape[-1]
    return torch.cat([x[..., :-width], rotary.apply_rotary(x[..., -width:], cos, sin)], dim=-1)


PLANTED = {
    "rotary on the whole head": lambda mp: mp.setattr(llama, "rotary_tables", rotary_on_the_whole_head),
    "rotary on the second half": lambda mp: mp.setattr(llama, "apply_rotary", rotary_on_the_second_half),
    "group top-k without the group limit": lambda mp: mp.setattr(group_routing, "group_limited_top_k",
                                                                 no_group_limit),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_changes_the_logits(folders, monkeypatch, bug):
    folder, hf = folders["qk norm"]
    PLANTED[bug](monkeypatch)
    assert (logits(zerotrain.load_model(str(folder))) - logits(hf)).abs().max() > CAUGHT


def test_decoding_through_the_cache_equals_the_full_forward(folders):
    """The prompt in one forward, then one token per forward (what `sample` does): the logits of the whole row."""
    model = zerotrain.load_model(str(folders["qk norm"][0]))
    assert (decoded(model, 30) - logits(model)).abs().max() < EXACT


def test_an_hf_export_loads_in_transformers_as_glm4_moe_with_the_same_logits(folders, tmp_path):
    model, theirs = exported_to_transformers(folders["qk norm"][0], tmp_path / "out", "Glm4MoeForCausalLM")
    bias = dict(theirs.named_buffers())["model.layers.1.mlp.gate.e_score_correction_bias"]  # moved too
    assert torch.equal(bias, model.model.layers[1].mlp.gate.e_score_correction_bias.detach())


def test_mtp_layers_are_set_aside_at_import_and_kept_bitwise_by_an_export(folders, tmp_path):
    """A folder with one MTP layer (model.layers.3...: a block as layer 2's, with eh_proj and enorm): the model
    leaves it out (transformers' too: the logits agree), counts it, and an export from the folder holds it bitwise."""
    from zerotrain.cli.main import main

    folder = tmp_path / "model"
    hf_model(folder)
    mtp = add_mtp_layer(folder)
    model = zerotrain.load_model(str(folder))
    assert model.cfg.mtp_layers == 1 and not any(n.startswith("model.layers.3.") for n, _ in model.named_parameters())
    assert (logits(model) - logits(folders["qk norm"][1])).abs().max() < EXACT
    assert main(["train", "--init-from", str(folder), "--data", "synthetic", "--steps", "1", "--seq-len", "16",
                 "--micro-batch", "2", "--no-progress", "--threads", "1", "--out", str(tmp_path / "run")]) == 0
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--format", "hf"]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(exported[n], t) for n, t in mtp.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


# What zerotrain does not compute for GLM-4.5: refused in one line naming it (exit 2 for a run's settings).

@pytest.mark.parametrize("flags, said", [
    (["--method", "dpo"], "--routing-bias-speed 0.001 with --method dpo: the bias moves with the expert loads of "
                          "--method sft's steps only in zerotrain yet: give --routing-bias-speed 0"),
])
def test_what_zerotrain_does_not_have_for_glm_is_refused_in_one_line(folders, flags, said, capsys):
    assert_refused_in_one_line(capsys, ["train", "--init-from", str(folders["qk norm"][0]), "--data", "synthetic",
                                        *flags], said)


@pytest.mark.parametrize("field, value, said", [
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope_type 'yarn'"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3},
     "partial_rotary_factor 0.3 rotates 7"),
    ("use_qk_norm", 1, "use_qk_norm must be true or false"),
    ("first_k_dense_replace", -1, "first_k_dense_replace must be a whole number"),
])
def test_a_config_zerotrain_does_not_compute_is_refused_naming_the_field(field, value, said):
    assert_config_refused(transformers.Glm4MoeConfig(**SIZES), field, value, said)


def test_attention_adapters_export_to_peft_with_the_runs_logits_and_a_wrong_scale_is_caught(folders, tmp_path, capfd,
                                                                                             monkeypatch):
    """A LoRA run on the attention's projections (their biases and q/k norms frozen beside them) exports to peft:
    peft's model of transformers' Glm4MoeForCausalLM and the adapter computes the run's logits; the adapters' scale
    written wrong (alpha doubled) is caught. Adapters on an MLP of a mixture of experts are refused at a peft export
    (hub/adapter.py: peft takes those names for the routed experts' 3-D tensors), as for every MoE family."""
    import peft
    from conftest import zerotrain_here

    from zerotrain.hub import adapter

    folder, _ = folders["qk norm"]
    out = tmp_path / "run"
    r = zerotrain_here(capfd, "train", "--init-from", str(folder), "--data", "synthetic", "--seq-len", "16",
                       "--micro-batch", "2", "--lora-rank", "4", "--lora-targets", "q_proj,k_proj,v_proj,o_proj",
                       "--lr", "5e-2", "--steps", "2", "--ckpt-every", "2", "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]

    def peft_logits() -> torch.Tensor:
        r = zerotrain_here(capfd, "export", str(out), str(tmp_path / "adapter"), "--format", "peft", "--overwrite")
        assert r.returncode == 0, r.stderr[-2000:]
        base = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        return logits(peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval())

    ours = logits(zerotrain.load_model(str(out)))
    assert (peft_logits() - ours).abs().max() < EXACT
    assert (logits(folders["qk norm"][1]) - ours).abs().max() > CAUGHT  # the adapters trained
    real = adapter.peft_config
    monkeypatch.setattr(adapter, "peft_config", lambda run, path, adapted: {
        **real(run, path, adapted), "lora_alpha": 2 * real(run, path, adapted)["lora_alpha"]})
    assert (peft_logits() - ours).abs().max() > CAUGHT


def tiny_glm():
    """A tiny GLM-4.5 of zerotrain's own: a dense layer and two MoE layers (2 shared experts), GQA, half-rotary heads."""
    import dataclasses

    from zerotrain.config import PRESETS, ModelConfig

    return dataclasses.replace(ModelConfig(**PRESETS["qwen3-moe-tiny"]), arch="glm4_moe", n_layer=3, n_kv_head=2,
                               head_width=8, partial_rotary=0.5, attention_bias=True, use_qk_norm=True,
                               first_dense_layers=1, shared_experts=2, expert_groups=2, routed_scaling=2.5,
                               router_aux_coef=0.0)


def test_the_model_flops_are_torchs_count_and_shared_experts_left_out_are_caught(monkeypatch):
    """The MFU's FLOPs per token (6 N + 12 L T a, N the weights a token goes through) equal what torch's
    FlopCounterMode counts in a forward and backward: the shared experts are among them (planted: counted as
    Qwen3-MoE's, without them)."""
    from test_throughput import counted_flops

    from zerotrain.training import throughput

    m = tiny_glm()
    assert throughput.model_flops_per_token(m) * 2 * m.seq_len == counted_flops(m)
    monkeypatch.setattr(throughput, "GROUP_ROUTED", ())
    assert throughput.model_flops_per_token(m) * 2 * m.seq_len < counted_flops(m)


def test_the_activation_bytes_are_counted_to_the_byte_and_an_uncounted_part_is_caught(monkeypatch):
    """What a GLM-4.5 layer saves for its backward (a dense layer and two MoE layers: DeepSeek-V3's router and shared
    experts, rotary on half of each head, q/k norms), as the memory plan counts it, equals what autograd saves, in
    fp32 and bf16 and for packed records. Caught: the plan without DeepSeek-V3's router and shared experts; partial
    rotary returning a contiguous q (torch.cat's), whose attention output o_proj then saves as one more copy."""
    from test_activation_bytes import measured_bytes, packed_segments, predicted_bytes

    from zerotrain.model import activation_memory, build_model

    cfg = tiny_glm()
    cases = [("fp32", None), ("bf16", None), ("fp32", packed_segments(2, 16))]
    for precision, segments in cases:
        kw = dict(precision=precision, recompute="none", documents=segments is not None)
        measured = measured_bytes(build_model(cfg, seed=0), 2, 16, precision, "none", segments)
        assert predicted_bytes(cfg, 2, 16, **kw) == measured, precision
        with monkeypatch.context() as m:  # planted: the plan counts GLM's experts as Qwen3-MoE's
            m.setattr(activation_memory, "GROUP_ROUTED", ())
            assert predicted_bytes(cfg, 2, 16, **kw) < measured
    whole = rotary.apply_rotary

    def contiguous_partial(x, cos, sin):  # planted: the rotated share and the rest joined by torch.cat
        width = cos.shape[-1]
        return torch.cat([whole(x[..., :width], cos, sin), x[..., width:]], dim=-1)

    monkeypatch.setattr(llama, "apply_rotary", contiguous_partial)
    assert measured_bytes(build_model(cfg, seed=0), 2, 16, "fp32", "none") > predicted_bytes(cfg, 2, 16)
