"""A Ctrl-C while the `zerotrain` command still imports torch (its first seconds) ends it with one line and exit code
130, as one later does, not a traceback: the console script's entry (cli/entry.py) is light and catches it. The
interrupt is delivered deterministically: a `torch` found first on the path raises KeyboardInterrupt as it is
imported. Planted: the entry as it was (zerotrain.cli.main:main, importing torch before any handler) prints the
traceback."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def interrupted_at_import(tmp_path, entry: str) -> subprocess.CompletedProcess:
    """`zerotrain train --help` through `entry` (module:function, as a console script calls it), with torch's import
    interrupted."""
    (tmp_path / "torch").mkdir(exist_ok=True)
    (tmp_path / "torch" / "__init__.py").write_text("raise KeyboardInterrupt  # a Ctrl-C while torch is imported\n")
    module, function = entry.split(":")
    code = f"import sys\nfrom {module} import {function}\nsys.argv[0] = 'zerotrain'\nsys.exit({function}())"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    return subprocess.run([sys.executable, "-c", code, "train", "--help"], env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_ctrl_c_while_the_command_imports_torch_is_one_line_and_exit_130(tmp_path):
    script, = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "zerotrain"]
    run = interrupted_at_import(tmp_path, script.value)
    assert (run.returncode, run.stderr) == (130, "zerotrain: interrupted\n"), run.stderr
    planted = interrupted_at_import(tmp_path, "zerotrain.cli.main:main")
    assert planted.returncode != 130 and "Traceback" in planted.stderr
