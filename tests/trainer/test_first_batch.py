"""The ranks of one model replica must read the same training batch, and the data-parallel replicas different ones:
the first training batch is compared over the world (refused where a replica's peers differ, warned where every
replica holds the same)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lightning_parallel.models import GPT
from lightning_parallel.strategies import LPDDPStrategy, LPPipelineStrategy, LPTensorStrategy
from tests.trainer.token_data import T

_g = torch.Generator().manual_seed(7)
_TOKENS = torch.randint(0, 64, (96, T + 1), generator=_g)


class _Stream(IterableDataset):
    """Samples split by ``split``: "world" (torch.distributed's global rank: the usual streaming pattern, wrong for
    model parallelism), "dp" (the data-parallel coordinates), or "none"."""

    def __init__(self, split: str, dp_rank: int, dp_size: int) -> None:
        self.split, self.dp_rank, self.dp_size = split, dp_rank, dp_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, step = {"world": (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1),
                       "dp": (self.dp_rank, self.dp_size), "none": (0, 1)}[self.split]
        for i in range(start, len(_TOKENS), step):
            yield _TOKENS[i, :-1], _TOKENS[i, 1:]


class _StreamData(pl.LightningDataModule):
    def __init__(self, split: str, batch_size: int) -> None:
        super().__init__()
        self.split, self.batch_size = split, batch_size

    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs if self.trainer.world_size > 1 else None
        rank, size = (kwargs["rank"], kwargs["num_replicas"]) if kwargs else (0, 1)
        return DataLoader(_Stream(self.split, rank, size), batch_size=self.batch_size)


def _fit(strategy: Any, devices: int, split: str, batch_size: int) -> None:
    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=2, bias=False)
    pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
               enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
               num_sanity_val_steps=0, limit_val_batches=0).fit(model, datamodule=_StreamData(split, batch_size))


def test_peers_of_a_replica_must_read_the_same_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream split by the global rank gave tp2's peers different inputs and pp2's last stage another rank's
    labels (2.3e-02 from one device after 4 steps, silently): refused on every rank at the first batch. Split by the
    data-parallel coordinates it trains; a stream that every replica reads whole is warned about."""
    for strategy in (LPTensorStrategy({"tensor_parallel_size": 2}, start_method="fork"),
                     LPPipelineStrategy({"pipeline_parallel_size": 2}, start_method="fork")):
        with pytest.raises(Exception, match="the first training batch differs between global ranks 0 and 1"):
            _fit(strategy, 2, "world", 4)
    _fit(LPTensorStrategy({"tensor_parallel_size": 2}, start_method="fork"), 2, "dp", 4)
    from lightning_parallel.strategies import base

    warned = tmp_path / "warned.txt"  # (pytest records the forked ranks' warnings where nothing can read them)
    monkeypatch.setattr(base, "rank_zero_warn", lambda message, *a, **k: warned.open("a").write(f"{message}\n"))
    _fit(LPDDPStrategy(start_method="fork"), 2, "none", 2)
    assert "the first training batch is the same on all 2 data-parallel replicas" in warned.read_text()
    warned.unlink()
    _fit(LPDDPStrategy(start_method="fork"), 2, "dp", 2)
    assert not warned.exists() or "the same on all" not in warned.read_text()


def test_the_fingerprint_is_exact() -> None:
    """Equal tensors give equal fingerprints -- NaN (not equal to itself), values whose sums overflow, sparse
    tensors -- and a changed element another."""
    from lightning_parallel.strategies.base import _fingerprint

    for t in (torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1e308, 1e308, -1e308, -1e308], dtype=torch.float64),
              torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,)), torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)):
        assert _fingerprint(t) == _fingerprint(t.clone()), t
    assert _fingerprint(torch.tensor([1.0, 2.0])) != _fingerprint(torch.tensor([2.0, 1.0]))
