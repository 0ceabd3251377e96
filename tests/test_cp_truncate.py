"""Records longer than a row (--seq-len + 1 tokens) are never split over rows: refused in one line naming the record and
its length, or with --truncate cut to their first seq_len + 1 tokens, the start line naming a record whose completion
or assistant turn was cut."""

from __future__ import annotations

import re

import pytest
from conftest import zerotrain_here
from model_folders import write_jsonl
from test_packing import SEQ, record_source, write_records

from zerotrain.errors import ConfigError

pytestmark = pytest.mark.timeout(300)

SHORT = [("Q1:", " one"), ("Q2:", " two")]
LONG_ANSWER = ("Q3:" + "p" * 20, " " + "a" * 30)  # 23 + 32 tokens (bytes, with its end-of-text): 55 > SEQ + 1 = 33


def test_a_record_longer_than_a_row_is_refused_naming_it_its_length_and_the_turn_it_would_lose(tmp_path):
    folder = write_records(tmp_path / "d", SHORT + [LONG_ANSWER] + SHORT)
    with pytest.raises(ConfigError) as e:
        record_source(folder, truncate=False)
    # record 3, 55 tokens: its first 33 are the prompt's 23 and 10 of the completion's 32 (each a target): 22 lost
    assert str(e.value) == (f"{folder}/train.bin: record 3 is 55 tokens, longer than a row of --seq-len {SEQ} + 1, "
                            "and its completion or assistant turn would lose 22 trained tokens (1 such record): give "
                            f"--truncate to keep the first {SEQ + 1} tokens of each, or --seq-len 54; a record is "
                            "never split over rows")
    # --truncate: kept, cut to the window, and the start line says whose completion was cut
    source = record_source(folder, truncate=True)
    assert source.truncated == 1 and source.turns_cut == (1, "3", 55, 22)
    assert "1 with their completion or assistant turn cut by --truncate (the first: record 3, 55 tokens, 22 trained " \
           "tokens lost)" in source.describe()
    # a long prompt: the cut loses its completion, here its end-of-text alone (a trained token)
    folder = write_records(tmp_path / "p", SHORT + [("Q:" + "p" * 40, "")])
    with pytest.raises(ConfigError, match=r"record 3 is 43 tokens, longer than a row of --seq-len 32 \+ 1, and its "
                                          r"completion or assistant turn would lose 1 trained token \(1 such record\)"):
        record_source(folder, truncate=False)
    # with --truncate it is kept, cut, and the start line names it
    assert "1 with their completion or assistant turn cut" in record_source(folder, truncate=True).describe()


def test_the_user_is_told_in_one_line_with_exit_2_and_truncate_trains(tmp_path, capfd):
    records = [{"prompt": f"Q{i}:", "completion": f" answer {i}"} for i in range(6)]
    records[3] = {"prompt": "Q3:", "completion": " " + "long " * 30}
    data = write_jsonl(tmp_path / "long.jsonl", records)
    common = ["--data", data, "--seq-len", "64", "--steps", "1", "--micro-batch", "1", "--val-fraction", "0",
              "--no-progress", "--data-cache", str(tmp_path / "cache")]
    r = zerotrain_here(capfd, "train", *common, "--out", str(tmp_path / "refused"))
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("zerotrain: error: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    said = re.fullmatch(rf"zerotrain: error: --data {re.escape(data)} \(train\): record 4 is (\d+) tokens, longer than "
                        r"a row of --seq-len 64 \+ 1, and its completion or assistant turn would lose (\d+) trained "
                        r"tokens \(1 such record\): give --truncate to keep the first 65 tokens of each, or --seq-len "
                        r"(\d+); a record is never split over rows", errors[0])
    assert said, errors[0]
    length, lost, seq_len = (int(g) for g in said.groups())
    assert length > 65 and seq_len == length - 1 and lost == length - 65
    r = zerotrain_here(capfd, "train", *common, "--truncate", "--out", str(tmp_path / "truncated"))
    assert r.returncode == 0, r.stderr[-2000:]
    start = r.stdout.splitlines()[0]
    assert "1 longer than the window (--seq-len 64 + 1 tokens), truncated" in start, start
    assert f"1 with their completion or assistant turn cut by --truncate (the first: record 4, {length} tokens, " \
           f"{lost} trained tokens lost)" in start, start
