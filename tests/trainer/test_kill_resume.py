"""Exact resume after ``kill -9`` mid-epoch, through ``lightning-parallel fit`` (lp_ddp, 2 CPU ranks, popen).

Three runs of the same recipe (20 steps, a checkpoint every 5 steps, ``last.ckpt`` too; an epoch of the embedded
corpus is hundreds of steps, so every checkpoint is mid-epoch):

1. uninterrupted;
2. every rank SIGKILLs itself at step 13 (no clean-up, no save: as ``kill -9``); its ``last.ckpt`` is step 10's;
3. ``--ckpt_path <run 2>/last.ckpt`` to step 20.

The resumed run's loss at steps 11-20 and its final weights must equal the uninterrupted run's: the data position
(epoch and batches done, :class:`~lightning_parallel.data.ResumableDataModuleMixin`), the optimizer, LR scheduler and
loop counters all come back.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

pytestmark = pytest.mark.slow  # kill -9 of a real CLI run and its resume: ~40 s

ROOT = Path(__file__).resolve().parents[2]
KILL_AT, EVERY, STEPS = 13, 5, 20

RECIPE = """\
seed_everything: 1234
model:
  class_path: lightning_parallel.models.GPT
  init_args: {{n_layer: 2, n_head: 2, n_embd: 32, block_size: 16, vocab_size: 256, lr: 3.0e-3, warmup_steps: 4}}
trainer:
  accelerator: cpu
  devices: 2
  strategy: lp_ddp
  max_steps: {steps}
  limit_val_batches: 0
  num_sanity_val_steps: 0
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {folder}/ckpt, every_n_train_steps: {every}, save_last: true, save_top_k: -1}}
    - class_path: tests.trainer.test_kill_resume.LossLog
      init_args: {{path: {folder}/losses.jsonl, kill_at: {kill_at}}}
data:
  class_path: lightning_parallel.data.TextDataModule
  init_args: {{block_size: 16, batch_size: 4}}
"""


class LossLog(Callback):
    """Rank 0 appends each step's global-batch loss (``train_loss`` averaged over the ranks); with ``kill_at``,
    every rank SIGKILLs itself after that step."""

    def __init__(self, path: str, kill_at: int = 0) -> None:
        self.path, self.kill_at = Path(path), kill_at

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = trainer.strategy.reduce(trainer.callback_metrics["train_loss"].detach().reshape(1), reduce_op="mean")
        if trainer.global_rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": float(loss)}) + "\n")
        if self.kill_at and trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # the command ends a distributed run with os._exit after the atexit handlers: a user's handler still runs
        marker = self.path.parent / f"atexit-rank{trainer.global_rank}"
        atexit.register(marker.write_text, "ran")


def _run(folder: Path, *, kill_at: int = 0, ckpt_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    folder.mkdir(parents=True, exist_ok=True)
    recipe = folder / "recipe.yaml"
    recipe.write_text(RECIPE.format(folder=folder, steps=STEPS, every=EVERY, kill_at=kill_at))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "lightning_parallel", "fit", "--config", str(recipe)]
    if ckpt_path is not None:
        cmd += ["--ckpt_path", str(ckpt_path)]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def _losses(folder: Path) -> dict[int, float]:
    rows = map(json.loads, (folder / "losses.jsonl").read_text().splitlines())
    return {int(r["step"]): float(r["loss"]) for r in rows}


def test_kill_9_mid_epoch_then_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    full = _run(tmp_path / "uninterrupted")
    assert full.returncode == 0, full.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "uninterrupted").glob("atexit-rank*")) == ["atexit-rank0", "atexit-rank1"]
    killed = _run(tmp_path / "killed", kill_at=KILL_AT)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
    last = tmp_path / "killed" / "ckpt" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 10, saved["global_step"]
    resumed_folder = tmp_path / "killed"  # the resumed run appends to the killed run's loss log
    resumed = _run(resumed_folder, ckpt_path=last)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a, b = _losses(tmp_path / "uninterrupted"), _losses(resumed_folder)
    lines = [f"step {s:2d}: uninterrupted {a[s]:.6f} | killed at {KILL_AT}, resumed from step 10: {b[s]:.6f}"
             + ("" if s > 10 else "  (before the checkpoint)") for s in range(1, STEPS + 1)]
    w_full = torch.load(tmp_path / "uninterrupted" / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    w_res = torch.load(last, weights_only=True)["state_dict"]
    diff = max(float((v - w_res[k]).abs().max()) for k, v in w_full.items())
    print("\n" + "\n".join(lines) + f"\nfinal weights (step {STEPS}): max |w_resumed - w_uninterrupted| = {diff:.1e}")
    assert max(abs(a[s] - b[s]) for s in range(11, STEPS + 1)) < 1e-5
    assert diff < 1e-5
