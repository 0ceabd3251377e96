"""Special tokens as the model defines them: one BOS per record, the model's own EOS, nothing else trained; the model's
tokenizer or a one-line refusal (no tokenizer.json, data from another tokenizer, a vocabulary too large)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import zerotrain_here
from model_folders import BOS, EOS, IM_END, VOCAB, llama_folder, read_prepared, tokenizer_folder, write_jsonl
from test_user_errors import one_line_error

from zerotrain.data import tokenizer as tokenizer_module
from zerotrain.data.tokenfiles import write_llmc
from zerotrain.data.tokenizer import BPETokenizer, load_tokenizer

pytestmark = pytest.mark.timeout(300)

RECORDS = [{"prompt": f"Question {i}: what is {i} plus {i}? Answer:", "completion": f" {2 * i}."} for i in range(16)] \
    + [{"prompt": "", "completion": "The user asks."}, {"text": "The assistant answers."},
       {"prompt": "Question 3:", "completion": ""}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama-style tokenizer folder (post-processor `<s> $A`, eos_token `</s>` in tokenizer_config.json)."""
    folder = tmp_path_factory.mktemp("llama-tokenizer")
    return folder, tokenizer_folder(folder)


def prepare(capfd, jsonl, out, tokenizer) -> None:
    r = zerotrain_here(capfd, "prepare", str(jsonl), str(out), "--tokenizer", str(tokenizer), "--val-fraction", "0")
    assert r.returncode == 0, r.stderr


def check_records(folder, hf) -> None:
    """Each record: BOS once, at its start; its tokens the tokenizer's encoding of the whole of it; trained tokens
    exactly its completion (or text) and the model's EOS."""
    for record, (tokens, mask) in zip(RECORDS, read_prepared(folder)):
        whole = record.get("text", record.get("prompt", "") + record.get("completion", ""))
        assert tokens[0] == BOS and (tokens == BOS).sum() == 1, (record, tokens)
        assert list(tokens) == hf(whole)["input_ids"] + [EOS]  # hf adds the post-processor's BOS, as a whole text
        trained = tokens[mask == 1]
        assert trained[-1] == EOS and (np.isin(trained[:-1], [BOS, EOS, IM_END])).sum() == 0
        assert hf.decode(trained[:-1]) == record.get("completion", record.get("text")), (record, trained)


def test_a_record_is_one_bos_its_whole_encoding_and_the_models_eos_and_a_planted_encoding_with_specials_is_caught(
        llama, tmp_path, capfd, monkeypatch):
    folder, hf = llama
    jsonl = write_jsonl(tmp_path / "ft.jsonl", RECORDS)
    prepare(capfd, jsonl, tmp_path / "out", folder)
    check_records(tmp_path / "out", hf)
    meta = json.load(open(tmp_path / "out" / "meta.json"))
    assert (meta["version"], meta["eot_id"], meta["bos_ids"]) == (3, EOS, [BOS])
    assert meta["train"]["record_count"] == len(RECORDS) and meta["train"]["records"] == "train.records"
    # planted: the product's encoding keeps the post-processor's special tokens (a BOS before every piece)
    encode_batch = tokenizer_module.BPETokenizer.encode_pieces

    def with_specials(self, texts, offsets=False):
        return self.tokenizer.encode_batch(texts, add_special_tokens=True)

    monkeypatch.setattr(tokenizer_module.BPETokenizer, "encode_pieces", with_specials)
    prepare(capfd, jsonl, tmp_path / "planted", folder)
    with pytest.raises(AssertionError):
        check_records(tmp_path / "planted", hf)
    monkeypatch.setattr(tokenizer_module.BPETokenizer, "encode_pieces", encode_batch)


def test_the_end_of_text_token_is_the_one_the_folder_names_never_a_guess(tmp_path):
    tokenizer_folder(tmp_path / "chat", eos="<|im_end|>")
    assert BPETokenizer.from_file(str(tmp_path / "chat" / "tokenizer.json")).eot_id == IM_END  # tokenizer_config.json
    bare = tmp_path / "bare"
    bare.mkdir()
    os.rename(tmp_path / "chat" / "tokenizer.json", bare / "tokenizer.json")
    with pytest.raises(ValueError, match="names no end-of-text token"):  # it has </s>, but nothing names it
        BPETokenizer.from_file(str(bare / "tokenizer.json"))
    (bare / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, EOS]}))
    assert load_tokenizer(str(bare)).eot_id == IM_END  # the first of generation_config.json's
    (bare / "generation_config.json").write_text(json.dumps({"eos_token_id": 300}))  # an ordinary token: not it
    with pytest.raises(ValueError, match="names no end-of-text token"):
        BPETokenizer.from_file(str(bare / "tokenizer.json"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / "llama"
    llama_folder(folder)
    return folder


def test_a_model_folder_without_tokenizer_json_is_refused_for_text(model, tmp_path, capfd):
    folder = tmp_path / "old-llama"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        os.link(model / name, folder / name)
    (folder / "tokenizer.model").write_bytes(b"sentencepiece")
    write_jsonl(tmp_path / "ft.jsonl", RECORDS)
    r = zerotrain_here(capfd, "train", "--init-from", str(folder), "--data", str(tmp_path / "ft.jsonl"), "--steps",
                       "1", "--no-progress", "--out", str(tmp_path / "run"))
    line = one_line_error(r)
    assert f"--init-from {folder}: no tokenizer.json (only tokenizer.model)" in line and "save_pretrained" in line
    assert not (tmp_path / "run").exists()


def test_data_prepared_with_another_tokenizer_is_refused_naming_both(model, tmp_path, capfd):
    write_jsonl(tmp_path / "ft.jsonl", RECORDS)
    assert zerotrain_here(capfd, "prepare", str(tmp_path / "ft.jsonl"), str(tmp_path / "bytes")).returncode == 0
    r = zerotrain_here(capfd, "train", "--init-from", str(model), "--data", str(tmp_path / "bytes"), "--steps", "1",
                       "--no-progress", "--out", str(tmp_path / "run"))
    line = one_line_error(r)
    assert f"--data {tmp_path / 'bytes'} was prepared with bytes, not with the tokenizer of --init-from {model}" in line
    tokenizer_folder(tmp_path / "other", eos="<|im_end|>")  # the same tokenizer.json, another end-of-text token
    prepare(capfd, tmp_path / "ft.jsonl", tmp_path / "other-data", tmp_path / "other")
    line = one_line_error(zerotrain_here(capfd, "train", "--init-from", str(model), "--data",
                                         str(tmp_path / "other-data"), "--steps", "1", "--no-progress"))
    assert f"end-of-text id {IM_END}" in line and f"end-of-text id {EOS}" in line
    prepare(capfd, tmp_path / "ft.jsonl", tmp_path / "same", model)  # the model's own: accepted
    from zerotrain.cli.flags import config_from_args
    from zerotrain.cli.main import build_parser

    args = build_parser().parse_args(["train", "--init-from", str(model), "--data", str(tmp_path / "same"), "--out",
                                      str(tmp_path / "run")])
    assert config_from_args(args).model.vocab_size == VOCAB


def test_a_vocabulary_too_large_for_the_model_is_not_blamed_on_vocab_size(model, tmp_path, capfd):
    (tmp_path / "bins").mkdir()
    write_llmc(str(tmp_path / "bins" / "train.bin"), np.arange(VOCAB + 10) % (VOCAB + 5), VOCAB + 5)
    line = one_line_error(zerotrain_here(capfd, "train", "--init-from", str(model), "--data", str(tmp_path / "bins"),
                                         "--steps", "1", "--no-progress"))
    assert f"is not below the vocabulary of --init-from {model} ({VOCAB} ids)" in line and "--vocab-size" not in line
    (tmp_path / "bins" / "meta.json").write_text(json.dumps({"vocab_size": VOCAB + 5}))  # states it, no tokenizer
    line = one_line_error(zerotrain_here(capfd, "train", "--init-from", str(model), "--data", str(tmp_path / "bins"),
                                         "--steps", "1", "--no-progress"))
    assert f"its vocabulary has {VOCAB + 5} ids, more than the {VOCAB} of --init-from {model}" in line
    assert "--vocab-size" not in line


def test_a_completion_that_starts_inside_a_token_trains_that_token_and_is_counted(llama, tmp_path, capfd):
    folder, hf = llama
    records = [{"prompt": "The user ask", "completion": "s and the assistant answers."}, RECORDS[0]]
    r = zerotrain_here(capfd, "prepare", write_jsonl(tmp_path / "ft.jsonl", records), str(tmp_path / "out"),
                       "--tokenizer", str(folder), "--val-fraction", "0")
    assert r.returncode == 0 and "1 training completions start inside a token" in r.stdout, r.stdout
    assert json.load(open(tmp_path / "out" / "meta.json"))["train"]["completions_inside_a_token"] == 1
    (tokens, mask), _ = read_prepared(tmp_path / "out")
    assert list(tokens) == hf("The user asks and the assistant answers.")["input_ids"] + [EOS]  # the whole, as one
    assert hf.decode(tokens[mask == 1][:-1]) == " asks and the assistant answers."  # " asks" holds the prompt's " ask"
