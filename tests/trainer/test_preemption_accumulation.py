"""A preemption in the middle of a gradient accumulation stops the run at the end of that optimizer step, not at
the next batch: the preemption checkpoint holds whole steps only.

``lp_ddp`` on 2 ranks (Lightning's ``popen`` launcher, as the command line starts them), 2 batches accumulated per
step, ``PreemptionCheckpoint``; rank 0 sends itself SIGTERM at the start of batch 2, the first batch of step 2. The
ranks agree on the stop at the end of batch 2 and go on to batch 3, which ends step 2; they stop before batch 4 and
save there: global step 2 after 4 batches. Before, they stopped before batch 3 and saved global step 1 after 3
batches -- a resumed run then trained step 2 on batch 3 alone, silently off the uninterrupted run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """\
import os, signal, sys
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning_parallel.callbacks import PreemptionCheckpoint
from lightning_parallel.strategies import LPDDPStrategy
from tests.helpers import tiny_gpt
from tests.trainer.token_data import GLOBAL_BATCH, TokenData


class TermAtBatch2(Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 2 and trainer.global_rank == 0:
            print("SIGTERM at batch 2", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        print(f"rank {trainer.global_rank} ended batch {batch_idx} at global step {trainer.global_step}", flush=True)


trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LPDDPStrategy(start_method="popen"), max_steps=6,
                     accumulate_grad_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                     callbacks=[TermAtBatch2(), PreemptionCheckpoint(dirpath=sys.argv[1], save_last=True,
                                                                     save_top_k=0)])
trainer.fit(tiny_gpt(bias=False), datamodule=TokenData(GLOBAL_BATCH // 2))
print("the run was not stopped", flush=True)
"""


def test_a_preemption_mid_accumulation_stops_at_the_end_of_the_step(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    folder = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, str(script), str(folder)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert "SIGTERM at batch 2" in out, out[-3000:]
    assert "the run was not stopped" not in out, out[-3000:]
    assert "rank 0 ended batch 3 at global step 2" in out and "ended batch 4" not in out, out[-3000:]
    saved = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=False)
    batches = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    print(f"\npreemption at batch 2 (accumulation 2): checkpoint of global step {saved['global_step']} after "
          f"{batches} batches")
    assert (saved["global_step"], batches) == (2, 4)


def test_a_preemption_under_forked_ranks_saves_and_ends_the_launcher(tmp_path: Path) -> None:
    """Ranks started by ``fork`` (``spawn`` alike): a preemption stops them at the step boundary, each runs the
    callbacks' ``on_exception`` there (the preemption checkpoint), and the launching process -- this test's -- ends
    with ``RanksPreempted``. Before, the ranks exited without saving and the launcher waited forever for rank 0's
    results."""
    import signal

    import lightning.pytorch as pl
    import pytest
    from lightning.pytorch.callbacks import Callback

    from lightning_parallel.callbacks import PreemptionCheckpoint
    from lightning_parallel.strategies import LPDDPStrategy
    from lightning_parallel.strategies.layout import RanksPreempted
    from tests.helpers import tiny_gpt
    from tests.trainer.token_data import GLOBAL_BATCH, TokenData

    class TermAtBatch2(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
            if args[-1] == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    folder = tmp_path / "ckpt"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LPDDPStrategy(start_method="fork"), max_steps=6,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                         callbacks=[TermAtBatch2(), PreemptionCheckpoint(dirpath=folder, save_top_k=0,
                                                                         save_last=True)])
    with pytest.raises(RanksPreempted, match="global step 3 "):
        trainer.fit(tiny_gpt(bias=False), datamodule=TokenData(GLOBAL_BATCH // 2))
    saved = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=False)
    print(f"\nfork: SIGTERM at batch 2 -> RanksPreempted in the launcher; last.ckpt of global step "
          f"{saved['global_step']}")
    assert saved["global_step"] == 3
