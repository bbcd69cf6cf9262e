"""lp_dp (alias dp) at the Trainer level: equal to one device on the same global batch; nested and uneven batches,
logging, predict, checkpoints, the CLI recipe, and the DDP side of the exchange accounting."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_parallel import LPDDPStrategy
from lightning_parallel.callbacks import CountCommunication
from lightning_parallel.strategies.dp import LPDPStrategy
from tests.helpers import TRAINER_QUIET, SequentialTokens, max_abs_diff, tiny_gpt

STEPS = 12
GLOBAL_BATCH = 6  # divisible by 2 and 3: every device gets a slice; uneven cases have their own tests


def _trainer(strategy: Any, devices: int, **kwargs: Any) -> pl.Trainer:
    options = {"max_steps": STEPS, "limit_val_batches": 0, **TRAINER_QUIET, **kwargs}
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, **options)


@pytest.fixture(scope="module")
def reference() -> pl.LightningModule:
    """One device, the global batch, 12 AdamW steps (warmup + cosine), dropout off."""
    model = tiny_gpt()
    _trainer("auto", 1).fit(model, SequentialTokens(batch_size=GLOBAL_BATCH))
    return model


@pytest.mark.parametrize(("devices", "backward"), [(2, "auto"), (3, "auto"), (2, "graph")])
def test_lp_dp_equals_one_device(reference: pl.LightningModule, devices: int, backward: Any,
                                 record_property: Any) -> None:
    model = tiny_gpt()
    assert max_abs_diff(model, reference) > 1e-3  # the reference really trained
    trainer = _trainer("dp" if backward == "auto" else LPDPStrategy(backward=backward), devices,
                       callbacks=[CountCommunication()])  # counting is opt-in
    trainer.fit(model, SequentialTokens(batch_size=GLOBAL_BATCH))
    assert isinstance(trainer.strategy, LPDPStrategy) and trainer.world_size == 1
    diff = max_abs_diff(model, reference)
    record_property("max_abs_weight_diff", diff)
    mode = "threads" if backward == "auto" else backward  # auto = threads on CPU
    print(f"lp_dp {devices} devices (backward={mode}) vs 1 device after {STEPS} AdamW steps: "
          f"max abs weight diff {diff:.3e}")
    assert diff < 5e-6
    counter = trainer.strategy.exchange_counter
    assert counter.steps == STEPS and counter.exchanges_per_step == 5
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    kinds = {s.kind: s for s in counter.stats()}
    assert kinds["replicate_params"].bytes_per_step == param_bytes * (devices - 1)
    assert kinds["reduce_grads"].bytes_per_step == param_bytes * (devices - 1)


def test_gradient_accumulation_and_clipping_equal_one_device() -> None:
    options = {"max_steps": 6, "accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    ref = tiny_gpt()
    _trainer("auto", 1, **options).fit(ref, SequentialTokens(batch_size=GLOBAL_BATCH))
    model = tiny_gpt()
    _trainer("lp_dp", 3, **options).fit(model, SequentialTokens(batch_size=GLOBAL_BATCH))
    assert max_abs_diff(model, ref) < 5e-6


class _Regression(pl.LightningModule):
    """A small MLP with SGD whose batches are nested: ``{"x": x, "meta": {"target": (y,), "tag": "t"}}``;
    logs a mean (loss), a sum (samples seen) and, in validation, a ``sync_dist`` metric."""

    def __init__(self, nested: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.nested = nested
        self.log_calls = 0

    def _unpack(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.nested:
            assert batch["meta"]["tag"] == ["t"] * len(batch["x"])  # collated strings are split too
            return batch["x"], batch["meta"]["target"][0]
        return batch[0], batch[1]

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = self._unpack(batch)
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.log_dict({"samples": float(x.shape[0])}, reduce_fx="sum")
        return {"loss": loss, "pred": self.net(x).detach()}

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self._unpack(batch)
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(self._unpack(batch)[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Nested(Dataset[Any]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return {"x": self.x[i], "meta": {"target": (self.y[i],), "tag": "t"}}


def _nested_fit(strategy: Any, devices: int, n: int, batch_size: int, **kwargs: Any) -> tuple[_Regression, pl.Trainer]:
    model = _Regression()
    loader = DataLoader(_Nested(n), batch_size=batch_size)
    trainer = _trainer(strategy, devices, max_epochs=2, max_steps=-1, **kwargs)
    trainer.fit(model, loader, DataLoader(_Nested(n), batch_size=batch_size))
    return model, trainer


@pytest.mark.parametrize(("n", "batch_size", "devices"), [(12, 6, 2), (10, 4, 3), (5, 1, 2)],
                         ids=["nested-even", "last-batch-smaller", "fewer-samples-than-devices"])
def test_nested_and_uneven_batches_equal_one_device(n: int, batch_size: int, devices: int) -> None:
    ref, ref_trainer = _nested_fit("auto", 1, n, batch_size, limit_val_batches=1.0)
    dp, dp_trainer = _nested_fit("lp_dp", devices, n, batch_size, limit_val_batches=1.0)
    assert max_abs_diff(dp, ref) < 1e-6
    for key in ("train_loss", "val_loss", "samples"):
        torch.testing.assert_close(dp_trainer.callback_metrics[key], ref_trainer.callback_metrics[key],
                                   rtol=1e-5, atol=1e-6)
    last_batch = n - (math.ceil(n / batch_size) - 1) * batch_size
    assert float(dp_trainer.callback_metrics["samples"]) == last_batch  # summed over the slices, logged once


def test_predict_concatenates_per_sample_outputs() -> None:
    model = _Regression()
    loader = DataLoader(_Nested(7), batch_size=5)
    ref = pl.Trainer(accelerator="cpu", devices=1, **TRAINER_QUIET).predict(model, loader)
    out = pl.Trainer(strategy="dp", accelerator="cpu", devices=3, **TRAINER_QUIET).predict(model, loader)
    assert ref is not None and out is not None
    assert [o.shape for o in out] == [(5, 1), (2, 1)]
    torch.testing.assert_close(torch.cat(out), torch.cat(ref))  # type: ignore[arg-type]


def test_checkpoint_holds_the_plain_state_dict_and_resumes(tmp_path: Path) -> None:
    model = tiny_gpt()
    trainer = _trainer("lp_dp", 2, max_steps=4)
    trainer.fit(model, SequentialTokens(batch_size=GLOBAL_BATCH))
    path = tmp_path / "dp.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["state_dict"].keys() == model.state_dict().keys()
    restored = tiny_gpt(seed=5)
    restored.load_state_dict(checkpoint["state_dict"])
    assert max_abs_diff(restored, model) == 0.0
    resumed = _trainer("lp_dp", 2, max_steps=6)
    resumed.fit(restored, SequentialTokens(batch_size=GLOBAL_BATCH), ckpt_path=path)
    assert resumed.global_step == 6
    # and a one-device Trainer takes the lp_dp checkpoint as it is
    single = _trainer("auto", 1, max_steps=6)
    single.fit(tiny_gpt(seed=5), SequentialTokens(batch_size=GLOBAL_BATCH), ckpt_path=path)
    assert single.global_step == 6


def test_any_lightning_module_trains_under_both_names() -> None:
    for name in ("dp", "lp_dp"):
        model = BoringModel()
        before = [p.detach().clone() for p in model.parameters()]
        trainer = _trainer(name, 2, max_steps=3, limit_val_batches=1)
        trainer.fit(model)
        assert trainer.global_step == 3 and trainer.num_devices == 2
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_manual_optimization_and_sync_batchnorm_are_refused_with_the_fix() -> None:
    class Manual(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="automatic optimization"):
        _trainer("dp", 2, max_steps=1).fit(Manual())
    with pytest.raises(ValueError, match="sync_batchnorm"):
        _trainer("dp", 2, max_steps=1, sync_batchnorm=True).fit(BoringModel())


class _Counting(_Regression):
    """Counts its forward calls in a buffer it reassigns (not in place), and optionally calls a torchmetrics metric
    inside the training step."""

    def __init__(self, metric_in_step: bool = False) -> None:
        super().__init__(nested=False)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("cache", torch.ones(3))
        self.metric_in_step = metric_in_step
        from torchmetrics import MeanAbsoluteError

        self.mae = MeanAbsoluteError()

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        self.calls = self.calls + 1
        self.cache = None
        if self.metric_in_step:
            self.log("mae", self.mae(self.net(batch[0]), batch[1]))
        return super().training_step(batch, batch_idx)


def test_a_reassigned_buffer_is_kept_and_a_metric_updated_in_a_step_is_refused() -> None:
    """A buffer the step reassigns (``self.calls = self.calls + 1``) stayed on the first replica: 0.0 where one device
    counts 6. A torchmetrics metric called inside a step updated the module's one metric object from every replica's
    thread at once (it logged 0.4756 where one device logs 0.6126), silently. Values logged under 64-true were
    combined in fp32."""
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(12, 4, generator=g, dtype=torch.float64),
                         torch.randn(12, 1, generator=g, dtype=torch.float64))
    models = []
    for strategy, devices in (("auto", 1), ("lp_dp", 2)):
        model = _Counting()
        _trainer(strategy, devices, max_steps=6, precision="64-true").fit(model, DataLoader(data, batch_size=2))
        models.append(model)
    assert float(models[0].calls) == float(models[1].calls) == 6.0
    assert models[0].cache is None and models[1].cache is None  # a buffer set to None in the step, as well
    assert max_abs_diff(models[1], models[0]) < 1e-12
    with pytest.raises(ValueError, match=r"lp_dp: the torchmetrics metric 'mae' was updated inside training_step.*"
                                         r"Fix: update it from the step's combined outputs in on_train_batch_end"):
        _trainer("lp_dp", 2, max_steps=1).fit(_Counting(metric_in_step=True),
                                              DataLoader(TensorDataset(*(t.float() for t in data.tensors)), 2))


def test_lp_dp_recipe_runs_from_the_cli(tmp_path: Path, root: Path) -> None:
    from lightning_parallel.cli import main

    run_dir = str(tmp_path / "gpt_dp")
    code = main(["fit", "--config", str(root / "recipes/gpt_dp.yaml"), "--trainer.max_steps", "4",
                 "--trainer.val_check_interval", "2",
                 "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", run_dir,
                 "--trainer.logger.init_args.save_dir", run_dir, "--model.init_args.n_layer", "1",
                 "--model.init_args.block_size", "32", "--data.init_args.block_size", "32",
                 "--data.init_args.batch_size", "4"])
    assert code == 0
    assert list(Path(run_dir).rglob("last.ckpt"))


def _write_counter(path: Path) -> pl.Callback:
    class Dump(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.global_rank == 0:
                path.write_text(json.dumps(trainer.strategy.exchange_counter.as_dict()))  # type: ignore[attr-defined]

    return Dump()


def test_ddp_counting_hook_is_exact_and_counts_one_allreduce_per_step(tmp_path: Path) -> None:
    data = RandomDataset(32, 24)
    models = []
    for hook in ("none", "count"):
        model = BoringModel()
        torch.manual_seed(0)
        model.layer.reset_parameters()
        trainer = _trainer(LPDDPStrategy(start_method="fork", comm_hook=hook), 2, max_steps=5,
                           callbacks=[_write_counter(tmp_path / f"{hook}.json")])
        trainer.fit(model, DataLoader(data, batch_size=3))
        models.append(model)
    assert max_abs_diff(models[0], models[1]) == 0.0  # the counting hook is the exact all-reduce
    counted = json.loads((tmp_path / "count.json").read_text())
    param_bytes = sum(p.numel() * 4 for p in models[1].parameters())
    assert counted["steps"] == 5 and counted["exchanges_per_step"] == 1
    assert counted["kinds"]["allreduce_grads"]["bytes_per_step"] == param_bytes
