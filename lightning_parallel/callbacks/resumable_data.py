"""``ResumableDataLoaders``: exact mid-epoch resume of the training DataLoader under any strategy.

The library's strategies make the training DataLoader resumable themselves
(:func:`~lightning_parallel.data.fast_forward.make_resumable`: the sampler's indices are fast-forwarded past the
batches a restored checkpoint already ran, with the RNG states its order was drawn from). This callback does the same
under a strategy of Lightning's own (one device, ``ddp``, ``fsdp``, ...): it routes that strategy's
``process_dataloader`` through :func:`~lightning_parallel.data.fast_forward.process_training_loader` from ``setup`` to
``teardown``. ``lightning-parallel fit`` adds it to every run; in a script, pass ``callbacks=[ResumableDataLoaders()]``
to the ``Trainer`` (with one of the library's strategies it does nothing).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

__all__ = ["ResumableDataLoaders"]


class ResumableDataLoaders(Callback):
    """Make the training DataLoader resume mid-epoch exactly under any strategy (module docstring)."""

    def __init__(self) -> None:
        self._patched: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_parallel.data.fast_forward import forget_early_load, process_training_loader

        forget_early_load(trainer)  # a mark of an earlier fit
        strategy = trainer.strategy
        if getattr(strategy, "resumes_dataloaders", False) or self._patched is not None:
            return
        original = strategy.process_dataloader

        def process_dataloader(dataloader: object) -> object:
            return process_training_loader(trainer, original(dataloader))

        strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]
        self._patched = strategy

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After the checkpoint is restored: data loaded before it is loaded again on a mid-epoch resume
        (:func:`~lightning_parallel.data.fast_forward.reload_after_restore`)."""
        from lightning_parallel.data.fast_forward import reload_after_restore

        if self._patched is not None:
            reload_after_restore(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy, self._patched = self._patched, None
        if strategy is not None and "process_dataloader" in vars(strategy):
            del strategy.process_dataloader
