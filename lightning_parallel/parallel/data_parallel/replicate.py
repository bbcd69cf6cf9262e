"""Replicate: autograd-aware copies of a module on every device (forward exchange 2, backward exchange 5 of DP).

``replicate(module, devices)`` returns one shallow copy of the module tree per device, built like torch's
``nn.parallel.replicate`` (``Module._replicate_for_data_parallel``: each replica shares the Python attributes of its
original, has no ``Parameter`` of its own, and holds plain tensors in place of the parameters). Where gradients are
on, the tensors are outputs of one autograd function, :class:`_Replicate`:

* forward (:data:`REPLICATE_PARAMS`): replica 0 uses the master parameters on device 0 as they are;
  replicas ``1..N-1`` get copies of the latest weights (made every step, so they see the last optimizer step);
* backward (:data:`REDUCE_GRADS`): called once, when every replica's backward is done, it sums each
  parameter's gradients on device 0 in replica order (``g_0 + g_1 + ... + g_{N-1}``), so the master parameters'
  ``.grad`` is the total and the optimizer steps once on device 0. A parameter no replica used keeps ``grad=None``,
  exactly as on one device.

Buffers are not differentiated: replica 0 shares the master's buffers (a BatchNorm's running statistics are updated
from device 0's slice), replicas ``1..N-1`` get detached copies whose updates are dropped after the step. Without
gradients (evaluation, ``torch.no_grad``/``inference_mode``) the copies are plain detached copies.

:func:`replicate_leaves` is the other way (the engine's ``threads`` backward mode): the replicas' trainable
parameters are their own autograd leaves (replica 0: detached aliases of the master parameters, no copy), so each
replica's backward can run on its own thread; :meth:`LeafReplicas.reduce_grads` then sums the leaf gradients on
device 0 in replica order -- the same exchange 5, the same numbers.

torch's own ``replicate`` (coalesced ``Broadcast``/``ReduceAddCoalesced``) refuses CPU tensors, materializes zero
gradients for unused parameters, and cannot count; this path makes per-tensor copies with ``Tensor.to`` on any device
type. No Lightning import here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from lightning_parallel.parallel.counters import REDUCE_GRADS, REPLICATE_PARAMS, CommCounter, tensor_bytes

__all__ = ["LeafReplicas", "replicate", "replicate_leaves"]

M = TypeVar("M", bound=nn.Module)


class _Replicate(torch.autograd.Function):
    """``(params) -> (params on device 0, copies on device 1, ..., copies on device N-1)``; backward sums."""

    @staticmethod
    def forward(ctx: Any, devices: Sequence[torch.device], counter: CommCounter | None,
                *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.num_params, ctx.source, ctx.counter = len(params), devices[0], counter
        outputs: list[torch.Tensor] = list(params)
        for device in devices[1:]:
            outputs.extend(p.to(device, copy=True) for p in params)
        return tuple(outputs)  # the forward bytes are counted by replicate(), with the buffers

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        p = ctx.num_params
        moved, reduced = 0, []
        for k in range(p):
            total: torch.Tensor | None = None
            for i, g in enumerate(grads[k::p]):  # replica order: device 0 first
                if g is None:
                    continue
                moved += tensor_bytes(g) if i > 0 else 0
                g = g.to(ctx.source)
                total = g if total is None else total + g
            reduced.append(total)
        if ctx.counter is not None and len(grads) > p:
            ctx.counter.record(REDUCE_GRADS, moved)
        return (None, None, *reduced)


def _copy_tensors(tensors: Sequence[torch.Tensor], devices: Sequence[torch.device], *, differentiable: bool,
                  counter: CommCounter | None) -> list[list[torch.Tensor]]:
    """``out[i][k]``: tensor ``k`` for replica ``i`` (replica 0: the tensor itself, or a differentiable alias)."""
    n, count = len(devices), len(tensors)
    if not tensors:
        return [[] for _ in devices]
    if differentiable:
        flat = list(_Replicate.apply(devices, counter, *tensors))
    else:
        flat = list(tensors) + [t.detach().to(d, copy=True) for d in devices[1:] for t in tensors]
    return [flat[i * count:(i + 1) * count] for i in range(n)]


def _wire(modules: list[nn.Module], copies: list[nn.Module], tensors: dict[int, torch.Tensor], kind: str) -> None:
    """Point each replica's children, parameters (``kind='param'``) or buffers at the replica's own objects."""
    index = {id(m): i for i, m in enumerate(modules)}
    for module, replica in zip(modules, copies, strict=True):
        if kind == "module":
            for key, child in module._modules.items():
                replica._modules[key] = None if child is None else copies[index[id(child)]]
        elif kind == "param":
            for key, param in module._parameters.items():
                # a plain tensor attribute, as torch's replicate does: the replica owns no Parameter
                object.__setattr__(replica, key, None if param is None else tensors[id(param)])
        else:
            for key, buf in module._buffers.items():
                replica._buffers[key] = None if buf is None else tensors[id(buf)]


@dataclass
class LeafReplicas(Generic[M]):
    """Replicas whose trainable parameters are their own autograd leaves (the ``backward="threads"`` mode).

    ``leaves[i][k]`` is replica ``i``'s leaf for ``params[k]`` (replica 0: a detached alias of the master parameter,
    no copy; others: copies on their device). Each replica's backward fills its leaves' ``.grad``;
    :meth:`reduce_grads` sums them on device 0 (:data:`REDUCE_GRADS`).
    """

    replicas: list[M]
    leaves: list[list[torch.Tensor]]
    params: list[torch.Tensor]

    def reduce_grads(self, destination: torch.device, counter: CommCounter | None) -> list[torch.Tensor | None]:
        """Per master parameter: the sum of the replicas' leaf gradients, in replica order (None if unused)."""
        moved, reduced = 0, []
        for k in range(len(self.params)):
            total: torch.Tensor | None = None
            for i, leaves in enumerate(self.leaves):
                g = leaves[k].grad
                if g is None:
                    continue
                moved += tensor_bytes(g) if i > 0 else 0
                g = g.to(destination)
                total = g if total is None else total + g
            reduced.append(total)
        if counter is not None and len(self.leaves) > 1:
            counter.record(REDUCE_GRADS, moved)
        return reduced


def _leaf_copies(params: Sequence[torch.Tensor], devices: Sequence[torch.device]) -> list[list[torch.Tensor]]:
    first = [p.detach().requires_grad_(True) for p in params]
    return [first] + [[p.detach().to(d, copy=True).requires_grad_(True) for p in params] for d in devices[1:]]


def _build(module: M, devices: Sequence[torch.device], counter: CommCounter | None, differentiable: bool,
           leaves: bool) -> tuple[list[M], list[list[torch.Tensor]], list[torch.Tensor]]:
    params = list(module.parameters())
    grad_params = [p for p in params if p.requires_grad and differentiable]
    plain_params = [p for p in params if not (p.requires_grad and differentiable)]
    buffers = list(module.buffers())
    grad_copies = (_leaf_copies(grad_params, devices) if leaves
                   else _copy_tensors(grad_params, devices, differentiable=True, counter=counter))
    per_device = list(zip(
        grad_copies,
        _copy_tensors(plain_params, devices, differentiable=False, counter=None),
        _copy_tensors(buffers, devices, differentiable=False, counter=None), strict=True,
    ))
    if counter is not None and len(devices) > 1:
        nbytes = sum(tensor_bytes(t) for t in params + buffers)
        counter.record(REPLICATE_PARAMS, nbytes * (len(devices) - 1))
    modules = list(module.modules())
    result: list[M] = []
    for g, q, b in per_device:
        copies = [m._replicate_for_data_parallel() for m in modules]
        param_map = {id(p): t for p, t in zip([*grad_params, *plain_params], g + q, strict=True)}
        buffer_map = {id(x): t for x, t in zip(buffers, b, strict=True)}  # replica 0 shares the master's buffers
        _wire(modules, copies, {}, "module")
        _wire(modules, copies, param_map, "param")
        _wire(modules, copies, buffer_map, "buffer")
        result.append(copies[0])  # type: ignore[arg-type]
    return result, [list(g) for g in grad_copies], list(grad_params)


def replicate(module: M, devices: Sequence[torch.device], *, counter: CommCounter | None = None,
              differentiable: bool | None = None) -> list[M]:
    """One replica of ``module`` per device, connected to the master parameters by autograd (``graph`` mode).

    ``replicas[0]`` runs on the master parameters (device 0); backward through any replica's output sums the
    gradients into the master ``.grad`` (see :class:`_Replicate`).

    Args:
        module: the master module, on ``devices[0]``.
        devices: one entry per replica (may repeat, e.g. ``[cpu] * N``).
        counter: where the parameter and gradient exchanges are counted.
        differentiable: connect the replicas to the master parameters for backward; default
            ``torch.is_grad_enabled()``.
    """
    if not devices:
        return []
    if differentiable is None:
        differentiable = torch.is_grad_enabled()
    return _build(module, devices, counter, differentiable, leaves=False)[0]


def replicate_leaves(module: M, devices: Sequence[torch.device], *,
                     counter: CommCounter | None = None) -> LeafReplicas[M]:
    """One replica of ``module`` per device with its own leaf parameters (``threads`` backward mode).

    The replicas are *not* connected to the master parameters: each replica's backward runs on its own (in its
    own thread), and :meth:`LeafReplicas.reduce_grads` sums the leaf gradients on device 0. This is what lets the
    replicas' backward passes run in parallel on CPU, where PyTorch's autograd engine runs one backward call on
    the calling thread only.
    """
    replicas, leaves, params = _build(module, devices, counter, True, leaves=True)
    return LeafReplicas(replicas, leaves, params)
