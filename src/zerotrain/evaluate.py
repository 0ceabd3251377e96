"""Validation loss: the mean token loss over a fixed set of validation batches, every rank computing its part."""

from __future__ import annotations

import torch

from .data import IGNORE, BatchSchedule
from .model import summed_token_loss
from .parallel import Comm


@torch.no_grad()
def validation_loss(model: torch.nn.Module, source, comm: Comm, *, batches: int, micro_batch: int) -> float:
    """Mean loss over validation batches 0..batches-1 of `source`, whose batch k is fixed.

    Each batch holds world_size x micro_batch sequences; each rank computes its own block, and one
    all-reduce of [summed token loss, token count] gives every rank the same mean, whatever the split.
    """
    schedule = BatchSchedule(source, micro_batch=micro_batch, accum=1, rank=comm.rank, world_size=comm.world_size)
    device = next(model.parameters()).device
    totals = torch.zeros(2, dtype=torch.float64)
    for k in range(batches):
        for x, y in schedule.batch(k).micro_batches:
            totals[0] += float(summed_token_loss(model(x.to(device)), y.to(device)))
            totals[1] += int((y != IGNORE).sum())
    totals = comm.all_reduce(totals.to(comm.device), "all_reduce_eval").cpu()
    return float(totals[0] / totals[1])
