"""What the Trainer-level equivalence tests of the model-parallel strategies share: fixed token data served in
order and split by the dp axis only, a fit with the settings every reference run uses, the weight difference, and
a callback that saves each rank's first predictions (fork workers return none to the main process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

T, GLOBAL_BATCH, STEPS = 16, 8, 10


class TokenData(pl.LightningDataModule):
    """Fixed random tokens in order; dp rank r of d gets samples r, r+d, ... (one device: all, in order).

    ``as_dict``: batches are ``{"tokens", "labels"}`` dicts. ``val_samples``: the validation set is the first that
    many samples (e.g. a count that leaves a short last batch). ``ignored``: labels set to -100 (not counted by
    the cross-entropy) -- ``"tail"``: the last quarter of every sample (padding); ``"ragged"``: a prompt and a
    padding of varying lengths per sample (:func:`ragged_ignored`)."""

    def __init__(self, batch_size: int, samples: int = 2 * STEPS * GLOBAL_BATCH, vocab: int = 64,
                 as_dict: bool = False, val_samples: int | None = None, ignored: str | None = None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        data = torch.randint(0, vocab, (samples, T + 1), generator=g)
        self.tokens = data[:, :-1]
        labels = data[:, 1:].clone()
        if ignored == "tail":
            labels[:, -T // 4:] = -100
        elif ignored == "ragged":
            labels[ragged_ignored(samples)] = -100
        elif ignored is not None:
            raise ValueError(f"ignored={ignored!r}: 'tail', 'ragged' or None")
        self.dataset: Any = TensorDataset(data[:, :-1], labels)
        if as_dict:
            self.dataset = [{"tokens": x, "labels": y} for x, y in self.dataset]
        self.batch_size = batch_size
        self.val_samples = val_samples

    def _loader(self, dataset: Any = None) -> DataLoader:
        dataset = self.dataset if dataset is None else dataset
        trainer: Any = self.trainer
        kwargs = trainer.strategy.distributed_sampler_kwargs if trainer.world_size > 1 else None
        sampler = DistributedSampler(dataset, shuffle=False, **kwargs) if kwargs else None
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        if self.val_samples is None:
            return self._loader()
        return self._loader(Subset(self.dataset, range(self.val_samples)))

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:  # token ids only: LightningModule's default predict_step is self(batch)
        return DataLoader(self.tokens, batch_size=self.batch_size, shuffle=False)


def ragged_ignored(samples: int) -> torch.Tensor:
    """A ``(samples, T)`` mask of labels not counted: sample ``i`` ignores its first ``(5 i) % 7`` (a prompt) and its
    last ``(3 i) % 6`` (padding) labels; samples 20..23 (the sixth batch of 4) ignore their first and last quarter,
    so under cp2 rank 0, which holds exactly those chunks, counts no token of that batch."""
    pos = torch.arange(T)
    prompt = torch.tensor([(5 * i) % 7 for i in range(samples)])[:, None]
    padding = torch.tensor([(3 * i) % 6 for i in range(samples)])[:, None]
    mask = (pos < prompt) | (pos >= T - padding)
    mask[20:24] = (pos < T // 4) | (pos >= T - T // 4)
    return mask


def fit(strategy: Any, devices: int, dp: int, *, model: Any, steps: int = STEPS, batch: int | None = None,
        samples: int = 2 * STEPS * GLOBAL_BATCH, ckpt_path: str | None = None, data: dict[str, Any] | None = None,
        **kw: Any) -> tuple[Any, Any]:
    """Fit with clipping 0.5 by norm and accumulation over 2 batches (a step sees GLOBAL_BATCH samples unless
    ``batch`` says otherwise), no validation unless asked; returns ``(model, trainer)``."""
    kwargs: dict[str, Any] = dict(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                  limit_val_batches=0, gradient_clip_val=0.5, accumulate_grad_batches=2,
                                  enable_checkpointing=False, use_distributed_sampler=False)
    kwargs.update(kw)
    trainer = pl.Trainer(**kwargs)
    module = TokenData(batch or GLOBAL_BATCH // 2 // dp, samples, **(data or {}))
    trainer.fit(model, datamodule=module, ckpt_path=ckpt_path)
    return model, trainer


class StepMeanMixin:
    """One device's reference for a loss that is the mean over every counted token of the optimizer step, mixed into
    a module whose ``_loss(batch)`` is the token mean of an ``(input, labels)`` batch: Lightning's accumulation
    averages its batches' own means (each divided by ``accumulate_grad_batches``), so each batch's loss is multiplied
    here by ``k x n_batch / N_step`` (``k`` the window's batches, fewer at an epoch's end; ``N_step`` counted from
    :attr:`labels`, the training set's labels in the order one device's loader serves them), and ``train_loss`` is
    logged as the batch's own mean."""

    labels: torch.Tensor
    trainer: Any

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self._loss(batch)  # type: ignore[attr-defined]
        self.log("train_loss", loss, prog_bar=True, sync_dist=False)  # type: ignore[attr-defined]
        accumulation, epoch = self.trainer.accumulate_grad_batches, int(self.trainer.num_training_batches)
        size = self.trainer.train_dataloader.batch_size  # a short last batch (drop_last=False) ends the data
        start = batch_idx // accumulation * accumulation
        end = min(start + accumulation, epoch)
        step = int((self.labels[start * size:end * size] != -100).sum())
        return loss * ((end - start) * int((batch[1] != -100).sum()) / step)


def weight_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between two modules' state dicts (same keys)."""
    sb = b.state_dict()
    return max(float((v - sb[k]).abs().max()) for k, v in a.state_dict().items())


class Residual(nn.Module):
    """A residual MLP layer (``up`` -> ReLU -> ``down``) for the small non-GPT test modules."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class SavePredictions(pl.Callback):
    """Fork workers return no predictions to the main process: each rank saves its first batch's output."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        if batch_idx == 0:
            torch.save(outputs, self.folder / f"pred_{trainer.global_rank}.pt")
