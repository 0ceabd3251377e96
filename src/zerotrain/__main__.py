"""Run the zerotrain command line: python -m zerotrain."""

import sys

from .cli import main

sys.exit(main())
