"""Gather: bring the replicas' outputs to device 0 and combine them (forward exchange 3, backward exchange 4 of DP).

:func:`gather` walks the replicas' outputs (tensors inside any nesting of dicts, lists, tuples, named tuples) and
combines each leaf so the result equals what one device computes on the whole batch, when replica ``i`` processed
``n_i`` of the ``B`` samples:

* a tensor whose leading dimension is ``n_i`` on every replica (per-sample outputs: predictions, logits) is
  **concatenated** along dim 0 on device 0;
* any other floating tensor (a 0-dim loss or metric, a per-class vector) is a **mean over the slice** and is
  combined as the weighted mean ``sum_i (n_i / B) * x_i``; with ``reduction="sum"`` (a loss summed, not averaged,
  over the samples) as the plain sum. Keys named in ``reduce_keys`` (``"loss"``) are always combined this way;
* an integer or bool 0-dim tensor (a count) is summed; a Python float is a weighted mean; any other leaf (ints,
  strings, None, objects) is taken from replica 0.

The transfer is one autograd function, :class:`_Gather`: forward moves the replicas' tensors to device 0
(:data:`GATHER_OUTPUTS`); its backward splits the incoming gradient (for a loss: ``dL/dx_i = n_i / B``)
and sends each piece back to its replica's device (:data:`SCATTER_GRAD`), where the replica's backward
continues. No Lightning import here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightning_parallel.parallel.counters import GATHER_OUTPUTS, SCATTER_GRAD, CommCounter, tensor_bytes

from .replicate import LeafReplicas

__all__ = ["BackwardPlan", "Reduction", "gather", "gather_tensors"]

Reduction = Literal["mean", "sum"]


class _Gather(torch.autograd.Function):
    """``(x_0 on device 0, ..., x_{N-1} on device N-1) -> the x_i on device 0``; backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, destination: torch.device, counter: CommCounter | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.devices, ctx.counter = [t.device for t in tensors], counter
        return tuple(t if i == 0 else t.to(destination, copy=True) for i, t in enumerate(tensors))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        out = [g if (g is None or i == 0) else g.to(ctx.devices[i], copy=True) for i, g in enumerate(grads)]
        if ctx.counter is not None and len(grads) > 1:
            ctx.counter.record(SCATTER_GRAD, sum(tensor_bytes(g) for g in grads[1:] if g is not None))
        return (None, None, *out)


@dataclass
class BackwardPlan:
    """The ``threads`` backward mode: replicas with their own leaves, and a runner for ``fn(i)`` in threads.

    The loss gathered through :class:`_GatherThenBackward` is the only way back into the replicas: its backward
    sends each replica its loss gradient (:data:`SCATTER_GRAD`), runs the ``N`` replica backward passes
    concurrently (``run``), and returns the reduced leaf gradients (:data:`REDUCE_GRADS`) as the
    gradients of the master parameters.
    """

    replicas: LeafReplicas[Any]
    run: Callable[[Callable[[int], None], int], Any]
    counter: CommCounter | None = None
    used: bool = False


class _GatherThenBackward(torch.autograd.Function):
    """``(master params) -> the replicas' tensors on device 0``; backward runs the replicas' backward in threads."""

    @staticmethod
    def forward(ctx: Any, plan: BackwardPlan, destination: torch.device, tensors: tuple[torch.Tensor, ...],
                *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.plan, ctx.tensors, ctx.destination = plan, tensors, destination
        return tuple(t.detach().to(destination, copy=i > 0) for i, t in enumerate(tensors))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan, tensors = ctx.plan, ctx.tensors
        sent = [g if (g is None or i == 0) else g.to(t.device, copy=True)
                for i, (t, g) in enumerate(zip(tensors, grads, strict=True))]
        if plan.counter is not None and len(grads) > 1:
            plan.counter.record(SCATTER_GRAD, sum(tensor_bytes(g) for g in grads[1:] if g is not None))

        def replica_backward(i: int) -> None:
            if sent[i] is not None and tensors[i].requires_grad:
                torch.autograd.backward(tensors[i], sent[i])

        plan.run(replica_backward, len(tensors))
        ctx.tensors = None  # the replica graphs are spent
        return (None, None, None, *plan.replicas.reduce_grads(ctx.destination, plan.counter))


def gather_tensors(tensors: Sequence[torch.Tensor], destination: torch.device, *,
                   counter: CommCounter | None = None, plan: BackwardPlan | None = None) -> list[torch.Tensor]:
    """The tensors moved to ``destination`` (tensor 0 is already there); autograd-aware, not counted here.

    With a ``plan`` (``threads`` backward) the first differentiable gather of a step goes through
    :class:`_GatherThenBackward`; later ones are detached (Lightning differentiates only the loss).
    """
    differentiable = any(t.requires_grad for t in tensors) and torch.is_grad_enabled()
    if plan is not None and differentiable:
        if plan.used:
            return [t.detach().to(destination, copy=i > 0) for i, t in enumerate(tensors)]
        plan.used = True
        return list(_GatherThenBackward.apply(plan, destination, tuple(tensors), *plan.replicas.params))
    if len(tensors) == 1:
        return [tensors[0].to(destination)]
    if differentiable:
        return list(_Gather.apply(destination, counter, *tensors))
    return [t if i == 0 else t.detach().to(destination, copy=True) for i, t in enumerate(tensors)]


class _Combiner:
    def __init__(self, sizes: Sequence[int], destination: torch.device, reduction: Reduction,
                 reduce_keys: tuple[str, ...], counter: CommCounter | None, plan: BackwardPlan | None) -> None:
        self.sizes, self.destination, self.reduction = list(sizes), destination, reduction
        self.reduce_keys, self.counter, self.plan = reduce_keys, counter, plan
        total = sum(self.sizes)
        self.weights = [s / total for s in self.sizes] if total else [1 / len(self.sizes)] * len(self.sizes)
        self.moved = 0

    def combine(self, values: list[Any], *, force_reduce: bool = False) -> Any:
        first = values[0]
        if isinstance(first, torch.Tensor):
            return self._tensor(values, force_reduce)
        if isinstance(first, Mapping):  # the loss first: it is the output that backward goes through
            keys = sorted(first, key=lambda k: k not in self.reduce_keys)
            done = {k: self.combine([v[k] for v in values], force_reduce=k in self.reduce_keys) for k in keys}
            return type(first)({k: done[k] for k in first})  # type: ignore[call-arg]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*(self.combine(list(col)) for col in zip(*values, strict=True)))
        if isinstance(first, (tuple, list)):
            return type(first)(self.combine(list(col)) for col in zip(*values, strict=True))
        if isinstance(first, float):
            return sum(w * float(v) for w, v in zip(self.weights, values, strict=True))
        return first

    def _tensor(self, values: list[Any], force_reduce: bool) -> torch.Tensor:
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise TypeError(f"replicas returned different types for one output: {[type(v).__name__ for v in values]}")
        self.moved += sum(tensor_bytes(v) for v in values[1:])
        moved = gather_tensors(values, self.destination, counter=self.counter, plan=self.plan)
        per_sample = all(v.dim() >= 1 and v.shape[0] == n for v, n in zip(values, self.sizes, strict=True))
        if per_sample and not force_reduce:
            return torch.cat(moved, dim=0)
        if not moved[0].is_floating_point() and not moved[0].is_complex():
            return torch.stack(moved).sum(0) if moved[0].dim() == 0 else moved[0]
        if self.reduction == "sum":
            return torch.stack(moved).sum(0)
        total = moved[0] * self.weights[0]
        for w, v in zip(self.weights[1:], moved[1:], strict=True):
            total = total + v * w
        return total


def gather(outputs: Sequence[Any], sizes: Sequence[int], destination: torch.device, *,
           reduction: Reduction = "mean", reduce_keys: tuple[str, ...] = ("loss",),
           force_reduce: bool = False, counter: CommCounter | None = None,
           plan: BackwardPlan | None = None) -> Any:
    """Combine the replicas' ``outputs`` (replica ``i`` processed ``sizes[i]`` samples) on ``destination``.

    Args:
        outputs: one output per replica, all of the same structure.
        sizes: samples per replica (the weights of the means).
        destination: device 0.
        reduction: how a mean-like leaf combines: ``mean`` (weighted by sizes, the default) or ``sum``.
        reduce_keys: dict keys that are always reduced, never concatenated (the loss).
        force_reduce: reduce the top-level tensor (a ``training_step`` that returns its loss tensor).
        counter: where the output transfer is counted (:data:`GATHER_OUTPUTS`), one call per gather.
        plan: the replicas of a ``threads``-backward step (from :func:`~.replicate.replicate_leaves`); None for the
            ``graph`` mode (or no gradients).
    """
    if len(outputs) != len(sizes) or not outputs:
        raise ValueError(f"gather got {len(outputs)} outputs for {len(sizes)} slices.")
    if all(o is None for o in outputs):
        return None
    if any(o is None for o in outputs):
        raise ValueError("some replicas returned None and others did not; a step must skip (return None) on all "
                         "slices or on none.")
    combiner = _Combiner(sizes, destination, reduction, reduce_keys, counter, plan)
    result = combiner.combine(list(outputs), force_reduce=force_reduce)
    if counter is not None and len(outputs) > 1:
        counter.record(GATHER_OUTPUTS, combiner.moved)
    return result
