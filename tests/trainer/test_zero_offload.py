"""lp_zero_offload at the Trainer level on 2 CPU ranks (DeepSpeed's CPU accelerator, gloo, fork launcher).

Equivalence: the same global batch (8) and seed as one device, 12 steps (2 epochs of 6: checkpoints are taken at an
epoch boundary, where Lightning resumes exactly). Offloading maps AdamW to DeepSpeed's CPU Adam, whose fused SIMD
update rounds differently from torch's AdamW: after 12 steps the weights differ by a few 1e-6 relative per tensor
(measured 5.6e-6; ~0.5 ulp-scale noise per step amplified by Adam's division by sqrt(v) on near-zero second moments),
so against torch AdamW the bound is 2e-5 relative. Against one device running the *same* CPU Adam the only difference
left is the order of the gradient average over ranks, and the bound is the contract's 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import TensorDataset

pytest.importorskip("deepspeed", reason="lp_zero_offload needs DeepSpeed: pip install -e '.[deepspeed]'")

from lightning_parallel.parallel.offload import ensure_ops, libaio_available, missing_ops, required_ops
from lightning_parallel.parallel.offload.optim import rebind_scheduler, to_host_optimizer
from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy, convert_to_fp32_state_dict
from tests.helpers import TRAINER_QUIET, SequentialTokens, max_abs_diff, max_rel_diff
from tests.helpers import tiny_gpt as _tiny_gpt

# the first module fixture may wait for DeepSpeed's cold op build (minutes on 2 cores; see conftest.py)
pytestmark = pytest.mark.timeout(1800)

STEPS = 12
PER_RANK_BATCH = 4
N_SAMPLES = 48  # 6 global batches of 8: an epoch ends at step 6 (exact resume point)


class PatternTokens(SequentialTokens):
    """SequentialTokens with learnable sequences (each row counts up from a random start by a random stride), so a
    few steps show the loss falling; the split over ranks is SequentialTokens'."""

    def __init__(self, batch_size: int, n_samples: int = N_SAMPLES, block_size: int = 16, vocab_size: int = 64) -> None:
        super().__init__(batch_size, n_samples, block_size, vocab_size)
        g = torch.Generator().manual_seed(4321)
        start = torch.randint(0, vocab_size, (n_samples, 1), generator=g)
        stride = torch.randint(1, 4, (n_samples, 1), generator=g)
        tokens = (start + stride * torch.arange(block_size + 1)) % vocab_size
        self.dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])


def tiny_gpt(seed: int = 0) -> pl.LightningModule:
    """The tests' GPT with its cosine schedule fixed to STEPS steps, so a 6-step run followed by a resume follows
    the same schedule as one 12-step run (the default derives it from the Trainer's max_steps)."""
    model = _tiny_gpt(seed)
    model._total_steps = lambda: STEPS  # type: ignore[method-assign]
    return model


def cpu_adam_gpt() -> pl.LightningModule:
    """The tiny GPT whose AdamW is DeepSpeed's CPU Adam already: the single-device twin of the offloaded runs.

    Under a plain Lightning strategy, ``LightningOptimizer`` wraps the optimizer in a dynamic subclass sharing its
    ``__dict__``; when a wrapper is dropped, ``DeepSpeedCPUAdam.__del__`` destroys the C++ optimizer of the live one
    (segfault at the next step). The reference therefore uses a subclass that leaves the C++ object alone."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    class _KeptCPUAdam(DeepSpeedCPUAdam):
        def __del__(self) -> None:  # the C++ optimizer lives as long as the test process
            pass

    model = tiny_gpt()
    configure = model.configure_optimizers

    def configure_optimizers() -> Any:
        out = configure()
        host = to_host_optimizer(out["optimizer"])
        host.__class__ = _KeptCPUAdam
        rebind_scheduler(out["lr_scheduler"]["scheduler"], host)
        return {"optimizer": host, "lr_scheduler": out["lr_scheduler"]}

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return model


def _fit(model: pl.LightningModule, strategy: Any, devices: int, batch_size: int, *, steps: int = STEPS,
         ckpt_path: str | None = None, save_to: Path | None = None, **trainer_kwargs: Any) -> pl.Trainer:
    """Fit; with ``save_to`` (``<dir>/step=<N>.ckpt``), a checkpoint at every epoch end is written into ``<dir>``."""
    quiet = dict(TRAINER_QUIET)
    quiet.update({k: trainer_kwargs.pop(k) for k in list(trainer_kwargs) if k in quiet})
    if save_to is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        quiet["enable_checkpointing"] = True
        # at the epoch's end (after the step's LR-scheduler update): where Lightning resumes exactly
        trainer_kwargs["callbacks"] = [ModelCheckpoint(dirpath=save_to.parent, filename="{step}", save_top_k=-1,
                                                       every_n_epochs=1, save_on_train_epoch_end=True)]
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps,
                         limit_val_batches=0, **quiet, **trainer_kwargs)
    trainer.fit(model, PatternTokens(batch_size=batch_size), ckpt_path=ckpt_path)
    if save_to is not None:
        assert save_to.is_dir(), f"no checkpoint folder at {save_to}"
    return trainer


def _strategy(stage: int, offload: str = "cpu", **kwargs: Any) -> LPZeroOffloadStrategy:
    parallel = {"zero_stage": stage, "offload": offload, **kwargs.pop("parallel", {})}
    return LPZeroOffloadStrategy(parallel=parallel, start_method="fork", **kwargs)


@pytest.fixture(scope="module", autouse=True)
def deepspeed_ops(pytestconfig: pytest.Config) -> None:
    """Build DeepSpeed's ops once, before the first run, and say so on the terminal (a cold build takes minutes:
    comm ~45 s, CPU Adam ~65 s, pin_memory + async_io ~4-9 min on 2 shared cores; cached in TORCH_EXTENSIONS_DIR)."""
    names = required_ops(accelerator="cpu", offload_optimizer="nvme" if libaio_available() else "cpu",
                         offload_param="none")
    todo = missing_ops(names)
    if not todo:
        return
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")

    def say(line: str) -> None:
        if reporter is not None:
            reporter.write_line(f"[lp_zero_offload] {line}")

    say(f"waiting for / building DeepSpeed ops {todo} (first use on this machine; later runs load them from the cache)")
    ensure_ops(todo, report=say)


@pytest.fixture(scope="module")
def reference() -> pl.LightningModule:
    """One device, torch AdamW, global batch 8, 12 steps (warmup + cosine)."""
    model = tiny_gpt()
    _fit(model, "auto", 1, 2 * PER_RANK_BATCH)
    return model


@pytest.fixture(scope="module")
def reference_cpu_adam() -> pl.LightningModule:
    model = cpu_adam_gpt()
    _fit(model, "auto", 1, 2 * PER_RANK_BATCH)
    return model


def _report(name: str, model: pl.LightningModule, reference: pl.LightningModule,
            reference_cpu_adam: pl.LightningModule, record_property: Any) -> tuple[float, float]:
    rel, rel_same = max_rel_diff(model, reference), max_rel_diff(model, reference_cpu_adam)
    abs_diff, abs_same = max_abs_diff(model, reference), max_abs_diff(model, reference_cpu_adam)
    record_property("max_rel_vs_torch_adamw", rel)
    record_property("max_rel_vs_one_device_cpu_adam", rel_same)
    print(f"\n{name} 2 ranks vs 1 device after {STEPS} steps: vs torch AdamW max abs {abs_diff:.3e} rel {rel:.3e}; "
          f"vs 1-device CPU Adam max abs {abs_same:.3e} rel {rel_same:.3e}")
    return rel, rel_same


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2_cpu_offload", "zero3_cpu_offload"])
def test_cpu_offload_two_ranks_equals_one_device(stage: int, reference: pl.LightningModule,
                                                 reference_cpu_adam: pl.LightningModule, record_property: Any) -> None:
    model = tiny_gpt()
    assert max_abs_diff(model, reference) > 5e-3  # the reference really trained
    _fit(model, _strategy(stage), 2, PER_RANK_BATCH)
    rel, rel_same = _report(f"ZeRO-{stage} + CPU offload", model, reference, reference_cpu_adam, record_property)
    assert rel_same < 1e-5
    assert rel < 2e-5
    assert max_abs_diff(model, reference) < 5e-5


def test_explicit_offload_none_runs_as_written(reference: pl.LightningModule) -> None:
    """``offload: none`` under lp_zero_offload is DeepSpeed ZeRO-2 with the module's own AdamW, no offload (it used to
    become ``cpu`` silently); "not set" takes the preset (cpu). Equal to one device with torch AdamW."""
    strategy = _strategy(2, "none")
    assert strategy.layout.offload == "none" and "offload_optimizer" not in strategy.config["zero_optimization"]
    assert LPZeroOffloadStrategy(parallel={"zero_stage": 2}).layout.offload == "cpu"  # unset: the preset
    model = tiny_gpt()
    _fit(model, strategy, 2, PER_RANK_BATCH)
    rel = max_rel_diff(model, reference)
    print(f"\nZeRO-2 without offload (explicit offload: none) 2 ranks vs 1 device torch AdamW: max rel diff {rel:.3e}, "
          f"max abs {max_abs_diff(model, reference):.3e}")
    assert rel < 1e-5


def test_layout_is_resolved_before_spawn_and_summarised_from_the_dims() -> None:
    """data_parallel_size=3 on 2 devices is refused in Trainer.__init__ (nothing spawned), like every strategy; the
    run summary comes from the resolved dims; an explicit stage 0 is refused with the fix."""
    from lightning_parallel.config import LayoutError

    with pytest.raises(LayoutError, match=r"data_parallel_size \(3\).*world size is 2 \(devices=2 per node"):
        pl.Trainer(strategy=_strategy(2, parallel={"data_parallel_size": 3}), accelerator="cpu", devices=2)
    trainer = pl.Trainer(strategy=_strategy(3), accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.describe() == "lp_zero_offload (dp=2 x pp=1 x tp=1 = 2 ranks, zero=3, offload=cpu)"
    with pytest.raises(LayoutError, match=r"zero_stage=0 \(no ZeRO\). Fix: .*lp_ddp"):
        LPZeroOffloadStrategy(parallel={"zero_stage": 0})
    with pytest.raises(LayoutError, match=r"pipeline_parallel_size=2.*Fix: pipeline_parallel_size=1"):
        LPZeroOffloadStrategy(parallel={"pipeline_parallel_size": 2})  # the preset's stage 2 meets the pipeline
    with pytest.raises(LayoutError, match=r"data parallel only.*tensor_parallel_size=2\. Fix: set both to 1"):
        LPZeroOffloadStrategy(parallel={"tensor_parallel_size": 2})


def test_tiled_gpt_under_zero3_offload_equals_the_untiled_model(reference: pl.LightningModule) -> None:
    """Memory Centric Tiling under ZeRO-3 + CPU offload (each tile its own partitioned submodule, gathered alone):
    the trained weights, re-assembled, equal the untiled one-device run."""
    from lightning_parallel.parallel.tiling import tile_linear_layers, untile_linear_layers

    model = tiny_gpt()
    assert len(tile_linear_layers(model, min_params=2048, tiles=(2, 2))) == 5
    _fit(model, _strategy(3), 2, PER_RANK_BATCH)
    untile_linear_layers(model)
    rel = max_rel_diff(model, reference)
    print(f"\ntiled GPT (2x2 tiles) under ZeRO-3 + CPU offload vs untiled 1 device: max rel diff {rel:.3e}")
    assert rel < 2e-5


def test_accumulation_clipping_and_scheduler_reach_the_engine() -> None:
    """accumulate_grad_batches=2 and gradient_clip_val (small enough to clip every step) on 2 ranks equal one device
    with the same Trainer settings and the same CPU Adam; the warmup+cosine schedule drives the host optimizer."""
    kwargs = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    reference = cpu_adam_gpt()
    _fit(reference, "auto", 1, PER_RANK_BATCH, steps=6, **kwargs)
    model = tiny_gpt()
    _fit(model, _strategy(2), 2, PER_RANK_BATCH // 2, steps=6, **kwargs)
    rel = max_rel_diff(model, reference)
    print(f"\nZeRO-2 + CPU offload, accumulation 2 + clipping 0.05, 6 steps: max rel diff {rel:.3e}")
    assert rel < 1e-5
    unclipped = cpu_adam_gpt()
    _fit(unclipped, "auto", 1, PER_RANK_BATCH, steps=6, accumulate_grad_batches=2)
    assert max_rel_diff(unclipped, reference) > 1e-4  # clipping really changed the run


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2_cpu_offload", "zero3_cpu_offload"])
def test_checkpoint_round_trip_resumes_exactly_and_consolidates(stage: int, tmp_path: Path,
                                                                reference_cpu_adam_6: pl.LightningModule) -> None:
    """A 7-step run checkpoints at the end of epoch 1 (step 6, the engine's folder); resuming from it for one step
    equals the uninterrupted run (to an fp32 ulp). (Only one step: after an epoch-end checkpoint Lightning's loop
    replays batch 0 once more, so later steps see other batches -- a data-order matter, not the engine's.) The
    checkpoint's consolidated fp32 state dict loads strictly into a plain module on one device: the 6-step weights."""
    uninterrupted = tiny_gpt()
    ckpt = tmp_path / "ckpts" / "step=6.ckpt"
    _fit(uninterrupted, _strategy(stage), 2, PER_RANK_BATCH, steps=7, save_to=ckpt)
    resumed = tiny_gpt(seed=99)
    _fit(resumed, _strategy(stage), 2, PER_RANK_BATCH, steps=7, ckpt_path=str(ckpt))
    diff = max_abs_diff(resumed, uninterrupted)
    plain = tiny_gpt(seed=99)
    plain.load_state_dict(convert_to_fp32_state_dict(ckpt))
    rel6 = max_rel_diff(plain, reference_cpu_adam_6)
    print(f"\nZeRO-{stage} + CPU offload resumed at step 6, one more step vs uninterrupted: max abs diff {diff:.3e}; "
          f"consolidated step-6 checkpoint vs 1-device CPU Adam at step 6: max rel diff {rel6:.3e}")
    assert diff < 1e-6  # measured 0 to 1.2e-7 (one fp32 ulp); a resume from the initial weights differs by ~1e-2
    assert rel6 < 1e-5


@pytest.fixture(scope="module")
def reference_cpu_adam_6() -> pl.LightningModule:
    model = cpu_adam_gpt()
    _fit(model, "auto", 1, 2 * PER_RANK_BATCH, steps=6)
    return model


@pytest.mark.skipif(not libaio_available(), reason="NVMe offload needs libaio (apt-get install libaio-dev)")
def test_nvme_offload_trains_and_resumes(tmp_path: Path, reference_cpu_adam_6: pl.LightningModule) -> None:
    """ZeRO-3 with optimizer and parameters on NVMe (a temporary folder): the loss falls over 7 steps; resuming
    from the step-6 checkpoint gives step 7's loss and weights (to an fp32 ulp) (DeepSpeed's own resume would silently
    restart from the initial weights: here the state is saved per rank, restored and verified)."""
    nvme = {"parallel": {"nvme_path": str(tmp_path / "swap")}}
    uninterrupted = tiny_gpt()
    ckpt = tmp_path / "ckpts" / "step=6.ckpt"
    _fit(uninterrupted, _strategy(3, "nvme", **nvme), 2, PER_RANK_BATCH, steps=7, save_to=ckpt,
         logger=_csv(tmp_path, "a"), log_every_n_steps=1)
    resumed = tiny_gpt(seed=99)
    _fit(resumed, _strategy(3, "nvme", **nvme), 2, PER_RANK_BATCH, steps=7, ckpt_path=str(ckpt),
         logger=_csv(tmp_path, "b"), log_every_n_steps=1)
    first, second = _losses(tmp_path, "a"), _losses(tmp_path, "b")
    plain = tiny_gpt(seed=99)
    plain.load_state_dict(convert_to_fp32_state_dict(ckpt))
    print(f"\nZeRO-3 NVMe offload train_loss steps 1-7: {[round(v, 4) for v in first]}; resumed at step 6, step 7: "
          f"{[round(v, 4) for v in second]}; weights vs uninterrupted: max abs diff "
          f"{max_abs_diff(resumed, uninterrupted):.3e}")
    assert len(first) == 7 and len(second) == 1
    assert first[5] < first[0] - 0.03  # the loss falls
    assert second[0] == pytest.approx(first[6], abs=1e-6)  # the resume continues where the run was
    assert max_abs_diff(resumed, uninterrupted) < 1e-6
    assert max_rel_diff(plain, reference_cpu_adam_6) < 1e-5  # the NVMe checkpoint consolidates to one device


def _csv(root: Path, name: str) -> Any:
    from lightning.pytorch.loggers import CSVLogger

    return CSVLogger(root / "logs", name=name, version=0)


def _losses(root: Path, name: str) -> list[float]:
    import csv

    with open(root / "logs" / name / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    return [float(r["train_loss"]) for r in sorted(rows, key=lambda r: int(r["step"]))]


@pytest.mark.skipif(not libaio_available(), reason="NVMe offload needs libaio (apt-get install libaio-dev)")
def test_nvme_consolidation_keeps_buffers(tmp_path: Path) -> None:
    """A module with a persistent buffer under ZeRO-3 NVMe offload: the consolidated fp32 state dict has the buffer
    (parameters come from the per-rank NVMe state, buffers from DeepSpeed's model-states file) and loads strictly."""
    from lightning_parallel.models import GPT

    class BufferedGPT(GPT):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.register_buffer("calib", torch.arange(4, dtype=torch.float32))

    pl.seed_everything(0, verbose=False)
    model = BufferedGPT(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, lr=1e-3, warmup_steps=2)
    ckpt = tmp_path / "ckpts" / "step=6.ckpt"
    _fit(model, _strategy(3, "nvme", parallel={"nvme_path": str(tmp_path / "swap")}), 2, PER_RANK_BATCH, steps=6,
         save_to=ckpt)
    state = convert_to_fp32_state_dict(ckpt)
    assert state["calib"].tolist() == [0.0, 1.0, 2.0, 3.0]
    fresh = BufferedGPT(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    fresh.load_state_dict(state)  # strict: nothing missing
    assert max_abs_diff(fresh, model) < 1e-6


@pytest.mark.parametrize("ignored", [None, "ragged"])
def test_accumulation_with_clipping_equals_one_device(ignored: str | None) -> None:
    """Lightning's loop divides the loss by accumulate_grad_batches; the engine must not divide it again (the
    gradients were 1/a^2 of one device's: 4.9e-4 off after 10 steps with a = 2 and clipping 0.5 before the fix).
    ``ragged``: labels ignored (-100) unevenly over the ranks' batches; each rank's token mean is weighed by its share
    of the optimizer step's counted tokens, against one device's step mean (``StepMeanMixin``; 1.2e-2 from one
    device without the weighing)."""
    from lightning_parallel.models import GPT
    from tests.trainer.token_data import StepMeanMixin, T, TokenData, fit, weight_diff

    class StepMeanGPT(StepMeanMixin, GPT):  # type: ignore[misc]
        pass

    def gpt(cls: type = GPT) -> Any:
        torch.manual_seed(0)
        return cls(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)

    data = {"ignored": ignored}
    reference = gpt(StepMeanGPT)
    reference.labels = TokenData(1, ignored=ignored).dataset.tensors[1]
    fit("auto", 1, 1, model=reference, data=data)  # accumulation 2, clipping 0.5 by norm
    model, _ = fit(LPZeroOffloadStrategy({"zero_stage": 2, "offload": "none"}, start_method="fork"), 2, 2, model=gpt(),
                   data=data)
    diff = weight_diff(model, reference)
    print(f"lp_zero_offload ZeRO-2 x2, accumulation 2, clipping 0.5, {ignored} -100 labels: max |w - w_1dev| = "
          f"{diff:.2e}")
    assert diff < 1e-5


def test_a_resume_from_inside_an_accumulation_window_steps_where_lightning_does(tmp_path: Path) -> None:
    """A checkpoint written by a validation inside an accumulation window (batch 3 of windows of 2), then resumed:
    the engine must end its windows where Lightning's loop does. A resumed engine counts its micro-steps from 0, so
    it stepped one batch after Lightning from then on (1.3e-2 from one device's resume here, measured). Compared with
    the same procedure on one device (whose resume drops the window's first batch, as Lightning does), with data
    that resume where they stopped on both."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_parallel.data import ResumableDataModuleMixin
    from lightning_parallel.models import GPT
    from tests.trainer.token_data import GLOBAL_BATCH, T, TokenData, weight_diff

    class Data(ResumableDataModuleMixin, TokenData):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.dataset, batch_size=self.batch_size,
                              sampler=self.resumable_sampler(self.dataset, self.batch_size, shuffle=False))

    def run(strategy: Any, devices: int, folder: Path) -> pl.LightningModule:
        models = []
        for ckpt in (None, folder / "step=1.ckpt"):
            torch.manual_seed(0)
            model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)
            trainer = pl.Trainer(strategy=strategy(), accelerator="cpu", devices=devices, max_steps=6, logger=False,
                                 enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                 val_check_interval=3, limit_val_batches=1, gradient_clip_val=0.5,
                                 accumulate_grad_batches=2, use_distributed_sampler=False,
                                 callbacks=[ModelCheckpoint(dirpath=folder, filename="{step}", save_top_k=-1,
                                                            save_on_train_epoch_end=False)])
            trainer.fit(model, datamodule=Data(GLOBAL_BATCH // 2 // devices),
                        ckpt_path=None if ckpt is None else str(ckpt))
            models.append(model)
        assert (folder / "step=1.ckpt").exists(), sorted(p.name for p in folder.iterdir())
        return models[1]

    one = run(lambda: "auto", 1, tmp_path / "one")
    offload = run(lambda: LPZeroOffloadStrategy({"zero_stage": 2, "offload": "none"}, start_method="fork"), 2,
                  tmp_path / "offload")
    diff = weight_diff(offload, one)
    print(f"\nlp_zero_offload ZeRO-2 x2 resumed from a checkpoint inside an accumulation window: max |w - w_1dev| = "
          f"{diff:.2e} (one device resumed the same way)")
    assert diff < 1e-5


def test_a_short_window_at_an_epochs_end_steps_as_on_one_device() -> None:
    """An epoch of 5 batches per rank with windows of 2: one device (Lightning's loop) steps on the epoch's last,
    short window; the engine's own count ran its windows across epochs instead (9.2e-3 from one device after 7
    steps, measured): the engine now steps where Lightning's loop does."""
    from lightning_parallel.models import GPT
    from tests.trainer.token_data import T, fit, weight_diff

    def gpt() -> pl.LightningModule:
        torch.manual_seed(0)
        return GPT(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)

    reference, one = fit("auto", 1, 1, model=gpt(), samples=20, steps=7)
    model, _ = fit(LPZeroOffloadStrategy({"zero_stage": 2, "offload": "none"}, start_method="fork"), 2, 2,
                   model=gpt(), samples=20, steps=7)
    diff = weight_diff(model, reference)
    print(f"\nlp_zero_offload ZeRO-2 x2, epochs of 5 batches, windows of 2, 7 steps over {one.current_epoch} epochs: "
          f"max |w - w_1dev| = {diff:.2e}")
    assert one.current_epoch == 3 and diff < 1e-5
