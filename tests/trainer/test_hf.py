"""Hugging Face causal LMs with no parallel code: ``HFCausalLM`` with a tiny random-init ``LlamaConfig`` under every
strategy against one device (10 AdamW steps, clipping 0.5 by the global norm, accumulation over 2 batches), dict
batches with a padding mask and -100 labels through a pipeline, the CLI by class path, and the refusals before
launch (families without plans, heads against tp, selective recomputation)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers: pip install -e '.[hf]'")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lightning_parallel.config import LayoutError
from lightning_parallel.hf import HFCausalLM, HFModelMixin
from lightning_parallel.strategies import (
    LPDDPStrategy,
    LPDPStrategy,
    LPHybridStrategy,
    LPPipelineStrategy,
    LPShardedStrategy,
    LPTensorStrategy,
)
from tests.trainer.token_data import STEPS, T, fit, weight_diff

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
TOL = 2e-5


def llama(seed: int = 0, **overrides: Any) -> HFCausalLM:
    torch.manual_seed(seed)
    return HFCausalLM({**LLAMA, **overrides}, lr=3e-3)


@pytest.fixture(scope="module")
def reference() -> HFCausalLM:
    model, _ = fit("auto", 1, 1, model=llama())
    assert weight_diff(model, llama()) > 1e-3  # it trained
    return model


def _check(name: str, strategy: Any, devices: int, dp: int, reference: HFCausalLM) -> float:
    model, _ = fit(strategy, devices, dp, model=llama())
    diff = weight_diff(model, reference)
    print(f"HFCausalLM(tiny LlamaConfig) {name}: {STEPS} AdamW steps, max |w - w_1dev| = {diff:.2e}")
    return diff


def test_data_parallel_family_equals_one_device(reference: HFCausalLM) -> None:
    diffs = {"lp_ddp x2": _check("lp_ddp x2", LPDDPStrategy(start_method="fork"), 2, 2, reference)}
    model, _ = fit(LPDPStrategy(), 2, 1, model=llama(), batch=4)  # one process: its batch is the global batch
    diffs["lp_dp x2"] = weight_diff(model, reference)
    print(f"HFCausalLM(tiny LlamaConfig) lp_dp x2: {STEPS} AdamW steps, max |w - w_1dev| = {diffs['lp_dp x2']:.2e}")
    for stage in (1, 2, 3):
        name = f"lp_sharded zero{stage} x2"
        diffs[name] = _check(name, LPShardedStrategy({"zero_stage": stage}, start_method="fork"), 2, 2, reference)
    assert max(diffs.values()) < TOL, diffs


def test_zero_offload_equals_one_device() -> None:
    pytest.importorskip("deepspeed")
    from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy

    # offload to CPU maps AdamW to DeepSpeed's CPU Adam, which rounds its fused update differently (see
    # test_zero_offload.py). One batch per step here: under this helper's accumulation over 2 batches the engine
    # ends ~5e-4 from one device after a single step, the library's GPT as well (an lp_zero_offload matter).
    ref, _ = fit("auto", 1, 1, model=llama(), batch=8, accumulate_grad_batches=1)
    model, _ = fit(LPZeroOffloadStrategy(start_method="fork"), 2, 2, model=llama(), batch=4,
                   accumulate_grad_batches=1)
    diff = weight_diff(model, ref)
    print(f"HFCausalLM(tiny LlamaConfig) lp_zero_offload x2 (zero 2, offload cpu): {STEPS} AdamW steps, "
          f"max |w - w_1dev| = {diff:.2e}")
    assert weight_diff(ref, llama()) > 1e-3 and diff < TOL


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_pipeline_every_schedule_equals_one_device(reference: HFCausalLM, schedule: str) -> None:
    layout: dict[str, Any] = {"pipeline_parallel_size": 2, "pipeline_schedule": schedule, "num_micro_batches": 2}
    if schedule == "interleaved_1f1b":
        layout["virtual_pipeline_stages"] = 2
    diff = _check(f"lp_pipeline pp2 {schedule}", LPPipelineStrategy(layout, start_method="fork"), 2, 1, reference)
    assert diff < TOL


def test_tensor_and_hybrid_equal_one_device(reference: HFCausalLM) -> None:
    diffs = {
        "lp_tensor tp2": _check("lp_tensor tp2", LPTensorStrategy({"tensor_parallel_size": 2}, start_method="fork"),
                                2, 1, reference),
        "lp_hybrid pp2 x tp2": _check(
            "lp_hybrid pp2 x tp2 (1f1b, full recomputation)",
            LPHybridStrategy({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "num_micro_batches": 2,
                              "activation_checkpointing": "full"}, start_method="fork"), 4, 1, reference),
    }
    assert max(diffs.values()) < TOL, diffs


@pytest.mark.slow
def test_dp2_pp2_tp2_equals_one_device(reference: HFCausalLM) -> None:
    layout = {"data_parallel_size": 2, "pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1,
              "num_micro_batches": 2}
    assert _check("lp_hybrid dp2 x pp2 x tp2 zero1", LPHybridStrategy(layout, start_method="fork"), 8, 2,
                  reference) < TOL


class PaddedDicts(pl.LightningDataModule):
    """Hugging Face style batches: ``input_ids``, ``attention_mask`` (each sample's last 3 positions padding) and
    ``labels`` with -100 there (as many per sample, so every micro-batch's mean counts as many tokens). ``ragged``:
    sample ``i`` pads its last ``(3 i) % 6`` positions and masks a prompt of ``(5 i) % 7`` labels instead, so
    samples count different numbers of tokens."""

    def __init__(self, batch_size: int, ragged: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 64, (80, T), generator=g)
        mask = torch.ones(80, T, dtype=torch.long)
        if ragged:
            pos, rows = torch.arange(T), torch.arange(80)[:, None]
            mask[pos >= T - (3 * rows) % 6] = 0
            labels = ids.masked_fill((mask == 0) | (pos < (5 * rows) % 7), -100)
        else:
            mask[:, -3:] = 0
            labels = ids.masked_fill(mask == 0, -100)
        self.rows = [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels,
                                                                                            strict=True)]
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        trainer: Any = self.trainer
        kwargs = trainer.strategy.distributed_sampler_kwargs if trainer.world_size > 1 else None
        sampler = DistributedSampler(self.rows, shuffle=False, **kwargs) if kwargs else None  # type: ignore[arg-type]
        return DataLoader(self.rows, batch_size=self.batch_size, sampler=sampler)  # type: ignore[arg-type]


def test_dict_batches_with_padding_mask_through_a_pipeline() -> None:
    """The mask and the labels' -100 reach the stages: a pipeline (the 2-D mask crosses the stage boundary with the
    hidden states) and lp_ddp equal one device on padded dict batches."""
    kw: dict[str, Any] = dict(accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False,
                              enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                              gradient_clip_val=0.5)
    ref = llama()
    pl.Trainer(devices=1, **kw).fit(ref, datamodule=PaddedDicts(8))
    diffs = {}
    for name, strategy, dp in (
        ("lp_pipeline pp2 1f1b", LPPipelineStrategy({"pipeline_parallel_size": 2, "num_micro_batches": 4},
                                                    start_method="fork"), 1),
        ("lp_ddp x2", LPDDPStrategy(start_method="fork"), 2),
    ):
        model = llama()
        pl.Trainer(devices=2, strategy=strategy, **kw).fit(model, datamodule=PaddedDicts(8 // dp))
        diffs[name] = weight_diff(model, ref)
        print(f"HFCausalLM padded dict batches {name}: max |w - w_1dev| = {diffs[name]:.2e}")
    assert weight_diff(ref, llama()) > 1e-3 and max(diffs.values()) < TOL, diffs


def test_ragged_labels_weigh_every_token_of_the_step_once() -> None:
    """Padding and masked prompts of varying lengths: each dp rank, micro-batch and accumulated batch holds a
    different number of counted tokens, and the adapter's loss is a token mean. Every strategy's optimizer step of 8
    samples (2 accumulated batches) equals one device taking the 8 samples as one batch -- the mean over every
    counted token of the step, as Hugging Face's trainer computes it -- because the adapter names its shifted labels
    (``HFCausalLM.context_parallel_plan``)."""
    kw: dict[str, Any] = dict(accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False,
                              enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                              gradient_clip_val=0.5)
    ref = llama()
    pl.Trainer(devices=1, **kw).fit(ref, datamodule=PaddedDicts(8, ragged=True))
    diffs = {}
    for name, strategy, devices, batch in (
        ("lp_ddp x2", LPDDPStrategy(start_method="fork"), 2, 2),
        ("lp_dp x2", LPDPStrategy(), 2, 4),
        ("lp_sharded zero3 x2", LPShardedStrategy({"zero_stage": 3}, start_method="fork"), 2, 2),
        ("lp_pipeline pp2 1f1b m2", LPPipelineStrategy({"pipeline_parallel_size": 2, "num_micro_batches": 2},
                                                       start_method="fork"), 2, 4),
    ):
        model = llama()
        pl.Trainer(devices=devices, strategy=strategy, accumulate_grad_batches=2, **kw).fit(
            model, datamodule=PaddedDicts(batch, ragged=True))
        diffs[name] = weight_diff(model, ref)
        print(f"HFCausalLM ragged -100 labels, 2 accumulated batches, {name}: max |w - w_1dev| = {diffs[name]:.2e}")
    assert weight_diff(ref, llama()) > 1e-3 and max(diffs.values()) < TOL, diffs


class SequenceMean(HFModelMixin, pl.LightningModule):
    """A user's module mixing in the adapter with a loss that is not a token mean (the mean over the samples of each
    sample's token mean): it names no labels, so no strategy reweighs it by counted tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llama().model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        target = self.hf_labels(batch)
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), target, ignore_index=-100,
                                                      reduction="none")
        return (per_token.sum(1) / (target != -100).sum(1).clamp(min=1)).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def test_a_users_mixin_module_with_another_loss_is_not_reweighed() -> None:
    """Only a module that names its labels is weighed by tokens (HFCausalLM does; the mixin does not impose it): a
    per-sample mean under lp_ddp x2 equals one device on the ragged batches, and lp_auto sees no context-parallel
    plan in the adapter's labels-only one."""
    from lightning_parallel.auto import _missing_hook

    kw: dict[str, Any] = dict(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                              enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False)
    torch.manual_seed(0)
    ref = SequenceMean()
    pl.Trainer(devices=1, **kw).fit(ref, datamodule=PaddedDicts(8, ragged=True))
    torch.manual_seed(0)
    model = SequenceMean()
    pl.Trainer(devices=2, strategy=LPDDPStrategy(start_method="fork"), **kw).fit(
        model, datamodule=PaddedDicts(4, ragged=True))
    diff = weight_diff(model, ref)
    print(f"HFModelMixin module, per-sample mean loss, ragged labels, lp_ddp x2: max |w - w_1dev| = {diff:.2e}")
    assert diff < TOL
    assert _missing_hook(llama(), "context_parallel_plan") == ("routes no attention (its context_parallel_plan() "
                                                                "names only the labels of its loss)")
    assert _missing_hook(ref, "context_parallel_plan") == "does not implement context_parallel_plan()"


class OwnModule(HFModelMixin, pl.LightningModule):
    """A user's own LightningModule holding an HF model under another attribute name."""

    hf_model_attr = "lm"

    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = dict(LLAMA)
        self.lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.hf_loss(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def test_mixin_on_a_users_module_under_hybrid() -> None:
    torch.manual_seed(0)
    ref, _ = fit("auto", 1, 1, model=OwnModule())
    torch.manual_seed(0)
    model, _ = fit(LPHybridStrategy({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "num_micro_batches": 2},
                                    start_method="fork"), 4, 1, model=OwnModule())
    diff = weight_diff(model, ref)
    print(f"OwnModule(HFModelMixin) lp_hybrid pp2 x tp2: max |w - w_1dev| = {diff:.2e}")
    assert sorted(model.state_dict()) == sorted(ref.state_dict()) and diff < TOL


def _refused(strategy: Any, model: Any, devices: int, match: str) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, max_steps=1,
                         enable_progress_bar=False, enable_checkpointing=False)
    with pytest.raises(LayoutError, match=match):
        trainer.fit(model, datamodule=PaddedDicts(4))


def test_refusals_before_launch() -> None:
    from transformers import GPT2Config

    gpt2 = HFCausalLM(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    _refused(LPTensorStrategy({"tensor_parallel_size": 2}, start_method="fork"), gpt2, 2,
             r"GPT2LMHeadModel \(gpt2\) has no tensor-parallel plan.*Conv1D")
    _refused(LPPipelineStrategy({"pipeline_parallel_size": 2}, start_method="fork"), gpt2, 2,
             r"GPT2LMHeadModel \(gpt2\) has no pipeline plan")
    _refused(LPTensorStrategy({"tensor_parallel_size": 4}, start_method="fork"), llama(), 4,
             r"num_key_value_heads=2: 2 % 4 = 2")
    _refused(LPTensorStrategy({"tensor_parallel_size": 2, "activation_checkpointing": "selective"},
                              start_method="fork"), llama(), 2, r"attention core is a function")
    _refused(LPDDPStrategy({"context_parallel_size": 2}, start_method="fork"), llama(), 2,
             r"context_parallel_size=2: .*LlamaForCausalLM \(llama\)'s attention core is a function")
    _refused(LPTensorStrategy({"tensor_parallel_size": 2}, start_method="fork"), llama(tie_word_embeddings=True), 2,
             r"tie_word_embeddings=True")
    gemma = HFCausalLM({"model_type": "gemma2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                        "tie_word_embeddings": False}, attn_implementation="eager")
    _refused(LPPipelineStrategy({"pipeline_parallel_size": 2}, start_method="fork"), gemma, 2,
             r"several attention types")


def test_cli_by_class_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_parallel.cli import main

    monkeypatch.chdir(tmp_path)
    config = ('{"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, '
              '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}')
    args = ["fit", "--model", "lightning_parallel.hf.HFCausalLM", "--model.init_args.model", config,
            "--data", "lightning_parallel.data.TextDataModule", "--data.init_args.block_size", "16",
            "--data.init_args.batch_size", "4", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
            "--trainer.strategy", "lp_pipeline_fork", "--parallel.pipeline_parallel_size", "2",
            "--parallel.num_micro_batches", "2", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
    # check (the dry run: the model on the meta device) judges the pipeline as fit does -- it refused the adapter's
    # model as "built on the meta device but has no init_weights()", which fit never does
    from lightning_parallel.cli import check_recipe

    assert "recipe OK | strategy lp_pipeline (dp=1 x pp=2" in check_recipe(args[1:])
    assert main(args) == 0
