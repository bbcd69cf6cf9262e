"""``RunSummary``: the callback the CLI adds to every run."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["WARMUP_BATCHES", "RunSummary", "calibrated_peak", "model_flops_per_sample"]


WARMUP_BATCHES = 2
"""Training batches left out of the MFU window (compilation, allocator and process-group warm-up)."""


def model_flops_per_sample(module: Any, seq_len: int) -> float:
    """Forward + backward model FLOPs of one sample: a GPT shape's count (``planner.flops.model_flops_per_token``
    x tokens), else ``6 P`` (each parameter used once per sample, as a dense layer is)."""
    from lightning_parallel.planner.detect import model_spec_from_module
    from lightning_parallel.planner.flops import model_flops_per_token

    spec, _ = model_spec_from_module(module)
    if spec.shape is not None and seq_len > 0:
        return model_flops_per_token(spec.shape, seq=seq_len) * seq_len
    return 6.0 * spec.n_params


def calibrated_peak(precision: str) -> tuple[float, str] | None:
    """The cached calibration's peak FLOP/s of ``precision``'s dtype and where it comes from; None without one (or
    with ``LIGHTNING_PARALLEL_CALIBRATION=none``). Never measures."""
    from lightning_parallel.planner.calibrate import cached_rates, calibration_mode

    if calibration_mode() == "none":
        return None
    rates = cached_rates()
    if rates is None:
        return None
    dtype = "bf16" if "bf16" in precision else "fp16" if "16" in precision else "fp32"
    return rates.peak(dtype), rates.source


class RunSummary(Callback):
    """Prints one line when ``fit`` ends (rank 0): time, strategy and layout, steps, ``val_loss <first> -> <last>``,
    the mean step time and tokens/s after the warm-up, achieved MFU, the checkpoint and the log folder. The
    validation losses are those of the real validation runs (not the sanity check), averaged over the validation set
    and the dp ranks by the module's ``sync_dist`` logging.

    MFU: model FLOPs per second of one device (:func:`model_flops_per_sample` x samples the dp replicas trained, over
    the training batches after :data:`WARMUP_BATCHES`, divided by their wall time and the world size) over the
    calibrated peak of this machine (the best matmul rate ``lightning-parallel plan --calibrate`` measured; the line
    says when there is no calibration)."""

    def __init__(self, monitor: str = "val_loss") -> None:
        self.monitor = monitor
        self.values: list[float] = []
        self._start = 0.0
        self._batches = 0
        self._samples = 0
        self._seq = 0
        self._batch_start: float | None = None
        self._train_s = 0.0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batches += 1
        if self._batches <= WARMUP_BATCHES or self._batch_start is None:
            return
        first = batch[0] if isinstance(batch, list | tuple) and batch else batch
        if isinstance(first, torch.Tensor) and first.dim() >= 1:
            self._samples += int(first.shape[0])
            self._seq = int(first.shape[1]) if first.dim() >= 2 else 0
        self._train_s += time.perf_counter() - self._batch_start

    def throughput_text(self, trainer: pl.Trainer) -> str:
        """``step 123.4 ms, 8,192 tokens/s``: the mean training batch (forward, backward, optimizer step) after the
        warm-up, and the tokens (samples without a sequence axis) all dp replicas trained per second; empty when too
        few batches ran."""
        counted = self._batches - WARMUP_BATCHES
        if counted <= 0 or self._train_s <= 0 or self._samples == 0:
            return ""
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
        replicas = int(kwargs.get("num_replicas", 1)) if isinstance(kwargs, dict) else 1
        units = self._samples * replicas * (self._seq or 1)
        return (f"step {self._train_s / counted * 1e3:,.1f} ms, {units / self._train_s:,.0f} "
                f"{'tokens' if self._seq else 'samples'}/s")

    def mfu_text(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        """``MFU 41.2% of the calibrated peak 0.2 TFLOP/s (...)``, or why it is not known."""
        if self._samples == 0 or self._train_s <= 0:
            return "MFU not measured (too few training batches)"
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
        replicas = int(kwargs.get("num_replicas", 1)) if isinstance(kwargs, dict) else 1
        achieved = model_flops_per_sample(pl_module, self._seq) * self._samples * replicas
        achieved /= self._train_s * max(trainer.world_size, 1)
        peak = calibrated_peak(str(trainer.precision))
        if peak is None:
            return (f"{achieved / 1e12:.3g} model TFLOP/s per device (MFU: no calibration of this machine; "
                    "lightning-parallel plan --calibrate)")
        return f"MFU {achieved / peak[0]:.1%} of the calibrated peak {peak[0] / 1e12:.3g} TFLOP/s ({peak[1]})"

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
        throughput = self.throughput_text(trainer)
        if throughput:
            parts.append(throughput)
        if trainer.lightning_module is not None:
            parts.append(self.mfu_text(trainer, trainer.lightning_module))
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
