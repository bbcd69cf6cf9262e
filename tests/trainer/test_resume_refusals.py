"""A checkpoint that does not fit the configured model, optimizer or LR schedulers is refused before any rank starts,
for every checkpoint format (a file, an lp_sharded folder, a DCP folder, a DeepSpeed folder), with what was saved,
what is configured and the fix; ``--resume_weights_only`` takes the weights alone.

One short save per format (forked CPU ranks, the resume matrix's GPT); then, per format, ``trainer.fit(...,
ckpt_path=...)`` with a changed model is run with every way of starting a rank trapped: the refusal must come first.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed
from torch.utils.data import DataLoader

from lightning_parallel.checkpoint import full_state_dict
from lightning_parallel.checkpoint.errors import ResumeError
from lightning_parallel.checkpoint.resume import TRUST_ENV
from lightning_parallel.cli import load_weights_only
from lightning_parallel.strategies import LPDDPStrategy, LPPipelineStrategy
from lightning_parallel.testing import resume_matrix as rm
from lightning_parallel.testing.faulty import OptimizerChoiceGPT

FORMATS = {"file": "lp_ddp x2", "lp_sharded folder": "lp_sharded z1 x2", "DCP folder": "lp_pipeline pp2",
           "DeepSpeed folder": "lp_zero_offload x2"}


class _Launched(RuntimeError):
    pass


def _trap_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Starting a rank raises :class:`_Launched` (and is recorded in the list returned) instead."""
    started: list[str] = []

    def trap(*args: Any, **kwargs: Any) -> Any:
        started.append("rank")
        raise _Launched("a rank would have been started")

    from lightning.pytorch.strategies.launchers import multiprocessing as mp_launcher

    monkeypatch.setattr(mp_launcher.mp, "start_processes", trap)
    monkeypatch.setattr(multiprocessing.get_context("fork"), "Process", trap, raising=False)
    monkeypatch.setattr(torch.distributed, "init_process_group", trap)
    return started


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    rm.quiet()
    os.environ[TRUST_ENV] = "1"  # the DeepSpeed folder's optimizer files hold DeepSpeed objects (written here)
    folder = tmp_path_factory.mktemp("refusals")
    return {fmt: rm.save(layout, folder) for fmt, layout in FORMATS.items() if layout in rm.LAYOUTS}


def _model(**changes: Any) -> pl.LightningModule:
    torch.manual_seed(0)
    args: dict[str, Any] = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": rm.T, "vocab_size": rm.VOCAB,
                            "warmup_steps": 2, "bias": False, **changes}
    return OptimizerChoiceGPT(**args)


CHANGES: dict[str, tuple[dict[str, Any], str]] = {
    "another shape (n_embd 16)": ({"n_embd": 16}, r"n_embd: configured 16, saved 32.*Fix: configure the model"),
    "another optimizer (SGD)": ({"optimizer": "sgd"}, r"optimizer 0 was saved as .*SGD \(dampening, momentum, "
                                                      r"nesterov\).*--resume_weights_only"),
    "an added LR scheduler (StepLR)": ({"step_lr": True},
                                       r"holds 1 LR scheduler state\(s\); this run configures 2 \(LambdaLR, StepLR\)"),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_mismatch_is_refused_before_any_rank_starts(saved: dict[str, Path], fmt: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if fmt not in saved:
        pytest.skip("DeepSpeed or its CPU ops are not available here")
    started = _trap_launches(monkeypatch)
    path = saved[fmt]
    # the strategy that resumes: the pipeline for the DCP folder, lp_ddp (any format, via the one-device form) else
    strategy = (lambda: LPPipelineStrategy({"pipeline_parallel_size": 2, "num_micro_batches": 2},
                                           start_method="fork")) if fmt == "DCP folder" else (
        lambda: LPDDPStrategy(start_method="fork"))
    lines = []
    for change, (args, expect) in CHANGES.items():
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy(), max_steps=6, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             limit_val_batches=0, use_distributed_sampler=False)
        with pytest.raises(ResumeError, match=expect) as refused:
            trainer.fit(_model(**args), datamodule=rm._Tokens(rm.GLOBAL_BATCH // 2), ckpt_path=str(path))
        lines.append(f"{fmt} x {change}: {str(refused.value)[:260]}")
    print("\n" + "\n".join(lines))
    assert not started
    # evaluating a checkpoint reads its weights: another shape is refused before launch (it failed in the ranks,
    # under a DCP folder with torch's "Size mismatch" only in their output); another optimizer is no matter
    loader = DataLoader(rm._Tokens(2).dataset, batch_size=2)
    for fn in ("validate", "test", "predict"):
        for args, refused_as in (({"n_embd": 16}, r"n_embd: configured 16, saved 32"), ({"optimizer": "sgd"}, None)):
            trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy(), logger=False,
                                 enable_progress_bar=False, enable_model_summary=False)
            with pytest.raises(ResumeError if refused_as else _Launched, match=refused_as):
                getattr(trainer, fn)(_model(**args), dataloaders=loader, ckpt_path=str(path))
    # the unchanged model is not refused: it gets as far as starting the ranks (trapped here)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy(), max_steps=6, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=0, use_distributed_sampler=False)
    with pytest.raises(_Launched):
        trainer.fit(_model(), datamodule=rm._Tokens(rm.GLOBAL_BATCH // 2), ckpt_path=str(path))
    # --resume_weights_only: the weights (joined from any format) go into the SGD model; another shape is refused
    sgd = _model(optimizer="sgd")
    load_weights_only(sgd, str(path))
    full = full_state_dict(path, trusted=True)
    assert all(torch.equal(v, full[k]) for k, v in sgd.state_dict().items())
    with pytest.raises(ResumeError, match=r"n_embd: configured 16, saved 32"):
        load_weights_only(_model(n_embd=16), str(path))


def test_a_weights_only_checkpoint_is_refused_before_launch_with_the_way_to_start_from_it(
        saved: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelCheckpoint(save_weights_only=True) keeps no optimizer or scheduler state (Lightning keeps the loops). A
    file of that kind went through the check unread (each rank then raised Lightning's KeyError after the launch); a
    folder was refused as "holds 0 optimizer state(s)", with a CLI-only fix. Refused before launch as weights-only,
    naming load_from_checkpoint -- also a file `lightning-parallel consolidate` wrote without --resumable."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_parallel.cli import main as cli

    file_run = tmp_path / "file"
    pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
               enable_model_summary=False, limit_val_batches=0,
               callbacks=[ModelCheckpoint(dirpath=file_run, save_weights_only=True, every_n_train_steps=2)]
               ).fit(_model(), datamodule=rm._Tokens(rm.GLOBAL_BATCH))
    weights = next(file_run.glob("*.ckpt"))
    consolidated = tmp_path / "consolidated.ckpt"
    assert cli(["consolidate", str(saved["DCP folder"]), str(consolidated)]) == 0
    folder_run = tmp_path / "folder"
    pl.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_progress_bar=False,
               enable_model_summary=False, limit_val_batches=0, use_distributed_sampler=False,
               strategy=LPPipelineStrategy({"pipeline_parallel_size": 2, "num_micro_batches": 2}, start_method="fork"),
               callbacks=[ModelCheckpoint(dirpath=folder_run, save_weights_only=True, every_n_train_steps=2)]
               ).fit(_model(), datamodule=rm._Tokens(rm.GLOBAL_BATCH // 2))
    folder = next(folder_run.glob("*.ckpt"))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda *a, **k: (_ for _ in ()).throw(_Launched("a rank would have been started")))
    for path, strategy in ((weights, LPDDPStrategy(start_method="fork")),
                           (consolidated, LPDDPStrategy(start_method="fork")),
                           (folder, LPPipelineStrategy({"pipeline_parallel_size": 2, "num_micro_batches": 2},
                                                       start_method="fork"))):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             limit_val_batches=0, use_distributed_sampler=False)
        with pytest.raises(ResumeError, match=r"holds no optimizer or LR scheduler state \(a weights-only .*"
                                              r"load_from_checkpoint\(path\)"):
            trainer.fit(_model(), datamodule=rm._Tokens(rm.GLOBAL_BATCH // 2), ckpt_path=str(path))


def test_a_hook_editing_the_weights_of_a_checkpoint_folder_is_told_they_are_read_later(
        saved: dict[str, Path]) -> None:
    """A DCP folder's weights go from the files into each rank's shards after on_load_checkpoint, whose
    checkpoint["state_dict"] is empty: a hook's key migration was ignored without a word (one device and a file
    apply it). Writing into it is refused when the weights load; reading an entry raises a KeyError that says why."""
    class Migrating(OptimizerChoiceGPT):
        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["state_dict"]["embed.pos.weight"] = torch.zeros(rm.T, 32)

    class Reading(OptimizerChoiceGPT):
        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["state_dict"]["embed.pos.weight"].mul_(2)

    class Replacing(OptimizerChoiceGPT):
        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["state_dict"] = {"embed.pos.weight": torch.zeros(rm.T, 32)}

    for kind, expect in ((Migrating, r"on_load_checkpoint wrote 1 entry \('embed.pos.weight'\) .* would be ignored"),
                         (Replacing, r"on_load_checkpoint wrote 1 entry .* would be ignored"),
                         (Reading, r"holds no tensors -- each rank reads its shards from the folder")):
        torch.manual_seed(0)
        model = kind(n_layer=2, n_head=2, n_embd=32, block_size=rm.T, vocab_size=rm.VOCAB, warmup_steps=2, bias=False)
        trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=6, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                             use_distributed_sampler=False,
                             strategy=LPPipelineStrategy({"pipeline_parallel_size": 2, "num_micro_batches": 2},
                                                         start_method="fork"))
        with pytest.raises(Exception, match=expect):
            trainer.fit(model, datamodule=rm._Tokens(rm.GLOBAL_BATCH // 2), ckpt_path=str(saved["DCP folder"]))


class _BuiltInConfigureModel(OptimizerChoiceGPT):
    """The GPT with its head made in ``configure_model()`` (which runs in the ranks)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head = None

    def configure_model(self) -> None:
        if self.head is None:
            self.head = self._new_layer("head")


class _NotStrict(OptimizerChoiceGPT):
    """The GPT with a layer the checkpoint does not hold, loading what matches (``strict_loading = False``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = torch.nn.Linear(4, 4)
        self.strict_loading = False


def test_what_the_checks_before_launch_leave_to_the_ranks(saved: dict[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Not refused before launch (each reaches the ranks, trapped here), as one device runs them: a module that builds
    layers in configure_model() (its tensors before launch are only some of them: refused as "does not hold the
    configured model's tensors", for fit and, once evaluation checked its ckpt_path, for validate), a module with
    strict_loading = False, and a model registry's name (it failed on the missing file "registry:...")."""
    started = _trap_launches(monkeypatch)
    path = str(saved["file"])
    loader = DataLoader(rm._Tokens(2).dataset, batch_size=2)
    args: dict[str, Any] = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": rm.T, "vocab_size": rm.VOCAB,
                            "warmup_steps": 2, "bias": False}
    for module, call in ((_BuiltInConfigureModel(**args), "fit"), (_BuiltInConfigureModel(**args), "validate"),
                         (_NotStrict(**args), "validate"), (_model(), "validate:registry:my-gpt")):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LPDDPStrategy(start_method="fork"), max_steps=6,
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, limit_val_batches=0, use_distributed_sampler=False)
        fn, _, ckpt = call.partition(":")
        with pytest.raises(_Launched):
            if fn == "fit":
                trainer.fit(module, datamodule=rm._Tokens(rm.GLOBAL_BATCH // 2), ckpt_path=path)
            else:
                trainer.validate(module, dataloaders=loader, ckpt_path=ckpt or path)
    assert len(started) == 4
