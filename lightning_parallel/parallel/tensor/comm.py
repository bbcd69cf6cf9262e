"""Megatron's count of the tensor-parallel collectives, to compare with what
:class:`~lightning_parallel.parallel.counters.CommCounter` counts (DTensor's functional collectives, by phase, with
the ring model: per rank all-reduce ``2 (t-1)/t B``, reduce-scatter and all-gather ``(t-1)/t B``).

Megatron's count per transformer layer, activations ``b x s x h`` of ``e`` bytes (:func:`megatron_tp_bytes`):
without sequence parallelism two all-reduces in forward (after the attention and the MLP row linears) and two in
backward (of the input gradients of q/k/v and of ``fc_in``); with it, each all-reduce becomes an all-gather plus a
reduce-scatter of the same buffer: the same bytes. The vocab-parallel embedding and head add one all-reduce each way
(the partial lookups; the head's input gradient), and the vocab-parallel loss three all-reduces of ``b x s``
statistics. No Lightning import.
"""

from __future__ import annotations

from lightning_parallel.parallel.counters import ring_bytes

__all__ = ["megatron_tp_bytes"]

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
