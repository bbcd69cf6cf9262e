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

_Part = tuple[str, float, int, bool]
"""(kind: "flat" | "copy", this rank's sum of |g|^p or max |g|, distinct shards, the parameter got a gradient)"""


class _Parts:
    """This rank's parts, measured on the device and read to the host once (:meth:`read`)."""

    def __init__(self, p: float) -> None:
        self.p = p
        self.meta: dict[str, tuple[str, int, bool]] = {}  # name -> (kind, distinct, used)
        self.values: dict[str, list[Tensor]] = {}  # name -> measured 0-d float64 tensors (summed, or max for inf)

    def add(self, name: str, kind: str, value: Tensor | None, distinct: int = 1, used: bool = True) -> None:
        _, _, seen = self.meta.get(name, (kind, distinct, False))
        self.meta[name] = (kind, distinct, seen or used)
        if value is not None:
            self.values.setdefault(name, []).append(value)

    def _combined(self, measured: list[Tensor]) -> Tensor:
        stacked = torch.stack(measured)
        return stacked.max() if math.isinf(self.p) else stacked.sum()

    def read(self) -> dict[str, _Part]:
        names = list(self.meta)
        values = [self._combined(self.values[n]) if n in self.values else None for n in names]
        present = [v for v in values if v is not None]
        read = iter(torch.stack(present).cpu().tolist() if present else [])  # one copy to the host
        return {n: (self.meta[n][0], next(read) if v is not None else 0.0, self.meta[n][1], self.meta[n][2])
                for n, v in zip(names, values, strict=True)}


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's gradient norm and the total norm, keyed as Lightning's ``grad_norm`` keys them
    (``grad_{p}_norm{sep}{name}``, ``grad_{p}_norm_total``), with one device's values under every layout of the
    library: for ``on_before_optimizer_step`` (the gradients of the step, reduced), e.g.
    ``self.log_dict(lightning_parallel.grad_norm(self, norm_type=2))``. A collective over the world when the module's
    strategy runs several ranks: call it on every rank. Under the flat ZeRO-1/2 optimizers before the step's
    gradients are reduced (``on_after_backward``) it raises; there a parameter given a gradient but in no optimizer
    is left out (nothing averages its gradient). ``lp_zero_offload`` (DeepSpeed holds the gradient partitions) has
    none to read."""
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    name_of = {id(q): name for name, q in module.named_parameters()}
    parts = _Parts(p)
    covered: set[int] = set()
    flat = False
    for optimizer in getattr(strategy, "optimizers", None) or []:
        flat |= _flat_parts(optimizer, name_of, parts, covered)
    for name, q in module.named_parameters():
        if id(q) not in covered and q.grad is not None and not flat:
            _copy_part(name, q.grad, parts)
    mine = parts.read()
    ranks = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(ranks, mine)
    used = {name for rank_parts in ranks for name, part in rank_parts.items() if part[3]}
    holders: dict[str, int] = {}
    for rank_parts in ranks:
        for name, (kind, _, _, _) in rank_parts.items():
            holders[name] = holders.get(name, 0) + (kind == "copy")
    norms: dict[str, float] = {}  # name -> sum of |g|^p over the whole gradient (inf: max |g|)
    for rank_parts in ranks:
        for name, (kind, value, distinct, _) in rank_parts.items():
            if name not in used:  # in a flat shard, but no rank gave it a gradient (one device: .grad is None)
                continue
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


def _measure(t: Tensor, p: float, weight: Tensor | None = None) -> Tensor:
    """``max |t|`` (p = inf) or ``sum weight |t|^p`` of ``t``: a 0-d float64 tensor on ``t``'s device."""
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    if math.isinf(p):
        return torch.linalg.vector_norm(t, math.inf, dtype=torch.float64)
    if weight is None:
        return torch.linalg.vector_norm(t, p, dtype=torch.float64).pow(p)
    return (t.double().abs().pow(p) * weight.to(t.device, torch.float64)).sum()


def _flat_parts(optimizer: Any, name_of: dict[int, str], parts: _Parts, covered: set[int]) -> bool:
    """The reduced flat shards of a ZeRO-1/2 optimizer (its ``reduced_gradient_pieces()``): each element of the
    averaged gradient lies in one dp rank's shard, weighted where tensor-parallel ranks hold it alike; and whether
    this rank gave each parameter a gradient. False for other optimizers."""
    pieces_of = getattr(optimizer, "reduced_gradient_pieces", None)
    if not callable(pieces_of):
        return False
    covered.update(id(q) for q in optimizer.model_parameters())
    try:
        pieces = pieces_of()
    except ValueError as err:
        raise ValueError(f"lightning_parallel.grad_norm reads the step's reduced gradient: {err}") from None
    for param, used, grad, weight in pieces:
        name = name_of.get(id(param))
        if name is not None:
            parts.add(name, "flat", None if grad is None else _measure(grad, parts.p, weight), used=used)
    return True


def _copy_part(name: str, grad: Tensor, parts: _Parts) -> None:
    """A gradient this rank holds whole (a replica's) or as one of a DTensor's shards (``distinct`` of them over its
    mesh; replicated mesh dimensions hold copies)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    if not isinstance(grad, DTensor):
        parts.add(name, "copy", _measure(grad, parts.p))
        return
    if any(isinstance(placement, Partial) for placement in grad.placements):
        parts.add(name, "copy", _measure(grad.full_tensor(), parts.p))  # a collective over its mesh: all holders
        return
    distinct = 1
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Shard):
            distinct *= grad.device_mesh.size(dim)
    parts.add(name, "copy", _measure(grad._local_tensor, parts.p), distinct)  # type: ignore[attr-defined]
