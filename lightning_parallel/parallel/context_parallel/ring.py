"""Ring attention: exact causal attention over a sequence split across the ``cp`` ranks (head-tail chunks).

Each of the ``n = cp`` ranks holds ``q``, ``k``, ``v`` of shape ``(b, h, 2c, d)`` -- its head chunk ``r`` then its tail
chunk ``2n - 1 - r`` of the ``2n`` chunks of ``c`` tokens (:mod:`.sharding`). In ``n`` steps every rank's queries
meet every rank's keys: at step ``i`` a rank holds the key/value block of rank ``j = (r - i) mod n`` (its own at step
0), and sends it on to rank ``r + 1`` while it computes on it (point to point; the block for step ``i + 1`` arrives from
rank ``r - 1``). By the chunks' order under the causal mask, each step is one of three cases:

* ``i = 0`` -- the rank's own block, causal (head attends to head causally, tail to head fully and to tail causally);
* ``j < r`` -- both of this rank's query chunks attend fully to ``j``'s head chunk, not at all to its tail;
* ``j > r`` -- only this rank's tail chunk attends, fully, to both of ``j``'s chunks.

So every rank computes ``c x 2c`` scores per received block: the causal work is balanced. The partial results are
merged exactly by their log-sum-exp (online softmax): ``lse = logaddexp(lse_a, lse_b)``,
``out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)``.

Backward runs the same ring: the key/value blocks travel again, each rank computes the block's gradients from the
saved output and the final log-sum-exp (flash attention's backward), adds ``dq`` locally and adds ``dk``, ``dv``
into an accumulator that travels with the block and arrives back at its owner after ``n`` hops.

Per rank and attention call: forward sends ``n - 1`` blocks of ``2 x b x h x 2c x d`` elements (k and v), backward
``n - 1`` such blocks plus ``n`` accumulators of the same size (fp32). Saved for backward: ``q, k, v``, the output and
the log-sum-exp of the rank's ``s / cp`` tokens -- activation memory divides by ``cp``.

The block kernel is torch's CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward: the kernel ``F.scaled_dot_product_attention`` runs on one CPU device) on CPU, and the same computation in
plain matrix products elsewhere. On CUDA torch's own context-parallel API
(``torch.distributed.tensor.experimental.context_parallel``) implements the same algorithm over its flash kernels;
this module is what runs on CPU/gloo and is tested here. No Lightning import.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["block_attention", "block_attention_backward", "ring_attention"]

_KV_TAG, _DKV_TAG = 11, 12


def _acc(t: Tensor) -> torch.dtype:
    """The accumulation dtype: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _use_cpu_kernel(q: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    s = torch.matmul(q.to(_acc(q)), k.to(_acc(q)).transpose(-2, -1)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def block_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of softmax attention of ``q`` over one key/value block (``causal``: the block is the queries'
    own, same length, lower-triangular mask): ``out`` ``(b, h, lq, d)`` and ``lse`` ``(b, h, lq)`` in fp32 (fp64 for
    fp64 inputs)."""
    acc = _acc(q)
    if _use_cpu_kernel(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.to(acc), lse.to(acc)
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc)), lse


def block_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                             scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` (fp32; fp64 for fp64 inputs) of one block given the *final* output and log-sum-exp of the
    queries (the merged ones: the block's probabilities are ``exp(q k^T scale - lse)``)."""
    acc = _acc(q)
    if _use_cpu_kernel(q):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype).contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse.contiguous(), 0.0, causal,
            scale=scale)
        return dq.to(acc), dk.to(acc), dv.to(acc)
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    dout_ = dout.to(acc)
    dv = torch.matmul(p.transpose(-2, -1), dout_)
    dp = torch.matmul(dout_, v.to(acc).transpose(-2, -1))
    delta = (dout_ * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    return torch.matmul(ds, k.to(acc)) * scale, torch.matmul(ds.transpose(-2, -1), q.to(acc)) * scale, dv


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    new = torch.logaddexp(lse, block_lse)
    merged = out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1)
    return merged, new


class _Ring:
    """Point-to-point shifts along the ring of ``group``: send to cp rank ``r + 1``, receive from ``r - 1``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensor: Tensor, tag: int) -> tuple[Tensor, list[Any]]:
        """Start sending ``tensor`` to the next rank and receiving the previous rank's into a new buffer; returns
        the buffer and the requests to wait for."""
        send = tensor.contiguous()
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float) -> Tensor:
        ring = _Ring(group)
        r, n = ring.rank, ring.size
        half = q.shape[-2] // 2
        kv = torch.stack([k, v])
        out = lse = torch.empty(0)
        for i in range(n):
            pending: tuple[Tensor, list[Any]] | None = ring.shift(kv, _KV_TAG) if i < n - 1 else None
            j = (r - i) % n
            if i == 0:
                out, lse = block_attention(q, kv[0], kv[1], scale=scale, causal=True)
            elif j < r:  # j's head chunk precedes both of ours; its tail follows both
                o, l_ = block_attention(q, kv[0, :, :, :half], kv[1, :, :, :half], scale=scale, causal=False)
                out, lse = _merge(out, lse, o, l_)
            else:  # j's chunks both lie between our head and our tail
                o, l_ = block_attention(q[:, :, half:], kv[0], kv[1], scale=scale, causal=False)
                tail_out, tail_lse = _merge(out[:, :, half:], lse[:, :, half:], o, l_)
                out = torch.cat([out[:, :, :half], tail_out], dim=2)
                lse = torch.cat([lse[:, :, :half], tail_lse], dim=2)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        # laid out (b, 2c, h, d) in memory, as torch's flash kernels return it: the caller's transpose(1, 2) and
        # reshape to (b, 2c, h d) are then views, and the output projection keeps no copy of it
        result = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.scale = group, scale
        return result

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        r, n, scale = ring.rank, ring.size, ctx.scale
        half = q.shape[-2] // 2
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=_acc(q), device=k.device)  # travels with the kv block
        kv = torch.stack([k, v])
        for i in range(n):
            pending = ring.shift(kv, _KV_TAG) if i < n - 1 else None
            j = (r - i) % n
            if i == 0:
                dq_, dk_, dv_ = block_attention_backward(dout, q, kv[0], kv[1], out, lse, scale=scale, causal=True)
                dq += dq_
                dkv[0] += dk_
                dkv[1] += dv_
            elif j < r:
                dq_, dk_, dv_ = block_attention_backward(dout, q, kv[0, :, :, :half].contiguous(),
                                                         kv[1, :, :, :half].contiguous(), out, lse, scale=scale,
                                                         causal=False)
                dq += dq_
                dkv[0, :, :, :half] += dk_
                dkv[1, :, :, :half] += dv_
            else:
                dq_, dk_, dv_ = block_attention_backward(dout[:, :, half:], q[:, :, half:].contiguous(), kv[0],
                                                         kv[1], out[:, :, half:], lse[:, :, half:], scale=scale,
                                                         causal=False)
                dq[:, :, half:] += dq_
                dkv[0] += dk_
                dkv[1] += dv_
            if n > 1:  # the accumulator goes on to the next rank; after n hops each is back at its owner
                dkv, requests = ring.shift(dkv, _DKV_TAG)
                _wait(requests)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, scale: float | None = None) -> Tensor:
    """Exact causal attention ``softmax(q k^T scale + causal mask) v`` of this rank's queries over the whole
    sequence, whose tokens are split over the ranks of ``group`` in head-tail chunks (:mod:`.sharding`).

    Args:
        q, k, v: ``(batch, heads, 2c, head_dim)``: this rank's head chunk then tail chunk (same heads for q, k, v).
        group: the cp process group (cp rank = the group rank). scale: default ``1 / sqrt(head_dim)``.

    Collectives: point to point along the ring (``n - 1`` k/v blocks forward; ``n - 1`` blocks and ``n``
    gradient accumulators backward). Meta tensors (shape inference) return an empty output without communicating.
    """
    if q.shape[-2] % 2 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"ring attention takes q, k, v of one shape (batch, heads, 2c, head_dim) holding a head and "
                         f"a tail chunk of c tokens each; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}.")
    if q.is_meta:
        return torch.empty_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out: Tensor = _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, scale)
    return out
