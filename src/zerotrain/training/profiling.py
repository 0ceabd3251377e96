"""--profile-steps A:B: a torch.profiler trace of steps A to B, one chrome trace per rank in <out>/profile/.

Every rank traces, not only rank 0: what a distributed step's time goes to is often one rank waiting for another
in a collective, which only the two ranks' traces side by side show (load them together in Perfetto or
chrome://tracing). Each step is a range named "step N" in the trace. A trace starts as step A starts and ends as
step B + 1 starts, so it holds step B's metrics and checkpoint too; a run that ends first writes what it traced.
"""

from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from zerotrain.config import step_range


def trace_path(out: str, rank: int, first: int, last: int) -> str:
    return os.path.join(out, "profile", f"steps{first:06d}-{last:06d}-rank{rank:05d}.json")


class StepProfiler:
    """Starts, labels and ends a trace at step boundaries; a no-op without --profile-steps."""

    def __init__(self, spec: str, out: str, rank: int, device: torch.device):
        self.steps = step_range(spec) if spec else None
        self.path = trace_path(out, rank, *self.steps) if self.steps else None
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = None
        self.label = None
        self.written: str | None = None

    def at_step(self, step: int) -> None:
        """Step `step` begins: start the trace at A, label each traced step, write the trace after B."""
        if self.steps is None or self.written:
            return
        first, last = self.steps
        if self.profiler is None and first <= step <= last:
            self.profiler = profile(activities=self.activities)
            self.profiler.start()
        if self.profiler is None:
            return
        self._end_label()
        if step > last:
            self.close()
            return
        self.label = record_function(f"step {step}")
        self.label.__enter__()

    def close(self) -> str | None:
        """Write the trace if one is running (the run ended inside A:B); the path written, if any."""
        if self.profiler is not None and not self.written:
            self._end_label()
            self.profiler.stop()
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.profiler.export_chrome_trace(self.path)
            self.written = self.path
        return self.written

    def _end_label(self) -> None:
        if self.label is not None:
            self.label.__exit__(None, None, None)
            self.label = None
