"""A rank's stop request: SIGTERM or SIGINT, or the stop file of a launcher that cannot signal its ranks."""

from __future__ import annotations

import os
import signal
import threading
import time

# How often a stop's watcher looks for the request: a signal's handler runs on the training thread, a launcher's stop
# file is only a file, and neither would otherwise be read before the step's all-reduce.
WATCH_S = 0.05

# Signals this close after the first are that stop request delivered again, not a second request: a terminal's
# Ctrl-C, `timeout` or `kill -- -PGID` reach every process of the group, and a launcher may pass the same stop on
# (torchrun's agent sends its ranks the signal it received; `timeout` signals its child, then the group). A person's
# second Ctrl-C comes later than this.
SAME_STOP_S = 1.0


class SignalCount:
    """Counts stop requests by signal: a signal within SAME_STOP_S of the first is the first one delivered again."""

    def __init__(self, clock=time.monotonic):
        self.clock, self.first_at = clock, None

    def is_second(self) -> bool:
        """Count a signal that just arrived; True when it is a second stop request (stop at once)."""
        now = self.clock()
        if self.first_at is None:
            self.first_at = now
            return False
        return now - self.first_at >= SAME_STOP_S


class StopRequest:
    """SIGTERM or SIGINT asks this rank to finish its step, save and exit; a second one exits at once.

    A launcher that cannot signal its ranks directly (zerotrain's own, which the ranks' parent process
    runs) writes a stop file instead, which `requested` also looks for; the file is not a signal, so the rank's
    own copy of a signal sent to the whole process group is not a second one. Until the loop is about to
    start its first step (`begin_stepping`), there is nothing to save: a signal then ends the rank at
    once. `begin_stepping` leaves `stepping_file` for the launcher, which then knows the same.
    """

    def __init__(self, stop_file: str | None = None, stepping_file: str | None = None, clock=time.monotonic):
        self.stop_file, self.stepping_file = stop_file, stepping_file
        self.signal_name: str | None = None
        self.stepping = False
        self.signals = SignalCount(clock)

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, _frame) -> None:
        # Before the first step (nothing to save) or at a second request: exit now (130 for SIGINT, 143 for SIGTERM).
        if self.signals.is_second() or not self.stepping:
            os._exit(128 + signum)
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def begin_stepping(self) -> None:
        """The loop's first step is next: from now on a signal finishes the step and saves."""
        self.stepping = True
        if self.stepping_file:
            open(self.stepping_file, "a").close()

    @property
    def requested(self) -> bool:
        if self.signal_name is None and self.stop_file and os.path.exists(self.stop_file):
            with open(self.stop_file) as f:
                self.signal_name = f.read().strip() or "SIGTERM"
        return self.signal_name is not None


class StopWatch:
    """A thread that calls `on_stop()` once, as soon as `request` is seen, so a stop's save can start while the
    training thread is still inside a step (which can outlast torchrun's 30 s between SIGTERM and SIGKILL)."""

    def __init__(self, request: StopRequest, on_stop, poll_s: float = WATCH_S):
        self.closed = threading.Event()

        def watch():
            while not self.closed.wait(poll_s):
                if request.requested:
                    on_stop()
                    return

        self.thread = threading.Thread(target=watch, name="zerotrain-stop-watch", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closed.set()
        self.thread.join()


_stop: StopRequest | None = None


def stop_request() -> StopRequest:
    """This rank's stop request (signals, or the launcher's stop file); created when the rank starts."""
    global _stop
    if _stop is None:
        _stop = StopRequest()
    return _stop


def install_stop_request(stop_file: str | None, stepping_file: str | None = None) -> StopRequest:
    """Called once as a rank starts: its signal handlers, and the launcher's stop and stepping files if it has one."""
    global _stop
    _stop = StopRequest(stop_file, stepping_file).install()
    return _stop
