"""``RunSummary``: the callback the CLI adds to every run."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["RunSummary"]


class RunSummary(Callback):
    """Prints one line when ``fit`` ends (rank 0): time, strategy and layout, steps, ``val_loss <first> -> <last>``,
    the checkpoint and the log folder. The validation losses are those of the real validation runs (not the
    sanity check), averaged over the validation set and the dp ranks by the module's ``sync_dist`` logging."""

    def __init__(self, monitor: str = "val_loss") -> None:
        self.monitor = monitor
        self.values: list[float] = []
        self._start = 0.0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None:
            self.values.append(float(value))

    def line(self, trainer: pl.Trainer, log_dir: str | None) -> str:
        strategy = trainer.strategy
        describe = getattr(strategy, "describe", None)
        name = describe() if callable(describe) else type(strategy).__name__
        parts = [f"fit done in {time.perf_counter() - self._start:.1f}s", f"strategy {name}",
                 f"{trainer.world_size} process(es)", f"{trainer.global_step} steps"]
        if self.values:
            first, last = self.values[0], self.values[-1]
            trend = "lower" if last < first else "NOT lower"
            parts.append(f"{self.monitor} {first:.4f} -> {last:.4f} ({trend}; {len(self.values)} validations)")
        else:
            parts.append(f"{self.monitor} not logged (no validation ran)")
        ckpt = trainer.checkpoint_callback
        path = getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "") if ckpt else ""
        if path:
            parts.append(f"checkpoint {path}")
        if log_dir:
            parts.append(f"logs {log_dir}")
        return "lightning-parallel: " + " | ".join(parts)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_dir = trainer.log_dir  # a collective (broadcast) under DDP: every rank must ask
        if trainer.is_global_zero:
            print(self.line(trainer, log_dir), flush=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"values": [v for v in self.values if math.isfinite(v)]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = list(state_dict.get("values", []))
