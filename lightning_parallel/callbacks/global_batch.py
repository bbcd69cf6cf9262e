"""``GlobalBatch``: ``parallel.global_batch_size`` samples per optimizer step on any data-parallel size.

The library's strategies apply it before any rank starts (:func:`apply_global_batch`, from the checked launchers):
with the per-rank batch ``b`` (the data module's ``batch_size``) and the layout's ``dp``, the Trainer's
``accumulate_grad_batches`` becomes ``global_batch_size / (b x dp)``
(:func:`~lightning_parallel.elastic.accumulation_for`), and a world where that is not a whole number is refused with
the arithmetic. The callback it adds then

* records ``{global_batch_size, micro_batch_size, data_parallel_size, accumulate_grad_batches}`` in every checkpoint;
* when a checkpoint written under another accumulation is resumed (an elastic restart on fewer or more nodes), moves
  Lightning's batch counters of the epoch to the same optimizer step under this run's accumulation
  (``batches = steps x accumulate_grad_batches``), so the loop's accumulation boundaries and the epoch's end fall
  where they should. The data module's position is kept in samples
  (:class:`~lightning_parallel.data.ResumableDataModuleMixin`), so it maps onto any dp size by itself.

A checkpoint taken in the middle of an accumulation (not on an optimizer step) cannot continue under another
accumulation: resuming it so is refused.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_parallel.config import LayoutError
from lightning_parallel.elastic import accumulation_for

__all__ = ["GlobalBatch", "apply_global_batch", "per_rank_batch_size"]

_BATCH_PROGRESS = "epoch_loop.batch_progress"


class GlobalBatch(Callback):
    """Keeps the global batch of ``parallel.global_batch_size`` (added by the strategies; see the module)."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 accumulate_grad_batches: int) -> None:
        self.global_batch_size = int(global_batch_size)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_size = int(data_parallel_size)
        self.accumulate_grad_batches = int(accumulate_grad_batches)

    def describe(self) -> str:
        return (f"global batch {self.global_batch_size} = batch_size {self.micro_batch_size} x dp "
                f"{self.data_parallel_size} x accumulate_grad_batches {self.accumulate_grad_batches}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size,
                "data_parallel_size": self.data_parallel_size,
                "accumulate_grad_batches": self.accumulate_grad_batches}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            print(f"lightning-parallel: {self.describe()}", flush=True)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Runs before Lightning restores its loops: their batch counters are moved to this run's accumulation."""
        saved = (checkpoint.get("callbacks") or {}).get(self.state_key)
        if not isinstance(saved, dict):
            return
        before = int(saved.get("accumulate_grad_batches", self.accumulate_grad_batches))
        if before == self.accumulate_grad_batches:
            return
        fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
        progress = fit_loop.get(_BATCH_PROGRESS)
        if not isinstance(progress, dict):
            return
        done = int(progress["current"]["processed"])
        if done % before:
            raise LayoutError(
                f"the checkpoint was saved after {done} batches of its epoch under accumulate_grad_batches={before}, "
                f"in the middle of an optimizer step ({done} % {before} = {done % before}); it resumes only under "
                f"the same accumulation. Fix: resume it on a world of the same data-parallel size "
                f"({saved.get('data_parallel_size')}), or from a checkpoint taken on an optimizer step."
            )
        shift = done // before * self.accumulate_grad_batches - done
        for part in ("current", "total"):
            for key, value in list(progress[part].items()):
                progress[part][key] = max(0, int(value) + shift)
        if trainer.is_global_zero:
            print(f"lightning-parallel: the checkpoint's step {done // before} of the epoch was taken under "
                  f"accumulate_grad_batches={before} (dp {saved.get('data_parallel_size')}); it continues under "
                  f"{self.accumulate_grad_batches} (dp {self.data_parallel_size}): {self.describe()}", flush=True)


def per_rank_batch_size(trainer: Any, args: tuple[Any, ...]) -> int | None:
    """The per-rank batch size of the fit: the ``batch_size`` of the data module (attribute or hyper-parameter) or
    of the training DataLoader among ``trainer.fit``'s arguments; None when none says."""
    candidates: list[Any] = [a for a in args if isinstance(a, (pl.LightningDataModule, DataLoader))]
    if trainer is not None and trainer.datamodule is not None:
        candidates.append(trainer.datamodule)
    for obj in candidates:
        value = getattr(obj, "batch_size", None)
        if value is None:
            hparams = getattr(obj, "hparams", None)
            value = hparams.get("batch_size") if hparams is not None and hasattr(hparams, "get") else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def apply_global_batch(strategy: Any, trainer: Any, args: tuple[Any, ...]) -> GlobalBatch | None:
    """Before the ranks start (every fit): set ``trainer.accumulate_grad_batches`` for the layout's
    ``global_batch_size`` and add :class:`GlobalBatch`; refuse, with the arithmetic, what cannot keep it. Returns the
    callback (None when the layout sets no global batch)."""
    layout = getattr(strategy, "layout", None)
    global_batch = getattr(layout, "global_batch_size", None)
    if global_batch is None or trainer is None:
        return None
    micro = per_rank_batch_size(trainer, args)
    if micro is None:
        raise LayoutError(
            f"parallel.global_batch_size={global_batch} needs the per-rank batch size to set the accumulation, but "
            "neither the data module nor the training DataLoader has an integer `batch_size`. Fix: give the data "
            "module a `batch_size` attribute, or remove parallel.global_batch_size and set "
            "trainer.accumulate_grad_batches yourself."
        )
    dp = int(strategy.dims.dp)
    accumulate = accumulation_for(global_batch, micro, dp)
    if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
        raise LayoutError(f"parallel.global_batch_size={global_batch} sets accumulate_grad_batches from the world "
                          "size, and a GradientAccumulationScheduler changes it per epoch. Fix: keep one of them.")
    mine = [c for c in trainer.callbacks if isinstance(c, GlobalBatch)]
    given = int(trainer.accumulate_grad_batches)
    if given not in (1, accumulate) and not any(c.accumulate_grad_batches == given for c in mine):
        raise LayoutError(
            f"trainer.accumulate_grad_batches={given} and parallel.global_batch_size={global_batch} disagree: with "
            f"batch_size {micro} x dp {dp} the global batch needs accumulate_grad_batches={accumulate}. Fix: remove "
            "trainer.accumulate_grad_batches (the global batch sets it), or remove parallel.global_batch_size."
        )
    trainer.accumulate_grad_batches = accumulate
    callback = GlobalBatch(global_batch, micro, dp, accumulate)
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, GlobalBatch)] + [callback]
    return callback
