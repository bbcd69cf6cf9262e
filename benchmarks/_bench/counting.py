"""Bytes each rank sends per step, by axis, from every path a collective can take (ring model)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from lightning_parallel.parallel.zero.comm import ring_bytes

# name -> (kind, the argument holding the full-size buffer, how to get its bytes)
_PATCHED: dict[str, tuple[str, str, str]] = {
    "all_reduce": ("all_reduce", "tensor", "one"),
    "reduce": ("reduce", "tensor", "one"),
    "broadcast": ("broadcast", "tensor", "one"),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "one"),
    "reduce_scatter_single": ("reduce_scatter", "input", "one"),
    "_reduce_scatter_base": ("reduce_scatter", "input", "one"),
    "reduce_scatter": ("reduce_scatter", "input_list", "list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor", "one"),
    "all_gather_single": ("all_gather", "output_tensor", "one"),
    "_all_gather_base": ("all_gather", "output_tensor", "one"),
    "all_gather": ("all_gather", "tensor_list", "list"),
    "all_to_all_single": ("all_to_all", "input", "one"),
    "isend": ("send", "tensor", "p2p"),
    "send": ("send", "tensor", "p2p"),
}


class CommCount:
    """Bytes this rank sends per axis while :attr:`active` (ring model), from every path a collective can take."""

    def __init__(self, rank: int, dims: Any) -> None:
        self.rank, self.dims = rank, dims
        self.active = False
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._depth = threading.local()
        self._originals: dict[tuple[Any, str], Any] = {}

    # ---------------------------------------------------------------- axis of a group
    def axis_of_ranks(self, ranks: list[int]) -> str:
        if len(ranks) == self.dims.world_size and sum(self.dims.size(a) > 1 for a in ("dp", "pp", "tp")) > 1:
            return "world"
        for axis in ("dp", "pp", "tp"):
            if self.dims.size(axis) > 1 and sorted(ranks) == sorted(self.dims.group_ranks(axis, self.rank)):
                return axis
        return "other"

    def axis_of_peer(self, peer: int) -> str:
        mine, theirs = self.dims.coords(self.rank), self.dims.coords(peer)
        moved = [a for a in ("dp", "pp", "tp") if getattr(mine, a) != getattr(theirs, a)]
        return moved[0] if len(moved) == 1 else "other"

    def record(self, axis: str, kind: str, nbytes: float) -> None:
        self.bytes[axis] += nbytes
        self.calls[f"{axis}:{kind}"] += 1

    # ---------------------------------------------------------------- torch.distributed functions
    def install(self) -> None:
        """Wrap the ``torch.distributed`` functions (both module namespaces) for the rest of the process."""
        from torch.distributed import distributed_c10d as c10d

        wrapped: dict[str, Any] = {}
        for name in _PATCHED:
            fn = getattr(c10d, name, None)
            if fn is not None:
                wrapped[name] = self._wrap(name, fn)
        for module in (c10d, dist):
            for name, fn in wrapped.items():
                self._originals[(module, name)] = getattr(module, name, None)
                setattr(module, name, fn)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        kind, arg, how = _PATCHED[name]
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if self.active and depth == 0:
                try:
                    self._count(kind, arg, how, signature.bind(*args, **kwargs).arguments)
                except Exception as err:  # never break the run for the counter
                    self.record("error", f"{name}: {err}", 0.0)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return wrapper

    def _count(self, kind: str, arg: str, how: str, bound: dict[str, Any]) -> None:
        group = bound.get("group")
        if how == "p2p":
            tensor = bound[arg]
            peer = bound.get("dst")
            if peer is None:
                peer = dist.get_global_rank(group, bound["group_dst"])
            self.record(self.axis_of_peer(int(peer)), kind, tensor.numel() * tensor.element_size())
            return
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        n = len(ranks)
        if n <= 1:
            return
        value = bound[arg]
        if how == "list":
            full = float(sum(t.numel() * t.element_size() for t in value))
        else:
            full = float(value.numel() * value.element_size())
        self.record(self.axis_of_ranks(ranks), kind, ring_bytes(kind, full_bytes=int(full), world_size=n))

    # ---------------------------------------------------------------- DTensor's functional collectives
    @contextlib.contextmanager
    def functional(self) -> Iterator[None]:
        """DTensor's functional collectives, through the library's dispatch-mode counter, booked by axis."""
        from lightning_parallel.parallel.tensor.comm import TPCommCounter

        counter = self

        class _ByAxis(TPCommCounter):
            def _add(self, kind: str, group: Any, nbytes: float) -> None:
                if counter.active:
                    counter.record(counter.axis_of_ranks(dist.get_process_group_ranks(group)), kind, nbytes)

        with _ByAxis():
            yield


def python_allreduce_hook(model: Any) -> None:
    """DDP's buckets through ``torch.distributed.all_reduce`` (counted), instead of the C++ default hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(None, default_hooks.allreduce_hook)



def book_exchanges(counter: CommCount, exchanges: Any) -> None:
    """lp_dp's exchanges through device 0 (the strategy's ``ExchangeCounter``, one step) as the ``dp`` axis: one
    process has no collective to wrap, its engine counts every transfer it makes."""
    for s in exchanges.stats():
        counter.bytes["dp"] += s.bytes_per_step
        counter.calls[f"dp:{s.kind}"] += s.calls
