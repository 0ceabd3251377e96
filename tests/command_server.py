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

`python3 -c CODE` and `python3 - <<EOF` (and `python`) are served the same way: a recipe's Python that builds a
tiny model imports torch and transformers' model code anew as its own interpreter, about 5 s of CPU each, where
this process has them already. CODE (or the script read from the client's stdin) runs here as `__main__`, with
fresh globals, the script's folder first on sys.path and its argv, and exits as the interpreter would: its
SystemExit's code, 1 after printing the traceback of anything else. Any other interpreter use (`-m`, a script
file, flags) runs as the real interpreter, as does everything under ZEROTRAIN_FAULTS.
"""

from __future__ import annotations

import builtins
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

python = os.path.basename(sys.argv[0]) != "zerotrain"
real = {sys.executable!r} if python else {REAL!r}
served = not python or (len(sys.argv) > 2 and sys.argv[1] == "-c") or (len(sys.argv) > 1 and sys.argv[1] == "-")
if "ZEROTRAIN_FAULTS" in os.environ or {ADDRESS_ENV!r} not in os.environ or not served:
    os.execv(real, [real, *sys.argv[1:]])
with socket.socket(socket.AF_UNIX) as s:
    s.connect(os.environ[{ADDRESS_ENV!r}])
    socket.send_fds(s, [b"."], [0, 1, 2])
    s.sendall(json.dumps({{"python": python, "argv": sys.argv[1:], "cwd": os.getcwd(),
                          "env": dict(os.environ)}}).encode())
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
        for name in ("zerotrain", "python", "python3"):
            client = os.path.join(self.folder, "bin", name)
            with open(client, "w") as f:
                f.write(CLIENT)
            os.chmod(client, 0o755)
        self.address = os.path.join(self.folder, "socket")
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(self.address)
        self.listener.listen()
        self.served = 0

    @property
    def python(self) -> str:
        """The client as `python3`: what a ```python block runs as, so that it too is served here."""
        return os.path.join(self.folder, "bin", "python3")

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
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)
        try:
            if len(fds) != 3:  # a client that died as it connected: it gets no code, and bash sees it fail
                return
            request = json.loads(b"".join(iter(lambda: conn.recv(1 << 16), b"")))
            run = run_python_here if request["python"] else run_here
            code = run(request["argv"], request["cwd"], request["env"], *fds)
        finally:
            for fd in fds:
                os.close(fd)
        self.served += 1
        with contextlib.suppress(OSError):  # a client killed meanwhile (the block's timeout) hears nothing
            conn.sendall(str(code).encode())

    def close(self) -> None:
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def run_here(argv: list[str], cwd: str, env: dict[str, str], stdin_fd: int, stdout_fd: int, stderr_fd: int) -> int:
    """`zerotrain ARGV` by its entry point in this process, in `cwd` with `env`, writing to the two descriptors (the
    launcher's own output and, since ranks write where their launcher writes, the ranks'); its exit code. The
    folder, environment and this process's descriptors are restored after."""
    from zerotrain.cli.main import main
    from zerotrain.runtime.run_folder import release_run_folders

    def command() -> int:
        try:
            return main(argv)
        finally:
            release_run_folders()  # as the end of the command's own process would

    return in_their_place(command, cwd, env, stdout_fd, stderr_fd)


def run_python_here(argv: list[str], cwd: str, env: dict[str, str], stdin_fd: int, stdout_fd: int,
                    stderr_fd: int) -> int:
    """`python3 -c CODE ARGS` or `python3 - ARGS` (the script on `stdin_fd`) run in this process as `__main__`, in
    `cwd` with `env`, writing to the two descriptors; its exit code. sys.argv and sys.path are restored after."""
    if argv[0] == "-c":
        source, args, name = argv[1], ["-c", *argv[2:]], "<string>"
    else:
        with open(stdin_fd, closefd=False) as stdin:
            source, args, name = stdin.read(), argv, "<stdin>"
    saved_argv, saved_path = sys.argv, list(sys.path)

    def script() -> int:
        sys.argv = args
        sys.path.insert(0, cwd)  # where the interpreter puts '' for -c and -
        try:
            exec(compile(source, name, "exec"), {"__name__": "__main__", "__builtins__": builtins})
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
        return 0

    return in_their_place(script, cwd, env, stdout_fd, stderr_fd)


def in_their_place(run, cwd: str, env: dict[str, str], stdout_fd: int, stderr_fd: int) -> int:
    """`run()` in `cwd` with `env`, writing to the two descriptors; its exit code as a process's would be (SystemExit's
    code; 1, with the traceback printed, for any other exception). The folder, environment and this process's
    descriptors are restored after."""
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
                code = run()
            except SystemExit as e:  # argparse's --help and its errors, a script's exit
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)  # as the interpreter does with SystemExit("message")
            except BaseException:  # noqa: BLE001 - a console script would print it and exit 1
                traceback.print_exc()
                code = 1
            finally:
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
