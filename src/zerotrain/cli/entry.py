"""The `zerotrain` command's entry point (and `python -m zerotrain`'s): light to import, so that a Ctrl-C while the
command line still imports torch (seconds) ends it with main's one line and exit code 130, not a traceback."""

from __future__ import annotations

import sys


def run() -> int:
    try:
        from zerotrain.cli.main import main
        return main()
    except KeyboardInterrupt:  # before main's own handling begins (its imports); main says the same after that
        print("zerotrain: interrupted", file=sys.stderr)
        return 130
