"""lp_tensor under the Lightning Trainer (fork-started gloo ranks) against a single-device reference.

Same global batch and seed: the weights after >= 10 AdamW steps (warmup + cosine, clipping 0.5 by the global norm,
accumulation 2) are compared with one device. Under TP the ranks of a tp group see the same batch (the sampler's
rank and size come from dp), so a (dp, tp) layout reads ``global / dp`` samples per rank.
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
from lightning_parallel.strategies import LPTensorStrategy
from tests.helpers import max_rel_diff
from tests.trainer.token_data import GLOBAL_BATCH, STEPS, SavePredictions, T, TokenData, fit, weight_diff


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
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


@pytest.fixture(scope="module")
def reference() -> GPT:
    return fit("auto", 1, 1, model=_gpt())[0]


def _tp(**layout: Any) -> LPTensorStrategy:
    return LPTensorStrategy(layout, start_method="fork")


@pytest.mark.parametrize(("layout", "devices"), [
    ({"tensor_parallel_size": 2}, 2),
    ({"tensor_parallel_size": 2, "sequence_parallel": True}, 2),
    ({"tensor_parallel_size": 2, "zero_stage": 1}, 4),
    ({"tensor_parallel_size": 2, "zero_stage": 0, "sequence_parallel": True}, 4),
])
def test_gpt_equals_one_device(reference: GPT, layout: dict[str, Any], devices: int) -> None:
    model, _ = fit(_tp(**layout), devices, devices // 2, model=_gpt())
    diff = weight_diff(model, reference)
    print(f"lp_tensor {layout} on {devices} ranks (dp={devices // 2}), {STEPS} AdamW steps: max |w - w_1dev| = "
          f"{diff:.2e}, max per-tensor relative {max_rel_diff(model, reference):.1e}")
    assert diff < 2e-5


@pytest.mark.parametrize("each", [False, True], ids=["reduce-per-step", "reduce_each_batch"])
def test_gpt_dp2_tp2_zero3_equals_one_device(reference: GPT, each: bool) -> None:
    """FSDP2 over dp on tensor-parallel shards, accumulating 2 batches: reducing once per step (the default) or each
    batch's gradient as it goes (``reduce_each_batch``, sequence-parallel partial gradients settled at the step's
    end)."""
    model, _ = fit(_tp(tensor_parallel_size=2, zero_stage=3, reduce_each_batch=each), 4, 2, model=_gpt())
    diff = weight_diff(model, reference)
    print(f"lp_tensor dp=2 x tp=2 zero_stage=3 reduce_each_batch={each} on 4 ranks, {STEPS} AdamW steps: "
          f"max |w - w_1dev| = {diff:.2e}")
    assert diff < 2e-5


@pytest.mark.parametrize(("layout", "devices"), [({"tensor_parallel_size": 2}, 2),
                                                  ({"tensor_parallel_size": 2, "zero_stage": 1}, 4),
                                                  ({"tensor_parallel_size": 2, "zero_stage": 3}, 4)])
def test_tied_embeddings_stay_tied_and_equal_one_device(layout: dict[str, Any], devices: int) -> None:
    """``GPT(tie_embeddings=True)``: the token embedding and the head share one weight. The tensor plan turns each
    layer's weight into its own DTensor, which untied them: each was stepped with its own layer's gradient only
    (1.3e-02 from one device after 4 steps at tp=2). The composition ties them again (both vocabulary-parallel)."""
    def tied() -> GPT:
        torch.manual_seed(0)
        return GPT(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False,
                   tie_embeddings=True)

    reference, _ = fit("auto", 1, 1, model=tied(), steps=4)
    model, _ = fit(_tp(**layout), devices, devices // 2, model=tied(), steps=4)
    diff = weight_diff(model, reference)
    print(f"lp_tensor {layout}, tied embeddings, 4 AdamW steps: max |w - w_1dev| = {diff:.2e}")
    assert diff < 5e-5  # (AdamW's first steps turn the two layers' gradient sums' rounding into 1e-5 here)


def test_clipping_by_value_equals_one_device() -> None:
    """``gradient_clip_algorithm="value"``: torch's ``clip_grad_value_`` refused the model's mix of DTensor and plain
    gradients (``_foreach_clamp_min_`` "got mixed torch.Tensor and DTensor"); the strategy clamps each gradient's
    local tensor (element-wise, so the whole gradient's clamp). Clip 0.01 bites on most elements."""
    kw: dict[str, Any] = dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")
    reference, _ = fit("auto", 1, 1, model=_gpt(), **kw)
    model, _ = fit(_tp(tensor_parallel_size=2), 2, 1, model=_gpt(), **kw)
    diff = weight_diff(model, reference)
    print(f"lp_tensor tp=2, clipping by value 0.01, {STEPS} AdamW steps: max |w - w_1dev| = {diff:.2e}")
    assert weight_diff(reference, fit("auto", 1, 1, model=_gpt())[0]) > 1e-4  # the clip changed the training
    assert diff < 2e-5


def test_non_gpt_module_with_its_own_plan_equals_one_device() -> None:
    ref, _ = fit("auto", 1, 1, model=_tiny())
    model, _ = fit(_tp(tensor_parallel_size=2), 2, 1, model=_tiny())
    diff = weight_diff(model, ref)
    print(f"lp_tensor TinyMLPLM tp=2, {STEPS} AdamW steps + StepLR: max |w - w_1dev| = {diff:.2e}")
    assert weight_diff(ref, _tiny()) > 1e-2  # it trained
    assert diff < 2e-5


def test_logging_validation_and_predict_equal_one_device(tmp_path: Any) -> None:
    """The logged training loss is one replicated value; validate and predict run tensor-parallel too."""
    kw: dict[str, Any] = dict(limit_val_batches=2, val_check_interval=4, steps=8)
    ref, ref_trainer = fit("auto", 1, 1, model=_gpt(), **kw)
    model, trainer = fit(_tp(tensor_parallel_size=2, sequence_parallel=True), 2, 1, model=_gpt(), **kw)
    for key in ("train_loss", "val_loss"):
        got, want = float(trainer.callback_metrics[key]), float(ref_trainer.callback_metrics[key])
        print(f"lp_tensor tp=2 SP logged {key} = {got:.6f}, one device {want:.6f}")
        assert abs(got - want) < 1e-5
    val = trainer.validate(model, datamodule=TokenData(4), verbose=False)[0]["val_loss"]
    ref_val = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         use_distributed_sampler=False, limit_val_batches=2).validate(ref, datamodule=TokenData(4),
                                                                                      verbose=False)
    assert abs(val - ref_val[0]["val_loss"]) < 1e-5, (val, ref_val)
    predictor = pl.Trainer(accelerator="cpu", devices=2, strategy=_tp(tensor_parallel_size=2), logger=False,
                           enable_progress_bar=False, use_distributed_sampler=False, limit_predict_batches=1,
                           callbacks=[SavePredictions(tmp_path)])
    predictor.predict(model, datamodule=TokenData(4), return_predictions=False)
    ref.eval()
    want = ref(TokenData(4).tokens[:4])
    for rank in (0, 1):  # whole logits on every tp rank, not a vocabulary shard
        got = torch.load(tmp_path / f"pred_{rank}.pt")
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)


def _refusal(strategy: LPTensorStrategy, model: Any, devices: int = 2, **trainer: Any) -> None:
    pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, max_steps=1,
               **trainer).fit(model, datamodule=TokenData(2))


def test_refusals_before_spawn() -> None:
    """Every refusal happens in the launching process (fork workers would print them and hang otherwise)."""
    with pytest.raises(LayoutError, match=r"n_head=4, 4 % 3 = 1\. Fix: tensor_parallel_size in \[1, 2, 4\]"):
        _refusal(_tp(tensor_parallel_size=3), _gpt(), devices=3)
    tiny = _tiny()  # the GPT's hidden size is heads x head_dim, so heads % t covers it; a module's own plan:
    tiny.layers[0]["up"], tiny.layers[0]["down"] = nn.Linear(32, 63), nn.Linear(63, 32)
    with pytest.raises(LayoutError, match=r"does not divide layers\.0\.up\.out_features=63 \(output features split "
                                          r"by the 'column' style\): 63 % 2 = 1\. Fix: make the hidden size"):
        _refusal(_tp(tensor_parallel_size=2), tiny)
    torch.manual_seed(0)
    with pytest.raises(LayoutError, match=r"vocab_size=65, 65 % 2 = 1\. Fix: pad vocab_size to 66, the next multiple"):
        _refusal(_tp(tensor_parallel_size=2), GPT(n_layer=1, n_head=2, n_embd=32, block_size=T, vocab_size=65))
    tiny = _tiny()
    tiny.out = nn.Linear(32, 63)  # the module's own plan, no parallel_shape(): the plan check finds it
    with pytest.raises(LayoutError, match=r"out\.out_features=63.*Fix: pad the vocabulary to 64"):
        _refusal(_tp(tensor_parallel_size=2), tiny)
    with pytest.raises(LayoutError, match=r"sequence_parallel=True.*tensor_parallel_size=1"):
        _tp(sequence_parallel=True)
    with pytest.raises(LayoutError, match=r"tensor_parallel_size \(4\) exceeds the devices of one node \(2\)"):
        pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=_tp(tensor_parallel_size=4))
    with pytest.raises(LayoutError, match=r"zero_stage=2\. Fix: zero_stage=1"):
        _tp(tensor_parallel_size=2, zero_stage=2)
    with pytest.raises(LayoutError, match=r"pipeline_parallel_size=2"):
        _tp(tensor_parallel_size=2, pipeline_parallel_size=2)

    class NoPlan(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

    with pytest.raises(LayoutError, match=r"(?s)does not implement `tensor_parallel_plan\(\)`.*A minimal plan.*"
                                          r"\"layers\.\*\.fc1\": \"column\""):
        _refusal(_tp(tensor_parallel_size=2), NoPlan())
    tiny = _tiny()
    tiny.tensor_parallel_plan = lambda: {"layers.*.upp": "column"}  # type: ignore[method-assign]
    with pytest.raises(LayoutError, match=r"'layers\.\*\.upp' matches no submodule"):
        _refusal(_tp(tensor_parallel_size=2), tiny)


@pytest.mark.parametrize(("layout", "devices"), [
    ({"tensor_parallel_size": 2, "sequence_parallel": True}, 2),
    ({"tensor_parallel_size": 2, "zero_stage": 1}, 4),
    ({"tensor_parallel_size": 2, "zero_stage": 3}, 4),
])
def test_dcp_checkpoint_resumes_exactly_and_reads_offline(tmp_path: Path, layout: dict[str, Any],
                                                          devices: int) -> None:
    """Per-rank DCP checkpoint at step 4 -> same-layout resume to step 6 == the uninterrupted run; the folder read
    offline (no process group) is the one-device checkpoint: module names, whole tensors, and it resumes one device.

    One global batch per epoch (accumulation 1): from an epoch-end checkpoint Lightning then replays the same data
    (docs/limits.md)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_parallel.checkpoint.formats.dcp import read_full_checkpoint

    dp = devices // 2
    kw: dict[str, Any] = {"steps": 6, "accumulate_grad_batches": 1}

    def run(strategy: Any, n: int, d: int, seed: int = 0, **extra: Any) -> Any:
        return fit(strategy, n, d, model=_gpt(seed), batch=GLOBAL_BATCH // d, samples=GLOBAL_BATCH, **kw,
                    **extra)[0]

    ckpt = ModelCheckpoint(dirpath=tmp_path / "a", filename="{step}", every_n_train_steps=4, save_top_k=-1)
    full = run(_tp(**layout), devices, dp, enable_checkpointing=True, callbacks=[ckpt])
    folder = tmp_path / "a" / "step=4.ckpt"
    assert (folder / "meta.pt").is_file() and (folder / ".metadata").is_file()
    assert len(list(folder.glob("*.distcp"))) == devices  # one shard file per rank
    # other initial weights: only a checkpoint that really restored weights and optimizer state gives `full`
    resumed = run(_tp(**layout), devices, dp, seed=1, ckpt_path=str(folder))
    exact = weight_diff(resumed, full)
    one_device = read_full_checkpoint(folder)  # offline: no process group here
    reference = _gpt().state_dict()
    assert sorted(one_device["state_dict"]) == sorted(reference)
    assert all(one_device["state_dict"][k].shape == v.shape for k, v in reference.items())
    assert one_device["global_step"] == 4 and len(one_device["optimizer_states"][0]["state"]) == len(reference)
    torch.save(one_device, tmp_path / "one.ckpt")
    # the one checkpoint API reads the same folder (format lp_tensor) and consolidates it for load_from_checkpoint
    from lightning_parallel.checkpoint import consolidate, detect_format, full_state_dict

    assert detect_format(folder).format == "lp_tensor"
    api = full_state_dict(folder)
    assert sorted(api) == sorted(reference) and all(torch.equal(api[k], one_device["state_dict"][k]) for k in api)
    consolidate(folder, tmp_path / "consolidated.ckpt")
    loaded = GPT.load_from_checkpoint(tmp_path / "consolidated.ckpt", map_location="cpu")
    assert all(torch.equal(loaded.state_dict()[k], api[k]) for k in api)
    single = run("auto", 1, 1, seed=1, ckpt_path=str(tmp_path / "one.ckpt"))
    moved = weight_diff(single, full)
    print(f"lp_tensor {layout}: DCP resume at step 4 -> 6, max |w - w_uninterrupted| = {exact:.1e}; offline "
          f"one-device checkpoint resumed on one device: {moved:.1e}")
    assert exact == 0.0
    assert moved < 2e-5
    if devices == 2:  # the one-device file's weights load into lp_tensor too (scattered): same validation loss
        data = TokenData(GLOBAL_BATCH, GLOBAL_BATCH)
        plain = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                           use_distributed_sampler=False).validate(_gpt(1), data, ckpt_path=str(tmp_path / "one.ckpt"),
                                                                   verbose=False)[0]["val_loss"]
        tp = pl.Trainer(accelerator="cpu", devices=2, strategy=_tp(**layout), logger=False, enable_progress_bar=False,
                        use_distributed_sampler=False).validate(_gpt(1), data, ckpt_path=str(tmp_path / "one.ckpt"),
                                                                verbose=False)[0]["val_loss"]
        print(f"one-device checkpoint validated on one device {plain:.6f}, under lp_tensor {tp:.6f}")
        assert abs(plain - tp) < 1e-5 and abs(plain - float(_gpt(1)._loss(next(iter(data.val_dataloader()))))) > 1e-3


@pytest.mark.parametrize("recipe", ["gpt_tp2.yaml", "gpt_dp2_tp2_zero1.yaml"])
def test_recipes_pass_the_dry_run_offit(recipe: str) -> None:
    """Everything fit would build (the model on the meta device, the layout against 2 or 4 devices, the plan), no
    process started."""
    from lightning_parallel.cli import check_recipe

    root = Path(__file__).resolve().parents[2]
    line = check_recipe(["--config", str(root / "recipes" / recipe), "--trainer.accelerator", "cpu",
                         "--trainer.logger", "false"])
    assert "lp_tensor" in line and "tp=2" in line, line


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_under_tp_equals_one_device(reference: GPT, mode: str) -> None:
    """Recomputation is applied before TP (parameter and module names unchanged), so the plan still resolves; a
    recomputed block re-runs its forward collectives in backward."""
    pytest.importorskip("lightning_parallel.parallel.activation_checkpointing")
    model, _ = fit(_tp(tensor_parallel_size=2, sequence_parallel=True, activation_checkpointing=mode), 2, 1,
                    model=_gpt())
    diff = weight_diff(model, reference)
    print(f"lp_tensor tp=2 SP activation_checkpointing={mode}: max |w - w_1dev| = {diff:.2e}")
    assert diff < 2e-5


class ManualGPT(GPT):
    """Manual optimization: ``manual_backward``, clipping by the global norm, the optimizer and scheduler steps."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt, sched = self.optimizers(), self.lr_schedulers()
        loss = self._loss(batch)
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")  # type: ignore[arg-type]
        opt.step()  # type: ignore[union-attr]
        sched.step()  # type: ignore[union-attr]
        self.log("train_loss", loss)
        return loss


def test_manual_optimization_equals_one_device() -> None:
    """``manual_backward`` inside ``training_step`` runs under the step's ``loss_parallel`` (it does not nest: before,
    the backward's own one removed the step's handlers and the step failed with a KeyError)."""
    kw: dict[str, Any] = dict(gradient_clip_val=None, accumulate_grad_batches=1, steps=6)

    def manual() -> ManualGPT:
        torch.manual_seed(0)
        return ManualGPT(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)

    ref, _ = fit("auto", 1, 1, model=manual(), batch=GLOBAL_BATCH, **kw)
    model, _ = fit(_tp(tensor_parallel_size=2), 2, 1, model=manual(), batch=GLOBAL_BATCH, **kw)
    diff = weight_diff(model, ref)
    print(f"lp_tensor tp=2, manual optimization, 6 AdamW steps: max |w - w_1dev| = {diff:.2e}")
    assert weight_diff(ref, manual()) > 1e-3  # it trained
    assert diff < 2e-5
