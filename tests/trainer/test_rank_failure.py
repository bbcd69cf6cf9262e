"""A rank lost mid-run does not hang the others, and they say which rank it was.

``lightning-parallel fit`` with ``lp_ddp`` on 2 CPU ranks (Lightning's popen launcher, as the CLI runs it), a short
collective timeout given the documented way (``--trainer.strategy lightning_parallel.LPDDPStrategy
--trainer.strategy.init_args.timeout 0:00:20``). A callback writes each rank's pid once training is under way; the
test then

* ``kill -9``s rank 1: rank 0's next collective fails at once (gloo: the peer's sockets closed), and the watchdog
  (:mod:`lightning_parallel.parallel.faults.watchdog`) names rank 1 from its pid;
* freezes rank 1 (``SIGSTOP``: alive but silent, as a node that dropped off the network): rank 0's collective
  times out after the collective timeout, and the watchdog names rank 1 from its stopped heartbeat.

Both bound rank 0's exit generously (the machine is shared): 120 s, against a 20 s timeout. The two runs share one
module fixture: the killed run starts once the frozen run's rank 1 is stopped, and ends within the frozen run's
collective timeout (its rank 0 waits in a collective meanwhile, idle), so the suite does not wait out the timeout
alone.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_parallel.parallel.faults.watchdog import RankWatchdog, process_alive

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 120.0
TIMEOUT = "0:00:20"

RECIPE = """\
seed_everything: 1234
model:
  class_path: lightning_parallel.models.GPT
  init_args: {{n_layer: 2, n_head: 2, n_embd: 32, block_size: 16, vocab_size: 256, lr: 1.0e-3, warmup_steps: 2}}
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 100000
  limit_val_batches: 0
  num_sanity_val_steps: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: tests.trainer.test_rank_failure.PidFile
      init_args: {{folder: {folder}}}
data:
  class_path: lightning_parallel.data.TextDataModule
  init_args: {{block_size: 16, batch_size: 4}}
"""


class PidFile(Callback):
    """Writes ``rank<R>.pid`` (this process's pid) once, after step ``after``: training is under way."""

    def __init__(self, folder: str, after: int = 3) -> None:
        self.folder, self.after = Path(folder), after

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.after:
            tmp = self.folder / f"rank{trainer.global_rank}.pid.tmp"
            tmp.write_text(str(os.getpid()))
            tmp.rename(self.folder / f"rank{trainer.global_rank}.pid")


class _Run:
    """One 2-rank run of the recipe in ``folder``, started at once (rank 0's output to ``rank0.log``)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "recipe.yaml").write_text(RECIPE.format(folder=folder))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
            env.pop(key, None)
        cmd = [sys.executable, "-m", "lightning_parallel", "fit", "--config", str(folder / "recipe.yaml"),
               "--trainer.strategy", "lightning_parallel.LPDDPStrategy",
               "--trainer.strategy.init_args.timeout", TIMEOUT]
        self.folder, self.log, self.pid1, self.lost_at = folder, folder / "rank0.log", 0, 0.0
        # output to a file, not a pipe: a frozen rank 1 inherits it and would hold a pipe open after rank 0 exits
        with open(self.log, "w") as out:
            self.rank0 = subprocess.Popen(cmd, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT)

    def lose_rank_1(self, sig: signal.Signals) -> None:
        """Send ``sig`` to rank 1 once both ranks train."""
        deadline = time.monotonic() + 180
        while not all((self.folder / f"rank{r}.pid").is_file() for r in (0, 1)):
            assert self.rank0.poll() is None, f"the run ended before training:\n{self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no training step after 180 s:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.2)
        self.pid1 = int((self.folder / "rank1.pid").read_text())
        os.kill(self.pid1, sig)
        self.lost_at = time.monotonic()

    def finish(self, sig: signal.Signals) -> tuple[int, float, str, int]:
        """Wait for rank 0's exit: (its exit code, seconds from the signal to its exit, its output, rank 1's pid)."""
        try:
            code = self.rank0.wait(timeout=max(1.0, self.lost_at + BOUND_S + 60 - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        elapsed = time.monotonic() - self.lost_at
        settle = time.monotonic() + 10  # rank 0's launcher kills the ranks it started when it fails
        while code is not None and time.monotonic() < settle and process_alive(self.pid1):
            time.sleep(0.2)
        LEFT_BEHIND[sig] = self.pid1 if process_alive(self.pid1) else None
        self.stop()
        assert code is not None, (f"rank 0 still ran {BOUND_S + 60:.0f}s after rank 1 was lost:\n"
                                  f"{self.log.read_text()[-3000:]}")
        return code, elapsed, self.log.read_text(), self.pid1

    def stop(self) -> None:
        if self.rank0.poll() is None:
            self.rank0.kill()
        self.rank0.wait()
        if self.pid1:
            _end_process(self.pid1)


_TESTS = {signal.SIGKILL: "test_rank_killed_mid_run_is_named_and_rank_0_stops",
          signal.SIGSTOP: "test_rank_frozen_mid_run_is_named_after_the_collective_timeout"}


@pytest.fixture(scope="module")
def lost_rank_1(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> dict[signal.Signals, tuple[int, float, str, int] | Exception]:
    """Both runs, each rank 1 lost its way; the result (or the failure) of each for its test. The frozen run waits
    out the collective timeout with rank 0 blocked in a collective and rank 1 stopped, the cores idle: the killed
    run (its own world, store and ports) runs from start to end in that wait, rather than after it. Only the runs
    of the tests selected are made."""
    here = request.node.path
    selected = {item.name.split("[")[0] for item in request.session.items if item.path == here}
    wanted = [sig for sig, name in _TESTS.items() if name in selected]
    results: dict[signal.Signals, tuple[int, float, str, int] | Exception] = {}
    frozen = _Run(tmp_path_factory.mktemp("rank_frozen")) if signal.SIGSTOP in wanted else None
    try:
        if frozen is not None:
            try:
                frozen.lose_rank_1(signal.SIGSTOP)
            except Exception as err:  # the frozen test reports it
                results[signal.SIGSTOP] = err
                frozen.stop()
                frozen = None
        if signal.SIGKILL in wanted:
            killed = _Run(tmp_path_factory.mktemp("rank_killed"))
            try:
                killed.lose_rank_1(signal.SIGKILL)
                results[signal.SIGKILL] = killed.finish(signal.SIGKILL)
            except Exception as err:  # the killed test reports it
                results[signal.SIGKILL] = err
            finally:
                killed.stop()
        if frozen is not None:
            try:
                results[signal.SIGSTOP] = frozen.finish(signal.SIGSTOP)
            except Exception as err:  # the frozen test reports it
                results[signal.SIGSTOP] = err
    finally:
        if frozen is not None:
            frozen.stop()
    return results


def _outcome(results: dict[signal.Signals, tuple[int, float, str, int] | Exception],
             sig: signal.Signals) -> tuple[int, float, str, int]:
    result = results[sig]
    if isinstance(result, Exception):
        raise result
    return result


LEFT_BEHIND: dict[signal.Signals, int | None] = {}
"""Rank 1's pid when it still existed 10 s after rank 0 exited, else None."""


def _end_process(pid: int) -> None:
    for sig in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


def _message(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("lightning-parallel: rank 1 ")]
    assert lines, f"no line names rank 1:\n{output[-4000:]}"
    return lines[0]


def test_rank_killed_mid_run_is_named_and_rank_0_stops(lost_rank_1: dict) -> None:
    code, elapsed, output, pid1 = _outcome(lost_rank_1, signal.SIGKILL)
    line = _message(output)
    print(f"rank 1 (pid {pid1}) killed -> rank 0 exited with code {code} after {elapsed:.1f}s:\n{line}")
    assert code != 0
    assert elapsed < BOUND_S
    assert f"rank 1 (pid {pid1} " in line and "is gone (" in line
    assert line.endswith("this rank (0) stops")


@pytest.mark.slow  # waits for the collective timeout: ~40 s
def test_rank_frozen_mid_run_is_named_after_the_collective_timeout(lost_rank_1: dict) -> None:
    code, elapsed, output, pid1 = _outcome(lost_rank_1, signal.SIGSTOP)
    line = _message(output)
    print(f"rank 1 (pid {pid1}) frozen -> rank 0 exited with code {code} after {elapsed:.1f}s "
          f"(collective timeout {TIMEOUT}):\n{line}")
    assert code != 0
    assert elapsed < BOUND_S
    assert f"rank 1 (pid {pid1} " in line and "no heartbeat for" in line
    assert "Timed out" in line or "timeout" in line.lower()
    assert line.endswith("this rank (0) stops")
    ps = subprocess.run(["ps", "-o", "pid,stat,cmd", "-p", str(pid1)], capture_output=True, text=True).stdout
    print(f"ps -p {pid1} after rank 0 exited:\n{ps.strip()}")
    assert LEFT_BEHIND[signal.SIGSTOP] is None, f"the frozen rank 1 (pid {pid1}) was left behind:\n{ps}"


SEGFAULT_SCRIPT = """\
import ctypes, faulthandler, sys
import lightning.pytorch as pl, torch
from lightning_parallel.strategies import LPDDPStrategy

class Crash(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            ctypes.string_at(0)  # SIGSEGV in rank 1
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

if __name__ == "__main__":
    assert not faulthandler.is_enabled()  # nothing for a forked rank to inherit: the launcher enables it
    trainer = pl.Trainer(strategy=LPDDPStrategy(start_method=sys.argv[1]), accelerator="cpu", devices=2,
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Crash(), torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=2))
"""


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_segfaulting_rank_prints_the_python_stack_of_its_threads(tmp_path: Path, start_method: str) -> None:
    (tmp_path / "crash.py").write_text(SEGFAULT_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    for key in ("PYTHONFAULTHANDLER", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    run = subprocess.run([sys.executable, "crash.py", start_method], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    err = run.stderr
    assert run.returncode != 0 and "terminated with signal SIGSEGV" in err, err[-3000:]
    assert "Fatal Python error: Segmentation fault" in err, err[-3000:]
    stack = err[err.index("Fatal Python error: Segmentation fault"):]
    assert "in training_step" in stack and "Current thread" in stack, stack[:3000]
    assert "\nThread 0x" in stack, stack[:3000]  # the rank's other threads too (the watchdog's heartbeat)


# ---------------------------------------------------------------------- the look-up alone, in this process (fast)
def _watchdog(rank: int = 0) -> tuple[RankWatchdog, Any]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    dog = RankWatchdog(rank=rank, world_size=2, store=client, prefix="t", interval=0.05,
                       address=f"127.0.0.1:{server.port}")
    dog.begin()
    return dog, server


def _pretend_rank_1(dog: RankWatchdog, pid: int) -> None:
    dog.store.set(dog.key("info", 1), json.dumps({"host": dog.host, "pid": pid, "namespace": dog.namespace}))


def test_lookup_names_a_dead_pid_an_earlier_failure_and_a_silent_peer() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dog, _server = _watchdog()
    try:
        _pretend_rank_1(dog, dead.pid)
        line = dog.diagnose(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
        assert line is not None and line.startswith(f"lightning-parallel: rank 1 (pid {dead.pid} on ")
        assert "is gone (its process no longer exists): rank 0 got RuntimeError: Connection closed" in line
        assert line.endswith("; this rank (0) stops")
    finally:
        dog.end()

    dog, _server = _watchdog()  # rank 1 alive (this process) but it reported its error first
    try:
        _pretend_rank_1(dog, os.getpid())
        dog.store.set(dog.key("exit", 1), json.dumps({"seq": 0, "reason": "ValueError: boom"}))
        line = dog.diagnose(RuntimeError("Connection reset by peer"))
        assert line is not None and "rank 1 (pid" in line and "failed first (with ValueError: boom)" in line
    finally:
        dog.end()

    dog, _server = _watchdog()  # rank 1 alive, but no heartbeat: a frozen rank or a host that dropped off
    try:
        _pretend_rank_1(dog, os.getpid())
        line = dog.diagnose(RuntimeError("Timed out waiting 20000ms for recv operation to complete"))
        assert line is not None and "no heartbeat for 2s and no error reported" in line
    finally:
        dog.end()

    dog, _server = _watchdog()  # this rank's own bug (not a failed collective): no waiting, nobody blamed
    try:
        _pretend_rank_1(dog, os.getpid())
        assert dog.diagnose(ValueError("my own bug")) is None
    finally:
        dog.end()


def test_lookup_when_the_store_host_is_gone() -> None:
    dog, server = _watchdog(rank=1)
    dog.root = None
    del server  # the store's host goes away
    gc.collect()
    line = dog.diagnose(RuntimeError("Connection reset by peer"))
    dog.end()
    assert line is not None and line.startswith("lightning-parallel: rank 0, which hosts the store, is gone")
    assert line.endswith("this rank (1) stops")
