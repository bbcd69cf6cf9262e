"""``PeriodicCheckpoint``: a checkpoint every N optimizer steps and/or every M minutes, written in the background.

Each save writes ``<dirpath>/step=<global step>.ckpt`` in the strategy's own format (one file, an ``lp_sharded``
folder, a DCP folder), atomically (``<name>.partial``, then a rename) and checksummed as every save of the library.
With ``async_save=True`` (the default) the step waits only for the collectives of the save and the copy of each
rank's state to host memory; the files are written by a background thread while training continues
(:mod:`lightning_parallel.checkpoint.async_save`). At most one save is in flight: a save that comes due while the
previous one is still being written waits for it first (and raises its failure). When training ends the save in
flight is waited for; a failure in the background is raised there, not lost.

The ``keep`` newest complete checkpoints are kept; older ones are removed once a newer one is complete (never
before: a failure in the middle of a save always leaves the previous checkpoint). ``--ckpt_path last`` (and every
elastic restart) resumes from the newest complete one. Lost work when a rank fails: the steps since the newest
*complete* checkpoint -- at most one interval, plus the steps run while a save was still being written (that save's
``.partial`` is discarded).

On a preemption (SIGTERM, Ctrl-C: every rank stops at the same step) the save in flight is finished and one more is
written synchronously at the step of the stop; after any other failure nothing is saved (a save would start
collectives a lost rank never joins).

In a recipe::

    trainer:
      callbacks:
        - class_path: lightning_parallel.callbacks.PeriodicCheckpoint
          init_args: {dirpath: runs/x/checkpoints, every_n_steps: 100, every_n_minutes: 30, keep: 2}
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_parallel.checkpoint import async_save as background
from lightning_parallel.checkpoint.names import OLD_SUFFIX, PARTIAL_SUFFIX

__all__ = ["PeriodicCheckpoint"]

_NAME = re.compile(r"^step=(\d+)\.ckpt$")


class PeriodicCheckpoint(Callback):
    """A checkpoint every ``every_n_steps`` optimizer steps and/or ``every_n_minutes`` minutes (see the module).

    Args:
        dirpath: the folder of the checkpoints; default ``<trainer.default_root_dir>/checkpoints``.
        every_n_steps: save when the global step is a multiple of it.
        every_n_minutes: save when this much wall time has passed since the previous save (rank 0's clock decides;
            one small broadcast per step).
        keep: how many of the newest complete checkpoints to keep (>= 1).
        async_save: write the files in the background (the step waits only for the copy to host memory); False
            writes them in the step, as ``ModelCheckpoint`` does.
        save_on_train_end: one more save (synchronous) when training ends, unless the last step was just saved.
    """

    def __init__(self, dirpath: str | Path | None = None, *, every_n_steps: int | None = None,
                 every_n_minutes: float | None = None, keep: int = 2, async_save: bool = True,
                 save_on_train_end: bool = True) -> None:
        if every_n_steps is None and every_n_minutes is None:
            raise ValueError("PeriodicCheckpoint needs every_n_steps, every_n_minutes or both.")
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or int(every_n_steps) < 1):
            raise ValueError(f"PeriodicCheckpoint(every_n_steps={every_n_steps!r}) must be a positive integer.")
        if every_n_minutes is not None and not float(every_n_minutes) > 0:
            raise ValueError(f"PeriodicCheckpoint(every_n_minutes={every_n_minutes!r}) must be positive.")
        if int(keep) < 1:
            raise ValueError(f"PeriodicCheckpoint(keep={keep!r}) must be at least 1 (the newest complete checkpoint).")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every_n_steps = int(every_n_steps) if every_n_steps is not None else None
        self.every_n_minutes = float(every_n_minutes) if every_n_minutes is not None else None
        self.keep = int(keep)
        self.async_save = bool(async_save)
        self.save_on_train_end = bool(save_on_train_end)
        self.writer = background.process_writer()
        self.step_waits: list[float] = []
        """Seconds each save held the training step (the collectives and the copy; all of it when synchronous)."""
        self.saved_steps: list[int] = []
        self._last_step = -1
        self._last_save_time = time.monotonic()

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=str(self.dirpath), every_n_steps=self.every_n_steps,
                                        every_n_minutes=self.every_n_minutes)

    # ------------------------------------------------------------------ where
    def folder(self, trainer: pl.Trainer) -> Path:
        return self.dirpath if self.dirpath is not None else Path(trainer.default_root_dir) / "checkpoints"

    def path_for(self, trainer: pl.Trainer, step: int) -> Path:
        return self.folder(trainer) / f"step={step}.ckpt"

    def complete_checkpoints(self, trainer: pl.Trainer) -> list[Path]:
        """This callback's complete checkpoints in the folder, oldest first (no ``.partial``, no save in flight)."""
        folder = self.folder(trainer)
        if not folder.is_dir():
            return []
        in_flight = self.writer.target if self.writer.in_flight else None
        found = [p for p in folder.iterdir() if _NAME.match(p.name) and str(p) != in_flight
                 and not p.name.endswith((PARTIAL_SUFFIX, OLD_SUFFIX))]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))  # type: ignore[union-attr]

    # ------------------------------------------------------------------ when
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        self._last_save_time = time.monotonic()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # an accumulation batch: no optimizer step since the last call
            return
        self._last_step = step
        due = self.every_n_steps is not None and step % self.every_n_steps == 0
        if self.every_n_minutes is not None:
            late = time.monotonic() - self._last_save_time >= 60.0 * self.every_n_minutes
            due = bool(trainer.strategy.broadcast(due or late))  # rank 0's clock: every rank saves, or none
        if due:
            self.save(trainer, step)

    # ------------------------------------------------------------------ the save
    def save(self, trainer: pl.Trainer, step: int, *, in_background: bool | None = None) -> Path:
        """Save at ``step`` (every rank calls it; ``in_background`` defaults to ``async_save``); returns the path."""
        in_background = self.async_save if in_background is None else in_background
        start = time.perf_counter()
        self._wait(trainer)  # at most one in flight; raises the previous one's failure, on every rank
        self._prune(trainer)
        path = self.path_for(trainer, step)
        if in_background:
            with background.deferred(self.writer):
                trainer.save_checkpoint(path)
        else:
            trainer.save_checkpoint(path)
        self.step_waits.append(time.perf_counter() - start)
        self.saved_steps.append(step)
        self._last_save_time = time.monotonic()
        return path

    def _wait(self, trainer: pl.Trainer) -> None:
        """Wait for this process's save in flight (a collective): if its background part failed on any rank, every
        rank raises -- the failing one its :class:`~lightning_parallel.checkpoint.async_save.BackgroundSaveError`,
        the others an error naming that rank -- so none goes on into a save the others left."""
        from lightning_parallel.checkpoint.formats.common import agree_on_failure

        error: BaseException | None = None
        try:
            self.writer.wait()
        except background.BackgroundSaveError as err:
            error = err
        agree_on_failure(trainer.strategy, error)  # type: ignore[arg-type]  # every Lightning strategy has them

    def _prune(self, trainer: pl.Trainer) -> None:
        """Remove all but the ``keep`` newest complete checkpoints (every rank calls; the strategy's rank 0 acts)."""
        done = self.complete_checkpoints(trainer)
        for old in done[:-self.keep] if len(done) > self.keep else []:
            trainer.strategy.remove_checkpoint(old)

    # ------------------------------------------------------------------ the end
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._wait(trainer)  # a failure in the background is raised here, on every rank
        if self.save_on_train_end and trainer.global_step not in self.saved_steps and trainer.global_step > 0:
            self.save(trainer, trainer.global_step, in_background=False)
        self._prune(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A preemption (every rank stopped at the same step): finish the save in flight, then save this step. Any
        other failure: nothing (a lost rank would never join the save's collectives)."""
        if not isinstance(exception, SIGTERMException):
            return
        try:
            self.writer.wait()
        except background.BackgroundSaveError as err:
            if trainer.is_global_zero:
                print(f"lightning-parallel: {err}", flush=True)
        if trainer.global_step not in self.saved_steps:
            self.save(trainer, trainer.global_step, in_background=False)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"saved_steps": list(self.saved_steps[-8:])}
