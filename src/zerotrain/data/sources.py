"""Token sources: (seed, step, global sample index) -> one training sequence.

Every sequence of step s is a pure function of (seed, s, its index in the global batch), so how the
global batch is split over ranks and micro-batches never changes what is trained on, and resuming
at step s needs no loader state at all. A validation source (split="val") is the same function over
the validation data with a fixed seed: its batch k is the same in every run, whatever --seed, so
validation losses over batches 0..n-1 compare across runs.
"""

from __future__ import annotations

import numpy as np
import torch

from zerotrain.config import Config
from zerotrain.errors import ConfigError

from .resolve import resolve_data, validation_files
from .tokenfiles import TokenFile, open_token_file, positions_of

IGNORE = -100  # label of a masked position, as PyTorch's cross_entropy ignore_index
_TOKENS, _LENGTH = 0, 1  # independent random streams per sample
_VAL_STREAMS = 2  # synthetic validation draws from streams 2 and 3: never a training sequence
VAL_SEED = 0  # validation windows do not depend on --seed


def _rng(seed: int, step: int, index: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, index, stream])))


class SyntheticSource:
    """Seeded token sequences from a fixed random Markov chain, so the loss has something to learn.

    Each next token is perm[previous] with probability 0.8, else uniform noise. With ``varlen`` each
    sequence is a document of random length (at least 2 tokens), padded with label-masked positions.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, varlen: bool = False, split: str = "train"):
        self.vocab_size, self.seq_len, self.seed, self.varlen = vocab_size, seq_len, seed, varlen
        self.stream = _VAL_STREAMS if split == "val" else 0  # the chain stays the seed's; the draws differ
        chain_rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x5EED])))
        self.perm = chain_rng.permutation(vocab_size)

    def _length(self, step: int, index: int) -> int:
        """Real tokens in the sequence (inputs plus the final target)."""
        if not self.varlen:
            return self.seq_len + 1
        return int(_rng(self.seed, step, index, self.stream + _LENGTH).integers(2, self.seq_len + 2))

    def sequences(self, step: int, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        T, n = self.seq_len, len(indices)
        start = np.empty(n, dtype=np.int64)
        noise = np.empty((n, T), dtype=np.int64)
        use_noise = np.empty((n, T), dtype=bool)
        for row, i in enumerate(indices):
            rng = _rng(self.seed, step, i, self.stream + _TOKENS)
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


class TokenSource:
    """Token files, memory-mapped, as training sequences.

    Packed (the default): each sequence is a window of seq_len + 1 tokens at a seeded random start,
    inside one file (documents run on across their end-of-text tokens). Unpacked: each sequence is one
    document, up to and including its end-of-text token, truncated or padded and label-masked.
    """

    def __init__(self, files: list[TokenFile], seq_len: int, seed: int, vocab_size: int, pack: bool = True,
                 eot_id: int | None = None, name: str = ""):
        self.files, self.seq_len, self.seed, self.vocab_size, self.pack = files, seq_len, seed, vocab_size, pack
        self.name = name or ", ".join(f.path for f in files)
        if pack:
            starts = np.array([max(0, len(f) - seq_len) for f in files], dtype=np.int64)
            if not starts.sum():
                raise ConfigError(f"{self.name}: no token file holds one sequence of --seq-len {seq_len} "
                                  "plus its target")
            self.first_start = np.concatenate([[0], np.cumsum(starts)])  # window starts, numbered across files
        else:
            if eot_id is None:
                raise ConfigError(f"{self.name}: unpacked sequences need the end-of-text id")
            self.docs = _documents(files, eot_id)  # rows of (file, start, end past its end-of-text)
            if not len(self.docs):
                raise ConfigError(f"{self.name}: no document of at least 2 tokens")

    def describe(self) -> str:
        """For the run's start line: where the tokens come from and how many there are."""
        return f"{self.name}: {self.token_total:,} tokens"

    @property
    def token_total(self) -> int:
        return sum(len(f) for f in self.files)

    def _window(self, step: int, index: int) -> tuple[int, int, int]:
        """(file, start, end) of the tokens of sequence `index` of step `step`."""
        rng = _rng(self.seed, step, index, _TOKENS)
        if self.pack:
            k = int(rng.integers(self.first_start[-1]))
            f = int(np.searchsorted(self.first_start, k, side="right")) - 1
            start = k - int(self.first_start[f])
            return f, start, start + self.seq_len + 1
        f, start, end = (int(v) for v in self.docs[int(rng.integers(len(self.docs)))])
        return f, start, min(end, start + self.seq_len + 1)

    def sequences(self, step: int, indices: range) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = np.zeros((len(indices), self.seq_len + 1), dtype=np.int64)
        context = np.zeros((len(indices), self.seq_len + 1), dtype=bool)  # a prompt's tokens: no loss on them
        lengths = []
        for row, i in enumerate(indices):
            f, start, end = self._window(step, i)
            tokens[row, : end - start] = self.files[f].tokens[start:end]
            if self.files[f].mask is not None:
                context[row, : end - start] = self.files[f].mask[start:end] == 0
            lengths.append(end - start)
        if len(indices) and tokens.max() >= self.vocab_size:  # the start-up scan saw these files; they changed
            row = int(np.argmax(tokens.max(axis=1)))
            f, start, _ = self._window(step, indices[row])
            raise ValueError(f"{self.files[f].path}: token id {int(tokens[row].max())} near position {start} is not "
                             f"below the vocabulary size {self.vocab_size}")
        x, y = _inputs_and_labels(tokens, lengths)
        y[torch.from_numpy(context[:, 1:])] = IGNORE
        return x, y

    def token_count(self, step: int, global_batch: int) -> int:
        """Target tokens the loss counts in step `step`'s global batch: not padding, not a prompt's."""
        if self.pack and all(f.mask is None for f in self.files):
            return global_batch * self.seq_len  # every window is full and every target counts
        windows = [self._window(step, i) for i in range(global_batch)]
        return sum(end - start - 1 if self.files[f].mask is None else int(self.files[f].mask[start + 1 : end].sum())
                   for f, start, end in windows)


def _inputs_and_labels(tokens: np.ndarray, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs are tokens[:-1], labels tokens[1:]; labels past a sequence's real length are masked."""
    x = torch.from_numpy(tokens[:, :-1].copy())
    y = torch.from_numpy(tokens[:, 1:].copy())
    for row, length in enumerate(lengths):
        y[row, length - 1 :] = IGNORE
        x[row, length:] = 0
    return x, y


def _documents(files: list[TokenFile], eot_id: int) -> np.ndarray:
    """(file, start, end) of every document of at least 2 tokens; end is past its end-of-text token."""
    rows = []
    for f, file in enumerate(files):
        ends = positions_of(file, eot_id) + 1
        if len(file) and (not len(ends) or ends[-1] != len(file)):
            ends = np.append(ends, len(file))  # a last document without its end-of-text token
        starts = np.concatenate([[0], ends[:-1]])
        keep = ends - starts >= 2
        rows.append(np.stack([np.full(int(keep.sum()), f), starts[keep], ends[keep]], axis=1))
    return np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.int64)


def make_source(cfg: Config, split: str = "train"):
    """The source of cfg.data for `split` ("train", or "val": the validation split with a fixed seed).

    Reads only what check_source / prepare_source prepared; a text input not yet in the cache (another
    machine under torchrun) is prepared here under a file lock.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    d, m = cfg.data, cfg.model
    seed = cfg.loop.seed if split == "train" else VAL_SEED
    if d.source in ("synthetic", "synthetic-varlen"):
        # the synthetic chain is the run seed's in both splits (validation must measure the same chain)
        return SyntheticSource(m.vocab_size, m.seq_len, cfg.loop.seed, varlen=d.source == "synthetic-varlen",
                               split=split)
    spec = resolve_data(cfg)
    paths, origin = (spec.train, f"--data {d.source}") if split == "train" else validation_files(cfg, spec)
    files = [f for f in (open_token_file(p) for p in paths) if len(f)]
    if not files:
        why = " (a single document, or --val-fraction 0: nothing was set aside; --val-data PATH supplies it)" \
            if split == "val" else ""
        raise ConfigError(f"{origin} has no {split} tokens{why}")
    return TokenSource(files, m.seq_len, seed, m.vocab_size, pack=d.pack, eot_id=spec.eot_id,
                       name=f"{origin} ({split})")
