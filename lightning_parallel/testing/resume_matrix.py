"""Save under one layout, resume under another: the checks behind ``tests/trainer/test_resume_matrix.py``.

A small GPT trains ``STOP + MORE`` AdamW steps (warmup + cosine schedule over the whole run, clipping 0.5 by norm)
on fixed random tokens, one global batch of :data:`GLOBAL_BATCH` samples per step; an epoch is
:data:`EPOCH_STEPS` steps, so the checkpoint at step :data:`STOP` is taken **mid-epoch** and the resumed run must
continue with the remaining batches of that epoch (:class:`~lightning_parallel.data.ResumableDataModuleMixin`).

* the reference: one device, all steps, its loss per step and final weights;
* a save run per layout: the same steps, stopped right after the checkpoint at step ``STOP`` (as if killed there);
* a resume run per (save layout, resume layout): ``fit(ckpt_path=...)`` under the resume layout to the end.

Each cell reports the resumed loss at step ``STOP + 1`` against the reference's, and the largest weight difference at
the end. Ranks are forked from the calling process (CPU, gloo).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.data.resumable import ResumableDataModuleMixin

__all__ = ["EPOCH_STEPS", "GLOBAL_BATCH", "LAYOUTS", "MORE", "STOP", "Cell", "Layout", "reference", "resume",
           "save"]

T, VOCAB, GLOBAL_BATCH = 16, 64, 8
DROPOUT = 0.0  # > 0 makes the RNG states part of what a resume must restore
STOP, MORE, EPOCH_STEPS = 3, 3, 5


@dataclass(frozen=True)
class Layout:
    """A strategy factory, its device count and data-parallel size (per-rank batch = GLOBAL_BATCH / dp)."""

    name: str
    make: Callable[[], Any]
    devices: int
    dp: int


def _layouts() -> dict[str, Layout]:
    from lightning_parallel.strategies import (
        LPDDPStrategy,
        LPDPStrategy,
        LPHybridStrategy,
        LPPipelineStrategy,
        LPShardedStrategy,
        LPTensorStrategy,
    )

    fork: dict[str, Any] = {"start_method": "fork"}
    pp = {"pipeline_parallel_size": 2, "num_micro_batches": 2, "pipeline_schedule": "1f1b"}
    items = [
        Layout("1 device", lambda: "auto", 1, 1),
        Layout("lp_dp x2", lambda: LPDPStrategy(), 2, 1),  # one process, 2 replicas in threads: dp for data = 1
        Layout("lp_ddp x2", lambda: LPDDPStrategy(**fork), 2, 2),
        Layout("lp_sharded z1 x2", lambda: LPShardedStrategy({"zero_stage": 1}, checkpoint="sharded", **fork), 2, 2),
        Layout("lp_sharded z3 x2", lambda: LPShardedStrategy({"zero_stage": 3}, checkpoint="sharded", **fork), 2, 2),
        Layout("lp_tensor tp2", lambda: LPTensorStrategy({"tensor_parallel_size": 2}, **fork), 2, 1),
        Layout("lp_pipeline pp2", lambda: LPPipelineStrategy(pp, **fork), 2, 1),
        Layout("lp_hybrid 2x2x2", lambda: LPHybridStrategy(
            {**pp, "data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1}, **fork), 8, 2),
        Layout("lp_hybrid 2x2x2 z3", lambda: LPHybridStrategy(
            {**pp, "data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}, **fork), 8, 2),
        Layout("lp_sharded hsdp 2x2 z3", lambda: LPShardedStrategy(
            {"zero_stage": 3, "data_parallel_shard_size": 2}, checkpoint="sharded", **fork), 4, 4),
    ]
    if _deepspeed_ready():
        from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy

        items.append(Layout("lp_zero_offload x2", lambda: LPZeroOffloadStrategy(
            {"zero_stage": 2, "offload": "cpu"}, start_method="fork"), 2, 2))
    return {layout.name: layout for layout in items}


def _deepspeed_ready() -> bool:
    """DeepSpeed installed and its CPU ops built (the matrix never builds them: that is set-up work)."""
    try:
        from lightning_parallel.parallel.offload import missing_ops, required_ops

        return not missing_ops(required_ops(accelerator="cpu", offload_optimizer="cpu", offload_param="none"))
    except ImportError:
        return False


LAYOUTS: dict[str, Layout] = _layouts()


class _Tokens(ResumableDataModuleMixin, pl.LightningDataModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        base = torch.randint(0, VOCAB, (EPOCH_STEPS * GLOBAL_BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (EPOCH_STEPS * GLOBAL_BATCH, 1), generator=g)
        data = (base + stride * torch.arange(T + 1)) % VOCAB  # learnable: the loss falls within a few steps
        self.dataset = TensorDataset(data[:, :-1], data[:, 1:])
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        sampler = self.resumable_sampler(self.dataset, self.batch_size, shuffle=True, seed=11)
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)


class _Losses(Callback):
    """Rank 0 appends ``{"step", "loss"}`` per step: the logged ``train_loss`` averaged over all ranks (the global
    batch's mean; model-parallel peers hold the same value)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = trainer.callback_metrics["train_loss"].detach().float().reshape(1)
        loss = trainer.strategy.reduce(loss, reduce_op="mean")
        if trainer.global_rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": float(loss)}) + "\n")


class _StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _gpt() -> pl.LightningModule:
    from lightning_parallel.models import GPT

    torch.manual_seed(0)
    return GPT(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=VOCAB, warmup_steps=2, bias=False,
               dropout=DROPOUT)


def _fit(layout: Layout, *, losses: Path, callbacks: list[Callback], ckpt_path: str | None = None) -> nn.Module:
    model = _gpt()
    trainer = pl.Trainer(accelerator="cpu", devices=layout.devices, strategy=layout.make(), max_steps=STOP + MORE,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, gradient_clip_val=0.5, use_distributed_sampler=False,
                         enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                         callbacks=[_Losses(losses), *callbacks])
    trainer.fit(model, datamodule=_Tokens(GLOBAL_BATCH // layout.dp), ckpt_path=ckpt_path)
    return model


def _read_losses(path: Path) -> dict[int, float]:
    if not path.is_file():
        return {}
    return {int(r["step"]): float(r["loss"]) for r in map(json.loads, path.read_text().splitlines())}


def reference(folder: Path) -> tuple[nn.Module, dict[int, float]]:
    """The uninterrupted one-device run: final model and loss per step."""
    folder.mkdir(parents=True, exist_ok=True)
    losses = folder / "reference_losses.jsonl"
    losses.unlink(missing_ok=True)
    model = _fit(LAYOUTS["1 device"], losses=losses, callbacks=[])
    return model, _read_losses(losses)


def save(name: str, folder: Path) -> Path:
    """Train under layout ``name`` until step ``STOP``, checkpoint there (``ModelCheckpoint``), stop; the path."""
    folder.mkdir(parents=True, exist_ok=True)
    ckpt_dir = folder / f"save_{_slug(name)}"
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="stop", every_n_train_steps=STOP, save_top_k=-1)
    _fit(LAYOUTS[name], losses=folder / f"save_{_slug(name)}.jsonl", callbacks=[checkpoint, _StopAt(STOP)])
    path = ckpt_dir / "stop.ckpt"
    if not path.exists():
        raise FileNotFoundError(f"{name}: no checkpoint at {path}")
    return path


@dataclass(frozen=True)
class Cell:
    """One (save layout, resume layout) result."""

    saved: str
    resumed: str
    loss: float | None
    reference_loss: float
    weight_diff: float | None
    error: str | None = None

    @property
    def loss_diff(self) -> float | None:
        return None if self.loss is None else abs(self.loss - self.reference_loss)


def resume(saved: str, checkpoint: Path, resumed: str, folder: Path, ref: tuple[nn.Module, dict[int, float]]
           ) -> Cell:
    """Resume ``checkpoint`` (saved under ``saved``) under layout ``resumed`` to the end; compare with ``ref``."""
    ref_model, ref_losses = ref
    losses = folder / f"resume_{_slug(saved)}__{_slug(resumed)}.jsonl"
    losses.unlink(missing_ok=True)
    try:
        path = checkpoint
        if resumed == "1 device" and checkpoint.is_dir():
            # Lightning's own one-device strategy reads one file: the folder joined with its optimizer state
            from lightning_parallel.checkpoint import consolidate

            path = folder / f"resumable_{_slug(saved)}.ckpt"
            from lightning_parallel.checkpoint.resume import TRUST_ENV

            consolidate(checkpoint, path, resumable=True, trusted=os.environ.get(TRUST_ENV) == "1")
        model = _fit(LAYOUTS[resumed], losses=losses, callbacks=[], ckpt_path=str(path))
    except Exception as err:
        return Cell(saved, resumed, None, ref_losses[STOP + 1], None, f"{type(err).__name__}: {err}")
    got = _read_losses(losses)
    ref_state = ref_model.state_dict()
    diff = max(float((v.float() - ref_state[k].float()).abs().max()) for k, v in model.state_dict().items())
    return Cell(saved, resumed, got.get(STOP + 1), ref_losses[STOP + 1], diff)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def quiet() -> None:
    """Less Lightning chatter for the matrix's many short fits."""
    import logging
    import warnings

    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
