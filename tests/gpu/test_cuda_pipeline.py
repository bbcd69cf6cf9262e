"""CUDA / NCCL paths of lp_pipeline (skipped without two GPUs): pp=2 under 1F1B and interleaved 1F1B, against one
GPU on the same global batch (activations and gradients cross between the GPUs point-to-point over NCCL)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.strategies import LPPipelineStrategy
from tests.helpers import TRAINER_QUIET, SequentialTokens, max_rel_diff, tiny_gpt

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="pipeline parallelism on CUDA needs 2 GPUs")
@pytest.mark.parametrize("layout", [
    {"pipeline_schedule": "1f1b", "num_micro_batches": 4},
    {"pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_stages": 2, "num_micro_batches": 4},
], ids=["1f1b", "interleaved"])
def test_lp_pipeline_nccl_equals_one_gpu(layout: dict[str, Any]) -> None:
    reference = tiny_gpt(sgd=True)
    pl.Trainer(accelerator="gpu", devices=1, max_steps=8, limit_val_batches=0, **TRAINER_QUIET).fit(
        reference, SequentialTokens(batch_size=8))
    model = tiny_gpt(sgd=True)
    strategy = LPPipelineStrategy({"pipeline_parallel_size": 2, **layout}, start_method="spawn")
    pl.Trainer(strategy=strategy, accelerator="gpu", devices=2, max_steps=8, limit_val_batches=0,
               **TRAINER_QUIET).fit(model, SequentialTokens(batch_size=8))  # pipeline peers see the same batch
    assert max_rel_diff(model.cpu(), reference.cpu()) < 1e-4  # TF32/cuBLAS reductions differ from CPU fp32
