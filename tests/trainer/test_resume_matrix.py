"""Checkpoints that outlive the layout: saved mid-epoch under each strategy, resumed under others.

Each cell: the resumed run's loss at the first step after the checkpoint vs the uninterrupted one-device run, and
the largest weight difference after 3 more AdamW steps (:mod:`lightning_parallel.testing.resume_matrix`). Every
layout saves once; each checkpoint is resumed under its own layout and under layouts of the other checkpoint
families (one-file, sharded folder, DCP folder, DeepSpeed folder) picked in rotation: every saved family is read by
every family's loader, and every layout is resumed into at least three times (42 of the 121 cells, about 2 minutes
here). ``LP_RESUME_MATRIX=full`` runs every cell; ``-s`` prints them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from lightning_parallel.checkpoint.resume import TRUST_ENV
from lightning_parallel.testing import resume_matrix as rm

pytestmark = pytest.mark.slow  # 11 layouts saved, 42 cells and DeepSpeed folders: ~2.5 min here

# The checkpoint family each layout writes (and whose loader it runs when resuming).
FAMILIES: dict[str, tuple[str, ...]] = {
    "one-file": ("1 device", "lp_dp x2", "lp_ddp x2"),
    "sharded": ("lp_sharded z1 x2", "lp_sharded z3 x2", "lp_sharded hsdp 2x2 z3"),
    "dcp": ("lp_tensor tp2", "lp_pipeline pp2", "lp_hybrid 2x2x2", "lp_hybrid 2x2x2 z3"),
    "deepspeed": ("lp_zero_offload x2",),
}


def resumed_under(saved_under: str) -> list[str]:
    """The layouts a checkpoint saved under ``saved_under`` is resumed under: its own, and one of each family in
    rotation (every layout, with ``LP_RESUME_MATRIX=full``)."""
    names = list(rm.LAYOUTS)
    if os.environ.get("LP_RESUME_MATRIX") == "full":
        return names
    row = names.index(saved_under)
    firsts = {next(m for m in members if m in rm.LAYOUTS) for members in FAMILIES.values()
              if any(m in rm.LAYOUTS for m in members)}
    picks = [saved_under]
    for members in FAMILIES.values():
        present = [m for m in members if m in rm.LAYOUTS]
        if len(present) > 1 or (present and saved_under in firsts):  # a family of one (DeepSpeed's: the costliest
            picks.append(present[row % len(present)])  # start) is resumed into from the first layout of each family
    return [name for name in names if name in picks]


def test_the_cells_cover_every_pair_of_families_and_every_layout_three_times() -> None:
    assert {m for members in FAMILIES.values() for m in members} >= set(rm.LAYOUTS), "a layout without a family"
    targets = [t for s in rm.LAYOUTS for t in resumed_under(s)]
    family = {m: f for f, members in FAMILIES.items() for m in members}
    pairs = {(family[s], family[t]) for s in rm.LAYOUTS for t in resumed_under(s)}
    present = {family[n] for n in rm.LAYOUTS}
    assert pairs == {(a, b) for a in present for b in present}
    for name in rm.LAYOUTS:
        assert targets.count(name) >= 3, (name, targets.count(name))

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
    for target in resumed_under(saved_under):
        cell = rm.resume(saved_under, saved[saved_under], target, folder, ref)
        assert cell.error is None, f"{saved_under} -> {target}: {cell.error}"
        assert cell.loss_diff is not None and cell.weight_diff is not None
        lines.append(f"{saved_under:>18} -> {target:<18} loss at step {rm.STOP + 1}: {cell.loss:.6f} "
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
