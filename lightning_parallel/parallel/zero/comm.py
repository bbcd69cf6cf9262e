"""The collectives of ZeRO over the ``dp`` process group: the reduce-scatter of a flat gradient (mean), the
all-gather of updated shards, and the set-up broadcast that makes replicas equal. They count nothing themselves:
:mod:`lightning_parallel.parallel.counters` sees them from outside when a run asks. No Lightning import.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_into", "broadcast_coalesced", "broadcast_module_states", "local_data", "reduce_scatter_mean"]

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
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(local_data(t), src=src_rank, group=group)


def local_data(t: Tensor) -> Tensor:
    """The tensor a rank holds for ``t``: a DTensor's local shard, a plain tensor's data."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t.data  # type: ignore[attr-defined,no-any-return]


def broadcast_coalesced(tensors: list[Tensor], *, src_rank: int, group: dist.ProcessGroup | None) -> None:
    """``tensors`` (small ones, each rank's in the same order) := global rank ``src_rank``'s, in one broadcast per
    dtype of their concatenation (per step: buffers). The concatenation is a copy: not for the whole model's
    parameters (:func:`broadcast_module_states` sends them one by one)."""
    if dist.get_world_size(group) == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.broadcast(flat, src=src_rank, group=group)
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
