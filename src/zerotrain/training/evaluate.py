"""Validation loss: the summed token loss over fixed validation batches, for --eval-every and `zerotrain eval`."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from zerotrain.data import IGNORE, MicroBatch
from zerotrain.model import summed_token_loss
from zerotrain.model.loss import head_loss
from zerotrain.parallel import Mesh
from zerotrain.parallel.context import context_parallel


def validation_sequences(source, batches: int, *, batch: int, micro_batch: int,
                         first: int = 0) -> Iterator[MicroBatch]:
    """Sequences first .. first + batch of validation batches 0 .. batches - 1, micro_batch at a time.

    Batch k is fixed by the source (a pure function of k and the index), so a replica's block of it
    and the whole of it hold the same sequences.
    """
    for k in range(batches):
        for lo in range(first, first + batch, micro_batch):
            yield source.sequences(k, range(lo, min(first + batch, lo + micro_batch)))


@torch.no_grad()
def summed_loss(model: torch.nn.Module, micro_batches, on_targets: Callable[[torch.Tensor], None] | None = None
                ) -> tuple[float, int]:
    """(summed token loss, target tokens) over micro-batches; `on_targets(labels)` sees each one's labels."""
    device = next(model.parameters()).device
    loss_sum, tokens = 0.0, 0
    for micro in micro_batches:
        x, y, segments = micro.to(device)  # packed records' segments: each record attends to itself
        loss_sum += float(head_loss(model, x, y, summed_token_loss, False, segments))  # the head's chunked loss
        tokens += int((micro.labels != IGNORE).sum())
        if on_targets is not None:
            on_targets(micro.labels)
    return loss_sum, tokens


def validation_loss(model: torch.nn.Module, source, mesh: Mesh, *, batches: int, micro_batch: int) -> float:
    """Mean loss over validation batches 0..batches-1 of `source`, the same on every rank.

    Each batch holds (DP replicas) x micro_batch sequences; each replica computes its own block (its
    TP ranks together, counted once), and one all-reduce of [summed token loss, token count] gives
    every rank the same mean, whatever the split.
    """
    block = validation_sequences(source, batches, batch=micro_batch, micro_batch=micro_batch,
                                 first=mesh.dp_rank * micro_batch)
    cp = context_parallel(mesh)  # --cp: each CP rank its part of the replica's rows, its tokens counted
    block = map(cp.part, block) if cp else block
    loss_sum, tokens = summed_loss(model, block)  # every TP rank runs the forward
    counted = mesh.tp_rank == 0
    totals = torch.tensor([loss_sum if counted else 0.0, tokens if counted else 0], dtype=torch.float64)
    totals = mesh.world.all_reduce(totals.to(mesh.world.device), "all_reduce_eval").cpu()
    return float(totals[0] / totals[1])
