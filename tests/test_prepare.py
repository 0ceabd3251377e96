"""`zerotrain prepare`: a local BPE that round-trips, llm.c token files, meta.json; checkpoints keep the tokenizer."""

import hashlib
import json
import os

import numpy as np
import pytest
from conftest import tiny_config

from zerotrain import checkpoint
from zerotrain.cli.commands import prepare
from zerotrain.cli.flags import Parser
from zerotrain.data import check_source, load_tokenizer, make_source
from zerotrain.data.tokenfiles import HEADER_BYTES, LLMC_MAGIC
from zerotrain.data.tokenizer import EOT_TEXT
from zerotrain.errors import ConfigError

TEXT = "\n\n".join(
    f"def function_{i}(x, y):\n    \"\"\"Return the {i}th combination of x and y.\"\"\"\n"
    f"    return x * {i} + y - {i % 7}\n"
    for i in range(60))


def run_prepare(*argv) -> int:
    """`zerotrain prepare ARGV` through the command's own parser (whatever cli.py registers)."""
    parser = Parser(prog="zerotrain")
    prepare.add_parser(parser.add_subparsers(dest="command", required=True, parser_class=Parser))
    args = parser.parse_args(["prepare", *map(str, argv)])
    return args.func(args)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """TEXT (60 paragraphs) prepared with a 300-id BPE."""
    root = tmp_path_factory.mktemp("prep")
    (root / "code.txt").write_text(TEXT)
    assert run_prepare(root / "code.txt", root / "bpe", "--tokenizer", "bpe:300", "--val-fraction", "0.1") == 0
    return root / "bpe"


def read_llmc(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    dtype = {1: "<u2", 2: "<u4"}[int(header[1])]
    return header, np.fromfile(path, dtype=dtype, offset=HEADER_BYTES)


def test_prepare_bpe_round_trips_and_writes_llmc_files_with_meta(prepared, capsys):
    assert sorted(os.listdir(prepared)) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    meta = json.load(open(prepared / "meta.json"))
    tok = load_tokenizer(str(prepared))
    assert (tok.kind, tok.vocab_size, tok.eot_id) == ("bpe", 300, 0) == ("bpe", meta["vocab_size"], meta["eot_id"])
    assert meta["tokenizer"] == {"kind": "bpe", "vocab_size": 300, "eot_id": 0, "file": "tokenizer.json"}
    docs = {}
    for split in ("train", "val"):
        header, tokens = read_llmc(prepared / f"{split}.bin")
        assert list(header[:3]) == [LLMC_MAGIC, 1, len(tokens)] and not header[3:].any()  # uint16, version 1
        entry = meta[split]
        assert entry["tokens"] == len(tokens) and entry["bytes"] == os.path.getsize(prepared / f"{split}.bin")
        assert entry["sha256"] == hashlib.sha256(open(prepared / f"{split}.bin", "rb").read()).hexdigest()
        assert tokens[-1] == 0 and int(tokens.max()) > 255  # documents end with end-of-text; merges are used
        docs[split] = tok.decode(tokens).split(EOT_TEXT)[:-1]
        assert entry["documents"] == len(docs[split]) > 0
    assert sorted(docs["train"] + docs["val"]) == sorted(p.strip("\n") for p in TEXT.split("\n\n"))
    for text in (TEXT[:500], "naïve café ∑ 🙂 and a new word: zyzzyva", f"one{EOT_TEXT}two"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text and max(ids) < 300
    assert len(tok.encode(TEXT[:500])) < len(TEXT[:500].encode()) / 2  # the BPE compresses what it was trained on
    assert tok.encode(f"a{EOT_TEXT}b")[1] == 0
    assert meta["tokens_per_s"] > 0 and meta["timings"]["total_s"] > 0 and "tokenizer_train_s" in meta["timings"]


def test_training_on_a_prepared_folder_takes_its_vocabulary_and_tokenizer(prepared, tmp_path):
    cfg = tiny_config(tmp_path)
    cfg.data.source = str(prepared)
    spec = check_source(cfg)
    assert cfg.model.vocab_size == 300 and spec.tokenizer_file == str(prepared / "tokenizer.json")
    x, _, _ = make_source(cfg).sequences(0, range(8))
    assert int(x.max()) < 300


def test_prepare_bytes_and_the_byte_tokenizer(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    assert run_prepare(tmp_path / "t.txt", tmp_path / "bytes") == 0
    assert "tokenizer.json" not in os.listdir(tmp_path / "bytes")
    tok = load_tokenizer(str(tmp_path / "bytes"))
    assert (tok.kind, tok.vocab_size, tok.eot_id) == ("bytes", 256, 0)
    _, tokens = read_llmc(tmp_path / "bytes" / "train.bin")
    assert tok.decode(tokens).split(EOT_TEXT)[0] in TEXT
    assert tok.decode(tok.encode(f"é{EOT_TEXT}x")) == f"é{EOT_TEXT}x" and tok.encode(EOT_TEXT) == [0]


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer", "bpe:100"], "needs N >= 257"),
    (["--tokenizer", "wordpiece"], "use bytes, bpe:N"),
    (["--val-fraction", "1"], "argument --val-fraction: must be in [0, 1)"),
])
def test_prepare_refuses_bad_options_in_one_line(tmp_path, argv, message):
    (tmp_path / "t.txt").write_text(TEXT)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as e:
        run_prepare(tmp_path / "t.txt", tmp_path / "out", *argv)
    assert "\n" not in str(e.value)


def test_prepare_refuses_a_non_utf8_input_and_an_occupied_outdir(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"good start \x80 bad")
    with pytest.raises(ConfigError, match="invalid byte 0x80 at offset 11"):
        run_prepare(tmp_path / "bad.txt", tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")  # nothing half-written is left
    (tmp_path / "t.txt").write_text(TEXT)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists"):
        run_prepare(tmp_path / "t.txt", tmp_path / "out")
    assert run_prepare(tmp_path / "t.txt", tmp_path / "out", "--overwrite") == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "train.bin", "val.bin"]
    with pytest.raises(ConfigError, match="no such file or folder"):
        run_prepare(tmp_path / "missing", tmp_path / "out2")


def test_checkpoints_keep_the_tokenizer_and_verify_catches_a_changed_one(prepared, tmp_path, one_rank):
    from zerotrain.training.loop import train

    cfg = tiny_config(tmp_path, steps=2)
    cfg.data.source, cfg.checkpoint.every = str(prepared), 2
    check_source(cfg)
    folder = train(cfg, one_rank).checkpoints[-1]
    manifest = checkpoint.read_manifest(folder)
    assert manifest["tokenizer"] == {"kind": "bpe", "vocab_size": 300, "eot_id": 0, "file": "tokenizer.json"}
    entry = next(f for f in manifest["files"] if f["name"] == "tokenizer.json")
    data = open(os.path.join(folder, "tokenizer.json"), "rb").read()
    assert data == open(prepared / "tokenizer.json", "rb").read()
    assert entry == {"name": "tokenizer.json", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    checkpoint.verify_or_raise(folder)
    tok = load_tokenizer(folder)
    assert tok.kind == "bpe" and tok.encode(TEXT[:200]) == load_tokenizer(str(prepared)).encode(TEXT[:200])
    assert load_tokenizer(os.path.dirname(folder)).kind == "bpe"  # a checkpoint root: what `latest` names
    with open(os.path.join(folder, "tokenizer.json"), "r+b") as f:  # planted: the tokenizer changed after the save
        f.seek(len(data) // 2)
        f.write(b"#")
    with pytest.raises(checkpoint.CheckpointError, match="tokenizer.json: sha256"):
        checkpoint.verify_or_raise(folder)
    os.remove(os.path.join(folder, "tokenizer.json"))
    with pytest.raises(checkpoint.CheckpointError, match="tokenizer.json: is missing"):
        checkpoint.verify_or_raise(folder)


def test_byte_level_runs_record_the_byte_tokenizer_without_a_file(tmp_path, one_rank):
    from zerotrain.training.loop import train

    (tmp_path / "t.txt").write_text(TEXT)
    cfg = tiny_config(tmp_path / "run", steps=1)
    cfg.data.source, cfg.data.cache_dir, cfg.checkpoint.every = str(tmp_path / "t.txt"), str(tmp_path / "cache"), 1
    check_source(cfg)
    folder = train(cfg, one_rank).checkpoints[-1]
    manifest = checkpoint.read_manifest(folder)
    assert manifest["tokenizer"] == {"kind": "bytes", "vocab_size": 256, "eot_id": 0}
    assert "tokenizer.json" not in os.listdir(folder) and load_tokenizer(folder).kind == "bytes"
    checkpoint.verify_or_raise(folder)


def test_prepare_and_export_refuse_an_unwritable_destination_in_one_line_before_any_work(tmp_path, capsys):
    """A destination below a file (and, where the machine has one, on a read-only file system) is refused naming it,
    exit 2, as train refuses such a folder: it ended in a traceback (OSError) after the work was done."""
    from zerotrain.cli.main import main

    (tmp_path / "t.txt").write_text(TEXT)
    (tmp_path / "a-file").write_text("")
    for command in (["prepare", str(tmp_path / "t.txt")], ["export", str(tmp_path / "no-run-needed")]):
        out = str(tmp_path / "a-file" / "out")
        assert main([*command, out] + (["--format", "hf"] if command[0] == "export" else [])) == 2
        err = capsys.readouterr().err
        assert err == f"zerotrain: error: {command[0]} {out} cannot be written: Not a directory " \
                      f"({tmp_path / 'a-file'})\n", err
    read_only = "/sys/zerotrain-out"  # sysfs: read-only for root too, in containers and on most machines
    if not _can_make(read_only):
        assert main(["prepare", str(tmp_path / "t.txt"), read_only]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"zerotrain: error: prepare {read_only} cannot be written: ") and err.count("\n") == 1


def _can_make(folder: str) -> bool:
    try:
        os.mkdir(folder)
    except OSError:
        return False
    os.rmdir(folder)
    return True
