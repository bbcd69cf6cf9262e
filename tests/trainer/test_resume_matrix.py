"""Checkpoints that outlive the layout: saved mid-epoch under each strategy, resumed under every other.

Each cell: the resumed run's loss at the first step after the checkpoint vs the uninterrupted one-device run, and
the largest weight difference after 3 more AdamW steps (:mod:`lightning_parallel.testing.resume_matrix`). The whole
matrix runs here (121 cells of forked CPU ranks with DeepSpeed's ops built, 100 without; about 5 minutes); ``-s``
prints every cell.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from lightning_parallel.checkpoint.resume import TRUST_ENV
from lightning_parallel.testing import resume_matrix as rm

pytestmark = pytest.mark.slow  # 9 layouts saved x 9 resumed and DeepSpeed folders: ~4 min here

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


def test_deepspeed_folders_of_other_stages(matrix: tuple) -> None:
    """A ZeRO-1 (no offload) and a ZeRO-3 (CPU offload) DeepSpeed folder resume under lp_ddp and under lp_zero_offload
    ZeRO-2 (through the one-device form); a ZeRO-3 run refuses another stage's folder with the reason."""
    pytest.importorskip("deepspeed")
    if "lp_zero_offload x2" not in rm.LAYOUTS:
        pytest.skip("DeepSpeed's CPU ops are not built (scripts/test.sh builds them in its set-up)")
    from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy

    folder, ref, _ = matrix
    added = []
    for stage, offload in ((1, "none"), (3, "cpu")):
        name = f"lp_zero_offload z{stage} {offload} x2"
        added.append(name)
        rm.LAYOUTS[name] = rm.Layout(name, lambda s=stage, o=offload: LPZeroOffloadStrategy(
            {"zero_stage": s, "offload": o}, start_method="fork"), 2, 2)
    try:
        for saved_under in ("lp_zero_offload z1 none x2", "lp_zero_offload z3 cpu x2"):
            path = rm.save(saved_under, folder)
            for resumed_under in ("lp_ddp x2", "lp_zero_offload x2"):
                cell = rm.resume(saved_under, path, resumed_under, folder, ref)
                print(f"\n{saved_under} -> {resumed_under}: loss at step {rm.STOP + 1} {cell.loss} (uninterrupted "
                      f"{cell.reference_loss:.6f}), max |w - w_ref| {cell.weight_diff}")
                assert cell.error is None, cell.error
                assert cell.loss_diff is not None and cell.loss_diff < TOL
                assert cell.weight_diff is not None and cell.weight_diff < TOL
        refused = rm.resume("lp_zero_offload z1 none x2", folder / "save_lp_zero_offload_z1_none_x2" / "stop.ckpt",
                            "lp_zero_offload z3 cpu x2", folder, ref)
        assert refused.error is not None and "DeepSpeed resumes its folders on the same stage" in refused.error
    finally:
        for name in added:
            del rm.LAYOUTS[name]


@pytest.mark.parametrize("layout", ["lp_ddp x2", "lp_pipeline pp2"])
def test_rng_states_make_a_dropout_run_resume_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      layout: str) -> None:
    """With dropout, the resumed run equals the uninterrupted one on the same layout only because every rank's RNG
    states come back from the checkpoint; without them (control) the dropout masks differ."""
    import lightning_parallel.checkpoint.rng as rng

    monkeypatch.setattr(rm, "DROPOUT", 0.2)
    full = rm._fit(rm.LAYOUTS[layout], losses=tmp_path / "full.jsonl", callbacks=[])
    path = rm.save(layout, tmp_path)

    def resumed(name: str) -> tuple[float, float]:
        model = rm._fit(rm.LAYOUTS[layout], losses=tmp_path / f"{name}.jsonl", callbacks=[], ckpt_path=str(path))
        a, b = rm._read_losses(tmp_path / "full.jsonl"), rm._read_losses(tmp_path / f"{name}.jsonl")
        loss = max(abs(a[s] - b[s]) for s in range(rm.STOP + 1, rm.STOP + rm.MORE + 1))
        weights = max(float((v - full.state_dict()[k]).abs().max()) for k, v in model.state_dict().items())
        return loss, weights

    loss, weights = resumed("restored")
    monkeypatch.setattr(rng, "restore_rng_states", lambda *args, **kwargs: False)
    control_loss, control_weights = resumed("not_restored")
    print(f"\n{layout}, dropout 0.2: resumed vs uninterrupted, steps {rm.STOP + 1}-{rm.STOP + rm.MORE}: max |loss "
          f"difference| {loss:.1e}, max |w difference| {weights:.1e}; without the RNG states {control_loss:.1e} / "
          f"{control_weights:.1e}")
    assert loss < TOL and weights < TOL
    assert control_loss > 1e-4
