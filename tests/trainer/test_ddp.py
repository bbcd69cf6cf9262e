"""lp_ddp at the Trainer level: equal to one device on the same global batch, and any LightningModule trains."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_parallel import LPDDPStrategy
from tests.helpers import TRAINER_QUIET, SequentialTokens, max_abs_diff, max_rel_diff, tiny_gpt

STEPS = 12
PER_RANK_BATCH = 4


def _fit(model: pl.LightningModule, strategy: Any, devices: int, batch_size: int, **trainer_kwargs: Any) -> None:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS,
                         limit_val_batches=0, **TRAINER_QUIET, **trainer_kwargs)
    trainer.fit(model, SequentialTokens(batch_size=batch_size))


@pytest.fixture(scope="module")
def reference() -> pl.LightningModule:
    """One device, global batch 2 x PER_RANK_BATCH, 12 AdamW steps (warmup + cosine)."""
    model = tiny_gpt()
    _fit(model, "auto", 1, 2 * PER_RANK_BATCH)
    return model


def test_lp_ddp_sgd_equals_one_device_so_the_gradient_scale_is_right() -> None:
    """Adam is blind to a constant gradient scale; SGD is not: a sum instead of a mean over ranks would fail here."""
    reference = tiny_gpt(sgd=True)
    _fit(reference, "auto", 1, 2 * PER_RANK_BATCH)
    model = tiny_gpt(sgd=True)
    _fit(model, LPDDPStrategy(start_method="fork"), 2, PER_RANK_BATCH)
    diff = max_abs_diff(model, reference)
    print(f"\nlp_ddp 2 ranks vs 1 device after {STEPS} SGD steps: max abs weight diff {diff:.3e}")
    assert max_abs_diff(tiny_gpt(sgd=True), reference) > 1e-2
    assert diff < 1e-6


@pytest.mark.parametrize(
    "ddp_kwargs",
    [{}, {"static_graph": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 0.01}],
    ids=["default", "static_graph+bucket_view+small_buckets"],
)
def test_lp_ddp_two_ranks_equals_one_device(reference: pl.LightningModule, ddp_kwargs: dict[str, Any],
                                            record_property: Any) -> None:
    model = tiny_gpt()
    assert max_abs_diff(model, reference) > 5e-3  # the reference really trained
    _fit(model, LPDDPStrategy(start_method="fork", **ddp_kwargs), 2, PER_RANK_BATCH)
    diff, rel = max_abs_diff(model, reference), max_rel_diff(model, reference)
    record_property("max_abs_weight_diff", diff)
    print(f"\nlp_ddp 2 ranks vs 1 device after {STEPS} AdamW steps {ddp_kwargs}: max abs weight diff {diff:.3e}, "
          f"max per-tensor relative diff {rel:.3e}")
    assert rel < 1e-5  # "a few 1e-6 relative"
    assert diff < 2e-5


def test_lp_ddp_fp16_compression_trains_close_to_reference(reference: pl.LightningModule) -> None:
    """The fp16 comm hook halves all-reduce bytes; it is lossy, so close (not equal) to the exact run."""
    model = tiny_gpt()
    _fit(model, LPDDPStrategy(start_method="fork", comm_hook="fp16"), 2, PER_RANK_BATCH)
    assert 0 < max_rel_diff(model, reference) < 1e-2


def test_lightning_demo_model_trains_unchanged_with_registered_name() -> None:
    model = BoringModel()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = pl.Trainer(strategy="lp_ddp_fork", accelerator="cpu", devices=2, max_steps=3, limit_val_batches=1,
                         **TRAINER_QUIET)
    trainer.fit(model)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_sampler_takes_rank_and_size_from_dp_axis() -> None:
    strategy = LPDDPStrategy()
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=3, **TRAINER_QUIET)
    assert strategy.dims.shape == (3, 1, 1)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 3, "rank": 0}
