"""A rank's stop request: SIGTERM or SIGINT, or the stop file of a launcher that cannot signal its ranks."""

from __future__ import annotations

import os
import select
import signal
import threading
import time

from zerotrain.durable import write_atomic

# How often a stop's watcher looks for the launcher's stop file (only a file, which would otherwise be read at the
# step's all-reduce) and for its own closing; a signal wakes it at once.
WATCH_S = 0.05
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

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
    """SIGTERM or SIGINT asks this rank to finish its step, save and exit; a second one exits at once, unless the
    stop's save has begun.

    A launcher that cannot signal its ranks directly (zerotrain's own, which the ranks' parent process
    runs) writes a stop file instead, which `requested` also looks for; the file is not a signal, so the rank's
    own copy of a signal sent to the whole process group is not a second one. Until the rank can answer a stop
    with a save (`begin_stepping`: before DPO's reference pass and the first step), there is nothing to save: a
    signal then ends the rank at once. Once the stop's save has begun (`begin_save`), every further signal is
    ignored: exiting in it would leave the other ranks in the save's collectives and lose the step it commits
    (SIGKILL still ends the rank). `begin_stepping` and `begin_save` leave `stepping_file` and `saving_file` for the
    launcher, which then knows the same.

    Python runs a signal's handler on the main thread, between two bytecodes: never while that thread waits inside a
    collective (a gloo or NCCL wait does not return on a signal), which is where a rank spends a step another rank
    makes long. `wait` therefore also reads the signal module's wakeup fd, written by the C-level handler the moment
    the signal comes, so the stop's watcher thread sees a stop whatever the training thread is doing.
    """

    def __init__(self, stop_file: str | None = None, stepping_file: str | None = None,
                 saving_file: str | None = None, clock=time.monotonic):
        self.stop_file, self.stepping_file, self.saving_file = stop_file, stepping_file, saving_file
        self.signal_name: str | None = None
        self.stepping = False
        self.saving_step: int | None = None  # the step whose stop-save has begun
        self.ignored = 0  # signals that came during that save
        self.signals = SignalCount(clock)
        self.wakeup: tuple[int, int] | None = None  # (read, write) ends of the pipe the signal module writes to

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._on_signal)
            self.wakeup = os.pipe()
            for fd in self.wakeup:
                os.set_blocking(fd, False)  # the C handler must never block, nor the watcher's read
            signal.set_wakeup_fd(self.wakeup[1], warn_on_full_buffer=False)
        return self

    def close(self) -> None:
        """The main thread, as `install`: the signal module stops writing to the wakeup pipe, which is closed."""
        if self.wakeup is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
            for fd in self.wakeup:
                os.close(fd)
            self.wakeup = None

    def wait(self, timeout_s: float) -> bool:
        """Another thread than the main one: wait up to `timeout_s` for a stop signal; whether a stop is requested.
        A signal counts here as soon as it comes, before its handler has run on the main thread; the handler still
        decides alone what a further signal does (exit at once, or wait for the save)."""
        if self.wakeup is None:
            time.sleep(timeout_s)
            return self.requested
        if select.select([self.wakeup[0]], [], [], timeout_s)[0]:
            self._read_wakeup()
        return self.requested

    def _read_wakeup(self) -> None:
        try:
            signums = os.read(self.wakeup[0], 512)
        except BlockingIOError:
            return
        for signum in signums:
            # before stepping the handler ends the rank (nothing to save); once a save began a signal changes nothing
            if signum in STOP_SIGNALS and self.stepping and self.saving_step is None and self.signal_name is None:
                self.signal_name = signal.Signals(signum).name

    def _on_signal(self, signum, _frame) -> None:
        if self.saving_step is not None:  # the stop's save has begun: it commits first
            self.ignored += 1
            return
        # Before the rank can save (nothing to save) or at a second request: exit now (130 for SIGINT, 143 for SIGTERM).
        if self.signals.is_second() or not self.stepping:
            os._exit(128 + signum)
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def begin_stepping(self) -> None:
        """The rank can answer a stop with a save from now on: a signal finishes the reference pass (DPO) and the step,
        then saves."""
        self.stepping = True
        if self.stepping_file:
            open(self.stepping_file, "a").close()

    def begin_save(self, step: int) -> None:
        """Every rank stops and saves at `step`: from now on a signal waits for that save (the launcher's too)."""
        if self.saving_step != step:
            self.saving_step = step
            if self.saving_file:
                write_atomic(self.saving_file, str(step), durable=False)

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
            while not self.closed.is_set():
                if request.wait(poll_s):
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


def install_stop_request(stop_file: str | None, stepping_file: str | None = None,
                         saving_file: str | None = None) -> StopRequest:
    """Called once as a rank starts: its signal handlers, and the launcher's stop, stepping and saving files if it has
    one."""
    global _stop
    if saving_file and os.path.exists(saving_file):  # an earlier attempt's, which failed in its save
        os.remove(saving_file)
    if _stop is not None:
        _stop.close()
    _stop = StopRequest(stop_file, stepping_file, saving_file).install()
    return _stop
