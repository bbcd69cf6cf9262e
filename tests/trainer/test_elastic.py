"""Elastic training in one process tree (ranks forked from the test): the global batch kept on another data-parallel
size, the refusal of a world that cannot keep it, and checkpoints written in the background.

* A run saved under ``lp_sharded`` ZeRO-1 on 2 ranks (accumulation 2) resumes on 1 rank (accumulation 4): the same
  global batch of 8, so its loss per step and final weights equal the uninterrupted 2-rank run's (the in-process
  form of the node loss that ``test_elastic_launch.py`` runs under torchrun).
* ``parallel.global_batch_size`` that the world cannot keep is refused before any rank starts.
* A background save (:mod:`lightning_parallel.checkpoint.async_save`) equals a synchronous one taken at the same step
  -- one file, an ``lp_sharded`` folder, a DCP folder -- although training changed the weights while it was written
  (the writer is slowed down), is complete, verified against its checksums, and never leaves ``.partial``; at most one
  is in flight; a failure in one rank's writer is raised on every rank when training ends, removes ``<name>.partial``
  and leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_parallel.callbacks import PeriodicCheckpoint
from lightning_parallel.checkpoint import async_save
from lightning_parallel.checkpoint.resume import read_resumable
from lightning_parallel.checkpoint.verify import verify_folder, verify_torch_file
from lightning_parallel.config import LayoutError
from lightning_parallel.strategies import LPDDPStrategy, LPPipelineStrategy, LPShardedStrategy, LPTensorStrategy
from lightning_parallel.testing import resume_matrix as rm
from lightning_parallel.testing.elastic import StepLoss, read_steps

G = 8  # global batch; the data module's batch_size is 2 per rank


class _StopAfter(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _fit(strategy: Any, devices: int, losses: Path, *, steps: int = 6, callbacks: tuple[Callback, ...] = (),
         ckpt_path: str | None = None, batch_size: int = 2) -> pl.LightningModule:
    model = rm._gpt()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, gradient_clip_val=0.5, use_distributed_sampler=False,
                         enable_checkpointing=False, callbacks=[StepLoss(losses), *callbacks])
    trainer.fit(model, datamodule=rm._Tokens(batch_size), ckpt_path=ckpt_path)
    return model


def test_shrink_to_one_rank_with_accumulation_stays_on_the_trajectory(tmp_path: Path) -> None:
    rm.quiet()
    fork = {"start_method": "fork"}
    whole = _fit(LPShardedStrategy({"global_batch_size": G, "zero_stage": 1}, **fork), 2, tmp_path / "whole.jsonl")
    saver = PeriodicCheckpoint(tmp_path / "ckpt", every_n_steps=3, save_on_train_end=False)
    _fit(LPShardedStrategy({"global_batch_size": G, "zero_stage": 1}, checkpoint="sharded", **fork), 2,
         tmp_path / "lost.jsonl", callbacks=(saver, _StopAfter(4)))  # "killed" after step 4: step 3 is the newest
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=3.ckpt"]
    resumed = _fit(LPDDPStrategy({"global_batch_size": G}, **fork), 1, tmp_path / "resumed.jsonl",
                   ckpt_path=str(tmp_path / "ckpt" / "step=3.ckpt"))
    a, b = read_steps(tmp_path / "whole.jsonl"), read_steps(tmp_path / "resumed.jsonl")
    assert sorted(b) == [4, 5, 6]
    assert [a[s]["accumulate"] for s in b] == [2, 2, 2] and [b[s]["accumulate"] for s in b] == [4, 4, 4]
    loss = max(abs(a[s]["loss"] - b[s]["loss"]) for s in b)
    weights = max(float((v - whole.state_dict()[k]).abs().max()) for k, v in resumed.state_dict().items())
    print(f"\nlp_sharded ZeRO-1 x2 (accumulation 2) saved at step 3 -> lp_ddp x1 (accumulation 4), global batch {G}: "
          f"loss steps 4-6 {[round(b[s]['loss'], 6) for s in b]} vs uninterrupted "
          f"{[round(a[s]['loss'], 6) for s in b]}: max |difference| {loss:.1e}; final weights {weights:.1e}")
    assert loss < 1e-5 and weights < 1e-5


def test_a_world_that_cannot_keep_the_global_batch_is_refused_before_any_rank_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    started: list[int] = []
    monkeypatch.setattr(_MultiProcessingLauncher, "launch", lambda *a, **k: started.append(1))
    strategy = LPDDPStrategy({"global_batch_size": G}, start_method="fork")
    with pytest.raises(LayoutError) as err:
        _fit(strategy, 3, tmp_path / "x.jsonl")
    text = str(err.value)
    print(f"\ndevices=3, batch_size 2, global_batch_size {G}: {text}")
    assert "parallel.global_batch_size=8 cannot be kept on this world" in text
    assert "8 / (2 x 3)" in text and "dp in [1, 2, 4]" in text
    assert started == []  # refused in the launching process: no rank was started


# ---------------------------------------------------------------------------------------------- background saves
class _Probe(Callback):
    """At ``step``: a synchronous save to ``sync/step=N.ckpt``, then a background one of the same state to
    ``async/step=N.ckpt``; training goes on while the (slowed) writer works. When training ends each rank writes how
    many background parts its process ever ran at once."""

    def __init__(self, root: Path, step: int, seen: dict[str, int]) -> None:
        self.root, self.step, self.seen = root, step, seen
        self.sync_saver = PeriodicCheckpoint(root / "sync", every_n_steps=10**6, save_on_train_end=False,
                                             async_save=False)
        self.async_saver = PeriodicCheckpoint(root / "async", every_n_steps=10**6, save_on_train_end=False)
        self.written_late = False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.sync_saver.save(trainer, self.step)
            target = self.async_saver.save(trainer, self.step)
            self.written_late = not target.exists()  # the step went on before the file was there

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.async_saver.writer.wait()
        (self.root / f"rank{trainer.global_rank}.json").write_text(json.dumps(
            {"max_in_flight": self.seen["max"], "written_late": self.written_late}))


def _slow_writer(monkeypatch: pytest.MonkeyPatch, delay: float, *, fail: str | None = None,
                 fail_rank: int = 0) -> dict[str, int]:
    """Every background part starts ``delay`` s late (training meanwhile changes the weights in place) and counts
    how many run at once in its process (the ranks are forked after the patch: each counts its own). ``fail``: in
    the part for a target ending so, every ``torch.save`` on ``fail_rank`` raises ENOSPC."""
    seen = {"now": 0, "max": 0}
    lock = threading.Lock()
    original = async_save.AsyncWriter.submit
    failing: set[int] = set()  # the writer threads whose writes fail: every torch.save in them raises a full disk
    if fail is not None:
        real_save = torch.save

        def save(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() in failing:
                raise OSError(28, "No space left on device (injected)")
            return real_save(*args, **kwargs)

        monkeypatch.setattr(torch, "save", save)

    def submit(self: async_save.AsyncWriter, target: str, job: Any) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0

        def slow() -> None:
            with lock:
                seen["now"] += 1
                seen["max"] = max(seen["max"], seen["now"])
            try:
                time.sleep(delay)
                if fail is not None and target.endswith(fail) and rank == fail_rank:
                    failing.add(threading.get_ident())  # the job's own writes fail, inside the format's handling
                job()
            finally:
                with lock:
                    seen["now"] -= 1
        original(self, target, slow)

    monkeypatch.setattr(async_save.AsyncWriter, "submit", submit)
    return seen


FORMATS = {
    "one file (lp_ddp x2)": (lambda: LPDDPStrategy(start_method="fork"), 2),
    "lp_sharded folder (ZeRO-1 x2)": (lambda: LPShardedStrategy({"zero_stage": 1}, checkpoint="sharded",
                                                                 start_method="fork"), 2),
    "lp_sharded folder (ZeRO-3 x2)": (lambda: LPShardedStrategy({"zero_stage": 3}, checkpoint="sharded",
                                                                 start_method="fork"), 2),
    "DCP folder (lp_pipeline pp2)": (lambda: LPPipelineStrategy({"pipeline_parallel_size": 2, "num_micro_batches": 2},
                                                                start_method="fork"), 2),
    "DCP folder (lp_tensor tp2, DTensor shards)": (lambda: LPTensorStrategy({"tensor_parallel_size": 2},
                                                                            start_method="fork"), 2),
}


def _tensors(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"state_dict.{k}": v for k, v in checkpoint["state_dict"].items()}
    for i, opt in enumerate(checkpoint.get("optimizer_states") or []):
        for idx, slot in opt["state"].items():
            for key, value in slot.items():
                if isinstance(value, torch.Tensor):
                    out[f"optimizer_states[{i}].{idx}.{key}"] = value
    return out


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_background_save_equals_a_synchronous_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    name: str) -> None:
    rm.quiet()
    seen = _slow_writer(monkeypatch, 0.3)  # longer than a step: the next step runs while the file is written
    make, devices = FORMATS[name]
    every = PeriodicCheckpoint(tmp_path / "every", every_n_steps=1, keep=2, save_on_train_end=False)
    batch = G if "DCP" in name else G // 2  # per data-parallel rank: pp and tp ranks share one batch
    _fit(make(), devices, tmp_path / "losses.jsonl", steps=5, batch_size=batch,
         callbacks=(every, _Probe(tmp_path, 2, seen)))
    a, b = tmp_path / "async" / "step=2.ckpt", tmp_path / "sync" / "step=2.ckpt"
    for path in (a, b):
        if path.is_dir():
            verify_folder(path)  # DCP: against checksums.json; lp_sharded: each .pt against its records' CRCs
        else:
            verify_torch_file(path)
    left = sorted(p.name for folder in ("async", "every") for p in (tmp_path / folder).iterdir()
                  if p.name.endswith((".partial", ".old")))
    got, want = read_resumable(a), read_resumable(b)
    ta, tb = _tensors(got), _tensors(want)
    assert ta.keys() == tb.keys() and len(ta) > 10
    diff = max(float((ta[k].float() - tb[k].float()).abs().max()) for k in ta)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(devices)]
    kept = sorted(p.name for p in (tmp_path / "every").iterdir())
    print(f"\n{name}: background save of step 2 vs synchronous: {len(ta)} tensors, max |difference| {diff:.1e}; "
          f"file(s) appeared after the step went on: {[r['written_late'] for r in ranks]}; most background saves in "
          f"flight at once per rank: {[r['max_in_flight'] for r in ranks]}; every-step saver kept {kept}; left over: "
          f"{left}")
    assert diff == 0.0
    assert (got["global_step"], got["epoch"], got["loops"]) == (want["global_step"], want["epoch"], want["loops"])
    assert all(r["written_late"] for r in ranks)  # it really was written while training went on
    assert max(r["max_in_flight"] for r in ranks) == 1  # one file: rank 0 alone writes
    assert kept == ["step=4.ckpt", "step=5.ckpt"] and left == []


@pytest.mark.parametrize("name", ["one file (lp_ddp x2)", "lp_sharded folder (ZeRO-1 x2)"])
def test_a_failed_background_save_is_raised_and_leaves_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    rm.quiet()
    _slow_writer(monkeypatch, 0.2, fail="step=4.ckpt", fail_rank=0 if name.startswith("one file") else 1)
    make, devices = FORMATS[name]
    saver = PeriodicCheckpoint(tmp_path / "ckpt", every_n_steps=2, save_on_train_end=False)
    with pytest.raises(Exception) as err:
        _fit(make(), devices, tmp_path / "losses.jsonl", steps=4, batch_size=G // 2, callbacks=(saver,))
    text = str(err.value)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    raised = [line for line in text.splitlines() if line.startswith(async_save.BackgroundSaveError.__module__)]
    print(f"\n{name}: writer failed on step 4 -> {raised[-1:] or type(err.value).__name__}; folder: {files}")
    assert "the background save of" in text and "step=4.ckpt failed" in text
    assert "step=2.ckpt" in files and "step=4.ckpt" not in files and not any(f.endswith(".partial") for f in files)
    previous = tmp_path / "ckpt" / "step=2.ckpt"
    verify_folder(previous) if previous.is_dir() else verify_torch_file(previous)
    assert read_resumable(previous)["global_step"] == 2
