"""What the elastic tests and the elastic demonstration record: the loss of each optimizer step, with the world it ran
on, and the times around a restart.

:class:`StepLoss` appends one JSON line per optimizer step (rank 0): ``step``, ``loss`` (the mean over the global
batch: every micro-batch of the step's accumulation, averaged over every rank), ``time`` (wall clock, seconds since
the epoch), ``world`` (ranks), ``accumulate`` (``accumulate_grad_batches``), ``restart``
(``TORCHELASTIC_RESTART_COUNT``) and ``strategy`` (what the strategy says of itself). Use it from a recipe::

    trainer:
      callbacks:
        - class_path: lightning_parallel.testing.elastic.StepLoss
          init_args: {path: runs/x/losses.jsonl}

:func:`read_steps` reads such a file back (the last record of each step wins: a step run again after a restart).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

__all__ = ["StepLoss", "read_records", "read_steps"]


class StepLoss(Callback):
    """Rank 0 appends each optimizer step's global-batch loss and the world it ran on (see the module)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._step = -1
        self._sum: torch.Tensor | None = None
        self._count = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._step != trainer.global_step:  # the first micro-batch of a step
            self._step, self._sum, self._count = trainer.global_step, None, 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = trainer.callback_metrics["train_loss"].detach().float().reshape(1)
        loss = trainer.strategy.reduce(loss, reduce_op="mean")  # this micro-batch over every rank
        self._sum = loss if self._sum is None else self._sum + loss
        self._count += 1
        if trainer.global_step == self._step:
            return  # an accumulation batch: the optimizer has not stepped yet
        assert self._sum is not None
        if trainer.global_rank == 0:
            record = {"step": trainer.global_step, "loss": float(self._sum) / self._count, "time": time.time(),
                      "world": trainer.world_size, "accumulate": int(trainer.accumulate_grad_batches),
                      "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                      "strategy": _describe(trainer.strategy)}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        self._step, self._sum, self._count = trainer.global_step, None, 0


def _describe(strategy: Any) -> str:
    describe = getattr(strategy, "describe", None)
    return str(describe()) if callable(describe) else type(strategy).__name__


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a :class:`StepLoss` file, in the order written."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_steps(path: str | Path) -> dict[int, dict[str, Any]]:
    """The record of each step (a step written twice -- run again after a restart -- keeps the later one)."""
    return {int(r["step"]): r for r in read_records(path)}
