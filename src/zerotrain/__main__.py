"""Run the zerotrain command line: python -m zerotrain."""

import sys

from zerotrain.cli.main import main

sys.exit(main())
