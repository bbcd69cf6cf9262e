"""Modules built the large-model ways (layers made in ``configure_model()``, tensors on the meta device): the fork
launchers hand the trained weights back to the calling process's module, and what a layout cannot build is refused
before any rank starts, with the way that works."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_parallel.config import LayoutError
from lightning_parallel.models import GPT
from lightning_parallel.strategies import LPDDPStrategy, LPPipelineStrategy, LPShardedStrategy, LPTensorStrategy
from tests.trainer.token_data import T, fit

_SIZES = dict(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=2, bias=False)


class _LazyGPT(GPT):
    """The reference GPT with its layers built in ``configure_model()`` (Lightning's pattern for large models),
    seeded there, idempotent as Lightning asks."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        del self.embed, self.head
        self.embed: Any = None
        self.head: Any = None
        self.blocks = nn.ModuleDict()
        self.built = False

    def configure_model(self) -> None:
        if self.built:
            return
        self.built = True
        torch.manual_seed(0)
        self.embed = self._new_layer("embed")
        self.blocks = nn.ModuleDict({str(i): self._new_layer("block") for i in range(self.hparams.n_layer)})
        self.head = self._new_layer("head")
        self.init_weights(default_init=False)


def test_layers_built_in_configure_model_reach_the_calling_process() -> None:
    """The ranks build the layers in ``configure_model()`` and train them as one device does; Lightning then loads
    rank 0's weights into the calling process's module without strictness, where that hook never ran: the module
    had no layers after the fit (0 of 20 state keys; Lightning's own ``ddp_fork`` the same)."""
    reference, _ = fit("auto", 1, 1, model=_LazyGPT(**_SIZES), steps=3)
    expected = reference.state_dict()
    assert len(expected) == 20
    worst = {}
    for name, strategy in (("lp_ddp", LPDDPStrategy(start_method="fork")),
                           ("zero3", LPShardedStrategy({"zero_stage": 3}, start_method="fork"))):
        model, _ = fit(strategy, 2, 2, model=_LazyGPT(**_SIZES), steps=3)
        got = model.state_dict()
        assert set(got) == set(expected), (name, len(got))
        worst[name] = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    print("\nthe calling process's module against one device:", worst)
    assert all(v <= 1e-6 for v in worst.values()), worst


class _MetaMLP(pl.LightningModule):
    """A module without ``init_weights()``: built on the meta device, nothing can fill it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(T, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0].float()).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_modules_a_layout_cannot_build_are_refused_before_launch() -> None:
    """``configure_model()`` under a pipeline: the stages are cut before the ranks start, and the refusal said "Fix:
    pipeline_parallel_size x virtual_pipeline_stages <= 0". A meta-device module without ``init_weights()`` under
    lp_ddp: the ranks failed in set-up behind Lightning's teardown error ("Cannot copy out of meta tensor")."""
    with pytest.raises(LayoutError, match=r"before its configure_model\(\) has run.*torch.device\('meta'\)"):
        fit(LPPipelineStrategy({"pipeline_parallel_size": 2}, start_method="fork"), 2, 1,
            model=_LazyGPT(**_SIZES), steps=1)
    with torch.device("meta"):
        model = _MetaMLP()
    with pytest.raises(LayoutError, match=r"built on the meta device .* no init_weights\(\)"):
        fit(LPDDPStrategy(start_method="fork"), 2, 2, model=model, steps=1)


class _OwnParameters(GPT):
    """Parameters outside every layer: a temperature on the LightningModule itself scaling the logits in the loss
    (after the forward), and a non-contiguous mixing matrix (a transposed view) on the hidden state."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        n = kwargs["n_embd"]
        self.log_temp = nn.Parameter(torch.tensor([0.3]))
        self.mix = nn.Parameter((torch.eye(n) + 0.05 * torch.randn(n, n)).t())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        *layers, head = self.pipeline_layers()
        x = idx
        for layer in layers:
            x = layer(x)
        return head(x @ self.mix)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().pipeline_loss(output * self.log_temp.exp(), target)


def test_parameters_outside_every_layer_train_as_one_device() -> None:
    """ZeRO-3 resharded the root after its forward, so the loss met the temperature as a sharded DTensor ("got mixed
    torch.Tensor and DTensor"), and FSDP2 refused the non-contiguous matrix in every rank; under tensor parallelism
    the temperature's gradient through the vocab-parallel logits is a DTensor on a plain parameter, and the first
    AdamW step failed (a bare AssertionError in DTensor's dispatch)."""
    torch.manual_seed(0)
    reference, _ = fit("auto", 1, 1, model=_OwnParameters(**_SIZES), steps=3)
    expected = reference.state_dict()
    worst = {}
    for name, strategy, dp in (("zero3", LPShardedStrategy({"zero_stage": 3}, start_method="fork"), 2),
                               ("tp2", LPTensorStrategy({"tensor_parallel_size": 2}, start_method="fork"), 1)):
        torch.manual_seed(0)
        model, _ = fit(strategy, 2, dp, model=_OwnParameters(**_SIZES), steps=3)
        got = model.state_dict()
        worst[name] = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    moved = float((expected["log_temp"] - 0.3).abs().max())
    print(f"\nparameters outside every layer, max |w - w_1dev|: {worst}; the temperature moved {moved:.2e}")
    assert moved > 1e-4 and all(v <= 1e-5 for v in worst.values()), worst
