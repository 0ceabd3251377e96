"""`zerotrain` commands of a shell script, run by zerotrain's entry point in this process rather than in a new one.

A recipe's `zerotrain train` as its own process imports torch twice (the command, then the forkserver its ranks
fork from): about 6 s of CPU on a 2-core machine, for a run that trains in one. The script still runs in bash,
as written; the `zerotrain` it finds first on PATH is a small stdlib-only client. The client sends its argument
list, working folder and environment, and its stdout and stderr descriptors, over a Unix socket to the test's
process, which runs `zerotrain.cli.main.main(argv)` there as the console script would (its folder, its
environment, its output on the client's descriptors, the ranks forked from this process's forkserver) and sends
back the exit code, with which the client exits.

A command given ZEROTRAIN_FAULTS runs as the installed `zerotrain`, a process of its own: a fault may signal the
launcher, and the launcher must then be that command, not the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

ADDRESS_ENV = "ZEROTRAIN_COMMAND_SERVER"
REAL = os.path.join(os.path.dirname(sys.executable), "zerotrain")  # the console script this interpreter installed

CLIENT = f"""\
#!{sys.executable} -IS
import json, os, socket, sys

if "ZEROTRAIN_FAULTS" in os.environ or {ADDRESS_ENV!r} not in os.environ:
    os.execv({REAL!r}, [{REAL!r}, *sys.argv[1:]])
with socket.socket(socket.AF_UNIX) as s:
    s.connect(os.environ[{ADDRESS_ENV!r}])
    socket.send_fds(s, [b"."], [1, 2])
    s.sendall(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode())
    s.shutdown(socket.SHUT_WR)
    code = s.recv(16)
sys.exit(int(code) if code else "zerotrain: the test's command server closed without an exit code")
"""


class CommandServer:
    """Serves the `zerotrain` commands of the scripts run through `run` (one at a time, in this thread: the main
    thread, where a launcher installs its signal handlers). `served` counts the commands run here."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="zt-cmd-", dir="/tmp")  # a Unix socket's path is at most 107 bytes
        os.mkdir(os.path.join(self.folder, "bin"))
        client = os.path.join(self.folder, "bin", "zerotrain")
        with open(client, "w") as f:
            f.write(CLIENT)
        os.chmod(client, 0o755)
        self.address = os.path.join(self.folder, "socket")
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(self.address)
        self.listener.listen()
        self.served = 0

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with the client first on PATH and the server's address."""
        return dict(env, PATH=os.path.join(self.folder, "bin") + os.pathsep + env.get("PATH", ""),
                    **{ADDRESS_ENV: self.address})

    def wait(self, proc: subprocess.Popen, timeout: float) -> bool:
        """Serve `proc`'s commands until it ends (True) or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                return False
            if select.select([self.listener], [], [], 0.05)[0]:
                conn, _ = self.listener.accept()
                with conn:
                    self._serve(conn)
        return True

    def _serve(self, conn: socket.socket) -> None:
        _, fds, _, _ = socket.recv_fds(conn, 1, 2)
        try:
            if len(fds) != 2:  # a client that died as it connected: it gets no code, and bash sees it fail
                return
            request = json.loads(b"".join(iter(lambda: conn.recv(1 << 16), b"")))
            code = run_here(request["argv"], request["cwd"], request["env"], fds[0], fds[1])
        finally:
            for fd in fds:
                os.close(fd)
        self.served += 1
        with contextlib.suppress(OSError):  # a client killed meanwhile (the block's timeout) hears nothing
            conn.sendall(str(code).encode())

    def close(self) -> None:
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def run_here(argv: list[str], cwd: str, env: dict[str, str], stdout_fd: int, stderr_fd: int) -> int:
    """`zerotrain ARGV` by its entry point in this process, in `cwd` with `env`, writing to the two descriptors (the
    launcher's own output and, since ranks write where their launcher writes, the ranks'); its exit code. The
    folder, environment and this process's descriptors are restored after."""
    from zerotrain.cli.main import main
    from zerotrain.runtime.run_folder import release_run_folders

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    out, err = open(stdout_fd, "w", closefd=False), open(stderr_fd, "w", closefd=False)
    try:
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's --help and its errors
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - a console script would print it and exit 1
                traceback.print_exc()
                code = 1
            finally:
                release_run_folders()  # as the end of the command's own process would
                out.flush()
                err.flush()
        return code
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        for fd, saved in zip((1, 2), saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
