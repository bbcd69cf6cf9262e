"""How a sequence is split over the ``cp`` ranks (head-tail load balancing), and the process's active split.

A sequence of ``s`` tokens is cut into ``2 cp`` chunks of ``c = s / (2 cp)`` tokens; cp rank ``r`` holds chunk ``r``
(its *head*) followed by chunk ``2 cp - 1 - r`` (its *tail*)::

    cp = 2, s = 8:   chunks  [0 1] [2 3] [4 5] [6 7]
                     rank 0  holds [0 1] + [6 7]     positions 0 1 6 7
                     rank 1  holds [2 3] + [4 5]     positions 2 3 4 5

Under a causal mask a query at position ``i`` attends to ``i + 1`` keys, so the rank holding the first ``s / cp``
tokens would do a quarter of the work and the last rank three quarters (cp = 2); with head and tail every rank
computes the same number of scores: ``2c (2c + 1) / 2`` on its own block under the causal mask and ``2 c^2`` on each
of the ``cp - 1`` blocks it receives (torch's ``_HeadTailLoadBalancer``, Megatron-Core's and torchtitan's layout).

:func:`shard_sequence` keeps a rank's tokens of a tensor along one dimension; :func:`unshard_sequence` gathers them
back (an all-gather over cp) in the original order. :func:`sequence_positions` gives the global positions of the
tokens a module holds: ``arange(t)`` on one device, this rank's head and tail under context parallelism -- modules
with position embeddings (learned, rotary) call it instead of ``torch.arange``. No Lightning import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ContextParallelState", "SequenceShard", "activate", "activated", "active", "deactivate", "head_tail_order",
           "sequence_length", "sequence_positions", "shard_sequence", "unshard_sequence"]


@dataclass(frozen=True)
class SequenceShard:
    """Rank ``rank`` of ``cp``'s part of a sequence: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``."""

    cp: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.cp:
            raise ValueError(f"cp rank {self.rank} is outside 0..{self.cp - 1}.")

    @property
    def chunks(self) -> tuple[int, int]:
        """``(head, tail)``: the indices of this rank's two chunks among the ``2 cp``."""
        return self.rank, 2 * self.cp - 1 - self.rank

    def check_length(self, seq_len: int, *, what: str = "the sequence") -> int:
        """The chunk length ``seq_len / (2 cp)``; ValueError with the arithmetic if it does not divide."""
        if seq_len % (2 * self.cp):
            raise ValueError(
                f"context_parallel_size={self.cp} splits {what} into 2 x cp = {2 * self.cp} chunks, but its length is "
                f"{seq_len}: {seq_len} % {2 * self.cp} = {seq_len % (2 * self.cp)}. Fix: a sequence length that is a "
                f"multiple of {2 * self.cp} (the data module's block size).")
        return seq_len // (2 * self.cp)

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> Tensor:
        """The global positions (``int64``) of this rank's ``seq_len / cp`` tokens of a ``seq_len``-token sequence."""
        c = self.check_length(seq_len)
        head, tail = self.chunks
        return torch.cat([torch.arange(head * c, (head + 1) * c, device=device),
                          torch.arange(tail * c, (tail + 1) * c, device=device)])


def head_tail_order(cp: int, seq_len: int, device: torch.device | str | None = None) -> Tensor:
    """The global positions of the tokens of all cp ranks concatenated in rank order (rank 0's head and tail, then
    rank 1's, ...): ``gathered[i]`` holds position ``order[i]``; ``argsort(order)`` puts them back in order."""
    return torch.cat([SequenceShard(cp, r).positions(seq_len, device) for r in range(cp)])


def shard_sequence(tensor: Tensor, dim: int, shard: SequenceShard) -> Tensor:
    """This rank's tokens of ``tensor`` along ``dim`` (head chunk then tail chunk; a copy, contiguous)."""
    c = shard.check_length(tensor.shape[dim], what=f"a batch tensor of shape {tuple(tensor.shape)} along dim {dim}")
    head, tail = shard.chunks
    return torch.cat([tensor.narrow(dim, head * c, c), tensor.narrow(dim, tail * c, c)], dim=dim).contiguous()


def unshard_sequence(tensor: Tensor, dim: int, shard: SequenceShard, group: dist.ProcessGroup) -> Tensor:
    """The whole sequence from every cp rank's part along ``dim`` (an all-gather over ``group``), in position
    order; the inverse of :func:`shard_sequence`. Collective: every cp rank calls it. Not differentiable."""
    parts = [torch.empty_like(tensor) for _ in range(shard.cp)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    gathered = torch.cat(parts, dim=dim)
    order = head_tail_order(shard.cp, gathered.shape[dim], device=tensor.device)
    return gathered.index_select(dim, torch.argsort(order))


@dataclass
class ContextParallelState:
    """What the routed attention modules and :func:`sequence_positions` of this process use: the cp group, this
    rank's shard and the attention style."""

    group: Any
    """The ``cp`` process group (its ranks in cp order)."""
    shard: SequenceShard
    style: str = "ring"


_ACTIVE: ContextParallelState | None = None


def active() -> ContextParallelState | None:
    """The process's context-parallel state, or None (one device, or cp = 1)."""
    return _ACTIVE


def activate(state: ContextParallelState | None) -> None:
    """Make ``state`` the process's (the composition's context-parallel step does; None clears it)."""
    global _ACTIVE
    _ACTIVE = state


def deactivate() -> None:
    """Clear the process's state: routed attention modules run their own forward again, positions start at 0."""
    activate(None)


@contextlib.contextmanager
def activated(state: ContextParallelState | None) -> Generator[None, None, None]:
    """``state`` active inside the block, the previous one restored after it."""
    before = _ACTIVE
    activate(state)
    try:
        yield None
    finally:
        activate(before)


def sequence_length(length: int) -> int:
    """The whole sequence's length when this module holds ``length`` of its tokens: ``length x cp`` under context
    parallelism, ``length`` otherwise."""
    state = _ACTIVE
    return length if state is None else length * state.shard.cp


def sequence_positions(length: int, device: torch.device | str | None = None) -> Tensor:
    """The global positions of the ``length`` tokens this module holds: ``torch.arange(length)`` without context
    parallelism; under it (``length`` = the local tokens, ``s / cp``) this rank's head and tail positions of the
    ``length x cp``-token sequence. Call it wherever a module would call ``torch.arange(t)`` for positions."""
    state = _ACTIVE
    if state is None or state.shard.cp == 1:
        return torch.arange(length, device=device)
    return state.shard.positions(length * state.shard.cp, device=device)
