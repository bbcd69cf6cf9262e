"""Counting the tensor-parallel collectives at each call, and Megatron's formula for them.

DTensor issues its collectives as functional ops (``_c10d_functional.all_reduce``, ``reduce_scatter_tensor``,
``all_gather_into_tensor``) on plain local tensors; :class:`TPCommCounter` is a ``TorchDispatchMode`` that sees each
of them (in forward and, on CPU where backward runs on the calling thread, in backward) and records its full-buffer
bytes by phase, with the ring model of :mod:`lightning_parallel.parallel.zero.comm` (per rank: all-reduce
``2 (t-1)/t B``, reduce-scatter and all-gather ``(t-1)/t B``).

Megatron's count per transformer layer, activations ``b x s x h`` of ``e`` bytes (:func:`megatron_tp_bytes`):
without sequence parallelism two all-reduces in forward (after the attention and the MLP row linears) and two in
backward (of the input gradients of q/k/v and of ``fc_in``); with it, each all-reduce becomes an all-gather plus a
reduce-scatter of the same buffer: the same bytes. The vocab-parallel embedding and head add one all-reduce each way
(the partial lookups; the head's input gradient), and the vocab-parallel loss three all-reduces of ``b x s``
statistics. No Lightning import.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_parallel.parallel.zero.comm import ring_bytes

__all__ = ["TPCommCounter", "megatron_tp_bytes"]

_KINDS = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
          "all_gather_into_tensor": "all_gather", "all_reduce_coalesced": "all_reduce",
          "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor_coalesced": "reduce_scatter",
          "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast"}


class TPCommCounter(TorchDispatchMode):
    """Bytes and calls of the functional collectives run inside ``with counter:``, by ``phase`` and kind.

    Set :attr:`phase` (``"forward"``, ``"backward"``, ...) from outside; only groups of more than one rank count.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.bytes: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def total(self, phase: str | None = None) -> float:
        return float(sum(v for (p, _), v in self.bytes.items() if phase is None or p == phase))

    def count(self, phase: str | None = None, kind: str | None = None) -> int:
        return sum(v for (p, k), v in self.calls.items() if (phase is None or p == phase) and
                   (kind is None or k == kind))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(t is DTensor or (isinstance(t, type) and issubclass(t, DTensor)) for t in types):
            return NotImplemented  # let DTensor run: its functional collectives come back here on plain tensors
        kwargs = kwargs or {}
        if func.namespace == "_c10d_functional":
            kind = _KINDS.get(func._overloadpacket.__name__)
            if kind is not None:
                self._record(kind, args)
        return func(*args, **kwargs)

    def _record(self, kind: str, args: tuple[Any, ...]) -> None:
        tensor = args[0]
        tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
        group = dist.distributed_c10d._resolve_process_group(args[-1])
        world = dist.get_world_size(group)
        if world <= 1:
            return
        size = sum(t.numel() * t.element_size() for t in tensors)
        full = size * world if kind == "all_gather" else size
        self._add(kind, group, ring_bytes(kind, full_bytes=full, world_size=world))

    def _add(self, kind: str, group: Any, nbytes: float) -> None:
        """Book one collective of ``kind`` over ``group`` sending ``nbytes`` (ring model) under :attr:`phase`."""
        self.bytes[(self.phase, kind)] += nbytes
        self.calls[(self.phase, kind)] += 1


def megatron_tp_bytes(*, n_layer: int, batch: int, seq: int, hidden: int, tp: int, elem_bytes: int = 4,
                      sequence_parallel: bool = False, scatter_embedding: bool = True) -> dict[str, float]:
    """Bytes one rank sends over ``tp`` per micro-batch (ring model) for a Megatron-split transformer, by phase.

    ``x = (t-1)/t * b s h * elem_bytes`` (one all-gather or reduce-scatter of an activation; an all-reduce is
    ``2x``). Layers: 2 all-reduces per layer each way (``4 L x``), with SP 2 all-gathers + 2 reduce-scatters (the same
    ``4 L x``). Vocab-parallel embedding: forward all-reduce ``2x`` (SP without ``scatter_embedding``: a
    reduce-scatter ``x``), backward with SP the all-gather ``x`` of its sequence-split gradient. Vocab-parallel head:
    forward with SP the all-gather ``x`` of its input, backward the reduction of its input gradient (``2x``; SP
    ``x``). ``loss`` (reported apart): the vocab-parallel cross-entropy's three all-reduces of ``b s`` values.
    """
    x = (tp - 1) / tp * batch * seq * hidden * elem_bytes
    layers = 4 * n_layer * x
    if sequence_parallel:
        fwd = layers + (2 * x if scatter_embedding else x) + x
        bwd = layers + x + x
    else:
        fwd, bwd = layers + 2 * x, layers + 2 * x
    loss = 3 * ring_bytes("all_reduce", full_bytes=batch * seq * elem_bytes, world_size=tp)
    return {"forward": fwd, "backward": bwd, "loss": loss, "total": fwd + bwd + loss}
