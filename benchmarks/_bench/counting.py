"""Bytes each rank sends per step, by axis: the benchmark's view of the library's one communication counter
(:class:`lightning_parallel.parallel.counters.CommCounter`, ring model), the same counter for all three variants."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning_parallel.parallel.counters import CommCounter


class CommCount:
    """Bytes this rank sends per axis while :attr:`active`, from every path a collective can take: the
    ``torch.distributed`` functions (wrapped for the whole process by :meth:`install`), DTensor's functional
    collectives (:meth:`functional`), DDP's buckets (:func:`python_allreduce_hook`) and lp_dp's in-process exchanges
    (:func:`book_exchanges`)."""

    def __init__(self, rank: int, dims: Any) -> None:
        self.counter = CommCounter(dims=dims, rank=rank)
        self.counter.enabled = False
        self._installed = contextlib.ExitStack()

    @property
    def active(self) -> bool:
        return self.counter.enabled

    @active.setter
    def active(self, on: bool) -> None:
        self.counter.enabled = on

    def install(self) -> None:
        """Wrap the ``torch.distributed`` functions for the rest of the process (counting while :attr:`active`)."""
        self._installed.enter_context(self.counter.counting(functional=False))

    @contextlib.contextmanager
    def functional(self) -> Iterator[None]:
        with self.counter.functional():
            yield

    @property
    def bytes(self) -> dict[str, float]:
        return self.counter.bytes_by_axis

    @property
    def calls(self) -> dict[str, int]:
        return {key: calls for key, (calls, _) in self.counter.by_axis_and_kind().items()}


def python_allreduce_hook(model: Any) -> None:
    """DDP's buckets through ``torch.distributed.all_reduce`` (counted), instead of the C++ default hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(None, default_hooks.allreduce_hook)


def book_exchanges(counter: CommCount, exchanges: CommCounter) -> None:
    """lp_dp's exchanges through device 0 (the strategy's exchange counter, one step) as the ``dp`` axis: one
    process has no collective to wrap, its engine counts every transfer it makes."""
    was, counter.active = counter.active, True  # booked after the counted step's window closed
    for s in exchanges.stats():
        counter.counter.record(s.kind, s.bytes_per_step, calls=s.calls, axis="dp")
    counter.active = was
