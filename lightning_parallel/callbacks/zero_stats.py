"""Opt-in measurement: ``CountCommunication`` turns the strategy's communication counter on, ``ZeroStats`` also logs
the model-state bytes and the traffic of every optimizer step.

Adding one of them is what turns counting on: in ``setup`` it asks the strategy to count its communication
(``count_communication()``, :class:`~lightning_parallel.parallel.counters.CommCounter`); without it a step runs no
counting code.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["CountCommunication", "ZeroStats"]


class CountCommunication(Callback):
    """Count every collective (or, under ``lp_dp``, every exchange) of the fit: the strategy's ``comm_counter``
    (``exchange_counter`` under ``lp_dp``) holds the figures afterwards."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        count = getattr(trainer.strategy, "count_communication", None)
        if stage == "fit" and callable(count):
            count()


class ZeroStats(CountCommunication):
    """Log this rank's model-state bytes after each optimizer step and the bytes its collectives sent in that step
    (``zero/params_bytes``, ``zero/grads_bytes``, ``zero/optim_bytes``, ``zero/model_state_bytes``,
    ``zero/comm_bytes``); rank 0's values. Works under every strategy that can count its communication."""

    def __init__(self) -> None:
        self._before = 0.0

    def _sent(self, trainer: pl.Trainer) -> float:
        counter = getattr(trainer.strategy, "comm_counter", None)
        return float(counter.total_bytes) if counter is not None else 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:  # the first micro-batch of an optimizer step
            self._before = self._sent(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        from .model_states import measure_rank_states

        mem = measure_rank_states(trainer, pl_module)
        if not mem:
            return
        values = {"zero/params_bytes": mem["params"], "zero/grads_bytes": mem["grads"],
                  "zero/optim_bytes": mem["optimizer"],
                  "zero/model_state_bytes": mem["params"] + mem["grads"] + mem["optimizer"],
                  "zero/comm_bytes": self._sent(trainer) - self._before}
        for key, value in values.items():
            pl_module.log(key, float(value), rank_zero_only=True, on_step=True, on_epoch=False)
