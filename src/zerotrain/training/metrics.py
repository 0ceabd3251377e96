"""Per-step metrics: a progress line on rank 0, one JSON object per step (and per event) in a JSONL file."""

from __future__ import annotations

import json
import os
import sys

from tqdm import tqdm

from zerotrain.durable import write_atomic


class Metrics:
    """Rank 0 writes; other ranks hold a no-op instance so the loop needs no rank checks.

    The file is appended to. A run resuming at step s first drops the step records after s (they
    belong to work that was not committed), and a rollback to step s drops those of the abandoned steps,
    rewriting the file atomically, so the file holds one record per step of the timeline that trained.
    Events (restart, rollback, stop) are history and always kept. `dropped_after` is the last step a
    resume dropped, which tells a restart how many steps it lost.
    """

    def __init__(self, path: str, *, active: bool, progress: bool, start: int, total: int,
                 tensorboard: str | None = None):
        self.active = active
        self.path, self.tensorboard = path, tensorboard
        self.file = None
        self.bar = None
        self.board = None
        self.dropped_after = start
        if not active:
            return
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.dropped_after = _truncate_after(path, start)
            self.file = open(path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # the [tb] extra; checked when the config was

            self.board = SummaryWriter(tensorboard, purge_step=start + 1)
        # The bar starts with the first step, after the start line: a line printed beside a drawn bar lands on it.
        self._bar_span = (start, total) if progress else None

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self._write(record)
        if self.board:
            for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s"):
                if record.get(key) is not None:
                    self.board.add_scalar(key, record[key], record["step"])
        if self._bar_span and self.bar is None:
            start, total = self._bar_span
            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr,
                            dynamic_ncols=True, leave=True)
        if self.bar:
            postfix = dict(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if "val_loss" in record:
                postfix["val"] = f"{record['val_loss']:.4f}"
            self.bar.set_postfix(**postfix, refresh=False)
            self.bar.update(1)

    def announce(self, line: str) -> None:
        """A line for the person watching (the run's start line), on rank 0, before the progress bar starts."""
        if self.active:
            print(f"zerotrain: {line}", flush=True)

    def event(self, record: dict, message: str | None = None) -> None:
        """An event (restart, rollback, stop) in the metrics, and its line on screen."""
        if not self.active:
            return
        self._write(record)
        if message:
            if self.bar:
                self.bar.write(f"zerotrain: {message}", file=sys.stderr)
                if "to_step" in record:  # a rollback moves the bar back
                    self.bar.n = record["to_step"]
                    self.bar.refresh()
            else:
                print(f"zerotrain: {message}", file=sys.stderr, flush=True)

    def rewind(self, step: int) -> None:
        """A rollback to `step`: the abandoned steps' records go (file and TensorBoard); the replay writes them anew."""
        if not self.active:
            return
        if self.file:
            self.file.close()
            _truncate_after(self.path, step)
            self.file = open(self.path, "a")
        if self.board:  # a writer's purge_step hides the steps from there on in what TensorBoard shows
            from torch.utils.tensorboard import SummaryWriter

            self.board.close()
            self.board = SummaryWriter(self.tensorboard, purge_step=step + 1)

    def _write(self, record: dict) -> None:
        if self.file:
            try:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            except OSError as e:  # a full disk's write names no file
                raise OSError(e.errno, e.strerror, self.path) from e

    def close(self) -> None:
        if self.board:
            self.board.close()
        if self.bar:
            self.bar.close()
        if self.file:
            self.file.close()


def _truncate_after(path: str, step: int) -> int:
    """Keep the step records of steps <= step, and every event; return the last step seen."""
    if not os.path.isfile(path):
        return step
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = [json.loads(line) for line in lines]
    last = max((r["step"] for r in records if "step" in r and "event" not in r), default=step)
    kept = [line for line, r in zip(lines, records) if "event" in r or r.get("step", 0) <= step]
    if len(kept) < len(lines):
        write_atomic(path, "".join(line if line.endswith("\n") else line + "\n" for line in kept))
    return last


def read_step_records(path: str) -> list[dict]:
    """The step records of a metrics file, in step order; a step replayed after a rollback keeps its last record."""
    by_step = {}
    if path and os.path.isfile(path):
        with open(path) as f:
            for line in f:
                record = json.loads(line) if line.strip() else {}
                if "event" not in record and "step" in record:
                    by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def count_events(path: str, kind: str) -> int:
    """Events of one kind in a metrics file: the whole run's, restarts and resumes included."""
    if not path or not os.path.isfile(path):
        return 0
    with open(path) as f:
        return sum(json.loads(line).get("event") == kind for line in f if line.strip())

