"""Text inputs as documents: the Python standard library, a UTF-8 text file, a folder of text files; the val split.

A document is a file (the standard library, a folder) or, in a single text file, a blank-line separated
paragraph (the newline ending it and the blank lines are dropped: the end-of-text token takes their place). Each
document goes to the validation split when the sha256 of its name, read as a fraction of 2**64, is
below --val-fraction: deterministic, disjoint from training, and stable when other documents are
added or removed. The name is a file's path relative to the input, or a paragraph's own sha256 (so
a repeated paragraph never lands in both splits).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from zerotrain.errors import ConfigError

STDLIB = "python-stdlib"
# Not the standard library's text: its test suites, installed packages, caches.
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_PARAGRAPH_BREAK = re.compile(rb"\n[ \t\r]*\n\s*")


@dataclass
class Document:
    name: str  # what the split is decided from
    split: str  # "train" or "val"
    read: Callable[[], bytes]  # its UTF-8 bytes, checked


class TextInput:
    """The documents of one text input in order (sorted paths, or paragraph order), each in train or val."""

    def __init__(self, kind: str, label: str, names: list[str], readers: list[Callable[[], bytes]],
                 val_fraction: float, skipped: list[str] | None = None):
        self.kind, self.label, self.val_fraction = kind, label, val_fraction
        self.skipped = skipped or []  # standard-library files left out (not UTF-8 text)
        splits = assign_splits(names, val_fraction)
        self.documents = [Document(n, s, r) for n, s, r in zip(names, splits, readers)]

    def __iter__(self) -> Iterator[tuple[Document, bytes]]:
        for doc in self.documents:
            yield doc, doc.read()

    def hasher(self) -> "ContentHash":
        return ContentHash(self.kind, self.val_fraction)

    def content_hash(self) -> str:
        """sha256 of every document's name, split and bytes, in order: what a prepared copy is keyed by."""
        h = self.hasher()
        for doc, data in self:
            h.update(doc, data)
        return h.hexdigest()


class ContentHash:
    """The running sha256 behind TextInput.content_hash, for a caller that reads the documents anyway."""

    def __init__(self, kind: str, val_fraction: float):
        self.h = hashlib.sha256(f"{kind}\0{val_fraction!r}\0".encode())

    def update(self, doc: Document, data: bytes) -> None:
        self.h.update(f"{doc.name}\0{doc.split}\0{len(data)}\0".encode())
        self.h.update(data)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def fraction_of(name: str) -> float:
    """sha256 of `name` as a number in [0, 1)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()[:8], "big") / 2**64


def assign_splits(names: list[str], val_fraction: float) -> list[str]:
    """"val" where the name hashes below val_fraction; with two documents or more and val_fraction > 0,
    at least one of each split (the lowest hash goes to val, the highest to train)."""
    fractions = [fraction_of(n) for n in names]
    splits = ["val" if f < val_fraction else "train" for f in fractions]
    if val_fraction > 0 and len(names) >= 2:
        if "val" not in splits:
            splits[fractions.index(min(fractions))] = "val"
        if "train" not in splits:
            splits[fractions.index(max(fractions))] = "train"
    return splits


def check_text(data: bytes, path: str) -> None:
    """ConfigError naming `path` and the offset of its first byte that is not UTF-8 text (a NUL counts: binary)."""
    nul = data.find(b"\0")
    try:
        data.decode("utf-8")
        bad = None
    except UnicodeDecodeError as e:
        bad = e.start
    if nul >= 0 and (bad is None or nul < bad):
        raise ConfigError(f"--data {path}: not UTF-8 text: NUL byte at offset {nul} (a binary file?)")
    if bad is not None:
        raise ConfigError(f"--data {path}: not UTF-8 text: invalid byte 0x{data[bad]:02x} at offset {bad}")


def _reader(path: str) -> Callable[[], bytes]:
    def read() -> bytes:
        with open(path, "rb") as f:
            data = f.read()
        check_text(data, path)
        return data
    return read


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
    """The standard library's .py files relative to its root, sorted; test folders and site-packages left out."""
    root = root or stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")]
        rel = os.path.relpath(folder, root)
        for name in files:
            if name.endswith(".py"):
                found.append(Path(rel, name).as_posix() if rel != "." else name)
    return sorted(found)


def stdlib_input(val_fraction: float, root: str | None = None) -> TextInput:
    """The running interpreter's standard-library sources; a file that is not UTF-8 text is left out, not fatal."""
    root = root or stdlib_root()
    names, readers, skipped = [], [], []
    for rel in stdlib_files(root):
        path = os.path.join(root, rel)
        try:
            _reader(path)()
        except (ConfigError, OSError):
            skipped.append(rel)
            continue
        names.append(rel)
        readers.append(_reader(path))
    if not names:
        raise ConfigError(f"--data {STDLIB}: no readable .py files under {root}")
    label = f"{STDLIB} (Python {sys.version.split()[0]}, {root})"
    return TextInput(STDLIB, label, names, readers, val_fraction, skipped)


def folder_input(folder: str, glob: str, val_fraction: float) -> TextInput:
    files = sorted(p for p in Path(folder).glob(glob) if p.is_file())
    if not files:
        raise ConfigError(f"--data {folder}: no file matches --glob {glob!r}")
    names = [p.relative_to(folder).as_posix() for p in files]
    return TextInput("text-folder", f"{folder} ({len(files)} file{'s' * (len(files) != 1)} matching {glob!r})", names,
                     [_reader(str(p)) for p in files], val_fraction)


def file_input(path: str, val_fraction: float) -> TextInput:
    """One text file, split into blank-line separated paragraphs (the documents)."""
    data = _reader(path)()
    paragraphs, start = [], 0
    for m in _PARAGRAPH_BREAK.finditer(data):
        paragraphs.append(data[start : m.start()])
        start = m.end()
    paragraphs.append(data[start:].rstrip(b"\r\n"))  # like the others, without the newline that ends it
    paragraphs = [p for p in paragraphs if p]
    names = [hashlib.sha256(p).hexdigest() for p in paragraphs]
    return TextInput("text-file", path, names, [lambda p=p: p for p in paragraphs], val_fraction)


def text_input(spec: str, glob: str, val_fraction: float) -> TextInput:
    """The documents `--data` names: python-stdlib, a text file, or a folder of text files."""
    if spec == STDLIB:
        return stdlib_input(val_fraction)
    if os.path.isdir(spec):
        return folder_input(spec, glob, val_fraction)
    return file_input(spec, val_fraction)
