"""When the loop saves (every K steps, every M minutes of rank 0's clock, on a stop, at the end), through one writer."""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from zerotrain.config import Config
from zerotrain.data import checkpoint_tokenizer
from zerotrain.parallel import Comm, ZeroOneEngine

from .format import TOKENIZER_FILE, step_of
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


class SaveCadence:
    """When to save and how: every K steps, every M minutes (rank 0's clock), on a stop and at the end."""

    def __init__(self, cfg: Config, comm: Comm, on_commit: Callable[[int], None], halfway_hook=None):
        c = cfg.checkpoint
        self.on_commit = on_commit  # the rollback policy learns which checkpoints exist
        self.every, self.enabled = c.every, bool(c.every or c.every_minutes)
        self.clock = SaveClock(c.every_minutes, comm.rank == 0)
        # the data's tokenizer travels with every checkpoint, so sampling and export use the same one
        self.tokenizer, tokenizer_file = checkpoint_tokenizer(cfg)
        self.writer = CheckpointWriter(c.dir, comm, keep=c.keep, async_save=c.async_save, halfway_hook=halfway_hook,
                                       copied_files={TOKENIZER_FILE: tokenizer_file} if tokenizer_file else None)
        self.config = cfg.to_dict()
        self.committed: list[str] = []

    def due(self, step: int, last: int, decision) -> bool:
        by_steps = self.every and step % self.every == 0
        return decision.stop or (self.enabled and (by_steps or decision.save_by_clock or step == last))

    def save(self, step: int, engine: ZeroOneEngine, state: dict, wait: bool) -> None:
        """Save `step` with the loop's own `state` (data skips, guard window) in the manifest."""
        extra = {"config": self.config, "threads_per_rank": torch.get_num_threads(), **state}
        if self.tokenizer:
            extra["tokenizer"] = self.tokenizer
        self.clock.saved()
        if self.writer.async_save and not wait:
            self.finish()  # at most one save in flight
            self.writer.start(step, engine, extra)
            return
        self.finish()
        path, _, _ = self.writer.save(step, engine, extra)  # invariant (d) is checked inside, on every rank
        self._committed(path)

    def commit_written(self) -> None:
        self._committed(self.writer.commit_pending())

    def finish(self) -> None:
        self._committed(self.writer.finish())

    def _committed(self, path: str | None) -> None:
        if path:
            self.committed.append(path)
            self.on_commit(step_of(os.path.basename(path)))
