"""GRPO's rollout records on rank 0: `rollouts.jsonl`, one line per completion of each step (its prompt and completion
ids, text, each reward function's score, the weighted reward, the advantage).

Appended as the metrics file is: one write and flush per step, and a run resuming at step s first drops the records of
steps after s (work that was not committed; whole-or-absent by durable.write_atomic), so the file holds the rollouts
of the timeline that trained. A line a crash cut short is dropped too. After a rollback (the guard refusing a step and
restoring step t) the replay's first write, of step t + 1, drops the records of the abandoned steps t + 1 onwards
first, as the metrics file drops theirs: the file reads as one run.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Sequence

import torch

from zerotrain.durable import write_atomic
from zerotrain.model.generate import until_stop

FILE = "rollouts.jsonl"


def number_or_none(x: float) -> float | None:
    """A JSON-safe number: NaN (a completion no reward function scored) as null."""
    return None if math.isnan(x) else x


def rollout_records(step: int, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                    texts: Sequence[str], reward_names: Sequence[str], per_function: torch.Tensor,
                    rewards: torch.Tensor, advantages: torch.Tensor,
                    stop_ids: Collection[int] | None = None) -> list[dict]:
    """The records of one step's N completions (prompt-major, as sampled): `prompt_ids` one per completion,
    `completion_ids` cut after their first stop token (kept) here if not already, `per_function` (N, functions)
    the scores, NaN for None."""
    scores, totals, advantages = per_function.tolist(), rewards.tolist(), advantages.tolist()
    return [{"step": step, "prompt_ids": list(p), "completion_ids": until_stop(list(c), stop_ids)[0], "text": text,
             "rewards": {name: number_or_none(s) for name, s in zip(reward_names, row)},
             "reward": number_or_none(total), "advantage": advantage}
            for p, c, text, row, total, advantage in zip(prompt_ids, completion_ids, texts, scores, totals, advantages)]


class RolloutWriter:
    """Appends each step's rollout records to `path`; inactive (a no-op) off rank 0, so the caller needs no rank
    checks. `start`: the step the run resumes from (0: a fresh run), whose later records are dropped first; a step
    written again (the replay after a rollback) replaces the records of that step and every later one."""

    def __init__(self, path: str, *, active: bool = True, start: int = 0):
        self.path, self.file, self.last = path, None, start
        if not active:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        drop_steps_after(path, start)
        self.file = open(path, "a")

    def write(self, records: list[dict]) -> None:
        if self.file is None or not records:
            return
        step = records[0]["step"]
        if step <= self.last:  # a rollback restored step - 1: the steps after it were abandoned
            self.file.close()
            drop_steps_after(self.path, step - 1)
            self.file = open(self.path, "a")
        self.last = step
        try:
            self.file.write("".join(json.dumps(r) + "\n" for r in records))
            self.file.flush()
        except OSError as e:  # a full disk's write names no file
            raise OSError(e.errno, e.strerror, self.path) from e

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def read_rollouts(path: str) -> list[dict]:
    """The whole records of a rollouts file, in order (a last line cut short by a crash left out)."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [r for r in map(whole_record, f) if r is not None]


def whole_record(line: str) -> dict | None:
    """The record of one line, None for an empty line or one a crash cut short."""
    if not line.endswith("\n"):
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def drop_steps_after(path: str, step: int) -> None:
    """Rewrite `path` (whole or absent) without the records of steps after `step` and any line cut short."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if (r := whole_record(line)) is not None and r["step"] <= step]
    if len(kept) < len(lines):
        write_atomic(path, "".join(kept))
