"""Callbacks and schedulers a layout cannot serve are refused with the fix: a monitor of a value a pipeline never
logs (the module's own steps do not run there), and Lightning's one-process ``BatchSizeFinder`` on several ranks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, EarlyStopping

from lightning_parallel.config import LayoutError
from lightning_parallel.models import GPT
from lightning_parallel.strategies import LPDDPStrategy, LPPipelineStrategy
from tests.trainer.token_data import T, fit

_SIZES = dict(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=2, bias=False)


class _LogsInStep(GPT):
    """Logs its loss as ``tm`` in ``training_step`` (which a pipeline does not call)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("tm", loss)
        return loss


class _PlateauOnStepValue(_LogsInStep):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "tm", "interval": "step", "strict": False}}


class _LogsInEpochHook(GPT):
    """Logs ``vm`` from ``on_validation_epoch_end``, a hook that runs under a pipeline."""

    def on_validation_epoch_end(self) -> None:
        self.log("vm", torch.tensor(1.0))


class _LogsStepValueFromCallback(pl.Callback):
    """Logs ``tm`` from ``on_train_batch_end``, which runs under a pipeline (``outputs`` holds the step's loss)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        pl_module.log("tm", loss.detach().float())


class _Names:
    VM = "vm"


class _LogsThroughAName(_LogsInStep):
    """Logs ``vm`` in ``validation_step`` by its literal and in ``on_validation_epoch_end`` through a name."""

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().validation_step(batch, batch_idx)
        self.log("vm", torch.tensor(1.0))
        return out

    def on_validation_epoch_end(self) -> None:
        self.log(_Names.VM, torch.tensor(1.0))


def _pp() -> LPPipelineStrategy:
    return LPPipelineStrategy({"pipeline_parallel_size": 2}, start_method="fork")


def test_a_monitor_of_a_value_the_pipeline_never_logs_is_refused() -> None:
    """Under lp_pipeline, ``EarlyStopping(monitor="tm")`` failed inside the ranks after the launch, and
    ``ReduceLROnPlateau`` watching ``tm`` with ``strict=False`` skipped every update (the LR stayed 3e-3 for 12 steps
    where one device's fell to 4.7e-5). The callback is refused before the launch; the scheduler, which exists only
    once the optimizers do, in every rank before the first step. A value logged from a hook the pipeline runs (the
    module's, or a callback's; by its literal name or through a variable, which may be anything) is monitored as
    usual."""
    with pytest.raises(LayoutError, match=r"EarlyStopping\(monitor='tm'\) watches 'tm'.*only in training_step"):
        fit(_pp(), 2, 1, model=_LogsInStep(**_SIZES), steps=2, callbacks=[EarlyStopping(monitor="tm")])
    with pytest.raises(LayoutError, match=r"monitor='train_loss_epoch'\) watches 'train_loss_epoch', but .* logs "
                                          r"'train_loss' itself"):  # (Lightning: no checkpoint saved, a warning)
        fit(_pp(), 2, 1, model=GPT(**_SIZES), steps=2,
            callbacks=[EarlyStopping(monitor="train_loss_epoch")])
    with pytest.raises(Exception, match=r"LayoutError: the LR scheduler ReduceLROnPlateau \(monitor='tm'\)"):
        fit(_pp(), 2, 1, model=_PlateauOnStepValue(**_SIZES), steps=2)
    _, trainer = fit(_pp(), 2, 1, model=_LogsInEpochHook(**_SIZES), steps=2, limit_val_batches=1,
                     val_check_interval=1, callbacks=[EarlyStopping(monitor="vm", patience=5)])
    assert trainer.state.finished
    _, trainer = fit(_pp(), 2, 1, model=_LogsInStep(**_SIZES), steps=2, callbacks=[
        _LogsStepValueFromCallback(), EarlyStopping(monitor="tm", patience=5, check_on_train_epoch_end=True)])
    assert trainer.state.finished
    _, trainer = fit(_pp(), 2, 1, model=_LogsThroughAName(**_SIZES), steps=2, limit_val_batches=1,
                     val_check_interval=1, callbacks=[EarlyStopping(monitor="vm", patience=5)])
    assert trainer.state.finished


def test_batch_size_finder_on_several_ranks_is_refused_before_launch() -> None:
    """Each rank raised Lightning's "not supported with distributed strategies" once started."""
    with pytest.raises(LayoutError, match="BatchSizeFinder searches the batch size in one process"):
        fit(LPDDPStrategy(start_method="fork"), 2, 2, model=GPT(**_SIZES), steps=2, callbacks=[BatchSizeFinder()])
