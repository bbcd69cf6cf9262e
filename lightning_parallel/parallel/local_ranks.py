"""Run a function on N ranks on 127.0.0.1: the launcher of the multi-rank tests and of the planner's calibration.

Workers are started with ``torch.multiprocessing`` (``fork`` by default: the children inherit the already-imported
test process, which saves the ~5-10 s import of torch and Lightning per rank on a small machine), join a gloo
process group on a free local port with a timeout on every collective, run the function, and tear the group down in
``finally``. The parent waits with an overall deadline; the first rank that fails has its traceback raised in the
parent (as :class:`DistributedTestError`) and the other ranks are killed, so a failure cannot hang the suite.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_parallel.parallel.faults.watchdog import enable_fault_handler

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]


class DistributedTestError(RuntimeError):
    """A rank of :func:`run_distributed` failed, timed out or died; the message holds its traceback."""


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    queue: Any,
    collective_timeout_s: float,
    threads: int,
    device_type: str,
) -> None:
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
         "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
    )
    torch.set_num_threads(threads)
    enable_fault_handler()  # a SIGSEGV prints each thread's Python stack, not only the exit code below
    try:
        if device_type != "cpu":  # one accelerator per rank, chosen before the process group (NCCL's communicator)
            torch.get_device_module(device_type).set_device(rank)
        dist.init_process_group(
            "gloo" if device_type == "cpu" else dist.Backend.default_device_backend_map[device_type],
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        queue.put((rank, "ok", result))
    except BaseException:  # everything must reach the parent, KeyboardInterrupt included
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    start_method: str = "fork",
    threads_per_rank: int = 1,
    device_type: str = "cpu",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return the results by rank.

    ``device_type`` ``"cpu"``: gloo; an accelerator (``"cuda"``): rank ``r`` on device ``r`` with that device's
    default backend (NCCL), started with ``start_method="spawn"``.
    ``fn`` must be picklable for ``start_method='spawn'`` (a module-level function); results must be picklable.
    ``timeout_s`` bounds the whole run, ``collective_timeout_s`` every collective (gloo's own timeout).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    ctx: Any = mp.get_context(start_method)
    queue = ctx.SimpleQueue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, kwargs, queue, collective_timeout_s, threads_per_rank, device_type),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            if not queue.empty():
                rank, status, payload = queue.get()
                if status == "error":
                    raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{payload}")
                results[rank] = payload
                continue
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
            if dead and queue.empty():
                time.sleep(0.2)  # a dying rank may still be flushing its traceback
                if queue.empty():
                    codes = {i: procs[i].exitcode for i in dead}
                    raise DistributedTestError(f"rank(s) {dead} of {world_size} died without a result: {codes}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise DistributedTestError(f"timed out after {timeout_s:.0f}s waiting for rank(s) {missing}")
            time.sleep(0.01)
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]
