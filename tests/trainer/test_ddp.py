"""lp_ddp at the Trainer level: equal to one device on the same global batch, and any LightningModule trains."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_parallel import LPDDPStrategy
from lightning_parallel.models import GPT
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


class _BackboneGPT(GPT):
    """The GPT whose blocks are the ``backbone`` Lightning's ``BackboneFinetuning`` freezes before the fit and
    unfreezes later, adding them to the optimizer; SGD over what is trainable when the optimizer is made."""

    @property
    def backbone(self) -> torch.nn.Module:
        return self.blocks

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


@pytest.mark.parametrize("strategy", ["lp_ddp", "lp_sharded zero3"])
def test_backbone_finetuning_equals_one_device(strategy: str) -> None:
    """The blocks are frozen for the first epoch (4 steps) and unfrozen at the second. torch DDP builds its reducer
    over the parameters that require gradients when it is made -- the blocks were frozen then -- and never averaged
    their gradients once unfrozen: each replica stepped its own (1.8e-01 from one device after 12 SGD steps; Lightning's
    own ``ddp`` does the same). lp_ddp builds DDP again when the trainable set changes; FSDP2 (ZeRO-3) steps
    each parameter as one device does."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    from lightning_parallel.strategies import LPShardedStrategy

    def fit(devices: int) -> pl.LightningModule:
        model = _BackboneGPT(**tiny_gpt().hparams)
        chosen: Any = "auto" if devices == 1 else LPDDPStrategy(start_method="fork") if strategy == "lp_ddp" else \
            LPShardedStrategy({"zero_stage": 3}, start_method="fork")
        trainer = pl.Trainer(strategy=chosen, accelerator="cpu", devices=devices, max_epochs=3, limit_val_batches=0,
                             callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda _: 1.0,
                                                           backbone_initial_ratio_lr=1.0)], **TRAINER_QUIET)
        trainer.fit(model, SequentialTokens(batch_size=8 // devices, n_samples=32))
        assert devices > 1 or trainer.global_step == 12  # (a fork launcher's parent does not count the ranks' steps)
        return model

    reference = fit(1)
    untrained = _BackboneGPT(**tiny_gpt().hparams)
    assert max_abs_diff(reference.blocks, untrained.blocks) > 1e-2  # the blocks trained after the unfreeze
    model = fit(2)
    diff = max_abs_diff(model, reference)
    print(f"\n{strategy} 2 ranks, BackboneFinetuning (unfrozen at epoch 1) vs 1 device: max |w - w_1dev| = {diff:.2e}")
    assert diff < 1e-6


def test_a_backbone_finetuning_checkpoint_passes_the_pre_launch_resume_check(tmp_path: Any) -> None:
    """The check before launch compares a checkpoint's optimizer with ``configure_optimizers`` of a fresh module:
    with ``BackboneFinetuning`` the run's optimizer has the unfrozen head's group at first (the callback freezes the
    backbone in ``setup``) and gains the backbone's group at the unfreeze, which the callback adds again on restore.
    Both checkpoints were refused before ("saved with param groups of [5, 30] parameters; this run's SGD has
    [35]"); a checkpoint of another model still is."""
    from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint

    from lightning_parallel.checkpoint.errors import ResumeError
    from lightning_parallel.strategies.layout import check_ckpt_path

    def finetuning() -> BackboneFinetuning:
        return BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda _: 1.0,
                                  backbone_initial_ratio_lr=1.0)

    saver = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_val_batches=0,
                         callbacks=[finetuning(), saver], **{**TRAINER_QUIET, "enable_checkpointing": True})
    trainer.fit(_BackboneGPT(**tiny_gpt().hparams), SequentialTokens(batch_size=8, n_samples=32))
    strategy = LPDDPStrategy()
    for name in ("epoch=0.ckpt", "epoch=1.ckpt"):  # before and after the unfreeze
        check_ckpt_path(strategy, str(tmp_path / name), module=_BackboneGPT(**tiny_gpt().hparams),
                        finetuning=[finetuning()])
    with pytest.raises(ResumeError, match="param groups"):  # without the callback the groups do not fit
        check_ckpt_path(strategy, str(tmp_path / "epoch=1.ckpt"), module=_BackboneGPT(**tiny_gpt().hparams))


class _UnusedLayer(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(2, 2)


def test_a_parameter_without_a_gradient_names_the_strategys_option() -> None:
    """torch DDP's error named `find_unused_parameters=True` of its own constructor, which a Lightning user never
    calls; Lightning's ddp rewrites it for its own strategy, and lp_ddp now names its own."""
    trainer = pl.Trainer(strategy=LPDDPStrategy(start_method="fork"), accelerator="cpu", devices=2, max_steps=2,
                         **TRAINER_QUIET)
    with pytest.raises(Exception, match=r"got no gradient in this step.*LPDDPStrategy\(find_unused_parameters=True\)"):
        trainer.fit(_UnusedLayer())
