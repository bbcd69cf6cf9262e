"""``parallel.activation_checkpointing`` under the strategies: recomputation changes memory, not the training.

Each strategy that takes a layout applies it before wrapping the module (lp_ddp: before torch DDP; lp_sharded
stage 3: before FSDP2 ``fully_shard``); the trained weights equal one device without recomputation. A module that
lacks the hook its mode needs is refused in ``fit`` before any process starts, naming the hook.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

import lightning_parallel  # noqa: F401  (registers the strategies)
from lightning_parallel.config import LayoutError
from lightning_parallel.parallel.activation_checkpointing import checkpointed_modules
from lightning_parallel.strategies import LPDDPStrategy, LPShardedStrategy
from tests.helpers import TRAINER_QUIET, SequentialTokens, max_abs_diff, max_rel_diff, tiny_gpt

STEPS, PER_RANK = 6, 4


class _AssertRecomputed(Callback):
    """In each rank, once training starts: the strategy really applied the layout's recomputation."""

    def __init__(self, expected: list[str]) -> None:
        self.expected = expected

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        found = checkpointed_modules(pl_module)
        assert found == self.expected, (found, self.expected)


EXPECTED = {"none": [], "selective": ["blocks.0.attn.core", "blocks.1.attn.core"], "full": ["blocks.0", "blocks.1"]}


def _fit(model: pl.LightningModule, strategy: Any, devices: int, batch: int) -> None:
    mode = getattr(getattr(strategy, "layout", None), "activation_checkpointing", "none")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS,
                         limit_val_batches=0, callbacks=[_AssertRecomputed(EXPECTED[mode])], **TRAINER_QUIET)
    trainer.fit(model, SequentialTokens(batch_size=batch, n_samples=64))


@pytest.fixture(scope="module")
def reference() -> pl.LightningModule:
    """One device, no recomputation, global batch 8 (no dropout: 2 ranks draw other masks than 1 device)."""
    model = tiny_gpt(0)
    _fit(model, "auto", 1, 2 * PER_RANK)
    return model


@pytest.mark.parametrize(("name", "make"), [
    ("lp_ddp selective", lambda: LPDDPStrategy({"activation_checkpointing": "selective"}, start_method="fork")),
    ("lp_ddp full", lambda: LPDDPStrategy({"activation_checkpointing": "full"}, start_method="fork")),
    ("lp_sharded zero3 full", lambda: LPShardedStrategy({"zero_stage": 3, "activation_checkpointing": "full"},
                                                        start_method="fork")),
], ids=["ddp_selective", "ddp_full", "zero3_full"])
def test_recomputation_trains_like_one_device(name: str, make: Any, reference: pl.LightningModule) -> None:
    model = tiny_gpt(0)
    assert max_abs_diff(model, reference) > 1e-3  # the reference really trained
    _fit(model, make(), 2, PER_RANK)
    rel, diff = max_rel_diff(model, reference), max_abs_diff(model, reference)
    print(f"\n{name}, 2 ranks, {STEPS} AdamW steps vs 1 device without recomputation: "
          f"max rel {rel:.3e}, max abs {diff:.3e}")
    assert rel < 1e-5


def test_dropout_masks_are_replayed_by_the_recompute() -> None:
    """With dropout 0.1, lp_ddp on 2 ranks with full recomputation equals the same run without it: the recompute
    restores the random state, so it draws the masks of the first forward."""
    runs = {}
    for mode in ("none", "full"):
        model = tiny_gpt(0, dropout=0.1)
        pl.seed_everything(7, verbose=False)
        _fit(model, LPDDPStrategy({"activation_checkpointing": mode}, start_method="fork"), 2, PER_RANK)
        runs[mode] = model
    diff = max_abs_diff(runs["full"], runs["none"])
    print(f"\nlp_ddp 2 ranks, dropout 0.1: full recomputation vs none: max abs {diff:.3e}")
    assert diff < 1e-6


def test_a_module_without_the_hook_is_refused_before_spawn() -> None:
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    trainer = pl.Trainer(strategy=LPDDPStrategy({"activation_checkpointing": "selective"}, start_method="fork"),
                         accelerator="cpu", devices=2, max_steps=1, **TRAINER_QUIET)
    with pytest.raises(LayoutError, match="selective_checkpointing_modules"):
        trainer.fit(BoringModel(), BoringDataModule())
