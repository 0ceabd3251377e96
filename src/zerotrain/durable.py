"""Whole-or-absent file writes: write a temporary sibling, fsync it (when the file must survive a crash), rename it."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

from zerotrain.errors import ConfigError


def write_atomic(path: str, data: str | bytes, *, durable: bool = True,
                 halfway: Callable[[], None] | None = None) -> None:
    """Replace `path` with `data` in one rename, so a reader sees the old file or the new one, never half of one.

    `durable` fsyncs the bytes before the rename (checkpoint manifests, metrics, cached data); files
    that only need to be whole while their writer lives (a rank's sidecar, a stop request) skip it.
    The temporary name carries the pid, so two processes never write the same one; the file gets
    the umask's mode, as any file the process creates. `halfway`, if given, runs once half of the data is
    written (fault drills: a crash mid-write).
    """
    tmp = f"{path}.{os.getpid()}.part"
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            if halfway is not None:
                f.write(data[: len(data) // 2])
                f.flush()
                halfway()
                data = data[len(data) // 2 :]
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.filename is None:  # a failed write names no file: say which
            raise OSError(e.errno, e.strerror, path) from e
        raise


def write_json(path: str, obj, *, durable: bool = True) -> None:
    """`obj` as indented JSON at `path`, whole or absent."""
    write_atomic(path, json.dumps(obj, indent=1), durable=durable)


def check_writable_beside(path: str, what: str) -> None:
    """ConfigError naming `what` and `path` unless a file can be made beside `path` (in its folder, or the nearest
    folder above it that exists), where a command writes its temporary sibling before renaming it into place: a
    read-only or full file system, or a path below a file, is refused in one line before any work is done."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        if not os.path.isdir(folder):
            raise NotADirectoryError(20, "Not a directory", folder)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".zerotrain-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be written: {e.strerror} ({e.filename or folder})") from None
