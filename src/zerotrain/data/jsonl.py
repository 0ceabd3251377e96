"""Fine-tuning data: records (JSON Lines, JSON or Parquet), tokenized as the model's tokenizer encodes them, into token
files with a loss mask and a record index.

    {"text": "..."}                               every token is trained on
    {"prompt": "...", "completion": "..."}        the prompt is context: only the completion is trained on
    {"prompt": [messages], "completion": [messages]}  the same as a conversation (TRL's conversational
                                                  prompt/completion, with the record's "tools"): see below
    {"messages": [{"role": ..., "content": ...}]} a chat in the chat template that trains (with the record's "tools"):
                                                  its assistant turns are trained on, but those of "weight": 0
                                                  (chat.py, templates.py)

A record is encoded as the tokenizer encodes the whole of it: the special tokens its post-processor
puts before a text (a Llama's BOS) once, at the start; prompt and completion as one text, so nothing
comes between them and the boundary is where the tokenizer's own tokens fall (the token holding the
completion's first character is trained on: it is what the model has to emit; meta.json counts the
records where that token holds the prompt's end too); then the model's
end-of-text token (tokenizer.end_of_text_id). No special token is trained on but that one (and, in a
chat, the template's end-of-turn token inside an assistant turn). `{split}.mask` holds one byte per
token, 1 where the token is a target the loss counts; `{split}.records` the little-endian uint64
offset of each record's first token, then the end offset (n_records + 1 values): packing keeps each
record to itself by it.

A conversational prompt/completion is encoded as TRL's SFTTrainer encodes it (completion_only_loss): rendered with
the model's chat template (or --chat-template FILE: not a training variant, as TRL does without
assistant_only_loss), the prompt alone with the generation prompt and the prompt followed by the completion; every
token from where the two first differ to the end is trained on, the template's end of turn and what it writes after
it included, nothing added after it. The completion holds the assistant's messages; a message's "weight" is refused
(TRL reads none: the whole completion is trained).

The file is streamed, never whole in memory (a JSON array is: it is one value): CHUNK_RECORDS records
at a time are parsed, then rendered and tokenized on all cores (the tokenizers library's batch
encoding, which returns them in order) while the next chunk is parsed, then appended; the output
does not depend on the chunk size or the number of threads. A record goes to train or val by the
hash of its index (--val-fraction; a first pass counts the records, so that with two or more each
split gets one). A record that is not one of the shapes above is a ConfigError naming file:line
(file[i] in a JSON array or a Parquet file). A Parquet file (what Hugging Face data sets are stored
in) is read through pyarrow, an optional extra, a row batch at a time: its messages, text, or prompt
and completion columns. CSV is refused with a hint (no column is guessed). The common formats
(ShareGPT and Alpaca records, gzip or zstd JSON Lines, save_to_disk and Parquet folders) are read
through formats.py as the same records.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import chain

import numpy as np

from zerotrain.durable import write_json
from zerotrain.errors import ConfigError

from .chat import ChatTemplate, check_messages, check_prompt_completion
from .documents import fraction_of
from .formats import (arrow_stream, as_messages, compression, decompression_errors, folder_files, inner_name,
                      is_records_folder, open_records_file, shape_columns, table_record)
from .tokenfiles import LlmcWriter
from .tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, tokenizer_file, tokenizer_record

# 2: a split's "records" names its record index; "record_count" counts them. 3: a chat turn of weight 0 is not trained
# (a ShareGPT turn's weight was dropped, the turn trained): what version 2 prepared is prepared again
FORMAT, VERSION = "zerotrain-tokens", 3
SPLITS = ("train", "val")
# Records per batch encoding: enough for every core, and no more: the library's Encodings hold each token's string
# and offsets besides its id, and two chunks are in flight, so memory grows with it (docs/benchmarks.md).
CHUNK_RECORDS = 1024
RECORD_FILES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".jsonl.zst")
TABLES = (".csv", ".tsv")  # refused with a hint: not text, and no column is guessed
SHAPES = '{"text": ...}, {"prompt": ..., "completion": ...} (text or message lists), ' \
    '{"messages": [{"role": ..., "content": ...}, ...]}, ' \
    'ShareGPT\'s {"conversations": [...]} or Alpaca\'s {"instruction": ..., "output": ...}'


def is_records_file(path: str) -> bool:
    """Whether `path` is a file of records (.jsonl, .json or .parquet, .jsonl.gz or .jsonl.zst: never read as text)
    or a folder of them (save_to_disk's, or Parquet files)."""
    return (os.path.isfile(path) and path.lower().endswith(RECORD_FILES)) or is_records_folder(path)


def records_size(path: str) -> int:
    """The bytes of a records file, or of the data files of a records folder read: what a progress bar counts."""
    return sum(os.path.getsize(f) for f in folder_files(path)) if os.path.isdir(path) else os.path.getsize(path)


def split_stem(path: str) -> str:
    """What a record's split is hashed from, with its index: the file's name (data.jsonl for data.jsonl.gz: compressing
    a file does not move its records), or the folder's."""
    return os.path.basename(inner_name(os.path.normpath(path)))


def refuse_table(path: str, flag: str) -> None:
    if path.lower().endswith(TABLES):
        raise ConfigError(f"{flag} {path}: a table is not read as text; write its text, prompt/completion or messages "
                          "columns as JSON Lines (pandas: pd.read_csv(path).to_json('data.jsonl', orient='records', "
                          "lines=True)) or Parquet and give that file")


def iter_records(path: str, progress=None):
    """(where, JSON value) of each record of `path`, streamed; `where` is file:line (file[i] in a JSON array or a
    Parquet file: its record i, from 0).

    `progress(n)` is told the bytes read. ConfigError naming the line that is not UTF-8 or not JSON.
    """
    if os.path.isdir(path):
        for file in folder_files(path):
            yield from _parquet_records(file, progress) if file.lower().endswith(".parquet") else \
                _arrow_records(file, progress)
        return
    if path.lower().endswith(".parquet"):
        yield from _parquet_records(path, progress)
        return
    if compression(path):
        yield from _compressed_records(path, progress)
        return
    with open(path, "rb") as f:
        first = f.read(4096).lstrip()[:1]
        f.seek(0)
        if path.lower().endswith(".json") and first == b"[":
            yield from _array_records(path, f)
            return
        if path.lower().endswith(".json") and first not in (b"{", b""):
            raise ConfigError(f"{path}: a .json file is read as a JSON array of records or as JSON Lines (one object "
                              f"per line), and this one starts with {first.decode('utf-8', 'replace')!r}")
        for number, line in enumerate(f, start=1):
            if progress:
                progress(len(line))
            if line.strip():
                yield _line_record(path, number, line)


def _line_record(path: str, number: int, line: bytes):
    """(file:line, the JSON value of a line); ConfigError naming it when it is not UTF-8 or not JSON."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}:{number}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
    try:
        return f"{path}:{number}", json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{number}: not JSON ({e.msg})") from None


def _compressed_lines(path: str, progress=None):
    """(number, line) of each line of a .jsonl.gz or .jsonl.zst file, decompressed as it is read; `progress` is told
    the compressed bytes read. ConfigError naming the file when it is not what its name says."""
    raw, f = open_records_file(path)
    with raw, f:
        read, number = 0, 0
        try:
            for number, line in enumerate(f, start=1):
                if progress and raw.tell() != read:
                    progress(raw.tell() - read)
                    read = raw.tell()
                yield number, line
        except decompression_errors() as e:
            raise ConfigError(f"{path}: not a {compression(path)} file, or a damaged one, after line {number} "
                              f"({e})") from None


def _compressed_records(path: str, progress):
    for number, line in _compressed_lines(path, progress):
        if line.strip():
            yield _line_record(path, number, line)


def _array_records(path: str, f):
    try:
        records = json.load(f)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    yield from ((f"{path}[{i}]", r) for i, r in enumerate(records))


def _parquet_file(path: str):
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ConfigError(f"{path}: Parquet is read through pyarrow, which is not installed: pip install "
                          "'zerotrain[parquet]', or write it as JSON Lines (pandas: pd.read_parquet(path).to_json("
                          "'data.jsonl', orient='records', lines=True))") from None
    try:
        return pyarrow.parquet.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise ConfigError(f"{path}: not a Parquet file pyarrow reads ({str(e).splitlines()[0]})") from None


def _record_columns(path: str, names: list[str]) -> list[str]:
    """The columns of a table its records are read from (formats.shape_columns); ConfigError naming its columns."""
    columns = shape_columns(names)
    if columns is None:
        raise ConfigError(f"{path}: no \"messages\", \"text\", \"prompt\" and \"completion\", \"conversations\" "
                          f"(ShareGPT) or \"instruction\" and \"output\" (Alpaca) column (columns: "
                          f"{', '.join(names) or 'none'})")
    return columns


def _parquet_records(path: str, progress):
    """A Parquet file's records, a row batch at a time: the columns of the first record shape it has (what a Hugging
    Face data set's files hold), other columns not read."""
    file = _parquet_file(path)
    columns = _record_columns(path, file.schema_arrow.names)
    row, size, rows = 0, os.path.getsize(path), max(file.metadata.num_rows, 1)
    for batch in file.iter_batches(batch_size=CHUNK_RECORDS, columns=columns):
        for record in batch.to_pylist():
            yield f"{path}[{row}]", table_record(record)
            row += 1
        if progress:
            progress(size * batch.num_rows // rows)


def _arrow_records(path: str, progress):
    """The records of an Arrow stream file of a save_to_disk folder, a record batch at a time, as _parquet_records."""
    import pyarrow

    reader, row = _arrow_reader(path), 0
    columns = _record_columns(path, reader.schema.names)
    try:
        for batch in reader:
            for record in batch.select(columns).to_pylist():
                yield f"{path}[{row}]", table_record(record)
                row += 1
    except pyarrow.ArrowException as e:
        raise ConfigError(f"{path}: a damaged Arrow stream after row {row} ({str(e).splitlines()[0]})") from None
    if progress:
        progress(os.path.getsize(path))


def _arrow_reader(path: str):
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ConfigError(f"{path}: a save_to_disk folder's Arrow files are read through pyarrow, which is not "
                          "installed: pip install 'zerotrain[parquet]'") from None
    return arrow_stream(path)


def parse_record(record, where: str) -> tuple:
    """("text", text), ("completion", prompt, completion), ("chat", messages, context: the record's tools and
    documents) or ("chat completion", prompt messages, completion messages, context); ConfigError naming `where`."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: a JSON {type(record).__name__}, not an object: {SHAPES}")
    if "messages" in record:
        return ("chat", *check_messages(record, where, weighted=True))
    if "text" in record:
        fields = {"text": record["text"]}
    elif "prompt" in record and "completion" in record:
        if isinstance(record["prompt"], list) or isinstance(record["completion"], list):  # TRL's conversational
            return ("chat completion", *check_prompt_completion(record, where))
        fields = {"prompt": record["prompt"], "completion": record["completion"]}
    elif (chat := as_messages(record, where)) is not None:  # ShareGPT, Alpaca
        return ("chat", *check_messages(chat, where, weighted=True))
    else:
        raise ConfigError(f"{where}: has neither \"text\" nor \"prompt\" and \"completion\" nor \"messages\" nor "
                          "\"conversations\" (ShareGPT) nor \"instruction\" and \"output\" (Alpaca) (keys: "
                          f"{', '.join(sorted(record)) or 'none'})")
    wrong = next((k for k, v in fields.items() if not isinstance(v, str)), None)
    if wrong:
        raise ConfigError(f"{where}: \"{wrong}\" is {fields[wrong]!r}, not a string")
    return ("text", fields["text"]) if "text" in fields else ("completion", fields["prompt"], fields["completion"])


def read_records(path: str) -> list[tuple]:
    """Every record of `path`, parsed (parse_record); ConfigError naming the first bad one, or a file of none."""
    records = [parse_record(r, where) for where, r in iter_records(path)]
    if not records:
        raise ConfigError(f"{path}: no records")
    return records


class SplitOf:
    """Which split record i of `count` goes to: assign_splits' rule (val where the record's name hashes below
    val_fraction; with two or more records and val_fraction > 0, the lowest hash to val and the highest to train
    if a split would be empty), one record at a time, without holding a name per record."""

    def __init__(self, stem: str, count: int, val_fraction: float):
        self.stem, self.val_fraction, self.forced = stem, val_fraction, {}
        if val_fraction > 0 and count >= 2:
            fractions = (self.fraction(i) for i in range(count))
            low = high = (self.fraction(0), 0)
            for i, f in enumerate(fractions):
                low, high = min(low, (f, i)), max(high, (f, i))
            if low[0] >= val_fraction:
                self.forced[low[1]] = "val"
            if high[0] < val_fraction:
                self.forced[high[1]] = "train"

    def fraction(self, index: int) -> float:
        return fraction_of(f"{self.stem}:{index}")

    def __call__(self, index: int) -> str:
        return self.forced.get(index) or ("val" if self.fraction(index) < self.val_fraction else "train")


def record_tokenizer(spec: str):
    """The tokenizer a --tokenizer SPEC names for records: bytes, or a tokenizer.json (or a model folder holding one),
    its special tokens as the folder beside it names them. ConfigError for anything else."""
    if spec == "bytes":
        return ByteTokenizer()
    file = tokenizer_file(spec)
    if file is None:
        only = " (it has tokenizer.model only: transformers writes tokenizer.json with AutoTokenizer.from_pretrained" \
               f"('{spec}').save_pretrained('{spec}'))" if os.path.isfile(os.path.join(spec, "tokenizer.model")) else ""
        raise ConfigError(f"--tokenizer {spec}: JSON Lines data takes bytes or a tokenizer.json (or a model folder "
                          f"holding one){only}")
    try:
        return BPETokenizer.from_file(file)
    except ValueError as e:
        raise ConfigError(f"--tokenizer {spec}: {file} {e}") from None


def encode_chunk(chunk: list[tuple], tok, chat: ChatTemplate | None, conversation: ChatTemplate | None = None
                 ) -> tuple[list[tuple[list[int], bytes]], set[int]]:
    """(tokens, mask) of each parsed record of the chunk (parse_record's tuples with their `where` last), in order, and
    which of them have a completion that starts inside a token (the one holding the prompt's last characters too).
    `chat` renders the chat records, `conversation` the conversational prompt/completions.

    Lists and bytes, not arrays: a record is a few C-level joins, and the chunk becomes one array when it is written
    (numpy calls per record cost more CPU time: docs/benchmarks.md).
    """
    if isinstance(tok, ByteTokenizer):
        return [_bytes_record(r, tok) for r in chunk], set()
    prefix, eot = list(tok.prefix_ids), tok.eot_id
    texts = [r for r in chunk if r[0] == "text"]
    rest = [r for r in chunk if r[0] in ("chat", "completion")]
    pairs = [conversation.prompt_completion(r[1], r[2], r[-1], **r[3]) for r in chunk if r[0] == "chat completion"]
    rendered_pairs = iter(tok.encode_pieces([text for pair in pairs for text in pair]))
    rendered = [chat.render(r[1], r[-1], **r[2]) if r[0] == "chat" else (r[1] + r[2], len(r[1])) for r in rest]
    plain = iter(tok.encode_pieces([r[1] for r in texts]))
    offsets = iter(tok.encode_pieces([text for text, _ in rendered], offsets=True))
    where = iter(rendered)
    untrained = set(tok.special_ids) - {eot}
    out, inside = [], set()
    for k, r in enumerate(chunk):
        if r[0] == "chat":  # the template ends each turn; its BOS, if it writes one, is not doubled
            encoding, (_, spans) = next(offsets), next(where)
            ids, mask = encoding.ids, _span_mask(encoding, spans).tobytes()
            bos = missing_bos(ids, prefix)
            out.append((bos + ids, bytes(len(bos)) + mask))
            continue
        if r[0] == "chat completion":  # TRL's completion mask: from where prompt and prompt + completion differ
            prompt_ids, ids = next(rendered_pairs).ids, next(rendered_pairs).ids
            prompt_ids, ids = missing_bos(prompt_ids, prefix) + prompt_ids, missing_bos(ids, prefix) + ids
            first = common_prefix(prompt_ids, ids)
            out.append((ids, bytes(first) + b"\1" * (len(ids) - first)))
            continue
        if r[0] == "text":
            ids, first = next(plain).ids, 0
        else:
            encoding, (_, boundary) = next(offsets), next(where)
            ids, first = encoding.ids, _completion_start(encoding, boundary)
            if first < len(ids) and encoding.token_to_chars(first)[0] < boundary:
                inside.add(k)
        mask = bytes(len(prefix) + first) + b"\1" * (len(ids) - first + 1)  # ... and the end-of-text token
        if not untrained.isdisjoint(ids):  # a special token written in the text is context, never a target
            mask = bytearray(mask)
            for j, i in enumerate(ids):
                if i in untrained:
                    mask[len(prefix) + j] = 0
            mask = bytes(mask)
        out.append((prefix + ids + [eot], mask))
    return out, inside


def missing_bos(ids: list[int], prefix: list[int]) -> list[int]:
    """What goes before a rendered chat's ids: the tokenizer's BOS (its post-processor's prefix), unless the template
    wrote it itself (then it is not doubled)."""
    return list(prefix) if prefix and ids[: len(prefix)] != list(prefix) else []


def encode_chat_prompt(tok, chat: ChatTemplate, messages: list[dict], where: str, **context) -> list[int]:
    """The token ids of a conversation with the assistant's turn opened, as encode_chunk encodes a chat record up to
    an assistant turn: the template's text without the tokenizer's special tokens, the BOS placed by missing_bos;
    `context` is the record's tools and documents, written by the template as training wrote them. What `zerotrain
    sample --chat` and `--messages` feed the model, so a model sees at inference the context it was trained on."""
    ids = tok.encode_pieces([chat.prompt(messages, where, **context)])[0].ids
    return missing_bos(ids, tok.prefix_ids) + ids


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids `a` and `b` have in common: where a completion's tokens start (TRL's
    common_prefix_length), so that a token the tokenizer merges across the boundary, or a prompt the template writes
    differently alone, belongs to the completion."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _completion_start(encoding, boundary: int) -> int:
    """The first token of the completion: the one holding character `boundary` (the completion's first)."""
    first = encoding.char_to_token(boundary) if encoding.ids else None  # None past the text's end
    if first is None:  # an empty completion, or a character no token holds: the first token past the boundary
        first = next((j for j, (_, end) in enumerate(encoding.offsets) if end > boundary), len(encoding.ids))
    return first


def _span_mask(encoding, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for every token that overlaps one of the character spans, as transformers' assistant mask."""
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        mask |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
    return mask.astype(np.uint8)


def _bytes_record(record: tuple, tok: ByteTokenizer) -> tuple[list[int], bytes]:
    if record[0] in ("chat", "chat completion"):
        ChatTemplate.of(tok, record[-1])  # refuses: bytes have no chat template
    context, target = (tok.encode(record[1]), tok.encode(record[2])) if record[0] == "completion" else \
        ([], tok.encode(record[1]))
    # a written <|endoftext|> (id 0) is context, never a target; the one that ends the record is
    mask = bytes(len(context)) + bytes(int(i != tok.eot_id) for i in target) + b"\1"
    return [*context, *target, tok.eot_id], mask


class SplitWriter:
    """One split's token file, loss mask and record index, appended a chunk at a time."""

    def __init__(self, out: str, split: str, vocab_size: int):
        self.tokens = LlmcWriter(os.path.join(out, f"{split}.bin"), vocab_size)
        self.mask = open(os.path.join(out, f"{split}.mask"), "wb")
        self.index = open(os.path.join(out, f"{split}.records"), "wb")
        self.records = self.trained = self.longest = self.inside = 0

    def write(self, records: list[tuple[list[int], bytes]], inside: int = 0) -> None:
        """Append records (tokens, mask); `inside` of them have a completion that starts inside a token."""
        self.inside += inside
        if not records:
            return
        lengths = np.array([len(mask) for _, mask in records], dtype=np.int64)
        starts = self.tokens.count + np.concatenate([[0], np.cumsum(lengths[:-1])])
        self.index.write(starts.astype("<u8").tobytes())
        self.tokens.write(np.fromiter(chain.from_iterable(ids for ids, _ in records), dtype=self.tokens.dtype,
                                      count=int(lengths.sum())))
        mask = b"".join(m for _, m in records)
        self.mask.write(mask)
        self.records += len(records)
        self.trained += int(np.frombuffer(mask, dtype=np.uint8).sum(dtype=np.int64))
        self.longest = max(self.longest, int(lengths.max()))

    def close(self) -> None:
        self.index.write(np.array([self.tokens.count], dtype="<u8").tobytes())  # the end offset
        for f in (self.index, self.mask):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self.tokens.close()

    def entry(self, split: str) -> dict:
        return {"file": f"{split}.bin", "mask": f"{split}.mask", "records": f"{split}.records",
                "tokens": self.tokens.count, "record_count": self.records, "trained_tokens": self.trained,
                "longest_record": self.longest, "completions_inside_a_token": self.inside}


def prepare_jsonl(path: str, out: str, tokenizer: str = "bytes", val_fraction: float = 0.05,
                  chat_template: str | None = None) -> dict:
    """Tokenize the records of `path` into folder `out` (created): train/val .bin, .mask and .records, meta.json,
    and the tokenizer.json when `tokenizer` is one (bytes otherwise). Chats are rendered with the template that trains
    (templates.py: `chat_template`, a file, else a training variant of the folder's, else the folder's). Returns
    meta.json's contents."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    tok = record_tokenizer(tokenizer)
    count = _record_count(path)
    if not count:
        raise ConfigError(f"{path}: no records")
    split_of = SplitOf(split_stem(path), count, val_fraction)
    os.makedirs(out, exist_ok=True)
    if isinstance(tok, BPETokenizer):
        tok.save(os.path.join(out, TOKENIZER_FILE))
    writers = {s: SplitWriter(out, s, tok.vocab_size) for s in SPLITS}
    chat, conversation, chats = None, None, 0
    # One chunk is encoded (the tokenizers library's threads, without the GIL) while the next is read and parsed.
    name = os.path.basename(os.path.normpath(path))
    with tqdm(total=records_size(path), unit="B", unit_scale=True, desc=f"prepare {name}", file=sys.stderr,
              disable=None, leave=False) as bar, ThreadPoolExecutor(1) as encoder:
        try:
            chunk, splits, pending = [], [], None
            for index, (where, value) in enumerate(iter_records(path, bar.update)):
                record = (*parse_record(value, where), where)
                if record[0] == "chat":
                    chat = chat or ChatTemplate.of(tok, where, chat_template, training=True)
                elif record[0] == "chat completion":  # no training variant: TRL renders it with the model's own
                    conversation = conversation or ChatTemplate.of(tok, where, chat_template)
                chats += record[0] in ("chat", "chat completion")
                chunk.append(record)
                splits.append(split_of(index))
                if len(chunk) == CHUNK_RECORDS:
                    _write_chunk(pending, writers)
                    pending = encoder.submit(encode_chunk, chunk, tok, chat, conversation), splits
                    chunk, splits = [], []
            _write_chunk(pending, writers)
            _write_chunk((encoder.submit(encode_chunk, chunk, tok, chat, conversation), splits), writers)
        finally:
            for w in writers.values():
                w.close()
    total_s = time.perf_counter() - t0
    tokens = sum(w.tokens.count for w in writers.values())
    meta = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer_record(tok), "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id, "bos_ids": list(getattr(tok, "prefix_ids", [])), "loss_mask": True,
            **{s: w.entry(s) for s, w in writers.items()},
            "source": {"kind": "jsonl", "input": os.path.abspath(path), "val_fraction": val_fraction, "chats": chats,
                       "chat_template": "generation markers" if chat and chat.marked else
                       "growing prefixes" if chat else "prompt and completion" if conversation else None,
                       "template": _template_entry(chat, conversation)},
            "timings": {"total_s": round(total_s, 3)}, "tokens_per_s": round(tokens / max(total_s, 1e-9))}
    write_json(os.path.join(out, "meta.json"), meta)
    return meta


def _template_entry(chat: ChatTemplate | None, conversation: ChatTemplate | None) -> dict | None:
    """What rendered the chats and why, for meta.json and the start line: the chat records' template, else the
    conversational prompt/completions'."""
    if chat is None and conversation is None:
        return None
    said = chat.said if chat else f"{conversation.choice.describe(True).split(' (')[0]} (the completion trained " \
        "from where the prompt with its generation prompt ends, as TRL's completion mask)"
    choice = (chat or conversation).choice
    return {"said": said, "origin": choice.origin, "name": choice.name, "sha256": choice.digest}


def _record_count(path: str) -> int:
    """How many records `path` holds, without parsing them where it can (JSON Lines: its non-blank lines; Parquet:
    its metadata; Arrow: its batches' row counts): the first pass."""
    if os.path.isdir(path):
        return sum(_parquet_file(f).metadata.num_rows if f.lower().endswith(".parquet") else
                   sum(batch.num_rows for batch in _arrow_reader(f)) for f in folder_files(path))
    if path.lower().endswith(".parquet"):
        return _parquet_file(path).metadata.num_rows
    if compression(path):
        return sum(1 for _, line in _compressed_lines(path) if line.strip())
    if path.lower().endswith(".json"):
        return sum(1 for _ in iter_records(path))
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _write_chunk(pending, writers: dict[str, SplitWriter]) -> None:
    """Append each record of an encoded chunk ((the future of encode_chunk, the records' splits), or None) to its
    split, in the chunk's order."""
    if pending is None:
        return
    (encoded, inside), splits = pending[0].result(), pending[1]
    for s, writer in writers.items():
        writer.write([e for e, split in zip(encoded, splits) if split == s],
                     sum(splits[k] == s for k in inside))
