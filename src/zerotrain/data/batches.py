"""The batch schedule: which sequences of step s's global batch each rank computes, in which micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sources import IGNORE


@dataclass
class StepBatch:
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]  # this rank's (inputs, labels), in order
    global_tokens: int  # unmasked target tokens in the whole global batch, all ranks together

    @property
    def local_tokens(self) -> int:
        return sum(int((y != IGNORE).sum()) for _, y in self.micro_batches)


class BatchSchedule:
    """Splits step s's global batch: rank r owns a contiguous block of micro_batch x accum sequences."""

    def __init__(self, source, *, micro_batch: int, accum: int, rank: int, world_size: int):
        self.source, self.micro_batch, self.accum = source, micro_batch, accum
        self.rank, self.world_size = rank, world_size
        self.global_batch = world_size * micro_batch * accum

    def batch(self, step: int) -> StepBatch:
        per_rank = self.micro_batch * self.accum
        first = self.rank * per_rank
        micro = []
        for a in range(self.accum):
            lo = first + a * self.micro_batch
            micro.append(self.source.sequences(step, range(lo, lo + self.micro_batch)))
        return StepBatch(micro, self.source.token_count(step, self.global_batch))
