"""DeepSeek-V3 (deepseek_v3: multi-head latent attention, dense first layers, sigmoid group-limited routing with a
load-balancing bias, shared experts) against transformers' DeepseekV3ForCausalLM: tiny models built by transformers
with a dense layer and two MoE layers, random norms and a non-zero e_score_correction_bias, read by `load_model`
(hub/mapping.py's config and weights).

Logits within 1e-4 of transformers' with a query rank (q_a_proj, q_b_proj) and without (q_proj), with YaRN and
DeepSeek's mscale pair, and with rotate-half rotary units (rope_interleave false). Planted in the functions zerotrain
runs and caught: the interleaved rotary units taken as rotate-half's, rotary on the units without it, the group
limit dropped from the top-k, the bias in the weights, YaRN's softmax mscale left out. The bias update is
speed x sign(mean load - load) (a flipped sign is caught). An hf export loads in transformers as
DeepseekV3ForCausalLM with the same logits; MTP layers in a folder are set aside at import and their count kept.

The builder and checks here (hf_model, kind_folders, decoded, packed_gap, exported_to_transformers, add_mtp_layer, the
refusals) serve the tests of the families built on DeepSeek-V3's decoder too: GLM-4.5's and Mistral 4's.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_gemma import one_thread

import zerotrain
from zerotrain.hub import mapping
from zerotrain.hub.export import export_model
from zerotrain.model import deepseek, group_routing, mla
from zerotrain.model.kv_cache import KVCache

pytestmark = pytest.mark.timeout(600)

VOCAB, SEQ = 300, 40
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8, kv_lora_rank=16,
             q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=4, topk_group=2,
             num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
             max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False,
             num_nextn_predict_layers=0)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
CONFIGS = {
    "low-rank q": dict(),
    "plain q_proj": dict(q_lora_rank=None),
    "yarn": dict(rope_parameters=YARN),
    "rotate-half": dict(rope_interleave=False),
    # Kimi K2's options: one group of experts, YaRN with beta_fast = beta_slow, its base and scaling factor
    "kimi-k2": dict(n_group=1, topk_group=1, routed_scaling_factor=2.827, rope_parameters={
        **YARN, "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0}),
}
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
EXACT, CAUGHT = 1e-4, 1e-3


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def hf_model(folder, config_class=transformers.DeepseekV3Config, sizes=SIZES, **changes):
    """A tiny random DeepSeek-V3 (or another family of `config_class`: Mistral 4's, GLM-4.5's) saved by transformers
    in `folder`, its norms, biases and routing bias (where the family has them) moved off their starts (the routing
    bias large enough to change which experts are chosen); the model in eval mode, eager attention."""
    torch.manual_seed(0)
    config = config_class(**{**sizes, **changes})
    model_class = getattr(transformers, mapping.MAPPINGS[config.model_type].hf_class)
    model = model_class._from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.2)
    model.save_pretrained(str(folder))
    return model.eval()


def kind_folders(root, build, configs: dict) -> dict:
    """{kind: (its folder under `root`, the transformers model `build(folder, **changes)` saved there)} of each
    kind of `configs`, built on one thread."""
    folders = {}
    with one_thread():
        for kind, changes in configs.items():
            folder = root / kind.replace(" ", "_").replace(",", "")
            folders[kind] = (folder, build(folder, **changes))
    return folders


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return kind_folders(tmp_path_factory.mktemp("deepseek"), hf_model, CONFIGS)


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
        return out if isinstance(out, torch.Tensor) else out.logits


def decoded(model, prompt: int) -> torch.Tensor:
    """IDS's logits as `sample` computes them: the first `prompt` tokens in one forward, then one token a forward
    through the cache."""
    cache = KVCache(model.cfg, IDS.shape[0])
    with torch.no_grad():
        steps = [model(IDS[:, :prompt], cache)] + [model(IDS[:, t : t + 1], cache) for t in range(prompt, SEQ)]
    return torch.cat(steps, dim=1)


def packed_gap(model) -> torch.Tensor:
    """IDS's rows as two records (15 tokens, then the rest, positions restarting): the largest gap between their
    packed logits and each record's alone."""
    segments = torch.cat([torch.zeros(15, dtype=torch.long), torch.ones(SEQ - 15, dtype=torch.long)]).expand(2, SEQ)
    with torch.no_grad():
        packed = model(IDS, segments=segments.contiguous())
        alone = torch.cat([model(IDS[:, :15]), model(IDS[:, 15:])], dim=1)
    return (packed - alone).abs().max()


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_load_model_computes_the_logits_transformers_does(folders, kind):
    folder, hf = folders[kind]
    model = zerotrain.load_model(str(folder))
    cfg = model.cfg
    assert (cfg.arch, cfg.first_dense_layers, cfg.n_experts, cfg.expert_groups, cfg.head_dim) == \
        ("deepseek_v3", 1, 8, 1 if kind == "kimi-k2" else 4, 24)
    assert [cfg.has_experts(layer) for layer in range(3)] == [False, True, True]
    biases = [b for n, b in model.named_parameters() if n.endswith("e_score_correction_bias")]
    assert len(biases) == 2 and all(b.abs().min() > 0 for b in biases)
    gap = (logits(model) - logits(hf)).abs().max()
    assert gap < EXACT, gap


def rotary_on_the_wrong_units(x, cos, sin, interleaved):
    """Planted: rotary on the query's and key's first units, not the rotary ones (the shapes stay)."""
    return mla.apply_rotary(x.flip(-1), cos, sin).flip(-1)


def no_group_limit(choice, n_group, topk_group, top_k):
    return choice.topk(top_k, dim=-1, sorted=False)[1]


PLANTED = {
    "interleaved units taken as rotate-half's": ("low-rank q", lambda mp: mp.setattr(mla, "deinterleave",
                                                                                      lambda x: x)),
    "rotary on the wrong units": ("low-rank q", lambda mp: mp.setattr(mla, "rotate_units",
                                                                      rotary_on_the_wrong_units)),
    "group top-k without the group limit": ("low-rank q", lambda mp: mp.setattr(group_routing, "group_limited_top_k",
                                                                                no_group_limit)),
    "yarn's softmax mscale left out": ("yarn", lambda mp: mp.setattr(mla, "softmax_scale",
                                                                     lambda cfg: cfg.head_dim ** -0.5)),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_changes_the_logits(folders, monkeypatch, bug):
    kind, plant = PLANTED[bug]
    folder, hf = folders[kind]
    plant(monkeypatch)
    assert (logits(zerotrain.load_model(str(folder))) - logits(hf)).abs().max() > CAUGHT


def test_decoding_through_the_cache_equals_the_full_forward(folders, monkeypatch):
    """The prompt in one forward, then one token per forward (what `sample` does): the logits of the whole row, the
    values (narrower than the keys) padded in the cache; a query rotated at the wrong position is caught."""
    model = zerotrain.load_model(str(folders["yarn"][0]))
    full = logits(model)
    assert (decoded(model, 30) - full).abs().max() < EXACT
    monkeypatch.setattr(deepseek, "new_positions", lambda idx, cache, seq_len, segments=None: torch.arange(
        idx.shape[1]))  # planted: every forward's positions from 0
    assert (decoded(model, 30) - full).abs().max() > CAUGHT


def test_packed_records_equal_each_record_alone_and_a_missing_mask_is_caught(folders, monkeypatch):
    """Two records in a row (positions restarting, the records' mask): each one's logits as alone, within 1e-5; the
    layers given the plain causal mask (the second record reading the first) are caught."""
    model = zerotrain.load_model(str(folders["low-rank q"][0]))
    assert packed_gap(model) < 1e-5
    monkeypatch.setattr(deepseek, "layer_mask", lambda *args: None)
    assert packed_gap(model) > CAUGHT


def test_the_group_limit_keeps_each_tokens_experts_within_its_best_groups():
    """Two groups of four: the best single expert's group loses to the group whose two best sum higher."""
    choice = torch.tensor([[0.9, 0.0, 0.0, 0.0, 0.6, 0.5, 0.1, 0.1]])
    chosen = group_routing.group_limited_top_k(choice, n_group=2, topk_group=1, top_k=2)
    assert sorted(chosen[0].tolist()) == [4, 5]


def test_the_routing_bias_moves_against_the_load_and_a_flipped_sign_is_caught(monkeypatch):
    """speed x sign(mean load - load): the overloaded expert's bias falls, the underloaded one's rises, an expert
    at the mean stays; the rule flipped (bias following the load) is caught by the same assertion."""
    loads = torch.tensor([[6.0, 2.0, 4.0, 4.0]])

    def check():
        assert torch.equal(group_routing.bias_update(loads, 0.001), torch.tensor([[-0.001, 0.001, 0.0, 0.0]]))

    check()
    monkeypatch.setattr(group_routing, "bias_update", lambda loads, speed: speed * torch.sign(
        loads - loads.mean(dim=-1, keepdim=True)))
    with pytest.raises(AssertionError):
        check()


def exported_to_transformers(folder, out, hf_class: str, loader=transformers.AutoModelForCausalLM):
    """`folder`'s model, every parameter moved (a trained model's stand-in), exported with --format hf to `out` and
    loaded by transformers' `loader` (its Auto class, which has no Mistral 4): (ours, theirs), theirs checked to be
    `hf_class` computing our logits within EXACT, with a config.json that reads back as our model."""
    model = zerotrain.load_model(str(folder))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    export_model(model, str(out), "hf", tokenizer_folder=None, eot_id=None)
    theirs = loader.from_pretrained(str(out), attn_implementation="eager")
    assert type(theirs).__name__ == hf_class
    assert (logits(theirs.eval()) - logits(model)).abs().max() < EXACT
    assert mapping.model_config_from_hf(theirs.config.to_dict(), "export") == model.cfg
    return model, theirs


def test_an_hf_export_loads_in_transformers_as_deepseek_v3_with_the_same_logits(folders, tmp_path):
    model, theirs = exported_to_transformers(folders["yarn"][0], tmp_path / "out", "DeepseekV3ForCausalLM")
    bias = dict(theirs.named_buffers())["model.layers.1.mlp.gate.e_score_correction_bias"]  # moved too
    assert torch.equal(bias, model.model.layers[1].mlp.gate.e_score_correction_bias.detach())


def add_mtp_layer(folder) -> dict:
    """One MTP layer added to a tiny model's folder of 3 layers, hidden 64 (model.layers.3...: a block as layer 2's,
    and eh_proj, enorm; config.json's num_nextn_predict_layers 1); its MTP tensors."""
    tensors = load_file(str(folder / "model.safetensors"))
    mtp = {n.replace("model.layers.2.", "model.layers.3."): torch.randn_like(t) for n, t in tensors.items()
           if n.startswith("model.layers.2.")}
    mtp.update({"model.layers.3.eh_proj.weight": torch.randn(64, 128), "model.layers.3.enorm.weight": torch.rand(64)})
    save_file({**tensors, **mtp}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return mtp


def test_mtp_layers_are_kept_frozen_through_import_training_and_export(tmp_path, capsys):
    """Import sets them aside (the decoder's logits are transformers', which skips them too) and counts them; a
    run's checkpoint exported with --format hf holds them bitwise as the --init-from folder has them, its config
    counts them, and transformers loads it; a folder that counts them without holding them fails the export in one line
(exit 1, as every unreadable model folder), nothing written."""
    from zerotrain.cli.main import main

    hf_model(tmp_path / "model")
    mtp = add_mtp_layer(tmp_path / "model")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"),
                                                           attn_implementation="eager").eval()
    model = zerotrain.load_model(str(tmp_path / "model"))
    assert model.cfg.mtp_layers == 1 and not any(n.startswith("model.layers.3.") for n, _ in model.named_parameters())
    assert (logits(model) - logits(hf)).abs().max() < EXACT
    assert main(["train", "--init-from", str(tmp_path / "model"), "--data", "synthetic", "--steps", "2",
                 "--seq-len", "32", "--micro-batch", "2", "--lr", "1e-3", "--no-progress", "--threads", "1",
                 "--out", str(tmp_path / "run")]) == 0
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--format", "hf"]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(exported[n], t) for n, t in mtp.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    trained = zerotrain.load_model(str(tmp_path / "run"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager")
    assert (logits(theirs.eval()) - logits(trained)).abs().max() < EXACT
    assert (logits(trained) - logits(hf)).abs().max() > CAUGHT  # it trained
    save_file({n: t for n, t in load_file(str(tmp_path / "model" / "model.safetensors")).items()
               if not n.startswith("model.layers.3.")}, str(tmp_path / "model" / "model.safetensors"))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "again"), "--format", "hf"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "counts 1 multi-token-prediction layers" in err[0] and "model.layers.3.*" in err[0], err
    assert not (tmp_path / "again").exists()


# What zerotrain does not have for DeepSeek-V3 yet, and a TP degree that splits a head: refused in one line, exit 2.

@pytest.mark.parametrize("flags, said", [
    (["--nproc", "8", "--tp", "8"], "--tp 8 does not divide --n-head 4: each TP rank keeps whole attention heads"),
    (["--method", "dpo"], "--routing-bias-speed 0.001 with --method dpo: the bias moves with the expert loads of "
                          "--method sft's steps only in zerotrain yet: give --routing-bias-speed 0"),
])
def test_what_zerotrain_does_not_have_for_deepseek_is_refused_in_one_line(folders, flags, said, capsys):
    assert_refused_in_one_line(capsys, ["train", "--init-from", str(folders["low-rank q"][0]), "--data", "synthetic",
                                        *flags], said)


def assert_refused_in_one_line(capsys, args: list[str], said: str):
    """`zerotrain ARGS` exits 2 with `said` as its one line of error."""
    from zerotrain.cli.main import main

    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"zerotrain: error: {said}"]


@pytest.mark.parametrize("field, value, said", [
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("num_key_value_heads", 2, "latent attention gives every head its keys"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}, "rope_type 'llama3'"),
    ("first_k_dense_replace", -1, "first_k_dense_replace must be a whole number"),
])
def test_a_config_zerotrain_does_not_compute_is_refused_naming_the_field(field, value, said):
    assert_config_refused(transformers.DeepseekV3Config(**SIZES), field, value, said)


def assert_config_refused(config, field: str, value, said: str):
    """transformers' `config` with `field` set to `value` is refused by hub/mapping.py, naming it as `said` does."""
    changed = {**config.to_dict(), field: value}
    with pytest.raises(zerotrain.errors.CheckpointError, match=said.replace("(", r"\(").replace("[", r"\[")):
        mapping.model_config_from_hf(changed, "config.json")
