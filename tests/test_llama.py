"""Models in and out: Llama-family training, --init-from a local Hugging Face folder, export back, each exact.

Every Hugging Face model here is built locally with `transformers` (random weights, save_pretrained): nothing
is downloaded. Planted mapping bugs (q and k swapped, gate and up swapped, an untransposed GPT-2 matrix, a
dropped rotary half) are each caught by the logits comparison.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import transformers  # a test dependency (pyproject's [test] extra): missing, the module fails to import, loudly
from conftest import zerotrain_here
from safetensors.torch import load_file, save_file
from test_checkpoint import spawn

from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser, main
from zerotrain.hub import init_from, mapping
from zerotrain.model import llama as llama_module
from zerotrain.model import summed_token_loss
from zerotrain.training.loop import build_engine

SEQ, VOCAB = 16, 96
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def hf_model(folder, arch: str, kv: int = 2, tie: bool = False, theta: float = 500.0, shard: str | None = None):
    """A tiny random Hugging Face model saved in `folder`: Llama with GQA, an untied head and rope theta 500 by
    default, or GPT-2; `shard` splits its weights into files of that size with an index."""
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=SEQ,
                                          rope_theta=theta, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                                          initializer_range=0.2)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ,
                                         bos_token_id=0, eos_token_id=0, initializer_range=0.2)
        model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(str(folder), **({"max_shard_size": shard} if shard else {}))
    return model.eval()


def hf_logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def config_for(folder, *flags):
    args = build_parser().parse_args(["train", "--init-from", str(folder), "--data", "synthetic", "--no-progress",
                                      "--out", str(folder) + "-run", *flags])
    return config_from_args(args)


def zerotrain_logits(folder, comm, *flags) -> tuple[torch.Tensor, object]:
    engine = build_engine(config_for(folder, *flags), comm)
    with torch.no_grad():
        return engine.model(IDS), engine


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    models = {name: (root / name, hf_model(root / name, arch, **kw)) for name, arch, kw in (
        ("llama", "llama", {}), ("llama-mha", "llama", {"kv": 4, "tie": True, "theta": 10000.0}), ("gpt2", "gpt2", {}))}
    # saved from the bare GPT2Model, as the original gpt2 files are: names without "transformer."
    models["gpt2-bare"] = (root / "gpt2-bare", models["gpt2"][1])
    models["gpt2"][1].transformer.save_pretrained(str(root / "gpt2-bare"))
    return models


@pytest.mark.parametrize("name", ["llama", "llama-mha", "gpt2", "gpt2-bare"])
def test_zerotrain_computes_the_logits_and_first_loss_transformers_does(folders, one_rank, name):
    folder, hf = folders[name]
    ours, engine = zerotrain_logits(folder, one_rank)
    assert (ours - hf_logits(hf)).abs().max() < 1e-4
    with torch.no_grad():  # the loss training takes: the sum of token losses over the token count
        x, y = IDS[:, :-1].contiguous(), IDS[:, 1:].contiguous()
        loss = summed_token_loss(engine.model(x), y) / y.numel()
        theirs = hf(IDS, labels=IDS).loss
    assert abs(loss.item() - theirs.item()) <= 1e-5 * theirs.item()


def swap_names(a: str, b: str):
    """Planted: the reading path takes tensor `a` for `b` and `b` for `a`."""
    read = init_from._read_rows

    def swapped(f, name, *args):
        other = name.replace(a, b) if a in name else name.replace(b, a) if b in name else name
        return read(f, other, *args)

    return swapped


def dropped_rotary_half(x, cos, sin):
    """Planted: the rotated half loses its -x2 term."""
    half = x.shape[-1] // 2
    rotated = torch.cat((torch.zeros_like(x[..., half:]), x[..., :half]), dim=-1)
    return x * cos + rotated * sin


PLANTED = {
    "q and k swapped": ("llama-mha", lambda mp: mp.setattr(init_from, "_read_rows", swap_names("q_proj", "k_proj"))),
    "gate and up swapped": ("llama", lambda mp: mp.setattr(init_from, "_read_rows", swap_names("gate_proj", "up_proj"))),
    "untransposed GPT-2 matrix": ("gpt2", lambda mp: mp.setitem(mapping.MAPPINGS, "gpt2", dataclasses.replace(
        mapping.MAPPINGS["gpt2"], transposed=("attn.c_attn.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")))),
    "dropped rotary half": ("llama", lambda mp: mp.setattr(llama_module, "apply_rotary", dropped_rotary_half)),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_mapping_bug_changes_the_logits(folders, one_rank, monkeypatch, bug):
    name, plant = PLANTED[bug]
    folder, hf = folders[name]
    plant(monkeypatch)
    ours, _ = zerotrain_logits(folder, one_rank)
    assert (ours - hf_logits(hf)).abs().max() > 1e-2  # 100x the bound the exact mapping meets


def tp_logits_job(rank, comm, tmp_path, folder):
    logits, engine = zerotrain_logits(folder, comm, "--nproc", "2", "--tp", "2")
    shapes = {n: list(p.shape) for n, p in engine.model.named_parameters()}
    return {"logits": logits.tolist(), "shapes": shapes}


def tp_logits_of_each_job(rank, comm, tmp_path, folders):
    return {name: tp_logits_job(rank, comm, tmp_path, folder) for name, folder in folders.items()}


@pytest.fixture(scope="module")
def tp_logits(folders, tmp_path_factory):
    """{name: each TP 2 rank's logits and parameter shapes} of the Llama and the GPT-2, on one start of 2 ranks."""
    codes, results = spawn(tp_logits_of_each_job, 2, tmp_path_factory.mktemp("tp-logits"),
                           {name: str(folders[name][0]) for name in ("llama", "gpt2")})
    assert codes == [0, 0], results
    return {name: [r[name] for r in results] for name in ("llama", "gpt2")}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tp2_computes_the_logits_transformers_does_from_each_ranks_own_slices(folders, tp_logits, name):
    _, hf = folders[name]
    results = tp_logits[name]
    for r in results:
        assert (torch.tensor(r["logits"]) - hf_logits(hf)).abs().max() < 1e-4
    split = "model.layers.0.self_attn.q_proj.weight" if name == "llama" else "transformer.h.0.attn.c_attn.weight"
    full = 32 if name == "llama" else 96
    assert results[0]["shapes"][split][0] == full // 2  # each rank read its half, not the full tensor


def test_init_from_reads_a_sharded_index_and_refuses_pickles_contradictions_and_missing_tensors(tmp_path, one_rank,
                                                                                                capfd):
    sharded = tmp_path / "sharded"
    hf = hf_model(sharded, "llama", shard="20KB")
    assert (sharded / init_from.INDEX_FILE).exists() and len(list(sharded.glob("*.safetensors"))) > 1
    ours, _ = zerotrain_logits(sharded, one_rank)
    assert (ours - hf_logits(hf)).abs().max() < 1e-4

    pickled = tmp_path / "pickled"
    hf_model(pickled, "llama")
    os.rename(pickled / "model.safetensors", pickled / "pytorch_model.bin")
    r = zerotrain_here(capfd, "train", "--init-from", str(pickled), "--data", "synthetic", "--out", str(tmp_path / "r1"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"zerotrain: error: --init-from {pickled}: holds pytorch_model.bin but no model.safetensors: zerotrain never "
        "unpickles weights; convert them first (transformers: AutoModelForCausalLM.from_pretrained(folder)"
        ".save_pretrained(folder) writes model.safetensors)"]

    r = zerotrain_here(capfd, "train", "--init-from", str(sharded), "--n-layer", "3", "--data", "synthetic",
                  "--out", str(tmp_path / "r2"))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"zerotrain: error: --n-layer 3 contradicts --init-from {sharded}, whose model has n_layer = 2: leave it "
        "out, the model's comes with it")

    missing = tmp_path / "missing"
    hf_model(missing, "llama")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    r = zerotrain_here(capfd, "train", "--init-from", str(missing), "--data", "synthetic", "--steps", "1", "--no-progress",
                  "--out", str(tmp_path / "r3"))
    assert r.returncode == 2  # found from the headers before any rank starts
    assert r.stderr.strip().splitlines()[-1] == (
        f"zerotrain: error: --init-from {missing}: no tensor model.layers.1.mlp.up_proj.weight in model.safetensors, "
        "which the model its config describes has")


def test_a_llama_trains_reshards_exports_what_transformers_loads_and_inits_from_its_checkpoint(folders, tmp_path,
                                                                                                 one_rank, capfd):
    folder, _ = folders["llama"]
    out = str(tmp_path / "tp2")
    common = ["--init-from", str(folder), "--data", "synthetic", "--micro-batch", "4", "--no-progress",
              "--steps", "4", "--ckpt-every", "2"]
    r = zerotrain_here(capfd, "train", *common, "--nproc", "2", "--tp", "2", "--out", out)
    assert r.returncode == 0, r.stderr
    losses = [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    manifest = json.load(open(os.path.join(out, "checkpoints", "step_00000004", "manifest.json")))
    assert manifest["init_from"]["path"] == str(folder) and manifest["init_from"]["files"][0]["blocks_sha256"]
    # TP 2 -> TP 1 from step 2: the same losses within float reordering
    resumed = str(tmp_path / "tp1")
    r = zerotrain_here(capfd, "train", *common, "--nproc", "1", "--out", resumed,
                  "--resume", os.path.join(out, "checkpoints", "step_00000002"))
    assert r.returncode == 0, r.stderr
    again = [json.loads(line)["loss"] for line in open(os.path.join(resumed, "metrics.jsonl")) if '"loss"' in line]
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(again, losses[2:])) and len(again) == 2
    # export the TP-trained model; transformers loads it and computes zerotrain's logits
    hf_out = str(tmp_path / "hf")
    assert main(["export", out, hf_out, "--format", "hf"]) == 0  # the command's entry point, in this process
    import zerotrain as zt
    with torch.no_grad():
        theirs = transformers.LlamaForCausalLM.from_pretrained(hf_out)(IDS).logits
        ours = zt.load_model(out)(IDS)
    assert (theirs - ours).abs().max() < 1e-4
    # --init-from the run folder (its latest checkpoint) and from the export: the trained weights, exactly
    for source in (out, hf_out):
        start, _ = zerotrain_logits(source, one_rank)
        assert torch.equal(start, ours)


def test_a_llama_demo_verifies_its_invariants_and_a_bitwise_resume(tmp_path, capsys):
    code = main(["demo", "--preset", "llama-tiny", "--nproc", "2", "--out", str(tmp_path / "demo")])  # in this process
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "model: Llama 2 layers" in out and "RESUME VERIFIED" in out


def test_llama_splits_and_tp2_give_the_full_batch_gradient_and_step(tmp_path, capsys):
    report = tmp_path / "equivalence.json"
    code = main(["equivalence", "--preset", "llama-tiny", "--nproc", "4", "--tp", "2", "--json", str(report)])
    assert code == 0, capsys.readouterr()
    result = json.loads(report.read_text())
    assert result["passed"] and result["wrong_variants_caught"] and result["config"]["model"]["arch"] == "llama"
    # 1 rank (accumulating), TP 2 x DP 2 and 4 plain DP ranks, each against the full batch on one rank
    assert [row["split"] for row in result["checked"]] == ["1 x 16 x 1", "1 x 2 x 8", "4 x 2 x 4 (TP 2 x DP 2)",
                                                            "4 x 4 x 1"]


def test_generation_caches_only_the_kv_heads_and_matches_recomputing(folders, one_rank):
    from zerotrain.model.generate import generate
    from zerotrain.model.kv_cache import KVCache

    _, engine = zerotrain_logits(folders["llama"][0], one_rank)
    model = engine.model.eval()
    assert KVCache(model.cfg, 1).keys.shape == (2, 1, 2, SEQ, 8)  # 2 KV heads of 4 query heads
    prompt = IDS[:1, :3]
    cached = generate(model, prompt, 20, temperature=0.0)
    assert torch.equal(cached, generate(model, prompt, 20, temperature=0.0, kv_cache=False))
