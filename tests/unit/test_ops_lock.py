"""A DeepSpeed op build killed midway leaves torch's build lock; the next build must clear it, not wait forever."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from lightning_parallel.parallel.offload import ops


def test_stale_build_locks_are_cleared_and_a_live_build_is_waited_for_with_a_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "cpu_adam"
    folder.mkdir()
    monkeypatch.setattr(ops, "_build_dir", lambda name: folder)
    said: list[str] = []
    lock, owner = folder / "lock", folder / "lock.lp_owner"

    gone = subprocess.Popen(["true"])
    gone.wait()
    lock.write_text("")
    owner.write_text(f"{gone.pid} host\n")
    ops.settle_lock("cpu_adam", report=said.append, timeout=5)
    assert not lock.exists() and not owner.exists()
    assert f"its builder, pid {gone.pid}, is no longer running" in said[-1] and "removed a stale build lock" in said[-1]

    lock.write_text("")  # left by a build outside lightning-parallel: no owner record; nothing compiling
    old = time.time() - 120
    os.utime(lock, (old, old))
    ops.settle_lock("cpu_adam", report=said.append, timeout=5)
    assert not lock.exists() and "no process has compiled in" in said[-1]

    lock.write_text("")  # a live builder (this process): wait, then give up with the folder and the lock to delete
    owner.write_text(f"{os.getpid()} host\n")
    with pytest.raises(ops.OpsUnavailableError, match="delete") as err:
        ops.settle_lock("cpu_adam", report=said.append, timeout=0.3, poll=0.1)
    assert str(folder) in str(err.value) and lock.exists()


def test_a_cached_build_of_another_environment_is_not_taken_for_built(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh virtual environment sharing the extensions cache: torch would rebuild the op (its build file names
    another torch and DeepSpeed), so the set-up must build it, announced, instead of reporting it cached."""
    import deepspeed
    import torch

    folder = tmp_path / "cpu_adam"
    folder.mkdir()
    monkeypatch.setattr(ops, "_build_dir", lambda name: folder)
    monkeypatch.setattr("deepspeed.git_version_info.installed_ops", {})
    assert not ops.op_is_built("cpu_adam")  # nothing cached
    (folder / "cpu_adam.so").write_bytes(b"")
    assert ops.op_is_built("cpu_adam")  # a cache without its build file is trusted
    here = (f"cflags = -I{Path(deepspeed.__file__).parent}/ops/csrc/includes\n"
            f"ldflags = -shared -L{Path(torch.__file__).parent / 'lib'} -lc10\n")
    (folder / "build.ninja").write_text(here)
    assert ops.op_is_built("cpu_adam")
    (folder / "build.ninja").write_text(here.replace(str(Path(torch.__file__).parents[1]), "/elsewhere/site-packages"))
    assert not ops.op_is_built("cpu_adam")
    assert ops.missing_ops(["cpu_adam"]) == ["cpu_adam"]


def test_a_cached_build_with_newer_sources_is_not_taken_for_built(tmp_path: Path) -> None:
    """A freshly installed environment at the same path has sources newer than the cache: ninja (which torch's loader
    runs) would rebuild, so the set-up must not call the op built."""
    import shutil
    import sys

    ninja = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
    if not Path(ninja).is_file():
        pytest.skip("no ninja")
    rules = "rule cp\n  command = cp $in $out\nbuild out.txt: cp in.txt\ndefault out.txt\n"
    (tmp_path / "build.ninja").write_text(rules)
    (tmp_path / "in.txt").write_text("source")
    os.utime(tmp_path / "in.txt", (time.time() - 100, time.time() - 100))
    assert not ops._ninja_up_to_date(tmp_path)  # not built yet
    subprocess.run([ninja, "-C", str(tmp_path)], check=True, capture_output=True)  # the build, as torch runs it
    assert ops._ninja_up_to_date(tmp_path)
    os.utime(tmp_path / "in.txt", (time.time() + 100, time.time() + 100))  # the source is newer than the build
    assert not ops._ninja_up_to_date(tmp_path)
