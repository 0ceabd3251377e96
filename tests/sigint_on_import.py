"""Imported in the ranks' server before its slow imports (tests/test_rank_server_signals.py): a Ctrl-C delivered then,
the server sending SIGINT to itself as a terminal would; and what a rank reports of its signal handlers."""

import os
import signal
import sys

# rank_start.SERVER_FLAG, spelled out: importing rank_start here would install what the test checks
SERVER_FLAG = "ZEROTRAIN_RANK_SERVER"

if os.environ.get(SERVER_FLAG) == "1":
    os.kill(os.getpid(), signal.SIGINT)


def report_handlers(state) -> None:
    """In a rank: exit 0 when SIGINT and SIGTERM are Python's defaults again (the server ignores both)."""
    ok = signal.getsignal(signal.SIGINT) is signal.default_int_handler and \
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    sys.exit(0 if ok else 3)
