"""CUDA / NCCL paths of lp_tensor (skipped without two GPUs): tp=2, and tp=2 with sequence parallelism, against one
GPU on the same global batch."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.strategies import LPTensorStrategy
from tests.helpers import TRAINER_QUIET, SequentialTokens, max_rel_diff, tiny_gpt

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism on CUDA needs 2 GPUs")
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_lp_tensor_nccl_equals_one_gpu(sequence_parallel: bool) -> None:
    reference = tiny_gpt(sgd=True)
    pl.Trainer(accelerator="gpu", devices=1, max_steps=8, limit_val_batches=0, **TRAINER_QUIET).fit(
        reference, SequentialTokens(batch_size=8))
    model = tiny_gpt(sgd=True)
    strategy = LPTensorStrategy({"tensor_parallel_size": 2, "sequence_parallel": sequence_parallel},
                                start_method="spawn")
    pl.Trainer(strategy=strategy, accelerator="gpu", devices=2, max_steps=8, limit_val_batches=0,
               **TRAINER_QUIET).fit(model, SequentialTokens(batch_size=8))  # tp peers see the same batch
    assert max_rel_diff(model.cpu(), reference.cpu()) < 1e-4  # TF32/cuBLAS reductions differ from CPU fp32
