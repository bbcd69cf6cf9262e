"""One-device loss curves: the ``train_loss`` each strategy logs is the one-device value of the global batch's loss.

The reference GPT logs ``self.log("train_loss", loss, sync_dist=False)`` in its ``training_step``, as most modules
do. Under data parallelism that is each rank's loss of its part of the batch; the strategies combine such logged
values over ``dp`` (the mean, or the logged ``reduce_fx``) before Lightning sees them, so the curve rank 0 logs is the
curve one device logs (:mod:`lightning_parallel.strategies.logged`). Here rank 0 records the logged value as Lightning
holds it (``trainer.callback_metrics``, no reduction of ours) at every batch, under each strategy family, and it must
equal one device's at every batch within fp32 tolerance. ``-s`` prints the table.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_parallel.strategies import (
    LPDDPStrategy,
    LPDPStrategy,
    LPHybridStrategy,
    LPPipelineStrategy,
    LPShardedStrategy,
    LPTensorStrategy,
)
from lightning_parallel.testing.resume_matrix import _deepspeed_ready

from .token_data import GLOBAL_BATCH, TokenData

STEPS = 6
TOL = 2e-5
FORK: dict[str, Any] = {"start_method": "fork"}
PP = {"pipeline_parallel_size": 2, "num_micro_batches": 2, "pipeline_schedule": "1f1b"}

FAMILIES: dict[str, tuple[Callable[[], Any], int, int]] = {  # name: (strategy, devices, dp)
    "lp_dp x2": (lambda: LPDPStrategy(), 2, 1),
    "lp_ddp x2": (lambda: LPDDPStrategy(**FORK), 2, 2),
    "lp_sharded z1 x2": (lambda: LPShardedStrategy({"zero_stage": 1}, **FORK), 2, 2),
    "lp_sharded z2 x2": (lambda: LPShardedStrategy({"zero_stage": 2}, **FORK), 2, 2),
    "lp_sharded z3 x2": (lambda: LPShardedStrategy({"zero_stage": 3}, **FORK), 2, 2),
    "lp_tensor dp2 x tp2": (lambda: LPTensorStrategy({"tensor_parallel_size": 2, "data_parallel_size": 2}, **FORK),
                            4, 2),
    "lp_pipeline dp2 x pp2": (lambda: LPPipelineStrategy({**PP, "data_parallel_size": 2}, **FORK), 4, 2),
    "lp_hybrid dp2 x pp2 x tp2": (lambda: LPHybridStrategy({**PP, "data_parallel_size": 2,
                                                             "tensor_parallel_size": 2}, **FORK), 8, 2),
}
if _deepspeed_ready():
    from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy

    FAMILIES["lp_zero_offload x2"] = (lambda: LPZeroOffloadStrategy({"zero_stage": 2, "offload": "cpu"}, **FORK),
                                      2, 2)


class LoggedLoss(Callback):
    """Rank 0 appends the logged ``train_loss`` as Lightning holds it, per batch."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(float(trainer.callback_metrics["train_loss"])) + "\n")


def logged_losses(name: str, folder: Path) -> list[float]:
    from tests.helpers import tiny_gpt

    make, devices, dp = ("auto", 1, 1) if name == "1 device" else FAMILIES[name]
    path = folder / f"{''.join(c if c.isalnum() else '_' for c in name)}.jsonl"
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=make() if callable(make) else make,
                         max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False,
                         use_distributed_sampler=False, callbacks=[LoggedLoss(path)])
    trainer.fit(tiny_gpt(bias=False), datamodule=TokenData(GLOBAL_BATCH // dp))
    return [float(x) for x in path.read_text().split()]


def test_every_strategy_logs_the_one_device_loss_of_the_global_batch(tmp_path: Path) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    reference = logged_losses("1 device", tmp_path)
    assert len(reference) == STEPS
    lines, worst = [], {}
    for name in FAMILIES:
        got = logged_losses(name, tmp_path)
        assert len(got) == STEPS, (name, got)
        worst[name] = max(abs(a - b) for a, b in zip(got, reference, strict=True))
        lines.append(f"{name:<26} logged train_loss per step: {' '.join(f'{v:.6f}' for v in got)}  "
                     f"max |diff| vs 1 device: {worst[name]:.1e}")
    print(f"\n{'1 device':<26} logged train_loss per step: {' '.join(f'{v:.6f}' for v in reference)}\n"
          + "\n".join(lines))
    assert max(worst.values()) < TOL, "\n".join(lines)


@pytest.mark.parametrize("reduce_fx", ["sum", "max"])
def test_a_logged_reduce_fx_combines_the_ranks_as_one_device_would(tmp_path: Path, reduce_fx: str) -> None:
    """A value logged with ``reduce_fx="sum"`` (e.g. tokens in the batch) is summed over dp; ``max`` is the max. And
    the batch's collectives outside DDP's C++ reducer: the sum rides with the mean loss and the non-finite-loss
    guard's numbers in one all-reduce (which also replaces Lightning's broadcast of the preemption flag); a max takes
    one more."""
    from tests.helpers import tiny_gpt

    class Counts(type(tiny_gpt())):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, _ = batch
            self.log("first_token", x[:, 0].float().sum() if reduce_fx == "sum" else x[:, 0].float().max(),
                     reduce_fx=reduce_fx)
            return super().training_step(batch, batch_idx)

    class Record(Callback):
        def __init__(self) -> None:
            self.calls: list[str] = []
            self.originals: dict[str, Any] = {}

        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            import torch.distributed as dist

            for name in ("all_reduce", "broadcast", "all_gather", "barrier", "broadcast_object_list"):
                original = self.originals[name] = getattr(dist, name)
                setattr(dist, name, lambda *a, _f=original, _n=name, **k: (self.calls.append(_n), _f(*a, **k))[1])

        def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
            import torch.distributed as dist

            for name, original in self.originals.items():
                setattr(dist, name, original)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_rank == 0:
                with open(tmp_path / "values.jsonl", "a") as f:
                    f.write(json.dumps(float(trainer.callback_metrics["first_token"])) + "\n")
                with open(tmp_path / "calls.jsonl", "a") as f:
                    f.write(json.dumps(self.calls) + "\n")
            self.calls.clear()

    data = TokenData(GLOBAL_BATCH)
    tokens = data.tokens[:, 0].float().view(-1, GLOBAL_BATCH)[:3]  # the first 3 global batches, in order
    expected = (tokens.sum(1) if reduce_fx == "sum" else tokens.amax(1)).tolist()
    model = Counts(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LPDDPStrategy(**FORK), max_steps=3, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, enable_checkpointing=False, use_distributed_sampler=False,
                         callbacks=[Record()])
    trainer.fit(model, datamodule=TokenData(GLOBAL_BATCH // 2))
    got = [float(x) for x in (tmp_path / "values.jsonl").read_text().split()]
    assert got == expected, (got, expected)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    per_batch = ["all_reduce"] if reduce_fx == "sum" else ["all_reduce", "all_reduce"]
    assert calls[1:] == [per_batch] * 2, calls  # the first batch's count starts mid-batch (on_train_start)


def test_sync_dist_sums_count_each_replica_once(tmp_path: Path) -> None:
    """``self.log(..., reduce_fx="sum", sync_dist=True)`` goes through the strategy's ``reduce`` over the world:
    under tensor parallelism the tp peers of a replica see the same batch, so their copies are counted once (the
    value is one device's sum, not tp times it); a mean is the same either way. A vote
    (``reduce_boolean_decision``: ``ModelCheckpoint``, ``EarlyStopping``) still counts every rank."""
    from tests.helpers import tiny_gpt

    class Tokens(type(tiny_gpt())):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("train_tokens", float(batch[0].numel()), reduce_fx="sum", sync_dist=True)
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("val_tokens", float(batch[0].numel()), reduce_fx="sum", sync_dist=True)
            self.log("val_first", batch[0][:, 0].float().mean(), sync_dist=True)

        def on_train_end(self) -> None:  # ModelCheckpoint's and EarlyStopping's votes: every rank counts
            strategy = self.trainer.strategy
            votes = (strategy.reduce_boolean_decision(True), strategy.reduce_boolean_decision(self.global_rank == 0),
                     strategy.reduce_boolean_decision(self.global_rank == 0, all=False))
            assert votes == (True, self.trainer.world_size == 1, True), votes

    def run(strategy: Any, devices: int, dp: int) -> dict[str, float]:
        model = Tokens(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             limit_val_batches=2, val_check_interval=2, enable_checkpointing=False,
                             use_distributed_sampler=False)
        trainer.fit(model, datamodule=TokenData(GLOBAL_BATCH // dp))
        return {k: float(trainer.callback_metrics[k]) for k in ("train_tokens", "val_tokens", "val_first")}

    want = run("auto", 1, 1)
    got = run(LPTensorStrategy({"tensor_parallel_size": 2, "data_parallel_size": 2}, **FORK), 4, 2)
    print(f"\none device {want}\nlp_tensor dp2 x tp2 {got}")
    assert got == pytest.approx(want, rel=1e-6)
