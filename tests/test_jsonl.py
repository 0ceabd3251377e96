"""Fine-tuning data: JSON Lines records, the prompt masked out of the loss, bad lines named, tables refused."""

from __future__ import annotations

import json

import pytest
import torch

from zerotrain.data import jsonl as jsonl_module
from zerotrain.data import sources as sources_module
from zerotrain.data import tokenfiles
from zerotrain.data.jsonl import prepare_jsonl, read_records
from zerotrain.data.packing import RecordSource, file_records
from zerotrain.data.sources import IGNORE, TokenSource
from zerotrain.data.tokenfiles import open_token_file
from zerotrain.errors import ConfigError

RECORDS = [{"prompt": f"Q{i}:", "completion": f" answer {i}"} for i in range(12)] + [{"text": "plain"}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def unpacked(folder, seq_len=24):
    files = [open_token_file(str(folder / "train.bin"))]
    return RecordSource(files, file_records(files, eot_id=0), seq_len, seed=0, vocab_size=256, global_batch=8,
                        pack=False)


def test_only_the_completion_and_its_end_of_text_are_targets(tmp_path):
    meta = prepare_jsonl(write_jsonl(tmp_path / "ft.jsonl", RECORDS), str(tmp_path / "out"), val_fraction=0.0)
    assert meta["loss_mask"] and meta["train"]["records"] == 13
    source = unpacked(tmp_path / "out")
    x, y, _ = source.sequences(0, range(8))
    completions = {f" answer {i}" for i in range(12)} | {"lain"}  # a text record: all but its first token
    for row in range(8):
        targets = bytes(int(t) for t in y[row] if t != IGNORE)
        assert targets[-1] == 0 and targets[:-1].decode() in completions  # the end-of-text id of bytes is 0
    assert source.token_count(0, 8) == int((y != IGNORE).sum())  # the loss divides by the trained tokens only
    packed = TokenSource(source.files, 24, seed=0, vocab_size=256)
    _, y, _ = packed.sequences(3, range(4))
    assert packed.token_count(3, 4) == int((y != IGNORE).sum()) < 4 * 24  # prompts inside windows carry no loss


def test_a_source_that_forgets_the_mask_trains_on_the_prompt(tmp_path, monkeypatch):
    prepare_jsonl(write_jsonl(tmp_path / "ft.jsonl", RECORDS[:12]), str(tmp_path / "out"), val_fraction=0.0)
    _, y, _ = unpacked(tmp_path / "out").sequences(0, range(4))
    assert not any(b":" in bytes(int(t) for t in row if t != IGNORE) for row in y)  # the prompts end in ":"
    # planted: the mask beside the tokens is not read
    monkeypatch.setattr(tokenfiles, "mask_path", lambda path: path + ".nowhere")
    _, y, _ = unpacked(tmp_path / "out").sequences(0, range(4))
    assert any(b":" in bytes(int(t) for t in row if t != IGNORE) for row in y)


@pytest.mark.parametrize("line, why", [
    ('{"text": "ok"', "not JSON"),
    ('["text"]', "a JSON list, not an object"),
    ('{"prompt": "only"}', 'has neither "text" nor "prompt" and "completion" (keys: prompt)'),
    ('{"prompt": "x", "completion": 3}', '"completion" is 3, not a string'),
    ('{"text": null}', '"text" is None, not a string'),
])
def test_a_bad_line_is_named_by_its_number(tmp_path, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(ConfigError) as raised:
        read_records(str(path))
    assert str(raised.value).startswith(f"{path}:3: ") and why in str(raised.value)


def test_a_table_is_refused_with_a_hint(tmp_path):
    for name in ("data.csv", "data.parquet"):
        with pytest.raises(ConfigError, match="a table is not read as text; write its text column as JSON Lines"):
            jsonl_module.refuse_table(str(tmp_path / name), "--data")
    assert sources_module.IGNORE == -100 and torch.tensor([IGNORE]).item() == -100
