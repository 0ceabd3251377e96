"""A broken model folder is refused in one line naming the file and the field, exit 2, before any rank starts.

Each folder is a tiny random Hugging Face model built locally with `transformers` (test_llama's hf_model), broken
one way: its tokenizer, its config.json's types and values, its safetensors files (read from their headers), a
Qwen2 / Qwen3 / Phi-3 relabelled as llama, a model_type zerotrain does not build, pickled weights.
`zerotrain.load_model` reads the sharded folders `--init-from` reads.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import zerotrain_here
from safetensors.torch import load_file, save_file
from test_llama import IDS, SEQ, VOCAB, hf_model
from test_user_errors import one_line_error

import zerotrain
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.data.tokenizer import train_bpe

import transformers  # noqa: E402 - a [test] dependency: missing, the module fails loudly rather than skipping

pytestmark = pytest.mark.timeout(300)

BPE_VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=SEQ)


def hf_family(folder, name: str) -> None:
    """A tiny random model of a Llama-like family saved in `folder`: Qwen2, Qwen3 or Phi-3, which zerotrain builds
    under their own model_type and refuses relabelled as llama."""
    torch.manual_seed(0)
    if name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE))
    elif name == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=8))
    else:
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**SHAPE, pad_token_id=0, bos_token_id=1,
                                                                     eos_token_id=2))
    model.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Unbroken folders, by name; each test copies the one it breaks."""
    root = tmp_path_factory.mktemp("clean")
    hf_model(root / "llama", "llama")
    hf_model(root / "llama-sharded", "llama", shard="20KB")
    hf_model(root / "gpt2", "gpt2")
    for name in ("qwen2", "qwen3", "phi3"):
        hf_family(root / name, name)
    text = root / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n\nclass Zen:\n    beautiful = better\n" * 40)
    # a Llama with a BPE of its own, whose vocabulary is the model's, as a downloaded model folder has
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SHAPE, "vocab_size": BPE_VOCAB})).save_pretrained(
        str(root / "llama-bpe"))
    train_bpe([text.read_text()], BPE_VOCAB).save(str(root / "llama-bpe" / "tokenizer.json"))
    return root


def edit_json(path, **changes) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump(data, f)


def edit_tensors(path, change) -> None:
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def corrupt_tokenizer(folder) -> None:
    """A tokenizer.json whose model is a WordPiece without its unk_token (a field tokenizers requires)."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(folder / "tokenizer.json"))
    edit_json(folder / "tokenizer.json", model={"type": "WordPiece", "vocab": {"a": 0, "b": 1},
                                                "continuing_subword_prefix": "##", "max_input_chars_per_word": 100})


def tokenizer_without_eot(folder) -> None:
    from tokenizers import Tokenizer, models

    letters = "abcdefghijklmnopqrstuvwxyz \n():+=1"
    Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(letters)}, merges=[])).save(str(folder / "tokenizer.json"))


def relabel_llama(folder) -> None:
    edit_json(folder / "config.json", model_type="llama", architectures=["LlamaForCausalLM"])


def truncate(path, by: int = 100) -> None:
    os.truncate(path, os.path.getsize(path) - by)


def as_zerotrain_export(folder) -> None:
    """The llama folder's config.json as a zerotrain export's (its tensors are already in zerotrain's names), with
    n_layer a string."""
    with open(folder / "config.json", "w") as f:
        json.dump({"format": "zerotrain-model", "version": 1, "model": {
            "arch": "llama", "n_layer": "2", "n_head": 4, "n_kv_head": 2, "n_embd": 32, "intermediate_size": 48,
            "seq_len": SEQ, "vocab_size": VOCAB, "tie_embeddings": False}}, f)


UP = "model.layers.1.mlp.up_proj.weight"
SHARD = "model-00002-of-00005.safetensors"  # hf_model's shard="20KB" makes five
# name: (the clean folder, how it is broken, --data, what the error line must say)
BROKEN = {
    "corrupt tokenizer.json": ("llama-bpe", corrupt_tokenizer, "synthetic", ["tokenizer.json", "unk_token"]),
    "tokenizer without an end-of-text token": ("llama-bpe", tokenizer_without_eot, "text",
                                               ["tokenizer.json", "end-of-text", "<|endoftext|>"]),
    "num_attention_heads 0": ("llama", lambda d: edit_json(d / "config.json", num_attention_heads=0), "synthetic",
                              ["config.json", "num_attention_heads", "got 0"]),
    "num_hidden_layers a string": ("llama", lambda d: edit_json(d / "config.json", num_hidden_layers="2"),
                                   "synthetic", ["config.json", "num_hidden_layers", "got '2'"]),
    "hidden_size not divisible by the heads": ("llama", lambda d: edit_json(d / "config.json", hidden_size=30,
                                                                            head_dim=None),  # no width of their own
                                               "synthetic", ["config.json", "hidden_size 30", "num_attention_heads 4"]),
    "gpt2 n_embd null": ("gpt2", lambda d: edit_json(d / "config.json", n_embd=None), "synthetic",
                         ["config.json", "n_embd", "got None"]),
    "truncated model.safetensors": ("llama", lambda d: truncate(d / "model.safetensors"), "synthetic",
                                    ["model.safetensors", "bytes"]),
    "truncated shard": ("llama-sharded", lambda d: truncate(d / SHARD), "synthetic", [SHARD, "bytes"]),
    "misshapen tensor": ("llama", lambda d: edit_tensors(d / "model.safetensors",
                                                         lambda t: t.update({UP: t[UP][:40].clone()})),
                         "synthetic", ["model.safetensors", UP, "[40, 32]", "[48, 32]"]),
    "missing tensor": ("llama", lambda d: edit_tensors(d / "model.safetensors", lambda t: t.pop(UP)), "synthetic",
                       ["model.safetensors", UP]),
    "Qwen2 relabelled llama": ("qwen2", relabel_llama, "synthetic", ["model.safetensors", "k_proj.bias", "Qwen2"]),
    "Qwen3 relabelled llama": ("qwen3", relabel_llama, "synthetic", ["model.safetensors", "k_norm", "Qwen3"]),
    "Phi-3 relabelled llama": ("phi3", relabel_llama, "synthetic", ["model.safetensors", "gate_up_proj", "Phi-3"]),
    "model_type falcon": ("phi3", lambda d: edit_json(d / "config.json", model_type="falcon"), "synthetic",
                          ["config.json", "model_type 'falcon'", "'gpt2'", "'llama'", "'phi3'"]),
    "zerotrain export with n_layer a string": ("llama", as_zerotrain_export, "synthetic",
                                               ["config.json", "n_layer", "'2'"]),
    "pickled weights": ("llama", lambda d: os.rename(d / "model.safetensors", d / "pytorch_model.bin"), "synthetic",
                        ["pytorch_model.bin", "from_pretrained(folder).save_pretrained(folder)"]),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_model_folder_is_refused_in_one_line_naming_the_file_and_field_before_any_rank_starts(
        clean, tmp_path, capfd, case):
    name, brake, data, said = BROKEN[case]
    folder = tmp_path / "model"
    shutil.copytree(clean / name, folder)
    brake(folder)
    out = tmp_path / "run"
    r = zerotrain_here(capfd, "train", "--init-from", str(folder), "--nproc", "2", "--steps", "1",
                       "--micro-batch", "2", "--no-progress", "--out", str(out),
                       "--data", str(clean / "text.txt") if data == "text" else data)
    line = one_line_error(r)
    assert str(folder) in line and all(s in line for s in said), line
    assert "safe_serialization" not in line
    assert not out.exists()  # refused before the run folder was taken: no rank started


@pytest.mark.parametrize("name", ["llama", "llama-sharded", "gpt2", "llama-bpe"])
def test_an_unbroken_folder_passes_the_same_checks(clean, tmp_path, name):
    data = str(clean / "text.txt") if name == "llama-bpe" else "synthetic"  # text: tokenized with its BPE
    args = build_parser().parse_args(["train", "--init-from", str(clean / name), "--data", data,
                                      "--out", str(tmp_path / "run")])
    assert config_from_args(args).model.n_layer == 2


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_a_zerotrain_cache_that_cannot_hold_the_cache_is_named_in_one_line(clean, tmp_path, capfd, monkeypatch,
                                                                           where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    cache = blocker if where == "a file" else blocker / "cache"
    monkeypatch.setenv("ZEROTRAIN_CACHE", str(cache))
    out = tmp_path / "run"
    r = zerotrain_here(capfd, "train", "--data", str(clean / "text.txt"), "--nproc", "2", "--steps", "1",
                       "--no-progress", "--out", str(out))
    line = one_line_error(r)
    assert f"ZEROTRAIN_CACHE={cache}" in line, line
    assert not out.exists()


def test_load_model_reads_a_sharded_folder_as_the_unsharded_one(clean):
    sharded, whole = zerotrain.load_model(str(clean / "llama-sharded")), zerotrain.load_model(str(clean / "llama"))
    assert len(list((clean / "llama-sharded").glob("*.safetensors"))) > 1
    theirs, ours = whole.state_dict(), sharded.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    with torch.no_grad():
        assert torch.equal(sharded(IDS), whole(IDS))
