"""When the loop saves (every K steps, every M minutes of rank 0's clock, on a stop, at the end), through one writer."""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from typing import Callable

import torch

from zerotrain.config import Config
from zerotrain.data import checkpoint_tokenizer
from zerotrain.parallel import Comm, ZeroEngine

from .format import step_of
from .save import CheckpointWriter


class SaveClock:
    """Rank 0's wall clock decides when a save is due by time; 0 minutes turns it off."""

    def __init__(self, every_minutes: float, is_rank0: bool):
        self.period_s = every_minutes * 60.0
        self.active = is_rank0 and self.period_s > 0
        self.last = time.monotonic()

    def due(self) -> bool:
        return self.active and time.monotonic() - self.last >= self.period_s

    def saved(self) -> None:
        self.last = time.monotonic()


class AsyncCost:
    """What an async save costs training, measured on this rank against what a synchronous save costs here.

    The run's first save is synchronous and timed: what a save costs when training waits for it. An async
    save costs start() plus the time its steps took, from start() until the step that commits it, beyond
    the same number of steps at the median step time of the last steps with no save in flight. Where that is
    more than the synchronous save (a CPU whose cores the training threads already hold: the writer's
    copying and hashing then displace training rather than run beside it), the save should have been
    synchronous: `slower` says so, and the loop's all-reduce makes every rank save synchronously from then on.
    """

    def __init__(self):
        self.sync_s: float | None = None  # the first save's duration
        self.recent: deque[float] = deque(maxlen=20)  # step seconds with no save in flight
        self.start_s = 0.0
        self.window: list[float] | None = None  # step seconds while an async save is in flight
        self.last: tuple[float, float] | None = None  # (cost, sync_s) of the last async save judged
        self.slower = False

    def step(self, seconds: float) -> None:
        (self.recent if self.window is None else self.window).append(seconds)

    def started(self, seconds: float) -> None:
        self.start_s, self.window = seconds, []

    def committed(self) -> None:
        """Judge the async save just committed."""
        if self.window is None or self.sync_s is None:
            return
        window, self.window = self.window, None
        if not self.recent:
            return
        cost = self.start_s + sum(window) - len(window) * statistics.median(self.recent)
        self.last = (cost, self.sync_s)
        self.slower = self.slower or cost > self.sync_s


class SaveCadence:
    """When to save and how: every K steps, every M minutes (rank 0's clock), on a stop and at the end."""

    def __init__(self, cfg: Config, comm: Comm, on_commit: Callable[[int], None], halfway_hook=None,
                 staging_hook=None, manifest_extra: dict | None = None, commit_hook=None):
        c = cfg.checkpoint
        self.on_commit = on_commit  # the rollback policy learns which checkpoints exist
        self.every, self.enabled = c.every, bool(c.every or c.every_minutes)
        self.clock = SaveClock(c.every_minutes, comm.rank == 0)
        # the tokenizer (the model's, with its configuration, under --init-from) travels with every checkpoint, so
        # sampling and export use the same one
        self.tokenizer, tokenizer_files = checkpoint_tokenizer(cfg)
        self.writer = CheckpointWriter(c.dir, comm, keep=c.keep, async_save=c.async_save, halfway_hook=halfway_hook,
                                       staging_hook=staging_hook, commit_hook=commit_hook,
                                       copied_files=tokenizer_files or None)
        self.config = cfg.to_dict()
        self.manifest_extra = manifest_extra or {}  # e.g. where --init-from's weights came from
        self.committed: list[str] = []
        self.cost = AsyncCost()

    def due(self, step: int, last: int, decision) -> bool:
        by_steps = self.every and step % self.every == 0
        return decision.stop or (self.enabled and (by_steps or decision.save_by_clock or step == last))

    def save(self, step: int, engine: ZeroEngine, state: dict, wait: bool) -> None:
        """Save `step` with the loop's own `state` (data skips, guard window) in the manifest."""
        extra = {"config": self.config, "threads_per_rank": torch.get_num_threads(), **self.manifest_extra, **state}
        if self.tokenizer:
            extra["tokenizer"] = self.tokenizer
        self.clock.saved()
        if self.writer.async_save and not wait and self.cost.sync_s is not None:
            self.finish()  # at most one save in flight
            t0 = time.perf_counter()
            self.writer.start(step, engine, extra)
            self.cost.started(time.perf_counter() - t0)
            return
        self.finish()
        t0 = time.perf_counter()
        path, _, _ = self.writer.save(step, engine, extra)  # invariant (d) is checked inside, on every rank
        if self.cost.sync_s is None:
            self.cost.sync_s = time.perf_counter() - t0
        self._committed(path)

    def step_took(self, seconds: float) -> None:
        """One training step's time, for judging async saves."""
        self.cost.step(seconds)

    def save_synchronously(self) -> str:
        """Every rank, once any rank measured an async save costing more than a synchronous one: say why, once."""
        self.writer.async_save = False
        cost, sync_s = self.cost.last or (float("nan"), float("nan"))
        return (f"--async-save: an async save cost {cost:.3g} s of training here, a synchronous save {sync_s:.3g} s "
                "(no spare core for the writer?): saving synchronously from now on")

    def commit_written(self) -> None:
        self._committed(self.writer.commit_pending())
        self.cost.committed()

    def finish(self) -> None:
        t0 = time.perf_counter()
        path = self.writer.finish()  # training waits here for a save still in flight: part of its cost
        self._committed(path)
        if path:
            self.cost.start_s += time.perf_counter() - t0
            self.cost.committed()

    def _committed(self, path: str | None) -> None:
        if path:
            self.committed.append(path)
            self.on_commit(step_of(os.path.basename(path)))
