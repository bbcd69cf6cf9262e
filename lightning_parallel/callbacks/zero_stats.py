"""``ZeroStats``: log the ZeRO engine's measured model-state bytes and traffic per optimizer step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["ZeroStats"]


class ZeroStats(Callback):
    """Log this rank's model-state bytes after each optimizer step and the bytes its collectives sent in that step
    (``zero/params_bytes``, ``zero/grads_bytes``, ``zero/optim_bytes``, ``zero/model_state_bytes``,
    ``zero/comm_bytes``), from :class:`LPShardedStrategy`'s built-in measurement; rank 0's values."""

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        strategy = trainer.strategy
        mem = getattr(strategy, "last_model_state", None)  # LPShardedStrategy's measurement (duck-typed: no import)
        if mem is None:
            return
        comm = getattr(strategy, "last_step_comm", {}).get("total", 0.0)
        values = {"zero/params_bytes": mem.params, "zero/grads_bytes": mem.grads, "zero/optim_bytes": mem.optim,
                  "zero/model_state_bytes": mem.total, "zero/comm_bytes": comm}
        for key, value in values.items():
            pl_module.log(key, float(value), rank_zero_only=True, on_step=True, on_epoch=False)
