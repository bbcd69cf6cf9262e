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

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["FlatShard", "flat_group_refusal", "hook_trainable"]


def flat_group_refusal(params: Sequence[Tensor], index: int | None = None) -> str | None:
    """Why the flat ZeRO-1/2 cannot flatten the param group ``params`` (number ``index`` of its optimizer), or None:
    the group becomes one buffer, so its parameters must share one dtype and one device."""
    dtypes = {p.dtype for p in params}
    devices = {p.device for p in params}
    if len(dtypes) <= 1 and len(devices) <= 1:
        return None
    group = "a param group" if index is None else f"param group {index}"
    return (f"ZeRO flattens each optimizer param group into one buffer, so a group must have one dtype and one "
            f"device; {group} has dtypes {sorted(map(str, dtypes))} and devices {sorted(map(str, devices))}. Fix: "
            "put parameters of different dtypes in separate param groups in configure_optimizers.")


class FlatShard:
    """Flat layout of one param group over ``world_size`` ranks; this process is ``rank``.

    Args:
        params: the group's parameters (one dtype, one device).
        world_size: dp ranks ``N``. rank: this process's dp rank.
        keep_full_grad: ZeRO-1 -- keep a persistent full flat gradient buffer whose views are the parameters'
            ``.grad`` (``G Psi`` bytes); ZeRO-2 -- no full buffer, only the ``G Psi / N`` gradient shard persists.
    """

    def __init__(self, params: list[nn.Parameter], *, world_size: int, rank: int, keep_full_grad: bool) -> None:
        if not params:
            raise ValueError("a ZeRO param group needs at least one parameter.")
        why = flat_group_refusal(params)
        if why is not None:
            raise ValueError(why)
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
        self.flat_grad: Tensor | None = None
        self._grad_views: list[Tensor] = []  # ZeRO-1: the parameters' gradients, views into flat_grad (made once)
        if keep_full_grad:
            self.flat_grad = torch.zeros_like(self.flat)
            self._grad_views = self._views(self.flat_grad)
            self._attach_grad_views()
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
    def _attach_grad_views(self) -> None:
        """Make every parameter's ``.grad`` its view into ``flat_grad`` again where something replaced it (a hook, a
        ``zero_grad(set_to_none=True)``); a per-step call, so the views are made once and compared by identity."""
        for p, view in zip(self.params, self._grad_views, strict=True):
            if p.grad is not view:
                p.grad = view

    def params_with_own_grad(self) -> list[int]:
        """The parameters whose ``.grad`` is a tensor of their own, not one that autograd accumulated into in place:
        any ``.grad`` at ZeRO-2, one that replaced its view into ``flat_grad`` at ZeRO-1 (a gradient set by hand, as
        the tensor-parallel wrapper and torch's zero-bubble schedules do)."""
        if self.flat_grad is None:
            return [i for i, p in enumerate(self.params) if p.grad is not None]
        return [i for i, (p, view) in enumerate(zip(self.params, self._grad_views, strict=True))
                if p.grad is not None and p.grad is not view]

    def full_local_grad(self) -> Tensor:
        """This rank's local (not yet reduced) gradients as one full flat buffer.

        ZeRO-1: the persistent buffer (re-attached if something replaced a ``.grad``); ZeRO-2: a transient buffer
        assembled from the parameters' ``.grad`` (missing gradients count as zero), freed after the reduce-scatter.
        """
        if self.flat_grad is not None:
            for p, view in zip(self.params, self._grad_views, strict=True):
                if p.grad is view:
                    continue
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view
            return self.flat_grad
        full = torch.zeros_like(self.flat)
        for p, view in zip(self.params, self._views(full), strict=True):
            if p.grad is not None:
                view.copy_(p.grad)
        return full

    def release_full_grad(self) -> None:
        """After the reduce-scatter: ZeRO-2 drops the parameters' full gradients; ZeRO-1 zeroes the slots other ranks
        own (their local values are spent), so a further backward accumulates from zero there."""
        if self.flat_grad is None:
            for p in self.params:
                p.grad = None
            return
        start, end = self.shard_range
        self.flat_grad[:start].zero_()
        self.flat_grad[end:].zero_()

    def zero_grad(self) -> None:
        if self.flat_grad is not None:
            self.flat_grad.zero_()
            self._attach_grad_views()
        else:
            for p in self.params:
                p.grad = None
            assert self.shard_param.grad is not None
            self.shard_param.grad.zero_()


def hook_trainable(shards: list[FlatShard], hook: Callable[[int, int, Tensor], None],
                   trainable: tuple[bool, ...], handles: list[Any]) -> tuple[tuple[bool, ...], list[Any]]:
    """``hook(s, i, param)`` as a post-accumulate-grad hook on every parameter of ``shards`` that takes gradients
    (torch refuses a hook on a frozen one), made again -- the old ``handles`` removed -- only when that set changed
    since ``trainable``. Returns the set and the handles (those given, when nothing changed)."""
    now = tuple(p.requires_grad for shard in shards for p in shard.params)
    if now == trainable:
        return trainable, handles
    for handle in handles:
        handle.remove()
    return now, [p.register_post_accumulate_grad_hook(partial(hook, s, i))
                 for s, shard in enumerate(shards) for i, p in enumerate(shard.params) if p.requires_grad]

