"""Small models and data with a controlled global batch, shared by equivalence tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_parallel.models import GPT

TRAINER_QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "use_distributed_sampler": False,
}


class SGDGPT(GPT):
    """The GPT with plain SGD + momentum: unlike Adam, its steps scale with the gradient, so a wrong gradient
    scale (a sum instead of a mean over ranks) shows in the weights."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def tiny_gpt(seed: int = 0, *, sgd: bool = False, **overrides: Any) -> GPT:
    pl.seed_everything(seed, verbose=False)
    kwargs: dict[str, Any] = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64,
                              "lr": 1e-3, "warmup_steps": 2}
    kwargs.update(overrides)
    return SGDGPT(**kwargs) if sgd else GPT(**kwargs)


class SequentialTokens(pl.LightningDataModule):
    """Random tokens served in order, split over data-parallel ranks by the data module itself.

    Lightning's automatic distributed sampler always shuffles training data (with its own seed), so equivalence
    runs pass ``use_distributed_sampler=False`` and this module builds ``DistributedSampler(shuffle=False)`` from
    the strategy's dp rank and size: rank r gets samples r, r+N, ..., and N ranks with ``batch_size`` each see
    exactly the global batches of one device with ``N * batch_size``."""

    def __init__(self, batch_size: int, n_samples: int = 256, block_size: int = 16, vocab_size: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, vocab_size, (n_samples, block_size + 1), generator=g)
        self.dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        sampler = DistributedSampler(self.dataset, shuffle=False, **kwargs) if kwargs else None
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)


def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest element-wise difference over all weights."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)


def max_rel_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest per-tensor relative difference ``||a - b|| / ||b||`` (the fp32 tolerance the contract states).

    Element-wise, Adam can turn a rounding difference in a gradient that is nearly zero (samples cancelling)
    into a visible step of that one element, so the element-wise figure is reported and bounded more loosely."""
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k].float() - sb[k].float()).norm() / sb[k].float().norm().clamp_min(1e-12)) for k in sa)


_LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "GPUS_PER_NODE", "NPROC_PER_NODE", "RANK",
                       "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")


def launch_env(**extra: str) -> dict[str, str]:
    """The environment for a launch script or CLI run started by a test: this process's, without what a launcher or
    an earlier run set (SLURM, torchelastic, Lightning and library variables, the rendezvous), one thread per
    process, this checkout importable, no CUDA."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_", "LP_")) and k not in _LAUNCHER_VARIABLES}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                "LP_PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}, **extra)
    return env
