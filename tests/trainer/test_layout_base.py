"""The layout base (``LayoutStrategy`` on Lightning's ``ParallelStrategy``): the module is parallelized in ``setup``
for every ``TrainerFn`` -- fit, validate, test, predict -- and evaluation gives one device's numbers.

Each run records, in the rank processes, which ``TrainerFn`` ``parallelize`` saw and what the module became; the
parent compares the logged losses with a single-device Trainer on the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader

import lightning_parallel  # noqa: F401  (registers the strategies)
from lightning_parallel.strategies import LPDDPStrategy, LPShardedStrategy
from tests.helpers import TRAINER_QUIET, SequentialTokens, tiny_gpt

N_SAMPLES = 32


class _Recording:
    """Mix into a strategy: note each ``parallelize`` call (TrainerFn, the module type it returned) in the module's
    hyper-parameter-free attribute ``seen`` that the launcher does not ship back, so the test asserts in the rank."""

    def parallelize(self, model: Any, *, trainer_fn: Any) -> Any:
        out = super().parallelize(model, trainer_fn=trainer_fn)  # type: ignore[misc]
        lm = self.lightning_module  # type: ignore[attr-defined]
        fsdp = type(lm).__name__.startswith("FSDP")
        lm.log_fn = (str(trainer_fn.value), type(out).__name__, fsdp)
        return out


class RecordingDDP(_Recording, LPDDPStrategy):
    pass


class RecordingSharded(_Recording, LPShardedStrategy):
    pass


def _model() -> pl.LightningModule:
    model = tiny_gpt(0)
    base_val, base_test = model.validation_step, model.test_step

    def validation_step(batch: Any, batch_idx: int) -> torch.Tensor:
        fn, _, fsdp = getattr(model, "log_fn")  # noqa: B009
        model.log("parallelized_for_validate", float(fn == "validate"), sync_dist=True)
        model.log("sharded_params", float(fsdp), sync_dist=True)
        return base_val(batch, batch_idx)

    def test_step(batch: Any, batch_idx: int) -> torch.Tensor:
        fn = getattr(model, "log_fn")[0]  # noqa: B009
        model.log("parallelized_for_test", float(fn == "test"), sync_dist=True)
        return base_test(batch, batch_idx)

    model.validation_step = validation_step  # type: ignore[method-assign]
    model.test_step = test_step  # type: ignore[method-assign]
    return model


def _one_device(model: pl.LightningModule, data: SequentialTokens) -> dict[str, float]:
    plain = tiny_gpt(0)
    plain.load_state_dict(model.state_dict())
    trainer = pl.Trainer(accelerator="cpu", devices=1, **TRAINER_QUIET)
    out = dict(trainer.validate(plain, data.val_dataloader(), verbose=False)[0])
    out.update(trainer.test(plain, data.val_dataloader(), verbose=False)[0])
    return out


@pytest.mark.parametrize(("strategy", "sharded"), [
    (lambda: RecordingDDP(start_method="fork"), False),
    (lambda: RecordingSharded({"zero_stage": 3}, start_method="fork"), True),
], ids=["lp_ddp", "lp_sharded_zero3"])
def test_validate_test_predict_are_parallelized_and_equal_one_device(strategy: Any, sharded: bool,
                                                                    tmp_path: Path) -> None:
    data = SequentialTokens(batch_size=4, n_samples=N_SAMPLES)
    model = _model()
    trainer = pl.Trainer(strategy=strategy(), accelerator="cpu", devices=2, max_steps=3, **TRAINER_QUIET)
    trainer.fit(model, data)
    ours = dict(trainer.validate(model, data.val_dataloader(), verbose=False)[0])
    ours.update(trainer.test(model, data.val_dataloader(), verbose=False)[0])
    reference = _one_device(model, data)
    print(f"\n{type(trainer.strategy).__name__}: val_loss {ours['val_loss']:.6f} vs one device "
          f"{reference['val_loss']:.6f}; test_loss {ours['test_loss']:.6f} vs {reference['test_loss']:.6f}")
    assert ours["parallelized_for_validate"] == 1.0 and ours["parallelized_for_test"] == 1.0
    assert ours["sharded_params"] == float(sharded)  # ZeRO-3 evaluates on sharded parameters too
    assert ours["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    assert ours["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5)
    # a fresh Trainer that never fitted: validate parallelizes too (no DDP-style rank-0 broadcast assumption)
    fresh = pl.Trainer(strategy=strategy(), accelerator="cpu", devices=2, **TRAINER_QUIET)
    again = fresh.validate(model, data.val_dataloader(), verbose=False)[0]
    assert again["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    # predict: every rank predicts its share of the batches (written per rank: spawn/fork launchers return none)
    tokens = data.dataset.tensors[0][:8]
    writer = _Writer(tmp_path)
    predictor = pl.Trainer(strategy=strategy(), accelerator="cpu", devices=2, callbacks=[writer],
                           **{**TRAINER_QUIET, "use_distributed_sampler": True})
    predictor.predict(model, DataLoader(tokens, batch_size=2), return_predictions=False)  # type: ignore[arg-type]
    written = {p.name: torch.load(p, weights_only=True) for p in sorted(tmp_path.glob("rank*.pt"))}
    assert sorted(written) == ["rank0.pt", "rank1.pt"]
    for name, (fn, logits) in written.items():
        assert fn == "predict" and logits.shape == (2, 2, tokens.shape[1], 64), name  # 2 batches of 2 per rank
    one = tiny_gpt(0)
    one.load_state_dict(model.state_dict())
    with torch.no_grad():  # the distributed sampler deals samples 0, 2, 4, 6 to rank 0 and 1, 3, 5, 7 to rank 1
        for rank in (0, 1):
            expected = one(tokens[rank::2]).reshape(2, 2, tokens.shape[1], 64)
            assert torch.allclose(written[f"rank{rank}.pt"][1], expected, atol=1e-5)


class _Writer(BasePredictionWriter):
    def __init__(self, root: Path) -> None:
        super().__init__(write_interval="epoch")
        self.root = root

    def write_on_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Any,
                           batch_indices: Any) -> None:
        fn = pl_module.log_fn[0]  # type: ignore[index]
        torch.save((fn, torch.stack(list(predictions))), self.root / f"rank{trainer.global_rank}.pt")
