"""The ``lp_sharded`` format: a folder from ``lp_sharded`` with ``checkpoint="sharded"`` (native backend).

* ``meta.pt`` (rank 0): Lightning's checkpoint dict without ``optimizer_states``, plus
  ``lp_sharded_checkpoint = {"zero_stage", "world_size", "sharded_shapes"}``; at stages 1-2 also the full
  ``state_dict`` (parameters are replicated at those stages, only the optimizer state is sharded);
* ``rank_XXXXX.pt`` (one per rank): ``{"optimizer_states": [this rank's shard]}``, at stage 3 also ``"state_dict"``:
  this rank's FSDP2 ``Shard(0)`` pieces as plain local tensors;
* ``checksums.json`` (rank 0, last): the CRC-32 and size of every file (format version 1).

Here: the collective write (:func:`save`, into ``<name>.partial``, renamed once every rank is done), the per-rank read
on the layout that wrote it (:func:`load`), and the offline reading in one CPU process (:func:`detect`,
:func:`read_full` -- the weights -- and :func:`read_optimizer_states` -- the optimizer in torch's one-device per-index
form; :func:`consolidate_checkpoint` writes both into one file). Everything is read with ``weights_only=True``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import async_save, rng
from ..atomic import disk_errors, fresh_partial, partial_path, replace_with
from ..errors import CheckpointFormatError
from ..names import DCP_METADATA_FILE, META_FILE, RANK_FILE_GLOB, SHARDED_KEY, rank_file
from ..verify import write_manifest
from .common import (
    CheckpointInfo,
    CheckpointStrategy,
    agree_on_failure,
    check_format_version,
    load_torch_file,
    refused_save,
    stamp_format_version,
    strip_wrapper_prefixes,
    tensor_bytes,
    wait_for_background_save,
)

__all__ = [
    "FORMATS",
    "consolidate_checkpoint",
    "detect",
    "join_recorded_shards",
    "join_zero3_shards",
    "load",
    "loaded_as_shards",
    "read_full",
    "read_optimizer_states",
    "save",
]

FORMATS = ("lp_sharded",)


# ---------------------------------------------------------------------------------------------- write
def save(strategy: CheckpointStrategy, checkpoint: dict[str, Any], filepath: Any, *, zero_stage: int,
         shard_ranks: Sequence[int] | None = None, fsdp: bool | None = None) -> None:
    """Write the folder (collective: every rank calls it with its own ``optimizer_states`` and, at stage 3, its
    ``state_dict`` of local shards). ``meta.pt`` is written last, then the folder is renamed into place: a failed
    save never leaves a half folder under the checkpoint's name. ``shard_ranks``: the ranks whose files together
    hold one whole copy (HSDP: one shard group; the other groups hold replicas); None = every rank. ``fsdp``: the
    parameters are FSDP2 ``Shard(0)`` DTensors (each rank writes its local shards); default: at stage 3."""
    fsdp = zero_stage == 3 if fsdp is None else fsdp
    if refused_save(strategy, filepath):
        return
    writer = wait_for_background_save(strategy)  # the save in flight first; a writer: this one in the background
    rng.attach_rng_states(checkpoint)  # every rank's, into meta.pt (a collective)
    stamp_format_version(checkpoint)
    target = Path(strategy.broadcast(str(filepath)))
    path = partial_path(target)
    error: BaseException | None = None
    if strategy.is_global_zero:
        try:
            fresh_partial(target)
        except OSError as err:
            error = err
    agree_on_failure(strategy, error)
    own = {"optimizer_states": checkpoint.pop("optimizer_states", [])}
    if fsdp:
        own["state_dict"] = checkpoint.pop("state_dict")
    if strategy.is_global_zero:
        checkpoint[SHARDED_KEY] = {"zero_stage": zero_stage, "world_size": strategy.world_size,
                                   "sharded_shapes": _sharded_shapes(strategy.lightning_module, fsdp)}
        checkpoint[SHARDED_KEY].update(_sharded_over(strategy.world_size, zero_stage, shard_ranks, fsdp))
    if writer is not None:  # the rest in the background, on copies, the ranks joined on the writer's own group
        writer.group()
        own_copy = async_save.host_copy(own)
        meta = async_save.host_copy(checkpoint) if strategy.is_global_zero else None
        rank = strategy.global_rank

        def write() -> None:
            failure: BaseException | None = None
            try:
                with disk_errors(target, needed=tensor_bytes(own_copy) + tensor_bytes(meta)):
                    torch.save(own_copy, path / rank_file(rank))
            except Exception as err:
                failure = err
            writer.agree(failure, cleanup=path)  # every rank's part stops if one rank's file could not be written
            if meta is not None:  # metadata, then the checksums, last; then the rename
                try:
                    with disk_errors(target, needed=tensor_bytes(meta)):
                        torch.save(meta, path / META_FILE)
                        write_manifest(path)
                        replace_with(path, target)
                except Exception as err:
                    failure = err
            writer.agree(failure, cleanup=path)

        writer.submit(str(target), write)
        return
    try:
        with disk_errors(target, needed=tensor_bytes(own) + (tensor_bytes(checkpoint) if strategy.is_global_zero
                                                              else 0)):
            torch.save(own, path / rank_file(strategy.global_rank))
    except Exception as err:
        error = err
    agree_on_failure(strategy, error, cleanup=path)  # every rank stops if one rank's file could not be written
    if strategy.is_global_zero:  # metadata, then the checksums, last; then the rename
        try:
            with disk_errors(target, needed=tensor_bytes(checkpoint)):
                torch.save(checkpoint, path / META_FILE)
                write_manifest(path)
                replace_with(path, target)
        except Exception as err:
            error = err
    agree_on_failure(strategy, error, cleanup=path)


def _sharded_shapes(module: Any, fsdp: bool) -> dict[str, list[int]]:
    """FSDP2: the full shapes of the state-dict entries that are dim-0 shards (DTensors), so that a reader
    joins exactly those and keeps replicated entries (buffers) once."""
    from torch.distributed.tensor import DTensor

    if not fsdp or module is None:
        return {}
    return {k: list(v.shape) for k, v in module.state_dict().items() if isinstance(v, DTensor)}


# ---------------------------------------------------------------------------------------------- read, same layout
def _sharded_over(world_size: int, zero_stage: int, shard_ranks: Sequence[int] | None,
                  fsdp: bool | None) -> dict[str, Any]:
    """The ``meta.pt`` entries that say how one copy is sharded, beyond the world size and the stage: ``fsdp`` for
    ZeRO-2 over FSDP2 (HSDP; stored like stage 3), ``shard_ranks`` for an HSDP shard group (absent: every rank)."""
    out: dict[str, Any] = {}
    if fsdp and zero_stage != 3:
        out["fsdp"] = True
    if shard_ranks is not None and list(shard_ranks) != list(range(world_size)):
        out["shard_ranks"] = [int(r) for r in shard_ranks]
    return out


def load(strategy: CheckpointStrategy, path: Path, *, zero_stage: int, shard_ranks: Sequence[int] | None = None,
         fsdp: bool | None = None) -> dict[str, Any] | None:
    """``meta.pt`` + this rank's file, as saved, with this rank's RNG states kept for the start of training -- when
    ``path`` is an lp_sharded folder written on this layout (world size, ZeRO stage, and the ranks a copy is sharded
    over: HSDP's shard group against the whole dp axis; ``shard_ranks`` and ``fsdp`` as :func:`save` takes them);
    None for anything else (a file, another layout, another format), which the caller reads through the one-device
    form."""
    meta_file = path / META_FILE
    if not (path.is_dir() and meta_file.is_file() and not (path / DCP_METADATA_FILE).exists()):
        return None
    checkpoint: dict[str, Any] = torch.load(meta_file, map_location="cpu", weights_only=True)
    check_format_version(checkpoint, where=meta_file)
    saved = checkpoint.get(SHARDED_KEY) or {}
    if saved.get("world_size") != strategy.world_size or saved.get("zero_stage") != zero_stage:
        return None
    mine = _sharded_over(strategy.world_size, zero_stage, shard_ranks, fsdp)
    if {key: saved[key] for key in ("fsdp", "shard_ranks") if key in saved} != mine:
        return None  # the same ranks, sharded otherwise (HSDP's groups against the whole dp axis)
    checkpoint.update(torch.load(path / rank_file(strategy.global_rank), map_location="cpu", weights_only=True))
    rng.restore_rng_states(checkpoint, rank=strategy.global_rank, world_size=strategy.world_size,
                           module=strategy.lightning_module)
    return checkpoint


def loaded_as_shards(checkpoint: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint`` came from :func:`load` (this rank's shards) rather than the one-device form."""
    return SHARDED_KEY in checkpoint


# ---------------------------------------------------------------------------------------------- offline read
def detect(folder: Path, *, trusted: bool) -> CheckpointInfo | None:
    """The folder's :class:`CheckpointInfo` if it holds a ``meta.pt`` (None otherwise); refused when that is not an
    lp_sharded ``meta.pt`` or a rank file is missing or left over from another save."""
    meta_file = folder / META_FILE
    if not meta_file.is_file():
        return None
    meta = load_torch_file(meta_file, trusted=trusted, what=f"the {META_FILE} of an lp_sharded checkpoint folder")
    info = meta.get(SHARDED_KEY) if isinstance(meta, dict) else None
    check_format_version(meta, where=meta_file)
    if not isinstance(info, dict) or not {"zero_stage", "world_size"} <= set(info):
        raise CheckpointFormatError(
            f"{meta_file}: no '{SHARDED_KEY}' entry with zero_stage and world_size; expected the {META_FILE} "
            "written by lp_sharded (checkpoint='sharded')."
        )
    stage, world = int(info["zero_stage"]), int(info["world_size"])
    ranks = [folder / rank_file(r) for r in range(world)]
    missing = [f.name for f in ranks if not f.is_file()]
    if missing:
        raise CheckpointFormatError(
            f"{folder}: {META_FILE} says {world} ranks wrote this ZeRO-{stage} checkpoint, but "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} is missing (an interrupted save or a "
            "partial copy); expected one rank_XXXXX.pt per rank."
        )
    extra = sorted(x.name for x in folder.glob(RANK_FILE_GLOB) if x not in ranks)
    if extra:
        raise CheckpointFormatError(f"{folder}: {META_FILE} says {world} ranks, but the folder also holds "
                                    f"{extra[:4]} (files of another save mixed in); expected exactly {world} rank "
                                    "files.")
    return CheckpointInfo(format="lp_sharded", path=folder, files=(meta_file, *ranks), zero_stage=stage,
                          world_size=world, checkpoint=meta)


def read_full(info: CheckpointInfo, *, trusted: bool = False) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``(full state_dict under the module's names, meta.pt's other keys)``: stages 1-2 from ``meta.pt``, stage 3
    joined from the rank files."""
    meta = info.checkpoint
    assert meta is not None and info.world_size is not None
    rest = {k: v for k, v in meta.items() if k not in ("state_dict", SHARDED_KEY)}
    if not _fsdp_files(info):  # stages 1-2: parameters are replicated; rank 0 wrote the full state dict into meta.pt
        if not isinstance(meta.get("state_dict"), dict):
            raise CheckpointFormatError(f"{info.files[0]}: a ZeRO-{info.zero_stage} sharded checkpoint without "
                                        f"'state_dict'; expected the full weights in {META_FILE} at stages 1-2.")
        return strip_wrapper_prefixes(meta["state_dict"]), rest
    files = _one_copy(info)
    parts = [load_torch_file(f, trusted=trusted, what="a rank file of an lp_sharded checkpoint") for f in files]
    for f, part in zip(files, parts, strict=True):
        if not isinstance(part, dict) or not isinstance(part.get("state_dict"), dict):
            raise CheckpointFormatError(f"{f}: no 'state_dict'; expected this rank's ZeRO-3 shards (lp_sharded "
                                        "checkpoint='sharded' at stage 3).")
    shapes = (meta.get(SHARDED_KEY) or {}).get("sharded_shapes")
    if shapes is not None:  # recorded at save time: join exactly those, keep the rest (buffers) once
        state = join_recorded_shards([p["state_dict"] for p in parts], shapes=shapes, where=info.path)
    else:  # folders written before the shapes were recorded
        n_params = _optimizer_param_count(parts[0])
        state = join_zero3_shards([p["state_dict"] for p in parts], n_params=n_params, where=info.path)
    return strip_wrapper_prefixes(state), rest


def _fsdp_files(info: CheckpointInfo) -> bool:
    """Whether the rank files hold FSDP2 ``Shard(0)`` pieces (stage 3, or stage 2 over FSDP2 under HSDP)."""
    return info.zero_stage == 3 or bool(((info.checkpoint or {}).get(SHARDED_KEY) or {}).get("fsdp"))


def _one_copy(info: CheckpointInfo) -> list[Path]:
    """The rank files that together hold one whole copy, in shard order: every rank's, or under HSDP the ranks of one
    shard group (``shard_ranks`` in ``meta.pt``; the other groups' files are replicas)."""
    meta = info.checkpoint or {}
    ranks = (meta.get(SHARDED_KEY) or {}).get("shard_ranks")
    files = list(info.files[1:])
    return files if ranks is None else [files[int(r)] for r in ranks]


def join_recorded_shards(parts: list[Mapping[str, Any]], *, shapes: Mapping[str, list[int]],
                         where: Path) -> dict[str, Any]:
    """Full tensors from every rank's local ``Shard(0)`` state dict, for a folder that records which entries were
    sharded and their full shapes (``sharded_shapes`` in ``meta.pt``): those are joined in rank order and checked
    against the recorded shape; every other entry is replicated and taken from rank 0."""
    out: dict[str, Any] = {}
    for key, first in parts[0].items():
        if key not in shapes:
            out[key] = first
            continue
        try:
            joined = torch.cat([p[key] for p in parts], dim=0)
        except (KeyError, RuntimeError) as err:
            raise CheckpointFormatError(f"{where}: the ranks' shards of {key} do not join ({err}); the rank files "
                                        "do not belong together.") from None
        if list(joined.shape) != list(shapes[key]):
            raise CheckpointFormatError(f"{where}: {key} joins to shape {list(joined.shape)}, but {META_FILE} recorded "
                                        f"{list(shapes[key])}; the rank files do not belong together.")
        out[key] = joined
    return out


def _optimizer_param_count(part: Mapping[str, Any]) -> int | None:
    """How many parameters the saved optimizers hold (each is a Shard(0) parameter at stage 3); None if unknown."""
    states = part.get("optimizer_states")
    if not isinstance(states, list) or not states:
        return None
    ids: set[int] = set()
    for i, osd in enumerate(states):
        groups = osd.get("param_groups") if isinstance(osd, dict) else None
        if not isinstance(groups, list):
            return None
        ids |= {(i, int(p)) for g in groups for p in g.get("params", [])}  # type: ignore[misc]
    return len(ids)


def _chunk_sizes(total: int, world: int) -> list[int]:
    """dim-0 sizes of ``torch.chunk``-style ``Shard(0)`` pieces (FSDP2): ceil(total/world) each, the rest last."""
    step = math.ceil(total / world) if total else 0
    return [max(0, min(step, total - r * step)) for r in range(world)]


def join_zero3_shards(parts: list[Mapping[str, Any]], *, n_params: int | None, where: Path) -> dict[str, Any]:
    """Full tensors from every rank's local ``Shard(0)`` state dict (FSDP2 parameters as plain local tensors, in
    rank order); entries identical on every rank are replicated buffers and kept once.

    The files do not record which entries were DTensors, so a parameter whose shards are all identical would be
    taken for a buffer: with ``n_params`` (the optimizer's parameter count) that case is detected and refused.
    """
    world = len(parts)
    keys = list(parts[0])
    for r, part in enumerate(parts[1:], start=1):
        if list(part) != keys:
            diff = sorted(set(part) ^ set(keys))[:4]
            raise CheckpointFormatError(f"{where}: rank {r}'s state dict has other keys than rank 0's ({diff}); "
                                        "expected the same entries on every rank.")
    out: dict[str, Any] = {}
    replicated: list[str] = []
    for key in keys:
        values = [p[key] for p in parts]
        if not all(isinstance(v, Tensor) for v in values):
            out[key] = values[0]  # _extra_state and the like
            continue
        first = values[0]
        if first.dim() == 0 or all(v.shape == first.shape and torch.equal(v, first) for v in values[1:]):
            out[key] = first
            replicated.append(key)
            continue
        total = sum(int(v.shape[0]) for v in values)
        sizes = [int(v.shape[0]) for v in values]
        if (any(v.dim() != first.dim() or v.shape[1:] != first.shape[1:] for v in values)
                or sizes != _chunk_sizes(total, world)):
            raise CheckpointFormatError(
                f"{where}: {key} has local shapes {[tuple(v.shape) for v in values]} on ranks 0..{world - 1}, which "
                "are not dim-0 shards of one tensor (FSDP2 Shard(0)); the rank files do not belong together."
            )
        out[key] = torch.cat(values, dim=0)
    sharded = len(keys) - len(replicated)
    if n_params is not None and sharded < n_params:
        raise CheckpointFormatError(
            f"{where}: the optimizer holds {n_params} parameters but only {sharded} entries differ between ranks; "
            f"some of {replicated[:6]} are parameters whose shards are identical, and the ZeRO-3 rank files do not "
            "record which entries were sharded. Save with checkpoint='full' to get this model's full weights."
        )
    return out


def read_optimizer_states(info: CheckpointInfo, *, trusted: bool = False) -> list[dict[str, Any]]:
    """Every optimizer's state in torch's one-device per-index form, joined from the rank files: stages 1-2 each
    param group's flat shards concatenated in rank order and cut back into per-parameter tensors by the recorded
    shapes (the padding at the end dropped); stage 3 each parameter's ``Shard(0)`` state pieces joined along dim 0."""
    files = _one_copy(info)
    parts = [load_torch_file(f, trusted=trusted, what="a rank file of an lp_sharded checkpoint") for f in files]
    per_rank: list[list[dict[str, Any]]] = []
    for f, part in zip(files, parts, strict=True):
        states = part.get("optimizer_states") if isinstance(part, dict) else None
        if not isinstance(states, list):
            raise CheckpointFormatError(f"{f}: no 'optimizer_states'; expected this rank's optimizer shard.")
        per_rank.append(states)
    n_opt = {len(s) for s in per_rank}
    if len(n_opt) != 1:
        raise CheckpointFormatError(f"{info.path}: the rank files hold {sorted(n_opt)} optimizers; they do not "
                                    "belong together.")
    joined = []
    for i in range(n_opt.pop()):
        shards = [s[i] for s in per_rank]
        if _fsdp_files(info):
            joined.append(_join_dim0_optimizer(shards, where=info.path))
        else:
            joined.append(_join_flat_optimizer(shards, where=info.path))
    return joined


def _join_flat_optimizer(shards: Sequence[dict[str, Any]], *, where: Path) -> dict[str, Any]:
    """Stages 1-2 (``ZeroOptimizer.state_dict()``): one flat shard per param group and rank -> per-parameter."""
    first = shards[0]
    if first.get("format") is None or "shapes" not in first:
        raise CheckpointFormatError(f"{where}: the rank files' optimizer state is not a ZeroOptimizer shard "
                                    "(no 'format'/'shapes').")
    world = int(first["world_size"])
    if len(shards) != world or sorted(int(s["rank"]) for s in shards) != list(range(world)):
        raise CheckpointFormatError(f"{where}: expected the shards of ranks 0..{world - 1}, found ranks "
                                    f"{[s.get('rank') for s in shards]}.")
    shards = sorted(shards, key=lambda s: int(s["rank"]))
    inner = [s["optim"] for s in shards]
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for g, shapes in enumerate(first["shapes"]):
        numels = [int(torch.Size(shape).numel()) for shape in shapes]
        ids = list(range(index, index + len(shapes)))
        # the inner optimizer holds one flat parameter per group: its state index is g
        slots = [r["state"].get(g, r["state"].get(str(g), {})) for r in inner]
        per_param: list[dict[str, Any]] = [{} for _ in shapes]
        shard_numel = -(-sum(numels) // world)
        for key, value in slots[0].items():
            if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == shard_numel:
                flat = torch.cat([s[key] for s in slots])
                offset = 0
                for slot, shape, n in zip(per_param, shapes, numels, strict=True):
                    slot[key] = flat[offset:offset + n].view(shape).clone()
                    offset += n
            else:  # scalars (Adam's step) are per group
                for slot in per_param:
                    slot[key] = value.clone() if isinstance(value, Tensor) else value
        state.update({i: s for i, s in zip(ids, per_param, strict=True) if s})
        saved_group = inner[0]["param_groups"][g]
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
        index += len(shapes)
    return {"state": state, "param_groups": groups}


def _join_dim0_optimizer(shards: Sequence[dict[str, Any]], *, where: Path) -> dict[str, Any]:
    """Stage 3 (FSDP2 ``Shard(0)``): each parameter's state pieces, one per rank, joined along dim 0."""
    first = shards[0]
    state: dict[Any, dict[str, Any]] = {}
    for idx, slot in first["state"].items():
        out: dict[str, Any] = {}
        for key, value in slot.items():
            if isinstance(value, Tensor) and value.dim() > 0:
                try:
                    out[key] = torch.cat([s["state"][idx][key] for s in shards], dim=0)
                except (KeyError, RuntimeError) as err:
                    raise CheckpointFormatError(f"{where}: the ranks' optimizer shards of parameter {idx} do not "
                                                f"join ({err}); the rank files do not belong together.") from None
            else:
                out[key] = value
        state[idx] = out
    return {"state": state, "param_groups": first["param_groups"]}


def consolidate_checkpoint(sharded_dir: str | Path, out_file: str | Path) -> dict[str, Any]:
    """Write (and return) the single-file, single-device form of an lp_sharded folder: the full ``state_dict``, the
    optimizer states in torch's per-index form, and ``meta.pt``'s other keys; it resumes a fit on one device or under
    any layout. Reads with ``weights_only=False`` (files you trust)."""
    folder = Path(sharded_dir)
    info = detect(folder, trusted=True)
    if info is None:
        raise CheckpointFormatError(f"{folder}: no {META_FILE}; expected an lp_sharded checkpoint folder.")
    state, rest = read_full(info, trusted=True)
    checkpoint = {**rest, "state_dict": state, "optimizer_states": read_optimizer_states(info, trusted=True)}
    torch.save(checkpoint, out_file)
    return checkpoint
