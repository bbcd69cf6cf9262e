"""lp_pipeline under the Lightning Trainer (fork-started gloo ranks) against a single-device reference.

Same global batch and seed: the weights after 10 AdamW steps (GPT's warmup + cosine schedule, clipping 0.5 by the
global norm, accumulation over 2 batches) are compared with one device, for every schedule, p=2 and p=4, and dp=2 x
pp=2 with ZeRO-1. Pipeline peers see the same batch (the sampler's rank and size come from dp).
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
from lightning_parallel.strategies import LPPipelineStrategy
from tests.trainer.token_data import GLOBAL_BATCH, STEPS, Residual, SavePredictions, T, TokenData, fit, weight_diff


def _gpt(seed: int = 0, n_layer: int = 6) -> GPT:
    torch.manual_seed(seed)
    return GPT(n_layer=n_layer, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)


class DictMLP(ParallelModuleMixin, pl.LightningModule):
    """A non-GPT module with dict batches: embedding -> 3 residual MLP layers in an nn.ModuleList -> head."""

    def __init__(self, vocab: int = 64, hidden: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Residual(hidden) for _ in range(3))
        self.out = nn.Linear(hidden, vocab)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.emb, *self.layers, self.out]

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))

    def pipeline_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["tokens"], batch["labels"]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.pipeline_loss(self(batch["tokens"]), batch["labels"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)}


@pytest.fixture(scope="module")
def reference() -> GPT:
    return fit("auto", 1, 1, model=_gpt())[0]


def _pp(**layout: Any) -> LPPipelineStrategy:
    return LPPipelineStrategy(layout, start_method="fork")


@pytest.mark.parametrize(("layout", "devices"), [
    ({"pipeline_parallel_size": 2, "pipeline_schedule": "gpipe", "num_micro_batches": 2}, 2),
    ({"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b", "num_micro_batches": 4}, 2),
    ({"pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_stages": 2,
      "num_micro_batches": 2}, 2),
    ({"pipeline_parallel_size": 2, "pipeline_schedule": "zero_bubble", "num_micro_batches": 2}, 2),
    ({"pipeline_parallel_size": 4, "pipeline_schedule": "1f1b", "num_micro_batches": 4}, 4),
    ({"pipeline_parallel_size": 4, "pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_stages": 2,
      "num_micro_batches": 4}, 4),
    ({"pipeline_parallel_size": 2, "zero_stage": 1, "num_micro_batches": 2}, 4),
])
def test_gpt_equals_one_device(reference: GPT, layout: dict[str, Any], devices: int) -> None:
    dp = devices // layout["pipeline_parallel_size"]
    model, _ = fit(_pp(**layout), devices, dp, model=_gpt())
    diff = weight_diff(model, reference)
    print(f"lp_pipeline {layout} on {devices} ranks (dp={dp}), {STEPS} AdamW steps: max |w - w_1dev| = {diff:.2e}")
    assert weight_diff(reference, _gpt()) > 1e-3  # it trained
    assert diff < 2e-5


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_under_pp_equals_one_device(reference: GPT, mode: str) -> None:
    """Recomputation is applied to the pruned stage (names unchanged); zero bubble's split backward (input
    gradients first, weight gradients later) recomputes the blocks too."""
    for schedule in ("1f1b", "zero_bubble"):
        model, _ = fit(_pp(pipeline_parallel_size=2, num_micro_batches=2, pipeline_schedule=schedule,
                           activation_checkpointing=mode), 2, 1, model=_gpt())
        diff = weight_diff(model, reference)
        print(f"lp_pipeline pp=2 {schedule} activation_checkpointing={mode}: max |w - w_1dev| = {diff:.2e}")
        assert diff < 2e-5


def test_module_built_on_the_meta_device_equals_one_device(reference: GPT) -> None:
    """Each stage materializes and initializes only its own layers (GPT.init_weights walks the whole model's
    draws), after the same seed the reference was built with: the same training."""
    with torch.device("meta"):
        meta = GPT(n_layer=6, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)
    pl.seed_everything(0, verbose=False)
    model, _ = fit(_pp(pipeline_parallel_size=2, num_micro_batches=2), 2, 1, model=meta)
    diff = weight_diff(model, reference)
    print(f"lp_pipeline pp=2 on a meta-device GPT: max |w - w_1dev| = {diff:.2e}")
    assert diff < 2e-5


def test_non_gpt_module_with_dict_batches_equals_one_device() -> None:
    torch.manual_seed(0)
    ref, _ = fit("auto", 1, 1, model=DictMLP(), data={"as_dict": True})
    torch.manual_seed(0)
    model, _ = fit(_pp(pipeline_parallel_size=2, num_micro_batches=2), 2, 1, model=DictMLP(), data={"as_dict": True})
    torch.manual_seed(0)
    diff = weight_diff(model, ref)
    print(f"lp_pipeline DictMLP (dict batches, ModuleList layers) pp=2, {STEPS} AdamW steps + StepLR: "
          f"max |w - w_1dev| = {diff:.2e}")
    assert weight_diff(ref, DictMLP()) > 1e-2  # it trained
    assert diff < 2e-5


def test_logging_validation_test_and_predict_equal_one_device(tmp_path: Path) -> None:
    """train_loss (reduced from the last stage and over dp) and val_loss are logged with the one-device values,
    and validation runs in the middle of a step's gradient accumulation (every 3 batches, 2 accumulated) leave the
    training as one device's (ZeRO-3 stages: FSDP2's gradient reduction and torch's first-step clean-up of the
    gradients kept out of the forward-only schedules); validate and test run forward-only schedules (a short last
    batch included); predict gives every rank the last stage's output."""
    # 6 validation samples: per dp rank a batch of 2 and a short one of 1 -- a new forward-only schedule, built
    # (and its first step run) inside an accumulation window, where the last stage is still gathered
    kw: dict[str, Any] = dict(limit_val_batches=2, val_check_interval=3, steps=8, data={"val_samples": 6})
    ref, ref_trainer = fit("auto", 1, 1, model=_gpt(), **kw)
    layout = {"pipeline_parallel_size": 2, "num_micro_batches": 2, "zero_stage": 3}
    model, trainer = fit(_pp(**layout), 4, 2, model=_gpt(), **kw)
    diff = weight_diff(model, ref)
    print(f"lp_pipeline dp=2 x pp=2 ZeRO-3, validation inside accumulation windows: max |w - w_1dev| = {diff:.2e}")
    assert diff < 2e-5
    for key in ("train_loss", "val_loss"):
        got, want = float(trainer.callback_metrics[key]), float(ref_trainer.callback_metrics[key])
        print(f"lp_pipeline dp=2 x pp=2 logged {key} = {got:.6f}, one device {want:.6f}")
        assert abs(got - want) < 1e-5
    one = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     use_distributed_sampler=False)
    pp = pl.Trainer(accelerator="cpu", devices=2, strategy=_pp(**layout), logger=False, enable_progress_bar=False,
                    use_distributed_sampler=False)
    short = {"val_samples": 2 * GLOBAL_BATCH - 2}  # a short last validation batch
    val = pp.validate(model, datamodule=TokenData(4, **short), verbose=False)
    ref_val = one.validate(ref, datamodule=TokenData(4, **short), verbose=False)
    test = pp.test(model, datamodule=TokenData(4), verbose=False)
    ref_test = one.test(ref, datamodule=TokenData(4), verbose=False)
    print(f"validate {val[0]['val_loss']:.6f} vs {ref_val[0]['val_loss']:.6f}; test {test[0]['test_loss']:.6f} vs "
          f"{ref_test[0]['test_loss']:.6f}")
    assert abs(val[0]["val_loss"] - ref_val[0]["val_loss"]) < 1e-5
    assert abs(test[0]["test_loss"] - ref_test[0]["test_loss"]) < 1e-5
    predictor = pl.Trainer(accelerator="cpu", devices=2, strategy=_pp(**layout), logger=False,
                           enable_progress_bar=False, use_distributed_sampler=False, limit_predict_batches=1,
                           callbacks=[SavePredictions(tmp_path)])
    predictor.predict(model, datamodule=TokenData(4), return_predictions=False)
    ref.eval()
    want = ref(TokenData(4).tokens[:4])
    for rank in (0, 1):  # the whole logits on the first stage's rank too
        got = torch.load(tmp_path / f"pred_{rank}.pt")
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)


def test_a_batch_of_a_new_shape_inside_an_accumulation_window_equals_one_device() -> None:
    """The epoch's last training batch is shorter (2 samples per rank after three of 4) and is the second batch of
    its accumulation window: it builds a new training schedule, whose first step clears the FSDP2 stages'
    gradients after its shape inference -- the window's first batch's gradient is kept and added back. The GPT's
    loss is a token mean over the step (its plan names its labels), so the short batch weighs by its tokens: the
    reference is one device's step mean."""
    from tests.trainer.token_data import StepMeanMixin

    class StepMeanGPT(StepMeanMixin, GPT):  # type: ignore[misc]
        pass

    kw: dict[str, Any] = dict(max_steps=-1, max_epochs=1, samples=28)
    torch.manual_seed(0)
    ref = StepMeanGPT(n_layer=6, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)
    ref.labels = TokenData(1, 28).dataset.tensors[1]
    fit("auto", 1, 1, model=ref, batch=8, **kw)
    model, _ = fit(_pp(pipeline_parallel_size=2, num_micro_batches=2, zero_stage=3), 4, 2, model=_gpt(), batch=4,
                   **kw)
    diff = weight_diff(model, ref)
    print(f"lp_pipeline dp=2 x pp=2 ZeRO-3, a short last batch mid-window: max |w - w_1dev| = {diff:.2e}")
    assert weight_diff(ref, _gpt()) > 1e-3  # it trained
    assert diff < 2e-5  # 2.6e-3 when the window's first gradient was lost


class _StepsEveryOtherBatch(GPT):
    """Accumulates by hand: a backward on every batch, a step and a zeroing on every other one."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx % 2 == 0:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if batch_idx % 2 == 0:
            optimizer.zero_grad()


def test_the_modules_own_zero_grad_hook_runs_as_on_one_device() -> None:
    """The schedule runs the backward inside training_step, so Lightning's zero-grad (on_before_zero_grad, then the
    module's optimizer_zero_grad) moves in front of it. The strategy used to zero every window itself and skip the
    module's hook: a module accumulating by hand (a step and a zeroing every other batch) trained 1.2e-02 from one
    device."""
    torch.manual_seed(0)
    kw: dict[str, Any] = dict(accumulate_grad_batches=1, steps=6, batch=GLOBAL_BATCH // 2)
    ref = _StepsEveryOtherBatch(n_layer=6, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3,
                                bias=False)
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    fit("auto", 1, 1, model=ref, **kw)
    torch.manual_seed(0)
    model = _StepsEveryOtherBatch(n_layer=6, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3,
                                  bias=False)
    fit(_pp(pipeline_parallel_size=2), 2, 1, model=model, **kw)
    diff = weight_diff(model, ref)
    moved = max(float((ref.state_dict()[k] - v).abs().max()) for k, v in start.items())
    print(f"lp_pipeline pp=2, a step every other batch by the module's hooks: max |w - w_1dev| = {diff:.2e} "
          f"(moved {moved:.2e})")
    assert moved > 1e-3 and diff < 5e-5  # (AdamW after 6 steps amplifies the micro-batches' rounding)


def _refusal(strategy: LPPipelineStrategy, model: Any, devices: int = 2, batch: int = 2, **trainer: Any) -> None:
    pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, max_steps=1,
               **trainer).fit(model, datamodule=TokenData(batch))


def test_refusals_before_spawn() -> None:
    """Every refusal happens in the launching process, with the key, the value, the arithmetic and the fix."""
    with pytest.raises(LayoutError, match=r"4 x virtual_pipeline_stages=2 = 8 stages, but GPT\.pipeline_layers\(\) "
                                          r"returns 4 layers \(each stage needs at least one\)"):
        _refusal(_pp(pipeline_parallel_size=4, pipeline_schedule="interleaved_1f1b", virtual_pipeline_stages=2,
                     num_micro_batches=4), _gpt(n_layer=2), devices=4)
    with pytest.raises(LayoutError, match=r"6 x virtual_pipeline_stages=1 = 6 stages, but DictMLP\.pipeline_layers\(\) "
                                          r"returns 5 layers .*Fix: pipeline_parallel_size x virtual_pipeline_stages "
                                          r"<= 5"):
        _refusal(_pp(pipeline_parallel_size=6, num_micro_batches=6), DictMLP(), devices=6, batch=6)
    with pytest.raises(LayoutError, match=r"batch_size=6 \(per data-parallel rank\) does not split into "
                                          r"parallel\.num_micro_batches=4 equal micro-batches: 6 % 4 = 2\. Fix"):
        _refusal(_pp(pipeline_parallel_size=2, num_micro_batches=4), _gpt(), batch=6)
    loader = torch.utils.data.DataLoader  # a validation DataLoader takes any batch size; the training one splits
    tokens = torch.utils.data.TensorDataset(torch.zeros(12, T, dtype=torch.long))
    _pp(pipeline_parallel_size=2, num_micro_batches=2).check_data((_gpt(), loader(tokens, 4), loader(tokens, 3)))
    with pytest.raises(LayoutError, match=r"the training DataLoader's batch_size=3 .* 3 % 2 = 1"):
        _pp(pipeline_parallel_size=2, num_micro_batches=2).check_data((_gpt(), loader(tokens, 3), loader(tokens, 4)))
    # drop_last=False: 25 samples in batches of 4 end each epoch on a batch of 1, which 2 micro-batches cannot split;
    # it stopped the run only when it arrived, after the epoch's other batches -- refused unless the run ends first
    pairs = torch.utils.data.TensorDataset(torch.zeros(25, T, dtype=torch.long), torch.zeros(25, T, dtype=torch.long))
    with pytest.raises(LayoutError, match=r"25 samples over dp=1 ranks .* batch of 1 samples.*drop_last=True"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=_pp(pipeline_parallel_size=2, num_micro_batches=2),
                   logger=False, max_epochs=1).fit(_gpt(), loader(pairs, 4))
    from lightning_parallel.strategies.layout import TrainingDataProbe

    for steps, given in ((2, loader(pairs, 4)),  # 2 steps of 7 batches: the short one is never reached
                         (-1, loader(pairs, 4, sampler=torch.utils.data.SubsetRandomSampler(range(24)))),  # 24 yielded
                         (-1, loader(pairs, 4, drop_last=True))):
        run = pl.Trainer(accelerator="cpu", devices=2, logger=False, max_steps=steps, max_epochs=1,
                         strategy=_pp(pipeline_parallel_size=2, num_micro_batches=2))
        run.strategy.check_last_training_batch(TrainingDataProbe((_gpt(), given), trainer=run))
    class OwnValidation(GPT):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("accuracy", 1.0)

    with pytest.warns(UserWarning, match=r"does not call its validation_step: it logs train_loss, val_loss"):
        _pp(pipeline_parallel_size=2, num_micro_batches=2).check_module(
            OwnValidation(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=64))
    manual = _gpt()
    manual.automatic_optimization = False
    _pp(pipeline_parallel_size=2, num_micro_batches=2).check_module(manual)  # validate/test/predict take it
    with pytest.raises(LayoutError, match=r"lp_pipeline runs every training batch through its pipeline schedule .*"
                                          r"never calls GPT\.training_step, so automatic_optimization=False .*Fix"):
        _refusal(_pp(pipeline_parallel_size=2, num_micro_batches=2), manual)
    with pytest.raises(LayoutError, match=r"num_micro_batches=1 < pipeline_parallel_size=2.*Fix: num_micro_batches "
                                          r">= 2"):
        _pp(pipeline_parallel_size=2, num_micro_batches=1)
    with pytest.raises(LayoutError, match=r"interleaved_1f1b' needs virtual_pipeline_stages >= 2"):
        _pp(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b")
    # ZeRO-2/3 run inside pipelines (FSDP2 per stage, tests/trainer/test_fsdp_layouts.py); offload does not
    with pytest.raises(LayoutError, match=r"(?s)offload='cpu' runs on the DeepSpeed engine.*pipeline_parallel_size=2"
                                          r".*Fix"):
        _pp(pipeline_parallel_size=2, zero_stage=2, offload="cpu")
    with pytest.raises(LayoutError, match=r"num_micro_batches=7: .*r = max\(1, m // p\) = 3 .* 7 % 3 = 1"):
        _pp(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", virtual_pipeline_stages=2,
            num_micro_batches=7)
    with pytest.raises(LayoutError, match=r"pipeline_stage_layers=\[3, 3, 2\] must list one positive layer count "
                                          r"per stage: .* = 2 counts"):
        _pp(pipeline_parallel_size=2, pipeline_stage_layers=[3, 3, 2])
    with pytest.raises(LayoutError, match=r"2 positive layer counts .* summing to the module's 8 pipeline layers; "
                                          r"got 2 counts summing to 7"):
        _refusal(_pp(pipeline_parallel_size=2, pipeline_stage_layers=[3, 4]), _gpt())
    with pytest.raises(LayoutError, match=r"tensor_parallel_size=2"):
        _pp(pipeline_parallel_size=2, tensor_parallel_size=2)
    torch.manual_seed(0)
    tied = GPT(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=64, tie_embeddings=True)
    with pytest.raises(LayoutError, match=r"shares one parameter between pipeline stage 0 \(embed\.tok\.weight\) and "
                                          r"stage 1 \(head\.lm_head\.weight\).*Fix: untie them .*tie_embeddings=False"):
        _refusal(_pp(pipeline_parallel_size=2, num_micro_batches=2), tied)

    class NoHooks(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

    with pytest.raises(LayoutError, match=r"(?s)does not implement `pipeline_layers\(\)`.*A minimal implementation.*"
                                          r"def pipeline_loss\(self, output, target\)"):
        _refusal(_pp(pipeline_parallel_size=2, num_micro_batches=2), NoHooks())


@pytest.mark.parametrize(("layout", "devices", "resume_layout", "resume_devices"), [
    ({"pipeline_parallel_size": 2, "num_micro_batches": 2}, 2, None, 2),
    ({"pipeline_parallel_size": 2, "zero_stage": 1, "num_micro_batches": 2}, 4,
     {"pipeline_parallel_size": 4, "num_micro_batches": 4}, 4),
])
def test_dcp_checkpoint_resumes_and_reads_offline(tmp_path: Path, layout: dict[str, Any], devices: int,
                                                  resume_layout: dict[str, Any] | None, resume_devices: int) -> None:
    """Per-stage DCP checkpoint at step 4 -> resume to step 6 == the uninterrupted run (on the same layout, and on
    another cut: dp=2 x pp=2 ZeRO-1 -> pp=4, the shards are keyed by the module's names); the folder read offline is
    the one-device checkpoint, which resumes on one device."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_parallel.checkpoint import consolidate, detect_format, full_state_dict
    from lightning_parallel.checkpoint.formats.dcp import read_full_checkpoint

    dp = devices // layout["pipeline_parallel_size"]
    kw: dict[str, Any] = {"steps": 6, "accumulate_grad_batches": 1}

    def run(strategy: Any, n: int, d: int, seed: int = 0, **extra: Any) -> Any:
        return fit(strategy, n, d, model=_gpt(seed), batch=GLOBAL_BATCH // d, samples=GLOBAL_BATCH, **kw,
                    **extra)[0]

    ckpt = ModelCheckpoint(dirpath=tmp_path / "a", filename="{step}", every_n_train_steps=4, save_top_k=-1)
    full = run(_pp(**layout), devices, dp, enable_checkpointing=True, callbacks=[ckpt])
    folder = tmp_path / "a" / "step=4.ckpt"
    assert (folder / "meta.pt").is_file() and (folder / ".metadata").is_file()
    assert not list((tmp_path / "a").glob("*.partial"))  # written aside, renamed into place
    assert detect_format(folder).format == "lp_pipeline"
    rl = resume_layout or layout
    resumed = run(_pp(**rl), resume_devices, resume_devices // rl["pipeline_parallel_size"], seed=1,
                  ckpt_path=str(folder))
    exact = weight_diff(resumed, full)
    reference = _gpt().state_dict()
    api = full_state_dict(folder)  # offline, no process group
    assert sorted(api) == sorted(reference) and all(api[k].shape == v.shape for k, v in reference.items())
    one = read_full_checkpoint(folder)  # the whole Lightning checkpoint, optimizer state by one-device index
    assert one["global_step"] == 4
    assert len(one["optimizer_states"][0]["state"]) == len(list(_gpt().parameters()))
    torch.save(one, tmp_path / "one.ckpt")
    consolidate(folder, tmp_path / "weights.ckpt")
    loaded = GPT.load_from_checkpoint(tmp_path / "weights.ckpt", map_location="cpu")
    assert all(torch.equal(loaded.state_dict()[k], api[k]) for k in api)
    single = run("auto", 1, 1, seed=1, ckpt_path=str(tmp_path / "one.ckpt"))
    moved = weight_diff(single, full)
    print(f"lp_pipeline {layout} -> {rl}: DCP resume at step 4 -> 6, max |w - w_uninterrupted| = {exact:.1e}; "
          f"consolidated one-device checkpoint resumed on one device: {moved:.1e}")
    assert exact < (1e-6 if resume_layout else 1e-12)
    assert moved < 2e-5


def test_recipes_pass_the_dry_run_offit() -> None:
    from lightning_parallel.cli import check_recipe

    root = Path(__file__).resolve().parents[2]
    for recipe in ("gpt_pp2.yaml", "gpt_pp2_interleaved.yaml", "gpt_dp2_pp2_zero1.yaml"):
        line = check_recipe(["--config", str(root / "recipes" / recipe), "--trainer.accelerator", "cpu",
                             "--trainer.logger", "false"])
        assert "lp_pipeline" in line and "pp=2" in line, line
