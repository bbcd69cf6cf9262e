"""``ModelStateReport``: the planner's model-state bytes per rank against what the ranks hold after training.

Measured on every rank at the end of each training batch (the last one is kept), from the strategy's own accounting
where it has one -- the DeepSpeed engine's partitions (:func:`~lightning_parallel.parallel.offload.accounting.
engine_state_bytes`: device and host) -- else from the module's local tensors
(a DTensor's local shard), their gradients and the optimizer's state (:func:`~lightning_parallel.parallel.zero.memory.
measure_model_state`). When training ends the ranks' figures are gathered and rank 0 prints the busiest rank's
against the prediction, as a ratio. ``lp_auto`` adds it to the run, with the decision and the recipe it writes into
the run's log folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_parallel.planner.memory import ModelStates
from lightning_parallel.planner.units import format_bytes

__all__ = ["ModelStateReport", "measure_rank_states", "model_state_bytes"]


def model_state_bytes(model: Any = None, optimizer: Any = None, *, engine: Any = None) -> dict[str, int]:
    """``params``, ``grads``, ``optimizer`` (where training runs) and ``host`` (offloaded) bytes this rank holds: from
    a DeepSpeed ``engine``'s partitions (device, host and NVMe), else from ``model``'s local tensors (a DTensor's local
    shard), their gradients and ``optimizer``'s state."""
    if engine is not None:
        from lightning_parallel.parallel.offload.accounting import engine_state_bytes

        found = engine_state_bytes(engine)
        device = found["device"]
        return {"params": device["params"], "grads": device["grads"], "optimizer": device["optimizer"],
                "host": sum(found["host"].values()) + sum(found["nvme"].values())}
    from lightning_parallel.parallel.zero.memory import measure_model_state

    return _on_device(measure_model_state(model, optimizer))


def _on_device(mem: Any) -> dict[str, int]:
    return {"params": mem.params, "grads": mem.grads, "optimizer": mem.optim, "host": 0}


def measure_rank_states(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int]:
    """This rank's :func:`model_state_bytes`, from the strategy's own accounting where it has one (the DeepSpeed
    engine), else from the module and the first optimizer (a ZeRO optimizer's gradient shards included)."""
    strategy = trainer.strategy
    engine = getattr(strategy, "deepspeed_engine", None)
    if engine is not None:
        return model_state_bytes(engine=engine)
    if not trainer.optimizers:
        return {}
    return model_state_bytes(strategy.model if strategy.model is not None else pl_module, trainer.optimizers[0])


class ModelStateReport(Callback):
    """Compare measured model-state bytes per rank with ``predicted`` (the planner's figure for the layout run) and
    write ``files`` (name -> text) into the run's log folder when fit starts (rank 0)."""

    def __init__(self, predicted: ModelStates, *, files: dict[str, str] | None = None, label: str = "lp_auto") -> None:
        self.predicted = predicted
        self.files = dict(files or {})
        self.label = label
        self.measured: dict[str, int] = {}
        self.result: dict[str, Any] = {}
        """After training: ``predicted``/``measured`` totals (device + host), the busiest rank and the ratio."""
        self.written: list[Path] = []

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_dir = trainer.log_dir  # a collective under the data-parallel strategies: every rank asks
        if not self.files or not trainer.is_global_zero:
            return
        folder = Path(log_dir or trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in self.files.items():
            path = folder / name
            path.write_text(text)
            self.written.append(path)
        shown = ", ".join(str(p) for p in self.written)
        print(f"{self.label}: wrote {shown}", flush=True)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # every batch, not once at the end: lp_pipeline releases its gradients before on_train_end (a walk over the
        # parameters and optimizer state, no I/O and no collective)
        self.measured = measure_rank_states(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = dict(self.measured)
        ranks: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        measured = [r for r in ranks if r]
        if not measured:
            return
        totals = [r["params"] + r["grads"] + r["optimizer"] + r["host"] for r in measured]
        busiest = max(range(len(measured)), key=lambda i: totals[i])
        top = measured[busiest]
        predicted = self.predicted.device + self.predicted.host + self.predicted.nvme
        ratio = totals[busiest] / predicted if predicted else float("nan")
        self.result = {"predicted": predicted, "measured": totals[busiest], "rank": busiest, "ratio": ratio,
                       "measured_parts": top, "ranks": len(measured)}
        if not trainer.is_global_zero:
            return
        p = self.predicted
        host_p = f" + host {format_bytes(p.host + p.nvme)}" if p.host or p.nvme else ""
        host_m = f" + host {format_bytes(top['host'])}" if top["host"] else ""
        print(f"{self.label}: model states per rank: predicted {format_bytes(predicted)} (params "
              f"{format_bytes(p.params)}, grads {format_bytes(p.grads)}, optimizer {format_bytes(p.optimizer)}"
              f"{host_p}); measured {format_bytes(totals[busiest])} on rank {busiest}, the busiest of "
              f"{len(measured)} (params {format_bytes(top['params'])}, grads {format_bytes(top['grads'])}, optimizer "
              f"{format_bytes(top['optimizer'])}{host_m}); measured/predicted {ratio:.3f}", flush=True)
