"""A checkpoint write the disk refuses (no space left) stops every rank with one message naming the path and the
bytes, leaves the previous ``last.ckpt`` whole and no ``.partial`` behind -- for every checkpoint format.

The writer of each format raises ``OSError(ENOSPC)`` while saving step 2 (monkeypatched before the ranks fork; a
real full disk is a tmpfs of 1 MB, which needs root to mount: ``docs/reliability.md`` shows that run): for a DCP
folder and an lp_sharded folder only rank 1's write fails (the other rank must not wait for it), for a one-file
checkpoint rank 0's (the only writer), for a DeepSpeed folder every rank's (a full disk is shared; DeepSpeed's own
save ends in a barrier of its own).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_parallel.checkpoint import detect_format
from lightning_parallel.checkpoint.resume import TRUST_ENV, read_resumable
from lightning_parallel.testing import resume_matrix as rm

ARMED = {"on": False}
FORMATS = {"file": "lp_ddp x2", "lp_sharded folder": "lp_sharded z1 x2", "DCP folder": "lp_pipeline pp2",
           "DeepSpeed folder": "lp_zero_offload x2"}


class _ArmAtStep2(Callback):  # runs before ModelCheckpoint (Lightning puts checkpoint callbacks last)
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        ARMED["on"] = trainer.global_step == 2


def _full(rank: int | None) -> Any:
    def check() -> None:
        import torch.distributed as dist

        me = dist.get_rank() if dist.is_initialized() else 0
        if ARMED["on"] and (rank is None or me == rank):
            raise OSError(errno.ENOSPC, "No space left on device")
    return check


def _patch(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if fmt == "DCP folder":
        import torch.distributed.checkpoint.filesystem as fs

        write_item, check = fs._write_item, _full(1)

        def failing_write_item(*args: Any, **kwargs: Any) -> Any:
            check()
            return write_item(*args, **kwargs)

        monkeypatch.setattr(fs, "_write_item", failing_write_item)
    elif fmt == "lp_sharded folder":
        import lightning_parallel.checkpoint.formats.sharded as sharded

        save, check1 = torch.save, _full(1)

        def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if "rank_" in str(f):
                check1()
            return save(obj, f, *args, **kwargs)

        monkeypatch.setattr(sharded.torch, "save", failing_save)
    elif fmt == "file":
        import fsspec.implementations.local as local

        write, check0 = local.LocalFileOpener.write, _full(0)

        def failing_write(self: Any, *args: Any, **kwargs: Any) -> Any:
            check0()
            return write(self, *args, **kwargs)

        monkeypatch.setattr(local.LocalFileOpener, "write", failing_write)
    else:
        save_all, check_all = torch.save, _full(None)

        def failing_torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if "optim_states" in str(f):
                check_all()
            return save_all(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", failing_torch_save)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_full_disk_stops_every_rank_with_the_path_and_the_bytes(tmp_path: Path, fmt: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if FORMATS[fmt] not in rm.LAYOUTS:
        pytest.skip("DeepSpeed or its CPU ops are not available here")
    rm.quiet()
    os.environ[TRUST_ENV] = "1"
    _patch(fmt, monkeypatch)
    folder = tmp_path / "ckpt"
    checkpoint = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_last=True, save_top_k=0)
    with pytest.raises(BaseException) as raised:
        rm._fit(rm.LAYOUTS[FORMATS[fmt]], losses=tmp_path / "losses.jsonl", callbacks=[_ArmAtStep2(), checkpoint])
    text = str(raised.value)
    line = next((x for x in text.splitlines() if "no space left" in x), text.strip().splitlines()[-1])
    print(f"\n{fmt}: {line.strip()[:420]}")
    assert "CheckpointWriteError" in text and "no space left on device while writing the checkpoint" in text, text
    assert str(folder / "last.ckpt") in text and "it needs about" in text and "bytes free" in text, text
    last = folder / "last.ckpt"
    saved = read_resumable(last, trusted=True)
    leftovers = sorted(p.name for p in folder.iterdir() if p.name.startswith("last"))
    print(f"{fmt}: last.ckpt is a {detect_format(last, trusted=True).describe()} of global_step "
          f"{saved['global_step']}; next to it: {leftovers}")
    assert saved["global_step"] == 1 and leftovers == ["last.ckpt"]
