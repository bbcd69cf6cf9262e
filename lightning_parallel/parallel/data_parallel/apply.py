"""Parallel apply: run one function per replica in threads of this process (the forward compute of DP).

Replica 0 runs on the calling thread, replicas ``1..N-1`` on a thread pool. Autograd, inference mode and autocast
are thread-local in PyTorch, so each worker re-enters the caller's grad mode, inference mode and autocast state
(as torch's ``parallel_apply`` does), and, on an accelerator, the replica's device. The threads share the GIL:
PyTorch releases it inside kernels, so large operators overlap and Python overhead does not.

On CPU every replica thread can be given an intra-op thread count (``cpu_threads``) so that ``N`` replicas do not
oversubscribe the cores. It is set once per thread, when the pool starts (:func:`start_workers`), while no replica
runs, and each worker's first parallel kernel (torch's lazy per-thread set-up, which calls ``set_num_threads``
again) runs then too. ``torch.set_num_threads`` also touches process-wide state (MKL's threads, the pthreadpool,
oneDNN's computation cache): called from one thread while another runs kernels, it is a race. A CI run crashed with
SIGSEGV in the first step's embedding, on both replica threads, when each thread set its count as it entered the
step; this is the likely cause (not reproduced on demand).

Every replica runs to completion; the first failure (in replica order) is re-raised with a note naming the replica.
No Lightning import here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = ["ThreadState", "parallel_apply", "start_workers"]

T = TypeVar("T")


@dataclass(frozen=True)
class ThreadState:
    """The thread-local PyTorch state a replica thread must share with its caller."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]

    @classmethod
    def capture(cls, device_types: Sequence[str]) -> ThreadState:
        autocast = tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in sorted(set(
            device_types)))
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)

    @contextlib.contextmanager
    def enter(self, device: torch.device) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference_mode))
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, enabled, dtype in self.autocast:
                if enabled:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
            if device.type != "cpu" and device.index is not None:
                stack.enter_context(torch.get_device_module(device.type).device(device.index))
            yield


def _set_threads(count: int | None) -> None:
    """Set this thread's intra-op count (None: leave it) and run torch's lazy per-thread set-up now.

    A thread's first parallel kernel calls ``set_num_threads`` itself (with the process-wide count) when the count was
    ever set; run here, while no replica runs, it cannot race with another thread's kernels."""
    if count is not None:
        torch.set_num_threads(count)
    torch.get_num_threads()
    torch.ones(1 << 16).add_(1)  # above the grain size: a parallel_for, whatever the count


def start_workers(workers: int, cpu_threads: int | None = None) -> ThreadPoolExecutor:
    """A pool of ``workers`` started threads, each with ``cpu_threads`` intra-op threads (None: leave as is).

    The calling thread's count is set first, then every worker's, one task per worker held at a barrier (the pool
    starts threads lazily and reuses an idle one when it can), all before any replica runs; each worker also runs
    torch's lazy per-thread set-up then, even when its count is left as is. Callers then run their
    replica 0 on the calling thread and the others on this pool (:func:`parallel_apply`).
    """
    if workers < 1:
        raise ValueError(f"start_workers needs at least one worker, got {workers}.")
    if cpu_threads is not None:
        _set_threads(cpu_threads)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lp_dp")
    started = threading.Barrier(workers, timeout=60)

    def start() -> None:
        started.wait()
        _set_threads(cpu_threads)

    for future in [pool.submit(start) for _ in range(workers)]:
        future.result()
    return pool


def parallel_apply(fn: Callable[[int], T], devices: Sequence[torch.device], *,
                   executor: ThreadPoolExecutor | None = None, cpu_threads: int | None = None) -> list[T]:
    """``[fn(0), fn(1), ..., fn(N-1)]`` with ``fn(i)`` on ``devices[i]``, concurrently.

    Args:
        fn: the work of replica ``i`` (e.g. its ``training_step`` on its slice).
        devices: one device per replica.
        executor: a pool with at least ``N - 1`` workers, from :func:`start_workers`; a temporary one when None.
        cpu_threads: intra-op threads per thread of the temporary pool (None: leave as is); a given ``executor``
            keeps the counts it was started with.
    """
    n = len(devices)
    if n == 0:
        return []
    state = ThreadState.capture([d.type for d in devices])

    def run(i: int) -> T:
        with state.enter(devices[i]):
            return fn(i)

    if n == 1:
        return [run(0)]
    own = executor is None
    pool = executor or start_workers(n - 1, cpu_threads if devices[0].type == "cpu" else None)
    try:
        futures: list[Future[T]] = [pool.submit(run, i) for i in range(1, n)]
        results: list[Any] = [None] * n
        errors: list[tuple[int, BaseException]] = []
        try:
            results[0] = run(0)
        except BaseException as err:  # wait for the workers before raising
            errors.append((0, err))
        for i, future in enumerate(futures, start=1):
            try:
                results[i] = future.result()
            except BaseException as err:
                errors.append((i, err))
    finally:
        if own:
            pool.shutdown(wait=True)
    if errors:
        index, first = errors[0]
        if hasattr(first, "add_note"):
            first.add_note(f"(raised in data-parallel replica {index} on {devices[index]})")
        raise first
    return results
