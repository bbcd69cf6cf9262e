"""lp_tensor under the Lightning Trainer (fork-started gloo ranks) against a single-device reference.

Same global batch and seed: the weights after >= 10 AdamW steps (warmup + cosine, clipping 0.5 by the global norm,
accumulation 2) are compared with one device. Under TP the ranks of a tp group see the same batch (the sampler's
rank and size come from dp), so a (dp, tp) layout reads ``global / dp`` samples per rank.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_parallel  # noqa: F401
from lightning_parallel import ParallelModuleMixin
from lightning_parallel.models import GPT
from lightning_parallel.strategies import LPTensorStrategy

T, GLOBAL_BATCH, STEPS = 16, 8, 10


class _Data(pl.LightningDataModule):
    """Fixed random tokens in order; dp rank r of d gets samples r, r+d, ... (one device: all, in order)."""

    def __init__(self, batch_size: int, samples: int = 2 * STEPS * GLOBAL_BATCH, vocab: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        data = torch.randint(0, vocab, (samples, T + 1), generator=g)
        self.dataset = TensorDataset(data[:, :-1], data[:, 1:])
        self.batch_size = batch_size

    def _loader(self) -> DataLoader:
        trainer: Any = self.trainer
        kwargs = trainer.strategy.distributed_sampler_kwargs if trainer.world_size > 1 else None
        sampler = DistributedSampler(self.dataset, shuffle=False, **kwargs) if kwargs else None
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)


class TinyMLPLM(ParallelModuleMixin, pl.LightningModule):
    """A non-GPT module with its own plan: embedding (vocab) -> 2 residual MLP layers (column, row) -> head (vocab)."""

    def __init__(self, vocab: int = 64, hidden: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(hidden, 2 * hidden), "down":
                                                   nn.Linear(2 * hidden, hidden)}) for _ in range(2))
        self.out = nn.Linear(hidden, vocab, bias=False)

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"emb": "vocab", "layers.*.up": "column", "layers.*.down": "row", "out": "vocab"}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer["down"](torch.relu(layer["up"](x)))
        return self.out(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)}


def _tiny() -> TinyMLPLM:
    torch.manual_seed(0)
    return TinyMLPLM()


def _fit(strategy: Any, devices: int, dp: int, *, model: Any, steps: int = STEPS, **kw: Any) -> tuple[Any, Any]:
    kwargs: dict[str, Any] = dict(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                  limit_val_batches=0, gradient_clip_val=0.5, accumulate_grad_batches=2,
                                  enable_checkpointing=False, use_distributed_sampler=False)
    kwargs.update(kw)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, datamodule=_Data(GLOBAL_BATCH // 2 // dp))  # accumulation 2: a step sees GLOBAL_BATCH
    return model, trainer


def _diff(a: nn.Module, b: nn.Module) -> float:
    sb = b.state_dict()
    return max(float((v - sb[k]).abs().max()) for k, v in a.state_dict().items())


@pytest.fixture(scope="module")
def reference() -> GPT:
    return _fit("auto", 1, 1, model=_gpt())[0]


def _tp(**layout: Any) -> LPTensorStrategy:
    return LPTensorStrategy(layout, start_method="fork")


@pytest.mark.parametrize(("layout", "devices"), [
    ({"tensor_parallel_size": 2}, 2),
    ({"tensor_parallel_size": 2, "sequence_parallel": True}, 2),
    ({"tensor_parallel_size": 2, "zero_stage": 1}, 4),
])
def test_gpt_equals_one_device(reference: GPT, layout: dict[str, Any], devices: int) -> None:
    model, _ = _fit(_tp(**layout), devices, devices // 2, model=_gpt())
    diff = _diff(model, reference)
    print(f"lp_tensor {layout} on {devices} ranks, {STEPS} AdamW steps: max |w - w_1dev| = {diff:.2e}")
    assert diff < 2e-5


def test_gpt_dp2_tp2_zero3_equals_one_device(reference: GPT) -> None:
    model, _ = _fit(_tp(tensor_parallel_size=2, zero_stage=3), 4, 2, model=_gpt())
    diff = _diff(model, reference)
    print(f"lp_tensor dp=2 x tp=2 zero_stage=3 on 4 ranks, {STEPS} AdamW steps: max |w - w_1dev| = {diff:.2e}")
    assert diff < 2e-5


def test_non_gpt_module_with_its_own_plan_equals_one_device() -> None:
    ref, _ = _fit("auto", 1, 1, model=_tiny())
    model, _ = _fit(_tp(tensor_parallel_size=2), 2, 1, model=_tiny())
    diff = _diff(model, ref)
    print(f"lp_tensor TinyMLPLM tp=2, {STEPS} AdamW steps + StepLR: max |w - w_1dev| = {diff:.2e}")
    assert _diff(ref, _tiny()) > 1e-2  # it trained
    assert diff < 2e-5
