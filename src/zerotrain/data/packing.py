"""Records in epochs: each once per epoch, in an order set by (seed, epoch), packed whole into windows or one per row.

A record is a JSON Lines record (its prompt, completion or text and the end-of-text token; the
`.records` index beside the token file says where each starts) or, with --no-pack, a document of a
token file (found by its end-of-text token). Epoch e draws a permutation of the records from
(seed, e) alone. Packed, the records are placed in that order into windows of seq_len positions,
each into the fullest window it still fits (best fit; a new window when none has room), so a
window holds several whole records, each from its first token, with its own segment id: the model
keeps each record's attention and positions to itself, and the tail of a window is padding with
IGNORE labels. Unpacked, each record is a row of its own. A record is never split over rows: one
longer than the window is refused, naming it and its length, or with --truncate keeps its first
seq_len + 1 tokens (counted in `describe`, which also names the records whose trained tokens, a
completion or an assistant turn, were cut); a record left with no trained token is left out (it
would add nothing to the loss or the gradient).

The rows of an epoch are read in order, a global batch of rows a step, its last step only what is
left (the rest of its rows are empty: no token, no loss), so every step lies in one epoch and
`--epochs N` is a whole number of steps. Where a data step starts is a function of the rows the
steps before it consumed: the source keeps its layout, the [first data step, global batch] of each
stretch of steps the run has had (one pair unless a resume changed the global batch; checkpoints
keep it), so a resume at another global batch continues at the row where the run stopped, and each
record is still read once per epoch. With one global batch G, step k of an epoch holds rows
k*G .. k*G + G - 1: a data step's rows are a function of (seed, data step, layout, seq_len) alone, so
how the ranks and micro-batches split them changes nothing, and a resume needs only the step and the
layout.
"""

from __future__ import annotations

import bisect
import heapq
import math
import os
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

from zerotrain.errors import ConfigError

from .batches import IGNORE, MicroBatch
from .tokenfiles import TokenFile, positions_of

_EPOCH_ORDER = 0xE90C  # the permutation's own stream: never one of a token source's draws
_EPOCHS_KEPT = 2  # the epoch being read and the next: a step never needs more


def records_path(path: str) -> str:
    """The record index beside token file `path`: train.bin -> train.records."""
    return (path[:-4] if path.endswith(".bin") else path) + ".records"


def has_records(file: TokenFile) -> bool:
    """Whether the file's tokens are records (JSON Lines data: a record index or a loss mask beside them)."""
    return file.mask is not None or os.path.isfile(records_path(file.path))


def file_records(files: list[TokenFile], eot_id: int | None) -> np.ndarray:
    """(file, start, end) of every record of at least 2 tokens, from each file's `.records` index, or where a file has
    none, by its end-of-text tokens (end is past the end-of-text token)."""
    rows = []
    for f, file in enumerate(files):
        index = records_path(file.path)
        if os.path.isfile(index):
            offsets = _read_offsets(index, len(file))
            starts, ends = offsets[:-1], offsets[1:]
        elif eot_id is None:
            raise ConfigError(f"{file.path}: no record index ({index}) and no end-of-text id to find its records by")
        else:
            ends = positions_of(file, eot_id) + 1
            if len(file) and (not len(ends) or ends[-1] != len(file)):
                ends = np.append(ends, len(file))  # a last document without its end-of-text token
            starts = np.concatenate([[0], ends[:-1]])
        keep = ends - starts >= 2
        rows.append(np.stack([np.full(int(keep.sum()), f), starts[keep], ends[keep]], axis=1).astype(np.int64))
    return np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.int64)


def _read_offsets(path: str, tokens: int) -> np.ndarray:
    """A `.records` index: little-endian uint64 offsets of each record's first token, then the end offset."""
    size = os.path.getsize(path)
    offsets = np.fromfile(path, dtype="<u8").astype(np.int64) if size else np.zeros(0, dtype=np.int64)
    if size % 8 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != tokens or (np.diff(offsets) < 0).any():
        raise ConfigError(f"{path}: not a record index of its {tokens} tokens (uint64 offsets from 0, non-decreasing, "
                          "ending at the token count): written by another preparation, or truncated")
    return offsets


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The records of epoch `epoch` in the order it reads them: a permutation drawn from (seed, epoch) alone."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, _EPOCH_ORDER])))
    return rng.permutation(n)


def best_fit(costs: np.ndarray, capacity: int) -> np.ndarray:
    """The window of each item, placed in order into the window with the least room that still takes it (the earliest
    such window on a tie), or into a new one. Windows are numbered in the order they open."""
    window = np.empty(len(costs), dtype=np.int64)
    rooms: list[int] = []  # the distinct rooms open windows have, sorted
    open_with: dict[int, list[int]] = {}  # room -> heap of the windows that have it
    opened = 0
    for i, cost in enumerate(costs.tolist()):
        j = bisect.bisect_left(rooms, cost)
        if j == len(rooms):
            w, room = opened, capacity
            opened += 1
        else:
            room = rooms[j]
            w = heapq.heappop(open_with[room])
            if not open_with[room]:
                del open_with[room], rooms[j]
        window[i] = w
        room -= cost
        if room > 0:
            if room not in open_with:
                bisect.insort(rooms, room)
                open_with[room] = []
            heapq.heappush(open_with[room], w)
    return window


class _Stretch(NamedTuple):
    """Steps of one epoch at one global batch: step `first` + j reads rows `row` + j * `batch` onwards."""

    first: int  # data step
    epoch: int
    row: int
    batch: int


class RecordSource:
    """Records, each seen once per epoch, as training rows: packed windows with segment ids, or one record per row."""

    def __init__(self, files: list[TokenFile], records: np.ndarray, seq_len: int, seed: int, vocab_size: int, *,
                 global_batch: int, pack: bool = True, name: str = "", chat_template: str | None = None,
                 truncate: bool = False):
        self.files, self.seq_len, self.seed, self.vocab_size, self.pack = files, seq_len, seed, vocab_size, pack
        self.chat_template = chat_template  # what rendered its chats and why, for the start line
        self.global_batch = global_batch
        self.name = name or ", ".join(f.path for f in files)
        lengths = records[:, 2] - records[:, 1]
        cost = np.minimum(lengths, seq_len + 1) - 1  # positions: every kept token but the last is an input
        trained = _trained_targets(files, records, cost)
        long = np.flatnonzero(lengths > seq_len + 1)
        # the trained targets a record would lose: its completion's or assistant turns' tokens past the window
        lost = _trained_targets(files, records[long], lengths[long] - 1) - trained[long]
        masked = np.array([files[f].mask is not None for f in records[long, 0]], dtype=bool)
        if len(long) and not truncate:
            i = int(long[0])
            n = int(lost[0])
            cut = f", and its {'completion or assistant turn' if masked[0] else 'text'} would lose {n:,} trained " \
                f"token{'s' * (n != 1)}" if n else ""
            such = f"{len(long):,} such record{'s' * (len(long) > 1)}"
            raise ConfigError(f"{self.name}: record {self._number(records, i)} is {int(lengths[i]):,} tokens, longer "
                              f"than a row of --seq-len {seq_len} + 1{cut} ({such}): give --truncate to keep the first "
                              f"{seq_len + 1} tokens of each, or --seq-len {int(lengths[long].max()) - 1}; a record is "
                              "never split over rows")
        # --truncate: the records whose trained tokens were cut (a chat's assistant turn), the first named
        turns = long[(lost > 0) & masked]
        self.turns_cut = (len(turns), self._number(records, int(turns[0])), int(lengths[turns[0]]),
                          int(lost[(lost > 0) & masked][0])) if len(turns) else None
        keep = trained > 0
        self.truncated = int((lengths[keep] > seq_len + 1).sum())
        self.left_out = int((~keep).sum())
        self.records, self.cost, self.trained = records[keep], cost[keep], trained[keep]
        if not len(self.records):
            raise ConfigError(f"{self.name}: no record with a trained token in a window of --seq-len {seq_len}")
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        # [first data step, global batch] of each stretch of steps the run has had (continue_layout adds one)
        self.layout = [[0, global_batch]]
        self._stretches: list[_Stretch] = []  # as far as laid out, in order

    @staticmethod
    def _number(records: np.ndarray, i: int) -> str:
        """Record i's number in its file (1-based: a JSON Lines file's record order), and the file where several."""
        f = int(records[i, 0])
        return str(i - int(np.searchsorted(records[:, 0], f)) + 1) + (f" of file {f + 1}" if records[-1, 0] else "")

    # ---------------------------------------------------------------- the epochs
    def epoch_rows(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(records in row order, row bounds into them, trained targets per row) of epoch `epoch`."""
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
            return self._epochs[epoch]
        order = epoch_order(self.seed, epoch, len(self.records))
        if self.pack:
            window = best_fit(self.cost[order], self.seq_len)
            order = order[np.argsort(window, kind="stable")]  # by window, each window's records in epoch order
            bounds = np.searchsorted(np.sort(window), np.arange(int(window.max()) + 2))
        else:
            bounds = np.arange(len(order) + 1)
        rows = (order, bounds, np.add.reduceat(self.trained[order], bounds[:-1]))
        self._epochs[epoch] = rows
        while len(self._epochs) > _EPOCHS_KEPT:
            self._epochs.popitem(last=False)
        return rows

    def rows_in_epoch(self, epoch: int) -> int:
        return len(self.records) if not self.pack else len(self.epoch_rows(epoch)[1]) - 1

    # ---------------------------------------------------------------- the steps over the epochs
    def continue_layout(self, layout: list[list[int]], at: int) -> None:
        """Continue from data step `at` the layout of a checkpoint's run ([first data step, global batch] pairs) at
        this source's global batch: the steps before `at` keep the rows they had, step `at` reads on from the row
        where they stopped."""
        kept = [[int(first), int(batch)] for first, batch in layout if int(first) < at]
        if kept and kept[0][0] != 0 or any(b[0] <= a[0] or b[1] < 1 for a, b in zip([[-1, 1]] + kept, kept)):
            raise ValueError(f"not a data layout (increasing first steps from 0, positive global batches): {layout}")
        if not kept or kept[-1][1] != self.global_batch:
            kept.append([int(at), self.global_batch])
        self.layout, self._stretches = kept, []

    def _stretch_after(self, last: _Stretch | None) -> _Stretch:
        """The stretch of steps after `last`: the rest of its epoch at the next global batch where the layout changes
        it before the epoch ends, else the next epoch from its first row."""
        if last is None:
            return _Stretch(0, 0, 0, self.layout[0][1])
        end = last.first + math.ceil((self.rows_in_epoch(last.epoch) - last.row) / last.batch)
        change = next((first for first, _ in self.layout if first > last.first), None)
        if change is not None and change < end:
            return _Stretch(change, last.epoch, last.row + (change - last.first) * last.batch, self._batch_at(change))
        return _Stretch(end, last.epoch + 1, 0, self._batch_at(end))

    def _batch_at(self, step: int) -> int:
        return next(batch for first, batch in reversed(self.layout) if first <= step)

    def _stretch_of(self, *, step: int | None = None, epoch: int | None = None) -> _Stretch:
        """The stretch data step `step` lies in, or the first of epoch `epoch`, laying the stretches out as far as
        needed."""
        stretches = self._stretches
        while not stretches or (stretches[-1].first <= step if epoch is None else stretches[-1].epoch < epoch):
            stretches.append(self._stretch_after(stretches[-1] if stretches else None))
        if epoch is None:
            return stretches[bisect.bisect_right(stretches, step, key=lambda s: s.first) - 1]
        return stretches[bisect.bisect_left(stretches, epoch, key=lambda s: s.epoch)]

    def step_rows(self, step: int) -> tuple[int, int, int]:
        """(epoch, first row in it, rows a step) of data step `step`: where the steps before it stopped."""
        s = self._stretch_of(step=step)
        return s.epoch, s.row + (step - s.first) * s.batch, s.batch

    def first_step(self, epoch: int) -> int:
        """The first data step of epoch `epoch` (0-based): the steps of the epochs before it."""
        return self._stretch_of(epoch=epoch).first

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within it) of data step `step`."""
        epoch = self.step_rows(step)[0]
        return epoch, step - self.first_step(epoch)

    def epochs_in(self, steps: int) -> str:
        """What `steps` data steps from the start cover, in epochs (for the start line)."""
        epoch, into = self.locate(steps)
        whole = f"{epoch} epoch{'s' * (epoch != 1)}"
        if not into:
            return whole
        of = self.first_step(epoch + 1) - self.first_step(epoch)
        return f"{whole} and {into} of epoch {epoch + 1}'s {of} steps"

    # ---------------------------------------------------------------- a step's rows
    def sequences(self, step: int, indices: range) -> MicroBatch:
        epoch, first, batch = self.step_rows(step)
        order, bounds, _ = self.epoch_rows(epoch)
        rows, T = len(bounds) - 1, self.seq_len
        x = np.zeros((len(indices), T), dtype=np.int64)
        y = np.full((len(indices), T), IGNORE, dtype=np.int64)
        seg = np.zeros((len(indices), T), dtype=np.int64)
        for row, i in enumerate(indices):
            r = first + i
            if i >= batch or r >= rows:
                continue  # past the epoch's last row: an empty row of its last step
            at = 0
            for s, rec in enumerate(order[bounds[r] : bounds[r + 1]]):
                f, start, _ = (int(v) for v in self.records[rec])
                c, file = int(self.cost[rec]), self.files[f]
                tokens = file.tokens[start : start + c + 1].astype(np.int64)
                if int(tokens.max()) >= self.vocab_size:  # the start-up scan saw these files; they changed
                    raise ValueError(f"{file.path}: token id {int(tokens.max())} near position {start} is not below "
                                     f"the vocabulary size {self.vocab_size}")
                x[row, at : at + c], y[row, at : at + c] = tokens[:-1], tokens[1:]
                if file.mask is not None:  # a prompt's tokens are context: no loss on them
                    y[row, at : at + c][file.mask[start + 1 : start + c + 1] == 0] = IGNORE
                seg[row, at : at + c] = s
                at += c
            seg[row, at:] = bounds[r + 1] - bounds[r]  # the padding: a segment of its own
        segments = torch.from_numpy(seg) if self.pack else None
        return MicroBatch(torch.from_numpy(x), torch.from_numpy(y), segments)

    def token_count(self, step: int, global_batch: int) -> int:
        """Target tokens the loss counts in step `step`'s global batch: not padding, not a prompt's."""
        epoch, first, batch = self.step_rows(step)
        if global_batch != batch:
            raise ValueError(f"step {step} is laid out for {batch} rows, not {global_batch}")
        return int(self.epoch_rows(epoch)[2][first : first + batch].sum())

    def row_count(self, step: int, global_batch: int) -> int:
        """Rows of step `step`'s global batch with a trained token: the epoch's rows it reads (a record without one is
        left out), not the empty rows past the epoch's last."""
        epoch, first, batch = self.step_rows(step)
        if global_batch != batch:
            raise ValueError(f"step {step} is laid out for {batch} rows, not {global_batch}")
        return int((self.epoch_rows(epoch)[2][first : first + batch] > 0).sum())

    # ---------------------------------------------------------------- for the start line
    @property
    def token_total(self) -> int:
        return sum(len(f) for f in self.files)

    def describe(self) -> str:
        said = [f"{len(self.records):,} records"]
        if self.pack:
            rows = self.rows_in_epoch(0)
            said.append(f"packed {len(self.records) / rows:.1f} per window of {self.seq_len} ({rows:,} window"
                        f"{'s' if rows != 1 else ''} in epoch 1)")
        else:
            said.append("one per sequence")
        said.append(f"{int(self.trained.sum()):,} trained tokens")
        if self.truncated:
            said.append(f"{self.truncated:,} longer than the window (--seq-len {self.seq_len} + 1 tokens), truncated")
        if self.turns_cut:
            n, first, length, lost = self.turns_cut
            said.append(f"{n:,} with their completion or assistant turn cut by --truncate (the first: record {first}, "
                        f"{length:,} tokens, {lost:,} trained token{'s' * (lost != 1)} lost)")
        if self.left_out:
            said.append(f"{self.left_out:,} with no trained token in the window, left out")
        if not (self.truncated or self.left_out):
            said.append("none truncated or left out")
        if self.chat_template:
            said.append(f"chats rendered with {self.chat_template}")
        return f"{self.name}: {self.token_total:,} tokens, " + ", ".join(said)


def _trained_targets(files: list[TokenFile], records: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Per record, the targets its kept tokens train on: its labels are tokens start+1 .. start+cost."""
    trained = cost.copy()
    for f, file in enumerate(files):
        mine = np.flatnonzero((records[:, 0] == f) & (cost > 0))
        if file.mask is None or not len(mine):
            continue
        lo, hi = records[mine, 1] + 1, records[mine, 1] + cost[mine] + 1
        # reduceat sums mask[lo:hi] at the even places, one call for all records; it needs indices inside the
        # array, so a sum that runs to the file's end is taken apart
        inside = hi < len(file)
        sums = np.zeros(len(mine), dtype=np.int64)
        if inside.any():
            index = np.stack([lo[inside], hi[inside]], axis=1).ravel()
            sums[inside] = np.add.reduceat(file.mask, index, dtype=np.int64)[::2]
        for j in np.flatnonzero(~inside):
            sums[j] = int(file.mask[lo[j] : hi[j]].sum(dtype=np.int64))
        trained[mine] = sums
    return trained
