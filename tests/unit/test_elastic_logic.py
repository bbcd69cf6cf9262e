"""The pure logic of elastic training: the accumulation arithmetic and its refusal, the loop counters moved to another
accumulation, the data position in samples, the launch scripts' elastic commands, and the watchdog's peer
monitoring (one process, a local store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from lightning_parallel.callbacks.global_batch import GlobalBatch
from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.data.resumable import ResumableDataModuleMixin
from lightning_parallel.elastic import accumulation_for, elastic_world
from lightning_parallel.parallel.faults.watchdog import RankWatchdog

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_SH = ROOT / "scripts" / "launch" / "torchrun.sh"
SLURM_SBATCH = ROOT / "scripts" / "launch" / "slurm.sbatch"


def test_accumulation_keeps_the_global_batch_or_refuses_with_the_arithmetic() -> None:
    assert accumulation_for(16, 4, 4) == 1
    assert accumulation_for(16, 4, 2) == 2
    assert accumulation_for(16, 4, 1) == 4
    with pytest.raises(LayoutError) as err:
        accumulation_for(16, 4, 3)
    text = str(err.value)
    assert "parallel.global_batch_size=16 cannot be kept on this world" in text
    assert "16 / (4 x 3) = 1.333" in text and "16 % 12 = 4" in text
    assert "dp in [1, 2, 4]" in text and "a multiple of 12" in text
    with pytest.raises(LayoutError, match="positive integer"):
        ParallelConfig(global_batch_size=0)
    assert ParallelConfig.from_dict({"global_batch_size": 32}).global_batch_size == 32


def test_elastic_world_is_read_from_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                       "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3"}.items():
        monkeypatch.setenv(key, value)
    world = elastic_world()
    assert (world.nodes, world.devices_per_node, world.node_rank, world.restart) == (3, 2, 1, 2)
    assert world.describe() == "3 node(s) x 2 rank(s) = world 6 (restart 2 of 3)"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(LayoutError, match=r"torchrun\.sh --elastic"):
        elastic_world()


def _checkpoint(done: int, accumulate: int, dp: int) -> dict[str, Any]:
    counters = {"ready": done, "started": done, "processed": done, "completed": done - 1}
    return {"callbacks": {"GlobalBatch": {"global_batch_size": 16, "micro_batch_size": 4, "data_parallel_size": dp,
                                          "accumulate_grad_batches": accumulate}},
            "loops": {"fit_loop": {"epoch_loop.batch_progress": {"current": dict(counters),
                                                                 "total": {k: v + 100 for k, v in counters.items()}}}}}


def test_loop_counters_move_to_the_new_accumulation() -> None:
    trainer = SimpleNamespace(is_global_zero=False)
    checkpoint = _checkpoint(done=12, accumulate=1, dp=4)  # step 12 under dp 4: 12 batches of the epoch
    GlobalBatch(16, 4, 2, 2).on_load_checkpoint(trainer, None, checkpoint)  # type: ignore[arg-type]
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["current"] == {"ready": 24, "started": 24, "processed": 24, "completed": 23}  # 12 steps x 2
    assert progress["total"]["processed"] == 124
    back = _checkpoint(done=24, accumulate=2, dp=2)  # and back to 4 ranks
    GlobalBatch(16, 4, 4, 1).on_load_checkpoint(trainer, None, back)  # type: ignore[arg-type]
    assert back["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 12
    same = _checkpoint(done=7, accumulate=2, dp=2)
    GlobalBatch(16, 4, 2, 2).on_load_checkpoint(trainer, None, same)  # type: ignore[arg-type]
    assert same["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 7  # untouched
    with pytest.raises(LayoutError, match="in the middle of an optimizer step"):
        GlobalBatch(16, 4, 4, 1).on_load_checkpoint(trainer, None, _checkpoint(7, 2, 2))  # type: ignore[arg-type]


class _Data(ResumableDataModuleMixin):
    def __init__(self, processed: int) -> None:
        progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
        self.trainer = SimpleNamespace(current_epoch=0, world_size=1,
                                       fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))


def test_the_data_position_in_samples_maps_onto_another_data_parallel_size() -> None:
    dataset = list(range(400))
    saving = _Data(processed=6)
    saving.resumable_sampler(dataset, 4, shuffle=False)  # this run's geometry: batch 4 on 1 replica
    saving._lp_geometry = (4, 4)  # as if 4 replicas: step 6 = 6 x 16 samples
    state = saving.state_dict()
    assert state == {"epoch": 0, "batches": 6, "samples": 96}
    resuming = _Data(processed=0)
    resuming.load_state_dict(state)
    sampler = resuming.resumable_sampler(dataset, 4, shuffle=False)  # 1 replica now: skip all 96 samples
    assert next(iter(sampler)) == 96
    old = _Data(processed=0)
    old.load_state_dict({"epoch": 0, "batches": 6})  # a checkpoint without samples: batches x batch size
    assert next(iter(old.resumable_sampler(dataset, 4, shuffle=False))) == 24


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LP_", "TORCHELASTIC_"))}
    env.update({"LP_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)})
    return env


def test_torchrun_elastic_command() -> None:
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    dry = subprocess.run(["bash", str(TORCHRUN_SH), "--dry-run", "--elastic", "1:4", "--nproc-per-node", "8",
                          "--master-addr", "node0", "--rdzv-conf", "is_host=1", recipe, "--trainer.max_steps", "9"],
                         capture_output=True, text=True, env=_env(), check=True).stdout
    assert dry.startswith("LP_ELASTIC=1 LP_WATCHDOG_PEER_TIMEOUT=15 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ")
    for part in ("--nnodes 1:4", "--nproc-per-node 8", "--max-restarts 3", "--rdzv-backend c10d",
                 "--rdzv-endpoint node0:29500", "is_host=1", "--trainer.max_steps 9 --ckpt_path last"):
        assert part in dry, (part, dry)
    assert "--trainer.num_nodes" not in dry and "--node-rank" not in dry  # from the world each restart gets
    given = subprocess.run(["bash", str(TORCHRUN_SH), "--dry-run", "--elastic", "2:2", recipe, "--ckpt_path",
                            "x.ckpt"], capture_output=True, text=True, env=_env(), check=True).stdout
    assert "--ckpt_path x.ckpt" in given and "--ckpt_path last" not in given
    bad = subprocess.run(["bash", str(TORCHRUN_SH), "--elastic", "3:2", recipe], capture_output=True, text=True,
                         env=_env())
    assert bad.returncode == 2 and "need 1 <= MIN <= MAX" in bad.stderr


@pytest.mark.parametrize("srun_exit", [0, 1])
def test_slurm_elastic_resumes_and_requeues_a_failed_run(tmp_path: Path, srun_exit: int) -> None:
    """``slurm.sbatch --elastic`` under stand-in ``srun`` / ``scontrol``: the fit gets the allocation's nodes and
    ``--ckpt_path last``; a failed run requeues the job while requeues are left."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", f'echo "srun $*" >> {tmp_path}/calls\nexit {srun_exit}\n'),
                       ("scontrol", f'echo "scontrol $*" >> {tmp_path}/calls\n')):
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    env = {**_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "SLURM_NNODES": "3",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1",
           "SLURM_SUBMIT_DIR": str(ROOT)}
    run = subprocess.run(["bash", str(SLURM_SBATCH), "--elastic", str(ROOT / "recipes" / "quickstart.yaml")],
                         env=env, capture_output=True, text=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert run.returncode == srun_exit
    assert "--trainer.num_nodes 3 --trainer.devices 4 --ckpt_path last" in calls[0]
    assert ("scontrol requeue 77" in calls) == bool(srun_exit)
    if srun_exit:
        assert "requeueing job 77 (restart 2 of 3)" in run.stderr


def _watchdog(rank: int, peer_timeout: float) -> tuple[RankWatchdog, Any, list[str]]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    lost: list[str] = []
    dog = RankWatchdog(rank=rank, world_size=4, store=client, prefix="t", interval=0.05, node=0,
                       address=f"127.0.0.1:{server.port}", peer_timeout=peer_timeout, on_peer_lost=lost.append)
    for r, node in ((1, 0), (2, 1), (3, 1)):
        client.set(dog.key("info", r), json.dumps({"host": "node-b" if node else dog.host, "pid": 10_000 + r,
                                                   "namespace": "elsewhere", "node": node}))
    return dog, server, lost


def test_peer_monitoring_ends_the_rank_whose_watched_peer_went_silent() -> None:
    dog, _server, lost = _watchdog(rank=1, peer_timeout=0.5)  # rank 1 watches rank 2 (node 1)
    try:
        dog.begin()
        deadline = time.monotonic() + 10.0  # rank 2 never beats: reported after the 0.5 s peer timeout
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost, "the silent peer was not reported"
        line = lost[0]
        print(f"\n{line}")
        assert line.startswith("lightning-parallel: node 1 (ranks 2, 3 on node-b) is gone (rank 2, pid 10002: no "
                               "heartbeat for ")
        assert "LP_WATCHDOG_PEER_TIMEOUT=0.5): rank 1 stops now" in line
    finally:
        dog.end()

    dog, _server, lost = _watchdog(rank=1, peer_timeout=0.5)  # a peer that beats, or said it stopped, is not lost
    try:
        dog.store.set(dog.key("exit", 2), json.dumps({"seq": 1, "reason": "finished"}))
        dog.begin()
        time.sleep(1.5)
        assert lost == []
    finally:
        dog.end()

    dog, _server, lost = _watchdog(rank=1, peer_timeout=0.0)  # off (the default): nothing is judged
    try:
        dog.begin()
        time.sleep(1.0)
        assert lost == []
    finally:
        dog.end()


def _global_batches(n: int, b: int, dp: int, accumulate: int) -> list[set[int]]:
    """The samples of each optimizer step of one epoch of ResumableSampler, joined over ranks and micro-batches."""
    from lightning_parallel.data.resumable import ResumableSampler

    ranks = [list(ResumableSampler(range(n), num_replicas=dp, rank=r, shuffle=True, seed=5, multiple=b * accumulate))
             for r in range(dp)]
    micro = [[rank[i:i + b] for i in range(0, len(rank) - b + 1, b)] for rank in ranks]  # drop_last=True
    steps = len(micro[0]) // accumulate + (1 if len(micro[0]) % accumulate else 0)  # Lightning steps on the last
    return [{i for r in micro for m in r[s * accumulate:(s + 1) * accumulate] for i in m} for s in range(steps)]


def test_an_epoch_is_the_same_global_batches_on_any_data_parallel_size_and_accumulation() -> None:
    four = _global_batches(1000, 4, dp=4, accumulate=1)  # 62 steps of 16 (8 samples dropped)
    two = _global_batches(1000, 4, dp=2, accumulate=2)
    one = _global_batches(1000, 4, dp=1, accumulate=4)
    assert len(four) == len(two) == len(one) == 62
    assert four == two == one and all(len(s) == 16 for s in four)
