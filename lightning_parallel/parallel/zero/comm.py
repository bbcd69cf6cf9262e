"""The collectives of ZeRO over the ``dp`` process group: the reduce-scatter of a flat gradient (mean), the
all-gather of updated shards, and the set-up broadcast that makes replicas equal. They count nothing themselves:
:mod:`lightning_parallel.parallel.counters` sees them from outside when a run asks. No Lightning import.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_into", "broadcast_module_states", "reduce_scatter_mean"]

def reduce_scatter_mean(output: Tensor, full: Tensor, *, group: dist.ProcessGroup | None) -> None:
    """``output`` = this rank's ``1/N`` slice of the mean of ``full`` over ``group`` (``full.numel() == N * out``)."""
    world = dist.get_world_size(group)
    if world == 1:
        output.copy_(full)
        return
    dist.reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group)
    output.div_(world)


def all_gather_into(full: Tensor, shard: Tensor, *, group: dist.ProcessGroup | None) -> None:
    """Fill ``full`` with every rank's ``shard`` in rank order (``shard`` may be this rank's slice of ``full``)."""
    world = dist.get_world_size(group)
    if world == 1:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return
    dist.all_gather_single(full, shard, group=group)


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
