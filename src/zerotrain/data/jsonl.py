"""Fine-tuning data: a JSON Lines file of records, tokenized into token files with a loss mask.

    {"text": "..."}                          every token is trained on
    {"prompt": "...", "completion": "..."}   the prompt is context: only the completion's tokens are trained on

Each record becomes prompt tokens + completion tokens (or the text's) + the end-of-text token, and
`train.mask` / `val.mask` hold one byte per token: 1 where the token is a target the loss counts, 0 for
a prompt's. The sources mask those labels (-100), so the prompt carries no loss through the token-weighted
loss every run uses. Records are split into train and val by the hash of their line number
(--val-fraction). A line that is not a JSON object with those fields, as strings, is a ConfigError naming
its line. CSV and Parquet are not read as text: a hint says how to make JSONL of them.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from zerotrain.durable import write_json
from zerotrain.errors import ConfigError

from .documents import assign_splits
from .tokenfiles import LlmcWriter
from .tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, tokenizer_file, tokenizer_record

TABLES = (".csv", ".tsv", ".parquet")  # refused with a hint: not text, and no column is guessed


def refuse_table(path: str, flag: str) -> None:
    if path.lower().endswith(TABLES):
        raise ConfigError(f"{flag} {path}: a table is not read as text; write its text column as JSON Lines "
                          "(one {\"text\": ...} or {\"prompt\": ..., \"completion\": ...} per line) and give the "
                          ".jsonl file")


def read_records(path: str) -> list[tuple[str, str]]:
    """(prompt, completion) per record; a text record is ("", text). ConfigError naming the first bad line."""
    records = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{number}: a JSON {type(record).__name__}, not an object with \"text\" or "
                              "\"prompt\" and \"completion\"")
        if "text" in record:
            fields = {"text": record["text"]}
        elif "prompt" in record and "completion" in record:
            fields = {"prompt": record["prompt"], "completion": record["completion"]}
        else:
            raise ConfigError(f"{path}:{number}: has neither \"text\" nor \"prompt\" and \"completion\" (keys: "
                              f"{', '.join(sorted(record)) or 'none'})")
        wrong = next((k for k, v in fields.items() if not isinstance(v, str)), None)
        if wrong:
            raise ConfigError(f"{path}:{number}: \"{wrong}\" is {fields[wrong]!r}, not a string")
        records.append(("", fields["text"]) if "text" in fields else (fields["prompt"], fields["completion"]))
    if not records:
        raise ConfigError(f"{path}: no records")
    return records


def prepare_jsonl(path: str, out: str, tokenizer: str = "bytes", val_fraction: float = 0.05) -> dict:
    """Tokenize the records of `path` into folder `out` (created): train/val .bin and .mask, meta.json, and the
    tokenizer.json when `tokenizer` is a file (bytes otherwise). Returns meta.json's contents."""
    t0 = time.perf_counter()
    records = read_records(path)
    os.makedirs(out, exist_ok=True)
    if tokenizer == "bytes":
        tok = ByteTokenizer()
    else:
        file = tokenizer_file(tokenizer)
        if file is None:
            raise ConfigError(f"--tokenizer {tokenizer}: JSON Lines data takes bytes or a tokenizer.json (or a model "
                              "folder holding one)")
        tok = BPETokenizer.from_file(file)
        tok.save(os.path.join(out, TOKENIZER_FILE))
    splits = assign_splits([f"{os.path.basename(path)}:{i}" for i in range(len(records))], val_fraction)
    writers = {s: LlmcWriter(os.path.join(out, f"{s}.bin"), tok.vocab_size) for s in ("train", "val")}
    masks = {s: open(os.path.join(out, f"{s}.mask"), "wb") for s in ("train", "val")}
    counts = {s: {"records": 0, "trained_tokens": 0} for s in ("train", "val")}
    try:
        for (prompt, completion), split in zip(records, splits):
            context, target = tok.encode(prompt) if prompt else [], tok.encode(completion)
            tokens = np.array([*context, *target, tok.eot_id], dtype=np.int64)
            mask = np.array([0] * len(context) + [1] * (len(target) + 1), dtype=np.uint8)
            writers[split].write(tokens)
            masks[split].write(mask.tobytes())
            counts[split]["records"] += 1
            counts[split]["trained_tokens"] += int(mask.sum())
    finally:
        for f in masks.values():
            f.close()
        for w in writers.values():
            w.close()
    meta = {"format": "zerotrain-tokens", "version": 1, "tokenizer": tokenizer_record(tok),
            "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "loss_mask": True,
            **{s: {"file": f"{s}.bin", "mask": f"{s}.mask", "tokens": writers[s].count, **counts[s]}
               for s in ("train", "val")},
            "source": {"kind": "jsonl", "input": os.path.abspath(path), "val_fraction": val_fraction},
            "timings": {"total_s": round(time.perf_counter() - t0, 3)}}
    write_json(os.path.join(out, "meta.json"), meta)
    return meta
