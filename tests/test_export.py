"""`zerotrain export`: a Hugging Face GPT-2 folder transformers loads with our logits and ids; bare safetensors."""

import dataclasses
import json
import os
import stat
import tempfile

import pytest
import torch
from test_api import IDX, run_cli, step_folder, train_checkpoint

import zerotrain
from zerotrain.data import tokenizer as tokenizer_module
from zerotrain.data.tokenizer import ByteTokenizer
from zerotrain.hub import export, mapping
from zerotrain.model.generate import generate


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny GPT trained on the Zen of Python as bytes (see test_api.train_checkpoint): its run folder."""
    return train_checkpoint(str(tmp_path_factory.mktemp("run")))


HF_FILES = ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
            "tokenizer_config.json"]


def read_json(folder: str, name: str) -> dict:
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def hf_logits(folder: str) -> torch.Tensor:
    import transformers  # the [test] extra installs it: a missing one fails, never skips
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
    assert read_json(out, "generation_config.json") == {"bos_token_id": 0, "eos_token_id": 0}  # where generate stops
    with torch.no_grad():
        ours = zerotrain.load_model(run)(IDX)
    assert (hf_logits(out) - ours).abs().max() < 1e-4
    # planted: the one square Conv1D matrix left untransposed still loads, and the logits check catches it
    monkeypatch.setitem(mapping.MAPPINGS, "gpt2", dataclasses.replace(
        mapping.MAPPINGS["gpt2"], transposed=("attn.c_attn.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")))
    assert run_cli(["export", run, str(tmp_path / "wrong"), "--format", "hf"]) == 0
    assert (hf_logits(str(tmp_path / "wrong")) - ours).abs().max() > 1e-3


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_an_export_loads_back_with_the_checkpoints_logits_and_tokenizer(run, tmp_path, fmt):
    out = str(tmp_path / fmt)
    assert run_cli(["export", run, out, "--format", fmt]) == 0
    # hf: the byte tokenizer's twin for transformers, its configuration, generate's; safetensors: config.json's
    # record says bytes
    assert sorted(os.listdir(out)) == (HF_FILES if fmt == "hf" else ["config.json", "model.safetensors"])
    with torch.no_grad():
        assert torch.equal(zerotrain.load_model(out)(IDX), zerotrain.load_model(run)(IDX))
    assert zerotrain.load_tokenizer(out).kind == "bytes"  # the hf tokenizer.json is recognised as the bytes one
    if fmt == "safetensors":
        config = read_json(out, "config.json")
        assert config["model"]["seq_len"] == 16 and config["source"]["step"] == 300
        assert config["tokenizer"] == {"kind": "bytes", "vocab_size": 256, "eot_id": 0, "context_length": 16}


def test_export_refuses_a_non_empty_folder_in_one_line_and_overwrite_replaces_only_export_files(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "tokenizer.json").write_text("{}")  # stale files of an earlier export
    (out / "special_tokens_map.json").write_text("{}")
    assert run_cli(["export", run, str(out), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty (pass --overwrite" in err
    assert sorted(os.listdir(out)) == ["notes.txt", "special_tokens_map.json", "tokenizer.json"]  # untouched
    assert run_cli(["export", run, str(out), "--format", "hf", "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == sorted(HF_FILES + ["notes.txt"])
    assert zerotrain.load_tokenizer(str(out)).kind == "bytes"  # tokenizer.json replaced by the bytes one
    assert read_json(str(out), "special_tokens_map.json")["eos_token"] == "<|endoftext|>"  # and the map
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # the staging folder is gone
    assert run_cli(["export", run, str(out / "notes.txt"), "--format", "hf"]) == 2  # a file is no folder


def test_a_bpe_checkpoint_exports_its_tokenizer_as_a_pretrained_tokenizer_fast(tmp_path):
    import transformers  # the [test] extra installs it: a missing one fails, never skips
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
    assert theirs.unk_token is None  # a byte-level BPE has a token for every byte: nothing is unknown
    sample = "def g(y):\n    return y"
    assert theirs(sample)["input_ids"] == bpe.encode(sample)
    assert read_json(out, "config.json")["eos_token_id"] == bpe.eot_id
    assert zerotrain.load_tokenizer(out).encode(sample) == bpe.encode(sample)


def modes(folder: str) -> dict[str, int]:
    """The permission bits of `folder` (as ".") and of each file in it."""
    return {".": stat.S_IMODE(os.stat(folder).st_mode),
            **{n: stat.S_IMODE(os.stat(os.path.join(folder, n)).st_mode) for n in os.listdir(folder)}}


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_an_export_gets_the_umask_modes_and_a_mkdtemp_staging_folder_is_caught(run, tmp_path, monkeypatch, fmt):
    previous = os.umask(0o022)
    try:
        assert run_cli(["export", run, str(tmp_path / "shared"), "--format", fmt]) == 0
        got = modes(str(tmp_path / "shared"))
        assert got.pop(".") == 0o755 and set(got.values()) == {0o644}, got
        os.umask(0o027)  # another umask, other modes: they come from the umask, not from a constant
        assert run_cli(["export", run, str(tmp_path / "group"), "--format", fmt]) == 0
        got = modes(str(tmp_path / "group"))
        assert got.pop(".") == 0o750 and set(got.values()) == {0o640}, got
        # planted: the staging folder made by tempfile.mkdtemp again, 0700 whatever the umask
        os.umask(0o022)
        monkeypatch.setattr(export, "make_staging_folder", lambda out: tempfile.mkdtemp(
            prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(os.path.abspath(out))))
        assert run_cli(["export", run, str(tmp_path / "private"), "--format", fmt]) == 0
        assert modes(str(tmp_path / "private"))["."] == 0o700
    finally:
        os.umask(previous)


TEXTS = ["def ", "\u00e9\u20ac", "  two  spaces\n\ttab \U0001f600 <|endoftext|>next\x00nul"]


def test_a_bytes_model_exports_a_tokenizer_autotokenizer_loads_with_zerotrains_ids_and_a_naive_vocab_is_caught(
        run, tmp_path, monkeypatch):
    import transformers  # the [test] extra installs it: a missing one fails, never skips
    out = str(tmp_path / "hf")
    assert run_cli(["export", run, out, "--format", "hf"]) == 0
    theirs, ours = transformers.AutoTokenizer.from_pretrained(out), ByteTokenizer()
    assert len(theirs) == 256 and theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == ours.eot_id == 0
    assert theirs.unk_token == "<|endoftext|>"  # the twin's unknown: a NUL byte encodes to it, as zerotrain's
    assert theirs("def ")["input_ids"] == ours.encode("def ") == [100, 101, 102, 32]
    assert theirs("\u00e9\u20ac")["input_ids"] == ours.encode("\u00e9\u20ac") == [0xC3, 0xA9, 0xE2, 0x82, 0xAC]
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ids == ours.encode(text), text
        assert theirs.decode(ids) == ours.decode(ids)  # a NUL decodes to <|endoftext|> in both
        assert theirs.decode(ids) == text.replace("\x00", "<|endoftext|>")
    invalid = [104, 0xC3, 105, 0xE2, 0x82]  # sampled bytes need not be UTF-8: U+FFFD in both
    assert theirs.decode(invalid) == ours.decode(invalid) == "h\ufffdi\ufffd"
    # planted: the vocabulary as chr(byte), forgetting that ByteLevel maps bytes to printable characters
    monkeypatch.setattr(tokenizer_module, "bytes_to_unicode", lambda: {b: chr(b) for b in range(256)})
    assert run_cli(["export", run, str(tmp_path / "naive"), "--format", "hf"]) == 0
    naive = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "naive"))
    assert naive("def ")["input_ids"] != ours.encode("def ")


def test_transformers_generate_on_a_bytes_hf_export_gives_zerotrains_greedy_tokens(run, tmp_path):
    import transformers  # the [test] extra installs it: a missing one fails, never skips
    out = str(tmp_path / "hf")
    assert run_cli(["export", run, out, "--format", "hf"]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    for prompt in ("def ", "Now is"):  # with the 10 new tokens, within the context of 16
        inputs = tokenizer(prompt, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        assert ids == ByteTokenizer().encode(prompt)
        ours = generate(zerotrain.load_model(run), torch.tensor([ids]), 10, temperature=0)[0].tolist()
        with torch.no_grad():  # no eos: neither stops at the end of text (sample --ignore-eos)
            theirs = model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=[],
                                    pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
        assert theirs == ours, prompt
        assert tokenizer.decode(theirs) == ByteTokenizer().decode(ours)
