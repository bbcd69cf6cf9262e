"""A save killed midway (``kill -9`` of the saving process while it writes) never replaces the previous checkpoint.

For each checkpoint kind -- a Lightning file (one device), an ``lp_sharded`` folder, an ``lp_pipeline`` DCP folder
and an ``lp_zero_offload`` DeepSpeed folder -- a run saves ``last.ckpt`` at every step; at step 2 the process that
writes kills itself with SIGKILL in the middle of writing (after part of the new checkpoint is on disk). Afterwards
``last.ckpt`` is still step 1's checkpoint, whole: its format is detected, it reads into the one-device form, and a
run resumes from it. A half-written folder is left under ``last.ckpt.partial`` (removed by the next save); Lightning
writes one-file checkpoints into a temporary file first (fsspec), which the killed process leaves outside the folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_parallel.checkpoint import detect_format
from lightning_parallel.checkpoint.resume import read_resumable

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """\
import io, os, signal, sys
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_parallel.testing import resume_matrix as rm

KIND, FOLDER = sys.argv[1], sys.argv[2]
ARMED = {"on": False}


class ArmAtStep2(Callback):  # runs before ModelCheckpoint (Lightning puts checkpoint callbacks last)
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == 1 and trainer.global_rank == 0:  # step 1's complete checkpoint, for comparison
            import shutil
            src, dst = os.path.join(FOLDER, "last.ckpt"), os.path.join(FOLDER, "step1_copy")
            (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, dst)

    def on_train_batch_end(self, trainer, *args):
        ARMED["on"] = trainer.global_step == 2


def kill_midway(write):
    def wrapper(*args, **kwargs):
        target = args[1] if len(args) > 1 else kwargs.get("f")
        in_memory = isinstance(target, io.BytesIO)  # torch.save into memory, e.g. inside all_gather_object
        if ARMED["on"] and not in_memory:
            out = write(*args, **kwargs)  # some of the new checkpoint is on disk ...
            os.kill(os.getpid(), signal.SIGKILL)  # ... and the writer dies
        return write(*args, **kwargs)
    return wrapper


if KIND == "lightning":
    import fsspec.implementations.local as local
    local.LocalFileOpener.write = kill_midway(local.LocalFileOpener.write)
    layout = rm.LAYOUTS["1 device"]
elif KIND == "lp_sharded":
    import lightning_parallel.checkpoint.formats.sharded as sharded
    sharded.torch.save = kill_midway(torch.save)
    layout = rm.LAYOUTS["lp_sharded z1 x2"]
elif KIND == "lp_pipeline":
    import torch.distributed.checkpoint as dcp
    dcp.save = kill_midway(dcp.save)
    layout = rm.LAYOUTS["lp_pipeline pp2"]
else:
    from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy
    torch.save = kill_midway(torch.save)
    layout = rm.Layout("zo", lambda: LPZeroOffloadStrategy({"zero_stage": 2, "offload": "cpu"},
                                                           start_method="fork"), 2, 2)

os.makedirs(FOLDER, exist_ok=True)
checkpoint = ModelCheckpoint(dirpath=FOLDER, every_n_train_steps=1, save_last=True, save_top_k=0)
rm._fit(layout, losses=rm.Path(FOLDER) / "losses.jsonl", callbacks=[ArmAtStep2(), checkpoint])
print("the save was not interrupted", flush=True)
"""


@pytest.mark.parametrize("kind", ["lightning", "lp_sharded", "lp_pipeline", "deepspeed"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path: Path, kind: str) -> None:
    if kind == "deepspeed":
        pytest.importorskip("deepspeed")
        from lightning_parallel.parallel.offload import missing_ops, required_ops

        if missing_ops(required_ops(accelerator="cpu", offload_optimizer="cpu", offload_param="none")):
            pytest.skip("DeepSpeed's CPU ops are not built (scripts/test.sh builds them in its set-up)")
    script = tmp_path / "save.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
           "DS_ACCELERATOR": "cpu"}
    run = subprocess.run([sys.executable, str(script), kind, str(tmp_path / "ckpt")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert "the save was not interrupted" not in run.stdout
    assert run.returncode != 0, run.stdout[-2000:] + run.stderr[-3000:]
    last = tmp_path / "ckpt" / "last.ckpt"
    leftovers = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("last"))
    info = detect_format(last, trusted=kind == "deepspeed")
    step = _step(last, kind)
    print(f"\n{kind}: writer killed (exit {run.returncode}) while saving step 2 -> last.ckpt is a {info.describe()} "
          f"of step {step}; next to it: {leftovers}")
    assert step == 1
    if kind != "lightning":
        assert "last.ckpt.partial" in leftovers, leftovers
    if kind != "deepspeed":  # every tensor (weights and optimizer state) is step 1's
        full, before = read_resumable(last), read_resumable(tmp_path / "ckpt" / "step1_copy")
        assert full["global_step"] == 1 and full["optimizer_states"], full.keys()
        assert all(torch.equal(v, before["state_dict"][k]) for k, v in full["state_dict"].items())
        for got, want in zip(full["optimizer_states"], before["optimizer_states"], strict=True):
            for idx, slot in got["state"].items():
                assert all(torch.equal(v, want["state"][idx][key]) for key, v in slot.items())
    else:
        from lightning_parallel.checkpoint import full_state_dict

        after, before = full_state_dict(last, trusted=True), full_state_dict(tmp_path / "ckpt" / "step1_copy",
                                                                               trusted=True)
        assert all(torch.equal(v, before[k]) for k, v in after.items())


def _step(last: Path, kind: str) -> int:
    if kind == "lightning":
        return int(torch.load(last, weights_only=True)["global_step"])
    if kind == "deepspeed":
        from lightning_parallel.checkpoint import full_checkpoint

        return int(full_checkpoint(last, trusted=True)["global_step"])
    return int(read_resumable(last)["global_step"])
