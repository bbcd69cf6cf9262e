"""``DataParallelEngine``: one process drives ``N`` devices with threads (DP), the five exchanges of a step.

Per step, all through device 0 (``docs/formulas.md``, "DP versus DDP: what moves per step")::

    forward   1 scatter   the batch (on device 0) is split by samples, slice i copied to device i
              2 replicate the latest parameters are copied from device 0 to devices 1..N-1 (autograd-aware)
                (apply)   replica i runs the step function on slice i, in thread i
              3 gather    outputs come to device 0; the loss is combined there, weighted by slice size
    backward  4 scatter   the loss gradient goes back to every device; each replica's backward runs
              5 reduce    parameter gradients are summed on device 0, into the master ``.grad``
    optimizer steps once, on device 0

On CUDA the devices are ``cuda:0..N-1``; on CPU the same code runs ``N`` replicas on the CPU (``devices`` may repeat),
with real copies for replicas ``1..N-1`` so the traffic is the same. Every exchange is counted in :attr:`counter`
(if given).

Two ways to run backward (``backward=``), equal in result:

* ``graph``: the replicas' parameters are autograd outputs of the master parameters (torch's DataParallel design);
  one ``loss.backward()`` walks every replica's graph and reduces in the replicate node. PyTorch runs CUDA
  backward work on one autograd thread per device, so the replicas' backward passes overlap on GPUs -- but a CPU
  backward call runs on the calling thread alone, so on CPU the replicas' backward passes would run one by one.
* ``threads``: each replica has its own leaf parameters; the gathered loss's backward sends each replica its loss
  gradient and runs the ``N`` backward passes in the engine's threads, then sums the leaf gradients into the
  master ``.grad``. ``auto`` (default) picks ``threads`` on CPU and ``graph`` elsewhere.

No Lightning import here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from lightning_parallel.parallel.counters import CommCounter

from .apply import parallel_apply, start_workers
from .gather import BackwardPlan, Reduction, gather
from .replicate import replicate, replicate_leaves
from .scatter import scatter

__all__ = ["BackwardMode", "DataParallelEngine", "data_parallel", "default_cpu_threads"]

M = TypeVar("M", bound=nn.Module)
BackwardMode = Literal["auto", "threads", "graph"]


def default_cpu_threads(replicas: int) -> int:
    """Intra-op threads per replica thread on CPU: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // max(1, replicas))


class DataParallelEngine:
    """Scatter, replicate, parallel apply and gather over ``devices`` (device 0 holds the master module).

    Args:
        devices: one device per replica; ``devices[0]`` holds the master module, the batch and the optimizer.
        reduction: how mean-like outputs combine (``mean``: weighted by slice size; ``sum``).
        cpu_threads: intra-op threads of each replica thread on CPU; None = :func:`default_cpu_threads`, 0 = leave
            PyTorch's setting alone.
        counter: where exchanges are counted; None (the default): nothing is counted.
        backward: ``threads``, ``graph`` or ``auto`` (threads on CPU, graph elsewhere); see the module docstring.
    """

    def __init__(self, devices: Sequence[torch.device | str], *, reduction: Reduction = "mean",
                 cpu_threads: int | None = None, counter: CommCounter | None = None,
                 backward: BackwardMode = "auto") -> None:
        if not devices:
            raise ValueError("DataParallelEngine needs at least one device.")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction={reduction!r} is not one of ['mean', 'sum'].")
        if backward not in ("auto", "threads", "graph"):
            raise ValueError(f"backward={backward!r} is not one of ['auto', 'threads', 'graph'].")
        self.devices = [torch.device(d) for d in devices]
        cpu = self.devices[0].type == "cpu"
        self.backward_mode: Literal["threads", "graph"] = ("threads" if cpu else "graph") if backward == "auto" \
            else backward
        self.reduction: Reduction = reduction
        self.cpu_threads = default_cpu_threads(len(self.devices)) if cpu_threads is None else (cpu_threads or None)
        self.counter = counter
        self._pool: ThreadPoolExecutor | None = None

    @property
    def root_device(self) -> torch.device:
        return self.devices[0]

    def _executor(self) -> ThreadPoolExecutor | None:
        if len(self.devices) > 1 and self._pool is None:
            self._pool = start_workers(len(self.devices) - 1,
                                       self.cpu_threads if self.devices[0].type == "cpu" else None)
        return self._pool

    def scatter(self, batch: Any) -> tuple[list[Any], list[int]]:
        """Exchange 1: per-replica slices of ``batch`` and their sample counts (fewer slices when B < N)."""
        return scatter(batch, self.devices, counter=self.counter)

    def replicate(self, module: M, replicas: int) -> tuple[list[M], BackwardPlan | None]:
        """Exchange 2 (and 5 in backward): ``replicas`` copies of ``module`` on the first devices, and the backward
        plan to pass to :meth:`gather` (``threads`` mode with gradients on; None otherwise)."""
        devices = self.devices[:replicas]
        if self.backward_mode == "threads" and torch.is_grad_enabled() and replicas > 1:
            leaves = replicate_leaves(module, devices, counter=self.counter)
            return leaves.replicas, BackwardPlan(leaves, self.apply, self.counter)
        return replicate(module, devices, counter=self.counter), None

    def apply(self, fn: Callable[[int], Any], replicas: int) -> list[Any]:
        """``fn(i)`` for each replica, in threads."""
        return parallel_apply(fn, self.devices[:replicas], executor=self._executor())

    def gather(self, outputs: Sequence[Any], sizes: Sequence[int], *, plan: BackwardPlan | None = None,
               force_reduce: bool = False, reduce_keys: tuple[str, ...] = ("loss",)) -> Any:
        """Exchange 3 (and 4 in backward): the outputs combined on device 0 (see :func:`.gather.gather`)."""
        return gather(outputs, sizes, self.root_device, reduction=self.reduction, reduce_keys=reduce_keys,
                      force_reduce=force_reduce, counter=self.counter, plan=plan)

    def run(self, module: M, batch: Any, step: Callable[[M, Any], Any], *, force_reduce: bool = False) -> Any:
        """One DP step: scatter ``batch``, replicate ``module``, ``step(replica_i, slice_i)`` in threads, gather."""
        slices, sizes = self.scatter(batch)
        replicas, plan = self.replicate(module, len(slices))
        outputs = self.apply(lambda i: step(replicas[i], slices[i]), len(slices))
        return self.gather(outputs, sizes, plan=plan, force_reduce=force_reduce)

    def close(self) -> None:
        """Stop the worker threads (the engine can still be used; they restart on demand)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def data_parallel(module: nn.Module, batch: Any, devices: Sequence[torch.device | str], *,
                  reduction: Reduction = "mean", counter: CommCounter | None = None,
                  backward: BackwardMode = "graph") -> Any:
    """``module(slice)`` on every device and the outputs combined on device 0 (a functional one-shot engine).

    Defaults to the ``graph`` backward mode: the result may be differentiated any time later (the ``threads``
    mode runs its backward on the engine's threads, which this function closes when it returns).
    """
    engine = DataParallelEngine(devices, reduction=reduction, counter=counter, cpu_threads=0, backward=backward)
    try:
        return engine.run(module, batch, lambda replica, piece: replica(piece))
    finally:
        engine.close()
