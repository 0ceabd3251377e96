"""Validation loss: the mean token loss over a fixed set of validation batches, every rank computing its part."""

from __future__ import annotations

import torch

from zerotrain.data import IGNORE, BatchSchedule
from zerotrain.model.gpt2 import summed_token_loss
from zerotrain.parallel import Mesh


@torch.no_grad()
def validation_loss(model: torch.nn.Module, source, mesh: Mesh, *, batches: int, micro_batch: int) -> float:
    """Mean loss over validation batches 0..batches-1 of `source`, whose batch k is fixed.

    Each batch holds (DP replicas) x micro_batch sequences; each replica computes its own block (its
    TP ranks together, counted once), and one all-reduce of [summed token loss, token count] gives
    every rank the same mean, whatever the split.
    """
    schedule = BatchSchedule(source, micro_batch=micro_batch, accum=1, rank=mesh.dp_rank, world_size=mesh.dp_size)
    device = next(model.parameters()).device
    totals = torch.zeros(2, dtype=torch.float64)
    for k in range(batches):
        for x, y in schedule.batch(k).micro_batches:
            loss = float(summed_token_loss(model(x.to(device)), y.to(device)))  # every TP rank runs the forward
            if mesh.tp_rank == 0:
                totals[0] += loss
                totals[1] += int((y != IGNORE).sum())
    totals = mesh.world.all_reduce(totals.to(mesh.world.device), "all_reduce_eval").cpu()
    return float(totals[0] / totals[1])
