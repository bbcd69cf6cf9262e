"""ZeRO-2's gradient reduction during the backward (:class:`ChunkedReduce`), so that the whole local gradient never
exists at once and the reduction overlaps the rest of the backward.

Each param group's flat layout (:class:`~lightning_parallel.parallel.zero.flat.FlatShard`) is ``N`` chunks of ``S``
elements, chunk ``j`` owned by dp rank ``j``. During a backward that the strategy has armed (the step's last; an
accumulation micro-batch's gradients stay local unless ``reduce_each_batch`` arms every backward, whose rounds' chunks
add up), a trainable parameter's post-accumulate-grad hook counts it done;
once every trainable parameter overlapping chunk ``j`` is done, the chunk is assembled from their gradients into an
``S``-element buffer and reduced (sum) to rank ``j`` (``dist.reduce``, asynchronous), and the gradients of parameters
whose every chunk has been sent are freed. The backward produces the end of the layout first, so the chunks go from
the last to the first; every rank issues them in one fixed order (chunk-major over the param groups, last chunk
first) whatever order they complete in, on a process group of their own (the dp ranks'), so ranks whose parameters
complete differently (a parameter unused on one rank) still match their collectives, and a collective the model or a
callback runs between the backward and the step boundary on another group cannot be matched against a chunk; no hook
waits for another rank. A chunk the backward did not complete (a parameter without a gradient holds back its chunk
and every chunk after it in the order) is sent by :meth:`ChunkedReduce.finish` (the step boundary). A gradient that
arrives twice in one backward (a parameter reused across reentrant activation-checkpoint segments) after its chunk
was sent is refused with an error rather than lost. Traffic: ``N`` reduces of ``S`` elements, ``(N-1)/N`` of the
group's gradient per rank, as one reduce-scatter. Memory: the gradients of the parameters not yet sent, the chunk
buffers in flight and the rank's own reduced chunk, instead of every gradient plus a full flat copy at the step
boundary. No Lightning import.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .flat import FlatShard, hook_trainable

__all__ = ["ChunkedReduce"]


def _hook(owner: weakref.ref[ChunkedReduce], s: int, i: int, param: Tensor) -> None:
    chunked = owner()
    if chunked is not None:
        chunked._ready(s, i, param)

_Piece = tuple[int, int, int, int]  # (parameter index, start and end within the flat parameter, start in the chunk)


class ChunkedReduce:
    """Reduce each rank's chunk of ``shards``' gradients to that rank as the backward completes it (module
    docstring). :meth:`arm` before each backward to reduce so; :meth:`finish` at the step boundary returns each
    shard's reduced chunk (the sum over the ranks, and over the armed backwards since the last :meth:`finish`), or None
    when nothing was armed since. ``group``: the dp ranks (None: the world); the reduces run on a group of the same
    ranks of their own, made here (every member must build its optimizer, as it does)."""

    def __init__(self, shards: list[FlatShard], group: dist.ProcessGroup | None) -> None:
        self.shards = shards
        self.world = shards[0].world_size
        self.rank = shards[0].rank
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.group = dist.new_group(ranks, use_local_synchronization=True)
        self.dst = ranks
        self.order = [(s, j) for j in reversed(range(self.world)) for s in range(len(shards))]
        self.pieces: list[list[list[_Piece]]] = []  # per shard, per chunk
        self.chunks_of: list[list[list[int]]] = []  # per shard, per parameter: the chunks it overlaps
        for shard in shards:
            size = shard.shard_numel
            pieces: list[list[_Piece]] = [[] for _ in range(self.world)]
            chunks: list[list[int]] = []
            offset = 0
            for i, n in enumerate(shard.numels):
                mine = list(range(offset // size, (offset + n - 1) // size + 1)) if n else []
                for j in mine:
                    lo, hi = max(offset, j * size), min(offset + n, (j + 1) * size)
                    pieces[j].append((i, lo - offset, hi - offset, lo - j * size))
                chunks.append(mine)
                offset += n
            self.pieces.append(pieces)
            self.chunks_of.append(chunks)
        self.armed = False
        self._pending: list[list[int]] = []
        self._trainable_in: list[list[int]] = []  # per shard, per chunk: its trainable parameters (the hooked set)
        self._seen: list[list[bool]] = []
        self._next = len(self.order)  # nothing open
        self._in_flight: list[tuple[Any, Tensor]] = []
        self._owned: list[list[Tensor]] = [[] for _ in shards]  # this rank's chunks, one per round
        self._waits: list[Any] = []
        self._trainable: tuple[bool, ...] = ()
        self._hooks: list[Any] = []

    def __del__(self) -> None:
        for handle in getattr(self, "_hooks", ()):
            handle.remove()

    def _hook_trainable(self) -> None:
        """Hooks on the parameters that take gradients (torch refuses a hook on a frozen one), made again when that
        set changed. They hold this object weakly, so that an optimizer dropped (a second fit of the same module
        builds another) is freed with its flat buffers, and its hooks go with it."""
        before = self._trainable
        self._trainable, self._hooks = hook_trainable(self.shards, partial(_hook, weakref.ref(self)), before,
                                                      self._hooks)
        if self._trainable == before:
            return
        self._trainable_in = [[sum(shard.params[i].requires_grad for i, *_ in chunk) for chunk in pieces]
                              for shard, pieces in zip(self.shards, self.pieces, strict=True)]

    def arm(self) -> None:
        """The next backward reduces each chunk as it completes (a round left open by an earlier backward is sent
        first: that backward is over, and the rounds' reduced chunks are added into one, so that a step armed in
        each of its accumulated batches keeps one chunk per param group, not one per batch)."""
        if self.world == 1:
            return
        self._send_rest()
        self._fold()
        self._hook_trainable()
        self._pending = [list(counts) for counts in self._trainable_in]
        self._seen = [[False] * len(shard.params) for shard in self.shards]
        self._next = 0
        self.armed = True

    def _ready(self, s: int, i: int, _param: Tensor) -> None:
        chunks = self.chunks_of[s][i]
        if not self.armed or not chunks:  # an empty parameter is in no chunk
            return
        if self._seen[s][i]:  # a second gradient in one backward: it added to .grad, fine unless a chunk is gone
            if any(self._is_sent(s, j) for j in chunks):
                raise RuntimeError(
                    f"ZeRO-2 reduced a chunk of the gradient of parameter {i} of param group {s} during the backward, "
                    "and then that parameter received another gradient in the same backward (a parameter reused in "
                    "several reentrant activation-checkpoint segments, or a second backward without "
                    "ZeroOptimizer.overlap_backward() before it). Fix: use non-reentrant checkpointing "
                    "(use_reentrant=False), or arm each backward with overlap_backward()."
                )
            return
        self._seen[s][i] = True
        pending = self._pending[s]
        for j in chunks:
            pending[j] -= 1
        while self._next < len(self.order):
            s_next, j_next = self.order[self._next]
            if self._pending[s_next][j_next] > 0:
                return
            self._send(s_next, j_next)
            self._next += 1

    def _is_sent(self, s: int, j: int) -> bool:
        """Whether this round has sent shard ``s``'s chunk ``j``: the chunks go in :attr:`order`, so those before
        the next one are."""
        return (self.world - 1 - j) * len(self.shards) + s < self._next

    def _fold(self) -> None:
        """Between two armed backwards: wait for this rank's own reduces (every rank has issued the same ones by
        now: the round is complete), add its chunks of the rounds into one per shard, and drop the finished
        reduces' buffers."""
        for work in self._waits:
            work.wait()
        self._waits.clear()
        for s, chunks in enumerate(self._owned):
            if len(chunks) > 1:
                for more in chunks[1:]:
                    chunks[0].add_(more)
                self._owned[s] = chunks[:1]
        self._in_flight = [(work, buf) for work, buf in self._in_flight if not work.is_completed()]

    def _send_rest(self) -> None:
        while self._next < len(self.order):
            self._send(*self.order[self._next])
            self._next += 1

    @torch.no_grad()
    def _send(self, s: int, j: int) -> None:
        shard = self.shards[s]
        still = []
        for work, buf in self._in_flight:  # drop the buffers of the reduces done; never wait on another rank here
            if work.is_completed():
                work.wait()
            else:
                still.append((work, buf))
        self._in_flight = still
        buf = torch.zeros(shard.shard_numel, dtype=shard.flat.dtype, device=shard.flat.device)
        for i, lo, hi, at in self.pieces[s][j]:
            grad = shard.params[i].grad
            if grad is not None:
                buf[at : at + hi - lo].copy_(grad.reshape(-1)[lo:hi])
        for i, _, _, _ in self.pieces[s][j]:
            if self.chunks_of[s][i][0] == j:  # every chunk of this parameter is sent (last chunk first)
                shard.params[i].grad = None
        work = dist.reduce(buf, dst=self.dst[j], op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        if j == self.rank:
            self._waits.append(work)
            self._owned[s].append(buf)
        else:
            self._in_flight.append((work, buf))

    def finish(self) -> list[Tensor] | None:
        """Send what the backward left, wait for every reduce and return each shard's reduced chunk (summed over the
        rounds since the last call); None if nothing was armed since."""
        if not self.armed:
            return None
        self._send_rest()
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight.clear()
        for work in self._waits:
            work.wait()
        self._waits.clear()
        out = []
        for chunks in self._owned:
            total = chunks[0]
            for more in chunks[1:]:
                total.add_(more)
            out.append(total)
        self._owned = [[] for _ in self.shards]
        self.armed = False
        return out
