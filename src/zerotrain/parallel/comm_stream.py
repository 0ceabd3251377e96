"""The stream a rank's bucket collectives run on: on CUDA a communication stream of their own, ordered by events.

The gradient reduce-scatters and the parameter all-gathers (stages 1 and 2 after the update, stage 3's unit gathers
and prefetches) go through `CommStream.run`, as FSDP2 runs its collectives:

    ready   an event recorded on the compute stream when the collective is issued (its input is then queued in
            full); the communication stream waits for it, not for anything the compute stream queues later
    run     the collective is issued on the communication stream, which then waits for it (NCCL runs it on its own
            stream: a stream wait, no CPU wait) and records `done`
    wait    the compute stream waits for `done` before it reads the result (`Landing.wait`, where the engine waited
            for the work handle before); the CPU waits for nothing
    free    the landing holds the collective's tensors until that wait: a buffer the compute stream frees or reuses
            after it is ordered after the collective (event-guarded reuse, as FSDP2 frees its buffers, rather than
            record_stream, which delays every reuse until the allocator next polls the stream)

Elsewhere (CPU, gloo) there is no stream to choose: `run` issues the collective as it is and hands back its own
handle, so a CPU run computes bitwise what it did. The stream API is a seam (`api`: torch.cuda, or a recorder in
the tests), so the ordering is tested on CPU; on a GPU it is not measured yet (docs/cuda.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def stream_api(device: torch.device):
    """The stream API for collectives on `device`: torch.cuda on a CUDA device, else None (the current stream)."""
    return torch.cuda if device.type == "cuda" else None


class Landing:
    """A collective issued on the communication stream: `wait()` makes the compute stream wait for its `done` event
    and lets its tensors go."""

    def __init__(self, api, done, tensors: Sequence[torch.Tensor]):
        self.api, self.done, self.tensors = api, done, tuple(tensors)

    def wait(self) -> None:
        if self.done is not None:
            self.api.current_stream().wait_event(self.done)
            self.done, self.tensors = None, ()


class CommStream:
    """Where a Comm's bucket collectives run: `api` None, the current stream; else `api.Stream()` of its own."""

    def __init__(self, api=None):
        self.api = api
        # FSDP2 gives its collectives' streams a higher priority than compute's, so a ready collective is not
        # queued behind compute kernels
        self.side = api.Stream(priority=-1) if api is not None else None

    def run(self, launch: Callable[[bool], object], tensors: Sequence[torch.Tensor], async_op: bool):
        """Issue the collective `launch(async_op)` issues (and hands the handle of, with async_op) after what the
        compute stream has queued, reading and writing `tensors`: a handle to wait for with `async_op`, else waited
        for (by the compute stream) before returning None. On the current stream: `launch` as called."""
        if self.side is None:
            return launch(async_op)
        ready = self.api.Event()
        ready.record(self.api.current_stream())
        self.side.wait_event(ready)
        with self.api.stream(self.side):
            launch(True).wait()  # the communication stream waits for the collective (NCCL: its stream's, no CPU's)
            done = self.api.Event()
            done.record(self.side)
        landing = Landing(self.api, done, tensors)
        if async_op:
            return landing
        landing.wait()
        return None
