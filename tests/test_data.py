"""Data: the global batch of a step depends only on (seed, step), never on the split; real sources and their errors."""

import contextlib
import json
import os
import sys

import numpy as np
import pytest
import torch

from zerotrain.cli.main import main
from zerotrain.config import Config
from zerotrain.data import (IGNORE, BatchSchedule, SyntheticSource, TokenSource, check_source, corpus, documents,
                            load_tokenizer, make_source, prepare_source)
from zerotrain.data.tokenfiles import HEADER_BYTES, LLMC_MAGIC, open_token_file, write_llmc


def global_batch(source, step, world, micro, accum, schedule=BatchSchedule):
    xs, ys, counts = [], [], set()
    for rank in range(world):
        batch = schedule(source, micro_batch=micro, accum=accum, rank=rank, world_size=world).batch(step)
        counts.add(batch.global_tokens)
        for x, y, _ in batch.micro_batches:
            assert x.shape == (micro, source.seq_len)
            xs.append(x)
            ys.append(y)
    assert len(counts) == 1  # every rank agrees on the global token count
    return torch.cat(xs), torch.cat(ys), counts.pop()


class RankLocalSchedule(BatchSchedule):
    """Planted bug: each rank numbers its sequences from 0, so the global batch depends on the split."""

    def batch(self, step):
        rank, self.rank = self.rank, 0
        try:
            return super().batch(step)
        finally:
            self.rank = rank


def assert_split_invariant(source):
    x1, y1, n1 = global_batch(source, 3, 1, 8, 1)
    for world, micro, accum in [(2, 4, 1), (2, 2, 2), (4, 1, 2)]:
        x, y, n = global_batch(source, 3, world, micro, accum)
        assert torch.equal(x, x1) and torch.equal(y, y1) and n == n1
    assert n1 == int((y1 != IGNORE).sum())
    x_other, _, _ = global_batch(source, 4, 1, 8, 1)
    assert not torch.equal(x_other, x1)  # another step is another batch
    x_bug, _, _ = global_batch(source, 3, 2, 4, 1, schedule=RankLocalSchedule)
    assert not torch.equal(x_bug, x1)  # the planted rank-local numbering is caught


def config(source, tmp_path, **data) -> Config:
    cfg = Config()
    cfg.data.source, cfg.data.cache_dir = str(source), str(tmp_path / "cache")
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def nanogpt_folder(path, train, val, meta=None):
    os.makedirs(path, exist_ok=True)
    np.asarray(train, dtype="<u2").tofile(path / "train.bin")
    np.asarray(val, dtype="<u2").tofile(path / "val.bin")
    if meta is not None:
        (path / "meta.json").write_text(json.dumps(meta))
    return path


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerotrain: error: "), err
    return err


# ---------------------------------------------------------------- synthetic data, as before
@pytest.mark.parametrize("varlen", [False, True])
def test_split_over_ranks_and_micro_batches_does_not_change_the_global_batch(varlen):
    assert_split_invariant(SyntheticSource(64, 16, seed=1, varlen=varlen))


def test_varlen_batches_mask_padding_and_vary_in_real_tokens():
    source = SyntheticSource(64, 16, seed=0, varlen=True)
    x, y, _ = source.sequences(0, range(32))
    # The lengths are a stream of their own: the same sequences at full length hold every row's tokens, the last
    # target of a full row (which no input shows) included.
    full_x, full_y, _ = SyntheticSource(64, 16, seed=0).sequences(0, range(32))
    assert torch.equal(full_y[:, :-1], full_x[:, 1:])  # labels are the inputs shifted by one
    real = (y != IGNORE).sum(dim=1)
    assert real.min() == 1 and real.max() == 16 and len(set(real.tolist())) > 4  # both ends of the range
    for row in range(32):
        n = int(real[row])  # n targets, n + 1 real tokens: the inputs hold min(n + 1, 16) of them
        assert torch.equal(y[row, :n], full_y[row, :n]) and (y[row, n:] == IGNORE).all()
        assert torch.equal(x[row, : n + 1], full_x[row, : n + 1]) and (x[row, n + 1 :] == 0).all()


def test_synthetic_data_follows_its_markov_chain():
    source = SyntheticSource(64, 16, seed=0)
    x, y, _ = source.sequences(0, range(64))
    follows = (torch.from_numpy(source.perm)[x] == y).float().mean().item()
    assert 0.75 < follows < 0.9  # 80% chain + 20% noise (which can hit the chain by chance)


def test_synthetic_validation_follows_the_same_chain_with_other_draws(tmp_path):
    cfg = config("synthetic", tmp_path)
    train, val = make_source(cfg), make_source(cfg, split="val")
    assert np.array_equal(train.perm, val.perm)
    assert not torch.equal(train.sequences(0, range(8))[0], val.sequences(0, range(8))[0])
    assert torch.equal(val.sequences(2, range(8))[0], make_source(cfg, split="val").sequences(2, range(8))[0])


# ---------------------------------------------------------------- token files made by other tools
def test_nanogpt_token_folder_trains_as_is_with_tokens_above_255(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 1000, 5000), rng.integers(0, 1000, 600)
    folder = nanogpt_folder(tmp_path / "ngpt", train, val, meta={"vocab_size": 1000})
    cfg = config(folder, tmp_path)
    spec = check_source(cfg)
    assert cfg.model.vocab_size == 1000 and spec.val == [str(folder / "val.bin")]
    source = make_source(cfg)
    assert isinstance(source.files[0].tokens, np.memmap)  # read through a memmap, never loaded whole
    x, y, _ = source.sequences(0, range(32))
    assert int(x.max()) > 255
    for row in range(32):  # every sequence is a window of the file, its labels the next tokens
        window = np.concatenate([x[row].numpy(), y[row, -1:].numpy()])
        starts = np.flatnonzero(np.lib.stride_tricks.sliding_window_view(train, 17).__eq__(window).all(axis=1))
        assert len(starts) and torch.equal(y[row, :-1], x[row, 1:])
    assert_split_invariant(source)
    vx, _, _ = make_source(cfg, split="val").sequences(0, range(4))
    assert all(np.isin(vx[r].numpy(), val).all() for r in range(4))


def test_nanogpt_folder_without_meta_json_infers_the_vocabulary_and_never_reads_meta_pkl(tmp_path, capsys):
    folder = nanogpt_folder(tmp_path / "ngpt", [5, 700, 3] * 20, [1, 2, 3] * 10)
    (folder / "meta.pkl").write_bytes(b"\x80\x04 not to be unpickled")
    cfg = config(folder, tmp_path)
    check_source(cfg)
    assert cfg.model.vocab_size == 701
    err = capsys.readouterr().err
    assert "largest token id + 1 = 701" in err and "meta.pkl is not read" in err
    cfg = config(folder, tmp_path)
    cfg.model.vocab_size = 50257
    check_source(cfg, vocab_given=True)  # an explicit --vocab-size at least the largest id + 1 is kept
    assert cfg.model.vocab_size == 50257


@pytest.mark.parametrize("version, top", [(1, 65535), (2, 70000)])
def test_llmc_token_files_with_header_train_as_is(tmp_path, version, top):
    rng = np.random.default_rng(1)
    train = np.append(rng.integers(0, top, 3000), top)
    folder = tmp_path / "llmc"
    folder.mkdir()
    write_llmc(str(folder / "tiny_train.bin"), train, vocab_size=top + 1)
    write_llmc(str(folder / "tiny_val.bin"), train[:100], vocab_size=top + 1)
    header = np.fromfile(folder / "tiny_train.bin", dtype="<i4", count=256)
    assert list(header[:3]) == [LLMC_MAGIC, version, len(train)]
    assert os.path.getsize(folder / "tiny_train.bin") == HEADER_BYTES + len(train) * (2 if version == 1 else 4)
    for data in (folder, folder / "tiny_train.bin"):  # the folder, or the file with its _val sibling
        cfg = config(data, tmp_path)
        spec = check_source(cfg)
        assert cfg.model.vocab_size == top + 1 and spec.val == [str(folder / "tiny_val.bin")]
    source = make_source(cfg)
    x, _, _ = source.sequences(0, range(16))
    assert int(x.max()) > 255 and open_token_file(str(folder / "tiny_train.bin")).layout == f"llm.c v{version}"
    assert_split_invariant(source)


def test_a_token_id_at_or_above_the_vocabulary_is_caught(tmp_path, capsys):
    train = np.arange(2000) % 1000
    train[1234] = 1000  # planted: one id past meta.json's vocabulary
    folder = nanogpt_folder(tmp_path / "ngpt", train, [1, 2, 3] * 10, meta={"vocab_size": 1000})
    err = one_line_error(capsys, ["train", "--data", str(folder)])
    assert f"token id 1000 at position 1234 of {folder / 'train.bin'}" in err and "vocabulary size 1000" in err
    train[1234] = 999
    nanogpt_folder(folder, train, [1, 2, 3] * 10)
    cfg = config(folder, tmp_path)
    check_source(cfg)  # the same folder without the planted id passes
    err = one_line_error(capsys, ["train", "--data", str(folder), "--vocab-size", "512"])
    assert "--vocab-size 512 is too small for --data" in err and "1000 ids" in err
    source = make_source(cfg)  # a file changed after the start-up scan is still caught, per sequence
    source.vocab_size = 999
    with pytest.raises(ValueError, match="token id 999"):
        for step in range(50):
            source.sequences(step, range(8))


@pytest.mark.parametrize("content, message", [
    (b"\x01\x02\x03", "neither an llm.c token file"),  # odd size, no header
    (np.array([LLMC_MAGIC, 3, 0] + [0] * 253, "<i4").tobytes(), "llm.c header has version 3"),
    (np.array([LLMC_MAGIC, 1, 500] + [0] * 253, "<i4").tobytes() + bytes(10), "truncated or not a token file"),
])
def test_a_bin_file_in_neither_format_is_refused_in_one_line(tmp_path, capsys, content, message):
    (tmp_path / "train.bin").write_bytes(content)
    assert message in one_line_error(capsys, ["train", "--data", str(tmp_path / "train.bin")])


# ---------------------------------------------------------------- text
def test_binary_and_non_utf8_files_are_refused_naming_the_first_bad_byte(tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 au lait\n".encode("utf-8") + "na\u00efve".encode("latin-1"))
    err = one_line_error(capsys, ["train", "--data", str(bad)])
    assert f"--data {bad}: not UTF-8 text: invalid byte 0xef at offset 16" in err
    binary = tmp_path / "weights.bin.txt"
    binary.write_bytes(b"PK\x03\x04\x00\x00\xff\xfe")
    assert "not UTF-8 text: NUL byte at offset 4 (a binary file?)" in one_line_error(capsys, ["train", "--data",
                                                                                            str(binary)])
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("fine text\n" * 10)
    (folder / "sub" / "b.txt").write_bytes(b"ok then \xc3(")
    assert f"{folder / 'sub' / 'b.txt'}: not UTF-8 text: invalid byte 0xc3 at offset 8" in \
        one_line_error(capsys, ["train", "--data", str(folder)])


def test_missing_paths_and_empty_folders_are_one_line_errors(tmp_path, capsys):
    assert "nope.txt: no such file or folder" in one_line_error(capsys, ["train", "--data", "nope.txt"])
    (tmp_path / "empty").mkdir()
    assert "no file matches --glob '**/*.txt'" in one_line_error(capsys, ["train", "--data", str(tmp_path / "empty")])
    (tmp_path / "empty" / "notes.md").write_text("# notes\n")
    assert "no file matches --glob '*.rst'" in one_line_error(capsys, ["train", "--data", str(tmp_path / "empty"),
                                                                       "--glob", "*.rst"])
    short = tmp_path / "short.txt"
    short.write_text("abc")
    assert "fewer than one sequence of --seq-len 16" in one_line_error(capsys, ["train", "--data", str(short)])
    assert "--val-fraction must be in [0, 1)" in one_line_error(capsys, ["train", "--data", str(short),
                                                                         "--val-fraction", "1.5"])


def test_text_folder_splits_by_file_and_unpacked_sequences_are_documents(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(40):
        (folder / f"doc{i:02d}.txt").write_text(f"document number {i}: " + "words " * (i + 3))
    (folder / "skip.md").write_text("not matched by the glob")
    cfg = config(folder, tmp_path, val_fraction=0.2)
    cfg.model.seq_len = 64  # the shorter documents fit whole
    spec = check_source(cfg)
    meta = json.load(open(os.path.join(spec.folder, "meta.json")))
    assert cfg.model.vocab_size == 256 and meta["train"]["documents"] + meta["val"]["documents"] == 40
    assert 2 <= meta["val"]["documents"] <= 16
    tok = load_tokenizer(spec.folder)
    train_docs = tok.decode(np.fromfile(spec.train[0], "<u2", offset=HEADER_BYTES)).split("<|endoftext|>")[:-1]
    val_docs = tok.decode(np.fromfile(spec.val[0], "<u2", offset=HEADER_BYTES)).split("<|endoftext|>")[:-1]
    originals = {(folder / f"doc{i:02d}.txt").read_text() for i in range(40)}
    assert set(train_docs) | set(val_docs) == originals and not set(train_docs) & set(val_docs)
    cfg.data.pack, cfg.data.truncate = False, True  # the longer documents keep their first 65 tokens
    source = make_source(cfg, global_batch=16)
    x, y, _ = source.sequences(0, range(16))
    for row in range(16):  # one document per sequence: it starts a document and ends with end-of-text
        n = int((y[row] != IGNORE).sum())
        text = bytes(x[row, :n].tolist() + [int(y[row, n - 1])])
        assert text.startswith(b"document number") and (n == 64 or text.endswith(b"\0"))
        assert b"\0" not in text[:-1]
    assert source.token_count(0, 16) == int((y != IGNORE).sum())


def test_one_text_file_splits_by_blank_line_paragraphs(tmp_path):
    path = tmp_path / "t.txt"
    paragraphs = [f"paragraph {i} says something long enough" for i in range(30)]
    path.write_text("\n\n".join(paragraphs) + "\n\n\n")
    cfg = config(path, tmp_path)
    spec = check_source(cfg)
    tok = load_tokenizer(spec.folder)
    split = {s: tok.decode(np.fromfile(getattr(spec, s)[0], "<u2", offset=HEADER_BYTES)).split("<|endoftext|>")[:-1]
             for s in ("train", "val")}
    assert sorted(split["train"] + split["val"]) == sorted(paragraphs) and split["val"] and split["train"]
    source = make_source(cfg)
    x, _, _ = source.sequences(0, range(4))
    assert all(piece in path.read_bytes() for r in x.tolist() for piece in bytes(r).split(b"\0"))


def test_validation_batches_are_fixed_whatever_the_seed_and_apart_from_training(tmp_path):
    folder = nanogpt_folder(tmp_path / "ngpt", np.arange(3000) % 500, 500 + np.arange(800) % 300,
                            meta={"vocab_size": 800})
    cfg = config(folder, tmp_path)
    check_source(cfg)
    val = make_source(cfg, split="val")
    first = [val.sequences(k, range(8))[0] for k in range(3)]
    cfg.loop.seed = 7
    again = make_source(cfg, split="val")
    assert all(torch.equal(a, again.sequences(k, range(8))[0]) for k, a in enumerate(first))
    assert all(int(a.min()) >= 500 for a in first)  # drawn from val.bin only
    assert not torch.equal(first[0], first[1])
    # planted bug: validation seeded by the run seed would change with --seed
    seeded = TokenSource(again.files, cfg.model.seq_len, cfg.loop.seed, cfg.model.vocab_size)
    assert not torch.equal(seeded.sequences(0, range(8))[0], first[0])


# ---------------------------------------------------------------- the embedded default corpus
def test_embedded_stdlib_corpus_builds_once_is_cached_and_keeps_val_files_apart(tmp_path, monkeypatch):
    builds = []
    real = corpus.prepare_corpus
    monkeypatch.setattr(corpus, "prepare_corpus", lambda *a, **k: builds.append(1) or real(*a, **k))
    monkeypatch.setenv("ZEROTRAIN_CACHE", str(tmp_path / "cache"))
    cfg = Config()
    assert cfg.data.source == "python-stdlib"
    prepare_source(cfg)  # the launcher's call: builds
    spec = check_source(cfg)  # finds it built
    assert len(builds) == 1 and cfg.model.vocab_size == 256 and os.path.dirname(spec.folder) == str(tmp_path / "cache")
    meta = json.load(open(os.path.join(spec.folder, "meta.json")))
    stamp = os.path.getmtime(os.path.join(spec.folder, "meta.json"))
    make_source(cfg), make_source(cfg, split="val")  # ranks only read
    assert len(builds) == 1 and os.path.getmtime(os.path.join(spec.folder, "meta.json")) == stamp
    assert meta["python_version"] == sys.version.split()[0] and spec.folder.endswith(meta["content_hash"][:16])
    names = documents.stdlib_files()
    assert names == sorted(names) and "os.py" in names
    assert not any(set(n.split("/")[:-1]) & {"test", "tests", "idle_test", "site-packages"} for n in names)
    splits = documents.assign_splits(names, 0.05)
    assert meta["val"]["documents"] == splits.count("val") > 0 and meta["train"]["documents"] == splits.count("train")
    train = np.fromfile(spec.train[0], "<u2", offset=HEADER_BYTES)
    val = np.fromfile(spec.val[0], "<u2", offset=HEADER_BYTES)
    assert int((train == 0).sum()) == splits.count("train") and int((val == 0).sum()) == splits.count("val")
    root = documents.stdlib_root()
    val_texts = [open(os.path.join(root, n), "rb").read() for n, s in zip(names, splits) if s == "val"]
    assert val.astype(np.uint8).tobytes().startswith(val_texts[0] + b"\0")  # in path order, end-of-text after each
    assert max(val_texts, key=len) not in train.astype(np.uint8).tobytes()
    assert documents.assign_splits(names, 0.05) == splits  # deterministic: a hash of the path


def test_the_split_is_stable_and_a_nondeterministic_split_would_be_caught(tmp_path, monkeypatch):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(30):
        (folder / f"{i}.txt").write_text(f"text {i} " * 8)
    first = documents.folder_input(str(folder), "*.txt", 0.2)
    (folder / "new.txt").write_text("a new file does not move the others")
    again = documents.folder_input(str(folder), "*.txt", 0.2)
    before = {d.name: d.split for d in first.documents}
    assert all(before[d.name] == d.split for d in again.documents if d.name in before)
    rng = np.random.default_rng()  # planted bug: a split drawn at random each time the input is read
    monkeypatch.setattr(documents, "assign_splits", lambda names, f: ["val" if rng.random() < 0.5 else "train"
                                                                       for _ in names])
    drawn = [[d.split for d in documents.folder_input(str(folder), "*.txt", 0.2).documents] for _ in range(2)]
    assert drawn[0] != drawn[1]


def test_explicit_vocab_too_small_for_text_names_both_numbers(tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_text("some text that is long enough for a sequence or two\n" * 4)
    err = one_line_error(capsys, ["train", "--data", str(path), "--vocab-size", "100"])
    assert "--vocab-size 100 is too small for --data" in err and "256 ids" in err


def _build_in_child(folder, cache, log, barrier, locked, inside):
    real = corpus.prepare_corpus

    def counted(*args, **kwargs):
        with open(log, "a") as f:
            f.write("built\n")
        if not locked:
            inside.wait(timeout=60)  # all three are building at once: no sleep, no timing luck
        return real(*args, **kwargs)

    corpus.prepare_corpus = counted
    if not locked:  # planted: no lock, every rank that finds no cache builds it
        corpus._locked = lambda path: contextlib.nullcontext()
    barrier.wait()  # all start at once, as ranks do
    print(corpus.cached_corpus(documents.folder_input(folder, "*.txt", 0.1), cache))


@pytest.mark.parametrize("locked", [True, False])
def test_ranks_starting_at_once_build_the_cache_once_and_atomically(tmp_path, locked):
    import multiprocessing

    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(20):
        (folder / f"{i}.txt").write_text(f"text {i} " * 2000)
    ctx = multiprocessing.get_context("fork")
    barrier, inside, log, cache = ctx.Barrier(3), ctx.Barrier(3), tmp_path / "builds.log", tmp_path / "cache"
    procs = [ctx.Process(target=_build_in_child, args=(str(folder), str(cache), str(log), barrier, locked, inside))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    builds = open(log).read().count("built")
    assert builds == 1 if locked else builds == 3  # one built under the lock; without it, each rank did
    (built,) = [n for n in os.listdir(cache) if not n.startswith(".")]  # either way, one complete folder ...
    assert not [n for n in os.listdir(cache) if n.endswith(".tmp")]  # ... and no half-written one left
    assert sorted(os.listdir(cache / built)) == ["meta.json", "train.bin", "val.bin"]
