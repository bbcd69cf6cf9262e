"""Pure logic of resuming under another layout: the resumable sampler, by-name/by-index optimizer state, the checks
that refuse a checkpoint of another model or optimizer, atomic replacement, the ckpt_path check before spawn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_parallel.checkpoint.atomic import fresh_partial, partial_path, replace_with
from lightning_parallel.checkpoint.formats import CheckpointFormatError
from lightning_parallel.checkpoint.resume import (
    ResumeError,
    check_fits,
    optimizer_by_index,
    optimizer_by_name,
    read_resumable,
)
from lightning_parallel.data.resumable import ResumableSampler
from lightning_parallel.strategies.layout import check_ckpt_path


def _global_batches(n: int, replicas: int, batch: int, *, epoch: int = 0, skip: int = 0) -> list[set[int]]:
    per_rank = []
    for r in range(replicas):
        s = ResumableSampler(range(n), num_replicas=replicas, rank=r, shuffle=True, seed=3, skip=skip,
                             skip_epoch=epoch)
        s.set_epoch(epoch)
        per_rank.append(list(s))
    steps = len(per_rank[0]) // batch
    return [set().union(*(set(p[i * batch:(i + 1) * batch]) for p in per_rank)) for i in range(steps)]


def test_global_batches_are_the_same_for_every_dp_size() -> None:
    one = _global_batches(48, 1, 8)
    assert _global_batches(48, 2, 4) == one
    assert _global_batches(48, 4, 2) == one
    assert _global_batches(48, 1, 8, epoch=1) != one  # another epoch, another order


def test_a_resumed_epoch_skips_the_batches_already_run_in_that_epoch_only() -> None:
    full = _global_batches(48, 2, 4, epoch=1)
    assert _global_batches(48, 2, 4, epoch=1, skip=3 * 4) == full[3:]
    s = ResumableSampler(range(48), num_replicas=2, rank=0, skip=12, skip_epoch=1)
    s.set_epoch(2)
    assert len(list(s)) == len(s) == 24  # not in another epoch
    resumed = ResumableSampler(range(48), num_replicas=2, rank=0, skip=12, skip_epoch=1)
    resumed.set_epoch(1)
    # the length stays the whole epoch's: Lightning counts the restored batches itself and ends the epoch at
    # len(dataloader); a shorter length ended a resumed epoch early (found by a SIGTERM-and-resume run)
    assert len(resumed) == 24 and len(list(resumed)) == 12


def test_optimizer_state_by_name_and_back() -> None:
    saved = {"state": {0: {"exp_avg": torch.ones(2)}, 2: {"exp_avg": torch.zeros(3)}},
             "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}]}
    by_name = optimizer_by_name(saved, [["a", "b"], ["c"]])
    assert set(by_name["state"]) == {"a", "c"} and by_name["param_groups"][1] == {"lr": 0.2, "params": ["c"]}
    back = optimizer_by_index(by_name)
    assert back["param_groups"] == saved["param_groups"] and set(back["state"]) == {0, 2}
    with pytest.raises(ResumeError, match=r"param groups of sizes \[2, 1\], this run's optimizer \[1, 2\]"):
        optimizer_by_name(saved, [["a"], ["b", "c"]])


class _Tiny(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, 2)
        self.hparams = {"width": width}


def test_check_fits_names_the_file_the_tensor_and_the_hyper_parameters() -> None:
    saved = {"state_dict": _Tiny(4).state_dict(), "hyper_parameters": {"width": 4},
             "optimizer_states": [{"state": {}, "param_groups": [{"params": [0, 1]}]}]}
    model = _Tiny(8)
    with pytest.raises(ResumeError, match=r"x\.ckpt: lin\.weight has shape \[2, 4\] in the checkpoint but \[2, 8\] "
                                          r"in this model .*width 4 in the checkpoint, 8 here"):
        check_fits(saved, module=model, optimizers=[], path="x.ckpt")
    same = _Tiny(4)
    one_group = torch.optim.SGD([{"params": [same.lin.weight]}, {"params": [same.lin.bias]}], lr=0.1)
    with pytest.raises(ResumeError, match=r"optimizer 0 was saved with param groups of \[2\] parameters; this "
                                          r"run's has \[1, 1\]"):
        check_fits(saved, module=same, optimizers=[one_group], path="x.ckpt")
    check_fits(saved, module=same, optimizers=[torch.optim.SGD(same.parameters(), lr=0.1)], path="x.ckpt")


def test_replace_with_swaps_a_folder_for_a_file_and_back(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    target.write_text("old file")
    partial = fresh_partial(target)
    assert partial == partial_path(target) and partial.is_dir()
    (partial / "meta.pt").write_text("new")
    replace_with(partial, target)
    assert (target / "meta.pt").read_text() == "new" and not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_read_resumable_refuses_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    bad = tmp_path / "x.ckpt"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointFormatError, match=r"x\.ckpt"):
        read_resumable(bad)


def test_ckpt_path_is_checked_before_spawn(tmp_path: Path) -> None:
    class Strategy:
        def check_resume_source(self, path: str) -> None:
            raise ResumeError(f"refused {path}")

    with pytest.raises(CheckpointFormatError, match=r"--ckpt_path .*nothing\.ckpt: no such file or folder"):
        check_ckpt_path(object(), str(tmp_path / "nothing.ckpt"))
    check_ckpt_path(object(), "last")  # Lightning's keyword: resolved in the ranks
    (tmp_path / "a.ckpt").write_text("x")
    with pytest.raises(ResumeError, match="refused"):
        check_ckpt_path(Strategy(), str(tmp_path / "a.ckpt"))


def test_lp_zero_offload_resumes_other_layouts_at_zero_1_2_only(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from lightning_parallel.strategies.zero_offload import check_resume_source

    other = tmp_path / "model.ckpt"
    other.write_text("x")
    check_resume_source(other, zero_stage=2, offload="cpu")  # read into the one-device form when loading
    with pytest.raises(ResumeError, match=r"with ZeRO-3 resumes only DeepSpeed folders it wrote itself.*zero_stage 1 "
                                          r"or 2.*lightning-parallel consolidate"):
        check_resume_source(other, zero_stage=3, offload="cpu")
    with pytest.raises(ResumeError, match="with NVMe offload resumes only DeepSpeed folders it wrote itself"):
        check_resume_source(other, zero_stage=3, offload="nvme")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "latest").write_text("checkpoint")
    check_resume_source(tmp_path / "ds", zero_stage=3, offload="nvme")


def test_a_resume_from_inside_an_accumulation_window_is_warned_about() -> None:
    """A checkpoint written after batch 3 with windows of 2 (a validation mid-window): the gradient of batch 3 is in
    no checkpoint, so the resumed run leaves the uninterrupted one (4.5e-2 in the weights after 9 steps on one device,
    measured by a helper's probe) -- said, with the fix. Not on a step boundary, nor under manual optimization."""
    from types import SimpleNamespace

    from lightning_parallel.data.fast_forward import partial_step_warning

    def trainer(accumulate: int, automatic: bool = True) -> SimpleNamespace:
        return SimpleNamespace(accumulate_grad_batches=accumulate,
                               lightning_module=SimpleNamespace(automatic_optimization=automatic))

    text = partial_step_warning(trainer(2), 3)
    assert "inside an accumulation window (after 1 of its 2 batches, batch 3 of the epoch)" in text
    assert "ModelCheckpoint(every_n_train_steps=...)" in text
    assert partial_step_warning(trainer(2), 4) == "" and partial_step_warning(trainer(1), 3) == ""
    assert partial_step_warning(trainer(2, automatic=False), 3) == ""
