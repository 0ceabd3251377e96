"""Gemma 2 and Gemma 3 against transformers' eager attention, exact: tiny models built by transformers (vocabulary
1,000, sequences longer than the sliding window, sliding and global layers both present, Gemma 2's soft-caps on,
Gemma 3's local rotary base and linear-scaled global one), read by `load_model` and --init-from.

Logits within 1e-5 of transformers' (Gemma 3's multimodal folder too, for its language model), and each planted bug,
in the code path zerotrain runs, caught by the same comparison: the final or the attention soft-cap missing, a plain
w norm for (1 + w), the embedding unscaled, the global rotary base on the local layers, the window ignored. Packed
records equal each record alone (the window inside each record), on the mask path CPU runs and on FlexAttention's
(CUDA's, with its soft-cap score_mod). Three steps of --init-from at TP 1 (in this process) and at TP 2 (one start of
2 ranks for both models) give the same losses, and the TP 1 run's export is loaded by transformers with the same
logits. The activation bytes of Gemma's norms, soft-capped scores and logits are counted to the byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re

import pytest
import torch
import transformers
from conftest import world_of_one
from dist_jobs import in_turn_job
from test_activation_bytes import measured_bytes, packed_segments, predicted_bytes
from torch.nn.attention.flex_attention import flex_attention

import zerotrain
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.config import PRESETS, ModelConfig
from zerotrain.errors import CheckpointError
from zerotrain.hub import mapping
from zerotrain.hub.export import export_model
from zerotrain.model import attention, build_model, gemma, vocab
from zerotrain.model import llama as llama_module
from zerotrain.model.kv_cache import KVCache
from zerotrain.runtime.launch import run_job
from zerotrain.runtime.run_folder import resolve_paths

pytestmark = pytest.mark.timeout(300)

VOCAB, SEQ, WINDOW = 1000, 24, 6
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, rms_norm_eps=1e-6, sliding_window=WINDOW,
             query_pre_attn_scalar=24, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {  # what sets each apart made to matter: caps the logits reach, a local base far from the global one
    "gemma2": lambda: transformers.Gemma2Config(**SIZES, final_logit_softcapping=2.0, attn_logit_softcapping=1.0,
                                                rope_theta=500.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(**SIZES, sliding_window_pattern=2, rope_theta=10000.0,
                                                    rope_local_base_freq=20.0,
                                                    rope_scaling={"rope_type": "linear", "factor": 4.0}),
}
HF_CLASSES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
EXACT, CAUGHT = 1e-5, 1e-3
LIMIT = 180  # seconds: a deadlocked job fails the test instead of hanging CI


@contextlib.contextmanager
def one_thread():
    """torch on one thread: the tiny models' ops gain nothing from a second, and on busy cores each op's hand-off
    between threads costs more than the op (a 64-wide linear: 3 ms on 2 threads, 0.05 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _one_thread():
    """Per test, not per module: an autouse fixture of module scope would put every test of this file in one
    xdist group (conftest's pytest_itemcollected)."""
    with one_thread():
        yield


def hf_model(folder, family: str):
    """A tiny random `family` model saved by transformers in `folder`; the model in eval mode, eager attention."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation="eager")
    with torch.no_grad():  # the norms' weights start at 0 (a gain of 1): moved, so that (1 + w) differs from w
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(folder))
    return model.eval()


def multimodal_folder(folder, text):
    """A Gemma 3 with a (tiny) vision tower whose language model is `text`'s weights: model_type gemma3."""
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=16, patch_size=8)
    config = transformers.Gemma3Config(text_config=CONFIGS["gemma3"]().to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                                       eoi_token_index=VOCAB - 2)
    model = transformers.Gemma3ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.config._attn_implementation = "eager"
    model.save_pretrained(str(folder))
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: (folder, the transformers model saved there)}: gemma2, gemma3 and gemma3's multimodal folder."""
    root = tmp_path_factory.mktemp("gemma")
    with one_thread():
        out = {family: (root / family, hf_model(root / family, family)) for family in CONFIGS}
        out["gemma3 multimodal"] = (root / "mm", multimodal_folder(root / "mm", out["gemma3"][1]))
    return out


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
        return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gemma3 multimodal"])
def test_load_model_computes_the_logits_transformers_eager_attention_does(folders, name):
    folder, hf = folders[name]
    model = zerotrain.load_model(str(folder))
    theirs = logits(hf)
    assert (logits(model) - theirs).abs().max() < EXACT
    cfg = model.cfg  # read from its config.json: sliding and global layers alternate, the window shorter than SEQ
    assert [cfg.sliding(layer) for layer in range(4)] == [True, False, True, False] and cfg.sliding_window < SEQ
    assert (cfg.arch, cfg.attn_softcap, cfg.final_softcap, cfg.rope_local_theta, cfg.rope_scaling) == {
        "gemma2": ("gemma2", 1.0, 2.0, 0.0, "none"), "gemma3": ("gemma3", 0.0, 0.0, 20.0, "linear"),
        "gemma3 multimodal": ("gemma3", 0.0, 0.0, 20.0, "linear")}[name]
    if name == "gemma2":  # the caps bind: the logits reach near the final cap
        assert theirs.abs().max() > 0.9 * cfg.final_softcap


def plain_gain(x, weight, eps):
    """Planted: Llama's gain w where Gemma's is 1 + w."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def uncapped_scores(mp):
    real = attention.softcapped_attention
    mp.setattr(attention, "softcapped_attention", lambda q, k, v, mask, scale, cap: real(q, k, v, mask, scale, 0.0))


PLANTED = {  # (family, the bug planted in zerotrain's own function)
    "final soft-cap missing": ("gemma2", lambda mp: mp.setattr(vocab, "capped", lambda logits, softcap: logits)),
    "attention soft-cap missing": ("gemma2", uncapped_scores),
    "gemma2 plain w norm": ("gemma2", lambda mp: mp.setattr(gemma, "rms_norm_plus_one", plain_gain)),
    "gemma3 plain w norm": ("gemma3", lambda mp: mp.setattr(gemma, "rms_norm_plus_one", plain_gain)),
    "gemma2 embedding unscaled": ("gemma2", lambda mp: mp.setattr(llama_module, "embedding_scale", lambda *a: 1.0)),
    "gemma3 embedding unscaled": ("gemma3", lambda mp: mp.setattr(llama_module, "embedding_scale", lambda *a: 1.0)),
    "global rope base on local layers": ("gemma3", lambda mp: mp.setattr(
        llama_module, "rope_local", lambda cfg: (cfg.rope_theta, llama_module.rope_scaling(cfg)))),
    "window ignored": ("gemma3", lambda mp: mp.setattr(llama_module, "window_attention", lambda *a: None)),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_changes_the_logits(folders, monkeypatch, bug):
    family, plant = PLANTED[bug]
    folder, hf = folders[family]
    plant(monkeypatch)
    assert (logits(zerotrain.load_model(str(folder))) - logits(hf)).abs().max() > CAUGHT


def first_block_input(model, ids) -> torch.Tensor:
    seen = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        model(ids)
    handle.remove()
    return seen[0]


def test_the_embedding_scale_is_rounded_to_the_weights_dtype_as_transformers_casts_it(monkeypatch):
    """sqrt(1152) = 33.94 is 34.0 in bf16 (Gemma 3 1B's width): the scaled embedding equals transformers' bitwise."""
    cfg = dataclasses.replace(GEMMA["gemma3"], n_embd=1152, n_head=4, head_width=8, vocab_size=VOCAB, seq_len=SEQ)
    model = build_model(cfg, seed=0).to(torch.bfloat16)
    theirs = transformers.models.gemma3.modeling_gemma3.Gemma3TextScaledWordEmbedding(VOCAB, 1152, 0, 1152**0.5)
    theirs.weight.data.copy_(model.model.embed_tokens.weight.float())
    with torch.no_grad():
        expected = theirs.to(torch.bfloat16)(IDS)
    assert gemma.embedding_scale(1152, torch.bfloat16) == 34.0
    assert torch.equal(first_block_input(model, IDS), expected)
    monkeypatch.setattr(llama_module, "embedding_scale", lambda width, dtype: width**0.5)  # planted: not rounded
    assert not torch.equal(first_block_input(model, IDS), expected)


# Packed records: the window inside each record, on the mask path and FlexAttention's.

RECORDS = (10, 14)  # tokens of two records packed in one row of SEQ: each longer than the window


def packed_vs_alone(model, hf) -> float:
    """max |zerotrain's logits of the packed row - transformers' of each record alone|."""
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(RECORDS)]).expand(2, SEQ).contiguous()
    with torch.no_grad():
        packed = model(IDS, segments=segments)
    alone = torch.cat([logits(hf, IDS[:, a:b]) for a, b in ((0, RECORDS[0]), (RECORDS[0], SEQ))], dim=1)
    return (packed - alone).abs().max().item()


def as_flex(mp):
    """CUDA's kernel choice, FlexAttention (uncompiled: its reference implementation, which CPU has)."""
    mp.setattr(attention, "document_kernel", lambda device_type, head_dim: "flex")
    mp.setattr(attention, "compiled_flex_attention", lambda: flex_attention)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_packed_records_equal_each_record_alone_and_a_mask_without_the_window_is_caught(folders, monkeypatch, family):
    folder, hf = folders[family]
    model = zerotrain.load_model(str(folder))
    assert packed_vs_alone(model, hf) < EXACT
    real = attention.document_mask  # planted: the records' mask without the window
    monkeypatch.setattr(attention, "document_mask", lambda segments, dtype, window=0: real(segments, dtype))
    assert packed_vs_alone(model, hf) > CAUGHT


def test_flex_attention_caps_the_scores_in_its_score_mod_within_the_windows_and_without_it_is_caught(folders,
                                                                                                     monkeypatch):
    """CUDA's kernel for Gemma 2: FlexAttention with the soft-cap as its score_mod, over the global layers' causal
    block mask and the sliding layers' window, packed or not (a block mask without the window: test_families)."""
    folder, hf = folders["gemma2"]
    model = zerotrain.load_model(str(folder))
    as_flex(monkeypatch)
    assert (logits(model) - logits(hf)).abs().max() < EXACT
    assert packed_vs_alone(model, hf) < EXACT
    monkeypatch.setattr(attention, "tanh_score_mod", lambda cap: None)  # planted: the scores uncapped
    assert (logits(model) - logits(hf)).abs().max() > CAUGHT


def cached_logits(model, prompt: int = 3) -> torch.Tensor:
    """Logits of IDS through the KV cache: the prompt in one forward, then one token per forward, as sample does."""
    cache = KVCache(model.cfg, IDS.shape[0])
    with torch.no_grad():
        steps = [model(IDS[:, :prompt], cache)] + [model(IDS[:, t : t + 1], cache) for t in range(prompt, SEQ)]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_decoding_through_the_kv_cache_keeps_each_layers_window_and_caps(folders, monkeypatch, family):
    folder, hf = folders[family]
    model = zerotrain.load_model(str(folder))
    assert (cached_logits(model) - logits(hf)).abs().max() < EXACT
    real = attention._causal_mask  # planted: the cache's mask without the sliding layers' window
    monkeypatch.setattr(attention, "_causal_mask", lambda past, T, device, window=0: real(past, T, device))
    assert (cached_logits(model) - logits(hf)).abs().max() > CAUGHT


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gemma3 without a local base"])
def test_a_model_from_scratch_starts_as_transformers_initialises_gemma_norms_at_zero(family, tmp_path):
    """Gemma's gain is 1 + w: its norms' weights start at 0 (transformers' _init_weights), and the export of a model
    from the seed computes its logits in transformers (a Gemma 3's sliding layers unscaled at --rope-theta where it
    has no --rope-local-theta)."""
    cfg = dataclasses.replace(GEMMA[family.split()[0]], vocab_size=VOCAB)
    if family.endswith("local base"):
        cfg = dataclasses.replace(cfg, rope_local_theta=0.0)
    model = build_model(cfg, seed=0).eval()
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 4 * cfg.n_layer + 1 + (2 * cfg.n_layer if cfg.qk_norm else 0)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in norms)
    export_model(model, str(tmp_path / "hf"), "hf", tokenizer_folder=None, eot_id=None)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    ids = IDS[:, :16]
    assert (logits(loaded.eval(), ids) - logits(model, ids)).abs().max() < EXACT


# Training: 3 steps of --init-from at TP 1 (here) and TP 2 (one start of 2 ranks), the TP 1 run exported.

def config_for(folder, out, *flags):
    args = build_parser().parse_args(["train", "--init-from", str(folder), "--data", "synthetic", "--no-progress",
                                      "--seq-len", str(SEQ), "--steps", "3", "--micro-batch", "2", "--lr", "1e-3",
                                      "--ckpt-every", "3", "--seed", "1", "--out", str(out), *flags])
    return resolve_paths(config_from_args(args))


@pytest.fixture(scope="module")
def runs(folders, tmp_path_factory):
    """{family: (TP 1 losses, TP 2 losses, the TP 1 run's folder)}; "gemma2 zero3": DP 2 ZeRO-3's losses (Gemma 2 over
    2 DP ranks, a micro-batch of 1 each: the same global batch). The 2-rank runs share one start of the ranks (from
    dist_jobs, which imports little: a rank importing this file, transformers with it, took 4 s)."""
    from zerotrain.training.loop import train, train_job

    tmp = tmp_path_factory.mktemp("gemma-runs")
    two = {family: config_for(folders[family][0], tmp / f"{family}-tp2", "--nproc", "2", "--tp", "2")
           for family in CONFIGS}
    two["gemma2 zero3"] = config_for(folders["gemma2"][0], tmp / "gemma2-zero3", "--nproc", "2", "--zero", "3",
                                     "--micro-batch", "1")
    reports = run_job(functools.partial(in_turn_job, jobs=[(train_job, cfg) for cfg in two.values()]),
                      two["gemma2"], time_limit=LIMIT)
    results = {name: [r["loss"] for r in report["records"]] for name, report in zip(two, reports)}
    out = {}
    with one_thread(), world_of_one() as comm:
        for family in CONFIGS:
            cfg = config_for(folders[family][0], tmp / f"{family}-tp1")
            out[family] = ([r["loss"] for r in train(cfg, comm, announce=False).records], results[family],
                           tmp / f"{family}-tp1")
    out["gemma2 zero3"] = results["gemma2 zero3"]
    return out


@pytest.mark.parametrize("family", list(CONFIGS))
def test_tp2_trains_the_losses_tp1_does(runs, family):
    tp1, tp2, _ = runs[family]
    assert len(tp1) == 3 and all(abs(a - b) <= 1e-5 * b for a, b in zip(tp1, tp2)), (tp1, tp2)
    assert tp1[0] != tp1[-1]  # it trained


def test_zero3_over_two_ranks_trains_the_losses_one_rank_does(runs):
    tp1, zero3 = runs["gemma2"][0], runs["gemma2 zero3"]
    assert len(zero3) == 3 and all(abs(a - b) <= 1e-5 * b for a, b in zip(tp1, zero3)), (tp1, zero3)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_trained_export_is_loaded_by_transformers_with_the_same_logits(folders, runs, tmp_path, family):
    trained = zerotrain.load_model(str(runs[family][2]))
    ours = logits(trained)
    assert (ours - logits(folders[family][1])).abs().max() > CAUGHT  # it moved from where it started
    out = tmp_path / "hf"
    export_model(trained, str(out), "hf", tokenizer_folder=None, eot_id=None)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(loaded).__name__ == HF_CLASSES[family]
    assert (logits(loaded) - ours).abs().max() < EXACT
    config = json.loads((out / "config.json").read_text())  # config.json both ways
    assert mapping.model_config_from_hf(config, "config.json") == trained.cfg


def test_lora_on_gemma3_is_planned_to_the_byte_and_exports_to_peft_with_the_same_logits(folders, tmp_path):
    import peft

    from zerotrain.cli.main import main
    from zerotrain.training.loop import train

    folder, base = folders["gemma3"]
    with world_of_one() as comm:
        result = train(config_for(folder, tmp_path / "run", "--lora-rank", "4", "--lora-alpha", "8"), comm,
                       announce=False)
    assert result.plan["activations_measured"] == result.plan["rows"]["activations"]  # Gemma's frozen norms
    step = str(tmp_path / "run" / "checkpoints" / "step_00000003")
    assert main(["export", step, str(tmp_path / "adapter"), "--format", "peft"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager")
    theirs = logits(peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval())
    ours = logits(zerotrain.load_model(step))
    assert (ours - theirs).abs().max() < EXACT and (ours - logits(base)).abs().max() > CAUGHT  # the adapters count


# config.json: what zerotrain does not implement is refused, naming it.

@pytest.mark.parametrize("field, value, said", [
    ("layer_types", ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
     "do not alternate"),
    ("hidden_activation", "gelu", "hidden_activation = 'gelu'"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention = True"),
])
def test_what_zerotrain_does_not_implement_is_refused_naming_it(field, value, said):
    config = CONFIGS["gemma3"]().to_dict()
    config[field] = value
    with pytest.raises(CheckpointError, match="^config.json: .*" + re.escape(said)):
        mapping.model_config_from_hf(config, "config.json")


@pytest.mark.parametrize("flags, said", [
    (["--arch", "gemma3", "--attn-softcap", "50"], "--attn-softcap is for --arch gemma2, not --arch gemma3"),
    (["--arch", "gemma2", "--rope-local-theta", "1e4"], "--rope-local-theta is for --arch gemma3 or gemma4, not "
                                                           "--arch gemma2"),
    (["--sliding-window-pattern", "2"],
     "--sliding-window-pattern is for --arch gemma2 or gemma3 or gpt_oss or gemma4, not --arch llama"),
    (["--rope-scaling", "linear"], "--rope-scaling linear is for --arch gemma2 or gemma3, not --arch llama"),
])
def test_gemmas_settings_elsewhere_are_refused_in_one_line(flags, said, capsys):
    from zerotrain.cli.main import main

    assert main(["train", "--preset", "llama-tiny", "--data", "synthetic", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"zerotrain: error: {said}"]


def test_a_published_gemma3_config_is_read_with_transformers_defaults_for_what_it_leaves_out():
    """google/gemma-3-4b-it's config.json, as published: most of its text_config is left to the defaults."""
    published = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                 "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                 "sliding_window": 1024},
                 "vision_config": {"model_type": "siglip_vision_model"}}
    cfg = mapping.model_config_from_hf(published, "config.json")
    theirs = transformers.Gemma3Config(**published).text_config
    assert (cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.vocab_size, cfg.sliding_window_pattern) == (
        theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim, theirs.vocab_size, 6)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling, cfg.rope_factor) == (1e6, 1e4, "linear", 8.0)
    assert [cfg.sliding(i) for i in range(34)] == [t == "sliding_attention" for t in theirs.layer_types]


# The memory plan: Gemma's norms, soft-capped scores and logits, to the byte.

TINY = ModelConfig(**PRESETS["llama-tiny"])
GEMMA = {"gemma2": dataclasses.replace(TINY, arch="gemma2", sliding_window=5, sliding_window_pattern=2,
                                       attn_softcap=20.0, final_softcap=30.0, query_pre_attn_scalar=16),
         "gemma3": dataclasses.replace(TINY, arch="gemma3", sliding_window=5, sliding_window_pattern=2,
                                       rope_local_theta=100.0, rope_scaling="linear", query_pre_attn_scalar=16)}
OMITTED = {"gemma2": ("softcapped_attention", "gemma_norm"),
           "gemma3": ("gemma_qk_norms", "gemma_norm")}


@pytest.mark.parametrize("recompute", ["none", "blocks"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", list(GEMMA))
def test_gemmas_activation_bytes_are_counted_to_the_byte_and_an_omission_is_caught(family, precision, recompute):
    cfg = GEMMA[family]
    for segments in (None, packed_segments(2, 16)):
        measured = measured_bytes(build_model(cfg, seed=0), 2, 16, precision, recompute, segments)
        kw = dict(precision=precision, recompute=recompute, documents=segments is not None)
        assert predicted_bytes(cfg, 2, 16, **kw) == measured
        for piece in OMITTED[family] if recompute == "none" else ("document_mask",):
            assert predicted_bytes(cfg, 2, 16, piece, **kw) < measured, piece
    # Gemma 3's two rotary bases: a second pair of tables (fp32)
    if family == "gemma3" and precision == "fp32" and recompute == "none":
        with pytest.MonkeyPatch.context() as m:
            m.setattr("zerotrain.model.activation_memory.rotary_bases", lambda cfg, windows: 1)
            assert predicted_bytes(cfg, 2, 16, **kw) < measured
