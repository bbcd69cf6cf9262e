"""CUDA / NCCL paths of lp_sharded (skipped without a GPU): ZeRO 1-3 on the GPUs present, against one GPU."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.strategies import LPShardedStrategy
from tests.helpers import TRAINER_QUIET, SequentialTokens, max_rel_diff, tiny_gpt

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lp_sharded_nccl_equals_one_gpu(stage: int) -> None:
    n = min(2, torch.cuda.device_count())
    reference = tiny_gpt(sgd=True)
    pl.Trainer(accelerator="gpu", devices=1, max_steps=8, limit_val_batches=0, **TRAINER_QUIET).fit(
        reference, SequentialTokens(batch_size=8))
    model = tiny_gpt(sgd=True)
    strategy = LPShardedStrategy({"zero_stage": stage}, start_method="spawn")
    pl.Trainer(strategy=strategy, accelerator="gpu", devices=n, max_steps=8, limit_val_batches=0,
               **TRAINER_QUIET).fit(model, SequentialTokens(batch_size=8 // n))
    assert max_rel_diff(model.cpu(), reference.cpu()) < 1e-4  # TF32/cuBLAS reductions differ from CPU fp32
