"""A loss that becomes NaN stops every rank on that step, under every strategy family, and never reaches last.ckpt.

The GPT of the resume matrix returns NaN from its third step (``global_step >= 2``); ``ModelCheckpoint`` saves
``last.ckpt`` after every step. The fit must fail with the guard's message (the step, the last finite loss, the
newest checkpoint), and ``last.ckpt`` must still be the checkpoint of step 2 with every tensor finite. With
``NonFiniteLossGuard(action="skip")`` the NaN step's update is skipped instead and the run ends with finite weights.
Forked CPU ranks; one short fit per case.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.callbacks import NonFiniteLossGuard
from lightning_parallel.checkpoint import detect_format
from lightning_parallel.checkpoint.resume import TRUST_ENV, read_resumable
from lightning_parallel.models import GPT
from lightning_parallel.testing import resume_matrix as rm

NAN_FROM = 2  # global_step at which the loss becomes NaN: the third step


class NaNFrom(GPT):
    """The matrix GPT whose loss is NaN from ``global_step >= NAN_FROM`` (every rank, every micro-batch)."""

    def pipeline_loss(self, output: Any, target: Any) -> Any:
        loss = super().pipeline_loss(output, target)
        trainer = self._trainer
        if trainer is not None and trainer.training and trainer.global_step >= NAN_FROM:
            loss = loss * float("nan")
        return loss


def _model() -> NaNFrom:
    torch.manual_seed(0)
    return NaNFrom(n_layer=2, n_head=2, n_embd=32, block_size=rm.T, vocab_size=rm.VOCAB, warmup_steps=2, bias=False)


FAMILIES = {
    "lp_ddp x2": "lp_ddp x2",
    "lp_sharded z1 x2": "lp_sharded z1 x2",
    "lp_tensor tp2": "lp_tensor tp2",
    "lp_pipeline pp2": "lp_pipeline pp2",
    "lp_dp x2": "lp_dp x2",
    "lp_zero_offload x2": "lp_zero_offload x2",
}


def _fit(layout: rm.Layout, folder: Path, *, guard: NonFiniteLossGuard | None = None, steps: int = 5) -> pl.Trainer:
    checkpoint = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_last=True, save_top_k=0)
    callbacks: list[Any] = [checkpoint] if guard is None else [guard, checkpoint]
    trainer = pl.Trainer(accelerator="cpu", devices=layout.devices, strategy=layout.make(), max_steps=steps,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, use_distributed_sampler=False, callbacks=callbacks)
    trainer.fit(_model(), datamodule=rm._Tokens(rm.GLOBAL_BATCH // layout.dp))
    return trainer


def _all_finite(checkpoint: dict[str, Any]) -> bool:
    tensors = [v for v in checkpoint["state_dict"].values() if isinstance(v, torch.Tensor)]
    for state in checkpoint.get("optimizer_states") or []:
        tensors += [v for slot in state["state"].values() for v in slot.values() if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(bool(torch.isfinite(t.float()).all()) for t in tensors)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_nan_loss_stops_every_rank_on_its_step_and_keeps_last_ckpt_finite(tmp_path: Path, family: str) -> None:
    if family not in rm.LAYOUTS:
        pytest.skip("DeepSpeed or its CPU ops are not available here")
    rm.quiet()
    os.environ[TRUST_ENV] = "1"  # the DeepSpeed folder's optimizer files hold DeepSpeed objects (written here)
    layout = rm.LAYOUTS[FAMILIES[family]]
    with pytest.raises(BaseException) as raised:
        _fit(layout, tmp_path / "ckpt")
    text = str(raised.value)
    last = tmp_path / "ckpt" / "last.ckpt"
    print(f"\n{family}: {type(raised.value).__name__}: {text.strip().splitlines()[-1][:400]}")
    assert "NonFiniteLossError" in text or "training loss became" in text, text[-2000:]
    assert f"in step {NAN_FROM + 1}" in text and f"at step {NAN_FROM}" in text, text[-2000:]
    assert "last.ckpt" in text, text[-2000:]  # the newest good checkpoint is named
    counted = {"lp_pipeline pp2": 1, "lp_dp x2": 1}.get(family, 2)  # the ranks that hold a loss of their own
    if counted > 1:  # every one of them had a NaN loss: counted by the all-reduce of the failing step
        assert f"on {counted} of {counted} ranks" in text, text[-2000:]
    else:
        assert " ranks;" not in text, text[-2000:]
    saved = read_resumable(last, trusted=True)
    print(f"{family}: last.ckpt is a {detect_format(last, trusted=True).describe()} of global_step "
          f"{saved['global_step']}, every tensor finite: {_all_finite(saved)}")
    assert saved["global_step"] == NAN_FROM and _all_finite(saved)
    assert not list((tmp_path / "ckpt").glob("*.partial"))


@pytest.mark.parametrize("family", ["lp_ddp x2", "lp_pipeline pp2", "lp_dp x2"])
def test_skip_mode_skips_the_nan_steps_and_trains_on(tmp_path: Path, family: str) -> None:
    rm.quiet()
    _fit(rm.LAYOUTS[family], tmp_path / "ckpt", guard=NonFiniteLossGuard(action="skip"))
    saved = read_resumable(tmp_path / "ckpt" / "last.ckpt")
    assert saved["global_step"] == 5  # the skipped steps count (the LR schedule advances)
    assert _all_finite(saved)
    # every step from the first NaN one was skipped: the weights are those of a run stopped before it
    _fit(rm.LAYOUTS[family], tmp_path / "two", steps=NAN_FROM)
    before = read_resumable(tmp_path / "two" / "last.ckpt")
    diff = max(float((v.float() - before["state_dict"][k].float()).abs().max()) for k, v in saved["state_dict"].items())
    print(f"\n{family}: skip mode ran {saved['global_step']} steps; weights after the 3 skipped steps vs after step "
          f"{before['global_step']}: max |diff| {diff:.1e}")
    assert diff == 0.0


def test_the_guard_goes_first_but_behind_a_tuners_callback() -> None:
    """Every library strategy installs a guard when training starts. It must run before every callback that may
    save the step (ModelCheckpoint, the library's PeriodicCheckpoint saving from on_train_batch_end), so it goes
    first; but Lightning's learning-rate finder runs its fit with ``[its callback]`` and reads it back as
    ``trainer.callbacks[0]`` (the guard in front made ``Tuner.lr_find`` fail under every strategy:
    'NonFiniteLossGuard' object has no attribute 'lrs'), so it goes behind a tuner's callback."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.tuner.lr_finder import _LRCallback

    from lightning_parallel.callbacks import PeriodicCheckpoint
    from lightning_parallel.callbacks.nonfinite import install

    saver = PeriodicCheckpoint(every_n_steps=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, callbacks=[saver], logger=False, enable_progress_bar=False)
    guard = install(trainer)
    assert trainer.callbacks[0] is guard and isinstance(guard, NonFiniteLossGuard)
    assert trainer.callbacks.index(guard) < trainer.callbacks.index(saver)
    finder = _LRCallback(num_training=2, early_stop_threshold=None)
    trainer.callbacks = [finder, Callback()]  # what lr_find does for its run
    install(trainer)
    assert trainer.callbacks[0] is finder and isinstance(trainer.callbacks[1], NonFiniteLossGuard)
