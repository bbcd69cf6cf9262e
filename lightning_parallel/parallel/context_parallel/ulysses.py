"""All-to-all (Ulysses) attention over the ``cp`` ranks: heads <-> sequence.

Each rank holds ``q``, ``k``, ``v`` of shape ``(b, h, s/cp, d)`` (its head-tail chunks, :mod:`.sharding`). One
all-to-all per tensor over the cp group trades the split: afterwards each rank holds ``h / cp`` whole heads over the
whole sequence ``(b, h/cp, s, d)``, reordered into position order; it runs ordinary causal attention on them (torch's
``scaled_dot_product_attention``, its own backward), and one all-to-all of the output gives every rank all ``h``
heads of its own tokens back. Backward: the same all-to-alls in reverse (the gradients of ``out`` and of ``q, k, v``).

Per rank and attention call: ``4`` all-to-alls of ``b x h x s/cp x d`` elements forward (q, k, v, out) and ``4``
backward, each sending ``(cp - 1)/cp`` of its buffer -- independent of cp in bytes per rank, unlike the ring whose
traffic per rank does not shrink either but is point to point. Rule: the rank's heads (``n_head / tp``) divisible by
cp. Saved for backward: the attention's q, k, v, output over ``h / cp`` heads and ``s`` tokens -- the same bytes
as ``h`` heads over ``s / cp``: activation memory divides by cp. No Lightning import.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .sharding import head_tail_order

__all__ = ["all_to_all_attention"]


def _exchange(x: Tensor, group: dist.ProcessGroup, n: int, *, to_heads: bool) -> Tensor:
    """``to_heads``: ``(b, h, L, d)`` -> ``(b, h/n, n L, d)`` (rank j's L tokens at ``[j L, (j+1) L)``); else back."""
    if to_heads:
        b, h, L, d = x.shape
        send = x.reshape(b, n, h // n, L, d).transpose(0, 1).contiguous()  # (n, b, h/n, L, d): part j to rank j
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)  # recv[j] = rank j's tokens of my heads
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * L, d)
    b, hn, nL, d = x.shape
    L = nL // n
    send = x.reshape(b, hn, n, L, d).permute(2, 0, 1, 3, 4).contiguous()  # (n, b, h/n, L, d): rank j's tokens
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j] = my tokens of rank j's heads
    return recv.transpose(0, 1).reshape(b, n * hn, L, d)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup, n: int, to_heads: bool) -> Tensor:
        ctx.group, ctx.n, ctx.to_heads = group, n, to_heads
        return _exchange(x, group, n, to_heads=to_heads)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _exchange(grad.contiguous(), ctx.group, ctx.n, to_heads=not ctx.to_heads), None, None, None


def all_to_all_attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup,
                         scale: float | None = None) -> Tensor:
    """Exact causal attention of this rank's tokens (head-tail chunks, ``(b, h, s/cp, d)``) over the whole sequence,
    by two all-to-alls around a local attention (module docstring). ``h`` must be divisible by the group size."""
    n = dist.get_world_size(group)
    if q.shape[1] % n or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"all-to-all attention needs q, k, v of one shape with heads divisible by cp={n}; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if q.is_meta:
        return torch.empty_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    seq = q.shape[-2] * n
    order = torch.argsort(head_tail_order(n, seq, device=q.device))  # gathered -> position order
    inverse = torch.argsort(order)
    qh, kh, vh = (_AllToAll.apply(t.contiguous(), group, n, True).index_select(2, order) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    result: Tensor = _AllToAll.apply(out.index_select(2, inverse).contiguous(), group, n, False)
    return result.transpose(1, 2).contiguous().transpose(1, 2)  # (b, L, h, d) in memory, as flash kernels return it
