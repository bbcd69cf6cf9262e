"""Gradient norms as one device would compute them, under every layout: :func:`grad_norm`.

Lightning's ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` reads each parameter's ``.grad``. Under the
library's layouts a rank does not hold the whole averaged gradient there: the flat ZeRO-1 keeps this rank's slice of
the averaged gradient in each ``.grad`` (the rest zero), the flat ZeRO-2 none (``.grad`` is ``None``), ZeRO-3 and
tensor parallelism hold DTensor shards (whose norms Lightning's function cannot stack), and a pipeline rank holds its
stage's parameters only. :func:`grad_norm` takes every rank's part -- the reduced flat shards of the ZeRO optimizers,
a DTensor's local shard, a replica's whole gradient -- weighs what several ranks hold alike once, and gathers them
over the world (one ``all_gather_object`` per call: every rank must call it, as every rank runs a module's hooks).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["grad_norm"]

_Part = tuple[str, float, int]  # (kind: "flat" | "copy", this rank's sum of |g|^p or max |g|, distinct shards)


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's gradient norm and the total norm, keyed as Lightning's ``grad_norm`` keys them
    (``grad_{p}_norm{sep}{name}``, ``grad_{p}_norm_total``), with one device's values under every layout of the
    library: for ``on_before_optimizer_step`` (the gradients of the step, reduced), e.g.
    ``self.log_dict(lightning_parallel.grad_norm(self, norm_type=2))``. A collective over the world when the module's
    strategy runs several ranks: call it on every rank. Under the flat ZeRO-1/2 optimizers before the step's
    gradients are reduced (``on_after_backward``) it raises. ``lp_zero_offload`` (DeepSpeed holds the gradient
    partitions) has none to read."""
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    name_of = {id(q): name for name, q in module.named_parameters()}
    parts: dict[str, _Part] = {}
    covered: set[int] = set()
    for optimizer in getattr(strategy, "optimizers", None) or []:
        _flat_parts(optimizer, p, name_of, parts, covered)
    for name, q in module.named_parameters():
        if id(q) not in covered and q.grad is not None:
            parts[name] = _copy_part(q.grad, p)
    ranks = [parts]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(ranks, parts)
    norms: dict[str, float] = {}  # name -> sum of |g|^p over the whole gradient (inf: max |g|)
    holders: dict[str, int] = {}
    for rank_parts in ranks:
        for name, (kind, _, _) in rank_parts.items():
            holders[name] = holders.get(name, 0) + (kind == "copy")
    for rank_parts in ranks:
        for name, (kind, value, distinct) in rank_parts.items():
            if math.isinf(p):
                norms[name] = max(norms.get(name, 0.0), value)
            else:  # a whole copy (or one of `distinct` DTensor shards) is held by `holders / distinct` ranks alike
                share = value * distinct / holders[name] if kind == "copy" else value
                norms[name] = norms.get(name, 0.0) + share
    if not norms:
        return {}
    out = {f"grad_{p}_norm{group_separator}{name}": torch.tensor(_root(value, p), dtype=torch.float32)
           for name, value in norms.items()}
    total = max(norms.values()) if math.isinf(p) else sum(norms.values())
    out[f"grad_{p}_norm_total"] = torch.tensor(_root(total, p), dtype=torch.float32)
    return out


def _root(value: float, p: float) -> float:
    return value if math.isinf(p) else value ** (1.0 / p)


def _measure(t: Tensor, p: float, weight: Tensor | None = None) -> float:
    """``max |t|`` (p = inf) or ``sum weight |t|^p`` of ``t``, in float64."""
    if t.numel() == 0:
        return 0.0
    values = t.detach().double().abs()
    if math.isinf(p):
        return float(values.max())
    powered = values.pow(p)
    if weight is not None:
        powered = powered * weight.double()
    return float(powered.sum())


def _flat_parts(optimizer: Any, p: float, name_of: dict[int, str], parts: dict[str, _Part],
                covered: set[int]) -> None:
    """The reduced flat shards of a ZeRO-1/2 optimizer (one that names its module parameters): each element of the
    averaged gradient lies in one dp rank's shard, weighted ``1/t`` where tensor-parallel ranks hold it alike."""
    model_parameters = getattr(optimizer, "model_parameters", None)
    shards = getattr(optimizer, "shards", None)
    if not callable(model_parameters) or shards is None:
        return
    params = model_parameters()
    covered.update(id(q) for q in params)
    if not optimizer._grads_reduced:
        raise ValueError(
            "lightning_parallel.grad_norm reads the step's reduced gradient, which the ZeRO-1/2 optimizer does not "
            "hold yet (each rank holds its own, not yet averaged). Fix: call it in on_before_optimizer_step.")
    weights = getattr(optimizer, "_weights", None)
    offset = 0
    for s, shard in enumerate(shards):
        grad = shard.shard_param.grad
        for i, lo, hi in optimizer._spans[s]:
            name = name_of.get(id(params[offset + i]))
            if name is None or grad is None:
                continue
            value = _measure(grad[lo:hi], p, weights[s][lo:hi] if weights is not None else None)
            _, before, _ = parts.get(name, ("flat", 0.0, 1))
            parts[name] = ("flat", max(before, value) if math.isinf(p) else before + value, 1)
        offset += len(shard.params)


def _copy_part(grad: Tensor, p: float) -> _Part:
    """A gradient this rank holds whole (a replica's) or as one of a DTensor's shards (``distinct`` of them over its
    mesh; replicated mesh dimensions hold copies)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    if not isinstance(grad, DTensor):
        return ("copy", _measure(grad, p), 1)
    if any(isinstance(placement, Partial) for placement in grad.placements):
        return ("copy", _measure(grad.full_tensor(), p), 1)  # a collective over its mesh, as every holder calls it
    distinct = 1
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Shard):
            distinct *= grad.device_mesh.size(dim)
    return ("copy", _measure(grad._local_tensor, p), distinct)  # type: ignore[attr-defined]
