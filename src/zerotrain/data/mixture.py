"""Weighted mixtures of data sources: which source each row of a step comes from, and which of its rows it is.

`--data A:0.75 --data B:0.25` trains on both: step s's G rows are split among the sources by systematic sampling
with one uniform u, a counter-based hash of (seed, s) (so the rows of a stretch of steps are counted at once, without
a generator per step): source k gets floor(W_k G + u) - floor(W_(k-1) G + u) rows, W_k the weights summed through k
(so every step has w_k G rows, give or take one, and exactly that on average), and a permutation drawn from
(seed, s) spreads those rows over the step's positions, so no rank or micro-batch sees one source only.

Each source is a stream of rows read in order: row r of a source of records is the r-th row of its epochs laid end
to end (its own epoch order, packing and epoch count), row r of a token or synthetic source its window drawn from
(seed, r). Step s reads source k's rows from C_k(s), the rows the steps before it gave that
source, on: so a step's rows are a function of (seed, data step, the layout of global batches) alone, however ranks
and micro-batches split them, and a resume needs only the step and the layout. The layout is kept as a source of
records keeps its own ([first data step, global batch] pairs): a resume at another global batch reads each source
on from the row where the run stopped.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from zerotrain.config import Config, data_sources

from .batches import MicroBatch

_MIXTURE = 0x313C  # the mixture's own stream of draws: never one of a source's


def step_generator(seed: int, step: int) -> np.random.Generator:
    """The draws that place data step `step`'s rows of each source: keyed by (seed, step) alone."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, _MIXTURE])))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 whose outputs for consecutive inputs look independent."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def step_uniforms(seed: int, steps: np.ndarray) -> np.ndarray:
    """The uniform in [0, 1) that splits each data step of `steps` among the sources: a hash of (seed, step) alone
    (SplitMix64 over a key drawn from the seed), so a resume at step s counts the rows of steps 0..s-1 in one pass
    (100,000 steps: milliseconds, where a generator per step took seconds)."""
    with np.errstate(over="ignore"):
        key = _mix(np.array([seed % 2**64], dtype=np.uint64) + np.uint64(_MIXTURE) * _GOLDEN)
        x = _mix(key + (np.asarray(steps, dtype=np.uint64) + np.uint64(1)) * _GOLDEN)
    return (x >> np.uint64(11)).astype(np.float64) / 2.0**53


def source_config(cfg: Config, name: str) -> Config:
    """cfg with --data naming the one source `name` (its own model settings, which reading its data may fill in)."""
    return replace(cfg, data=replace(cfg.data, source=name), model=replace(cfg.model))


def mixture_weights(cfg: Config) -> dict[str, float]:
    """{source name, as the user gave it: its weight as given}."""
    return {name: weight for name, weight in data_sources(cfg.data.source)}


class MixtureSource:
    """Several sources, each step's rows drawn among them in proportion to their weights (module docstring)."""

    def __init__(self, sources: dict[str, object], weights: dict[str, float], seed: int, global_batch: int):
        self.sources, self.seed, self.global_batch = sources, seed, global_batch
        self.names = list(sources)
        total = sum(weights.values())
        self.weights = {name: weights[name] / total for name in self.names}
        cum = np.cumsum([self.weights[n] for n in self.names])
        cum[-1] = 1.0  # the last bound is the whole batch, whatever the float sum
        self._bounds = np.concatenate([[0.0], cum])
        self.layout = [[0, global_batch]]
        self._before = np.zeros((1, len(self.names)), dtype=np.int64)  # row s: what each source gave steps 0..s-1
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def pack(self) -> bool:
        """Whether rows carry record segments (a source of packed records is among the sources)."""
        return any(getattr(s, "pack", False) for s in self.sources.values())

    # ---------------------------------------------------------------- the split of each step
    def _batch_at(self, step: int) -> int:
        return next(batch for first, batch in reversed(self.layout) if first <= step)

    def counts(self, step: int) -> np.ndarray:
        """Rows each source gives data step `step`."""
        return self._counts(np.array([step]))[0]

    def _counts(self, steps: np.ndarray) -> np.ndarray:
        """[steps, sources]: the rows each source gives each step, by systematic sampling with the step's uniform."""
        firsts, batches = np.array(self.layout).T
        batch = batches[np.searchsorted(firsts, steps, side="right") - 1]
        u = step_uniforms(self.seed, steps)
        return np.diff(np.floor(self._bounds[None, :] * batch[:, None] + u[:, None]).astype(np.int64), axis=1)

    def rows_before(self, step: int) -> np.ndarray:
        """Rows each source gave data steps 0 .. step - 1: where step `step` reads each source on from."""
        have = len(self._before) - 1
        if step > have:  # counted a stretch of steps at a time
            steps = np.arange(have, max(step, 2 * have, 1024))
            more = self._before[-1] + np.cumsum(self._counts(steps), axis=0)
            self._before = np.concatenate([self._before, more])
        return self._before[step]

    def plan(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, row of that source's stream) of each of data step `step`'s positions."""
        if step not in self._plans:
            order = step_generator(self.seed, step).permutation(self._batch_at(step))
            source = np.repeat(np.arange(len(self.names)), self.counts(step))[order]
            row = np.empty(len(source), dtype=np.int64)
            for k, first in enumerate(self.rows_before(step)):
                mine = source == k
                row[mine] = first + np.arange(int(mine.sum()))
            self._plans = {step: (source, row)}  # a step is read micro-batch by micro-batch, then the next
        return self._plans[step]

    def continue_layout(self, layout: list[list[int]], at: int) -> None:
        """Continue from data step `at` the layout of a checkpoint's run at this mixture's global batch: the steps
        before `at` keep the rows they had, each source reads on from the row where they stopped."""
        kept = [[int(first), int(batch)] for first, batch in layout if int(first) < at]
        if kept and kept[0][0] != 0 or any(b[0] <= a[0] or b[1] < 1 for a, b in zip([[-1, 1]] + kept, kept)):
            raise ValueError(f"not a data layout (increasing first steps from 0, positive global batches): {layout}")
        if not kept or kept[-1][1] != self.global_batch:
            kept.append([int(at), self.global_batch])
        self.layout, self._before, self._plans = kept, self._before[:1], {}

    # ---------------------------------------------------------------- a step's rows
    def sequences(self, step: int, indices: range) -> MicroBatch:
        source, row = self.plan(step)
        rows = [self.sources[self.names[source[i]]].sequences(int(row[i]), range(0, 1)) for i in indices]
        segments = None
        if self.pack:  # a row without segments is one document: segment 0 throughout
            segments = torch.cat([r.segments if r.segments is not None else torch.zeros_like(r.inputs)
                                  for r in rows])
        return MicroBatch(torch.cat([r.inputs for r in rows]), torch.cat([r.labels for r in rows]), segments)

    def source_tokens(self, step: int) -> dict[str, int]:
        """Target tokens the loss counts in step `step`'s global batch, by source."""
        source, row = self.plan(step)
        tokens = dict.fromkeys(self.names, 0)
        for k, r in zip(source.tolist(), row.tolist()):
            tokens[self.names[k]] += self.sources[self.names[k]].token_count(r, 1)
        return tokens

    def row_count(self, step: int, global_batch: int) -> int:
        """Rows of step `step`'s global batch with a trained token (each source's row, as that source counts it)."""
        if global_batch != self._batch_at(step):
            raise ValueError(f"step {step} is laid out for {self._batch_at(step)} rows, not {global_batch}")
        source, row = self.plan(step)
        return sum(self.sources[self.names[k]].row_count(r, 1) if hasattr(self.sources[self.names[k]], "row_count")
                   else 1 for k, r in zip(source.tolist(), row.tolist()))

    def token_count(self, step: int, global_batch: int) -> int:
        if global_batch != self._batch_at(step):
            raise ValueError(f"step {step} is laid out for {self._batch_at(step)} rows, not {global_batch}")
        return sum(self.source_tokens(step).values())

    def source_epochs(self, step: int) -> dict[str, int]:
        """The epoch (1-based) each source of records is in at step `step`: that of the next row it reads."""
        before = self.rows_before(step)
        return {name: s.locate(int(before[k]))[0] + 1 for k, (name, s) in enumerate(self.sources.items())
                if hasattr(s, "locate")}

    # ---------------------------------------------------------------- for the start line
    def describe(self) -> str:
        parts = []
        for name, source in self.sources.items():
            said = source.describe() if hasattr(source, "describe") else name
            parts.append(f"{self.weights[name]:.3g} of {said}")
        return f"a mixture of {len(parts)} sources, rows drawn per step: " + "; ".join(parts)
