"""SIGTERM to the launching process while a checkpoint is being saved: the save finishes, then every rank stops at
the next step boundary with a preemption checkpoint.

A run (2 ranks started by Lightning's ``popen`` launcher, as the command line starts them: rank 0 is the process the
signal goes to) saves ``last.ckpt`` after every step with ``PreemptionCheckpoint``. In the middle of step 2's save --
a DCP folder (``lp_pipeline``) or a one-file checkpoint (``lp_ddp``) -- rank 0 sends itself SIGTERM. Lightning's own
handler would run a broadcast inside the signal handler, out of step with the save's collectives (gloo: "Received
data size doesn't match expected size", a rank aborting, no preemption checkpoint). Expected now: the run ends through
the preemption (``SIGTERMException``, which Lightning makes a ``SystemExit``) at the step boundary after the save (the
ranks agree on the stop at the end of step 3, and stop before step 4), no collective error, ``last.ckpt`` complete and
of step 3 (``PreemptionCheckpoint`` has it already: it saves again only for a step not yet saved), no ``.partial``.
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
from lightning.pytorch.callbacks import Callback
from lightning_parallel.callbacks import PreemptionCheckpoint
from lightning_parallel.strategies import LPDDPStrategy, LPPipelineStrategy
from lightning_parallel.testing import resume_matrix as rm

KIND, FOLDER = sys.argv[1], sys.argv[2]
ARMED = {"on": False}


class ArmAtStep2(Callback):  # runs before the checkpoint callback (Lightning puts those last)
    def on_train_batch_end(self, trainer, *args):
        ARMED["on"] = trainer.global_step == 2 and trainer.global_rank == 0


def term_midway(write):
    def wrapper(*args, **kwargs):
        if ARMED["on"]:  # the save has begun (its folder made, the RNG states gathered); the other rank is writing
            ARMED["on"] = False
            print("SIGTERM sent during the save", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher is told to stop; the save goes on
        return write(*args, **kwargs)
    return wrapper


if KIND == "dcp":
    import torch.distributed.checkpoint as dcp
    dcp.save = term_midway(dcp.save)
    pp = {"pipeline_parallel_size": 2, "num_micro_batches": 2, "pipeline_schedule": "1f1b"}
    layout = rm.Layout("pp", lambda: LPPipelineStrategy(pp, start_method="popen"), 2, 1)
else:
    import fsspec.implementations.local as local
    local.LocalFileOpener.write = term_midway(local.LocalFileOpener.write)
    layout = rm.Layout("ddp", lambda: LPDDPStrategy(start_method="popen"), 2, 2)

checkpoint = PreemptionCheckpoint(dirpath=FOLDER, every_n_train_steps=1, save_last=True, save_top_k=0)
rm._fit(layout, losses=rm.Path(FOLDER) / "losses.jsonl", callbacks=[ArmAtStep2(), checkpoint])
print("the run was not stopped", flush=True)
"""


@pytest.mark.parametrize("kind", ["dcp", "file"])
def test_sigterm_during_a_save_lets_it_finish_then_stops_as_a_preemption(tmp_path: Path, kind: str) -> None:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, str(script), kind, str(folder)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert "SIGTERM sent during the save" in out, out[-3000:]
    assert "the run was not stopped" not in out
    for bad in ("doesn't match expected size", "Fatal Python error", "Aborted", "is gone"):
        assert bad not in out, out[-4000:]
    losses = (folder / "losses.jsonl").read_text().splitlines()
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in losses]
    assert max(steps) == 3, (steps, out[-3000:])  # stopped at the step boundary the ranks agreed on, before step 4
    last = folder / "last.ckpt"
    info = detect_format(last)
    saved = read_resumable(last)
    leftovers = sorted(p.name for p in folder.iterdir() if p.name.startswith("last"))
    print(f"\n{kind}: SIGTERM to the launcher during step 2's save -> exit {run.returncode}; last.ckpt is a "
          f"{info.describe()} of global_step {saved['global_step']}; next to it: {leftovers}")
    assert saved["global_step"] == 3  # the save finished (2), the preemption stopped the run after step 3
    assert leftovers == ["last.ckpt"]
    assert all(bool(torch.isfinite(v.float()).all()) for v in saved["state_dict"].values())
