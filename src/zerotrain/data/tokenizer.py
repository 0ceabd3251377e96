"""Tokenizers: UTF-8 bytes, or a byte-level BPE trained locally with Hugging Face `tokenizers`; `load_tokenizer`.

Both share one convention: the end-of-text token (the separator between documents) is id 0. For bytes
it is the NUL byte, which never occurs in accepted text (a NUL marks a file as binary), so the
vocabulary stays 256; for BPE it is the special token `<|endoftext|>`, which the trainer places first.
`decode` renders it as the text `<|endoftext|>`, and `encode` maps that text back to it, for both.
A model's own tokenizer.json keeps the end-of-text token its folder names (`end_of_text_id`: its
tokenizer_config.json's eos_token, or its eos_token_id) and the BOS its post-processor adds.

The byte tokenizer also has a `tokenizers` twin (`ByteTokenizer.to_hf`) for Hugging Face exports: a
BPE without merges over GPT-2's 256 byte characters. `load_tokenizer` recognises its tokenizer.json and
gives the ByteTokenizer back.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

EOT_TEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves a chat template
BYTES_VOCAB, BYTES_EOT = 256, 0
_EOT_SPLIT = re.compile(re.escape(EOT_TEXT))


class ByteTokenizer:
    """Text as its UTF-8 bytes; id 0 (NUL) is the end-of-text token."""

    kind, vocab_size, eot_id = "bytes", BYTES_VOCAB, BYTES_EOT

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(_EOT_SPLIT.split(text)):
            if i:
                ids.append(self.eot_id)
            ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids) -> str:
        """Invalid UTF-8 (a model's sampled bytes can be) decodes as U+FFFD, as the BPE decoder does; so does
        an id past the bytes (a model whose --vocab-size exceeds 256)."""
        parts, run = [], bytearray()
        for i in map(int, ids):
            if 0 <= i < BYTES_VOCAB and i != self.eot_id:
                run.append(i)
                continue
            parts += [run.decode("utf-8", "replace"), EOT_TEXT if i == self.eot_id else "\ufffd"]
            run = bytearray()
        return "".join(parts) + run.decode("utf-8", "replace")

    def to_hf(self):
        """This tokenizer as a Hugging Face `tokenizers.Tokenizer`: the same ids for every text, the same decode.

        A BPE with no merges after GPT-2's ByteLevel pre-tokenizer: each UTF-8 byte becomes its printable
        character (bytes_to_unicode) and each character one token, whose id is the byte's value. The NUL
        byte's character is left out of the vocabulary and `<|endoftext|>` (id 0) is the unknown token,
        so a NUL encodes to 0 as here, and id 0 decodes to the text `<|endoftext|>` as here.
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tokenizer = Tokenizer(models.BPE(vocab=bytes_hf_vocab(), merges=[], unk_token=EOT_TEXT))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([EOT_TEXT])  # matched whole in text, before the pre-tokenizer splits it
        return tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer applies to UTF-8 bytes."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # '!'..'~', '¡'..'¬', '®'..'ÿ'
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def bytes_hf_vocab() -> dict[str, int]:
    """The byte tokenizer's vocabulary in `tokenizers` terms: each byte's character -> the byte, NUL's as EOT."""
    return {EOT_TEXT: BYTES_EOT, **{c: b for b, c in bytes_to_unicode().items() if b != BYTES_EOT}}


def is_bytes_tokenizer_json(path: str) -> bool:
    """Whether `path` is the byte tokenizer's tokenizer.json (ByteTokenizer.to_hf saved): a BPE of the byte
    vocabulary with no merges. A trained BPE never is one: it has at least 257 ids."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError:  # not JSON: BPETokenizer.from_file says what is wrong with it
        return False
    model = data.get("model") if isinstance(data, dict) else None
    return isinstance(model, dict) and model.get("type") == "BPE" and not model.get("merges") and \
        model.get("vocab") == bytes_hf_vocab()


# What a folder says its end-of-text token is, beside tokenizer.json: transformers' files, then zerotrain's records.
TOKENIZER_CONFIG, SPECIAL_ID_FILES, OWN_RECORDS = "tokenizer_config.json", ("generation_config.json", "config.json"), \
    ("meta.json", "manifest.json")
NO_EOT = (f"names no end-of-text token (no eos_token in {TOKENIZER_CONFIG}, no eos_token_id in "
          f"{' or '.join(SPECIAL_ID_FILES)} that is one of its added tokens, no {EOT_TEXT})")


class BPETokenizer:
    """A Hugging Face `tokenizers` tokenizer (tokenizer.json): zerotrain's byte-level BPE, or a model's own.

    Its end-of-text token is the one the folder of tokenizer.json names (`end_of_text_id`). `prefix_ids` are the
    special tokens its post-processor puts before a text (a Llama's BOS), `special_ids` its special tokens.
    """

    kind = "bpe"

    def __init__(self, tokenizer, folder: str | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eot_id = end_of_text_id(tokenizer, folder)
        self.special_ids = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self.prefix_ids = post_processor_prefix(tokenizer)
        self.folder = folder

    @classmethod
    def from_file(cls, path: str) -> "BPETokenizer":
        return cls(read_tokenizer_file(path), os.path.dirname(os.path.abspath(path)))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts on all cores; without offsets where the library can (no offsets to compute)."""
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [e.ids for e in encode(texts)]

    def encode_pieces(self, texts: list[str], offsets: bool = False) -> list:
        """Many texts on all cores, each as the tokenizer encodes the whole text, without the special tokens its
        post-processor adds (the caller places BOS and EOS once per record): `tokenizers.Encoding`s, with their
        character offsets when `offsets`."""
        if offsets:
            return self.tokenizer.encode_batch(texts, add_special_tokens=False)
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return encode(texts, add_special_tokens=False)

    def save(self, path: str) -> None:
        self.tokenizer.save(path)


def end_of_text_id(tokenizer, folder: str | None) -> int:
    """The id of the end-of-text token the folder beside tokenizer.json names; ValueError (NO_EOT) if it names none.

    In order: zerotrain's own record of it (a prepared folder's meta.json, a checkpoint's manifest.json);
    tokenizer_config.json's eos_token (a model folder, as transformers reads it); generation_config.json's or
    config.json's eos_token_id (the first, if a list), where it is one of the tokenizer's added tokens (a folder
    whose config.json is a library default for another vocabulary names an ordinary token); the tokenizer's
    own <|endoftext|> (zerotrain's BPE, GPT-2's). Never a guess among other names.
    """
    if folder:
        meta, manifest = (read_json_object(folder, name) for name in OWN_RECORDS)
        record = manifest.get("tokenizer") if isinstance(manifest.get("tokenizer"), dict) else {}
        own = meta.get("eot_id", record.get("eot_id"))
        if _is_id(own, tokenizer):
            return own
        eos = read_json_object(folder, TOKENIZER_CONFIG).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            if tokenizer.token_to_id(eos) is None:
                raise ValueError(f"{TOKENIZER_CONFIG} names eos_token {eos!r}, which tokenizer.json does not have")
            return tokenizer.token_to_id(eos)
        added = tokenizer.get_added_tokens_decoder()
        for name in SPECIAL_ID_FILES:
            eos_id = read_json_object(folder, name).get("eos_token_id")
            eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
            if _is_id(eos_id, tokenizer) and eos_id in added:
                return eos_id
    if tokenizer.token_to_id(EOT_TEXT) is None:
        raise ValueError(NO_EOT)
    return tokenizer.token_to_id(EOT_TEXT)


def post_processor_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer's post-processor puts before a text: [BOS] for `<s> $A`, [] for GPT-2's."""
    encoding = tokenizer.encode("a", add_special_tokens=True)
    prefix = []
    for i, special in zip(encoding.ids, encoding.special_tokens_mask):
        if not special:
            break
        prefix.append(i)
    return prefix


def _is_id(value, tokenizer) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < tokenizer.get_vocab_size()


def read_json_object(folder: str, name: str) -> dict:
    """The JSON object in folder/name, or {} (absent, or not an object: the model folder check reads it strictly and
    says what is wrong)."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def read_tokenizer_file(path: str):
    """The `tokenizers.Tokenizer` saved in `path`; ValueError with the library's one line on why the file is not one
    (`missing field `unk_token` at line 1 column 58`)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception carrying serde's message
        raise ValueError(str(e)) from None


def train_bpe(texts, vocab_size: int, length: int | None = None) -> BPETokenizer:
    """Train a byte-level BPE of `vocab_size` ids (all 256 bytes, `<|endoftext|>` as id 0, then merges) locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's splitting
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    return BPETokenizer(tokenizer)


def tokenizer_file(spec: str) -> str | None:
    """The tokenizer.json a --tokenizer PATH names (the file, or a folder holding one); None if it names none."""
    path = os.path.join(spec, TOKENIZER_FILE) if os.path.isdir(spec) else spec
    return path if os.path.isfile(path) and path.endswith(".json") else None


def parse_tokenizer_spec(spec: str) -> tuple[str, int]:
    """`bytes` -> ("bytes", 256); `bpe:N` -> ("bpe", N); a tokenizer.json or a folder with one -> ("file", its
    vocabulary size). ValueError naming what is accepted."""
    if spec == "bytes":
        return "bytes", BYTES_VOCAB
    file = tokenizer_file(spec)
    if file is not None:
        try:
            return "file", BPETokenizer.from_file(file).vocab_size
        except Exception as e:  # noqa: BLE001 - the tokenizers library's errors, said in one line
            raise ValueError(f"--tokenizer {spec}: {file} is not a usable tokenizer ({e})") from None
    m = re.fullmatch(r"bpe:(\d+)", spec)
    if not m:
        raise ValueError(f"--tokenizer {spec!r}: use bytes, bpe:N (N the vocabulary size, e.g. bpe:4096), or a "
                         "tokenizer.json or a model folder holding one")
    n = int(m.group(1))
    if n < BYTES_VOCAB + 1:
        raise ValueError(f"--tokenizer {spec}: a byte-level BPE needs N >= {BYTES_VOCAB + 1} "
                         f"(256 bytes and {EOT_TEXT})")
    return "bpe", n


def tokenizer_digest(file: str) -> str:
    """sha256 over tokenizer.json and the files beside it that decide its special tokens and chat template: what a
    cache of data tokenized with it is named by."""
    h = hashlib.sha256()
    folder = os.path.dirname(os.path.abspath(file))
    for name in (os.path.basename(file), TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE, *SPECIAL_ID_FILES):
        path = file if name == os.path.basename(file) else os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def tokenizer_record(tokenizer) -> dict:
    """What a checkpoint manifest and a prepared folder's meta.json record of a tokenizer."""
    record = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id}
    if tokenizer.kind == "bpe":
        record["file"] = TOKENIZER_FILE
    return record


def load_tokenizer(path: str):
    """The tokenizer of a checkpoint folder (or root), a prepared data folder, an exported folder or a tokenizer.json.

    A folder with tokenizer.json gives the BPE tokenizer it holds; a folder without one, or whose
    tokenizer.json is the byte tokenizer's (an hf export of a bytes model), the byte tokenizer.
    The result has encode(text) -> list[int], decode(ids) -> str, vocab_size, eot_id and kind.
    """
    if os.path.isfile(path):
        return ByteTokenizer() if is_bytes_tokenizer_json(path) else BPETokenizer.from_file(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such folder or tokenizer.json")
    latest = os.path.join(path, "latest")  # a checkpoint root: the checkpoint `latest` names
    if not os.path.isfile(os.path.join(path, TOKENIZER_FILE)) and os.path.isfile(latest):
        with open(latest) as f:
            path = os.path.join(path, f.read().strip())
    file = os.path.join(path, TOKENIZER_FILE)
    if os.path.isfile(file) and not is_bytes_tokenizer_json(file):
        return BPETokenizer.from_file(file)
    return ByteTokenizer()

