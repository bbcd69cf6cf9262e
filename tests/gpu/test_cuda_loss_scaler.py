"""``16-mixed`` on CUDA (skipped without two GPUs): Lightning's own ``Trainer(precision="16-mixed")`` -- its CUDA
``GradScaler`` from its default scale, NCCL -- under ZeRO-2 (against ``lp_ddp``: the same per-replica batch, so the
same overflows) and a two-stage pipeline (against one GPU). Every rank keeps the reference's scale after every batch
(the library agrees the scaler's check over the ranks, ``parallel/scaler.py``) and the weights match it; the CPU
version of this check, with a scaler made to keep overflowing, is ``tests/trainer/test_loss_scaler.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.strategies import LPDDPStrategy, LPPipelineStrategy, LPShardedStrategy
from tests.helpers import TRAINER_QUIET, SequentialTokens, max_rel_diff, tiny_gpt
from tests.trainer.test_loss_scaler import Scales

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="16-mixed across ranks needs 2 GPUs")]


def _fit(strategy: Any, devices: int, batch: int, folder: Path) -> tuple[torch.nn.Module, list[list[float]]]:
    folder.mkdir()
    model = tiny_gpt(sgd=True)
    pl.Trainer(strategy=strategy, accelerator="gpu", devices=devices, precision="16-mixed", max_steps=12,
               limit_val_batches=0, callbacks=[Scales(folder)], **TRAINER_QUIET).fit(model, SequentialTokens(
                   batch_size=batch))
    return model.cpu(), [json.loads((folder / f"rank{r}.json").read_text())["scales"] for r in range(devices)]


@pytest.mark.parametrize("case", ["zero2", "pp2"])
def test_16_mixed_scales_alike_on_every_rank(case: str, tmp_path: Path) -> None:
    if case == "zero2":
        reference, want = _fit(LPDDPStrategy(start_method="spawn"), 2, 4, tmp_path / "reference")
        model, scales = _fit(LPShardedStrategy({"zero_stage": 2}, start_method="spawn"), 2, 4, tmp_path / "run")
    else:
        reference, want = _fit("auto", 1, 8, tmp_path / "reference")
        model, scales = _fit(LPPipelineStrategy({"pipeline_parallel_size": 2, "num_micro_batches": 4},
                                                start_method="spawn"), 2, 8, tmp_path / "run")
    assert all(rank == want[0] for rank in [*want, *scales]), (want, scales)
    assert max_rel_diff(model, reference) < 1e-2
