"""Sharded ZeRO checkpoints on disk, and their offline consolidation into one single-device checkpoint.

A sharded checkpoint is a folder: ``meta.pt`` (written by rank 0: everything but the sharded states, plus
``lp_sharded_checkpoint = {"zero_stage", "world_size"}``) and ``rank_XXXXX.pt`` per rank (its
``optimizer_states`` and, at stage 3, its ``state_dict`` shard). :func:`consolidate_checkpoint` joins them without any
process group: stages 1-2 concatenate each group's flat shards (rank order) and cut them back into parameters;
stage 3 concatenates each DTensor ``Shard(0)`` local tensor along dim 0 (FSDP2 shards are contiguous chunks in rank
order). The result has the per-parameter optimizer form and loads on one device. No Lightning import.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["META_FILE", "SHARDED_KEY", "consolidate_checkpoint", "rank_file"]

META_FILE = "meta.pt"
SHARDED_KEY = "lp_sharded_checkpoint"


def rank_file(rank: int) -> str:
    """The file name of rank ``rank``'s part of a sharded checkpoint."""
    return f"rank_{rank:05d}.pt"


def _join_flat(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Stages 1-2: the per-parameter optimizer state from every rank's ``ZeroOptimizer.state_dict()``."""
    first = shards[0]
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for g, (numel, shapes) in enumerate(zip(first["numels"], first["shapes"], strict=True)):
        saved_group = first["optim"]["param_groups"][g]
        ids = list(range(index, index + len(shapes)))
        slots: list[dict[str, Any]] = [{} for _ in shapes]
        for key, value in first["optim"]["state"].get(g, {}).items():
            if isinstance(value, Tensor) and value.dim() == 1:
                full = torch.cat([s["optim"]["state"][g][key] for s in shards])[:numel]
                parts = full.split([math.prod(shape) for shape in shapes])
                for slot, part, shape in zip(slots, parts, shapes, strict=True):
                    slot[key] = part.reshape(shape).clone()
            else:
                for slot in slots:
                    slot[key] = value.clone() if isinstance(value, Tensor) else value
        state.update({i: s for i, s in zip(ids, slots, strict=True) if s})
        groups.append({**saved_group, "params": ids})
        index += len(shapes)
    return {"state": state, "param_groups": groups}


def _cat_dim0(values: list[Any]) -> Any:
    if isinstance(values[0], Tensor) and values[0].dim() > 0:
        return torch.cat(values, dim=0)
    if isinstance(values[0], dict):
        return {k: _cat_dim0([v[k] for v in values]) for k in values[0]}
    return values[0]


def _join_dim0(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Stage 3: the optimizer state from every rank's local (``Shard(0)``) state dict."""
    return {"state": _cat_dim0([s["state"] for s in shards]) if shards[0]["state"] else {},
            "param_groups": shards[0]["param_groups"]}


def _join_model_state(states: list[dict[str, Any]], shapes: dict[str, list[int]] | None) -> dict[str, Any]:
    """Stage 3 weights: entries recorded as dim-0 shards are joined in rank order and checked against their full
    shape; the others (replicated buffers) are taken once. Folders written before the shapes were recorded join
    every tensor entry."""
    if shapes is None:
        return _cat_dim0(states)  # type: ignore[no-any-return]
    out: dict[str, Any] = {}
    for name, value in states[0].items():
        if name not in shapes:
            out[name] = value
            continue
        joined = torch.cat([s[name] for s in states], dim=0)
        if list(joined.shape) != shapes[name]:
            raise ValueError(f"{name}: the joined shards have shape {list(joined.shape)}, but the checkpoint "
                             f"recorded {shapes[name]}; the folder is incomplete or from another layout.")
        out[name] = joined
    return out


def consolidate_checkpoint(sharded_dir: str | Path, out_file: str | Path) -> dict[str, Any]:
    """Write (and return) the single-file, single-device form of a sharded ZeRO checkpoint folder."""
    folder = Path(sharded_dir)
    meta: dict[str, Any] = torch.load(folder / META_FILE, map_location="cpu", weights_only=False)
    info = meta.pop(SHARDED_KEY)
    parts = [torch.load(folder / rank_file(r), map_location="cpu", weights_only=False)
             for r in range(info["world_size"])]
    n_opt = len(parts[0]["optimizer_states"])
    if info["zero_stage"] == 3:
        meta["state_dict"] = _join_model_state([p["state_dict"] for p in parts], info.get("sharded_shapes"))
        join = _join_dim0
    else:
        join = _join_flat
    meta["optimizer_states"] = [join([p["optimizer_states"][i] for p in parts]) for i in range(n_opt)]
    torch.save(meta, out_file)
    return meta
