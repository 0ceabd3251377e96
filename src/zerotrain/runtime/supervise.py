"""The launcher's watch over its ranks: SIGINT/SIGTERM (stop, then hard stop), reaping a failed attempt's ranks.

zerotrain's launcher runs torch's elastic agent in a thread and keeps the main thread for this: the
first signal writes the stop file every rank polls, the second stops every rank at once unless their stop's save
has begun; once a rank has reported a failure, the ranks of its attempt still running are killed after a short grace.
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import threading
import time

from zerotrain.durable import write_atomic

from .stop import SignalCount

STOP_FILE = "stop"
STEPPING_FILE = "stepping-rank{rank}"  # left by each rank once it can answer a stop with a save
SAVING_FILE = "saving-rank{rank}"  # left by each rank once its stop's save has begun: the step it saves
REAPED = "reaped"  # the folder of the ranks the reaper killed, named as their pid files: attempt{N}-rank{R}


class LauncherSignals:
    """The launcher's SIGINT/SIGTERM: the first writes the ranks' stop file, a second request asks for a hard stop.

    A signal to the whole process group reaches the launcher and every rank at once; it is one request, and so is
    the same signal delivered again within SAME_STOP_S (stop.py). Before every rank can save (stop.begin_stepping)
    there is nothing to save: the first signal asks for a hard stop. Once any rank's stop-save has begun (its saving
    file), every rank saves that step: a further request is ignored, with one line, until the job ends (stopping
    the ranks then would lose the step they commit; SIGKILL is still the user's).
    """

    def __init__(self, stop_file: str, stepping_files: list[str] | None = None, clock=time.monotonic,
                 saving_files: list[str] | None = None):
        self.stop_file, self.stepping_files = stop_file, stepping_files or []
        self.saving_files = saving_files or []
        self.hard_stop, self.before_first_step, self._previous = None, False, {}
        self.signals = SignalCount(clock)

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if not all(os.path.exists(p) for p in self.stepping_files):  # a rank still starts: no save can happen
            self.hard_stop, self.before_first_step = name, True
            return
        first = self.signals.first_at is None  # (a rank's own signal may have begun the stop)
        second = self.signals.is_second()
        saving = self.saving_step()
        if saving is not None:
            if first and not os.path.exists(self.stop_file):
                # a rank's own delivery of this request began the save before this handler ran: the stop file still
                # says the request was received (a rank reading it stops at the step it saves anyway)
                write_atomic(self.stop_file, name, durable=False)
            if first or second:  # said once a request, not again for its own delivery again
                print(f"zerotrain: saving step {saving}; {name} and any further signal are ignored until the save is "
                      "committed", file=sys.stderr, flush=True)
            return
        if second:
            self.hard_stop = name
            return
        if os.path.exists(self.stop_file):  # the first request, delivered again
            return
        write_atomic(self.stop_file, name, durable=False)
        print(f"zerotrain: {name} received: every rank finishes its current step and saves; "
              f"send it again to stop at once", file=sys.stderr, flush=True)

    def saving_step(self) -> str | None:
        """The step a rank's stop-save has begun to save, or None while none has."""
        for path in self.saving_files:
            try:
                with open(path) as f:
                    return f.read().strip()
            except FileNotFoundError:
                continue
        return None


class Reaper:
    """Once a rank has reported a failure, the ranks of that attempt still running get a second, then SIGKILL.

    The elastic agent stops a failed group with SIGTERM and waits up to 30 s before SIGKILL; a rank hung
    inside a collective or a C call never runs its SIGTERM handler, so without this the job would outlive
    its --timeout by half a minute. Each rank records its pid per attempt, so a restarted group is spared.
    """

    GRACE_S = 1.0

    def __init__(self, job_dir: str):
        self.job_dir, self.handled, self.due = job_dir, set(), {}

    def poll(self) -> None:
        failures = os.path.join(self.job_dir, "failures")
        for name in os.listdir(failures) if os.path.isdir(failures) else []:
            attempt = name.split("-")[0]
            if attempt not in self.handled:
                self.handled.add(attempt)
                self.due[attempt] = time.monotonic() + self.GRACE_S
        for attempt, when in list(self.due.items()):
            if time.monotonic() > when:
                del self.due[attempt]
                for path in glob.glob(os.path.join(self.job_dir, "pids", f"{attempt}-*")):
                    with open(path) as f:
                        if _signal(int(f.read()), signal.SIGKILL):  # said, so a restart does not blame it
                            os.makedirs(os.path.join(self.job_dir, REAPED), exist_ok=True)
                            open(os.path.join(self.job_dir, REAPED, os.path.basename(path)), "w").close()


def stop_descendants(agent: threading.Thread, spare: set[int], grace_s: float = 2.0) -> None:
    """SIGTERM the processes below this one that the job started (all but `spare`, those there before it), SIGKILL
    what is left after `grace_s`, let the agent wind down. A caller's own children are left alone.

    The agent's thread must end before the interpreter does: its stores' threads abort the process otherwise.
    """
    victims = [pid for pid in descendants() if pid not in spare]
    for pid in victims:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in victims):
        time.sleep(0.05)
    for pid in victims:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s  # a killed process takes a moment to go: leave none behind
    while time.monotonic() < deadline and any(_alive(pid) for pid in victims):
        time.sleep(0.05)
    agent.join(timeout=15)


def descendants() -> list[int]:
    """Live processes below this one (multiprocessing's shared resource tracker excepted)."""
    parent_of = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    tracker = b"resource_tracker" in f.read()
            except OSError:
                continue
            if fields[0] != "Z" and not tracker:
                parent_of[int(entry)] = int(fields[1])
    found, frontier = [], {os.getpid()}
    while frontier:
        children = [pid for pid, ppid in parent_of.items() if ppid in frontier and pid not in found]
        found += children
        frontier = set(children)
    return found


def _signal(pid: int, sig: signal.Signals) -> bool:
    """Send `sig` to `pid` if it lives; whether it did."""
    if not _alive(pid):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
