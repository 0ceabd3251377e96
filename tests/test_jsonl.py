"""Fine-tuning data: JSON Lines, JSON and Parquet records, the prompt masked out of the loss, a record index, output
independent of the chunk and the threads, bad lines named, CSV refused."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import tiny_config
from model_folders import read_prepared, tokenizer_folder, write_jsonl
from test_user_errors import one_line_error

from zerotrain.data import jsonl as jsonl_module
from zerotrain.data import resolve_data
from zerotrain.data import tokenfiles
from zerotrain.data.jsonl import prepare_jsonl, read_records
from zerotrain.data.tokenfiles import open_token_file
from zerotrain.errors import ConfigError

pytestmark = pytest.mark.timeout(300)

RECORDS = [{"prompt": f"Q{i}:", "completion": f" answer {i}"} for i in range(12)] + [{"text": "plain"}]
PREPARED = ("train.bin", "train.mask", "train.records", "val.bin", "val.mask", "val.records", "tokenizer.json")


def test_only_the_completion_and_its_end_of_text_are_targets_and_the_index_marks_each_record(tmp_path):
    meta = prepare_jsonl(write_jsonl(tmp_path / "ft.jsonl", RECORDS), str(tmp_path / "out"), val_fraction=0.0)
    assert meta["loss_mask"] and meta["train"]["record_count"] == 13 and meta["train"]["records"] == "train.records"
    records = read_prepared(tmp_path / "out")
    offsets = np.fromfile(tmp_path / "out" / "train.records", dtype="<u8")
    assert len(offsets) == 14 and offsets[0] == 0 and offsets[-1] == meta["train"]["tokens"]  # n_records + 1
    for record, (tokens, mask) in zip(RECORDS, records):
        assert bytes(tokens[mask == 0].tolist()).decode() == record.get("prompt", "")  # bytes: the prompt is context
        assert bytes(tokens[mask == 1][:-1].tolist()).decode() == record.get("completion", record.get("text"))
        assert tokens[-1] == 0 and mask[-1] == 1  # the end-of-text id of bytes is 0, trained on
    assert meta["train"]["trained_tokens"] == sum(int(m.sum()) for _, m in records)
    assert meta["train"]["longest_record"] == max(len(t) for t, _ in records)


def test_a_reader_that_forgets_the_mask_sees_the_prompt_as_targets(tmp_path, monkeypatch):
    prepare_jsonl(write_jsonl(tmp_path / "ft.jsonl", RECORDS[:12]), str(tmp_path / "out"), val_fraction=0.0)
    file = open_token_file(str(tmp_path / "out" / "train.bin"))
    assert b":" not in bytes(np.asarray(file.tokens)[np.asarray(file.mask) == 1])  # the prompts end in ":"
    monkeypatch.setattr(tokenfiles, "mask_path", lambda path: path + ".nowhere")  # planted: the mask is not read
    assert open_token_file(str(tmp_path / "out" / "train.bin")).mask is None


def prepared_files_equal(a, b) -> bool:
    return all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in PREPARED)


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    tokenizer_folder(folder)
    return folder


def test_the_output_does_not_depend_on_the_chunk_or_the_threads_and_a_planted_chunk_numbering_is_caught(
        bpe_folder, tmp_path, monkeypatch):
    records = [{"prompt": f"Question {i}:", "completion": f" {2 * i}"} if i % 3 else {"text": f"The user asks {i}."}
               for i in range(40)]
    jsonl = write_jsonl(tmp_path / "ft.jsonl", records)
    prepare_jsonl(jsonl, str(tmp_path / "whole"), str(bpe_folder), val_fraction=0.3)
    monkeypatch.setattr(jsonl_module, "CHUNK_RECORDS", 3)
    prepare_jsonl(jsonl, str(tmp_path / "chunks"), str(bpe_folder), val_fraction=0.3)
    assert prepared_files_equal(tmp_path / "whole", tmp_path / "chunks")
    for threads in ("1", "2"):  # the tokenizers library's thread pool, in a process of its own
        env = {**os.environ, "RAYON_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "true"}
        subprocess.run([sys.executable, "-m", "zerotrain", "prepare", jsonl, str(tmp_path / f"threads-{threads}"),
                        "--tokenizer", str(bpe_folder), "--val-fraction", "0.3"], check=True, env=env, timeout=240,
                       capture_output=True)
        assert prepared_files_equal(tmp_path / "whole", tmp_path / f"threads-{threads}")
    split_of = jsonl_module.SplitOf.__call__
    # planted: records numbered within their chunk, not the file (the split would depend on the chunk size)
    monkeypatch.setattr(jsonl_module.SplitOf, "__call__", lambda self, i: split_of(self, i % 3))
    prepare_jsonl(jsonl, str(tmp_path / "planted"), str(bpe_folder), val_fraction=0.3)
    assert not prepared_files_equal(tmp_path / "whole", tmp_path / "planted")


def test_a_json_file_is_read_as_records_never_as_text(tmp_path, capfd):
    from conftest import zerotrain_here

    lines = write_jsonl(tmp_path / "ft.jsonl", RECORDS)
    (tmp_path / "saved.json").write_text(open(lines).read())  # JSON Lines as pandas and datasets save .json
    (tmp_path / "alpaca.json").write_text(json.dumps(RECORDS, indent=2))  # an array of records
    prepare_jsonl(lines, str(tmp_path / "from-lines"), val_fraction=0.0)
    for name in ("saved.json", "alpaca.json"):
        prepare_jsonl(str(tmp_path / name), str(tmp_path / name[:-5]), val_fraction=0.0)
        for split_file in ("train.bin", "train.mask", "train.records"):
            assert filecmp.cmp(tmp_path / "from-lines" / split_file, tmp_path / name[:-5] / split_file, shallow=False)
    cfg = tiny_config(tmp_path)
    cfg.data.source, cfg.data.cache_dir, cfg.data.val_fraction = str(tmp_path / "alpaca.json"), str(tmp_path / "c"), 0.0
    spec = resolve_data(cfg)  # train --data alpaca.json: records with their mask, not braces and keys as text
    assert os.path.isfile(os.path.join(spec.folder, "train.mask"))
    assert open_token_file(spec.train[0]).tokens.tobytes() == open_token_file(
        str(tmp_path / "from-lines" / "train.bin")).tokens.tobytes()
    (tmp_path / "text.json").write_text('"just a string"')
    line = one_line_error(zerotrain_here(capfd, "train", "--data", str(tmp_path / "text.json"), "--steps", "1",
                                         "--data-cache", str(tmp_path / "c"), "--no-progress"))
    assert f"{tmp_path / 'text.json'}: a .json file is read as a JSON array of records or as JSON Lines" in line
    with pytest.raises(ConfigError, match=r"alpaca2\.json\[1\]: has neither"):
        (tmp_path / "alpaca2.json").write_text(json.dumps([RECORDS[0], {"instruction": "x"}]))
        read_records(str(tmp_path / "alpaca2.json"))


def test_a_parquet_file_is_read_by_its_record_columns_as_the_same_json_lines(bpe_folder, tmp_path, capfd):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import zerotrain_here

    chats = [{"messages": [{"role": "user", "content": f"Question {i}:"}, {"role": "assistant", "content": f"{i}"}],
              "source": "x"} for i in range(5)]
    tables = {"pc": RECORDS[:12], "text": [{"text": f"The user asks {i}.", "id": i} for i in range(7)], "chats": chats}
    chatml = tmp_path / "chatml"
    from model_folders import CHATML

    tokenizer_folder(chatml, template=CHATML, eos="<|im_end|>")
    for name, records in tables.items():
        tokenizer = str(chatml if name == "chats" else bpe_folder)
        pq.write_table(pa.Table.from_pylist(records), tmp_path / f"{name}.parquet", row_group_size=4)
        # val_fraction 0: the split hashes the file's name, which differs
        prepare_jsonl(write_jsonl(tmp_path / f"{name}.jsonl", records), str(tmp_path / f"{name}-lines"), tokenizer, 0.0)
        prepare_jsonl(str(tmp_path / f"{name}.parquet"), str(tmp_path / f"{name}-parquet"), tokenizer, 0.0)
        assert all(filecmp.cmp(tmp_path / f"{name}-lines" / n, tmp_path / f"{name}-parquet" / n, shallow=False)
                   for n in PREPARED if n != "tokenizer.json")
    pq.write_table(pa.Table.from_pylist([{"question": "x", "answer": "y"}]), tmp_path / "qa.parquet")
    line = one_line_error(zerotrain_here(capfd, "prepare", str(tmp_path / "qa.parquet"), str(tmp_path / "o")))
    assert f"{tmp_path / 'qa.parquet'}: no \"messages\", \"text\", \"prompt\" and \"completion\", \"conversations\" " \
           "(ShareGPT) or \"instruction\" and \"output\" (Alpaca) column (columns: question, answer)" in line
    pq.write_table(pa.Table.from_pylist([{"text": "fine"}, {"text": None}]), tmp_path / "null.parquet")
    with pytest.raises(ConfigError, match=r"null\.parquet\[1\]: \"text\" is None, not a string"):
        read_records(str(tmp_path / "null.parquet"))


@pytest.mark.parametrize("line, why", [
    ('{"text": "ok"', "not JSON"),
    ('["text"]', "a JSON list, not an object"),
    ('{"prompt": "only"}', 'has neither "text" nor "prompt" and "completion" nor "messages" nor "conversations" '
                           '(ShareGPT) nor "instruction" and "output" (Alpaca) (keys: prompt)'),
    ('{"prompt": "x", "completion": 3}', '"completion" is 3, not a string'),
    ('{"text": null}', '"text" is None, not a string'),
])
def test_a_bad_line_is_named_by_its_number(tmp_path, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(ConfigError) as raised:
        read_records(str(path))
    assert str(raised.value).startswith(f"{path}:3: ") and why in str(raised.value)


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not UTF-8 text"):
        prepare_jsonl(str(path), str(tmp_path / "out"))


def test_a_table_is_refused_with_a_hint(tmp_path):
    for name in ("data.csv", "data.tsv"):
        with pytest.raises(ConfigError, match="a table is not read as text; write its text, prompt/completion or "
                                              r"messages columns as JSON Lines \(pandas: pd.read_"):
            jsonl_module.refuse_table(str(tmp_path / name), "--data")


def test_records_shorter_than_one_window_train_packed_each_step_records_its_epoch_and_a_short_text_is_refused(tmp_path, capfd):
    """Records are packed whole into windows, so a file of fewer tokens than one window still trains; a text (read as
    random windows over one stream) that short cannot fill a window and stays refused."""
    from conftest import zerotrain_here

    data = write_jsonl(tmp_path / "few.jsonl", [{"prompt": "a", "completion": "b"}] * 4)
    r = zerotrain_here(capfd, "train", "--data", data, "--seq-len", "64", "--steps", "2", "--micro-batch", "1",
                       "--val-fraction", "0", "--no-progress", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "4 records, packed 4.0 per window of 64 (1 window in epoch 1)" in r.stdout, r.stdout
    with open(tmp_path / "run" / "metrics.jsonl") as f:  # one window per epoch: each step is an epoch of its own
        assert [json.loads(line).get("epoch") for line in f] == [1, 2]
    text = tmp_path / "few.txt"
    text.write_text("ab" * 10)
    r = zerotrain_here(capfd, "train", "--data", str(text), "--seq-len", "64", "--steps", "1", "--no-progress",
                       "--out", str(tmp_path / "text"))
    assert r.returncode == 2 and "fewer than one sequence of --seq-len 64" in r.stderr, r.stderr


def test_a_process_hashes_its_input_once_and_again_only_when_a_file_of_it_changes(tmp_path, monkeypatch):
    """A run resolves its training and validation data separately: the input is hashed once per process to find its
    prepared copy. Planted: a process that remembers nothing hashes it at every resolution."""
    from zerotrain.data import resolve as resolve_module

    cfg = tiny_config(tmp_path)
    cfg.data.source = write_jsonl(tmp_path / "records.jsonl", [{"text": f"record {i}"} for i in range(8)])
    cfg.data.cache_dir = str(tmp_path / "cache")
    hashed, real = [], resolve_module.sha256_file
    monkeypatch.setattr(resolve_module, "sha256_file", lambda path: (hashed.append(path), real(path))[1])
    first = resolve_data(cfg).folder
    assert resolve_data(cfg).folder == first and len(hashed) == 1
    write_jsonl(cfg.data.source, [{"text": f"record {i}"} for i in range(9)])  # changed: another size
    assert resolve_data(cfg).folder != first and len(hashed) == 2

    class Forgetful(dict):
        def __contains__(self, key):
            return False

    monkeypatch.setattr(resolve_module, "_PREPARED", Forgetful())
    resolve_data(cfg), resolve_data(cfg)
    assert len(hashed) == 4
