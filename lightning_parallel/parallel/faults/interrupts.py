"""SIGTERM and Ctrl-C as a preemption: stop every rank at the same step boundary, with a checkpoint, instead of
wherever each rank happens to be -- and never in the middle of a save.

Lightning handles SIGTERM (SLURM's preemption signal) that way: the signal sets ``trainer.received_sigterm``, the flag
is agreed on at the next step boundary, and all ranks raise ``SIGTERMException`` together, so
:class:`~lightning_parallel.callbacks.PreemptionCheckpoint` saves one consistent checkpoint (a collective under
sharded strategies). But Lightning's handler also runs a ``broadcast`` *inside the signal handler*, wherever the
process is: in the middle of a checkpoint save (a DCP folder's collectives, an ``all_gather_object``) that broadcast
pairs with another collective of a peer, the ranks' collectives go out of step (gloo: "Received data size doesn't
match expected size"), a rank aborts and no preemption checkpoint is written. :func:`install` (each rank, when
training starts; main thread only) replaces it with a handler that only sets the flag and forwards the signal to the
ranks this process started, as Lightning's does: a save in progress finishes, and every rank stops at the next step
boundary.

Ctrl-C raises ``KeyboardInterrupt`` in each rank at an arbitrary point; a save then would start collectives that the
other ranks never join. :func:`install` makes the first SIGINT set the same flag, so Ctrl-C follows SIGTERM's path; a
second Ctrl-C raises ``KeyboardInterrupt`` at once. :func:`uninstall` (teardown) puts the previous handlers back.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["install", "uninstall"]

_PREVIOUS: Any = None
_PREVIOUS_TERM: Any = None
_INSTALLED = False


def install(trainer: Any, request_stop: Callable[[], None] | None = None) -> None:
    """Route this process's SIGTERM and next SIGINT to a stop at the next step boundary, with no collective in the
    handler (no-op off the main thread): ``request_stop()`` when given (the ranks then agree on the stop in a
    collective of their own at a step boundary: a rank never stops alone because its signal came a moment earlier),
    else ``trainer``'s SIGTERM flag (Lightning's path)."""
    global _PREVIOUS, _PREVIOUS_TERM, _INSTALLED
    if threading.current_thread() is not threading.main_thread() or _INSTALLED:
        return
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None:
        return

    asked = {"stop": False}

    def stop() -> None:
        asked["stop"] = True
        if request_stop is not None:
            request_stop()
        else:
            connector.received_sigterm = True

    def handler(signum: int, frame: FrameType | None) -> None:
        if asked["stop"] or connector.received_sigterm:  # the second Ctrl-C: stop now
            uninstall()
            raise KeyboardInterrupt
        stop()
        if getattr(trainer, "is_global_zero", False):
            print("lightning-parallel: Ctrl-C: every rank stops at the next step boundary and saves a checkpoint "
                  "(with PreemptionCheckpoint); press Ctrl-C again to stop at once", file=sys.stderr,
                  flush=True)

    def term_handler(signum: int, frame: FrameType | None) -> None:
        first = not (asked["stop"] or connector.received_sigterm)
        stop()
        if not first:
            return
        launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
        kill = getattr(launcher, "kill", None)
        if callable(kill):  # the ranks this process started get the signal too (as Lightning's handler does)
            try:
                kill(signum)
            except Exception:
                pass
        if getattr(trainer, "is_global_zero", False):
            # the launcher of forked/spawned ranks sends SIGTERM to the others when one rank fails: say both causes
            print("lightning-parallel: SIGTERM (a preemption, or the launcher ending the ranks after one failed: its "
                  "error follows): a save in progress finishes, then every rank stops at the next step boundary and "
                  "saves a checkpoint (with PreemptionCheckpoint)", file=sys.stderr, flush=True)

    _PREVIOUS = signal.getsignal(signal.SIGINT)
    _PREVIOUS_TERM = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, term_handler)
    _INSTALLED = True


def uninstall() -> None:
    """Restore the SIGINT and SIGTERM handlers :func:`install` replaced."""
    global _PREVIOUS, _PREVIOUS_TERM, _INSTALLED
    if not _INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _PREVIOUS if _PREVIOUS is not None else signal.default_int_handler)
    signal.signal(signal.SIGTERM, _PREVIOUS_TERM if _PREVIOUS_TERM is not None else signal.SIG_DFL)
    _PREVIOUS, _PREVIOUS_TERM, _INSTALLED = None, None, False
