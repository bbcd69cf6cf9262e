"""Ctrl-C as a preemption: stop every rank at the same step boundary, with a checkpoint, instead of wherever each
rank happens to be.

Lightning handles SIGTERM (SLURM's preemption signal) that way: the signal sets ``trainer.received_sigterm``, rank 0's
flag is broadcast at the start of every training step, and all ranks raise ``SIGTERMException`` together, so
:class:`~lightning_parallel.callbacks.PreemptionCheckpoint` saves one consistent checkpoint (a collective under
sharded strategies).
Ctrl-C, though, raises ``KeyboardInterrupt`` in each rank at an arbitrary point; a save then would start collectives
that the other ranks never join. :func:`install` (each rank, when training starts; main thread only) makes the first
SIGINT set the same flag, so Ctrl-C follows SIGTERM's path; a second Ctrl-C raises ``KeyboardInterrupt`` at once.
:func:`uninstall` (teardown) puts the previous handler back.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

__all__ = ["install", "uninstall"]

_PREVIOUS: Any = None
_INSTALLED = False


def install(trainer: Any) -> None:
    """Route this process's next SIGINT to ``trainer``'s SIGTERM flag (no-op off the main thread)."""
    global _PREVIOUS, _INSTALLED
    if threading.current_thread() is not threading.main_thread() or _INSTALLED:
        return
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None:
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if connector.received_sigterm:  # the second Ctrl-C: stop now
            uninstall()
            raise KeyboardInterrupt
        connector.received_sigterm = True
        if getattr(trainer, "is_global_zero", False):
            print("lightning-parallel: Ctrl-C: every rank stops at the next step boundary and saves a checkpoint "
                  "(with PreemptionCheckpoint); press Ctrl-C again to stop at once", file=sys.stderr,
                  flush=True)

    _PREVIOUS = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, handler)
    _INSTALLED = True


def uninstall() -> None:
    """Restore the SIGINT handler :func:`install` replaced."""
    global _PREVIOUS, _INSTALLED
    if not _INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _PREVIOUS if _PREVIOUS is not None else signal.default_int_handler)
    _PREVIOUS, _INSTALLED = None, False
