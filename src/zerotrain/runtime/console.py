"""The console is best-effort: a reader that went away never ends a run, which may be saving.

A terminal's Ctrl-C reaches the whole foreground pipeline: `zerotrain train ... | tee run.log` loses `tee` at the
moment the launcher and its ranks start to finish their step and save. Their next line to the console (the launcher's
"SIGINT received", rank 0's progress bar) then raised BrokenPipeError: the rank failed after its save, its peer waited
in a collective, and the launcher aborted in its signal handler. Here a stream whose reader is gone is pointed at
/dev/null instead, once, and the run goes on; its record is the metrics file and the logs, not the console.
"""

from __future__ import annotations

import contextlib
import os
import sys


class _Tolerant:
    """A text stream whose writes and flushes outlive the reader: after a broken pipe, its descriptor is /dev/null."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._discard()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._discard()

    def _discard(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())  # what the stream still buffers, and C code's writes, go there too
        finally:
            os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def console_outlives_its_reader():
    """Within: sys.stdout and sys.stderr survive a reader that went away (see the module docstring)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (s if isinstance(s, _Tolerant) else _Tolerant(s) for s in saved)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
