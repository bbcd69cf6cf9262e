"""A tensor-parallel value as a plain tensor, for what runs outside the tensor-parallel module: a stage's output
handed to the next pipeline stage, the loss a strategy logs or checks, a step's outputs. No Lightning import."""

from __future__ import annotations

from torch import Tensor

__all__ = ["plain"]


def plain(t: Tensor) -> Tensor:
    """A DTensor as a plain tensor: a replicated one's local value (no collective; a loss keeps its graph), a sharded
    or partial one gathered (``full_tensor``: a collective over its mesh, which every rank of that mesh must call);
    plain tensors pass through."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return t
    if all(isinstance(p, Replicate) for p in t.placements):
        return t.to_local()
    return t.full_tensor()
