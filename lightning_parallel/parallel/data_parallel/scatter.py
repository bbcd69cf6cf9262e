"""Scatter: split a batch along its sample dimension into one slice per device (forward exchange 1 of DP).

The batch may be a tensor or any nesting of tuples, lists, named tuples, dicts and dataclasses. The *sample count*
``B`` is the leading dimension of the first tensor (depth-first) with at least one dimension. Every tensor whose
leading dimension is ``B`` is split into contiguous slices of sizes :func:`split_sizes` ``(B, N)`` (balanced: sizes
differ by at most one, the larger ones first; with ``B < N`` only ``B`` slices of one sample, so fewer replicas run);
so is a list of ``B`` strings (what the default collate makes of per-sample strings: ids, texts). Every other
tensor (a mask, a lookup table, a 0-dim scalar) is sent whole to every device, and other non-tensor leaves are
shared. Slice ``i`` goes to ``devices[i]``; slice 0 stays where the batch is (device 0) and is not counted, the
others are copied (also on CPU, so the CPU path makes the same memory traffic as GPUs) and counted as
:data:`SCATTER_INPUTS`. The copies are autograd-aware
(``Tensor.to``), so an input that requires grad receives its gradient back on device 0 in backward.

No Lightning import here.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_parallel.parallel.counters import SCATTER_INPUTS, CommCounter, tensor_bytes

__all__ = ["find_sample_count", "scatter", "send", "split_sizes"]


def split_sizes(total: int, parts: int) -> list[int]:
    """Balanced slice sizes of ``total`` samples over at most ``parts`` devices, zero-sized slices dropped.

    ``split_sizes(10, 3) == [4, 3, 3]``, ``split_sizes(1, 2) == [1]``, ``split_sizes(0, 2) == []``.
    """
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1 (the number of devices).")
    base, extra = divmod(total, parts)
    sizes = [base + (1 if i < extra else 0) for i in range(parts)]
    return [s for s in sizes if s > 0]


def find_sample_count(batch: Any) -> int | None:
    """The leading dimension of the first tensor (depth-first) with ``dim >= 1``; None when there is none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() >= 1 else None
    for child in _children(batch):
        found = find_sample_count(child)
        if found is not None:
            return found
    return None


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, Mapping):
        return list(obj.values())
    if isinstance(obj, (tuple, list)):
        return list(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return []


def send(tensor: torch.Tensor, device: torch.device, *, copy_data: bool) -> torch.Tensor:
    """``tensor`` on ``device``; a real copy when ``copy_data`` (a transfer to replica ``i >= 1``), autograd-aware."""
    return tensor.to(device, copy=copy_data)


def _rebuild(obj: Any, parts: list[list[Any]]) -> list[Any]:
    """``parts[k][i]`` is child ``k``'s value for replica ``i``; rebuild ``obj``'s container type per replica."""
    n = len(parts[0]) if parts else 0
    per_replica = [[p[i] for p in parts] for i in range(n)]
    if isinstance(obj, Mapping):
        keys = list(obj.keys())
        try:
            return [type(obj)(zip(keys, values, strict=True)) for values in per_replica]  # type: ignore[call-arg]
        except TypeError:
            return [dict(zip(keys, values, strict=True)) for values in per_replica]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return [type(obj)(*values) for values in per_replica]
    if isinstance(obj, (tuple, list)):
        return [type(obj)(values) for values in per_replica]
    out = []
    for values in per_replica:  # dataclass: a shallow copy with the fields replaced (works for frozen ones too)
        clone = copy.copy(obj)
        for f, v in zip(dataclasses.fields(obj), values, strict=True):
            object.__setattr__(clone, f.name, v)
        out.append(clone)
    return out


def _scatter_obj(obj: Any, sizes: Sequence[int], devices: Sequence[torch.device], total: int,
                 moved: list[int]) -> list[Any]:
    n = len(sizes)
    if isinstance(obj, torch.Tensor):
        pieces = list(torch.split(obj, list(sizes))) if obj.dim() >= 1 and obj.shape[0] == total else [obj] * n
        out = [send(piece, devices[i], copy_data=i > 0) for i, piece in enumerate(pieces)]
        moved[0] += sum(tensor_bytes(piece) for piece in pieces[1:])
        return out
    if isinstance(obj, list) and len(obj) == total and obj and all(isinstance(e, str) for e in obj):
        starts = [sum(sizes[:i]) for i in range(n)]  # collated per-sample strings (ids, texts): split like tensors
        return [obj[start:start + size] for start, size in zip(starts, sizes, strict=True)]
    children = _children(obj)
    if not children and not (isinstance(obj, (Mapping, tuple, list))):
        return [obj] * n
    parts = [_scatter_obj(child, sizes, devices, total, moved) for child in children]
    if not parts:
        return [copy.copy(obj) for _ in range(n)]
    return _rebuild(obj, parts)


def scatter(batch: Any, devices: Sequence[torch.device], *, counter: CommCounter | None = None,
            ) -> tuple[list[Any], list[int]]:
    """Split ``batch`` into per-device slices; returns ``(slices, sizes)`` with ``len(slices) <= len(devices)``.

    A batch with no tensor of ``dim >= 1`` cannot be split: it runs whole on device 0 alone (``([batch], [1])``).
    An empty batch (``B == 0``) gives one empty slice (``sizes == [0]``).
    """
    if not devices:
        raise ValueError("scatter needs at least one device.")
    total = find_sample_count(batch)
    if total is None:
        return [batch], [1]
    sizes = split_sizes(total, len(devices)) or [0]
    moved = [0]
    slices = _scatter_obj(batch, sizes, devices, total, moved)
    if counter is not None and len(sizes) > 1:
        counter.record(SCATTER_INPUTS, moved[0])
    return slices, sizes
