"""The training loop's one seam to checkpoints: when to save, how (sync or async, judged by its cost), commit, retention.

The loop calls a `Checkpointer` three times a step, as DESIGN.md's step list has it:

    flags()          what this rank puts in the step's one all-reduce: a save is due by rank 0's clock; its part of
                     the async save in flight is done (written; on rank 0, committed) or failed; async saves cost
                     more than synchronous ones here
    after_reduce(d)  with what every rank agreed: move the async save on (all written: rank 0 commits in its own
                     thread; committed: the rollback policy learns of it), or save synchronously from now on
    after_step(...)  the step's time (to judge async saves), then save if the cadence or the clock says so

and `finish()` at the end (or before a rollback); `recommit(...)` after a rollback re-saves the restored step with the
loop's new state.

A stop signal does not wait for the step: `arm(...)` at each step's start says which state a stop would save (the
last completed step's: nothing changes it until the step's update); `stop_requested()`, from the stop request's
watcher thread, starts that save at once (armed: now; otherwise at the next `arm`); `disarm()` before the step's
all-reduce reads the stop flag, so a save started on any rank means a stop flag in that all-reduce, and no rank
updates the state a save is reading. Once every rank has agreed to stop, `stop(...)` waits for the save (starting it
on a rank that had not seen the signal): the in-flight step is never applied, and a resumed run redoes it. Saves happen every K steps, every M minutes of rank 0's clock, on a stop and at the end. Fault injection reaches the writer through the hooks given at construction.
"""

from __future__ import annotations

import copy
import os
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SaveFlags:
    """This rank's checkpoint flags for the step's all-reduce."""

    by_clock: bool  # rank 0's clock says a save is due
    done: bool  # this rank's part of the async save in flight's current phase is done (True when none is)
    error: BaseException | None  # this rank's part failed: every rank stops, this one with this error
    async_slower: bool  # async saves cost training more than a synchronous save here


@dataclass(frozen=True)
class WriterHooks:
    """Fault injection handed to the writer (training/faults.py): see CheckpointWriter."""

    halfway: Callable[[int], None] | None = None
    staging: Callable[[int], None] | None = None
    commit: Callable[[int], None] | None = None


class Checkpointer:
    """Saves one run's checkpoints: the cadence, rank 0's clock, the writer and the cost of its async saves.

    All ranks construct it together (one collective, under --io-timeout). `on_commit(step)` is called on every rank
    when a checkpoint is committed (the rollback policy learns which checkpoints exist); `manifest_extra` goes into
    every manifest (e.g. where --init-from's weights came from); `on_stop_save(step)` as a stop's save of `step`
    begins (the stop request learns that its save is under way).
    """

    def __init__(self, cfg: Config, comm: Comm, on_commit: Callable[[int], None], hooks: WriterHooks = WriterHooks(),
                 manifest_extra: dict | None = None, on_stop_save: Callable[[int], None] | None = None):
        c = cfg.checkpoint
        self.on_commit, self.on_stop_save = on_commit, on_stop_save
        self.every, self.enabled, self.last = c.every, bool(c.every or c.every_minutes or c.final_save), cfg.loop.steps
        self.clock = SaveClock(c.every_minutes, comm.rank == 0)
        # the tokenizer (the model's, with its configuration, under --init-from) travels with every checkpoint, so
        # sampling and export use the same one
        self.tokenizer, tokenizer_files = checkpoint_tokenizer(cfg)
        self.writer = CheckpointWriter(c.dir, comm, keep=c.keep, async_save=c.async_save, halfway_hook=hooks.halfway,
                                       staging_hook=hooks.staging, commit_hook=hooks.commit,
                                       copied_files=tokenizer_files or None)
        self.config = cfg.to_dict()
        self.manifest_extra = manifest_extra or {}
        self.committed: list[str] = []
        self.cost = AsyncCost()
        self._lock = threading.Lock()  # the stop watcher's thread and the training thread share what follows
        self._armed: tuple | None = None  # (step, engine, manifest extra, CUDA event): what this step's stop saves
        self._open = False  # a stop seen now is saved from the armed state at once
        self._stop_wanted = False

    # ------------------------------------------------------------------ the loop's calls
    def flags(self) -> SaveFlags:
        done, error = self.writer.poll()
        return SaveFlags(by_clock=self.clock.due(), done=done, error=error,
                         async_slower=self.writer.async_save and self.cost.slower)

    def after_reduce(self, decision) -> str | None:
        """Every rank, with the step's agreed `decision` (its save_done and async_slower): move the async save in
        flight on; the message to log when async saves are turned off, else None."""
        if decision.stop:  # the stop's save supersedes the async save in flight: nothing else commits now
            return None
        if decision.save_done:
            path = self.writer.advance()
            if path:
                self._committed(path)
                self.cost.committed()
        if decision.async_slower and self.writer.async_save:
            return self._save_synchronously()
        return None

    def after_step(self, step: int, engine: ZeroEngine, state: dict, decision, seconds: float) -> None:
        """Count the step's `seconds`; save `step` if due, with the loop's own `state` (data skips, guard window) in
        the manifest. The last step saves synchronously: the run ends right after (a stop saves through `stop`)."""
        self.count_step(seconds)
        by_steps = self.every and step % self.every == 0
        if self.enabled and (by_steps or decision.save_by_clock or step == self.last):
            self._save(step, engine, state, wait=step == self.last)

    def count_step(self, seconds: float) -> None:
        """Count a step's `seconds` where after_step is not called for it (a step the loop judged after it was
        applied, at its next read of the device: no save is due there)."""
        self.cost.step(seconds)

    def arm(self, step: int, engine: ZeroEngine, state: dict) -> None:
        """The training thread, as a step begins: a stop from now until `disarm` saves `step`, the last completed
        one, with the loop's `state` as that step left it (copied: the loop changes its own as it goes)."""
        after = None
        if engine.device.type == "cuda":  # the state of `step` is what the stream holds after this
            after = torch.cuda.Event()
            after.record()
        with self._lock:
            self._armed, self._open = (step, engine, self._extra(copy.deepcopy(state)), after), True
            if self._stop_wanted:
                self._start_stop_save()

    def disarm(self) -> None:
        """The training thread, before the step's all-reduce reads the stop flag: a stop from now on is saved at the
        next `arm` or by `stop`."""
        with self._lock:
            self._open = False

    def stop_requested(self) -> None:
        """The stop request's watcher thread, once a stop signal (or the launcher's stop file) has come: save now."""
        with self._lock:
            self._stop_wanted = True
            if self._open:
                self._start_stop_save()

    def stop(self) -> tuple[int, str]:
        """Every rank, once the step's all-reduce agreed to stop, before any update: wait until the armed step (the
        last completed one) is saved, starting its save here if this rank's watcher had not; (step, folder)."""
        with self._lock:
            self._open = False
            self._start_stop_save()
        step = self._armed[0]
        path = self.writer.finish_stop_save()
        self._committed(path)
        return step, path

    def _start_stop_save(self) -> None:
        """Under the lock: start the stop's save of the armed state, once."""
        if not self.writer.stop_saving:
            step, engine, extra, after = self._armed
            if self.on_stop_save is not None:
                self.on_stop_save(step)
            self.writer.start_stop_save(step, engine, extra, after)

    def recommit(self, step: int, engine: ZeroEngine, state: dict) -> None:
        """Every rank: save `step` again now, synchronously, with the loop's new `state` in its manifest.

        After a rollback restored checkpoint `step`, the engine holds that checkpoint's training state and the loop
        has decided new data skips and guard state: this re-save commits them before training goes on (its data
        files are the restored ones, bit for bit). The committed folder of `step` is replaced as any re-save replaces
        it (commit.py: moved aside, then the new one renamed into place) and `latest` names it, so a crash at any
        moment resumes either as if the rollback had not been decided yet or the rolled-back timeline with its
        skips, never the restored checkpoint with its old ones.
        """
        self._save(step, engine, state, wait=True)

    def finish(self) -> None:
        """Every rank: wait for the save in flight and commit it (the end of the run, or before a rollback)."""
        t0 = time.perf_counter()
        path = self.writer.finish()  # training waits here for a save still in flight: part of its cost
        self._committed(path)
        if path:
            self.cost.start_s += time.perf_counter() - t0
            self.cost.committed()

    # ------------------------------------------------------------------ inside
    def _extra(self, state: dict) -> dict:
        """What a manifest holds beside the writer's own fields: the run's configuration, the loop's `state`."""
        extra = {"config": self.config, "threads_per_rank": torch.get_num_threads(), **self.manifest_extra, **state}
        if self.tokenizer:
            extra["tokenizer"] = self.tokenizer
        return extra

    def _save(self, step: int, engine: ZeroEngine, state: dict, wait: bool) -> None:
        extra = self._extra(state)
        self.clock.saved()
        if self.writer.async_save and not wait and self.cost.sync_s is not None:
            self.finish()  # at most one save in flight
            t0 = time.perf_counter()
            self.writer.start(step, engine, extra)
            self.cost.started(time.perf_counter() - t0)
            return
        self.finish()
        t0 = time.perf_counter()
        path, _, _ = self.writer.save(step, engine, extra)
        if self.cost.sync_s is None:
            self.cost.sync_s = time.perf_counter() - t0
        self._committed(path)

    def _save_synchronously(self) -> str:
        """Every rank, once any rank measured an async save costing more than a synchronous one: say why, once."""
        self.writer.async_save = False
        cost, sync_s = self.cost.last or (float("nan"), float("nan"))
        return (f"--async-save: an async save cost {cost:.3g} s of training here, a synchronous save {sync_s:.3g} s "
                "(no spare core for the writer?): saving synchronously from now on")

    def _committed(self, path: str | None) -> None:
        if path:
            self.committed.append(path)
            self.on_commit(step_of(os.path.basename(path)))
