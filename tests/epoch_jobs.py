"""Job functions of test_epochs' multi-rank run (importable by module name in the ranks): training that records the
records each rank's rows held, step by step."""

from __future__ import annotations

import copy
import os
from unittest import mock

import torch

from zerotrain import checkpoint
from zerotrain.config import Config
from zerotrain.data import IGNORE, BatchSchedule, RecordSource
from zerotrain.parallel import Comm
from zerotrain.training import loop
from zerotrain.training.loop import train


def record_pieces(mb) -> list[list[list[int]]]:
    """The [inputs, labels] of every record in a packed micro-batch (padding and empty rows left out)."""
    out = []
    for row in range(mb.inputs.shape[0]):
        for s in torch.unique_consecutive(mb.segments[row]):
            at = mb.segments[row] == s
            if (mb.labels[row, at] != IGNORE).any():
                out.append([mb.inputs[row, at].tolist(), mb.labels[row, at].tolist()])
    return out


def step_times_batch(real):
    """Planted: the row mapping before layouts, step k of an epoch at rows k*G for G the global batch the run has
    now, whatever rows the steps before it read (`real`: RecordSource.step_rows)."""
    def rows(self, step):
        today = copy.copy(self)
        today.continue_layout([], 0)  # the run's global batch from the first step on
        return real(today, step)
    return rows


def recorded_train(cfg: Config, comm: Comm) -> dict:
    """Train; the losses, the digests, {data step: the records every rank computed in it} and {data step: its epoch}."""
    seen: dict[int, list] = {}
    epochs: dict[int, int] = {}
    real = BatchSchedule.batch

    def recording(self, step):
        batch = real(self, step)
        seen[step] = [p for mb in batch.micro_batches for p in record_pieces(mb)]
        epochs[step] = batch.epoch
        return batch

    with mock.patch.object(BatchSchedule, "batch", recording):
        result = train(cfg, comm)
    every_rank = comm.io.all_gather_json({str(k): v for k, v in seen.items()}, "gather_seen_records")
    steps = {int(k) for rank in every_rank for k in rank}
    return {"losses": [r["loss"] for r in result.records], "digests": result.digests, "start": result.start_step,
            "plan": result.plan, "epochs": epochs,
            "seen": {k: [p for rank in every_rank for p in rank.get(str(k), [])] for k in sorted(steps)}}


def epochs_resume_job(cfg: Config, comm: Comm, *, resume_at: int, resized_steps: int, resized_out: str) -> dict:
    """An uninterrupted run saving at `resume_at`; a fresh run resumed from that checkpoint; one resumed from it at
    another global batch (micro-batch 1 x accum 3) to `resized_steps`, saving its last step in `resized_out`; and,
    planted, a resume that forgets the data position (its data steps count from 0 again), one whose memory plan
    leaves out the packed records' attention mask, and the resized resume with the rows of step x G."""
    first = recorded_train(cfg, comm)
    resumed = copy.deepcopy(cfg)
    resumed.checkpoint.resume = os.path.join(cfg.checkpoint.dir, checkpoint.step_name(resume_at))
    resumed.checkpoint.every, resumed.logging.metrics = 0, ""
    again = recorded_train(resumed, comm)
    with mock.patch.object(loop, "data_step", lambda step, skips: step - resume_at):
        forgetful = recorded_train(resumed, comm)
    real_plan = loop.memory_plan
    with mock.patch.object(loop, "memory_plan", lambda cfg, world_size, documents: real_plan(cfg, world_size)):
        unplanned = recorded_train(resumed, comm)  # planted: the plan is not told that the rows carry segments
    resized = copy.deepcopy(resumed)
    resized.loop.micro_batch, resized.loop.accum, resized.loop.steps = 1, 3, resized_steps
    resized.logging.out, resized.checkpoint.dir, resized.checkpoint.every = resized_out, resized_out, resized_steps
    other_batch = recorded_train(resized, comm)
    resized.checkpoint.every = 0
    with mock.patch.object(RecordSource, "step_rows", step_times_batch(RecordSource.step_rows)):
        step_times_g = recorded_train(resized, comm)
    return {"first": first, "resumed": again, "forgetful": forgetful, "unplanned": unplanned,
            "other_batch": other_batch, "step_times_g": step_times_g}
