"""Parallel apply: run one function per replica in threads of this process (the forward compute of DP).

Replica 0 runs on the calling thread, replicas ``1..N-1`` on a thread pool. Autograd, inference mode and autocast
are thread-local in PyTorch, so each worker re-enters the caller's grad mode, inference mode and autocast state
(as torch's ``parallel_apply`` does), and, on an accelerator, the replica's device. On CPU every worker can be
given its own intra-op thread count (``cpu_threads``) so that ``N`` replicas do not oversubscribe the cores. The
threads share the GIL: PyTorch releases it inside kernels, so large operators overlap and Python overhead does not.

Every replica runs to completion; the first failure (in replica order) is re-raised with a note naming the replica.
No Lightning import here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = ["ThreadState", "parallel_apply"]

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
    def enter(self, device: torch.device, cpu_threads: int | None) -> Iterator[None]:
        if cpu_threads is not None and torch.get_num_threads() != cpu_threads:
            torch.set_num_threads(cpu_threads)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference_mode))
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, enabled, dtype in self.autocast:
                if enabled:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
            if device.type != "cpu" and device.index is not None:
                stack.enter_context(torch.get_device_module(device.type).device(device.index))
            yield


def parallel_apply(fn: Callable[[int], T], devices: Sequence[torch.device], *,
                   executor: ThreadPoolExecutor | None = None, cpu_threads: int | None = None) -> list[T]:
    """``[fn(0), fn(1), ..., fn(N-1)]`` with ``fn(i)`` on ``devices[i]``, concurrently.

    Args:
        fn: the work of replica ``i`` (e.g. its ``training_step`` on its slice).
        devices: one device per replica.
        executor: a pool with at least ``N - 1`` workers; a temporary one when None.
        cpu_threads: intra-op threads of each replica thread on CPU (None: leave as is).
    """
    n = len(devices)
    if n == 0:
        return []
    state = ThreadState.capture([d.type for d in devices])

    def run(i: int) -> T:
        with state.enter(devices[i], cpu_threads if devices[i].type == "cpu" else None):
            return fn(i)

    if n == 1:
        return [run(0)]
    own = executor is None
    pool = executor or ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="lp_dp")
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
