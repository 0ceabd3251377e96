"""Python code run in a child forked from the test's process, as `python -c CODE` would run it in a fresh one.

A fresh interpreter spends 2-3 s of CPU importing zerotrain and torch to run a few lines; the test's process has
imported them already, and a forked child starts in milliseconds. For code that a fresh interpreter's state does not
change: the child inherits what the test's process imported and set (a planted bug included, which is then the
product's own function, patched). Not for code that computes with torch: the thread pool of torch's CPU kernels does
not survive a fork (a matmul in the child can hang), which is why ranks start from a server that never computed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback


class ForkedChild:
    """`code` run as `python -c CODE ARGV` would run it, in a child forked from this process, its stdout and stderr
    piped back, with the Popen methods the tests use."""

    def __init__(self, code: str, *argv: str):
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: it never returns into pytest
            status = 1
            try:
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                for fd in (out_r, out_w, err_r, err_w):
                    os.close(fd)
                # as in a fresh interpreter writing to pipes: stdout block-buffered, stderr line-buffered
                sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", buffering=1, closefd=False)
                sys.argv = ["-c", *argv]
                exec(compile(textwrap.dedent(code), "<child>", "exec"), {"__name__": "__main__"})
                status = 0
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else 1 if e.code else 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        os.close(out_w)
        os.close(err_w)
        self.stdout, self.stderr = open(out_r), open(err_r)
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["<forked child>"], timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        if self.poll() is None:
            self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float) -> tuple[str, str]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait(30)
            raise
        finally:
            out, err = self.stdout.read(), self.stderr.read()
            self.stdout.close()
            self.stderr.close()
        return out, err


def run_forked(code: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`code` run in a ForkedChild to its end: exit code (minus the signal that killed it), stdout and stderr."""
    child = ForkedChild(code, *argv)
    out, err = child.communicate(timeout)
    return subprocess.CompletedProcess(["<forked child>", *argv], child.returncode, out, err)
