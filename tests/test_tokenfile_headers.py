"""Token-file headers: a damaged llm.c header is refused in one line, never trained as headerless nanoGPT tokens."""

import os

import numpy as np
import pytest
from test_data import config, one_line_error

from zerotrain.data import check_source, tokenfiles
from zerotrain.data.tokenfiles import LLMC_MAGIC, open_token_file, write_llmc

RNG = np.random.default_rng(7)
TOKENS = RNG.integers(1, 1000, 3000)  # no zeros: a header's zero fields stand out from the data


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """A file the refusal misses would train: its run folder then goes to tmp_path, not the working tree."""
    monkeypatch.chdir(tmp_path)


def llmc_file(path, *, data_version=1, magic=LLMC_MAGIC, version=None, count=None, tail=None) -> str:
    """An llm.c file of TOKENS as llm.c writes it (uint16 for data_version 1, else uint32), then with header
    fields overwritten (the damage)."""
    write_llmc(str(path), TOKENS, vocab_size=1 << 16 if data_version == 1 else 1 << 17)
    header = np.fromfile(path, dtype="<i4", count=256)
    header[:3] = (magic, data_version if version is None else version, len(TOKENS) if count is None else count)
    if tail is not None:
        header[3:] = tail
    with open(path, "r+b") as f:
        f.write(header.tobytes())
    return str(path)


DAMAGED = {  # name: (header fields, what the refusal says)
    "zeroed magic": (dict(magic=0), "magic 0 instead of 20240520, though its version 1 and token count 3000 "
                                    "match the file's 7024 bytes"),
    "random magic, v2": (dict(magic=123456789, data_version=2), "magic 123456789 instead of 20240520, though "
                                                                "its version 2 and token count 3000 match"),
    "random magic, count also damaged": (dict(magic=-5, count=77), "magic -5 instead of 20240520, though its "
                                                                  "version is 1 and the rest of its header is zero"),
    "one bit flipped, count also damaged": (dict(magic=LLMC_MAGIC ^ (1 << 20), count=5, tail=9),
                                            f"magic {LLMC_MAGIC ^ (1 << 20)} is 20240520 with 1 bit(s) flipped"),
    "sign and low bit flipped, version damaged": (dict(magic=(LLMC_MAGIC ^ 1) - (1 << 31), version=7, tail=9),
                                                  f"magic {(LLMC_MAGIC ^ 1) - (1 << 31)} is 20240520 with 2 bit(s) "
                                                  f"flipped (version field 7, token count field 3000)"),
}


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_llmc_magic_is_refused_in_one_line_and_without_the_check_it_trains_as_headerless_tokens(
        tmp_path, capsys, monkeypatch, name):
    fields, message = DAMAGED[name]
    path = llmc_file(tmp_path / "train.bin", **fields)
    err = one_line_error(capsys, ["train", "--data", path])
    assert f"{path}: damaged llm.c header: {message}" in err, err
    assert "not read as headerless nanoGPT tokens" in err
    # planted: without the check the header is read as 512 tokens, and the vocabulary grows to fit them
    monkeypatch.setattr(tokenfiles, "damaged_llmc_header", lambda header, size: None)
    file = open_token_file(path)
    assert file.layout == "nanoGPT" and len(file) == os.path.getsize(path) // 2  # the header's 512 included
    assert (int(file.tokens[0]) | int(file.tokens[1]) << 16) == fields["magic"] & 0xFFFFFFFF
    cfg = config(path, tmp_path)
    check_source(cfg)
    assert cfg.model.vocab_size > 1000  # the data's ids are below 1000: the extra ids are the header's


@pytest.mark.parametrize("magic, what", [(20240326, "GPT-2 model checkpoint"), (20240328, "tokenizer"),
                                         (20240527, "training state")])
def test_another_llmc_file_given_as_data_is_refused_naming_what_it_is(tmp_path, capsys, magic, what):
    path = llmc_file(tmp_path / "gpt2_124M.bin", magic=magic, version=3, count=1024, tail=12)
    err = one_line_error(capsys, ["train", "--data", path])
    assert f"{path}: an llm.c {what} (magic {magic}), not a token file (magic 20240520)" in err


@pytest.mark.parametrize("fields, message", [
    (dict(version=3), "llm.c header has version 3; known: 1 (uint16), 2 (uint32)"),
    (dict(version=0), "llm.c header has version 0"),
    (dict(count=3001), "llm.c header says 3001 uint16 tokens, but the file has 7024 bytes (expected 7026)"),
    (dict(version=2), "llm.c header says 3000 uint32 tokens, but the file has 7024 bytes"),  # v1 data, v2 header
])
def test_an_llmc_header_with_a_good_magic_and_a_bad_version_or_count_is_refused_in_one_line(
        tmp_path, capsys, fields, message):
    path = llmc_file(tmp_path / "train.bin", **fields)
    assert f"{path}: {message}" in one_line_error(capsys, ["train", "--data", path])


def test_genuine_files_still_load_even_headerless_ones_that_start_like_an_llmc_header(tmp_path):
    for version in (1, 2):
        path = llmc_file(tmp_path / f"v{version}.bin", data_version=version)
        file = open_token_file(path)
        assert file.layout == f"llm.c v{version}" and np.array_equal(file.tokens, TOKENS)
    # headerless tokens whose version field reads 1 (tokens 2, 3 = 1, 0): no matching count, no zeroed header
    tokens = np.concatenate([[5, 6, 1, 0], TOKENS]).astype("<u2")
    tokens.tofile(tmp_path / "ngpt.bin")
    file = open_token_file(str(tmp_path / "ngpt.bin"))
    assert file.layout == "nanoGPT" and np.array_equal(file.tokens, tokens)
    np.zeros(600, "<u2").tofile(tmp_path / "zeros.bin")  # all zeros: version 0, no llm.c version
    assert open_token_file(str(tmp_path / "zeros.bin")).layout == "nanoGPT"
    np.arange(100, dtype="<u2").tofile(tmp_path / "short.bin")  # shorter than a header
    assert len(open_token_file(str(tmp_path / "short.bin"))) == 100
