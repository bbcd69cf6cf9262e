"""Checkpoints that outlive the layout: saved mid-epoch under each strategy, resumed under every other.

Each cell: the resumed run's loss at the first step after the checkpoint vs the uninterrupted one-device run, and
the largest weight difference after 3 more AdamW steps (:mod:`lightning_parallel.testing.resume_matrix`). The whole
matrix runs here (81 cells of forked CPU ranks with DeepSpeed's ops built, 64 without; about 2.5 minutes);
``scripts/check_resume_matrix.py`` prints it. ``lp_zero_offload`` resumes DeepSpeed folders only: the other
checkpoints are refused before any rank starts, with the reason and the strategies that resume them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from lightning_parallel.checkpoint.resume import TRUST_ENV
from lightning_parallel.testing import resume_matrix as rm

TOL = 1e-5


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple, dict[str, Path]]:
    rm.quiet()
    os.environ[TRUST_ENV] = "1"  # the DeepSpeed folder's optimizer files hold DeepSpeed objects (our own files here)
    folder = tmp_path_factory.mktemp("resume_matrix")
    ref = rm.reference(folder)
    saved = {name: rm.save(name, folder) for name in rm.LAYOUTS}
    return folder, ref, saved


@pytest.mark.parametrize("saved_under", list(rm.LAYOUTS))
def test_saved_under_one_layout_resumes_under_every_other(matrix: tuple, saved_under: str) -> None:
    folder, ref, saved = matrix
    lines = []
    for resumed_under in rm.LAYOUTS:
        cell = rm.resume(saved_under, saved[saved_under], resumed_under, folder, ref)
        if resumed_under == "lp_zero_offload x2" and saved_under != resumed_under:
            assert cell.error is not None and "lp_zero_offload cannot resume" in cell.error, cell
            lines.append(f"{saved_under:>18} -> {resumed_under:<18} refused before spawn: {cell.error[:110]}...")
            continue
        assert cell.error is None, f"{saved_under} -> {resumed_under}: {cell.error}"
        assert cell.loss_diff is not None and cell.weight_diff is not None
        lines.append(f"{saved_under:>18} -> {resumed_under:<18} loss at step {rm.STOP + 1}: {cell.loss:.6f} "
                     f"(uninterrupted {cell.reference_loss:.6f}); max |w - w_ref| after {rm.MORE} more steps: "
                     f"{cell.weight_diff:.1e}")
        assert cell.loss_diff < TOL, lines[-1]
        assert cell.weight_diff < TOL, lines[-1]
    print("\n" + "\n".join(lines))


def test_the_check_sees_a_wrong_data_position(matrix: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: with a plain loader (the epoch restarts from its first batch on resume, as in Lightning), the resumed
    step trains on another batch and the comparison fails."""
    folder, ref, saved = matrix

    def restart_epoch(self: rm._Tokens) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False, drop_last=True)

    monkeypatch.setattr(rm._Tokens, "train_dataloader", restart_epoch)
    cell = rm.resume("1 device", saved["1 device"], "1 device", folder, ref)
    assert cell.loss_diff is not None and cell.loss_diff > 1e-3, cell
