"""lp_hybrid (dp x pp x tp + ZeRO-1) under the Lightning Trainer (fork-started gloo ranks) against one device.

Same global batch and seed: weights after 10 AdamW steps (GPT's warmup + cosine, clipping 0.5 by the global norm,
accumulation over 2 batches) compared with one device, on 8 ranks (dp2 x pp2 x tp2, 1F1B, sequence parallel,
ZeRO-1) and on 4 (pp2 x tp2) for a non-GPT module with its own plan and hooks; checkpoints and refusals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_parallel  # noqa: F401
from lightning_parallel import ParallelModuleMixin
from lightning_parallel.config import LayoutError
from lightning_parallel.models import GPT
from lightning_parallel.strategies import LPHybridStrategy, LPPipelineStrategy
from tests.trainer.token_data import GLOBAL_BATCH, STEPS, Residual, T, TokenData, fit, weight_diff


def _gpt(seed: int = 0, n_layer: int = 2) -> GPT:
    torch.manual_seed(seed)
    return GPT(n_layer=n_layer, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)


class PlanMLP(ParallelModuleMixin, pl.LightningModule):
    """A non-GPT module with its own hooks: embedding -> 2 residual MLPs (ModuleList) -> head; plan column/row/vocab."""

    def __init__(self, vocab: int = 64, hidden: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Residual(hidden) for _ in range(2))
        self.out = nn.Linear(hidden, vocab, bias=False)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.emb, *self.layers, self.out]

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"emb": "vocab", "layers.*.up": "column", "layers.*.down": "row", "out": "vocab"}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)}


@pytest.fixture(scope="module")
def reference() -> GPT:
    return fit("auto", 1, 1, model=_gpt())[0]


def _hy(**layout: Any) -> LPHybridStrategy:
    return LPHybridStrategy(layout, start_method="fork")


HYBRID = {"data_parallel_size": 2, "pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1,
          "sequence_parallel": True, "pipeline_schedule": "1f1b", "num_micro_batches": 2}


@pytest.mark.parametrize("extra", [{}, {"mesh_order": "pp-dp-tp"}], ids=["dp-pp-tp", "pp-dp-tp"])
def test_dp2_pp2_tp2_zero1_equals_one_device(reference: GPT, extra: dict[str, Any]) -> None:
    layout = {**HYBRID, **extra}
    model, _trainer = fit(_hy(**layout), 8, 2, model=_gpt())
    diff = weight_diff(model, reference)
    print(f"lp_hybrid {layout} on 8 ranks, {STEPS} AdamW steps: max |w - w_1dev| = {diff:.2e}")
    assert weight_diff(reference, _gpt()) > 1e-3  # it trained
    assert diff < 2e-5


def test_schedules_recomputation_and_tp_only_equal_one_device(reference: GPT) -> None:
    """The composition under other settings: zero bubble with sequence parallelism, interleaved 1F1B with full
    recomputation (applied after the TP plan), and the full section with pp=1 (tensor parallelism alone)."""
    for layout, devices in (
        ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True,
          "pipeline_schedule": "zero_bubble", "num_micro_batches": 2}, 4),
        ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "virtual_pipeline_stages": 2,
          "pipeline_schedule": "interleaved_1f1b", "num_micro_batches": 2, "activation_checkpointing": "full"}, 4),
        ({"tensor_parallel_size": 2}, 2),
    ):
        model, _ = fit(_hy(**layout), devices, 1, model=_gpt())
        diff = weight_diff(model, reference)
        print(f"lp_hybrid {layout} on {devices} ranks: max |w - w_1dev| = {diff:.2e}")
        assert diff < 2e-5


def test_non_gpt_module_with_its_own_plan_and_hooks_equals_one_device() -> None:
    torch.manual_seed(0)
    ref, _ = fit("auto", 1, 1, model=PlanMLP())
    torch.manual_seed(0)
    model, _ = fit(_hy(pipeline_parallel_size=2, tensor_parallel_size=2, num_micro_batches=2), 4, 1, model=PlanMLP())
    torch.manual_seed(0)
    diff = weight_diff(model, ref)
    print(f"lp_hybrid PlanMLP pp=2 x tp=2, {STEPS} AdamW steps + StepLR: max |w - w_1dev| = {diff:.2e}")
    assert weight_diff(ref, PlanMLP()) > 1e-2
    assert diff < 2e-5


def test_logging_checkpoint_resume_and_offline_reading(tmp_path: Path) -> None:
    """pp2 x tp2 (sequence parallel): logged train_loss / val_loss equal one device's; a DCP checkpoint at step 4
    resumes exactly to step 6; the folder read offline is the one-device state dict with the module's names."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_parallel.checkpoint import consolidate, detect_format, full_state_dict

    layout = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True,
              "num_micro_batches": 2}
    kw: dict[str, Any] = dict(limit_val_batches=2, val_check_interval=4, steps=8)
    _ref, ref_trainer = fit("auto", 1, 1, model=_gpt(), **kw)
    _model, trainer = fit(_hy(**layout), 4, 1, model=_gpt(), **kw)
    for key in ("train_loss", "val_loss"):
        got, want = float(trainer.callback_metrics[key]), float(ref_trainer.callback_metrics[key])
        print(f"lp_hybrid pp=2 x tp=2 logged {key} = {got:.6f}, one device {want:.6f}")
        assert abs(got - want) < 1e-5
    run: dict[str, Any] = {"steps": 6, "accumulate_grad_batches": 1, "batch": GLOBAL_BATCH, "samples": GLOBAL_BATCH}
    ckpt = ModelCheckpoint(dirpath=tmp_path / "a", filename="{step}", every_n_train_steps=4, save_top_k=-1)
    full, _ = fit(_hy(**layout), 4, 1, model=_gpt(), enable_checkpointing=True, callbacks=[ckpt], **run)
    folder = tmp_path / "a" / "step=4.ckpt"
    assert detect_format(folder).format == "lp_hybrid" and len(list(folder.glob("*.distcp"))) == 4
    resumed, _ = fit(_hy(**layout), 4, 1, model=_gpt(1), ckpt_path=str(folder), **run)
    exact = weight_diff(resumed, full)
    api = full_state_dict(folder)
    whole = _gpt().state_dict()
    assert sorted(api) == sorted(whole) and all(api[k].shape == v.shape for k, v in whole.items())
    consolidate(folder, tmp_path / "one.ckpt")
    loaded = GPT.load_from_checkpoint(tmp_path / "one.ckpt", map_location="cpu")
    assert all(torch.equal(loaded.state_dict()[k], api[k]) for k in api)
    print(f"lp_hybrid pp=2 x tp=2: DCP resume at step 4 -> 6, max |w - w_uninterrupted| = {exact:.1e}")
    assert exact == 0.0


def _refusal(strategy: Any, model: Any, devices: int, **trainer: Any) -> None:
    pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, max_steps=1,
               **trainer).fit(model, datamodule=TokenData(2))


def test_refusals_before_spawn() -> None:
    """A bad hybrid layout is refused in the launching process with the key, the value, the arithmetic and the
    fix."""
    with pytest.raises(LayoutError, match=r"data_parallel_size \(2\) x pipeline_parallel_size \(2\) x "
                                          r"tensor_parallel_size \(2\) = 8, but the world size is 4"):
        pl.Trainer(accelerator="cpu", devices=4, strategy=_hy(**HYBRID))
    with pytest.raises(LayoutError, match=r"tensor_parallel_size \(4\) exceeds the devices of one node \(2\)"):
        pl.Trainer(accelerator="cpu", devices=2, num_nodes=4, strategy=_hy(pipeline_parallel_size=2,
                                                                          tensor_parallel_size=4, num_micro_batches=2))
    with pytest.raises(LayoutError, match=r"(?s)offload='cpu' runs on the DeepSpeed engine.*Fix"):
        _hy(pipeline_parallel_size=2, tensor_parallel_size=2, zero_stage=3, offload="cpu")
    with pytest.raises(LayoutError, match=r"n_head=2, 2 % 4 = 2\. Fix: tensor_parallel_size in \[1, 2\]"):
        _refusal(_hy(pipeline_parallel_size=2, tensor_parallel_size=4, num_micro_batches=2), _gpt(), 8)
    with pytest.raises(LayoutError, match=r"= 8 stages, but GPT\.pipeline_layers\(\) returns 4 layers"):
        _refusal(_hy(pipeline_parallel_size=4, tensor_parallel_size=2, virtual_pipeline_stages=2,
                     pipeline_schedule="interleaved_1f1b", num_micro_batches=4), _gpt(), 8)
    with pytest.raises(LayoutError, match=r"lp_pipeline .*parallel\.tensor_parallel_size=2\. Fix: .*lp_hybrid"):
        LPPipelineStrategy({"pipeline_parallel_size": 2, "tensor_parallel_size": 2})


def test_planner_written_cluster_recipes_pass_the_dry_run() -> None:
    """The committed cluster recipes (written by `lightning-parallel plan --write-recipe`) are lp_hybrid layouts
    that the dry run of fit accepts, and their headers quote memory, bubble, cross-node bytes and the launch."""
    from lightning_parallel.cli import check_recipe

    root = Path(__file__).resolve().parents[2]
    for recipe, ranks in (("gpt3_13b_2x8.yaml", 16), ("gpt3_175b_16x8.yaml", 128)):
        path = root / "recipes" / "cluster" / recipe
        header = path.read_text().split("seed_everything")[0]
        for quoted in ("predicted per device", "bubble:", "bytes between nodes per step", "<- chosen",
                       "scripts/launch/torchrun.sh", "scripts/launch/slurm.sbatch"):
            assert quoted in header, (recipe, quoted)
        line = check_recipe(["--config", str(path), "--trainer.accelerator", "cpu", "--trainer.logger", "false"])
        assert "lp_hybrid (pp=" in line and f"= {ranks} ranks, mesh_order pp-dp-tp" in line, line
