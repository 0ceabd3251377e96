"""The batch schedule: which sequences of step s's global batch each rank computes, in which micro-batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, NamedTuple

import torch

IGNORE = -100  # label of a masked position, as PyTorch's cross_entropy ignore_index


class MicroBatch(NamedTuple):
    """Rows of one forward: inputs and labels [B, T]; with packed records, which record each position belongs to."""

    inputs: torch.Tensor
    labels: torch.Tensor  # the next token, IGNORE where no loss is taken
    # [B, T] record index within its row, non-decreasing along T (padding has an id of its own); None: every row is
    # one document, attended causally as a whole
    segments: torch.Tensor | None = None

    def to(self, device, non_blocking: bool = False) -> MicroBatch:
        return MicroBatch(*(None if t is None else t.to(device, non_blocking=non_blocking) for t in self))

    def pin_memory(self) -> MicroBatch:
        return MicroBatch(*(None if t is None else t.pin_memory() for t in self))


@dataclass
class StepBatch:
    micro_batches: list[MicroBatch]  # this rank's, in order
    global_tokens: int  # unmasked target tokens in the whole global batch, all ranks together
    epoch: int | None = None  # 1-based, for sources of records read in epochs
    source_tokens: dict[str, int] | None = None  # a mixture's: global_tokens by source, as the user named them
    source_epochs: dict[str, int] | None = None  # a mixture's: the epoch (1-based) of each source of records
    # rows of the whole global batch with a trained token (not the empty rows that fill an epoch's last step): what a
    # mixture of experts' balancing loss is the mean over; None: every row
    global_rows: int | None = None

    @property
    def local_tokens(self) -> int:
        return sum(int((m.labels != IGNORE).sum()) for m in self.micro_batches)


class BatchSchedule:
    """Splits step s's global batch: rank r owns a contiguous block of micro_batch x accum sequences."""

    def __init__(self, source, *, micro_batch: int, accum: int, rank: int, world_size: int,
                 part: Callable[[MicroBatch], MicroBatch] | None = None):
        """`part`: what this rank keeps of each micro-batch it reads (context parallelism: its part of every row,
        the same rows as the other ranks of its DP replica); None: all of it."""
        self.source, self.micro_batch, self.accum, self.part = source, micro_batch, accum, part
        self.rank, self.world_size = rank, world_size
        self.global_batch = world_size * micro_batch * accum
        # A source of records in epochs lays the steps it is asked for out for one global batch size (a resume
        # at another continues its layout: resume()); another would silently read rows twice or skip them
        rows = getattr(source, "global_batch", self.global_batch)
        if rows != self.global_batch:
            raise ValueError(f"the source lays out steps of {rows} sequences, the schedule's global batch is "
                             f"{self.global_batch} ({world_size} x {micro_batch} x {accum})")

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the schedule: for records in epochs, the global batches the run has had and
        from which data step (the row the next step reads follows from them); other sources need nothing."""
        layout = getattr(self.source, "layout", None)
        return {} if layout is None else {"data_layout": layout}

    def resume(self, state: dict, at: int, global_batch: int) -> None:
        """Continue, from data step `at`, the run whose checkpoint holds `state` (its state_dict(), merged into the
        manifest); `global_batch`, that run's, stands for the layout of a checkpoint written without one."""
        if hasattr(self.source, "continue_layout"):
            self.source.continue_layout(state.get("data_layout") or [[0, global_batch]], at)

    def batch(self, step: int) -> StepBatch:
        per_rank = self.micro_batch * self.accum
        first = self.rank * per_rank
        micro = []
        for a in range(self.accum):
            lo = first + a * self.micro_batch
            rows = self.source.sequences(step, range(lo, lo + self.micro_batch))
            micro.append(rows if self.part is None else self.part(rows))
        epoch = self.source.locate(step)[0] + 1 if hasattr(self.source, "locate") else None
        # sources of records in epochs count their rows with a trained token; other sources fill every row
        rows = self.source.row_count(step, self.global_batch) if hasattr(self.source, "row_count") else None
        if hasattr(self.source, "source_tokens"):  # a mixture: what each source gave
            tokens = self.source.source_tokens(step)
            return StepBatch(micro, sum(tokens.values()), None, tokens, self.source.source_epochs(step) or None, rows)
        return StepBatch(micro, self.source.token_count(step, self.global_batch), epoch, global_rows=rows)


def on_device(micro_batches: Iterable[MicroBatch], device: torch.device,
              bounds: Callable[[torch.Tensor, torch.device], tuple] | None = None) -> Iterator[MicroBatch]:
    """The micro-batches on `device`, in order. On CPU they are used where they are.

    `bounds(segments, device)`: what the model's kernels need of a packed micro-batch's records beyond its segments
    (model/fused_delta_rule.segment_bounds), computed here while the segments are on the host, and kept on the
    segments on the device as `segments.segment_bounds` (the model reads them there: no kernel reads them back).

    On CUDA each is pinned and copied on a side stream one micro-batch ahead, so the next copy runs
    while this one computes and the host never waits for a copy; the compute stream waits for the
    copy's end before it reads, and the copies are marked as used by it so the allocator keeps them.
    Micro-batches already on the device are used as they are.
    """
    if device.type != "cuda":
        for micro in micro_batches:
            if bounds is not None and micro.segments is not None:
                micro.segments.segment_bounds = bounds(micro.segments, device)
            yield micro
        return
    copies, compute = torch.cuda.Stream(device), torch.cuda.current_stream(device)

    def issue(micro: MicroBatch) -> MicroBatch:
        if micro.inputs.device.type == "cuda":  # moved there already (bench compare shares its batches so)
            return micro
        with torch.cuda.stream(copies):
            moved = micro.pin_memory().to(device, non_blocking=True)
            if bounds is not None and micro.segments is not None:
                moved.segments.segment_bounds = bounds(micro.segments, device)
            return moved

    pending = iter(micro_batches)
    ahead = next(pending, None)
    ahead = issue(ahead) if ahead is not None else None
    while ahead is not None:
        compute.wait_stream(copies)
        current = ahead
        carried = [t for bounds in getattr(current.segments, "segment_bounds", ()) for t in bounds]
        for t in (*current, *carried):
            if t is not None and t.is_cuda:
                t.record_stream(compute)
        after = next(pending, None)
        ahead = issue(after) if after is not None else None
        yield current
