"""``16-mixed``'s gradient scaler where the ranks hold different gradients: ZeRO's shards over dp (the flat ZeRO-1/2
shard, FSDP2's), tp's shards, a pipeline's stages.

``16-mixed`` needs CUDA in Lightning (``Trainer(accelerator="cpu", precision="16-mixed")`` warns and runs
``bf16-mixed``), so the runs here pass Lightning's own ``MixedPrecision("16-mixed", "cpu")`` plugin with torch's CPU
``GradScaler``: fp16 autocast on the CPU, the same plugin code a GPU run goes through. The scaler grows its scale by 16x
every 2 clean steps, so the run keeps meeting the scale at which some gradients overflow and others do not -- the step
where ranks that check only their own gradients part (before the library agreed the check: ZeRO-2's ranks waited on each
other until the collective timeout; a pipeline never scaled its loss, so its gradients were divided by the scale, 0.087
from one device). Each rank records its scale after every batch: every rank must hold the reference's sequence (every
skip taken together), and the weights must match the reference's.

The reference: one device for the layouts of one replica (tp, pp: each rank's backward meets the one device's gradient
magnitudes); ``lp_ddp`` on as many replicas for the ZeRO stages -- a replica's backward of its half of the batch carries
gradients twice one device's (the mean over half the samples), so it overflows at half the scale, as torch DDP does;
DDP's all-reduced gradients are the same on every rank, so it needs no agreement.
"""

from __future__ import annotations

import itertools
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_parallel.models import GPT
from lightning_parallel.strategies import (
    LPDDPStrategy,
    LPHybridStrategy,
    LPPipelineStrategy,
    LPShardedStrategy,
    LPTensorStrategy,
)
from tests.helpers import max_rel_diff, tiny_gpt

from .token_data import TokenData, fit

FORK: dict[str, Any] = {"start_method": "fork"}
PP = {"pipeline_parallel_size": 2, "num_micro_batches": 2, "pipeline_schedule": "1f1b"}
STEPS = 8
STRATEGIES: dict[str, tuple[Callable[[], Any], int, int]] = {  # name: (strategy, devices, dp)
    "lp_sharded z1 x2": (lambda: LPShardedStrategy({"zero_stage": 1}, **FORK), 2, 2),
    "lp_sharded z2 x2": (lambda: LPShardedStrategy({"zero_stage": 2}, **FORK), 2, 2),
    "lp_sharded z3 x2": (lambda: LPShardedStrategy({"zero_stage": 3}, **FORK), 2, 2),
    "lp_tensor tp2": (lambda: LPTensorStrategy({"tensor_parallel_size": 2}, **FORK), 2, 1),
    "lp_pipeline pp2": (lambda: LPPipelineStrategy(PP, **FORK), 2, 1),
    "lp_pipeline dp2 x pp2 z1": (lambda: LPPipelineStrategy({**PP, "data_parallel_size": 2, "zero_stage": 1}, **FORK),
                                 4, 2),
    "lp_hybrid pp2 x tp2": (lambda: LPHybridStrategy({**PP, "tensor_parallel_size": 2}, **FORK), 4, 1),
}


def _plugin() -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_factor=16.0, growth_interval=2)
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


class Scales(Callback):
    """Each rank's scale after every batch, and whether the scaler skipped the step, into ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        kind = type(trainer.precision_plugin.scaler).__name__  # type: ignore[attr-defined]
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps({"scales": self.scales,
                                                                                  "scaler": kind}))


def _run(strategy: Any, devices: int, dp: int, folder: Path) -> tuple[torch.nn.Module, list[dict[str, Any]]]:
    folder.mkdir()
    model, _ = fit(strategy, devices, dp, model=tiny_gpt(bias=False), steps=STEPS, plugins=[_plugin()],
                   callbacks=[Scales(folder)])
    return model, [json.loads((folder / f"rank{r}.json").read_text()) for r in range(devices)]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[torch.nn.Module, list[float]]]:
    """By dp: one device (dp = 1) and ``lp_ddp`` x2 (dp = 2), each with its scales after every batch."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("scaler")
    out = {}
    for dp, strategy in ((1, "auto"), (2, LPDDPStrategy(**FORK))):
        model, ranks = _run(strategy, dp, dp, folder / f"dp{dp}")
        scales = ranks[0]["scales"]
        assert all(record["scales"] == scales for record in ranks), ranks
        # the run meets overflows: some steps skipped (the scale fell), some taken with growth (it rose)
        steps = list(itertools.pairwise(scales))
        assert any(b < a for a, b in steps) and any(b > a for a, b in steps), scales
        out[dp] = (model, scales)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_loss_scaler_skips_and_scales_alike_on_every_rank(
        name: str, references: dict[int, tuple[torch.nn.Module, list[float]]], tmp_path: Path) -> None:
    make, devices, dp = STRATEGIES[name]
    model, ranks = _run(make(), devices, dp, tmp_path / "run")
    reference, scales = references[dp]
    for rank, record in enumerate(ranks):
        assert record["scaler"] == "AgreedGradScaler", (name, rank, record)  # its check all-reduced over the world
        assert record["scales"] == scales, (name, rank, record["scales"], scales)
    diff = max_rel_diff(model, reference)
    print(f"{name}: scales {scales}; largest relative weight difference from the reference {diff:.1e}")
    assert diff < 1e-2, (name, diff)


def _one_sided_overflow(rank: int, world: int) -> dict[str, Any]:
    """Only rank 0's gradient overflows, on plain and on DTensor parameters, under a plain and a fused AdamW (a fused
    optimizer unscales inside its step: Lightning never calls ``unscale_`` for it, so the check is the step's own)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from lightning_parallel.parallel.scaler import AgreedGradScaler

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for kind in ("plain", "dtensor"):
        for fused in (False, True):
            whole = torch.ones(4)
            param = torch.nn.Parameter(whole if kind == "plain" else distribute_tensor(whole, mesh, [Shard(0)]))
            scaler = AgreedGradScaler("cpu", init_scale=1024.0)
            opt = torch.optim.AdamW([param], lr=0.1, fused=fused)
            scaler.scale(torch.ones(1))
            local = torch.ones(4 if kind == "plain" else 4 // world)
            if rank == 0:
                local[0] = float("inf")
            param.grad = local if kind == "plain" else DTensor.from_local(local, mesh, [Shard(0)])
            if not fused:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            weights = param.to_local() if isinstance(param, DTensor) else param
            out[f"{kind} fused={fused}"] = (bool((weights.detach() != 1).any()), scaler.get_scale())
    # ranks whose gradients lie on different numbers of devices make the same one all-reduce (here: two flags on
    # rank 0, as gradients on two devices would give, one 0-dim flag on rank 1)
    scaler = AgreedGradScaler("cpu")
    scaler.scale(torch.ones(1))
    flags = {"a": torch.zeros(1), "b": torch.ones(1)} if rank == 0 else {"a": torch.zeros(())}
    out["agreed over devices"] = all(float(flag) == 1.0 for flag in scaler._agree(flags).values())
    return out


def test_one_ranks_overflow_skips_the_step_on_every_rank() -> None:
    """Two gloo ranks: every rank skips the step and halves the scale, the fused optimizers' path included."""
    from lightning_parallel.parallel.local_ranks import run_distributed

    ranks = run_distributed(_one_sided_overflow, 2, timeout_s=120)
    assert all(rank.pop("agreed over devices") for rank in ranks), ranks
    for case in ranks[0]:
        assert [rank[case] for rank in ranks] == [(False, 512.0)] * 2, (case, ranks)


class NaNAt(GPT):
    """The test GPT whose loss is NaN on one optimizer step (``global_step == 2``), every rank and micro-batch."""

    def pipeline_loss(self, output: Any, target: Any) -> Any:
        loss = super().pipeline_loss(output, target)
        trainer = self._trainer
        return loss * float("nan") if trainer is not None and trainer.training and trainer.global_step == 2 else loss


@pytest.mark.slow
def test_a_step_the_nonfinite_guard_skips_is_recorded_by_the_scaler(tmp_path: Path) -> None:
    """``NonFiniteLossGuard(action="skip")`` raises after Lightning unscaled the gradients: the scaler records the
    skip (its scale backs off) and the next step unscales again (it failed with "unscale_() has already been called
    on this optimizer since the last update()" on every rank before); both ranks keep the same scales."""
    from lightning_parallel.callbacks import NonFiniteLossGuard

    pl.seed_everything(0, verbose=False)
    model = NaNAt(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, lr=1e-3, warmup_steps=2, bias=False)
    (tmp_path / "run").mkdir()
    guard = NonFiniteLossGuard(action="skip")
    trained, _ = fit(LPShardedStrategy({"zero_stage": 1}, **FORK), 2, 2, model=model, steps=5,
                     plugins=[_plugin()], callbacks=[Scales(tmp_path / "run"), guard])
    scales = [json.loads((tmp_path / "run" / f"rank{r}.json").read_text())["scales"] for r in range(2)]
    assert scales[0] == scales[1], scales
    assert any(b < a for a, b in itertools.pairwise(scales[0])), scales  # the NaN step backed the scale off
    assert all(torch.isfinite(p).all() for p in trained.parameters())


def test_a_custom_scaler_under_a_sharded_layout_is_refused(tmp_path: Path) -> None:
    """A scaler subclass would lose its own behaviour in the swap, or leave the check unagreed: refused, with the
    fix; torch's own class and ``AgreedGradScaler`` subclasses run."""

    class Capped(torch.amp.GradScaler):
        def update(self, new_scale: Any = None) -> None:
            super().update(new_scale)
            if self.get_scale() > 2.0**15:
                super().update(2.0**15)

    plugin = MixedPrecision("16-mixed", "cpu", scaler=Capped("cpu"))
    with pytest.raises(Exception, match="derive the scaler from AgreedGradScaler") as err:
        fit(LPShardedStrategy({"zero_stage": 1}, **FORK), 2, 2, model=tiny_gpt(bias=False), steps=1,
            plugins=[plugin])
    assert "Capped" in str(err.value)
    # validation uses no scaler: not refused
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LPShardedStrategy({"zero_stage": 1}, **FORK),
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=Capped("cpu"))], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2)
    trainer.validate(tiny_gpt(bias=False), datamodule=TokenData(4))
