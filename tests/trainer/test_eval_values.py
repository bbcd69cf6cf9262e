"""What user code computes in evaluation under model parallelism equals one device: torchmetrics metrics, values
reduced through the strategy (in place, as the all-reduce is), a value computed from a ZeRO-3 (DTensor) parameter;
and a predict that FSDP2 cannot run (ranks with different batch counts) is refused with the counts."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.models import GPT
from lightning_parallel.strategies import LPDDPStrategy, LPShardedStrategy, LPTensorStrategy


class _Counting(GPT):
    """Counts the validation samples with a torchmetrics ``SumMetric`` and through ``strategy.reduce(..., "sum")``
    (recording whether the tensor given holds the result, as under Lightning's own DDP), and logs the norm of the
    head's weight at the epoch's end through ``sync_dist`` (a DTensor under ZeRO-3)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen = torchmetrics.SumMetric()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        self.seen(torch.tensor(float(x.shape[0])))
        self.log("seen", self.seen)
        given = torch.tensor(float(x.shape[0]))
        reduced = self.trainer.strategy.reduce(given, reduce_op="sum")
        self.log("reduced", reduced, reduce_fx="sum")
        self.log("given_agrees", float(torch.equal(given, reduced)), reduce_fx="min")

    def on_validation_epoch_end(self) -> None:
        self.log("head_norm", self.head.lm_head.weight.detach().norm(), sync_dist=True)


def _data(samples: int) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (samples, 17), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)


def _model() -> _Counting:
    torch.manual_seed(0)
    return _Counting(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, bias=False)


def _trainer(strategy: Any, devices: int) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False)


def test_metrics_and_reductions_count_each_sample_once() -> None:
    """tp=2 (both ranks see every batch): the SumMetric synced over the world counted 20 of one device's 10, and the
    tensor given to ``reduce`` held the world's sum (20) while the result was 10; ZeRO-3 over dp=2 with Lightning's
    sampler: the head norm logged with ``sync_dist`` from a DTensor failed (no sharding strategy for allreduce_)."""
    one = _trainer("auto", 1).validate(_model(), dataloaders=_data(10), verbose=False)[0]
    assert one["seen"] == 10.0 and one["reduced"] == 10.0 and one["given_agrees"] == 1.0
    tp = _trainer(LPTensorStrategy({"tensor_parallel_size": 2}, start_method="fork"), 2)
    got = tp.validate(_model(), dataloaders=_data(10), verbose=False)[0]
    print(f"\none device {one}\ntp=2 {got}")
    assert (got["seen"], got["reduced"], got["given_agrees"]) == (10.0, 10.0, 1.0)
    assert got["head_norm"] == pytest.approx(one["head_norm"], rel=1e-6)
    z3 = pl.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    strategy=LPShardedStrategy({"zero_stage": 3}, start_method="fork"))
    got = z3.validate(_model(), dataloaders=_data(8), verbose=False)[0]
    print(f"zero3 dp=2 {got}")
    assert got["head_norm"] == pytest.approx(one["head_norm"], rel=1e-6)


def test_a_predict_fsdp2_cannot_run_is_refused_with_the_counts() -> None:
    """ZeRO-3 over dp=2, 9 samples in batches of 2: Lightning's predict sampler gives the ranks 3 and 2 batches, and
    FSDP2's all-gathers then mismatch (gloo: "Received data size doesn't match expected size")."""
    trainer = pl.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         strategy=LPShardedStrategy({"zero_stage": 3}, start_method="fork"))
    with pytest.raises(Exception, match="would run 2 to 3 predict batches"):
        trainer.predict(_model(), dataloaders=_data(9))


class _Unpadded(pl.LightningDataModule):
    """Validation and test sets of ``samples`` split over the ranks without padding (batches of 2)."""

    def __init__(self, samples: int) -> None:
        super().__init__()
        self.samples = samples

    def _loader(self) -> DataLoader:
        from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

        data = _data(self.samples).dataset
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        return DataLoader(data, batch_size=2, sampler=UnrepeatedDistributedSampler(data, shuffle=False, **kwargs))

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()


def test_validation_and_test_batches_a_collective_needs_even_are_checked() -> None:
    """The GPT names its token labels, so each validation or test batch sums its counted tokens over the dp ranks.
    With a sampler that does not pad (9 samples in batches of 2 over 2 ranks: 3 batches and 2) the rank with the
    third batch waited in that sum until the collective timeout (lp_ddp, ZeRO-3; Lightning's own ddp finishes, with
    a value that is not one device's). Refused on every rank with the counts; an even split runs."""
    for strategy in (LPDDPStrategy(start_method="fork"), LPShardedStrategy({"zero_stage": 3}, start_method="fork")):
        with pytest.raises(Exception, match="would run 2 to 3 validation batches"):
            _trainer(strategy, 2).validate(_model(), datamodule=_Unpadded(9))
    with pytest.raises(Exception, match="would run 2 to 3 test batches"):
        _trainer(LPDDPStrategy(start_method="fork"), 2).test(_model(), datamodule=_Unpadded(9))
    _trainer(LPDDPStrategy(start_method="fork"), 2).validate(_model(), datamodule=_Unpadded(8))  # 2 batches each
