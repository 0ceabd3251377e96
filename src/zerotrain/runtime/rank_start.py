"""Starting local ranks fast: forked from a server that imported torch once, yet inheriting what a spawned rank would.

A spawned rank imports torch and zerotrain anew, seconds of CPU each; a rank forked from a server that imported them
once starts without that cost (the figures: docs/benchmarks.md). multiprocessing's forkserver is a process started
at the first launch, with the modules below imported; each rank is a fork of it. spawn and forkserver both carry the
launcher's working folder and sys.path to the child; two things a forked rank would otherwise take from the server
rather than from its launcher now are fixed here:

- the environment: the server's is the launcher's as it was when the server started (a variable set since, such as
  ZEROTRAIN_FAULTS for one run, would be missing). `LauncherState` carries the launcher's environment as it is
  now; the elastic agent's own variables (RANK, MASTER_PORT, ...), which it sets in the rank before the job runs,
  are kept: they are what differs from the server's environment.
- stdout and stderr: the server's are the launcher's as they were when it started (a caller that redirected its
  output since, as pytest does per test, would not see the ranks'). The launcher's descriptors themselves are
  sent to the rank (the way multiprocessing sends a pipe), so the rank writes where the launcher writes, sharing
  its file offset as an inherited descriptor does.

The server also outlives a stop signal sent to the launcher's whole process group (a terminal's Ctrl-C, `timeout`,
`kill -TERM -- -PGID`): multiprocessing's server ignores SIGINT but not SIGTERM, and killed it takes with it the
pipe through which the launcher learns its ranks' exit codes, so every rank that saved and exited 0 was reported
as exit code 255. Here it ignores SIGTERM too, and SIGINT from its first import on: multiprocessing ignores SIGINT
only after the preload, whose seconds of imports a Ctrl-C at start-up ended with the server's traceback on the
console. Each rank takes both defaults back as it starts (and its own stop handler after that, stop.py), and the
server still ends when its launcher closes its pipe.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing import forkserver, reduction

from .allocator import huge_pages_environment

START_METHOD = "forkserver"
# This module first (it ignores the stop signals before the slow imports), then torch, what every rank imports, and
# what AdamW imports when first built.
PRELOAD = ["zerotrain.runtime.rank_start", "zerotrain.runtime.launch", "zerotrain.training.loop", "torch._dynamo"]

# In the forkserver, imported before any fork: the environment every rank starts from.
_SERVER_ENV = dict(os.environ)
# Set in the server's environment alone (start_server): the process importing this module with it is the server.
SERVER_FLAG = "ZEROTRAIN_RANK_SERVER"

if os.environ.get(SERVER_FLAG) == "1" and threading.current_thread() is threading.main_thread():
    # a stop signal to the process group is the ranks' to answer
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_server() -> None:
    """Start the server the ranks fork from, unless it runs already: with PRELOAD imported, and with malloc asking
    for huge pages where the kernel gives them on request (allocator.py). The launcher's own environment is left as
    it was, so the ranks' (and what they start) is the launcher's."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    extra = {**huge_pages_environment(), SERVER_FLAG: "1"}
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class LauncherState:
    """What the rank takes from its launcher as it is at launch (pickled with the rank's arguments)."""

    def __init__(self, environ: dict[str, str] | None = None, pid: int | None = None):
        self.environ = dict(os.environ) if environ is None else environ
        self.pid = os.getpid() if pid is None else pid

    def __reduce__(self):
        # DupFd sends the descriptors to the child as multiprocessing sends a pipe's (only while it pickles the
        # child's arguments, which is when this runs)
        return _in_rank, (self.environ, self.pid, reduction.DupFd(1), reduction.DupFd(2))


def _in_rank(environ: dict[str, str], pid: int, stdout, stderr) -> LauncherState:
    """Unpickled in the rank, before the job: the launcher's streams and environment (with the agent's variables),
    and SIGTERM's and SIGINT's defaults, which the server ignores."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout.flush()
    sys.stderr.flush()
    for sent, fd in ((stdout, 1), (stderr, 2)):
        received = sent.detach()
        if received != fd:
            os.dup2(received, fd)
            os.close(received)
    return LauncherState(environ, pid)


def adopt(state: LauncherState) -> None:
    """In the rank: the launcher's environment, with what the elastic agent set in this rank on top."""
    global _launcher_pid
    agent = {k: v for k, v in os.environ.items() if _SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(state.environ)
    os.environ.update(agent)
    _launcher_pid = state.pid


def server_pid() -> int | None:
    """The running server's pid (None before the first launch): the launcher's, kept for its later jobs."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def launcher_pid() -> int:
    """The process that launched this rank: zerotrain's launcher (the forkserver is a rank's parent), or, under
    torchrun, the parent."""
    return _launcher_pid or os.getppid()


_launcher_pid: int | None = None
