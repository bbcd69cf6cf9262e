"""Multi-node launch scripts on one machine: ``scripts/launch/torchrun.sh`` as two "nodes" of one rank each equals
one device, and ``scripts/launch/slurm.sbatch`` runs under a stand-in ``srun`` that sets what SLURM's would.

The 2-"node" run: two ``torchrun --nnodes 2 --nproc-per-node 1 --node-rank {0,1}`` launches (static rendezvous on
127.0.0.1, a free port), ``lp_ddp`` with dp=2 over the two nodes, per-rank batch B; the reference: one process,
``--trainer.devices 1``, per-rank batch 2B (the same global batch). The data are the same: Lightning gives both runs
a ``DistributedSampler`` seeded with the run's seed, and rank r of N draws positions r, r+N, ... of the same
permutation, so the two ranks' batches of a step together are the one device's batch of that step. The model is the
tiny GPT with SGD + momentum (its steps scale with the gradient: a sum instead of a mean over ranks would show).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from lightning_parallel.checkpoint import full_state_dict
from tests.helpers import launch_env

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_SH = ROOT / "scripts" / "launch" / "torchrun.sh"
SLURM_SBATCH = ROOT / "scripts" / "launch" / "slurm.sbatch"
STEPS = 4
BATCH = 4  # per rank in the 2-rank run; the one-device run takes 2 x BATCH

RECIPE = """\
seed_everything: 1234
model:
  class_path: tests.helpers.SGDGPT
  init_args: {{n_layer: 2, n_head: 2, n_embd: 32, block_size: 16, vocab_size: 256, lr: 1.0e-3, warmup_steps: 2}}
trainer:
  accelerator: cpu
  strategy: lp_ddp
  devices: 2
  max_steps: {steps}
  limit_val_batches: 0
  num_sanity_val_steps: 0
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {ckpt}, save_last: true, save_top_k: 0}}
data:
  class_path: lightning_parallel.data.TextDataModule
  init_args: {{block_size: 16, batch_size: {batch}}}
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _recipe(folder: Path, batch: int) -> Path:
    folder.mkdir(parents=True)
    path = folder / "recipe.yaml"
    path.write_text(RECIPE.format(steps=STEPS, ckpt=folder / "ckpt", batch=batch))
    return path


def _tail(text: str, n: int = 3000) -> str:
    return text[-n:]


def test_two_nodes_by_torchrun_equal_one_device(tmp_path: Path) -> None:
    two = _recipe(tmp_path / "two_nodes", BATCH)
    one = _recipe(tmp_path / "one_device", 2 * BATCH)
    port = free_port()
    start = time.monotonic()
    nodes = [
        subprocess.Popen(["bash", str(TORCHRUN_SH), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
                          "--master-addr", "127.0.0.1", "--master-port", str(port), str(two)],
                         cwd=two.parent, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]
    # the reference run meanwhile (one process: no port shared with the launches)
    ref = subprocess.run([sys.executable, "-m", "lightning_parallel", "fit", "--config", str(one),
                          "--trainer.devices", "1"], cwd=one.parent, env=launch_env(), capture_output=True, text=True,
                         timeout=180)
    outs = []
    try:
        for node in nodes:
            outs.append(node.communicate(timeout=180)[0])
    finally:
        for node in nodes:
            node.kill()
    print(f"2 nodes + reference: {time.monotonic() - start:.1f}s wall")
    for rank, (node, out) in enumerate(zip(nodes, outs, strict=True)):
        assert node.returncode == 0, f"node {rank}:\n{_tail(out)}"
    assert ref.returncode == 0, _tail(ref.stdout + ref.stderr)
    assert "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in outs[0]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in outs[1]
    assert f"lp_ddp (dp=2 x pp=1 x tp=1 = 2 ranks) | 2 process(es) | {STEPS} steps" in outs[0]
    # torchrun started the ranks, Lightning none: one rank per "node"
    assert all(out.count("Initializing distributed:") == 1 for out in outs)

    got = full_state_dict(two.parent / "ckpt" / "last.ckpt")
    want = full_state_dict(one.parent / "ckpt" / "last.ckpt")
    assert got.keys() == want.keys()
    diff = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
    print(f"2 nodes x 1 rank (torchrun) vs 1 device, {STEPS} SGD steps: max |weight difference| = {diff:.3e}")
    assert diff < 1e-5


def test_slurm_sbatch_under_a_stand_in_srun(tmp_path: Path) -> None:
    """``slurm.sbatch`` as ``sbatch --nodes 1 --ntasks-per-node 2`` would run it: a stand-in ``srun`` starts the
    tasks with the SLURM_* variables Lightning's SLURMEnvironment reads; Lightning starts no process itself."""
    recipe = _recipe(tmp_path / "slurm", BATCH)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(
        "#!/usr/bin/env bash\n"
        "n=$(( SLURM_NNODES * SLURM_NTASKS_PER_NODE )); pids=()\n"
        "for ((i = 0; i < n; i++)); do\n"
        "  SLURM_NTASKS=$n SLURM_PROCID=$i SLURM_LOCALID=$(( i % SLURM_NTASKS_PER_NODE ))"
        " SLURM_NODEID=$(( i / SLURM_NTASKS_PER_NODE )) \"$@\" &\n"
        "  pids+=($!)\n"
        "done\n"
        "rc=0; for p in \"${pids[@]}\"; do wait \"$p\" || rc=$?; done; exit $rc\n"
    )
    srun.chmod(0o755)
    env = launch_env(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", SLURM_NNODES="1",
               SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="127.0.0.1", SLURM_NODELIST="127.0.0.1",
               SLURM_JOB_NAME="lp-test", SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(ROOT),
               MASTER_PORT=str(free_port()))
    proc = subprocess.run(["bash", str(SLURM_SBATCH), str(recipe)], cwd=recipe.parent, env=env,
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _tail(out)
    assert "SLURM auto-requeueing enabled" in out  # SLURMEnvironment was detected
    assert out.count("Initializing distributed:") == 2
    assert f"lp_ddp (dp=2 x pp=1 x tp=1 = 2 ranks) | 2 process(es) | {STEPS} steps" in out
    assert (recipe.parent / "ckpt" / "last.ckpt").is_file()


def test_launch_scripts_parse_and_refuse_devices() -> None:
    for script in (TORCHRUN_SH, SLURM_SBATCH):
        subprocess.run(["bash", "-n", str(script)], check=True)
    help_text = subprocess.run(["bash", str(TORCHRUN_SH), "--help"], capture_output=True, text=True, check=True)
    assert "--nproc-per-node" in help_text.stdout and "NODE_RANK" in help_text.stdout
    dry = subprocess.run(["bash", str(TORCHRUN_SH), "--dry-run", "--nnodes", "2", "--nproc-per-node", "4",
                          "--node-rank", "1", str(ROOT / "recipes" / "quickstart.yaml")],
                         capture_output=True, text=True, env=launch_env(), check=True)
    assert "--trainer.num_nodes 2 --trainer.devices 4" in dry.stdout and "--node-rank 1" in dry.stdout
    bad = subprocess.run(["bash", str(TORCHRUN_SH), str(ROOT / "recipes" / "quickstart.yaml"),
                          "--trainer.devices", "3"], capture_output=True, text=True, env=launch_env())
    assert bad.returncode == 2 and "use --nproc-per-node / --nnodes" in bad.stderr
