"""A run resumed mid-epoch goes through the epoch's end exactly like the uninterrupted run (every remaining batch of
that epoch, then the next epoch's order), not an epoch shortened by the batches it had already run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_parallel.data import TextDataModule
from lightning_parallel.models import GPT


class _Losses(Callback):
    def __init__(self) -> None:
        self.steps: dict[int, tuple[int, float]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.steps[trainer.global_step] = (trainer.current_epoch, float(outputs["loss"]))


def _fit(root: Path, corpus: Path, *, max_steps: int, ckpt_path: str | None = None) -> _Losses:
    pl.seed_everything(7, verbose=False)
    losses = _Losses()
    every = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[losses, every])
    model = GPT(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=256, warmup_steps=2)
    trainer.fit(model, datamodule=TextDataModule(path=str(corpus), block_size=16, batch_size=4, val_fraction=0.2),
                ckpt_path=ckpt_path)
    return losses


def test_resumed_epoch_runs_to_its_end_then_the_next_epoch(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(chr(97 + (i * 7) % 26) for i in range(700)))  # 34 training windows: 8 batches/epoch
    whole = _fit(tmp_path / "a", corpus, max_steps=20)
    epochs = [e for e, _ in whole.steps.values()]
    assert epochs.count(0) == 8 and max(epochs) == 2  # the run crosses two epoch ends
    resumed = _fit(tmp_path / "b", corpus, max_steps=20,
                   ckpt_path=str(tmp_path / "a" / "ckpt" / "epoch=0-step=5.ckpt"))
    assert sorted(resumed.steps) == list(range(6, 21))
    for step in resumed.steps:
        assert resumed.steps[step][0] == whole.steps[step][0], step  # the same epoch at every step
        assert torch.isclose(torch.tensor(resumed.steps[step][1]), torch.tensor(whole.steps[step][1]),
                             rtol=0, atol=1e-6), step
