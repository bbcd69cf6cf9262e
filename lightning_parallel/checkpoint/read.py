"""Readers: the full single-device state dict and the one-file Lightning checkpoint of any supported format.

No process group, one CPU process. Lightning files and ``lp_sharded`` folders are read with ``weights_only=True``;
DeepSpeed folders cannot be (see :mod:`lightning_parallel.checkpoint`).
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from .formats import (
    NVME_STATE_DIR,
    SHARDED_KEY,
    CheckpointFormatError,
    CheckpointInfo,
    detect_format,
    load_torch_file,
)

__all__ = ["DROPPED_KEYS", "full_checkpoint", "full_state_dict", "join_zero3_shards", "read_checkpoint",
           "strip_wrapper_prefixes"]

T = TypeVar("T")

DROPPED_KEYS = ("optimizer_states", "lr_schedulers")
"""Top-level keys :func:`full_checkpoint` leaves out: the result is a weights-only checkpoint (optimizer and LR
scheduler states are per layout; Lightning's ``save_weights_only`` drops the same two)."""

# Path components that only wrappers add (FSDP1, activation checkpointing, torch.compile): removed anywhere in a key.
_WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
# Leading prefixes of the module a DeepSpeed engine wraps (Lightning's forward wrapper, a DDP-style wrapper).
_DEEPSPEED_LEADING = ("_forward_module.", "module.")
# Keys DeepSpeed adds to its model-states file next to Lightning's client state.
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "csr_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "ds_config", "ds_version", "mp_rank", "checkpoint_parallel_dimensions", "autoep_layers", "ds_autoep_layers",
})


def strip_wrapper_prefixes(state: Mapping[str, T], *, leading: tuple[str, ...] = ()) -> dict[str, T]:
    """The state dict under the module's own names.

    Removes the path components only wrappers add, anywhere in a key (``_fsdp_wrapped_module``,
    ``_checkpoint_wrapped_module``, ``_orig_mod``), then each prefix of ``leading`` (e.g. ``"_forward_module."``,
    ``"module."``) while *every* key starts with it. ``leading`` is empty by default: a Lightning checkpoint's
    ``state_dict`` already has the LightningModule's names, and a module may own a child called ``module``.
    Raises ``ValueError`` if two keys would get the same name.
    """
    out: dict[str, T] = {}
    for key, value in state.items():
        name = ".".join(part for part in key.split(".") if part not in _WRAPPER_COMPONENTS)
        if name in out:
            raise ValueError(f"state dict keys collide once wrapper prefixes are removed: {name!r} (from {key!r}).")
        out[name] = value
    for prefix in leading:
        if out and all(k.startswith(prefix) and len(k) > len(prefix) for k in out):
            out = {k[len(prefix):]: v for k, v in out.items()}
    return out


def full_state_dict(path: str | Path, *, trusted: bool = False) -> dict[str, Tensor]:
    """The module's full single-device state dict from a checkpoint written under any of the library's strategies.

    Keys are the LightningModule's own parameter and buffer names (no wrapper prefixes); values are CPU tensors in
    the dtype they were trained in (DeepSpeed folders: the fp32 master weights). No process group is needed.
    ``trusted`` loads a one-file checkpoint or an lp_sharded folder with ``weights_only=False`` (runs code stored in
    the files: only for files you trust). Raises :class:`~lightning_parallel.checkpoint.CheckpointFormatError` for
    anything it cannot read.
    """
    return read_checkpoint(path, trusted=trusted)[0]


def full_checkpoint(path: str | Path, *, trusted: bool = False) -> dict[str, Any]:
    """The one-file, single-device Lightning checkpoint of ``path``: ``state_dict`` from :func:`full_state_dict`
    plus the source's other top-level Lightning keys (``hyper_parameters``, ``epoch``, ``global_step``, ``loops``,
    ``callbacks``, ...), without :data:`DROPPED_KEYS` (optimizer and LR-scheduler states are dropped)."""
    state, rest, _ = read_checkpoint(path, trusted=trusted)
    out = {k: v for k, v in rest.items() if k not in DROPPED_KEYS}
    out["state_dict"] = state
    return out


def read_checkpoint(path: str | Path, *, trusted: bool = False) -> tuple[dict[str, Tensor], dict[str, Any],
                                                                           CheckpointInfo]:
    """``(state_dict, other top-level Lightning keys, format info)`` of the checkpoint at ``path``."""
    try:
        info = detect_format(path, trusted=trusted)
    except OSError as err:  # e.g. a folder that cannot be listed
        raise CheckpointFormatError(f"{path}: cannot be read ({err.strerror or err}).") from err
    try:
        if info.format == "lightning":
            state, rest = _read_lightning(info)
        elif info.format == "lp_sharded":
            state, rest = _read_sharded(info, trusted=trusted)
        elif info.format in ("lp_tensor", "lp_pipeline", "lp_hybrid"):
            state, rest = _read_tensor(info)
        else:
            state, rest = _read_deepspeed(info)
    except OSError as err:
        raise CheckpointFormatError(f"{err.filename or info.path}: cannot be read ({err.strerror or err}).") from err
    except (KeyError, TypeError, IndexError, AttributeError) as err:
        raise CheckpointFormatError(
            f"{info.path}: looks like a {info.describe()} but its content is not as expected "
            f"({type(err).__name__}: {err}); it may be corrupt or written by an incompatible version."
        ) from err
    return state, rest, info


# ---------------------------------------------------------------------------------------------- one file
def _read_lightning(info: CheckpointInfo) -> tuple[dict[str, Tensor], dict[str, Any]]:
    content = info.checkpoint
    assert content is not None
    state = strip_wrapper_prefixes(content["state_dict"])
    return state, {k: v for k, v in content.items() if k != "state_dict"}


# ---------------------------------------------------------------------------------------------- lp_tensor folder
def _read_tensor(info: CheckpointInfo) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """lp_tensor's DCP folder: every tp/dp shard joined into whole tensors, offline (no process group)."""
    from lightning_parallel.parallel.tensor.checkpoint import read_full_checkpoint

    full = read_full_checkpoint(info.path)
    state = strip_wrapper_prefixes(full.pop("state_dict"))
    return state, full


# ---------------------------------------------------------------------------------------------- lp_sharded folder
def _read_sharded(info: CheckpointInfo, *, trusted: bool) -> tuple[dict[str, Tensor], dict[str, Any]]:
    meta = info.checkpoint
    assert meta is not None and info.world_size is not None
    rest = {k: v for k, v in meta.items() if k not in ("state_dict", SHARDED_KEY)}
    if info.zero_stage != 3:  # stages 1-2: parameters are replicated; rank 0 wrote the full state dict into meta.pt
        if not isinstance(meta.get("state_dict"), dict):
            raise CheckpointFormatError(f"{info.files[0]}: a ZeRO-{info.zero_stage} sharded checkpoint without "
                                        "'state_dict'; expected the full weights in meta.pt at stages 1-2.")
        return strip_wrapper_prefixes(meta["state_dict"]), rest
    parts = [load_torch_file(f, trusted=trusted, what="a rank file of an lp_sharded checkpoint")
             for f in info.files[1:]]
    for f, part in zip(info.files[1:], parts, strict=True):
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
            raise CheckpointFormatError(f"{where}: {key} joins to shape {list(joined.shape)}, but meta.pt recorded "
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


# ---------------------------------------------------------------------------------------------- DeepSpeed folder
def _read_deepspeed(info: CheckpointInfo) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Lightning's client state from rank 0's model-states file; weights from DeepSpeed's fp32 reconstruction of the
    rank partitions, or (NVMe offload) from the per-rank state files lp_zero_offload writes."""
    assert info.tag is not None and info.checkpoint is not None
    model_states = info.checkpoint
    rest = {k: v for k, v in model_states.items() if k not in _DEEPSPEED_KEYS}
    buffer_names = set(model_states.get("buffer_names") or ())
    buffers = {k: v for k, v in (model_states.get("module") or {}).items() if k in buffer_names}
    if info.format == "deepspeed_nvme":
        param_names = [n for group in model_states.get("param_shapes") or [] for n in group]
        param_names += list((model_states.get("frozen_param_shapes") or {}).keys())
        state = _nvme_params(info.path / NVME_STATE_DIR, param_names)
        for name, value in buffers.items():  # as zero_to_fp32 does: buffers from the model states, fp32
            state[name] = value.float() if value.is_floating_point() else value
    else:
        state = _zero_to_fp32(info.path, info.tag)
    return strip_wrapper_prefixes(state, leading=_DEEPSPEED_LEADING), rest


@contextlib.contextmanager
def deepspeed_quietly() -> Any:
    """Around DeepSpeed's checkpoint readers (``zero_to_fp32``): their progress prints (stdout) and bars (stderr) go
    nowhere, and tqdm starts no monitor thread -- its first bar would start one that lives as long as the process,
    and a process that read a DeepSpeed checkpoint and then forks ranks (``start_method="fork"``) would fork with
    that thread alive (what a forked child inherits from a multi-threaded parent is unsafe)."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    interval = tqdm.monitor_interval if tqdm is not None else None
    if tqdm is not None:
        tqdm.monitor_interval = 0
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if tqdm is not None:
            tqdm.monitor_interval = interval


def _zero_to_fp32(folder: Path, tag: str) -> dict[str, Tensor]:
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as err:
        raise CheckpointFormatError(f"{folder}: a DeepSpeed checkpoint; reading it needs DeepSpeed "
                                    "(pip install -e '.[deepspeed]').") from err
    try:
        with deepspeed_quietly():
            state = dict(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag))
    except (FileNotFoundError, ValueError) as err:
        raise CheckpointFormatError(f"{folder}: DeepSpeed could not rebuild the fp32 weights ({err}); expected a "
                                    "complete ZeRO checkpoint folder.") from err
    # zero_to_fp32 returns views into one flat vector per group: give each tensor its own storage
    return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in state.items()}


def _nvme_params(nvme_dir: Path, param_names: list[str]) -> dict[str, Tensor]:
    """Full fp32 parameters from the per-rank NVMe state files (their partitions concatenated, padding dropped)."""
    from lightning_parallel.parallel.offload.state import assemble_local_states

    try:
        state = assemble_local_states(nvme_dir)  # torch.load(weights_only=True)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        raise CheckpointFormatError(f"{nvme_dir}: {err}; expected one lp_offload_rank*.pt per rank.") from err
    saved = strip_wrapper_prefixes(state, leading=_DEEPSPEED_LEADING)
    wanted = strip_wrapper_prefixes(dict.fromkeys(param_names, None), leading=_DEEPSPEED_LEADING)
    missing = sorted(set(wanted) - set(saved))
    if missing:
        raise CheckpointFormatError(
            f"{nvme_dir}: no NVMe state for parameters {missing[:5]} (frozen parameters are not saved there); "
            "their trained values are not in this checkpoint."
        )
    return state
