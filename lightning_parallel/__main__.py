"""``python -m lightning_parallel`` = the ``lightning-parallel`` command."""

import sys

from lightning_parallel.cli import main

sys.exit(main())
