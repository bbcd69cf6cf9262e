"""``lightning_parallel.checkpoint`` against every strategy's checkpoint: the tiny GPT trained 3 steps on 2 fork-started
CPU ranks (``lp_dp``: 2 replicas in one process), saved with ``trainer.save_checkpoint``, read back with
``full_state_dict`` (no process group) and consolidated into one file that ``GPT.load_from_checkpoint`` loads on one
device. The matrix is ``tests/checkpoint_matrix.py``; ``-s`` prints a line per case."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_parallel.checkpoint import CheckpointFormatError, full_state_dict
from lightning_parallel.models import GPT
from tests.checkpoint_matrix import CASES, Case, CaseResult, ensure_deepspeed_ops, run_case, skip_reason

REPO = Path(__file__).resolve().parents[2]
TORCH_ONLY = [c for c in CASES if c.needs in ("", "fairscale")]
ZERO_OFFLOAD = [c for c in CASES if c.needs in ("deepspeed", "nvme")]


def _ids(cases: list[Case]) -> list[str]:
    return [c.name.replace(" ", "-") for c in cases]


def _check(result: CaseResult) -> None:
    case = result.case
    print(f"\n{case.name}: {result.format}, {result.tensors} tensors; full_state_dict vs live "
          f"{result.full_vs_live:.1e}; consolidated+load_from_checkpoint vs live {result.consolidated_vs_live:.1e}; "
          f"val_loss live {result.val_live:.6f} consolidated {result.val_consolidated:.6f} ({result.seconds:.1f} s)"
          f"\n{result.summary}")
    assert result.format == case.expected_format
    assert result.keys_match and result.tensors == 35  # the GPT's own names, nothing missing, nothing added
    assert result.live_vs_initial > 1e-4  # the run trained: the checkpoint could not pass for the initial weights
    assert result.full_vs_live == 0.0
    assert result.consolidated_vs_live == 0.0
    assert result.hparams_match and result.weights_only_loadable
    assert abs(result.val_live - result.val_consolidated) < 1e-5


def _skip_if_unavailable(case: Case) -> None:
    reason = skip_reason(case)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("case", TORCH_ONLY, ids=_ids(TORCH_ONLY))
def test_torch_strategies(case: Case, tmp_path: Path) -> None:
    """lp_ddp, lp_dp, lp_sharded stages 1-3 (full file and sharded folder), fairscale stages 1-2."""
    _skip_if_unavailable(case)
    _check(run_case(case, tmp_path))


@pytest.mark.timeout(1800)  # the first offload fit may wait for DeepSpeed's cold op build (minutes on 2 cores)
@pytest.mark.slow  # DeepSpeed engines, NVMe offload included: ~20-25 s each
@pytest.mark.parametrize("case", ZERO_OFFLOAD, ids=_ids(ZERO_OFFLOAD))
def test_zero_offload(case: Case, tmp_path: Path) -> None:
    """lp_zero_offload: ZeRO-2 and ZeRO-3 with CPU offload (DeepSpeed's fp32 partitions), ZeRO-3 with NVMe offload
    (from the per-rank NVMe state lp_zero_offload writes; the trained weights, not the initial ones; the same folder
    without those files is refused, not read from DeepSpeed's partitions). ZeRO-2 also goes through the
    ``lightning-parallel consolidate`` command."""
    _skip_if_unavailable(case)
    ensure_deepspeed_ops(nvme=case.needs == "nvme")
    _check(run_case(case, tmp_path))
    folder = tmp_path / "model.ckpt"
    if case.needs == "nvme":
        bare = tmp_path / "without_nvme_state.ckpt"
        shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("lp_offload_state"))
        with pytest.raises(CheckpointFormatError, match="NVMe offload"):
            full_state_dict(bare)
    if case.name == "lp_zero_offload z2 cpu":
        _check_command(folder, tmp_path / "cli" / "one.ckpt", "DeepSpeed folder (ZeRO-2, 2 ranks)")


def _check_command(src: Path, out: Path, described: str) -> None:
    """``python -m lightning_parallel consolidate IN OUT`` (the console entry's module): exactly one line on stdout
    (DeepSpeed's own messages stay out of it), exit 0. Its errors are tested in-process in
    tests/unit/test_checkpoint_formats.py."""
    cmd = [sys.executable, "-m", "lightning_parallel", "consolidate", str(src), str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and described in lines[0] and "35 tensors" in lines[0], done.stdout
    assert torch.load(out, weights_only=True)["state_dict"].keys() == full_state_dict(src).keys()


class _BufferedGPT(GPT):
    """The tiny GPT with a persistent buffer (replicated, not sharded, under ZeRO-3)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.register_buffer("calib", torch.arange(4, dtype=torch.float32))


def test_zero3_sharded_folder_keeps_replicated_buffers_once(tmp_path: Path) -> None:
    """A ZeRO-3 sharded folder records which entries are dim-0 shards (``sharded_shapes``), so both readers -- the
    checkpoint API and lp_sharded's ``consolidate_checkpoint`` -- join those and keep a persistent buffer once (it
    used to come out world-size times as long)."""
    import lightning.pytorch as pl

    from lightning_parallel.checkpoint.formats.sharded import consolidate_checkpoint
    from lightning_parallel.strategies import LPShardedStrategy
    from tests.helpers import TRAINER_QUIET, SequentialTokens

    pl.seed_everything(0, verbose=False)
    model = _BufferedGPT(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    trainer = pl.Trainer(strategy=LPShardedStrategy({"zero_stage": 3}, checkpoint="sharded", start_method="fork"),
                         accelerator="cpu", devices=2, max_steps=2, **TRAINER_QUIET)
    path = tmp_path / "z3.ckpt"

    class _Save(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            trainer.save_checkpoint(path)

    trainer.callbacks.append(_Save())
    trainer.fit(model, SequentialTokens(batch_size=4))
    state = full_state_dict(path)
    assert state["calib"].tolist() == [0.0, 1.0, 2.0, 3.0]
    fresh = _BufferedGPT(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    fresh.load_state_dict(state)  # strict: every shape right
    assert max(float((state[k] - v).abs().max()) for k, v in model.state_dict().items()) == 0.0
    joined = consolidate_checkpoint(path, tmp_path / "one.ckpt")["state_dict"]
    assert joined["calib"].shape == (4,) and all(torch.equal(joined[k], state[k]) for k in state)
