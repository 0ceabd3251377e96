"""The common formats as messages: ShareGPT, Alpaca, gzip and zstd JSON Lines, a save_to_disk folder and Parquet shards
prepare to the bytes of the same records written as {"messages": [...]} JSON Lines; bad records named in one line."""

from __future__ import annotations

import gzip
import json
import os
import sys

import pytest
import test_chat
from conftest import tiny_config, zerotrain_here
from model_folders import CHATML_MARKED, tokenizer_folder, write_jsonl
from test_user_errors import one_line_error

from zerotrain.data import formats
from zerotrain.data import jsonl as jsonl_module
from zerotrain.data import resolve_data
from zerotrain.data.jsonl import prepare_jsonl
from zerotrain.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

PREPARED = ("train.bin", "train.mask", "train.records", "val.bin", "val.mask", "val.records", "tokenizer.json")
CHATS = [*test_chat.CHATS, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Question 7"},
                            {"role": "assistant", "content": "14"}]] * 2
SPEAKERS = {"user": "human", "assistant": "gpt", "system": "system"}
# ShareGPT as it is written: the second chat's system turn as a "system" field (LLaMA-Factory's), extra keys kept out
SHAREGPT = [{"id": f"c{i}", "conversations": [{"from": SPEAKERS[m["role"]], "value": m["content"]} for m in chat]}
            for i, chat in enumerate(CHATS)]
SHAREGPT[1] = {"system": CHATS[1][0]["content"], "conversations": SHAREGPT[1]["conversations"][1:]}
# a table's rows have every column (None where a record has no such key)
SHAREGPT_ROWS = [{"id": r.get("id"), "system": r.get("system"), "conversations": r["conversations"]} for r in SHAREGPT]
ALPACA = [
    {"instruction": "Add the numbers.", "input": "3 plus 3", "output": "Answer: 6."},
    {"instruction": "Question 4: what is 4 plus 4?", "input": "", "output": "8"},
    {"instruction": "Say it again.", "output": "again"},  # no input at all
    {"instruction": "Question 7", "input": "plus 7", "output": "14", "system": "Be brief."},
    {"instruction": "and 5 plus 5?", "input": "", "output": "10", "history": [["Question 4:", "8"]]},
]
ALPACA_ROWS = [{k: r.get(k) for k in ("instruction", "input", "output", "system", "history")} for r in ALPACA]
# what the docs promise each Alpaca record is, written out by hand
ALPACA_CHATS = [
    [{"role": "user", "content": "Add the numbers.\n\n3 plus 3"}, {"role": "assistant", "content": "Answer: 6."}],
    [{"role": "user", "content": "Question 4: what is 4 plus 4?"}, {"role": "assistant", "content": "8"}],
    [{"role": "user", "content": "Say it again."}, {"role": "assistant", "content": "again"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Question 7\n\nplus 7"},
     {"role": "assistant", "content": "14"}],
    [{"role": "user", "content": "Question 4:"}, {"role": "assistant", "content": "8"},
     {"role": "user", "content": "and 5 plus 5?"}, {"role": "assistant", "content": "10"}],
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A ChatML tokenizer folder; the chats and the Alpaca records as messages JSON Lines, each prepared."""
    root = tmp_path_factory.mktemp("formats")
    tokenizer_folder(root / "chatml", template=CHATML_MARKED, eos="<|im_end|>")
    for name, chats in (("chats", CHATS), ("alpaca", ALPACA_CHATS)):
        write_jsonl(root / f"{name}.jsonl", [{"messages": m} for m in chats])
        prepare_jsonl(str(root / f"{name}.jsonl"), str(root / f"{name}-messages"), str(root / "chatml"), 0.0)
    return root


def same_prepared(a, b) -> bool:
    """Every token file byte for byte, and meta.json but for where the input was and how long it took."""
    def meta(folder):
        m = json.load(open(os.path.join(folder, "meta.json")))
        del m["source"]["input"], m["timings"], m["tokens_per_s"]
        return m
    return all(open(os.path.join(a, n), "rb").read() == open(os.path.join(b, n), "rb").read() for n in PREPARED) \
        and meta(a) == meta(b)


def write_zst(path, records) -> str:
    import zstandard

    path.write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    return str(path)


def write_shards(folder, records, shards: int, split: str = "train") -> str:
    """Parquet files as a hub download lays them out: data/{split}-0000k-of-0000n.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder / "data", exist_ok=True)
    (folder / "README.md").write_text("---\nconfigs: ...\n---\n")
    step = -(-len(records) // shards)
    for k in range(shards):
        pq.write_table(pa.Table.from_pylist(records[k * step : (k + 1) * step]),
                       folder / "data" / f"{split}-{k:05d}-of-{shards:05d}.parquet", row_group_size=2)
    return str(folder)


def save_to_disk(folder, records, **splits) -> str:
    import datasets

    datasets.disable_progress_bars()
    if splits:
        datasets.DatasetDict({"train": datasets.Dataset.from_list(records),
                              **{k: datasets.Dataset.from_list(v) for k, v in splits.items()}}).save_to_disk(folder)
    else:
        datasets.Dataset.from_list(records).save_to_disk(str(folder), max_shard_size=200)  # several Arrow files
    return str(folder)


def inputs(tmp):
    """Each format's file or folder of the same records, and the messages JSON Lines it must prepare to."""
    gz = tmp / "chats.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp / ".." / "chats.jsonl").read_bytes()))
    return {
        "sharegpt": (write_jsonl(tmp / "sharegpt.jsonl", SHAREGPT), "chats"),
        "alpaca": (write_jsonl(tmp / "alpaca.jsonl", ALPACA), "alpaca"),
        "gzip": (str(gz), "chats"),
        "zstd sharegpt": (write_zst(tmp / "sharegpt.jsonl.zst", SHAREGPT), "chats"),
        "save_to_disk alpaca": (save_to_disk(tmp / "alpaca-saved", ALPACA_ROWS), "alpaca"),
        "DatasetDict sharegpt": (save_to_disk(tmp / "dd", SHAREGPT_ROWS, test=SHAREGPT_ROWS[:1]), "chats"),
        "parquet shards sharegpt": (write_shards(tmp / "hub", SHAREGPT_ROWS, 3), "chats"),
    }


def test_every_format_prepares_to_the_bytes_of_its_messages_and_planted_role_and_split_bugs_are_caught(
        data, tmp_path, capfd, monkeypatch):
    tmp = data / "each"
    tmp.mkdir()
    write_shards(tmp / "hub", SHAREGPT_ROWS[:2], 1, split="test")  # a test split beside the train one: never read
    for name, (path, messages) in inputs(tmp).items():
        out = tmp / name.replace(" ", "-")
        r = zerotrain_here(capfd, "prepare", path, str(out), "--tokenizer", str(data / "chatml"), "--val-fraction", "0")
        assert r.returncode == 0, (name, r.stderr[-2000:])
        assert same_prepared(out, data / f"{messages}-messages"), name
    # the train path: --data FOLDER prepares the same into the cache, keyed by the folder's data files
    cfg = tiny_config(tmp_path)
    cfg.data.source, cfg.data.cache_dir, cfg.data.val_fraction = str(tmp / "hub"), str(tmp_path / "c"), 0.0
    cfg.checkpoint.init_from = str(data / "chatml")
    assert same_prepared(resolve_data(cfg).folder, data / "chats-messages")
    with monkeypatch.context() as planted:  # planted: the shards' names not read for their split (test rows trained on)
        planted.setattr(formats, "_split_of", lambda relative: None)
        prepare_jsonl(str(tmp / "hub"), str(tmp / "all-splits"), str(data / "chatml"), 0.0)
    assert not same_prepared(tmp / "all-splits", data / "chats-messages")
    # planted: the role map reads human as the assistant and gpt as the user
    monkeypatch.setitem(formats.SHAREGPT_ROLES, "human", "assistant")
    monkeypatch.setitem(formats.SHAREGPT_ROLES, "gpt", "user")
    prepare_jsonl(str(tmp / "sharegpt.jsonl"), str(tmp / "swapped"), str(data / "chatml"), 0.0)
    assert not same_prepared(tmp / "swapped", data / "chats-messages")


def test_alpaca_input_follows_a_blank_line_and_a_planted_dropped_input_is_caught(data, tmp_path, monkeypatch):
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    monkeypatch.setattr(formats, "alpaca_user", lambda instruction, given: instruction)
    prepare_jsonl(alpaca, str(tmp_path / "dropped"), str(data / "chatml"), 0.0)
    assert not same_prepared(tmp_path / "dropped", data / "alpaca-messages")


def test_compressing_a_file_keeps_its_split_and_a_planted_split_by_the_compressed_name_is_caught(
        data, tmp_path, monkeypatch):
    plain = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])
    gz = tmp_path / "chats.jsonl.gz"
    gz.write_bytes(gzip.compress(open(plain, "rb").read()))
    tokenizer = str(data / "chatml")
    meta = prepare_jsonl(plain, str(tmp_path / "plain"), tokenizer, 0.4)
    assert meta["train"]["record_count"] and meta["val"]["record_count"]  # both splits hold records
    prepare_jsonl(str(gz), str(tmp_path / "gz"), tokenizer, 0.4)
    assert same_prepared(tmp_path / "gz", tmp_path / "plain")
    monkeypatch.setattr(jsonl_module, "split_stem", lambda path: os.path.basename(path))
    prepare_jsonl(str(gz), str(tmp_path / "planted"), tokenizer, 0.4)
    assert not same_prepared(tmp_path / "planted", tmp_path / "plain")


GOOD = json.dumps(SHAREGPT[0])
BAD = {  # a record -> what the line says after file:line
    "function call": ({"conversations": [{"from": "human", "value": "add"}, {"from": "function_call", "value": "{}"},
                                         {"from": "gpt", "value": "2"}]},
                      "conversations[1] (function_call) has the value '{}', not the JSON of a call"),
    "observation": ({"conversations": [{"from": "human", "value": "x"}, {"from": "observation", "value": 4},
                                       {"from": "gpt", "value": "4"}]},
                    'conversations[1] (observation) "value" is 4, not a string'),
    "tools not JSON": ({"conversations": SHAREGPT[0]["conversations"], "tools": "[{name: add}]"},
                       '"tools" is the string \'[{name: add}]\', which is not JSON'),
    "unknown role": ({"conversations": [{"from": "bot", "value": "x"}]}, "conversations[0] has role 'bot'; a ShareGPT"),
    "value": ({"conversations": [{"from": "human", "value": 3}]},
              'conversations[0] (human) "value" is 3, not a string'),
    "no assistant": ({"conversations": [{"from": "human", "value": "x"}]}, "no assistant message"),
    "a turn's unknown key": ({"conversations": [{"from": "human", "value": "x", "loss": False},
                                                {"from": "gpt", "value": "y"}]},
                             "conversations[0] has the key 'loss', which a ShareGPT turn does not have (a turn's "
                             "keys: from, value, weight)"),
    "a turn's weight": ({"conversations": [{"from": "human", "value": "x"},
                                           {"from": "gpt", "value": "y", "weight": 2}]},
                        "message 1 (assistant) has weight 2: a turn's weight is 0 (context, not trained) or 1"),
    "alpaca output": ({"instruction": "x", "output": None}, '"output" is None, not a string'),
    "alpaca history": ({"instruction": "x", "output": "y", "history": ["z"]}, '"history" is [\'z\']'),
    "unknown shape": ({"question": "x", "answer": "y"}, 'has neither "text" nor "prompt" and "completion" nor '
                      '"messages" nor "conversations" (ShareGPT) nor "instruction" and "output" (Alpaca) (keys: '
                      'answer, question)'),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_record_is_named_by_its_line_in_one_line(data, tmp_path, capfd, case):
    record, said = BAD[case]
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(f"{GOOD}\n\n{json.dumps(record)}\n".encode()))
    line = one_line_error(zerotrain_here(capfd, "prepare", str(path), str(tmp_path / "out"), "--tokenizer",
                                         str(data / "chatml")))
    assert f"{path}:3: {said}" in line, line


def test_bad_rows_of_folders_and_bad_files_are_named_in_one_line(data, tmp_path, capfd, monkeypatch):
    def refused(path) -> str:
        return one_line_error(zerotrain_here(capfd, "prepare", str(path), str(tmp_path / "out"), "--tokenizer",
                                             str(data / "chatml")))

    bad = [*SHAREGPT[:3], {"conversations": [{"from": "bot", "value": "4"}, {"from": "gpt", "value": "4"}]}]
    write_shards(tmp_path / "hub", bad, 2)  # rows 0-1 in the first shard, 2-3 in the second
    assert f"{tmp_path / 'hub' / 'data' / 'train-00001-of-00002.parquet'}[1]: conversations[0] has role 'bot'" \
           in refused(tmp_path / "hub")
    save_to_disk(tmp_path / "saved", [ALPACA[0], {"instruction": "x", "input": "", "output": None}])
    assert f"{tmp_path / 'saved' / 'data-00000-of-00001.arrow'}[1]: \"output\" is None, not a string" in \
        refused(tmp_path / "saved")
    write_shards(tmp_path / "only-test", SHAREGPT, 1, split="test")
    write_shards(tmp_path / "only-test", SHAREGPT, 1, split="validation")
    assert "Parquet files of the splits test, validation and none is \"train\"" in refused(tmp_path / "only-test")
    (tmp_path / "not.jsonl.gz").write_bytes(b'{"text": "not gzip"}\n')
    assert f"{tmp_path / 'not.jsonl.gz'}: not a gzip file" in refused(tmp_path / "not.jsonl.gz")
    write_zst(tmp_path / "chats.jsonl.zst", SHAREGPT)
    monkeypatch.setitem(sys.modules, "zstandard", None)  # not installed
    assert "pip install 'zerotrain[zstd]'" in refused(tmp_path / "chats.jsonl.zst")


def test_a_save_to_disk_folder_missing_its_arrow_file_is_named_as_such(tmp_path, capfd):
    """Copied without its data files, a save_to_disk folder was taken for a text folder ("no file matches --glob")."""
    folder = save_to_disk(tmp_path / "saved", ALPACA_ROWS)
    arrows = sorted(n for n in os.listdir(folder) if n.endswith(".arrow"))
    os.remove(os.path.join(folder, arrows[0]))
    line = one_line_error(zerotrain_here(capfd, "prepare", folder, str(tmp_path / "out")))
    assert line == f"zerotrain: error: {folder}: its state.json lists {arrows[0]}, which is not in the folder " \
                   "(copied without its data files?)", line
    for name in arrows[1:]:
        os.remove(os.path.join(folder, name))
    line = one_line_error(zerotrain_here(capfd, "prepare", folder, str(tmp_path / "out")))
    assert f"its state.json lists {', '.join(arrows)}, which {'are' if len(arrows) > 1 else 'is'} not in" in line


def test_a_weighted_sharegpt_table_prepares_as_its_messages_and_a_planted_null_weight_read_as_given_is_caught(
        data, tmp_path, monkeypatch):
    """A table gives every turn a "weight" column, null where a turn has none: read as absent."""
    chats = [test_chat.WEIGHTED, CHATS[0]]
    write_jsonl(tmp_path / "messages.jsonl", [{"messages": chat} for chat in chats])
    rows = [{"conversations": [{"from": SPEAKERS[m["role"]], "value": m["content"], "weight": m.get("weight")}
                               for m in chat]} for chat in chats]
    tokenizer = str(data / "chatml")
    prepare_jsonl(str(tmp_path / "messages.jsonl"), str(tmp_path / "messages"), tokenizer, 0.0)
    prepare_jsonl(write_shards(tmp_path / "hub", rows, 1), str(tmp_path / "table"), tokenizer, 0.0)
    assert same_prepared(tmp_path / "table", tmp_path / "messages")
    monkeypatch.setattr(jsonl_module, "table_record", lambda record: record)  # planted: nulls kept
    with pytest.raises(ConfigError, match=r"hub.*\[0\]: message 0 \(system\) has weight None"):
        prepare_jsonl(str(tmp_path / "hub"), str(tmp_path / "planted"), tokenizer, 0.0)
