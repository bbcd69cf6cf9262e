"""Checkpoints under context parallelism: cp is not part of the state.

Saved mid-epoch under a cp layout, resumed under layouts with and without cp (and the other way), with the checks of
:mod:`lightning_parallel.testing.resume_matrix`: the resumed run's loss at the first step after the checkpoint and its
weights after 3 more AdamW steps against the uninterrupted one-device run. Formats: Lightning's file (lp_ddp), the
lp_sharded folder (ZeRO-3 over dp x cp) and DCP (lp_tensor).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_parallel.testing import resume_matrix as rm

TOL = 1e-5
FORK = {"start_method": "fork"}


def _cp_layouts() -> dict[str, rm.Layout]:
    from lightning_parallel.strategies import LPDDPStrategy, LPShardedStrategy, LPTensorStrategy

    return {layout.name: layout for layout in (
        rm.Layout("lp_ddp cp2", lambda: LPDDPStrategy({"context_parallel_size": 2}, **FORK), 2, 1),
        rm.Layout("lp_sharded z3 dp2 x cp2", lambda: LPShardedStrategy(
            {"zero_stage": 3, "context_parallel_size": 2}, checkpoint="sharded", **FORK), 4, 2),
        rm.Layout("lp_tensor cp2 x tp2", lambda: LPTensorStrategy(
            {"tensor_parallel_size": 2, "context_parallel_size": 2}, **FORK), 4, 1),
    )}


SAVED = ["lp_ddp cp2", "lp_sharded z3 dp2 x cp2", "lp_tensor cp2 x tp2", "1 device", "lp_tensor tp2"]
RESUMED = ["1 device", "lp_ddp cp2", "lp_sharded z3 dp2 x cp2", "lp_tensor cp2 x tp2"]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, tuple, dict[str, Path]]]:
    rm.quiet()
    added = _cp_layouts()
    rm.LAYOUTS.update(added)  # for this module only: the resume matrix's own cells stay as they are
    try:
        folder = tmp_path_factory.mktemp("cp_resume")
        ref = rm.reference(folder)
        yield folder, ref, {name: rm.save(name, folder) for name in SAVED}
    finally:
        for name in added:
            rm.LAYOUTS.pop(name, None)


@pytest.mark.slow
@pytest.mark.parametrize("saved_under", SAVED)
def test_a_cp_checkpoint_resumes_under_other_layouts(matrix: tuple, saved_under: str) -> None:
    folder, ref, saved = matrix
    lines = []
    for resumed_under in RESUMED:
        if resumed_under == saved_under:
            continue
        cell = rm.resume(saved_under, saved[saved_under], resumed_under, folder, ref)
        assert cell.error is None, f"{saved_under} -> {resumed_under}: {cell.error}"
        assert cell.loss_diff is not None and cell.weight_diff is not None
        lines.append(f"{saved_under:>24} -> {resumed_under:<24} loss at step {rm.STOP + 1}: {cell.loss:.6f} "
                     f"(uninterrupted {cell.reference_loss:.6f}); max |w - w_ref| after {rm.MORE} more steps: "
                     f"{cell.weight_diff:.1e}")
        assert cell.loss_diff < TOL, lines[-1]
        assert cell.weight_diff < TOL, lines[-1]
    print("\n" + "\n".join(lines))
