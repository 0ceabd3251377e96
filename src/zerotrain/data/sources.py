"""Token sources: (seed, step, global sample index) -> one training sequence.

Every sequence of step s is a pure function of (seed, s, its index in the global batch), so how the
global batch is split over ranks and micro-batches never changes what is trained on, and resuming
at step s needs no loader state at all. A validation source (split="val") is the same function over
the validation data with a fixed seed: its batch k is the same in every run, whatever --seed, so
validation losses over batches 0..n-1 compare across runs.

Which source: synthetic data draws its sequences; packed text (pretraining corpora, token files without
records) is random windows over the token stream, which run on across documents as GPT-2's and
nanoGPT's training does (documents are long, and a window anywhere in them is a fair sample); records
(JSON Lines data, or any documents with --no-pack) go through epochs (packing.py).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from zerotrain.config import Config, data_sources, is_mixture
from zerotrain.errors import ConfigError

from .batches import IGNORE, MicroBatch
from .formats import is_records_folder
from .jsonl import RECORD_FILES
from .mixture import MixtureSource, mixture_weights, source_config
from .packing import RecordSource, file_records, has_records, records_path
from .resolve import SYNTHETIC, resolve_data, validation_files
from .tokenfiles import TokenFile, open_token_file

__all__ = ["IGNORE", "RecordSource", "SyntheticSource", "TokenSource", "epoch_steps", "make_source"]

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

    def sequences(self, step: int, indices: range) -> MicroBatch:
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
        return MicroBatch(*_inputs_and_labels(tokens, lengths))

    def token_count(self, step: int, global_batch: int) -> int:
        return sum(self._length(step, i) - 1 for i in range(global_batch))


class TokenSource:
    """Token files, memory-mapped, as packed training sequences: each a window of seq_len + 1 tokens at a
    seeded random start, inside one file (documents run on across their end-of-text tokens). Files with a loss
    mask or a record index are records, read by packing.RecordSource: every target of a window here counts."""

    def __init__(self, files: list[TokenFile], seq_len: int, seed: int, vocab_size: int, name: str = ""):
        self.files, self.seq_len, self.seed, self.vocab_size = files, seq_len, seed, vocab_size
        self.name = name or ", ".join(f.path for f in files)
        starts = np.array([max(0, len(f) - seq_len) for f in files], dtype=np.int64)
        if not starts.sum():
            raise ConfigError(f"{self.name}: no token file holds one sequence of --seq-len {seq_len} plus its target")
        self.first_start = np.concatenate([[0], np.cumsum(starts)])  # window starts, numbered across files

    def describe(self) -> str:
        """For the run's start line: where the tokens come from and how many there are."""
        return f"{self.name}: {self.token_total:,} tokens"

    @property
    def token_total(self) -> int:
        return sum(len(f) for f in self.files)

    def _window(self, step: int, index: int) -> tuple[int, int, int]:
        """(file, start, end) of the tokens of sequence `index` of step `step`."""
        k = int(_rng(self.seed, step, index, _TOKENS).integers(self.first_start[-1]))
        f = int(np.searchsorted(self.first_start, k, side="right")) - 1
        start = k - int(self.first_start[f])
        return f, start, start + self.seq_len + 1

    def sequences(self, step: int, indices: range) -> MicroBatch:
        tokens = np.zeros((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(indices):
            f, start, end = self._window(step, i)
            tokens[row] = self.files[f].tokens[start:end]
        if len(indices) and tokens.max() >= self.vocab_size:  # the start-up scan saw these files; they changed
            row = int(np.argmax(tokens.max(axis=1)))
            f, start, _ = self._window(step, indices[row])
            raise ValueError(f"{self.files[f].path}: token id {int(tokens[row].max())} near position {start} is not "
                             f"below the vocabulary size {self.vocab_size}")
        return MicroBatch(*_inputs_and_labels(tokens, [self.seq_len + 1] * len(indices)))

    def token_count(self, step: int, global_batch: int) -> int:
        """Target tokens the loss counts in step `step`'s global batch: every window is full, every target counts."""
        return global_batch * self.seq_len


def _inputs_and_labels(tokens: np.ndarray, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs are tokens[:-1], labels tokens[1:]; labels past a sequence's real length are masked."""
    x = torch.from_numpy(tokens[:, :-1].copy())
    y = torch.from_numpy(tokens[:, 1:].copy())
    for row, length in enumerate(lengths):
        y[row, length - 1 :] = IGNORE
        x[row, length:] = 0
    return x, y


def make_source(cfg: Config, split: str = "train", global_batch: int | None = None):
    """The source of cfg.data for `split` ("train", or "val": the validation split with a fixed seed).

    Records (JSON Lines data; any documents with --no-pack) are laid out in epochs over steps of
    `global_batch` rows: by default the run's global batch for training, and for validation the DP
    replicas x micro-batch that --eval-every evaluates at once. Reads only what check_source /
    prepare_source prepared; a text input not yet in the cache (another machine under torchrun) is
    prepared here under a file lock.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if is_mixture(cfg.data.source):  # each source a stream of rows (records: one row a data step); validation: its own
        rows = 1 if split == "train" else None
        sources = {name: make_source(source_config(cfg, name), split, rows)
                   for name, _ in data_sources(cfg.data.source)}
        return MixtureSource(sources, mixture_weights(cfg), cfg.loop.seed,
                             global_batch or (cfg.global_batch if split == "train" else cfg.dp * cfg.loop.micro_batch))
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
    name = f"{origin} ({split})"
    if d.pack and not any(has_records(f) for f in files):
        return TokenSource(files, m.seq_len, seed, m.vocab_size, name=name)
    if global_batch is None:
        global_batch = cfg.global_batch if split == "train" else cfg.dp * cfg.loop.micro_batch
    return RecordSource(files, file_records(files, spec.eot_id), m.seq_len, seed, m.vocab_size,
                        global_batch=global_batch, pack=d.pack, name=name, chat_template=spec.chat_template,
                        truncate=d.truncate)


def epoch_steps(cfg: Config) -> int:
    """The optimizer steps of --epochs N over cfg's training records at its global batch."""
    source = make_source(cfg)
    if not isinstance(source, RecordSource):
        raise ConfigError(f"--epochs {cfg.loop.epochs}: --data {cfg.data.source} is read as random windows, not "
                          "records (epochs count passes over JSON Lines records, or over documents with --no-pack): "
                          "give --steps")
    return source.first_step(cfg.loop.epochs)


def packs_records(cfg: Config) -> bool:
    """Whether the training rows will carry record segments (records packed whole), told from the --data path alone,
    without preparing it: what `zerotrain plan` needs to count the document mask for a run on another machine."""
    d = cfg.data
    if is_mixture(d.source):
        return any(packs_records(source_config(cfg, name)) for name, _ in data_sources(d.source))
    if not d.pack or d.source in SYNTHETIC:
        return False
    if d.source.lower().endswith(RECORD_FILES) or is_records_folder(d.source):
        return True
    if os.path.isdir(d.source):
        return any(name.endswith((".records", ".mask")) for name in os.listdir(d.source))
    stem = d.source[:-4] if d.source.endswith(".bin") else d.source
    return os.path.isfile(records_path(d.source)) or os.path.isfile(stem + ".mask")
