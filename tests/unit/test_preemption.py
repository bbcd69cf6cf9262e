"""Preemption and stuck ranks without a process group: Ctrl-C routed to Lightning's SIGTERM path, `--ckpt_path last`
across logger versions, the collective timeout's resolution."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_parallel import LayoutError, LPDDPStrategy, ParallelConfig
from lightning_parallel.cli import _resolve_last
from lightning_parallel.parallel.faults import interrupts
from lightning_parallel.strategies.base import CPU_COLLECTIVE_TIMEOUT


def test_first_ctrl_c_asks_for_a_stop_at_the_next_step_the_second_stops_now() -> None:
    trainer = SimpleNamespace(_signal_connector=SimpleNamespace(received_sigterm=False), is_global_zero=False)
    before = signal.getsignal(signal.SIGINT)
    interrupts.install(trainer)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert trainer._signal_connector.received_sigterm  # Lightning's SIGTERM flag: all ranks stop together
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    finally:
        interrupts.uninstall()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_preemption_ends_no_rank_and_blames_none() -> None:
    """The watchdog (no Lightning import) knows Lightning's SIGTERMException by name: after a preemption it ends no
    rank process; after another failure it ends the ranks that do not stop within the grace period."""
    import subprocess

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_parallel.parallel.faults import watchdog

    class Frozen:
        pid, killed = 4242, False

        def wait(self, timeout: float | None = None) -> int:
            if not self.killed:
                raise subprocess.TimeoutExpired("rank", timeout or 0)
            return -9

        def kill(self) -> None:
            self.killed = True

    assert watchdog.end_started_ranks(SimpleNamespace(procs=[Frozen()]), SIGTERMException(), grace=0) == []
    assert watchdog.end_started_ranks(SimpleNamespace(procs=[Frozen()]), RuntimeError("x"), grace=0) == [4242]
    assert watchdog.on_exception(SIGTERMException()) is None
    # the spawn/fork launchers hold multiprocessing.Process objects (no wait(): they were killed at once, no grace)
    import multiprocessing
    import time

    context = multiprocessing.get_context("fork")
    stopping, frozen = context.Process(target=time.sleep, args=(0.5,)), context.Process(target=time.sleep, args=(60,))
    stopping.start()
    frozen.start()
    ended = watchdog.end_started_ranks(SimpleNamespace(procs=[stopping, frozen]), RuntimeError("x"), grace=3)
    assert ended == [frozen.pid] and stopping.exitcode == 0 and frozen.exitcode == -9, (ended, stopping, frozen)


def _args(root: Path) -> dict[str, object]:
    return {"trainer": {"default_root_dir": str(root), "callbacks": [], "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root / "logs")}}}}


def test_ckpt_path_last_is_the_newest_complete_checkpoint_across_versions(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Lightning looks for `last` only in the new run's (empty) version folder and starts over; the CLI takes the
    newest complete checkpoint under the run's folders, skipping partial and damaged ones."""
    assert _resolve_last(_args(tmp_path)) is None
    assert "no checkpoint under" in capsys.readouterr().out
    old = tmp_path / "logs" / "csv" / "version_0" / "checkpoints"
    old.mkdir(parents=True)
    torch.save({"state_dict": {}, "global_step": 50}, old / "last.ckpt")
    newer = tmp_path / "logs" / "csv" / "version_1" / "checkpoints"
    newer.mkdir(parents=True)
    torch.save({"state_dict": {}, "global_step": 80}, newer / "epoch=0-step=80.ckpt")
    (newer / "last.ckpt.partial").write_bytes(b"half")  # an interrupted save
    time.sleep(0.01)
    damaged = newer / "last.ckpt"
    damaged.write_bytes((newer / "epoch=0-step=80.ckpt").read_bytes()[:100])  # newest, but truncated
    assert _resolve_last(_args(tmp_path)) == str(newer / "epoch=0-step=80.ckpt")
    out = capsys.readouterr().out
    assert f"skipping {damaged}" in out and "truncated" in out
    assert "--ckpt_path last is" in out


def test_collective_timeout_key_argument_and_cpu_default() -> None:
    assert LPDDPStrategy(parallel={"collective_timeout": 30}).layout.collective_timeout == 30
    with pytest.raises(LayoutError, match="collective_timeout"):
        ParallelConfig(collective_timeout=0).validate()
    strategy = LPDDPStrategy(accelerator=None)
    strategy.parallel_devices = [torch.device("cpu")]
    assert strategy.collective_timeout() == CPU_COLLECTIVE_TIMEOUT == timedelta(minutes=10)
    given = LPDDPStrategy(timeout=timedelta(seconds=7))
    given.parallel_devices = [torch.device("cpu")]
    assert given.collective_timeout() == timedelta(seconds=7)
    key = LPDDPStrategy(parallel={"collective_timeout": 30}, timeout=timedelta(seconds=7))
    key.parallel_devices = [torch.device("cpu")]
    assert key.collective_timeout() == timedelta(seconds=30)
