"""Modules and data that go wrong on purpose, importable by class path from the command line (``--model
lightning_parallel.testing.faulty.NaNLossGPT``): what the reliability tests and ``docs/reliability.md``'s examples
run. Not for training.

* :class:`NaNLossGPT` -- the reference GPT whose training loss is NaN from a given step on (every rank);
* :class:`OptimizerChoiceGPT` -- the reference GPT with another optimizer (``sgd``) or an extra LR scheduler
  (``StepLR``): a checkpoint of the plain GPT does not resume into it;
* :class:`ScalarGainGPT` -- the reference GPT with a 0-d (scalar) parameter scaling its logits, which FSDP2
  (ZeRO-3) cannot shard;
* :class:`HalfHeadGPT` -- the reference GPT with its output projection alone in bf16: one param group (one FSDP2
  unit) of two dtypes, which the flat ZeRO-1/2 and FSDP2 cannot flatten;
* :class:`DictBatchTextData` -- :class:`~lightning_parallel.data.TextDataModule` whose batches are dicts
  (``input_ids``, ``labels``), which the default ``pipeline_batch`` cannot split.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_parallel.data import TextDataModule
from lightning_parallel.models import GPT

__all__ = ["DictBatchTextData", "HalfHeadGPT", "NaNLossGPT", "OptimizerChoiceGPT", "ScalarGainGPT"]


class NaNLossGPT(GPT):
    """The GPT whose training loss is NaN from ``global_step >= nan_from_step`` (the step ``nan_from_step + 1``)."""

    def __init__(self, *args: Any, nan_from_step: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nan_from_step = nan_from_step

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        loss = super().pipeline_loss(output, target)
        trainer = self._trainer
        if trainer is not None and trainer.training and trainer.global_step >= self.nan_from_step:
            loss = loss * float("nan")
        return loss


class ScalarGainGPT(GPT):
    """The GPT whose logits are scaled by a 0-d parameter ``gain`` on the module itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gain = torch.nn.Parameter(torch.tensor(1.0))

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return super().pipeline_loss(output * self.gain, target)


class HalfHeadGPT(GPT):
    """The GPT whose ``head.lm_head`` is cast to bf16, the rest fp32."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert self.head is not None
        self.head.lm_head.to(torch.bfloat16)


class OptimizerChoiceGPT(GPT):
    """The GPT with ``optimizer`` ``adamw`` (as :class:`GPT`) or ``sgd`` (momentum 0.9), and with ``step_lr`` a
    ``StepLR`` after the GPT's warmup + cosine schedule."""

    def __init__(self, *args: Any, optimizer: str = "adamw", step_lr: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer_name, self.step_lr = optimizer, step_lr

    def configure_optimizers(self) -> Any:
        conf = super().configure_optimizers()
        optimizer, scheduler = conf["optimizer"], conf["lr_scheduler"]
        if self.optimizer_name == "sgd":
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
            optimizer = torch.optim.SGD(groups, lr=float(self.hparams["lr"]), momentum=0.9)
            scheduler = {**scheduler, "scheduler": torch.optim.lr_scheduler.LambdaLR(
                optimizer, scheduler["scheduler"].lr_lambdas[0])}
        schedulers = [scheduler]
        if self.step_lr:
            schedulers.append({"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=100),
                               "interval": "step"})
        return [optimizer], schedulers


class DictBatchTextData(TextDataModule):
    """:class:`TextDataModule` whose training batches are ``{"input_ids": x, "labels": y}``."""

    def train_dataloader(self) -> DataLoader:
        loader = super().train_dataloader()
        return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler,
                          drop_last=loader.drop_last, collate_fn=_as_dict)


def _as_dict(items: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    return {"input_ids": torch.stack([x for x, _ in items]), "labels": torch.stack([y for _, y in items])}
