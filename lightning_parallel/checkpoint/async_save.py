"""Checkpoints written in the background: the state is copied to host memory while the step waits, the files are
written by a thread while training goes on -- atomic and checksummed as a synchronous save is.

A save started inside :func:`deferred` (what :class:`~lightning_parallel.callbacks.PeriodicCheckpoint` does with
``async_save=True``) runs in two parts on every rank:

1. **in the step** (the caller waits): the collectives of the format (every rank's RNG states gathered, the target
   broadcast, the ``<name>.partial`` folder made) and a copy of this rank's tensors to host memory
   (:func:`host_copy`; DCP folders: ``torch.distributed.checkpoint.async_save`` stages them itself);
2. **in a background thread** (one per process): the files written into ``<name>.partial``, the ranks joined on a
   separate gloo process group (so the thread never shares the training's communicator), then rank 0 writes the
   metadata and the checksum manifest last and renames the folder into place -- the same order as a synchronous
   save, so a crash leaves ``<name>.partial`` and the previous checkpoint whole.

At most one save is in flight per process: every save -- background or not, by any caller -- first waits for the
previous one (:func:`before_save`). A failure in the background is raised, as :class:`BackgroundSaveError`, by the
next save or by :meth:`AsyncWriter.wait` (the callback calls it when training ends), never lost. What a save costs
the step is the copy (``host_copy``: memory bandwidth, the rank's checkpoint size in host memory while it is
written); what the thread takes (serialisation, the disk, the CRC-32 manifest) overlaps the following steps.

``lp_zero_offload`` (DeepSpeed's folders) always saves synchronously.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import CheckpointFormatError

__all__ = ["AsyncWriter", "BackgroundSaveError", "before_save", "deferred", "host_copy", "process_writer"]


class BackgroundSaveError(CheckpointFormatError):
    """A checkpoint written in the background failed; raised by the next save or when training ends."""


class AsyncWriter:
    """This process's background checkpoint writer: one thread at a time, its error kept for the next caller."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._target: str | None = None
        self._group: Any = None
        self._group_world: int | None = None
        self.started_at: float | None = None
        self.last_duration: float | None = None
        """Seconds the previous background part took (thread start to end)."""
        self.durations: list[float] = []
        """Seconds each background part of this process took, in order."""
        self.completed: list[str] = []
        """Targets written completely, in order (this process's view)."""

    # ------------------------------------------------------------------ the writer's own process group
    def group(self, timeout: timedelta | None = None) -> Any:
        """A gloo process group over every rank for the thread's barriers and DCP's coordination (created on the
        first background save: a collective, which every rank's save reaches at the same point)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        if self._group is None or self._group_world != world:
            self._group = dist.new_group(backend="gloo", timeout=timeout or timedelta(minutes=30))
            self._group_world = world
        return self._group

    def barrier(self) -> None:
        """All ranks' background parts reach this point (on the writer's group; no-op without one)."""
        if self._group is not None:
            dist.barrier(group=self._group)

    def agree(self, error: BaseException | None, *, cleanup: Any = None) -> None:
        """In the background part, on every rank (a collective on the writer's group): each rank passes what its own
        part raised (or None); when any rank failed, rank 0 removes ``cleanup`` (the ``.partial`` folder) and every
        rank's part raises -- so no rank's thread waits at the next barrier for one that gave up, and every rank's
        next save (or the end of training) reports the failure."""
        if self._group is not None:
            gathered: list[Any] = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(gathered, None if error is None else f"{type(error).__name__}: {error}",
                                   group=self._group)
            failed = [(rank, text) for rank, text in enumerate(gathered) if text is not None]
            first = dist.get_rank() == 0
        else:
            failed, first = ([] if error is None else [(0, None)]), True
        if not failed:
            return
        if cleanup is not None and first:
            from .atomic import remove_path

            with contextlib.suppress(OSError):
                remove_path(cleanup)
        if error is not None:
            raise error
        rank, text = failed[0]
        raise CheckpointFormatError(f"rank {rank}'s part of the background save failed ({text}); this rank's part "
                                    "stops with it.")

    # ------------------------------------------------------------------ jobs
    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def target(self) -> str | None:
        """What the save in flight (or the last one) writes."""
        return self._target

    def submit(self, target: str, job: Callable[[], None]) -> None:
        """Run ``job`` (the background part of the save of ``target``) in a daemon thread, after the previous one."""
        self.wait()
        self._target, self._error = str(target), None
        self.started_at = time.monotonic()

        def run() -> None:
            try:
                job()
                self.completed.append(str(target))
            except BaseException as err:  # kept for the next caller: a thread's exception would otherwise vanish
                self._error = err
            finally:
                self.last_duration = time.monotonic() - (self.started_at or time.monotonic())
                self.durations.append(self.last_duration)

        self._thread = threading.Thread(target=run, name="lightning-parallel-checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight; raise its failure (:class:`BackgroundSaveError`), once. Returns False when
        ``timeout`` passed first (the save is still running)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise BackgroundSaveError(f"the background save of {self._target} failed: {type(err).__name__}: "
                                      f"{first}; nothing was written under its name (the previous checkpoint is "
                                      "whole).") from err
        return True


_WRITER = AsyncWriter()
_DEFERRING: list[AsyncWriter] = []


def process_writer() -> AsyncWriter:
    """This process's writer (one per process: at most one save in flight, whoever started it)."""
    return _WRITER


@contextlib.contextmanager
def deferred(writer: AsyncWriter | None = None) -> Generator[AsyncWriter, None, None]:
    """Saves started inside write their files in the background (see the module)."""
    writer = writer or _WRITER
    _DEFERRING.append(writer)
    try:
        yield writer
    finally:
        _DEFERRING.remove(writer)


def before_save() -> AsyncWriter | None:
    """Called first by every format's save, on every rank: waits for this process's save in flight (raising its
    failure), and returns the writer when this save is to run in the background (inside :func:`deferred`), else
    None (a synchronous save)."""
    _WRITER.wait()
    if _DEFERRING:
        writer = _DEFERRING[-1]
        if writer is not _WRITER:
            writer.wait()
        return writer
    return None


def host_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to host memory (a new storage, also for tensors already on the CPU: training
    changes the originals in place while the copy is written); containers rebuilt, other values shared."""
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            obj = obj.to_local()
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        items = [(k, host_copy(v)) for k, v in obj.items()]
        try:
            rebuilt: Any = type(obj)
            return rebuilt(items)
        except Exception:
            return dict(items)
    if isinstance(obj, list):
        return [host_copy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(host_copy(v) for v in obj)
    return obj
