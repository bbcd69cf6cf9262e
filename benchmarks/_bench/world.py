"""One run: a fresh world of ranks, started the way torchrun starts them, each writing its result to a file."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .anchors import HAND
from .cases import Case
from .counting import CommCount
from .timing import Ctx, batches_per_step
from .trainer import run_trainer


def _rss_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def _rank_main(local_rank: int, job: dict[str, Any]) -> None:
    """One rank of one run: set the torchrun-style environment, create the process group, run, write the result."""
    a, case, role, world = job["args"], job["case"], job["role"], job["world"]
    out_file = Path(job["folder"]) / f"rank{local_rank}.json"
    start_rss = _rss_kb("VmRSS") * 1024 if a.device == "cpu" else 0
    try:
        import logging
        import warnings

        from lightning_parallel.parallel.faults.watchdog import enable_fault_handler

        enable_fault_handler()  # a crashing rank prints its threads' Python stacks
        warnings.filterwarnings("ignore")
        for name in ("lightning.pytorch", "lightning.fabric", "lightning_parallel", "DeepSpeed"):
            logging.getLogger(name).setLevel(logging.ERROR)
        torch.set_num_threads(a.threads)
        distributed = case.processes is None  # a process per rank, even one (``--dp 1``); lp_dp: none
        if distributed:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]), WORLD_SIZE=str(world),
                              RANK=str(local_rank), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world),
                              GROUP_RANK="0", ROLE_RANK=str(local_rank), ROLE_WORLD_SIZE=str(world),
                              NODE_RANK="0", TORCHELASTIC_RUN_ID=f"bench-{job['port']}")
        if a.device == "cuda":
            device = torch.device("cuda", local_rank)
            torch.get_device_module(device).set_device(device)
        else:
            device = torch.device("cpu")
        if distributed:
            dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=local_rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=a.timeout),
                                    device_id=device if a.device == "cuda" else None)
        from lightning_parallel.parallel.dims import ParallelDims

        dims = ParallelDims(dp=case.dp if case.processes is None else 1, pp=case.pp, tp=case.tp, world_size=world,
                            dp_shard=case.shard, cp=case.cp if case.processes is None else 1)
        counter = None
        if job["count"]:
            counter = CommCount(local_rank, dims)
            counter.install()
        g = torch.Generator().manual_seed(1234)
        batches = (a.warmup + a.steps + 1) * batches_per_step(a)
        tokens = torch.randint(0, a.vocab, (a.batch * batches, a.seq + 1), generator=g)
        ctx = Ctx(a=a, case=case, role=role, rank=local_rank, world=world, device=device, dims=dims,
                  counter=counter, tokens=tokens, profile=job.get("profile"))
        result = HAND[case.key](ctx) if role == "torch" else run_trainer(ctx)
        if a.device == "cuda":
            result["peak_bytes"] = torch.get_device_module(device).max_memory_allocated(device)
        else:
            result["peak_bytes"] = _rss_kb("VmHWM") * 1024
            result["start_bytes"] = start_rss
        if counter is not None:
            result["comm"] = dict(counter.bytes)
            result["comm_calls"] = dict(counter.calls)
        result["coords"] = list(dims.coords(local_rank))
        out_file.write_text(json.dumps(result))
    except BaseException:
        out_file.write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.barrier()  # no rank tears down while another still talks to rank 0's store
                dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(a: argparse.Namespace, case: Case, role: str, *, count: bool,
              profile: str | None = None) -> dict[str, Any]:
    """Start ``case.world`` ranks for one run of ``role``; every rank's result (or the first error)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="lp_bench_") as folder:
        job = {"args": a, "case": case, "role": role, "world": case.world, "folder": folder,
               "port": _free_port(), "count": count, "profile": profile}
        method = a.start_method
        if method == "forkserver":  # the server imports these once; every rank forks from it, clean
            import multiprocessing

            multiprocessing.set_forkserver_preload(["torch", "lightning.pytorch", "lightning_parallel", "_bench.world"])
        try:
            mp.start_processes(_rank_main, args=(job,), nprocs=case.world, start_method=method, join=True)
        except Exception as err:
            ranks = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("rank*.json"))]
            errors = [r["error"] for r in ranks if "error" in r]
            return {"error": errors[0] if errors else f"{type(err).__name__}: {err}"}
        ranks = [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(case.world)]
    return {"ranks": ranks}


