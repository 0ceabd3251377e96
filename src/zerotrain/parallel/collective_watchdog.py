"""A rank's watch over its collectives where the CPU does not wait for them (NCCL): one that is not done within its
timeout ends the rank with the line a gloo timeout gives, naming the collective and the step.

On gloo a collective's timeout is raised at the call (comm.collective_error makes the line). On NCCL the CPU queues
a collective and goes on; the stream waits for it, not the CPU (no TORCH_NCCL_BLOCKING_WAIT). A hung peer then
shows on this rank only where the CPU next reads the device, and NCCL's own watchdog, which aborts the communicator
(TORCH_NCCL_ASYNC_ERROR_HANDLING=2, set by the launcher), names neither. So each collective, as the rank starts
it (Comm._guard), is noted with its purpose, the step and its communicator's timeout; once the call returns, a
marker says when it is done: a CUDA event recorded on the current stream, which the call made wait for the
collective (gloo: done on return). One thread per rank wakes at the oldest pending collective's deadline; if its
marker is not done by then, it hands the collective's one line to `on_timeout`, which reports it and ends the
process. NCCL's own watchdog is given NCCL_TIMEOUT_GRACE_S more (process_group_timeout), so this line comes first.

Between steps nothing is pending (a checkpoint's file writes start no collective), so the watch costs nothing there;
in a step it costs one event record and query per collective, and no read of the device by the rank's own thread.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

# NCCL's watchdog aborts the communicator after the process group's timeout; it is given this much more than the
# collective's own --timeout, so that this watch, not NCCL's abort, speaks first.
NCCL_TIMEOUT_GRACE_S = 30.0
IDLE_POLL_S = 1.0  # how often the thread looks when nothing is pending (a start also wakes it)


def process_group_timeout(timeout_s: float, backend: str) -> datetime.timedelta:
    """The timeout a process group of `backend` is made with for collectives of `timeout_s` (--timeout)."""
    return datetime.timedelta(seconds=timeout_s + (NCCL_TIMEOUT_GRACE_S if backend == "nccl" else 0.0))


def cuda_marker() -> torch.cuda.Event:
    """Done when the current stream has reached this point: after a collective's wait, when the collective is."""
    event = torch.cuda.Event()
    event.record()
    return event


@dataclass(eq=False)  # each entry is itself: two alike are two collectives
class Pending:
    purpose: str
    step: int
    timeout_s: float
    timeout_flag: str
    deadline: float
    marker: object | None = None  # query() -> bool; None while the call has not returned
    returned: bool = False


class CollectiveWatchdog:
    """The rank's pending collectives and the thread that ends the rank when one outlives its timeout.

    `on_timeout(where, timeout_s, timeout_flag)` reports the collective and ends the process (it is not expected to
    return); `marker()` is what `returned` records (cuda_marker on CUDA; None: done on return); `timeout_s`, where
    given, replaces each communicator's own.
    """

    def __init__(self, on_timeout: Callable[[str, float, str], None], marker: Callable[[], object] | None = None,
                 timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.on_timeout, self.marker, self.timeout_s, self.clock = on_timeout, marker, timeout_s, clock
        self.pending: collections.deque[Pending] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: Pending | None = None

    def start(self) -> "CollectiveWatchdog":
        self._thread = threading.Thread(target=self._watch, name="zerotrain-collective-watchdog", daemon=True)
        self._thread.start()
        return self

    def started(self, purpose: str, step: int, timeout_s: float | None, timeout_flag: str) -> Pending | None:
        """Note a collective the rank starts now; None where it has no timeout to keep."""
        timeout = self.timeout_s if self.timeout_s is not None else timeout_s
        if not timeout:
            return None
        entry = Pending(purpose, step, timeout, timeout_flag, self.clock() + timeout)
        with self._lock:
            self._forget_done()
            self.pending.append(entry)
        self._wake.set()
        return entry

    def returned(self, entry: Pending | None) -> None:
        """The collective's call returned: done now (gloo), or when its marker says so (CUDA)."""
        if entry is None:
            return
        marker = self.marker() if self.marker is not None else None
        with self._lock:
            entry.marker, entry.returned = marker, True
            if marker is None and entry in self.pending:
                self.pending.remove(entry)

    def failed(self, entry: Pending | None) -> None:
        """The call raised: its own error reports it."""
        with self._lock:
            if entry is not None and entry in self.pending:
                self.pending.remove(entry)

    def check(self) -> float | None:
        """Drop what is done; report the oldest overdue collective (on_timeout), else the seconds until the next
        deadline (None: nothing pending)."""
        with self._lock:
            self._forget_done()
            if not self.pending:
                return None
            now = self.clock()
            overdue = [e for e in self.pending if e.deadline <= now and not _done(e)]
            if not overdue:
                return max(0.0, min(e.deadline for e in self.pending) - now)
            self.fired = overdue[0]
        where = f"collective {self.fired.purpose} at step {self.fired.step}"
        self.on_timeout(where, self.fired.timeout_s, self.fired.timeout_flag)
        return None

    def _forget_done(self) -> None:
        while self.pending and _done(self.pending[0]):
            self.pending.popleft()

    def _watch(self) -> None:
        while self.fired is None:
            wait = self.check()
            self._wake.wait(IDLE_POLL_S if wait is None else min(wait + 0.01, IDLE_POLL_S))
            self._wake.clear()


def _done(entry: Pending) -> bool:
    return entry.returned and (entry.marker is None or entry.marker.query())


_installed: CollectiveWatchdog | None = None


def install(watchdog: CollectiveWatchdog | None) -> None:
    """The rank's watchdog, which every communicator of this process notes its collectives with (None: none)."""
    global _installed
    _installed = watchdog


def installed() -> CollectiveWatchdog | None:
    return _installed
