"""What `--data` names, resolved to token files and a vocabulary, and checked against the model before any rank starts.

    synthetic, synthetic-varlen   generated sequences (no files; the model's --vocab-size)
    python-stdlib (the default)   this interpreter's standard-library sources, prepared as bytes into the cache
    a text file / text folder     UTF-8 text (--glob picks a folder's files), prepared as bytes into the cache
    a folder with *train*.bin     token files: a zerotrain prepared folder, nanoGPT's or llm.c's (*val*.bin: validation)
    a .bin file                   one token file (its *val* sibling, if any, for validation)

The model's vocabulary comes from the data unless --vocab-size (flag or TOML) sets it: bytes have 256
ids, a prepared folder or a folder with meta.json states its own, other token files the largest id
+ 1 (with a note). An explicit --vocab-size smaller than that is an error naming both numbers. Token
ids are checked against the vocabulary once, by a chunked scan of every file, before ranks start
(and again per sequence, as a cheap guard against files changed under a running job).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field

from zerotrain.config import Config, data_sources, is_mixture
from zerotrain.errors import ConfigError

from .corpus import META, cache_root, cached_corpus, cached_folder, sha256_file
from .documents import STDLIB, text_input
from .chat import chat_template_of
from .formats import folder_digest
from .jsonl import VERSION as JSONL_VERSION
from .jsonl import is_records_file, prepare_jsonl, refuse_table
from .mixture import source_config
from .packing import has_records
from .templates import choose_template
from .tokenfiles import max_token, open_token_file
from .tokenizer import (TOKENIZER_FILE, BPETokenizer, is_bytes_tokenizer_json, read_tokenizer_file, tokenizer_digest,
                        tokenizer_record)
from .tokenizer_config import config_files, model_facts

SYNTHETIC = ("synthetic", "synthetic-varlen")


@dataclass
class DataSpec:
    """Token files per split and what their folder says about their vocabulary and tokenizer."""

    name: str  # --data (or --val-data) as given
    kind: str  # "synthetic" or "tokens"
    folder: str = ""  # the token folder (a cache folder for text inputs)
    train: list[str] = field(default_factory=list)
    val: list[str] = field(default_factory=list)
    vocab_size: int | None = None  # stated by meta.json; None: not stated
    eot_id: int | None = None  # the end-of-text id, when known (needed by --no-pack)
    tokenizer: dict | None = None  # {"kind", "vocab_size", "eot_id"[, "file"]}: what a checkpoint records
    tokenizer_file: str | None = None  # the tokenizer.json a checkpoint copies
    notes: list[str] = field(default_factory=list)
    train_tokens: int = 0  # filled by check_source
    val_tokens: int = 0
    flag: str = "--data"  # the flag that named it, for messages
    chat_template: str | None = None  # what rendered its chats and why (meta.json), for the start line

    def describe(self) -> str:
        """One line for the start of a run: what is trained on, in tokens."""
        if self.kind == "synthetic":
            return self.name
        tokenizer = f"{self.tokenizer['kind']} tokenizer, " if self.tokenizer else ""
        return (f"{self.name} ({tokenizer}{self.train_tokens:,} train / {self.val_tokens:,} val tokens"
                + (f", prepared in {self.folder}" if self.folder != self.name else "") + ")")


def resolve_data(cfg: Config, source: str | None = None, flag: str = "--data",
                 val_fraction: float | None = None) -> DataSpec:
    """The DataSpec of cfg.data.source (or of `source`, named by `flag`); text is prepared into the cache first."""
    d = cfg.data
    src = d.source if source is None else source
    if d.chat_template and (src in SYNTHETIC or src.endswith(".bin") or (os.path.isdir(src) and _bins(src))):
        raise ConfigError(f"--chat-template {d.chat_template}: renders chat records, and {flag} {src} is not records "
                          "(token files were rendered when they were prepared: prepare them with --chat-template)")
    if src in SYNTHETIC:
        return DataSpec(src, "synthetic", flag=flag)
    if src != STDLIB and not os.path.exists(src):
        raise ConfigError(f"{flag} {src}: no such file or folder (use python-stdlib, synthetic, a UTF-8 text file or "
                          "folder, a .jsonl, .json or .parquet file of records (or .jsonl.gz, .jsonl.zst, a "
                          "save_to_disk or Parquet folder), or a folder of .bin token files)")
    if os.path.isdir(src) and _bins(src):
        return token_folder(src, src, flag)
    if os.path.isfile(src) and src.endswith(".bin"):
        return token_file(src, flag)
    refuse_table(src, flag)
    if d.chat_template and not os.path.isfile(d.chat_template):
        raise ConfigError(f"--chat-template {d.chat_template}: no such file (a Jinja chat template, as "
                          "chat_template.jinja holds one)")
    fraction = d.val_fraction if val_fraction is None else val_fraction
    tokenizer, root = model_tokenizer(cfg), cache_root(d.cache_dir)
    # the input is hashed to find its prepared copy once per process (a run asks for its training and validation
    # data separately), and again only if a file of it changed since
    key = (src, d.glob, fraction, root, tokenizer, d.chat_template,
           _stat_signature(src, tokenizer and os.path.dirname(tokenizer), d.chat_template or None))
    if key not in _PREPARED:
        if is_records_file(src):
            _PREPARED[key] = cached_jsonl(src, root, tokenizer, fraction, d.chat_template or None)
        else:
            _PREPARED[key] = cached_corpus(text_input(src, d.glob, fraction), root, tokenizer)
    return token_folder(_PREPARED[key], src, flag)


_PREPARED: dict[tuple, str] = {}  # this process's prepared folders, by input and the stat of its files


def _stat_signature(*paths: str | None) -> tuple:
    """Size and modification time of every file under `paths` (python-stdlib: this interpreter's, which do not
    change), to notice a changed input without reading it."""
    signature = []
    for path in paths:
        if path is None or path == STDLIB:
            continue
        walked = os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]
        for folder, _, names in walked:
            for name in sorted(names):
                st = os.stat(os.path.join(folder, name))
                signature.append((folder, name, st.st_size, st.st_mtime_ns))
    return tuple(signature)


def cached_jsonl(path: str, root: str, tokenizer: str | None, val_fraction: float,
                 chat_template: str | None = None) -> str:
    """The folder of JSON Lines `path` tokenized (bytes, or the tokenizer.json `tokenizer`, with the special tokens of
    its folder and the chat template that trains: `chat_template`, a training variant of the folder's, or the
    folder's) with its loss masks and record index, in the cache."""
    content = folder_digest(path) if os.path.isdir(path) else sha256_file(path)[1]
    parts = [content, tokenizer_digest(tokenizer) if tokenizer else "bytes", repr(val_fraction),
             f"records v{JSONL_VERSION}", _template_digest(tokenizer, chat_template)]
    key = hashlib.sha256("/".join(parts).encode()).hexdigest()
    return cached_folder(root, os.path.basename(os.path.normpath(path)), key,
                         lambda tmp: prepare_jsonl(path, tmp, tokenizer or "bytes", val_fraction, chat_template))


def _template_digest(tokenizer: str | None, chat_template: str | None) -> str:
    """sha256 of the chat template that trains (a TRL upgrade that changes a training variant prepares anew)."""
    folder = os.path.dirname(os.path.abspath(tokenizer)) if tokenizer else None
    choice = choose_template(chat_template_of(folder) if folder else None, folder, chat_template)
    return f"template {choice.digest}" if choice else "no template"


def model_tokenizer(cfg: Config) -> str | None:
    """The tokenizer.json of --init-from's model (text is tokenized with it), or None: bytes (a zerotrain model of
    bytes, or no --init-from).

    ConfigError if it names no end-of-text token, which ends each document, or if the model is a Hugging Face
    folder without tokenizer.json (older Llama and Mistral folders ship only tokenizer.model): its text would
    otherwise be trained as bytes the model has never seen.
    """
    folder = cfg.checkpoint.init_from
    if not folder:
        return None
    file = os.path.join(folder, TOKENIZER_FILE)
    if not os.path.isfile(file):
        if _zerotrain_folder(folder):
            return None
        only = " (only tokenizer.model)" if os.path.isfile(os.path.join(folder, "tokenizer.model")) else ""
        raise ConfigError(f"--init-from {folder}: no {TOKENIZER_FILE}{only}, and --data {cfg.data.source} is text, "
                          "tokenized with the model's tokenizer; write it with transformers (AutoTokenizer."
                          f"from_pretrained('{folder}').save_pretrained('{folder}')) or give token files prepared "
                          "with the model's tokenizer")
    if is_bytes_tokenizer_json(file):
        return None
    try:
        BPETokenizer.from_file(file)
    except ValueError as e:
        raise ConfigError(f"--init-from {folder}: {file} {e}; it ends each record and document of --data "
                          f"{cfg.data.source} (token files or synthetic data need none)") from None
    return file


def _zerotrain_folder(folder: str) -> bool:
    """A zerotrain checkpoint or export (its manifest or config.json records its tokenizer), not a Hugging Face one."""
    if os.path.isfile(os.path.join(folder, "manifest.json")):
        return True
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f).get("format") == "zerotrain-model"
    except (OSError, ValueError, AttributeError):
        return False


def check_model_tokenizer(cfg: Config, spec: DataSpec) -> None:
    """With --init-from, data that states its tokenizer (a prepared folder) must have been tokenized with the model's:
    ConfigError naming both otherwise. Data that states none (nanoGPT's or llm.c's token files) is taken as it is."""
    folder = cfg.checkpoint.init_from
    if not folder or spec.tokenizer is None:
        return
    file = os.path.join(folder, TOKENIZER_FILE)
    if os.path.isfile(file) and not is_bytes_tokenizer_json(file):
        model = BPETokenizer.from_file(file)
        theirs = f"its tokenizer.json (vocabulary {model.vocab_size}, end-of-text id {model.eot_id})"
    elif os.path.isfile(file) or _zerotrain_folder(folder):
        model, theirs = None, "bytes"
    else:
        model, theirs = None, f"no {TOKENIZER_FILE}"
    data = spec.tokenizer
    ours = "bytes" if data.get("kind") == "bytes" else \
        f"{spec.tokenizer_file or 'a BPE'} (vocabulary {data.get('vocab_size')}, end-of-text id {data.get('eot_id')})"
    if model is None:
        same = theirs == "bytes" and data.get("kind") == "bytes"
    else:
        same = data.get("kind") == "bpe" and spec.tokenizer_file is not None and data.get("eot_id") == model.eot_id \
            and read_tokenizer_file(spec.tokenizer_file).to_str() == model.tokenizer.to_str()
    if not same:
        raise ConfigError(f"{spec.flag} {spec.name} was prepared with {ours}, not with the tokenizer of --init-from "
                          f"{folder} ({theirs}): prepare it again with `zerotrain prepare INPUT OUT --tokenizer "
                          f"{folder}`, or give the text or JSON Lines file itself")


def validation_files(cfg: Config, spec: DataSpec | None = None) -> tuple[list[str], str]:
    """The token files validation reads, and what supplies them (for messages).

    --val-data PATH: its validation split if it has one, else all of it (a text input: every document);
    otherwise the validation split of --data (`spec`, when the caller resolved it already).
    """
    d = cfg.data
    if d.val_data:
        if d.source in SYNTHETIC:
            raise ConfigError(f"--val-data {d.val_data}: --data {d.source} generates its own validation sequences")
        spec = resolve_data(cfg, d.val_data, "--val-data", val_fraction=0.0)
        held_out = any(len(open_token_file(p)) for p in spec.val)
        return spec.val if held_out else spec.train, f"--val-data {d.val_data}"
    return (spec or resolve_data(cfg)).val, f"--data {d.source}"


def _bins(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".bin") and os.path.isfile(os.path.join(folder, n)))


def token_folder(folder: str, name: str, flag: str = "--data") -> DataSpec:
    """A folder of .bin token files: names containing "train" for training, "val" for validation."""
    bins = _bins(folder)
    train = [os.path.join(folder, n) for n in bins if "train" in n]
    val = [os.path.join(folder, n) for n in bins if "val" in n and "train" not in n]
    if not train:
        raise ConfigError(f"{flag} {name}: no training token file (a .bin whose name contains 'train') among {bins}")
    return _described(DataSpec(name, "tokens", folder, train, val, flag=flag), folder)


def token_file(path: str, flag: str = "--data") -> DataSpec:
    """One .bin token file for training; validation from the sibling named with 'val' for 'train', if there is one."""
    folder, base = os.path.split(path)
    sibling = os.path.join(folder, base.replace("train", "val")) if "train" in base else ""
    val = [sibling] if sibling and os.path.isfile(sibling) else []
    return _described(DataSpec(path, "tokens", folder or ".", [path], val, flag=flag), folder or ".")


def _described(spec: DataSpec, folder: str) -> DataSpec:
    """Fill vocabulary, end-of-text and tokenizer from the folder's meta.json and tokenizer.json (never meta.pkl)."""
    meta_path = os.path.join(folder, META)
    meta = None
    if os.path.isfile(meta_path):
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{spec.flag} {spec.name}: {meta_path} is not valid JSON ({e})") from None
        if not isinstance(meta, dict) or not _count(meta.get("vocab_size")):
            raise ConfigError(f"{spec.flag} {spec.name}: {meta_path} has no positive integer \"vocab_size\"")
        spec.vocab_size = meta["vocab_size"]
        spec.eot_id = meta.get("eot_id") if _count(meta.get("eot_id"), zero=True) else None
        if isinstance(meta.get("tokenizer"), dict):
            spec.tokenizer = meta["tokenizer"]
        template = (meta.get("source") or {}).get("template") if isinstance(meta.get("source"), dict) else None
        spec.chat_template = template.get("said") if isinstance(template, dict) else None
    elif os.path.isfile(os.path.join(folder, "meta.pkl")):
        spec.notes.append(f"{os.path.join(folder, 'meta.pkl')} is not read (zerotrain never unpickles); "
                          "write {\"vocab_size\": N} to meta.json beside it, or pass --vocab-size")
    tok_file = os.path.join(folder, TOKENIZER_FILE)
    if os.path.isfile(tok_file):
        spec.tokenizer_file = tok_file
        if spec.tokenizer is None:
            try:
                spec.tokenizer = tokenizer_record(BPETokenizer.from_file(tok_file))
            except Exception as e:  # not a tokenizers file, or one without <|endoftext|>
                raise ConfigError(f"{spec.flag} {spec.name}: {tok_file} is not a usable tokenizer ({e})") from None
            spec.eot_id = spec.tokenizer["eot_id"] if spec.eot_id is None else spec.eot_id
    elif spec.tokenizer and spec.tokenizer.get("file"):
        raise ConfigError(f"{spec.flag} {spec.name}: {meta_path} names {spec.tokenizer['file']}, which is missing")
    return spec


def _count(value, zero: bool = False) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)


def prepare_source(cfg: Config) -> None:
    """Build what the data source needs on disk (the cache of a text input) once, before the ranks start.

    For the launcher: ranks then only read. Cheap when already built (it hashes the input to find it).
    """
    for name, _ in data_sources(cfg.data.source) if is_mixture(cfg.data.source) else [(cfg.data.source, None)]:
        resolve_data(source_config(cfg, name))


def check_source(cfg: Config, *, vocab_given: bool = False) -> DataSpec:
    """Reject a data source that cannot feed this model (ConfigError) and resolve the vocabulary from it.

    `vocab_given`: the user set --vocab-size (flag or TOML); otherwise cfg.model.vocab_size is set from
    the data. Prepares a text input into the cache (so ranks find it built) and scans every token file.
    """
    d, m = cfg.data, cfg.model
    if is_mixture(d.source):
        return _check_mixture_sources(cfg, vocab_given)
    if d.source in SYNTHETIC:
        if d.source == "synthetic-varlen" and m.seq_len < 2:
            raise ConfigError(f"--data synthetic-varlen needs --seq-len >= 2, got {m.seq_len}")
        if d.val_data:
            validation_files(cfg)  # refuses: synthetic data makes its own validation sequences
        return DataSpec(d.source, "synthetic")
    spec = resolve_data(cfg)
    val_paths, val_origin = validation_files(cfg, spec)
    files = [open_token_file(p) for p in spec.train + val_paths]
    spec.train_tokens = sum(len(f) for f in files[: len(spec.train)])
    spec.val_tokens = sum(len(f) for f in files[len(spec.train) :])
    if cfg.loop.eval_every and spec.val_tokens == 0:
        why = "" if d.val_data else " (a single document, or --val-fraction 0, sets nothing aside; token files " \
                                    "need a sibling whose name has 'val')"
        raise ConfigError(f"--eval-every {cfg.loop.eval_every} needs validation tokens and {val_origin} has none{why}: "
                          "pass --val-data PATH")
    check_model_tokenizer(cfg, spec)
    top_file, top_id, top_pos = max(((f, *max_token(f)) for f in files), key=lambda scan: scan[1])
    if vocab_given and cfg.checkpoint.init_from:  # the model's vocabulary, not a flag the user passed
        if spec.vocab_size and m.vocab_size < spec.vocab_size:
            raise ConfigError(f"--data {d.source}: its vocabulary has {spec.vocab_size} ids, more than the "
                              f"{m.vocab_size} of --init-from {cfg.checkpoint.init_from}: prepare it with the model's "
                              f"tokenizer (--tokenizer {cfg.checkpoint.init_from})")
        origin = f"vocabulary of --init-from {cfg.checkpoint.init_from} ({m.vocab_size} ids)"
    elif vocab_given:
        if spec.vocab_size and m.vocab_size < spec.vocab_size:
            raise ConfigError(f"--vocab-size {m.vocab_size} is too small for --data {d.source}: its vocabulary has "
                              f"{spec.vocab_size} ids")
        origin = f"--vocab-size {m.vocab_size}"
    elif spec.vocab_size:
        m.vocab_size = spec.vocab_size
        origin = f"vocabulary size {m.vocab_size} stated by {os.path.join(spec.folder, META)}"
    else:
        m.vocab_size = max(top_id + 1, 1)
        origin = f"vocabulary size {m.vocab_size}"
        spec.notes.append(f"--data {d.source} does not state its vocabulary (no meta.json): using the largest token "
                          f"id + 1 = {m.vocab_size}; set --vocab-size to choose it (GPT-2's is 50257)")
    if top_id >= m.vocab_size:
        raise ConfigError(f"--data {d.source}: token id {top_id} at position {top_pos} of {top_file.path} is not "
                          f"below the {origin}")
    longest = max(len(f) for f in files[: len(spec.train)])  # a window never crosses files
    records = any(has_records(f) for f in files[: len(spec.train)])  # packed whole, however short: no window to fill
    if d.pack and not records and longest < m.seq_len + 1:
        raise ConfigError(f"--data {d.source}: {longest} tokens in its longest training file, fewer than one "
                          f"sequence of --seq-len {m.seq_len} plus its target")
    if not d.pack and spec.eot_id is None:
        raise ConfigError(f"--data {d.source}: --no-pack needs document boundaries, and its folder states no "
                          "end-of-text id (meta.json \"eot_id\")")
    for note in spec.notes:
        print(f"zerotrain: note: {note}", file=sys.stderr, flush=True)
    return spec


def _check_mixture_sources(cfg: Config, vocab_given: bool) -> DataSpec:
    """Each source of a mixture checked as --data alone; they must share one vocabulary and tokenizer (the model's
    vocabulary is theirs). Returns the first source's DataSpec."""
    checked, synthetic = [], []
    for name, _ in data_sources(cfg.data.source):
        own = source_config(cfg, name)
        if name in SYNTHETIC:  # generated over the model's vocabulary, whichever the other sources give it
            synthetic.append(own)
            continue
        checked.append((name, check_source(own, vocab_given=vocab_given), own.model.vocab_size))
    if not checked:
        return DataSpec(cfg.data.source, "synthetic")
    # the sources that state their vocabulary (meta.json, a tokenizer) must state the same; one that states none
    # (token files without meta.json) must fit in it
    vocab = max(v for _, _, v in checked)
    stated = [(name, spec, spec.vocab_size or v) for name, spec, v in checked if spec.vocab_size or spec.tokenizer]
    for other in stated[1:]:
        if other[2] != stated[0][2] or _tokenizers_differ(stated[0][1], other[1]):
            raise _not_one_tokenizer(other, stated[0])
    if stated and stated[0][2] < vocab and not vocab_given:
        raise _not_one_tokenizer(max(checked, key=lambda c: c[2]), stated[0])
    cfg.model.vocab_size = vocab
    for own in synthetic:
        own.model.vocab_size = vocab
        check_source(own, vocab_given=True)
    return checked[0][1]


def _tokenizers_differ(a: DataSpec, b: DataSpec) -> bool:
    """Whether two sources state tokenizers that give ids other meanings: another kind, size or end-of-text id, or
    two tokenizer.json files of one size whose vocabularies differ."""
    facts = [(t.get("kind"), t.get("vocab_size"), t.get("eot_id")) for t in (a.tokenizer, b.tokenizer) if t]
    if len(facts) == 2 and facts[0] != facts[1]:
        return True
    files = [spec.tokenizer_file for spec in (a, b) if spec.tokenizer_file]
    return len(files) == 2 and read_tokenizer_file(files[0]).to_str() != read_tokenizer_file(files[1]).to_str()


def _not_one_tokenizer(source: tuple[str, DataSpec, int], first: tuple[str, DataSpec, int]) -> ConfigError:
    """Two sources of a mixture ((name, spec, vocabulary) each) that do not share one tokenizer, in one line."""
    def said(spec: DataSpec, vocab: int) -> str:
        kind = f"{spec.tokenizer['kind']} tokenizer, " if spec.tokenizer else ""
        return f"{kind}a vocabulary of {vocab} ids" + (f", end-of-text id {spec.eot_id}" if spec.eot_id is not None
                                                       else "")
    (name, spec, vocab), (first_name, first_spec, first_vocab) = source, first
    return ConfigError(f"--data {name}: {said(spec, vocab)}, --data {first_name}'s {said(first_spec, first_vocab)}: "
                       "the sources of a mixture must share one tokenizer (prepare them with the same one)")


def checkpoint_tokenizer(cfg: Config) -> tuple[dict | None, dict[str, str]]:
    """What a checkpoint keeps of the tokenizer: (its manifest record or None, {file name: the file to copy}).

    Without --init-from, the data's tokenizer.json, if it has one. With --init-from, the model's own: its
    tokenizer.json and the files that configure it (tokenizer_config.json, special_tokens_map.json,
    chat_template.jinja, generation_config.json; the record lists them under "files"), and its context length and
    special ids, which an export writes back (tokenizer_config.model_facts): on any data, synthetic too.
    """
    if is_mixture(cfg.data.source):  # the sources share one tokenizer (check_source): the first real one's
        names = [name for name, _ in data_sources(cfg.data.source) if name not in SYNTHETIC]
        cfg = source_config(cfg, names[0] if names else "synthetic")
    # preference pairs and prompts are encoded by the --init-from model's tokenizer as they are read (data/pairs.py,
    # data/prompts.py)
    spec = None if cfg.data.source in SYNTHETIC or cfg.objective.method in ("dpo", "grpo") else resolve_data(cfg)
    record = dict(spec.tokenizer) if spec and spec.tokenizer else None
    copied = {TOKENIZER_FILE: spec.tokenizer_file} if spec and spec.tokenizer_file else {}
    model = cfg.checkpoint.init_from
    if not model:
        return record, copied
    own = os.path.join(model, TOKENIZER_FILE)
    if os.path.isfile(own) and not is_bytes_tokenizer_json(own):
        if record is None or record.get("kind") != "bpe":
            try:
                record = tokenizer_record(BPETokenizer.from_file(own))
            except ValueError:  # no end-of-text token it knows: the model's facts name its eos
                record = {"kind": "bpe", "vocab_size": read_tokenizer_file(own).get_vocab_size(), "eot_id": None}
        copied, record["file"] = {TOKENIZER_FILE: own}, TOKENIZER_FILE
    files = config_files(model)
    copied.update(files)
    record = {**(record or {}), **model_facts(model), **({"files": sorted(files)} if files else {})}
    return record or None, copied
