"""`zerotrain export`: a Hugging Face GPT-2 folder transformers loads with the same logits; bare safetensors."""

import json
import os

import pytest
import torch
from test_api import IDX, run_cli, step_folder, train_checkpoint

import zerotrain
from zerotrain.hub import export


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny GPT trained on the Zen of Python as bytes (see test_api.train_checkpoint): its run folder."""
    return train_checkpoint(str(tmp_path_factory.mktemp("run")))


def read_json(folder: str, name: str) -> dict:
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def hf_logits(folder: str) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied, as zerotrain's
    with torch.no_grad():
        return model.eval()(IDX).logits


def test_hf_export_gives_transformers_logits_within_1e_4_and_a_wrong_transpose_is_caught(run, tmp_path, monkeypatch):
    out = str(tmp_path / "hf")
    assert run_cli(["export", run, out, "--format", "hf"]) == 0
    config = read_json(out, "config.json")
    assert (config["model_type"], config["activation_function"], config["n_positions"]) == ("gpt2", "gelu_new", 16)
    assert (config["layer_norm_epsilon"], config["tie_word_embeddings"]) == (1e-5, True)
    assert config["bos_token_id"] == config["eos_token_id"] == 0  # the byte tokenizer's end-of-text
    with torch.no_grad():
        ours = zerotrain.load_model(run)(IDX)
    assert (hf_logits(out) - ours).abs().max() < 1e-4
    # planted: the one square Conv1D matrix left untransposed still loads, and the logits check catches it
    monkeypatch.setattr(export, "CONV1D_WEIGHTS", ("attn.c_attn.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"))
    assert run_cli(["export", run, str(tmp_path / "wrong"), "--format", "hf"]) == 0
    assert (hf_logits(str(tmp_path / "wrong")) - ours).abs().max() > 1e-3


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_an_export_loads_back_with_the_checkpoints_logits_and_tokenizer(run, tmp_path, fmt):
    out = str(tmp_path / fmt)
    assert run_cli(["export", run, out, "--format", fmt]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # bytes: no tokenizer file
    with torch.no_grad():
        assert torch.equal(zerotrain.load_model(out)(IDX), zerotrain.load_model(run)(IDX))
    assert zerotrain.load_tokenizer(out).kind == "bytes"
    if fmt == "safetensors":
        config = read_json(out, "config.json")
        assert config["model"]["seq_len"] == 16 and config["source"]["step"] == 300
        assert config["tokenizer"] == {"kind": "bytes", "vocab_size": 256, "eot_id": 0}


def test_export_refuses_a_non_empty_folder_in_one_line_and_overwrite_replaces_only_export_files(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "tokenizer.json").write_text("{}")  # a stale file of an earlier BPE export
    assert run_cli(["export", run, str(out), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty (pass --overwrite" in err
    assert sorted(os.listdir(out)) == ["notes.txt", "tokenizer.json"]  # untouched
    assert run_cli(["export", run, str(out), "--format", "hf", "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "notes.txt"]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # the staging folder is gone
    assert run_cli(["export", run, str(out / "notes.txt"), "--format", "hf"]) == 2  # a file is no folder


def test_a_bpe_checkpoint_exports_its_tokenizer_as_a_pretrained_tokenizer_fast(tmp_path):
    transformers = pytest.importorskip("transformers")
    from zerotrain.data.tokenizer import train_bpe

    text = "def f(x):\n    return x + 1\n\n" * 20 + "class Zen:\n    beautiful = better\n" * 20
    bpe = train_bpe([text], 300)
    root = train_checkpoint(str(tmp_path / "run"), synthetic_vocab=bpe.vocab_size, steps=1)
    bpe.save(os.path.join(step_folder(root, 1), "tokenizer.json"))  # where training will keep it
    out = str(tmp_path / "hf")
    assert run_cli(["export", root, out, "--format", "hf"]) == 0
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    assert read_json(out, "tokenizer_config.json")["tokenizer_class"] == "PreTrainedTokenizerFast"
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(theirs, transformers.PreTrainedTokenizerFast)  # TokenizersBackend in transformers 5
    assert theirs.eos_token == theirs.bos_token == "<|endoftext|>" and theirs.eos_token_id == bpe.eot_id
    sample = "def g(y):\n    return y"
    assert theirs(sample)["input_ids"] == bpe.encode(sample)
    assert read_json(out, "config.json")["eos_token_id"] == bpe.eot_id
    assert zerotrain.load_tokenizer(out).encode(sample) == bpe.encode(sample)
