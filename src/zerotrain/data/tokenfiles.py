"""Token files on disk: llm.c's headered .bin and nanoGPT's headerless uint16 .bin, memory-mapped; writing llm.c files.

llm.c layout: a 1024-byte header of 256 little-endian int32 (header[0] = 20240520, header[1] = version,
header[2] = token count, the rest 0), then the tokens: uint16 for version 1, uint32 for version 2. A file
without that magic is read as nanoGPT's headerless little-endian uint16 array, unless its header is
llm.c's with the magic damaged (see `damaged_llmc_header`): read as tokens, such a header would train
as 512 garbage tokens and inflate the inferred vocabulary to its bad magic, so it is refused instead.
Nothing is loaded whole: a file is a numpy memmap, and scans go through it in chunks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from zerotrain.errors import ConfigError

LLMC_MAGIC, HEADER_INTS = 20240520, 256
HEADER_BYTES = HEADER_INTS * 4
LLMC_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
# llm.c's other .bin files share the 256 x int32 header; given as data they are a mistake, not tokens.
LLMC_OTHER_MAGICS = {20240326: "GPT-2 model checkpoint", 20240327: "debug state", 20240328: "tokenizer",
                     20240527: "training state"}
# A first int32 this few bits from the magic is a damaged llm.c header (a flipped bit, a bad sector):
# headerless tokens 0 and 1 would have to form one of 529 of the 2**32 values.
NEAR_MAGIC_BITS = 2
SCAN_CHUNK = 1 << 24  # tokens per chunk of a scan: 32-64 MiB of file at a time


@dataclass
class TokenFile:
    """One memory-mapped token file: `tokens` is a read-only view of its token array; `mask`, when the file has a
    `.mask` sibling (JSON Lines data), one byte per token: 1 where the token is a target the loss counts."""

    path: str
    layout: str  # "llm.c v1", "llm.c v2" or "nanoGPT"
    tokens: np.ndarray
    mask: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def mask_path(path: str) -> str:
    """The loss mask beside token file `path`: train.bin -> train.mask."""
    return (path[:-4] if path.endswith(".bin") else path) + ".mask"


def open_token_file(path: str) -> TokenFile:
    """Memory-map `path` (and its loss mask, if any) as an llm.c or nanoGPT token file; ConfigError if it is neither."""
    file = _open_tokens(path)
    mask = mask_path(path)
    if os.path.isfile(mask):
        size = os.path.getsize(mask)
        if size != len(file):
            raise ConfigError(f"{mask}: {size} mask bytes for the {len(file)} tokens of {path}: written by another "
                              "preparation, or truncated")
        file.mask = np.memmap(mask, dtype=np.uint8, mode="r") if size else np.zeros(0, dtype=np.uint8)
    return file


def _open_tokens(path: str) -> TokenFile:
    size = os.path.getsize(path)
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS) if size >= HEADER_BYTES else None
    problem = damaged_llmc_header(header, size) if header is not None else None
    if problem:
        raise ConfigError(f"{path}: {problem}")
    if header is not None and header[0] == LLMC_MAGIC:
        version, count = int(header[1]), int(header[2])
        if version not in LLMC_DTYPES:
            raise ConfigError(f"{path}: llm.c header has version {version}; known: 1 (uint16), 2 (uint32)")
        dtype = LLMC_DTYPES[version]
        if size != HEADER_BYTES + count * dtype.itemsize:
            raise ConfigError(f"{path}: llm.c header says {count} {dtype.name} tokens, but the file has {size} bytes "
                              f"(expected {HEADER_BYTES + count * dtype.itemsize}): truncated or not a token file")
        tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,)) if count else \
            np.zeros(0, dtype=dtype)
        return TokenFile(path, f"llm.c v{version}", tokens)
    if size % 2:
        raise ConfigError(f"{path}: neither an llm.c token file (no magic {LLMC_MAGIC} in a 1024-byte header) nor "
                          f"nanoGPT's headerless uint16 tokens (odd size, {size} bytes)")
    tokens = np.memmap(path, dtype="<u2", mode="r") if size else np.zeros(0, dtype="<u2")
    return TokenFile(path, "nanoGPT", tokens)


def damaged_llmc_header(header: np.ndarray, size: int) -> str | None:
    """Why this 256 x int32 header is llm.c's though its magic is not LLMC_MAGIC (the refusal); None if it is not.

    Evidence, any one of: the magic is one of llm.c's other files'; it is within NEAR_MAGIC_BITS bits of
    LLMC_MAGIC; or the version is a known one and either the count matches the file's size or the rest
    of the header is zero, as llm.c writes it. Headerless tokens match none of these by chance: the
    version field would need tokens 2 and 3 to be (1 or 2, 0), and then 506 zero tokens or a count
    exact to the byte.
    """
    magic, version, count = (int(v) for v in header[:3])
    if magic == LLMC_MAGIC:
        return None
    if magic in LLMC_OTHER_MAGICS:
        return (f"an llm.c {LLMC_OTHER_MAGICS[magic]} (magic {magic}), not a token file (magic {LLMC_MAGIC}): "
                f"give the *_train.bin / *_val.bin files llm.c's data scripts write")
    damaged = "not read as headerless nanoGPT tokens; re-create or re-download the file"
    flipped = bin((magic ^ LLMC_MAGIC) & 0xFFFFFFFF).count("1")
    if flipped <= NEAR_MAGIC_BITS:
        return (f"damaged llm.c header: magic {magic} is {LLMC_MAGIC} with {flipped} bit(s) flipped (version "
                f"field {version}, token count field {count}); {damaged}")
    if version not in LLMC_DTYPES:
        return None
    expected = HEADER_BYTES + count * LLMC_DTYPES[version].itemsize
    if size == expected:
        why = f"its version {version} and token count {count} match the file's {size} bytes"
    elif not header[3:].any():
        why = f"its version is {version} and the rest of its header is zero, as llm.c writes it"
    else:
        return None
    return f"damaged llm.c header: magic {magic} instead of {LLMC_MAGIC}, though {why}; {damaged}"


def max_token(file: TokenFile) -> tuple[int, int]:
    """(largest token id, its first position) of the file, by a chunked scan; (-1, -1) when it is empty."""
    best, where = -1, -1
    for lo in range(0, len(file), SCAN_CHUNK):
        chunk = file.tokens[lo : lo + SCAN_CHUNK]
        i = int(np.argmax(chunk))
        if int(chunk[i]) > best:
            best, where = int(chunk[i]), lo + i
    return best, where


def positions_of(file: TokenFile, token: int) -> np.ndarray:
    """Every position holding `token`, by a chunked scan (document ends, for unpacked sequences)."""
    found = [lo + np.flatnonzero(file.tokens[lo : lo + SCAN_CHUNK] == token)
             for lo in range(0, len(file), SCAN_CHUNK)]
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def token_dtype(vocab_size: int) -> tuple[np.dtype, int]:
    """The narrowest llm.c token type for a vocabulary: (dtype, header version)."""
    return (LLMC_DTYPES[1], 1) if vocab_size <= 1 << 16 else (LLMC_DTYPES[2], 2)


class LlmcWriter:
    """Appends token chunks to an llm.c file; the header's count is filled in on close, then fsynced."""

    def __init__(self, path: str, vocab_size: int):
        self.path, (self.dtype, self.version) = path, token_dtype(vocab_size)
        self.count = 0
        self.f = open(path, "wb")
        self.f.write(bytes(HEADER_BYTES))

    def write(self, tokens) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        self.f.write(array.tobytes())
        self.count += len(array)

    def close(self) -> None:
        if self.count >= 1 << 31:  # header[2] is an int32
            raise ConfigError(f"{self.path}: {self.count} tokens do not fit an llm.c header (at most 2**31 - 1)")
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:3] = (LLMC_MAGIC, self.version, self.count)
        self.f.seek(0)
        self.f.write(header.tobytes())
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def write_llmc(path: str, tokens, vocab_size: int) -> None:
    """Write a whole token array as an llm.c file (uint16, version 1, when the vocabulary allows; else uint32)."""
    writer = LlmcWriter(path, vocab_size)
    writer.write(tokens)
    writer.close()
