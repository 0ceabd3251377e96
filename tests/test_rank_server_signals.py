"""The ranks' server (runtime/rank_start.py) outlives a Ctrl-C at start-up: multiprocessing's forkserver ignores
SIGINT only after its preload, seconds of imports (torch, zerotrain), and a Ctrl-C then ended the server with its
traceback on the user's console. Here the server sends SIGINT to itself during its preload (tests/sigint_on_import.py,
a Ctrl-C delivered at that moment, no timing involved): it starts a rank all the same, with no traceback, and the
rank has SIGINT's and SIGTERM's defaults back. Planted: the preload as it was (rank_start's ignore not first)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)
SCRIPT = """
import multiprocessing, signal, sys
# SIGINT's default, as a terminal gives it: a shell's background job starts with SIGINT ignored, and a process
# started ignoring it (the server, by exec) never sees the Ctrl-C this test sends
signal.signal(signal.SIGINT, signal.default_int_handler)
import sigint_on_import
import zerotrain.runtime.rank_start as r
rest = [m for m in r.PRELOAD if m != "zerotrain.runtime.rank_start"]
r.PRELOAD = (["sigint_on_import"] if sys.argv[1] == "planted" else [r.PRELOAD[0], "sigint_on_import"]) + rest
r.start_server()
rank = multiprocessing.get_context("forkserver").Process(target=sigint_on_import.report_handlers,
                                                         args=(r.LauncherState(),))
rank.start()
rank.join(120)
print("rank exit code", rank.exitcode)
"""


def server_run(order: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    return subprocess.run([sys.executable, "-c", SCRIPT, order], env=env, capture_output=True, text=True, timeout=150)


def test_a_ctrl_c_while_the_server_imports_leaves_it_serving_and_the_rank_takes_the_defaults_back():
    from sigint_on_import import SERVER_FLAG
    from zerotrain.runtime import rank_start
    assert SERVER_FLAG == rank_start.SERVER_FLAG
    run = server_run("product")
    assert run.stdout.strip() == "rank exit code 0", run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr, run.stderr
    planted = server_run("planted")
    assert "KeyboardInterrupt" in planted.stderr and "rank exit code 0" not in planted.stdout, planted.stdout
