"""Token sources: (seed, step, global sample index) -> one training sequence.

Every sequence of step s is a pure function of (seed, s, its index in the global batch), so how the
global batch is split over ranks and micro-batches never changes what is trained on, and resuming
at step s needs no loader state at all.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from ..config import Config, ConfigError

IGNORE = -100  # label of a masked position, as PyTorch's cross_entropy ignore_index
_TOKENS, _LENGTH = 0, 1  # independent random streams per sample


def _rng(seed: int, step: int, index: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, index, stream])))


class SyntheticSource:
    """Seeded token sequences from a fixed random Markov chain, so the loss has something to learn.

    Each next token is perm[previous] with probability 0.8, else uniform noise. With ``varlen`` each
    sequence is a document of random length (at least 2 tokens), padded with label-masked positions.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, varlen: bool = False):
        self.vocab_size, self.seq_len, self.seed, self.varlen = vocab_size, seq_len, seed, varlen
        chain_rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x5EED])))
        self.perm = chain_rng.permutation(vocab_size)

    def _length(self, step: int, index: int) -> int:
        """Real tokens in the sequence (inputs plus the final target)."""
        if not self.varlen:
            return self.seq_len + 1
        return int(_rng(self.seed, step, index, _LENGTH).integers(2, self.seq_len + 2))

    def sequences(self, step: int, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        T, n = self.seq_len, len(indices)
        start = np.empty(n, dtype=np.int64)
        noise = np.empty((n, T), dtype=np.int64)
        use_noise = np.empty((n, T), dtype=bool)
        for row, i in enumerate(indices):
            rng = _rng(self.seed, step, i, _TOKENS)
            start[row] = rng.integers(self.vocab_size)
            noise[row] = rng.integers(self.vocab_size, size=T)
            use_noise[row] = rng.random(T) < 0.2
        tokens = np.empty((n, T + 1), dtype=np.int64)
        tokens[:, 0] = start
        for t in range(T):
            tokens[:, t + 1] = np.where(use_noise[:, t], noise[:, t], self.perm[tokens[:, t]])
        lengths = [self._length(step, i) for i in indices]
        return _inputs_and_labels(tokens, lengths)

    def token_count(self, step: int, global_batch: int) -> int:
        return sum(self._length(step, i) - 1 for i in range(global_batch))


class TextSource:
    """A UTF-8 text file read as bytes (vocab 256), memory-mapped.

    Packed: each sequence is a window at a seeded random offset. Unpacked: the file is split into
    documents on blank lines and each sequence is one document, truncated or padded and masked.
    """

    def __init__(self, path: str, seq_len: int, seed: int, pack: bool = True):
        self.seq_len, self.seed, self.pack = seq_len, seed, pack
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        self.docs = None if pack else _documents(self.data, seq_len)

    def _window(self, step: int, index: int) -> np.ndarray:
        rng = _rng(self.seed, step, index, _TOKENS)
        if self.pack:
            off = int(rng.integers(0, len(self.data) - self.seq_len))
            return self.data[off : off + self.seq_len + 1]
        start, end = self.docs[int(rng.integers(len(self.docs)))]
        return self.data[start : min(end, start + self.seq_len + 1)]

    def sequences(self, step: int, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = np.zeros((len(indices), self.seq_len + 1), dtype=np.int64)
        lengths = []
        for row, i in enumerate(indices):
            w = self._window(step, i)
            tokens[row, : len(w)] = w
            lengths.append(len(w))
        return _inputs_and_labels(tokens, lengths)

    def token_count(self, step: int, global_batch: int) -> int:
        if self.pack:
            return global_batch * self.seq_len
        return sum(len(self._window(step, i)) - 1 for i in range(global_batch))


def _inputs_and_labels(tokens: np.ndarray, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs are tokens[:-1], labels tokens[1:]; labels past a sequence's real length are masked."""
    x = torch.from_numpy(tokens[:, :-1].copy())
    y = torch.from_numpy(tokens[:, 1:].copy())
    for row, length in enumerate(lengths):
        y[row, length - 1 :] = IGNORE
        x[row, length:] = 0
    return x, y


def _documents(data: np.ndarray, seq_len: int) -> list[tuple[int, int]]:
    """Byte ranges of the blank-line separated documents with at least two bytes."""
    text = bytes(data)
    docs, start = [], 0
    for m in re.finditer(rb"\n[ \t\r]*\n\s*", text):
        docs.append((start, m.start()))
        start = m.end()
    docs.append((start, len(text)))
    return [(s, e) for s, e in docs if e - s >= 2]


def text_shortfall(path: str, seq_len: int, pack: bool) -> str | None:
    """Why this text file cannot feed training, or None when it can."""
    size = os.path.getsize(path)
    if pack and size < seq_len + 1:
        return f"file has {size} bytes, fewer than one sequence of --seq-len {seq_len} plus its target"
    if not pack and not _documents(np.fromfile(path, dtype=np.uint8), seq_len):
        return "no blank-line separated document of at least 2 bytes"
    return None


def make_source(cfg: Config):
    d, m, seed = cfg.data, cfg.model, cfg.run.seed
    if d.source == "synthetic":
        return SyntheticSource(m.vocab_size, m.seq_len, seed)
    if d.source == "synthetic-varlen":
        return SyntheticSource(m.vocab_size, m.seq_len, seed, varlen=True)
    return TextSource(d.source, m.seq_len, seed, pack=d.pack)


def check_source(cfg: Config) -> None:
    """Reject a data source that cannot feed this model, before any worker starts (ConfigError)."""
    d, m = cfg.data, cfg.model
    if d.source in ("synthetic", "synthetic-varlen"):
        if d.source == "synthetic-varlen" and m.seq_len < 2:
            raise ConfigError(f"--data synthetic-varlen needs --seq-len >= 2, got {m.seq_len}")
        return
    if not os.path.isfile(d.source):
        raise ConfigError(f"--data {d.source}: no such file (use 'synthetic' or a text file path)")
    if m.vocab_size < 256:
        raise ConfigError(f"--vocab-size {m.vocab_size} is too small for byte-level text data (needs 256)")
    problem = text_shortfall(d.source, m.seq_len, d.pack)
    if problem:
        raise ConfigError(f"--data {d.source}: {problem}")
