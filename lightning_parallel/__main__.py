"""``python -m lightning_parallel`` = the ``lightning-parallel`` command."""

from lightning_parallel.cli import entry

entry()
