"""Run the zerotrain command line: python -m zerotrain."""

import sys

from zerotrain.cli.entry import run

sys.exit(run())
