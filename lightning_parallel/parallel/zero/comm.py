"""Counted collectives: every byte a ZeRO step moves over the ``dp`` process group, by collective.

Accounting model (what a ring algorithm sends per rank, the model the ZeRO paper's 2Psi / 3Psi figures use): for a
buffer of ``B`` bytes over ``N`` ranks, a reduce-scatter and an all-gather each send ``(N-1)/N * B`` bytes per rank,
an all-reduce (reduce-scatter + all-gather) ``2 (N-1)/N * B``, a broadcast, a reduce and an all-to-all
``(N-1)/N * B``. The library's own
collectives call :meth:`CommCounter.record`; collectives made by torch code (FSDP2's all-gathers and
reduce-scatters) are counted by :meth:`CommCounter.patch_torch`, which wraps the ``torch.distributed`` functions
FSDP2 calls for the duration of a ``with`` block. No Lightning import.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CommCounter", "all_gather_into", "broadcast_module_states", "reduce_scatter_mean", "ring_bytes"]

# collective kind -> factor of (N-1)/N * bytes of the full buffer
_RING_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "broadcast": 1.0, "reduce": 1.0,
                "all_to_all": 1.0}


def ring_bytes(kind: str, *, full_bytes: int, world_size: int) -> float:
    """Bytes one rank sends for a ring ``kind`` collective over a full buffer of ``full_bytes`` bytes."""
    if world_size <= 1:
        return 0.0
    return _RING_FACTOR[kind] * (world_size - 1) / world_size * full_bytes


@dataclass
class CommCounter:
    """Bytes sent per rank, by collective kind, since the last :meth:`reset` (ring model, see the module doc)."""

    bytes_by_kind: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    enabled: bool = True

    def record(self, kind: str, *, full_bytes: int, world_size: int) -> None:
        if self.enabled:
            self.bytes_by_kind[kind] += ring_bytes(kind, full_bytes=full_bytes, world_size=world_size)
            self.calls_by_kind[kind] += 1

    @property
    def total_bytes(self) -> float:
        return float(sum(self.bytes_by_kind.values()))

    def reset(self) -> None:
        self.bytes_by_kind.clear()
        self.calls_by_kind.clear()

    def snapshot(self) -> dict[str, float]:
        return {**dict(self.bytes_by_kind), "total": self.total_bytes}

    @contextlib.contextmanager
    def patch_torch(self) -> Iterator[CommCounter]:
        """Count the collectives torch code (FSDP2) issues through ``torch.distributed`` inside the block."""
        names = {  # (kind, position and keyword of the full-size tensor argument)
            "all_gather_single": ("all_gather", 0, "output_tensor"),
            "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
            "reduce_scatter_single": ("reduce_scatter", 1, "input"),
            "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
            "all_reduce": ("all_reduce", 0, "tensor"),
        }
        originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
        try:
            for name, fn in originals.items():
                setattr(dist, name, self._counting(fn, *names[name]))
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def _counting(self, fn: Callable[..., Any], kind: str, index: int, keyword: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tensor = args[index] if len(args) > index else kwargs[keyword]
            group = kwargs.get("group")
            self.record(kind, full_bytes=tensor.numel() * tensor.element_size(),
                        world_size=dist.get_world_size(group))
            return fn(*args, **kwargs)

        return wrapper


def reduce_scatter_mean(
    output: Tensor, full: Tensor, *, group: dist.ProcessGroup | None, counter: CommCounter | None = None
) -> None:
    """``output`` = this rank's ``1/N`` slice of the mean of ``full`` over ``group`` (``full.numel() == N * out``)."""
    world = dist.get_world_size(group)
    if world == 1:
        output.copy_(full)
        return
    dist.reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group)
    output.div_(world)
    if counter is not None:
        counter.record("reduce_scatter", full_bytes=full.numel() * full.element_size(), world_size=world)


def all_gather_into(
    full: Tensor, shard: Tensor, *, group: dist.ProcessGroup | None, counter: CommCounter | None = None
) -> None:
    """Fill ``full`` with every rank's ``shard`` in rank order (``shard`` may be this rank's slice of ``full``)."""
    world = dist.get_world_size(group)
    if world == 1:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return
    dist.all_gather_single(full, shard, group=group)
    if counter is not None:
        counter.record("all_gather", full_bytes=full.numel() * full.element_size(), world_size=world)


def broadcast_module_states(module: torch.nn.Module, *, group: dist.ProcessGroup | None, src_rank: int) -> None:
    """Make every rank's parameters and buffers equal to those of global rank ``src_rank`` (set-up, not per step).

    A DTensor (a tensor-parallel shard) is broadcast as its local tensor: each tp rank's shard goes to the same tp
    rank of the other replicas (``group`` is the dp group)."""
    if dist.get_world_size(group) == 1:
        return
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            local = t._local_tensor if isinstance(t, DTensor) else t.data  # type: ignore[attr-defined]
            dist.broadcast(local, src=src_rank, group=group)
