"""Context parallelism under the Trainer against one device: the reference GPT with its sequences split over cp ranks.

Same global batch and seed as one device, 10 AdamW steps with clipping 0.5 by the global norm and accumulation over 2
batches (``tests/trainer/token_data.fit``, 16-token sequences). Each run records the logged ``train_loss`` of every
batch (averaged over dp x cp: the one-device value of the global batch) and ends with the whole weights; both are
compared with one device's. Layouts: cp2 and cp4 (lp_ddp), dp2 x cp2 ZeRO-3 (lp_sharded, FSDP2 over dp x cp),
cp2 x tp2 (lp_tensor), cp2 x pp2 (lp_pipeline), dp2 x cp2 x tp2 (8 ranks, slow), and the all-to-all style.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import lightning_parallel  # noqa: F401
from lightning_parallel.config import LayoutError
from lightning_parallel.models import GPT
from lightning_parallel.strategies import (
    LPDDPStrategy,
    LPDPStrategy,
    LPHybridStrategy,
    LPPipelineStrategy,
    LPShardedStrategy,
    LPTensorStrategy,
)
from tests.trainer.token_data import GLOBAL_BATCH, STEPS, StepMeanMixin, T, fit, weight_diff


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)


class _Losses(pl.Callback):
    """Rank 0 writes the logged ``train_loss`` of every training batch to ``path`` when fitting ends."""

    def __init__(self, path: Path) -> None:
        self.path, self.losses = path, []  # type: ignore[var-annotated]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(self.losses))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPT, list[float]]:
    path = tmp_path_factory.mktemp("one_device") / "losses.json"
    model = fit("auto", 1, 1, model=_gpt(), callbacks=[_Losses(path)])[0]
    return model, json.loads(path.read_text())


CP2 = {"context_parallel_size": 2}
CASES = [
    pytest.param(LPDDPStrategy, CP2, 2, id="cp2"),
    pytest.param(LPDDPStrategy, {"context_parallel_size": 4}, 4, id="cp4"),
    pytest.param(LPShardedStrategy, {**CP2, "zero_stage": 3}, 4, id="dp2-cp2-zero3"),
    pytest.param(LPTensorStrategy, {**CP2, "tensor_parallel_size": 2}, 4, id="cp2-tp2"),
    pytest.param(LPPipelineStrategy, {**CP2, "pipeline_parallel_size": 2, "num_micro_batches": 2}, 4, id="cp2-pp2"),
    pytest.param(LPDDPStrategy, {**CP2, "context_parallel_style": "all_to_all"}, 4, id="dp2-cp2-all_to_all"),
    pytest.param(LPTensorStrategy, {**CP2, "tensor_parallel_size": 2, "sequence_parallel": True}, 4,
                 id="cp2-tp2-sequence_parallel"),
    pytest.param(LPShardedStrategy, {**CP2, "zero_stage": 1, "activation_checkpointing": "selective"}, 4,
                 id="dp2-cp2-zero1-selective"),
    pytest.param(LPHybridStrategy, {**CP2, "tensor_parallel_size": 2, "pipeline_parallel_size": 1}, 8,
                 id="dp2-cp2-tp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("cls", "layout", "devices"), CASES)
def test_context_parallel_equals_one_device(reference: tuple[GPT, list[float]], tmp_path: Path, cls: Any,
                                            layout: dict[str, Any], devices: int) -> None:
    one_device, one_losses = reference
    strategy = cls(layout, start_method="fork")
    model_ranks = layout["context_parallel_size"] * layout.get("pipeline_parallel_size", 1) * \
        layout.get("tensor_parallel_size", 1)
    path = tmp_path / "losses.json"
    model, _ = fit(strategy, devices, devices // model_ranks, model=_gpt(), callbacks=[_Losses(path)])
    losses = json.loads(path.read_text())
    diff = weight_diff(model, one_device)
    loss_diff = max(abs(a - b) for a, b in zip(losses, one_losses, strict=True))
    print(f"\n{strategy.describe()}: {len(losses) // 2} AdamW steps, max |w - w_1dev| = {diff:.2e}, "
          f"max |loss - loss_1dev| over {len(losses)} batches = {loss_diff:.2e}")
    for i, (a, b) in enumerate(zip(losses, one_losses, strict=True)):
        print(f"  batch {i:2d} (step {i // 2 + 1:2d}): loss {a:.7f}  one device {b:.7f}  diff {a - b:+.1e}")
    assert len(losses) == 2 * STEPS  # 10 optimizer steps of 2 accumulated batches
    assert diff < 2e-5
    assert loss_diff < 2e-6


class _Logged(_Losses):
    """Also the logged ``val_loss`` of every validation run (sanity checks off)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.val: list[float] = []

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.val.append(float(trainer.callback_metrics["val_loss"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps({"train": self.losses, "val": self.val}))


_REFERENCES: dict[str, tuple[GPT, dict[str, list[float]]]] = {}


def _ignored(kind: str) -> dict[str, Any]:
    """Fit settings: labels -100 (``kind``: "ragged", a prompt and a padding of varying lengths with one batch in
    which cp rank 0 counts no token; "tail", the last quarter of every sample), validation every 4 batches."""
    return dict(data={"ignored": kind}, limit_val_batches=2, val_check_interval=4)


class StepMeanGPT(StepMeanMixin, GPT):  # type: ignore[misc]
    """The reference GPT with the step's token mean (:class:`~tests.trainer.token_data.StepMeanMixin`)."""


def _step_mean_gpt(kind: str, samples: int = 2 * STEPS * GLOBAL_BATCH) -> StepMeanGPT:
    from tests.trainer.token_data import TokenData

    torch.manual_seed(0)
    model = StepMeanGPT(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)
    model.labels = TokenData(1, samples, ignored=kind).dataset.tensors[1]
    return model


def _ignored_reference(kind: str, folder: Path) -> tuple[GPT, dict[str, list[float]]]:
    """One device, Lightning's loop, the step's token mean (:class:`StepMeanGPT`); checked once against one device
    taking each global batch whole (no accumulation: the step's mean is its loss)."""
    if kind not in _REFERENCES:
        model = _step_mean_gpt(kind)
        fit("auto", 1, 1, model=model, callbacks=[_Logged(folder / "losses.json")], **_ignored(kind))
        whole = fit("auto", 1, 1, model=_gpt(), batch=GLOBAL_BATCH, accumulate_grad_batches=1,
                    data={"ignored": kind})[0]
        assert weight_diff(model, whole) < 2e-6, weight_diff(model, whole)
        _REFERENCES[kind] = model, json.loads((folder / "losses.json").read_text())
    return _REFERENCES[kind]


@pytest.mark.parametrize(("cls", "layout", "devices", "kind"), [
    pytest.param(LPDDPStrategy, CP2, 2, "ragged", id="cp2"),
    pytest.param(LPTensorStrategy, {**CP2, "tensor_parallel_size": 2}, 4, "ragged", id="cp2-tp2"),
    pytest.param(LPPipelineStrategy, {**CP2, "pipeline_parallel_size": 2, "num_micro_batches": 1,
                                      "pipeline_schedule": "gpipe"}, 4, "ragged", id="cp2-pp2"),
    pytest.param(LPShardedStrategy, {**CP2, "zero_stage": 3}, 4, "ragged", id="dp2-cp2-zero3"),
    pytest.param(LPDDPStrategy, {}, 2, "ragged", id="dp2"),
    pytest.param(LPDPStrategy, None, 2, "ragged", id="lp_dp-x2"),
    pytest.param(LPShardedStrategy, {"zero_stage": 3, "data_parallel_shard_size": 2}, 4, "ragged", id="hsdp2x2"),
    pytest.param(LPPipelineStrategy, {"pipeline_parallel_size": 2, "num_micro_batches": 2}, 2, "ragged",
                 id="pp2-m2"),
    pytest.param(LPPipelineStrategy, {"pipeline_parallel_size": 2, "num_micro_batches": 2}, 4, "ragged",
                 id="dp2-pp2-m2"),
])
def test_ignored_labels_count_every_token_once(tmp_path_factory: pytest.TempPathFactory, cls: Any,
                                               layout: dict[str, Any] | None, devices: int, kind: str) -> None:
    """Ignored labels fall unevenly over the cp ranks' chunks, the dp ranks' batches and a pipeline's micro-batches:
    each token mean is weighed by its share of the global batch's counted tokens (the GPT's plan names its labels),
    so the loss, the logged train and validation losses and the weights are one device's -- without the weighing
    2e-2 apart (cp2, tail padding), 1.2e-2 (dp2, dp2 x cp2), 7.7e-3 (pp2 with 2 micro-batches), 1.4e-2 (dp2 x pp2),
    or a NaN loss where a cp rank counts no token (ragged). A pipeline weighs on its last stage; a tensor-parallel
    loss is a DTensor."""
    one_device, one = _ignored_reference(kind, tmp_path_factory.mktemp(f"one_device_{kind}"))
    path = tmp_path_factory.mktemp("run") / "losses.json"
    if layout is None:  # lp_dp: one process, the batch split over its devices' replicas
        strategy, dp = cls(), 1
    else:
        strategy = cls(layout, start_method="fork")
        dp = devices // (layout.get("context_parallel_size", 1) * layout.get("pipeline_parallel_size", 1)
                         * layout.get("tensor_parallel_size", 1))
    model, _ = fit(strategy, devices, dp, model=_gpt(), callbacks=[_Logged(path)], **_ignored(kind))
    logged = json.loads(path.read_text())
    diff = weight_diff(model, one_device)
    train = max(abs(a - b) for a, b in zip(logged["train"], one["train"], strict=True))
    val = max(abs(a - b) for a, b in zip(logged["val"], one["val"], strict=True))
    print(f"\n{cls.__name__} {layout}, {kind} -100 labels: max |w - w_1dev| = {diff:.2e}, train losses {train:.2e}, "
          f"validation losses {val:.2e} ({len(logged['val'])} runs)")
    assert len(logged["train"]) == 2 * STEPS and len(logged["val"]) == len(one["val"]) == 5
    assert diff < 2e-5
    assert train < 2e-6 and val < 2e-6


@pytest.mark.parametrize(("cls", "layout"), [
    pytest.param(LPDDPStrategy, {}, id="lp_ddp"),
    pytest.param(LPPipelineStrategy, {"pipeline_parallel_size": 2, "num_micro_batches": 2}, id="lp_pipeline"),
])
def test_an_epochs_short_last_window_and_the_next_epoch_weigh_their_own_tokens(cls: Any, layout: dict[str, Any]
                                                                               ) -> None:
    """Epochs of 9 global batches with accumulation 2: windows of 2, 2, 2, 2, then 1 at each epoch's end (which
    Lightning still divides by 2), over 2 epochs, dp2 (and dp2 x pp2 with 2 micro-batches) with ragged -100 labels
    against one device's step mean: each window is read ahead from its epoch's start, so its count holds only its
    own batches."""
    samples = 36  # 9 global batches of 4 per epoch; 10 steps = 5 per epoch
    reference = _step_mean_gpt("ragged", samples)
    fit("auto", 1, 1, model=reference, batch=4, samples=samples, data={"ignored": "ragged"})
    devices = 2 * layout.get("pipeline_parallel_size", 1)
    model, _ = fit(cls(layout, start_method="fork"), devices, 2, model=_gpt(), batch=2, samples=samples,
                   data={"ignored": "ragged"})
    diff = weight_diff(model, reference)
    print(f"\n{cls.__name__} dp2 {layout}, epochs of 9 batches, windows 2-2-2-2-1, 2 epochs: "
          f"max |w - w_1dev| = {diff:.2e}")
    assert weight_diff(reference, _gpt()) > 1e-3  # it trained
    assert diff < 2e-5


def test_the_read_ahead_leaves_the_users_loader_as_it_is(tmp_path: Path) -> None:
    """The accumulation windows are read ahead by a copy of the training loader: the user's object, here also the
    validation loader, keeps its class and yields every batch -- in validation during the fit and after it."""
    from torch.utils.data import DataLoader, DistributedSampler

    from tests.trainer.token_data import TokenData

    class Check(pl.Callback):
        def __init__(self, loader: DataLoader) -> None:
            self.loader, self.val_batches = loader, 0

        def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
            self.val_batches += 1

        def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            plain = type(self.loader) is DataLoader and not hasattr(self.loader, "_lp_step_tokens")
            windows = type(trainer.train_dataloader) is not DataLoader  # the fit's own copy reads ahead
            result = [plain, windows, self.val_batches, sum(1 for _ in self.loader), len(self.loader)]
            (tmp_path / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))

    data = TokenData(2, 16, ignored="ragged").dataset
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False))
    trainer = pl.Trainer(strategy=LPDDPStrategy(start_method="fork"), accelerator="cpu", devices=2, max_steps=2,
                         accumulate_grad_batches=2, val_check_interval=2, limit_val_batches=None, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         use_distributed_sampler=False, callbacks=[Check(loader)])
    trainer.fit(_gpt(), train_dataloaders=loader, val_dataloaders=loader)
    plain, windows, val_batches, after, length = json.loads((tmp_path / "rank0.json").read_text())
    assert plain and windows
    assert val_batches == 2 * length  # two validations of the whole loader (4 batches each)
    assert after == length == 4


def test_gradient_scale_over_dp_x_cp_with_sgd(tmp_path: Path) -> None:
    """AdamW and clipping hide a wrong gradient scale (a sum over cp instead of a mean): plain SGD without clipping
    shows it in the weights. dp2 x cp2 against one device."""
    from tests.helpers import SGDGPT

    def sgd() -> GPT:
        torch.manual_seed(0)
        return SGDGPT(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64, bias=False)

    one = fit("auto", 1, 1, model=sgd(), gradient_clip_val=None)[0]
    model, _ = fit(LPDDPStrategy(CP2, start_method="fork"), 4, 2, model=sgd(), gradient_clip_val=None)
    diff = weight_diff(model, one)
    print(f"\nlp_ddp dp2 x cp2, SGD without clipping: max |w - w_1dev| = {diff:.2e}")
    assert diff < 2e-5


def test_predict_gathers_the_sequence_back(tmp_path: Path) -> None:
    """predict under cp2: each rank predicts on its head and tail tokens; the logits are gathered over cp into the
    whole sequence, in order, and equal one device's."""
    from tests.trainer.token_data import GLOBAL_BATCH, SavePredictions, TokenData

    model = _gpt()
    data = TokenData(GLOBAL_BATCH)
    expected = model(data.tokens[:GLOBAL_BATCH]).detach()
    trainer = pl.Trainer(strategy=LPDDPStrategy(CP2, start_method="fork"), accelerator="cpu", devices=2, logger=False,
                         enable_progress_bar=False, callbacks=[SavePredictions(tmp_path)])
    trainer.predict(_gpt(), datamodule=data, return_predictions=False)
    for rank in (0, 1):
        out = torch.load(tmp_path / f"pred_{rank}.pt")
        assert out.shape == expected.shape  # the whole sequence on every cp rank
        assert (out - expected).abs().max() < 1e-5
    # dict batches whose labels the plan names but a prediction batch lacks, with a per-sample entry first: the
    # ranks failed on the missing key ("names 'labels', which the batch ... does not have"), and with the labels on
    # the per-sample entry's length (IndexError); a validation logging the extremes of its per-token losses took
    # the mean of the cp ranks' extremes (1.2e-02 and 4.5e-02 from one device)
    from torch.utils.data import DataLoader

    samples = [{"index": i, "tokens": data.tokens[i]} for i in range(GLOBAL_BATCH)]
    batches = DataLoader(samples, batch_size=4)
    (tmp_path / "pred_0.pt").unlink()
    trainer = pl.Trainer(strategy=LPDDPStrategy(CP2, start_method="fork"), accelerator="cpu", devices=2, logger=False,
                         enable_progress_bar=False, callbacks=[SavePredictions(tmp_path)])
    trainer.predict(_DictBatches(), dataloaders=batches, return_predictions=False)
    assert (torch.load(tmp_path / "pred_0.pt") - expected[:4]).abs().max() < 1e-5
    labelled = DataLoader([{**sample, "labels": data.dataset[i][1]} for i, sample in enumerate(samples)], batch_size=4)
    one = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    expected_logs = one.validate(_DictBatches(), dataloaders=labelled, verbose=False)[0]
    trainer = pl.Trainer(strategy=LPDDPStrategy(CP2, start_method="fork"), accelerator="cpu", devices=2, logger=False,
                         enable_progress_bar=False)
    trainer.validate(_DictBatches(), dataloaders=labelled, verbose=False)
    got = {k: float(v) for k, v in trainer.callback_metrics.items()}
    print(f"cp2 validation extremes: {got} (one device {expected_logs})")
    assert all(abs(got[k] - expected_logs[k]) < 1e-4 for k in ("tok_max", "tok_min", "tok_sum")), (got, expected_logs)


class _DictBatches(GPT):
    """The test GPT on dict batches (``index`` per sample, ``tokens``, and ``labels`` but when predicting), logging
    the extremes of its per-token validation losses."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)

    def context_parallel_plan(self) -> dict[str, Any]:
        return {**super().context_parallel_plan(), "batch": {"tokens": 1, "labels": 1}, "labels": "labels"}

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch["tokens"])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        logits = self(batch["tokens"])
        per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        self.log("tok_max", per_token.max(), reduce_fx="max", sync_dist=True)
        self.log("tok_min", per_token.min(), reduce_fx="min", sync_dist=True)
        self.log("tok_sum", per_token.sum(), reduce_fx="sum")  # was averaged over the cp ranks


class _OneBlockRouted(GPT):
    def context_parallel_plan(self) -> dict[str, Any]:
        return {**super().context_parallel_plan(), "attention": ["blocks.0.attn.core"]}


class _MemoryAttention(torch.nn.Module):
    """A cross-attention onto a learned memory of 8 slots (the plan does not split it: every rank holds it whole)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.memory = torch.nn.Parameter(torch.randn(1, 1, 8, width) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.memory.expand(x.shape[0], -1, -1, -1)
        return x + torch.nn.functional.scaled_dot_product_attention(x.unsqueeze(1), memory, memory).squeeze(1)


class _WithMemory(GPT):
    """A GPT whose head reads a memory first; under cp2 a rank's 8 tokens meet 8 memory slots (one length)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)
        self.xattn = _MemoryAttention(32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        *layers, head = self.pipeline_layers()
        x = idx
        for layer in layers:
            x = layer(x)
        return head(self.xattn(x))

    def context_parallel_plan(self) -> dict[str, Any]:
        return {**super().context_parallel_plan(), "unsplit_attention": ["xattn"]}


def test_an_attention_the_plan_does_not_name_is_refused_at_the_first_step() -> None:
    """A plan naming one block's attention of two trained silently, the second block attending over each rank's
    chunks only (1.2e-02 from one device after 3 steps): the first step refuses it, naming the submodule."""
    torch.manual_seed(0)
    model = _OneBlockRouted(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)
    with pytest.raises(Exception, match=r"submodule 'blocks.1.attn.core' calls scaled_dot_product_attention outside "
                                        r"the attention submodules .* names \(blocks.0.attn.core\)"):
        fit(LPDDPStrategy(CP2, start_method="fork"), 2, 1, model=model, steps=1)
    # a cross-attention onto a memory the plan does not split, of the rank's length, named as such: as one device
    reference, _ = fit("auto", 1, 1, model=_WithMemory(), steps=2)
    model, _ = fit(LPDDPStrategy(CP2, start_method="fork"), 2, 1, model=_WithMemory(), steps=2)
    assert weight_diff(model, reference) < 1e-5
    # a pipeline's stages too (the schedule runs them: the check was opened by the other strategies' steps only)
    torch.manual_seed(0)
    model = _OneBlockRouted(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)
    with pytest.raises(Exception, match=r"calls scaled_dot_product_attention outside the attention submodules"):
        fit(LPPipelineStrategy({**CP2, "pipeline_parallel_size": 2, "num_micro_batches": 2}, start_method="fork"), 4,
            1, model=model, steps=1)


def test_a_module_without_the_hook_is_refused_before_spawn() -> None:
    class NoHook(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

    trainer = pl.Trainer(strategy=LPDDPStrategy(CP2, start_method="fork"), accelerator="cpu", devices=2,
                         logger=False, enable_progress_bar=False)
    with pytest.raises(LayoutError) as err:
        trainer.fit(NoHook())
    text = str(err.value)
    assert "does not implement `context_parallel_plan()`" in text and "def context_parallel_plan(self):" in text
    assert '"attention": ["layers.*.attn_core"]' in text and "sequence_positions" in text


def test_attention_dropout_and_a_short_sequence_are_refused_before_spawn() -> None:
    trainer = pl.Trainer(strategy=LPDDPStrategy({"context_parallel_size": 4}, start_method="fork"),
                         accelerator="cpu", devices=4, logger=False, enable_progress_bar=False)
    dropout = GPT(n_layer=1, n_head=2, n_embd=16, block_size=T, vocab_size=64, dropout=0.1)
    with pytest.raises(LayoutError, match=r"'blocks\.0\.attn\.core' has dropout=0\.1: dropout on the attention "
                                          r"probabilities is not run under context parallelism"):
        trainer.fit(dropout)
    from lightning_parallel.data import TextDataModule

    with pytest.raises(LayoutError, match=r"the data module TextDataModule's block_size is 12: 12 % 8 = 4"):
        trainer.fit(_gpt(), datamodule=TextDataModule(block_size=12, batch_size=2))
    # a plain DataLoader's batch, checked as a data module's block_size is: the length, an int plan meeting a
    # per-sample tensor (both failed in the ranks, the second with an IndexError), an unsplit per-token entry (warned)
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_parallel.strategies.layout import TrainingDataProbe, check_context_batch

    def loader(*tensors: torch.Tensor) -> DataLoader:
        return DataLoader(TensorDataset(*tensors), batch_size=2)

    tokens = torch.randint(0, 64, (8, 12))
    with pytest.raises(LayoutError, match=r"length is 12: 12 % 8 = 4"):
        check_context_batch(_gpt(), TrainingDataProbe((None, loader(tokens, tokens))), 4)
    tokens = torch.randint(0, 64, (8, T))
    with pytest.raises(LayoutError, match=r"splits batch entry 2 along dim 1, but it is a tensor of shape \(2,\)"):
        check_context_batch(_EveryTensorSplit(), TrainingDataProbe((None, loader(tokens, tokens, torch.ones(8)))), 4)
    with pytest.warns(UserWarning, match=r"does not split the batch entries 2 of shape \(2, 16\), which have the "
                                         r"sequence's length"):
        check_context_batch(_gpt(), TrainingDataProbe((None, loader(tokens, tokens, torch.ones(8, T)))), 4)
    # and before a fit's ranks start
    trainer = pl.Trainer(strategy=LPDDPStrategy({"context_parallel_size": 4}, start_method="fork"),
                         accelerator="cpu", devices=4, logger=False, enable_progress_bar=False)
    with pytest.raises(LayoutError, match=r"splits batch entry 2 along dim 1"):
        trainer.fit(_EveryTensorSplit(), loader(tokens, tokens, torch.ones(8)))


class _EveryTensorSplit(GPT):
    def __init__(self) -> None:
        super().__init__(n_layer=1, n_head=4, n_embd=16, block_size=T, vocab_size=64)

    def context_parallel_plan(self) -> dict[str, Any]:
        return {**super().context_parallel_plan(), "batch": 1}


def test_a_wrong_labels_entry_is_refused_before_spawn() -> None:
    """The plan's ``labels``: an entry the plan does not split, a non-integer ``ignore_index``, an entry that holds
    no integer labels in a real batch, and (pipelines) a target other than those labels -- each refused in the
    launching process, with the entry and the fix."""
    from torch.utils.data import DataLoader, TensorDataset

    class Plan(GPT):
        plan: dict[str, Any] = {}

        def context_parallel_plan(self) -> dict[str, Any]:
            return {**super().context_parallel_plan(), **self.plan}

    class Shifted(Plan):
        def pipeline_batch(self, batch: Any) -> tuple[Any, torch.Tensor | None]:
            return batch[0], batch[1].roll(1, dims=1)

    def refused(cls: type[Plan], plan: dict[str, Any], layout: dict[str, Any], loader: Any = None) -> str:
        strategy = (LPPipelineStrategy if "pipeline_parallel_size" in layout else LPDDPStrategy)(
            layout, start_method="fork")
        torch.manual_seed(0)
        model = cls(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64)
        model.plan = plan
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4 if strategy.layout.pipeline_parallel_size
                             > 1 else 2, logger=False, enable_progress_bar=False, max_steps=1)
        tokens = torch.randint(0, 64, (16, T))
        with pytest.raises(LayoutError) as err:
            trainer.fit(model, train_dataloaders=loader or DataLoader(TensorDataset(tokens, tokens), batch_size=4))
        return str(err.value)

    ddp = CP2
    assert "'labels' names batch entry 2, which 'batch' ({0: 1, 1: 1}) does not split" in refused(
        Plan, {"labels": 2}, ddp)
    assert "'ignore_index' must be an int" in refused(Plan, {"ignore_index": "pad"}, ddp)
    tokens = torch.randint(0, 64, (16, T))
    text = refused(Plan, {}, ddp, DataLoader(TensorDataset(tokens, tokens.float()), batch_size=4))
    assert "names batch entry 1, which holds torch.float32, not integer token labels" in text
    pipe = {**CP2, "pipeline_parallel_size": 2, "num_micro_batches": 2}
    text = refused(Shifted, {}, pipe)
    assert "pipeline_batch(batch) returns a different target" in text and "Fix: return the labels entry" in text


@pytest.mark.parametrize(("layout", "dp"), [pytest.param(CP2, 1, id="cp2"), pytest.param({}, 2, id="dp2")])
def test_manual_optimization_weighs_the_loss_it_backpropagates(layout: dict[str, Any], dp: int) -> None:
    """Under manual optimization the loss goes to ``manual_backward`` inside the step, not back to the loop: it is
    weighed there (in the strategy's ``backward``) by the rank's token share (over dp summed before the step). cp2
    and dp2 with ragged ignored labels (one batch in which cp rank 0 counts nothing), against the same manual loop
    on one device."""
    from tests.trainer.test_tensor import ManualGPT
    from tests.trainer.token_data import GLOBAL_BATCH

    def manual() -> ManualGPT:
        torch.manual_seed(0)
        return ManualGPT(n_layer=2, n_head=4, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)

    kw: dict[str, Any] = dict(gradient_clip_val=None, accumulate_grad_batches=1, steps=8, batch=GLOBAL_BATCH // 2,
                              data={"ignored": "ragged"})
    ref, _ = fit("auto", 1, 1, model=manual(), **kw)
    model, _ = fit(LPDDPStrategy(layout, start_method="fork"), 2, dp, model=manual(), **{**kw, "batch": 4 // dp})
    diff = weight_diff(model, ref)
    print(f"\nlp_ddp {layout}, manual optimization, ragged -100 labels, 8 AdamW steps: max |w - w_1dev| = {diff:.2e}")
    assert weight_diff(ref, manual()) > 1e-3  # it trained
    assert diff < 2e-5
