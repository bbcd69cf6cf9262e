"""``FlatShard``: one optimizer param group as a flat, padded buffer split evenly over the ``dp`` ranks.

The parameters of a group (``numel`` ``n_1 .. n_k``, one dtype) are laid end to end in one buffer of ``T`` elements,
padded to ``T' = ceil(T / N) * N`` so that each of the ``N`` dp ranks owns exactly ``S = T' / N`` consecutive
elements ``[r S, (r+1) S)`` -- a balanced split that cuts through parameters where it must (DeepSpeed's flat
partitions), unlike dealing whole parameters to ranks (torch ``ZeroRedundancyOptimizer``, fairscale ``OSS``), whose
per-rank share depends on the parameter sizes. The model's parameters become views into the flat buffer (their
``Parameter`` objects stay the same), and the rank's slice is exposed as one leaf ``shard_param`` that the user's
optimizer steps. The padding (``< N`` elements per group) is the only deviation from ``Psi / N`` per rank.
No Lightning import.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["FlatShard"]


class FlatShard:
    """Flat layout of one param group over ``world_size`` ranks; this process is ``rank``.

    Args:
        params: the group's parameters (one dtype, one device).
        world_size: dp ranks ``N``. rank: this process's dp rank.
        keep_full_grad: ZeRO-1 -- keep a persistent full flat gradient buffer whose views are the parameters'
            ``.grad`` (``G Psi`` bytes); ZeRO-2 -- only the ``G Psi / N`` gradient shard persists: the full buffer
            exists from :meth:`prepare_grad` (before a step's first backward) until :meth:`release_full_grad`
            (after the reduce-scatter), so the backward accumulates straight into it, as under ZeRO-1.
    """

    def __init__(self, params: list[nn.Parameter], *, world_size: int, rank: int, keep_full_grad: bool) -> None:
        if not params:
            raise ValueError("a ZeRO param group needs at least one parameter.")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"ZeRO flattens each optimizer param group into one buffer, so a group must have one dtype and one "
                f"device; got dtypes {sorted(map(str, dtypes))} and devices {sorted(map(str, devices))}. Fix: put "
                "parameters of different dtypes in separate param groups in configure_optimizers."
            )
        self.params = list(params)
        self.world_size, self.rank = world_size, rank
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        self.shard_numel = -(-self.numel // world_size)
        self.padded_numel = self.shard_numel * world_size
        dtype, device = params[0].dtype, params[0].device
        self.flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, view in zip(self.params, self._views(self.flat), strict=True):
                view.copy_(p.detach())
                p.data = view
        self.shard_param = nn.Parameter(self.shard_of(self.flat))
        self.keep_full_grad = keep_full_grad
        self.reduced: Tensor | None = None  # this step's reduced gradient shard, until the step
        # the full flat gradient whose views are the parameters' .grad: ZeRO-1 always, ZeRO-2 between prepare_grad
        # and release_full_grad (the views are made with the buffer, compared by identity each step)
        self.flat_grad: Tensor | None = None
        self._grad_views: list[Tensor] = []
        if keep_full_grad:
            self._new_flat_grad()
            assert self.flat_grad is not None
            self.shard_param.grad = self.shard_of(self.flat_grad)
        else:
            self.shard_param.grad = torch.zeros(self.shard_numel, dtype=dtype, device=device)

    # ------------------------------------------------------------------ layout
    @property
    def shard_range(self) -> tuple[int, int]:
        return self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel

    def shard_of(self, full: Tensor) -> Tensor:
        start, end = self.shard_range
        return full[start:end]

    def _views(self, full: Tensor) -> list[Tensor]:
        views, offset = [], 0
        for p, n in zip(self.params, self.numels, strict=True):
            views.append(full[offset : offset + n].view(p.shape))
            offset += n
        return views

    def unflatten(self, full: Tensor) -> list[Tensor]:
        """Per-parameter copies (parameter shapes) of a full flat tensor laid out like this group."""
        return [v.clone() for v in self._views(full)]

    def flatten(self, tensors: list[Tensor]) -> Tensor:
        """A full flat (padded) tensor from per-parameter tensors in this group's order."""
        out = torch.zeros(self.padded_numel, dtype=tensors[0].dtype, device=self.flat.device)
        for view, t in zip(self._views(out), tensors, strict=True):
            view.copy_(t.reshape(view.shape))
        return out

    # ------------------------------------------------------------------ gradients
    def _new_flat_grad(self) -> None:
        """A zeroed full flat gradient whose views become the parameters' ``.grad`` (a gradient already there, from
        a backward before this buffer existed, is copied in)."""
        self.flat_grad = torch.zeros_like(self.flat)
        self._grad_views = self._views(self.flat_grad)
        for p, view in zip(self.params, self._grad_views, strict=True):
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view

    def _attach_grad_views(self, *, keep: bool) -> None:
        """Make every parameter's ``.grad`` its view into ``flat_grad`` again where something replaced it (a hook, a
        ``zero_grad(set_to_none=True)``); ``keep``: the replacement's values are copied into the view (a missing
        gradient zeroes it), else the view keeps what it holds. A per-step call: the views are compared by
        identity."""
        for p, view in zip(self.params, self._grad_views, strict=True):
            grad = p.grad
            if grad is view:
                continue
            if keep:
                if grad is None:
                    view.zero_()
                elif grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
            p.grad = view

    def prepare_grad(self) -> None:
        """Before a backward: ZeRO-2 allocates this step's full flat gradient if it has none, so autograd
        accumulates into its views -- no per-parameter gradient tensors, and no copy of them into a flat buffer at
        the reduce-scatter (on CPU each of those is a fresh allocation the kernel zero-fills page by page: about 5,000
        page faults a step for a 3 M-parameter GPT, measured). Idempotent (accumulation micro-batches call it
        again); ZeRO-1's persistent buffer needs nothing."""
        if self.flat_grad is None:
            self._new_flat_grad()

    def full_local_grad(self) -> Tensor:
        """This rank's local (not yet reduced) gradients as one full flat buffer.

        The full buffer where it exists (ZeRO-1; ZeRO-2 after :meth:`prepare_grad`), with any ``.grad`` something
        replaced copied back in (a missing one counts as zero); else (ZeRO-2, a backward nobody prepared for) a
        transient buffer assembled from the parameters' ``.grad``, freed after the reduce-scatter.
        """
        if self.flat_grad is not None:
            self._attach_grad_views(keep=True)
            return self.flat_grad
        full = torch.zeros_like(self.flat)
        for p, view in zip(self.params, self._views(full), strict=True):
            if p.grad is not None:
                view.copy_(p.grad)
        return full

    def release_full_grad(self) -> None:
        """After the reduce-scatter: ZeRO-2 drops the full gradient (only its shard persists); ZeRO-1 zeroes the
        slots other ranks own (their local values are spent), so a further backward accumulates from zero there."""
        if not self.keep_full_grad:
            for p in self.params:
                p.grad = None
            self.flat_grad, self._grad_views = None, []
            return
        assert self.flat_grad is not None
        start, end = self.shard_range
        self.flat_grad[:start].zero_()
        self.flat_grad[end:].zero_()

    def zero_grad(self) -> None:
        if self.keep_full_grad:
            assert self.flat_grad is not None
            self.flat_grad.zero_()
            self._attach_grad_views(keep=False)
        else:
            for p in self.params:
                p.grad = None
            self.flat_grad, self._grad_views = None, []
            assert self.shard_param.grad is not None
            self.shard_param.grad.zero_()
