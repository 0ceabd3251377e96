"""Prepared corpora: documents -> tokens -> train.bin / val.bin (llm.c layout) + meta.json; the cache of text inputs.

`prepare_corpus` is what `zerotrain prepare` runs, and what training on text runs once per input: a
text input (the standard library, a file, a folder) is tokenized as bytes into a folder of the
cache, `$ZEROTRAIN_CACHE` or `~/.cache/zerotrain`, named by the sha256 of its documents' names,
splits and bytes. Ranks then only read that folder. Building it is safe when several processes
start at once: one builds under a file lock into a temporary folder and renames it into place (a
folder that exists is complete); the others wait for the lock and find it there.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import sys
import time
import uuid
from contextlib import contextmanager

import numpy as np

from zerotrain.durable import write_json
from zerotrain.errors import ConfigError

from .documents import TextInput
from .tokenfiles import LlmcWriter
from .tokenizer import (TOKENIZER_FILE, BPETokenizer, ByteTokenizer, parse_tokenizer_spec, tokenizer_digest,
                        tokenizer_file, tokenizer_record, train_bpe)

FORMAT, VERSION = "zerotrain-tokens", 1
META = "meta.json"
SPLITS = ("train", "val")
ENCODE_BATCH = 256  # documents per encode_batch call (the BPE encodes them on all cores)


def prepare_corpus(source: TextInput, out: str, tokenizer: str = "bytes") -> dict:
    """Write `source` tokenized into folder `out` (created): [tokenizer.json], train.bin, val.bin, meta.json.

    `tokenizer`: bytes, bpe:N, or a tokenizer.json (or a model folder holding one), copied into `out`.
    Every document is followed by the end-of-text token. A BPE is trained on the training documents
    only. Returns the metadata written to meta.json (token counts, sha256 of each file, timings).
    """
    t_start = time.perf_counter()
    kind, vocab = parse_tokenizer_spec(tokenizer)
    os.makedirs(out, exist_ok=True)
    tok, timings = _tokenizer(source, out, kind, vocab, t_start, tokenizer)
    t_encode = time.perf_counter()
    writers, documents, text_bytes, content = _encode(source, out, tok, kind)
    timings["encode_s"] = time.perf_counter() - t_encode
    files = _file_records(writers, documents)
    timings["total_s"] = time.perf_counter() - t_start
    meta = _meta(source, tok, writers["train"].version, files, text_bytes, timings, content)
    write_json(os.path.join(out, META), meta)
    return meta


def _tokenizer(source: TextInput, out: str, kind: str, vocab: int, t_start: float,
               spec: str) -> tuple[object, dict[str, float]]:
    """The tokenizer, a BPE trained on the training documents or one given (saved into `out`) or bytes, and the
    timings so far."""
    timings = {}
    if kind == "file":
        tok = BPETokenizer.from_file(tokenizer_file(spec))  # its end-of-text token as its folder names it
        shutil.copyfile(tokenizer_file(spec), os.path.join(out, TOKENIZER_FILE))
    elif kind == "bpe":
        n_train = sum(d.split == "train" for d in source.documents)
        tok = train_bpe((data.decode("utf-8") for doc, data in source if doc.split == "train"), vocab, n_train)
        tok.save(os.path.join(out, TOKENIZER_FILE))
        timings["tokenizer_train_s"] = time.perf_counter() - t_start
    else:
        tok = ByteTokenizer()
    return tok, timings


def _encode(source: TextInput, out: str, tok, kind: str) -> tuple[dict[str, LlmcWriter], dict[str, int], int, object]:
    """Every document into its split's .bin file; the writers (closed), documents per split, text bytes, hasher."""
    writers = {s: LlmcWriter(os.path.join(out, f"{s}.bin"), tok.vocab_size) for s in SPLITS}
    documents, text_bytes = dict.fromkeys(SPLITS, 0), 0
    pending: list[tuple[str, bytes]] = []
    content = source.hasher()
    for doc, data in source:
        content.update(doc, data)
        pending.append((doc.split, data))
        text_bytes += len(data)
        if len(pending) == ENCODE_BATCH:
            _flush(pending, tok, kind, writers, documents)
    _flush(pending, tok, kind, writers, documents)
    for w in writers.values():
        w.close()
    return writers, documents, text_bytes, content


def _flush(pending: list[tuple[str, bytes]], tok, kind: str, writers: dict[str, LlmcWriter],
           documents: dict[str, int]) -> None:
    """Encode the pending documents as one batch, append each with its end-of-text token, and empty the list."""
    if kind in ("bpe", "file"):
        encoded = tok.encode_batch([data.decode("utf-8") for _, data in pending])
    else:
        encoded = [np.frombuffer(data, dtype=np.uint8) for _, data in pending]
    for (split, _), ids in zip(pending, encoded):
        writers[split].write(np.append(np.asarray(ids, dtype=np.int64), tok.eot_id))
        documents[split] += 1
    pending.clear()


def _file_records(writers: dict[str, LlmcWriter], documents: dict[str, int]) -> dict[str, dict]:
    """meta.json's record of each split's file: tokens, documents, bytes and sha256."""
    files = {}
    for s in SPLITS:
        size, digest = sha256_file(writers[s].path)
        files[s] = {"file": f"{s}.bin", "tokens": writers[s].count, "documents": documents[s], "bytes": size,
                    "sha256": digest}
    return files


def _meta(source: TextInput, tok, layout_version: int, files: dict[str, dict], text_bytes: int,
          timings: dict[str, float], content) -> dict:
    """meta.json's contents: format, tokenizer, files, source, timings and throughput."""
    tokens = sum(f["tokens"] for f in files.values())
    return {
        "format": FORMAT, "version": VERSION,
        "tokenizer": tokenizer_record(tok), "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
        "layout": f"llm.c v{layout_version}",
        **files,
        "source": {"kind": source.kind, "input": source.label, "val_fraction": source.val_fraction,
                   "text_bytes": text_bytes, "skipped": source.skipped},
        "python_version": sys.version.split()[0],
        "timings": {k: round(v, 3) for k, v in timings.items()},
        "content_hash": content.hexdigest(),
        "tokens_per_s": round(tokens / max(timings["total_s"], 1e-9)),  # end to end, tokenizer training included
        "encode_tokens_per_s": round(tokens / max(timings["encode_s"], 1e-9)),
    }


def sha256_file(path: str) -> tuple[int, str]:
    """Size and sha256 of a file, read in 16 MiB blocks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def cache_root(configured: str = "") -> str:
    """Where prepared text inputs are kept: --data-cache, else $ZEROTRAIN_CACHE, else ~/.cache/zerotrain."""
    if configured:
        return configured
    if os.environ.get("ZEROTRAIN_CACHE"):
        return os.environ["ZEROTRAIN_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zerotrain")


def _cache_setting(root: str) -> str:
    """How the user chose cache folder `root`, for messages: the variable, the flag, or the default."""
    if os.environ.get("ZEROTRAIN_CACHE") == root:
        return f"ZEROTRAIN_CACHE={root}"
    if root == cache_root():
        return f"the data cache {root} (set ZEROTRAIN_CACHE or --data-cache to use another)"
    return f"--data-cache {root}"


def cached_corpus(source: TextInput, root: str, tokenizer: str | None = None) -> str:
    """The folder of `source` prepared under cache `root`, built first if it is not there: as bytes, or with the
    tokenizer.json `tokenizer` (a model's), whose bytes and the files beside it that name its end-of-text token are
    part of the folder's name."""
    content = key = source.content_hash()
    if tokenizer is not None:
        key = hashlib.sha256((content + tokenizer_digest(tokenizer)).encode()).hexdigest()
    stem = source.kind if source.kind == "python-stdlib" else os.path.basename(os.path.normpath(source.label))

    def build(tmp: str) -> None:
        if prepare_corpus(source, tmp, tokenizer or "bytes")["content_hash"] != content:
            raise ConfigError(f"--data {source.label} changed while it was being prepared; run again")

    return cached_folder(root, stem, key, build)


def cached_folder(root: str, stem: str, key: str, build) -> str:
    """The cache folder `<stem>-<key>` under `root`, made by `build(tmp)` first if it is not there.

    Safe when several processes start at once: one builds under a file lock into a temporary folder and
    renames it into place (a folder that exists is complete); the others wait for the lock and find it there.
    """
    name = f"{re.sub(r'[^A-Za-z0-9._-]+', '_', stem)[:48]}-{key[:16]}"
    final = os.path.join(root, name)
    if os.path.isdir(final):
        return final
    lock = os.path.join(root, f".{name}.lock")
    try:  # where a cache folder that cannot be written (a file, below a file, read-only) fails first
        os.makedirs(root, exist_ok=True)
        open(lock, "a").close()
    except OSError as e:
        why = "a file, not a folder" if os.path.isfile(root) else e.strerror.lower()
        raise ConfigError(f"{_cache_setting(root)}: cannot keep prepared data there ({why}): name a folder this user "
                          "can write") from None
    with _locked(lock):
        if os.path.isdir(final):  # another process built it while this one waited
            return final
        tmp = os.path.join(root, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            build(tmp)
            try:
                os.rename(tmp, final)
            except OSError:  # built meanwhile by a process that shares the folder but not the lock
                if not os.path.isdir(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextmanager
def _locked(path: str):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
