"""The Llama family's members against transformers: Llama 3.1's rope scaling, Qwen2, Qwen3, Mistral, Phi-3; exact.

Every model is a tiny random transformers model built locally (model_folders.family_folder: fp32, what sets each
member apart made to matter), read through --init-from's path. For each: logits within 1e-4 and the first loss
within 1e-5 relative at TP 1 (in this process) and TP 2 (one start of 2 ranks for all of them), and the export
round trip (transformers loads it as the same family and computes the same logits). A planted bug per member,
in the code path zerotrain runs, is caught by the same comparison: the q/k/v biases dropped, the q/k norms skipped,
the rope scaling ignored, the window not applied, Phi-3's fused rows misread. Mistral's window is checked shorter
than the sequence in packed records, on FlexAttention's path and through the KV cache `sample` decodes with;
Qwen3's splits over ranks and micro-batches, and its TP 2 checkpoint resumed at TP 1.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import transformers  # a [test] dependency: missing, the module fails to import, loudly
from conftest import zerotrain_here
from model_folders import LLAMA3_ROPE, WINDOW, family_config, family_folder
from test_activation_bytes import measured_bytes, packed_segments, predicted_bytes
from test_checkpoint import spawn
from test_user_errors import one_line_error
from torch.nn.attention.flex_attention import flex_attention

import zerotrain
from zerotrain.cli.commands import equivalence
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.config import PRESETS, ModelConfig
from zerotrain.errors import CheckpointError
from zerotrain.hub import init_from, mapping
from zerotrain.hub.export import export_model
from zerotrain.model import attention, build_model, param_count, summed_token_loss, tensor_parallel
from zerotrain.model import llama as llama_module
from zerotrain.model.generate import generate
from zerotrain.model.kv_cache import KVCache
from zerotrain.runtime.run_folder import resolve_paths

pytestmark = pytest.mark.timeout(300)

FAMILIES = ("llama3", "qwen2", "qwen3", "mistral", "phi3")  # llama3: a Llama with Llama 3.1's rope scaling
HF_CLASSES = {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM"}
SEQ, VOCAB = 32, 96  # model_folders.FAMILY_SIZES: every position the models hold, beyond the window and the
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))  # original rope context
EXACT, CAUGHT = 1e-4, 1e-2  # the logits bound, and what a planted bug must exceed (100x)


def config_for(folder, *flags):
    args = build_parser().parse_args(["train", "--init-from", str(folder), "--data", "synthetic", "--no-progress",
                                      "--seq-len", str(SEQ), "--out", str(folder) + "-run", *flags])
    return config_from_args(args)


def logits_and_loss(engine) -> tuple[torch.Tensor, float]:
    """The model's logits on IDS and the first loss training takes (token losses summed over the count)."""
    with torch.no_grad():
        x, y = IDS[:, :-1].contiguous(), IDS[:, 1:].contiguous()
        return engine.model(IDS), (summed_token_loss(engine.model(x), y) / y.numel()).item()


def zerotrain_logits(folder, comm, *flags):
    from zerotrain.training.loop import build_engine

    engine = build_engine(config_for(folder, *flags), comm)
    return (*logits_and_loss(engine), engine)


def hf_logits_and_loss(model) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        return model(IDS).logits, model(IDS, labels=IDS).loss.item()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (folder, the transformers model saved there)}."""
    root = tmp_path_factory.mktemp("families")
    return {family: (root / family, family_folder(root / family, family)) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_computes_the_logits_and_first_loss_transformers_does(folders, one_rank, family):
    folder, hf = folders[family]
    ours, loss, engine = zerotrain_logits(folder, one_rank)
    theirs, their_loss = hf_logits_and_loss(hf)
    assert (ours - theirs).abs().max() < EXACT
    assert abs(loss - their_loss) <= 1e-5 * their_loss
    cfg = engine.model.cfg  # what makes the family: read from its config.json
    assert (cfg.arch, cfg.rope_scaling, cfg.head_dim, cfg.sliding_window, cfg.tie_embeddings) == {
        "llama3": ("llama", "llama3", 8, 0, False), "qwen2": ("qwen2", "none", 8, 0, True),
        "qwen3": ("qwen3", "none", 12, 0, False), "mistral": ("mistral", "none", 8, WINDOW, False),
        "phi3": ("phi3", "none", 8, WINDOW, False)}[family]


def dropped_biases(mp):
    """Planted: the reading path gives zeros for q, k and v's biases."""
    read = init_from._read_rows
    mp.setattr(init_from, "_read_rows", lambda f, name, *a: torch.zeros_like(read(f, name, *a))
               if name.endswith("_proj.bias") else read(f, name, *a))


PLANTED = {  # family: the bug, planted in zerotrain's own function
    "qwen2": ("q/k/v biases dropped", dropped_biases),
    "qwen3": ("q/k norms skipped", lambda mp: mp.setattr(llama_module, "normalize_heads", lambda norm, x, comm: x)),
    "llama3": ("rope scaling ignored", lambda mp: mp.setattr(llama_module, "rope_scaling", lambda cfg: None)),
    "mistral": ("window not applied", lambda mp: mp.setattr(llama_module, "window_attention", lambda *a: None)),
    "phi3": ("gate and up read from each other's rows of gate_up_proj", lambda mp: mp.setitem(
        mapping.MAPPINGS, "phi3", dataclasses.replace(mapping.MAPPINGS["phi3"], fused=(
            mapping.PHI3_FUSED[0], ("mlp.gate_up_proj.weight", ("mlp.up_proj.weight", "mlp.gate_proj.weight")))))),
}


@pytest.mark.parametrize("family", list(PLANTED))
def test_a_planted_bug_of_each_family_changes_the_logits(folders, one_rank, monkeypatch, family):
    folder, hf = folders[family]
    PLANTED[family][1](monkeypatch)
    ours, _, _ = zerotrain_logits(folder, one_rank)
    assert (ours - hf_logits_and_loss(hf)[0]).abs().max() > CAUGHT


@pytest.mark.parametrize("family", FAMILIES)
def test_an_export_is_loaded_by_transformers_as_the_same_family_with_the_same_logits(folders, one_rank, tmp_path,
                                                                                     family):
    folder, _ = folders[family]
    ours, _, engine = zerotrain_logits(folder, one_rank)
    out = tmp_path / "hf"
    export_model(engine.model, str(out), "hf", tokenizer_folder=None, eot_id=None)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(loaded).__name__ == HF_CLASSES[family]
    assert (hf_logits_and_loss(loaded)[0] - ours).abs().max() < EXACT
    # config.json both ways: the export read back is the model that was exported, by zerotrain.load_model too
    config = json.loads((out / "config.json").read_text())
    assert mapping.model_config_from_hf(config, "config.json") == engine.model.cfg
    with torch.no_grad():
        assert torch.equal(zerotrain.load_model(str(out))(IDS), ours)


def test_llama3_rope_scaling_is_read_from_rope_scaling_and_rope_parameters_alike():
    """transformers 5 writes `rope_parameters` (the folders above); published configs and older transformers write
    `rope_scaling` with rope_theta beside it."""
    written = family_config("llama3").to_dict()
    assert written["rope_parameters"]["rope_type"] == "llama3"
    published = {**written, "rope_parameters": None, "rope_scaling": LLAMA3_ROPE, "rope_theta": 500.0}
    new, old = (mapping.model_config_from_hf(c, "config.json") for c in (written, published))
    assert new == old and (new.rope_scaling, new.rope_factor, new.rope_original_context, new.rope_theta) == (
        "llama3", 8.0, 8, 500.0)


def test_an_unknown_rope_type_is_refused_in_one_line_naming_it(folders, tmp_path, capfd):
    folder = tmp_path / "longrope"  # yarn is read (test_gpt_oss); longrope is not
    family_folder(folder, "llama")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 500.0,
                                 "original_max_position_embeddings": 8}
    (folder / "config.json").write_text(json.dumps(config))
    r = zerotrain_here(capfd, "train", "--init-from", str(folder), "--data", "synthetic", "--steps", "1",
                       "--no-progress", "--out", str(tmp_path / "run"))
    line = one_line_error(r)
    assert str(folder) in line and "rope_type 'longrope'" in line and "llama3" in line, line


@pytest.mark.parametrize("field, value, said", [
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_type 'linear'"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_type 'dynamic'"),  # the older key
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 500.0}, "rope_type 'longrope'"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "no 'low_freq_factor'"),
    ("use_sliding_window", True, "use_sliding_window = True"),  # Qwen2's window: zerotrain's qwen2 has none
])
def test_what_zerotrain_does_not_implement_is_refused_naming_it_never_ignored(field, value, said):
    config = family_config("qwen2").to_dict()
    config[field] = value
    with pytest.raises(CheckpointError, match="^config.json: .*" + re.escape(said)):
        mapping.model_config_from_hf(config, "config.json")


# Mistral's window, shorter than the sequence: packed records (the window inside each record) and the KV cache.

RECORDS = (12, 20)  # tokens of two records packed in one row of SEQ: each longer than the window


def packed_vs_alone(model, hf) -> float:
    """max |zerotrain's logits of the packed row - transformers' of each record alone|."""
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(RECORDS)]).expand(2, SEQ).contiguous()
    with torch.no_grad():
        packed = model(IDS, segments=segments)
        alone = torch.cat([hf(IDS[:, a:b]).logits for a, b in ((0, RECORDS[0]), (RECORDS[0], SEQ))], dim=1)
    return (packed - alone).abs().max().item()


def test_mistral_packed_records_attend_within_their_window_and_a_mask_without_it_is_caught(folders, monkeypatch):
    folder, hf = folders["mistral"]
    model = init_from_model(folder)
    assert packed_vs_alone(model, hf) < EXACT
    real = attention.document_mask
    monkeypatch.setattr(attention, "document_mask", lambda segments, dtype, window=0: real(segments, dtype))
    assert packed_vs_alone(model, hf) > CAUGHT


def flex_vs_mask(model) -> float:
    """max |logits through FlexAttention's block masks (CUDA's kernel choice) - through SDPA's masks|, unpacked and
    packed rows alike. FlexAttention runs uncompiled here: its reference implementation, which CPU has."""
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(RECORDS)]).expand(2, SEQ).contiguous()
    with torch.no_grad():
        masked = [model(IDS), model(IDS, segments=segments)]
        with pytest.MonkeyPatch.context() as m:
            m.setattr(attention, "document_kernel", lambda device_type, head_dim: "flex")
            m.setattr(attention, "compiled_flex_attention", lambda: flex_attention)
            flex = [model(IDS), model(IDS, segments=segments)]
    return max((a - b).abs().max().item() for a, b in zip(masked, flex))


def test_the_flex_attention_masks_cuda_takes_hold_the_window_and_block_masks_without_it_are_caught(folders,
                                                                                                   monkeypatch):
    model = init_from_model(folders["mistral"][0])
    assert flex_vs_mask(model) < EXACT
    # planted, each alone: the window left out of a block mask (a window as long as the row is no window)
    windowless = {"window_block_mask": lambda real: lambda T, window, device: real(T, T, device),
                  "document_block_mask": lambda real: lambda segments, window=0: real(segments)}
    for name, plant in windowless.items():
        with monkeypatch.context() as m:
            m.setattr(attention, name, plant(getattr(attention, name)))
            assert flex_vs_mask(model) > CAUGHT


def init_from_model(folder):
    """The folder's model as --init-from reads it, on one process."""
    source = init_from.weight_source(str(folder))
    model = build_model(source.model, 0)
    init_from.load_local(model, source, {}, 0)
    return model.eval()


def cached_logits(model, prompt: int = 3) -> torch.Tensor:
    """Logits of IDS through the KV cache: the prompt in one forward, then one token per forward, as sample does."""
    cache = KVCache(model.cfg, IDS.shape[0])
    with torch.no_grad():
        steps = [model(IDS[:, :prompt], cache)] + [model(IDS[:, t : t + 1], cache) for t in range(prompt, SEQ)]
    return torch.cat(steps, dim=1)


def test_mistral_decodes_through_the_kv_cache_within_its_window_and_a_cache_without_it_is_caught(folders,
                                                                                                 monkeypatch):
    folder, hf = folders["mistral"]
    model = init_from_model(folder)
    theirs = hf_logits_and_loss(hf)[0]
    assert (cached_logits(model) - theirs).abs().max() < EXACT
    # greedy decoding: with the cache, without it, and transformers' generate (its sliding-window cache)
    prompt = IDS[:1, :3]
    ours = generate(model, prompt, SEQ - 3, temperature=0.0)
    assert torch.equal(ours, generate(model, prompt, SEQ - 3, temperature=0.0, kv_cache=False))
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    with torch.no_grad():
        assert torch.equal(ours, hf.generate(prompt, max_new_tokens=SEQ - 3, do_sample=False)[:, 3:])
    real = attention._causal_mask
    monkeypatch.setattr(attention, "_causal_mask", lambda past, T, device, window=0: real(past, T, device))
    assert (cached_logits(model) - theirs).abs().max() > CAUGHT


# plan: parameter counts and activation bytes of the new pieces, exact.

@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b", "mistral-7b", "phi-3-mini-4k",
                                    "gemma-2-2b", "gemma-3-1b", "qwen3-moe-tiny", "qwen3-30b-a3b"])
def test_each_presets_parameters_are_those_of_transformers_model_from_the_config_zerotrain_exports(preset):
    cfg = ModelConfig(**PRESETS[preset])
    config = mapping.hf_config(cfg, None)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    assert type(theirs).__name__ == config["architectures"][0]
    assert param_count(cfg) == sum(p.numel() for p in theirs.parameters())  # a tied head counted once


TINY = ModelConfig(**PRESETS["llama-tiny"])
NEW_PIECES = {"qwen3": (dataclasses.replace(TINY, arch="qwen3", head_width=12), "qk_norms"),
              "mistral": (dataclasses.replace(TINY, arch="mistral", sliding_window=5), "document_mask")}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("member", list(NEW_PIECES))
def test_the_activation_bytes_of_q_k_norms_and_the_window_mask_are_counted_to_the_byte(member, precision):
    cfg, piece = NEW_PIECES[member]
    for segments in (None, packed_segments(2, 16)):
        measured = measured_bytes(build_model(cfg, seed=0), 2, 16, precision, "none", segments)
        kw = dict(precision=precision, recompute="none", documents=segments is not None)
        assert predicted_bytes(cfg, 2, 16, **kw) == measured
        assert predicted_bytes(cfg, 2, 16, piece, **kw) < measured  # planted: the new piece counted as nothing


# TP 2: one start of 2 ranks computes every family's logits and trains Qwen3 with checkpoints.

def tp2_job(rank, comm, tmp_path, folders, qwen3_run):
    from zerotrain.training.loop import train

    out = {}
    for family, folder in folders.items():
        logits, loss, engine = zerotrain_logits(folder, comm, "--nproc", "2", "--tp", "2")
        cfg = engine.model.cfg
        out[family] = {"logits": logits.tolist(), "loss": loss, "q_full": cfg.n_head * cfg.head_dim,
                       "q_rows": engine.model.model.layers[0].self_attn.q_proj.weight.shape[0]}
    cfg = resolve_paths(config_for(folders["qwen3"], "--nproc", "2", "--tp", "2", *qwen3_run))
    out["qwen3 run"] = [r["loss"] for r in train(cfg, comm, announce=False).records]
    return out


def qwen3_run(out) -> list[str]:
    return ["--steps", "4", "--ckpt-every", "2", "--micro-batch", "4", "--lr", "1e-3", "--seed", "1",
            "--out", str(out)]


@pytest.fixture(scope="module")
def tp2(folders, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp2")
    codes, results = spawn(tp2_job, 2, tmp, {f: str(folders[f][0]) for f in FAMILIES}, qwen3_run(tmp / "qwen3-tp2"))
    assert codes == [0, 0] and "error" not in results[0], results
    return results, tmp / "qwen3-tp2"


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_computes_the_logits_and_first_loss_transformers_does(folders, tp2, family):
    _, hf = folders[family]
    theirs, their_loss = hf_logits_and_loss(hf)
    for rank in tp2[0]:
        r = rank[family]
        assert (torch.tensor(r["logits"]) - theirs).abs().max() < EXACT
        assert abs(r["loss"] - their_loss) <= 1e-5 * their_loss
        assert r["q_rows"] == r["q_full"] // 2  # its half of the heads


def test_a_qwen3_tp2_checkpoint_resumes_at_tp1_with_the_same_losses_and_swapped_slices_are_caught(
        folders, tp2, one_rank, tmp_path, monkeypatch):
    from zerotrain.checkpoint import homes as homes_module
    from zerotrain.training.loop import train

    results, run = tp2
    losses = results[0]["qwen3 run"]

    def resumed(name):
        cfg = resolve_paths(config_for(folders["qwen3"][0], *qwen3_run(tmp_path / name), "--resume",
                                       str(run / "checkpoints" / "step_00000002")))
        return [r["loss"] for r in train(cfg, one_rank, announce=False).records]

    again = resumed("tp1")
    assert len(again) == 2 and all(abs(a - b) <= 1e-5 * b for a, b in zip(again, losses[2:]))
    # planted: the TP ranks' k_proj slices read in each other's place (all slices swapped would permute the heads
    # and the MLP's units together, which computes the same function)
    real = homes_module.tp_slices_of  # what the load's CheckpointHomes reads the old slices with
    monkeypatch.setattr(homes_module, "tp_slices_of", lambda manifest, *key: {
        n: tensor_parallel.TPSlice(s.dim, s.full_shape, s.parts[::-1]) if "k_proj" in n else s
        for n, s in real(manifest, *key).items()})
    assert abs(resumed("planted")[0] - losses[2]) > 1e-3 * losses[2]


# Splits: Qwen3 (q/k norms under TP) on 1 rank accumulating, TP 2 x DP 2 and 4 DP ranks against the full batch.

def unreduced_heads(norm, x, comm):
    """Planted: the q/k norm gains' gradients left as each TP rank's partial sum."""
    return norm(x)


def qwen3_equivalence_job(cfg, comm, **kwargs):
    """equivalence_job, then again with the q/k norm gains' gradients not all-reduced over TP; rows named so."""
    rows = [{**row, "planted": False} for row in equivalence.equivalence_job(cfg, comm, **kwargs) or []]
    real, llama_module.normalize_heads = llama_module.normalize_heads, unreduced_heads
    try:
        rows += [{**row, "planted": True} for row in equivalence.equivalence_job(cfg, comm, **kwargs) or []]
    finally:
        llama_module.normalize_heads = real
    return rows if comm.rank == 0 else None


def test_qwen3_splits_give_the_full_batch_step_and_unreduced_q_k_norm_gradients_are_caught():
    cfg = config_from_args(build_parser().parse_args(["equivalence", "--preset", "llama-tiny", "--arch", "qwen3",
                                                      "--head-width", "12", "--nproc", "4", "--tp", "2"]))
    report = equivalence.check(cfg, job=qwen3_equivalence_job, time_limit=120)
    honest = [row for row in report["checked"] if not row["planted"]]
    planted = [row for row in report["checked"] if row["planted"] and "TP 2" in row["split"]]
    assert len(honest) == 4 and all(row["passed"] for row in honest), honest
    assert planted and not any(row["passed"] for row in planted)
