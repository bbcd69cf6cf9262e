"""The DCP formats (``lp_tensor``, ``lp_pipeline``, ``lp_hybrid``): a torch DCP folder, one shard file per rank, for
strategies whose ranks hold different parts of the model (tensor shards, pipeline stages).

A folder holds:

* ``layout.json`` (rank 0): the strategy and layout that wrote it (readable without unpickling anything);
* ``meta.pt`` (rank 0): everything of the Lightning checkpoint but the tensors -- epoch, step, loops, LR schedulers,
  callbacks, hyper-parameters -- plus each optimizer's ``param_groups`` with parameters named by their FQN
  (``optimizer_param_groups``), and the layout record under ``lp_tensor_checkpoint``, ``lp_pipeline_checkpoint`` or
  ``lp_hybrid_checkpoint``;
* DCP files (``.metadata`` + ``__<rank>_0.distcp``): ``model`` (the module's ``state_dict()``: each rank writes its
  tp/dp shards of every DTensor, replicated tensors are written once) and ``optim.<i>.state.<fqn>.<key>`` (each
  optimizer state tensor laid out like its parameter). The optimizer state is stored by parameter name in every
  zero stage (ZeRO-1 gathers its flat dp shards per parameter first), so the format does not depend on the stage;
* ``checksums.json`` (rank 0, last): the CRC-32 of every file (the ``.distcp`` shards carry none); a folder without it
  is refused (:func:`~lightning_parallel.checkpoint.verify.verify_folder`).

Here: the collective write (:func:`save`, into ``<name>.partial``, renamed once complete), the per-rank read on a
layout that holds the same tensors (:func:`load`, then :func:`load_model` / :func:`load_optimizer`: each rank reads
its own shards), and the offline reading without a process group (:func:`detect`, :func:`read_full_checkpoint` --
the one-device Lightning checkpoint with its optimizer state -- and :func:`read_full`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import async_save, rng
from ..atomic import disk_errors, fresh_partial, partial_path, replace_with
from ..errors import CheckpointFormatError
from ..names import (
    DCP_FOLDER_KEY,
    DCP_LAYOUT_KEYS,
    DCP_METADATA_FILE,
    DCP_MODEL_KEY,
    DCP_OPTIM_KEY,
    FORMAT_VERSION,
    LAYOUT_FILE,
    META_FILE,
    OPTIMIZER_GROUPS_KEY,
)
from ..verify import write_manifest
from .common import (
    CheckpointFormat,
    CheckpointInfo,
    CheckpointStrategy,
    agree_on_failure,
    check_format_version,
    refused_save,
    stamp_format_version,
    strip_wrapper_prefixes,
    tensor_bytes,
    wait_for_background_save,
)

__all__ = [
    "FORMATS",
    "WeightsInFolder",
    "detect",
    "is_dcp_folder",
    "load",
    "load_model",
    "load_optimizer",
    "looks_like_dcp_folder",
    "read_full",
    "read_full_checkpoint",
    "refuse_written_weights",
    "save",
    "saved_layout",
    "saved_strategy",
]

FORMATS = ("lp_tensor", "lp_pipeline", "lp_hybrid")

MergeGroups = Callable[[list[list[dict[str, Any]]]], list[dict[str, Any]]]
"""Joins one optimizer's ``param_groups`` (parameter names) gathered from every rank into the whole model's."""


# ---------------------------------------------------------------------------------------------- write
def save(strategy: CheckpointStrategy, checkpoint: dict[str, Any], filepath: Any, *, layout_key: str,
         layout: dict[str, Any], merge_param_groups: MergeGroups) -> None:
    """Write the folder (collective: every rank calls it with its ``state_dict`` as it holds it and its optimizer
    states by parameter name). ``layout``: the record of the layout (``strategy`` and the degrees), stored under
    ``layout_key`` in ``meta.pt`` and as ``layout.json``. Written next to the target and renamed into place, so a
    failed save never leaves a half folder under the checkpoint's name."""
    if refused_save(strategy, filepath):
        return
    writer = wait_for_background_save(strategy)  # the save in flight first; a writer: this one in the background
    path = Path(strategy.broadcast(str(filepath)))
    partial = partial_path(path)
    error: BaseException | None = None
    if strategy.is_global_zero:
        try:
            fresh_partial(path)
        except OSError as err:
            error = err
    agree_on_failure(strategy, error)
    rng.attach_rng_states(checkpoint)  # every rank's, into meta.pt (a collective)
    stamp_format_version(checkpoint)
    model_state = checkpoint.pop("state_dict")
    optim_states = checkpoint.pop("optimizer_states", [])
    if dist.is_initialized() and dist.get_world_size() > 1 and optim_states:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [s["param_groups"] for s in optim_states])
        optim_states = [{**s, "param_groups": merge_param_groups([g[i] for g in gathered])}
                        for i, s in enumerate(optim_states)]
    checkpoint[layout_key] = layout
    if writer is not None:
        _write_in_background(writer, partial, path, model_state=model_state, optimizer_states=optim_states,
                             meta=checkpoint if strategy.is_global_zero else None, layout=layout)
        return
    needed = tensor_bytes(model_state) + tensor_bytes(optim_states)
    try:  # DCP reports a rank's failed write to every rank (CheckpointException)
        with disk_errors(path, needed=needed):
            _write_shards(partial, model_state=model_state, optimizer_states=optim_states,
                          meta=checkpoint if strategy.is_global_zero else None, rank=strategy.global_rank)
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt | SystemExit):
            raise
        error = err
    agree_on_failure(strategy, error, cleanup=partial)
    if strategy.is_global_zero:
        try:
            with disk_errors(path, needed=0):
                record = {**layout, "format_version": FORMAT_VERSION}
                (partial / LAYOUT_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
                write_manifest(partial)  # CRC-32 per file, checked before a load
                replace_with(partial, path)  # a checkpoint saved again under one name (last.ckpt): no stale shards
        except Exception as err:
            error = err
    agree_on_failure(strategy, error, cleanup=partial)


def _write_in_background(writer: async_save.AsyncWriter, partial: Path, path: Path, *, model_state: dict[str, Any],
                         optimizer_states: list[dict[str, Any]], meta: dict[str, Any] | None,
                         layout: dict[str, Any]) -> None:
    """The save's files by ``torch.distributed.checkpoint.async_save`` (it stages every rank's tensors in host memory
    now and writes them from its own thread, coordinating on the writer's gloo group), then -- in the writer's
    thread, once DCP is done on every rank -- rank 0's ``meta.pt``, ``layout.json``, the manifest and the rename."""
    import torch.distributed.checkpoint as dcp

    group = writer.group()
    future: Any = dcp.async_save({DCP_MODEL_KEY: model_state,
                             DCP_OPTIM_KEY: {str(i): {"state": s["state"]} for i, s in enumerate(optimizer_states)}},
                            checkpoint_id=str(partial), process_group=group)
    meta_copy = None
    if meta is not None:
        meta_copy = async_save.host_copy({**meta, OPTIMIZER_GROUPS_KEY: [s["param_groups"] for s in optimizer_states]})

    def finish() -> None:
        failure: BaseException | None = None
        try:  # DCP's own metadata is written by then (its coordinator gathers every rank's writes)
            with disk_errors(path, needed=0):
                future.result()
        except Exception as err:
            failure = err
        writer.agree(failure, cleanup=partial)
        if meta_copy is not None:
            try:
                with disk_errors(path, needed=0):
                    torch.save(meta_copy, partial / META_FILE)
                    record = {**layout, "format_version": FORMAT_VERSION}
                    (partial / LAYOUT_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
                    write_manifest(partial)
                    replace_with(partial, path)
            except Exception as err:
                failure = err
        writer.agree(failure, cleanup=partial)

    writer.submit(str(path), finish)


def _write_shards(folder: Path, *, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]],
                  meta: dict[str, Any] | None, rank: int) -> None:
    """The DCP files (every rank) and ``meta.pt`` (rank 0, with the optimizers' ``param_groups``)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({DCP_MODEL_KEY: model_state,
              DCP_OPTIM_KEY: {str(i): {"state": s["state"]} for i, s in enumerate(optimizer_states)}},
             checkpoint_id=str(folder))
    if rank == 0:
        assert meta is not None
        meta = {**meta, OPTIMIZER_GROUPS_KEY: [s["param_groups"] for s in optimizer_states]}
        torch.save(meta, folder / META_FILE)


# ---------------------------------------------------------------------------------------------- read, per rank
def load(strategy: CheckpointStrategy, path: Path, *, layout_key: str,
         can_read_saved_layout: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """``meta.pt`` of a DCP folder written under ``layout_key`` whose saved layout ``can_read_saved_layout``
    accepts, with this rank's RNG states kept for the start of training; the tensors stay in the files until
    :func:`load_model` / :func:`load_optimizer` read them (the folder is under ``DCP_FOLDER_KEY``). None for anything
    else (a file, another format, another strategy's folder, a layout this one does not read shard by shard)."""
    if not is_dcp_folder(path):
        return None
    checkpoint: dict[str, Any] = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    check_format_version(checkpoint, where=path / META_FILE)
    saved = next((checkpoint[k] for k in DCP_LAYOUT_KEYS.values() if k in checkpoint), None)
    if saved is None or checkpoint.get(layout_key) is None or not can_read_saved_layout(saved):
        return None
    rng.restore_rng_states(checkpoint, rank=strategy.global_rank, world_size=strategy.world_size,
                           module=strategy.lightning_module)
    checkpoint[DCP_FOLDER_KEY] = str(path)
    checkpoint["state_dict"] = WeightsInFolder(str(path))
    checkpoint["optimizer_states"] = [{} for _ in checkpoint.get(OPTIMIZER_GROUPS_KEY, [])]
    return checkpoint


class WeightsInFolder(dict):  # type: ignore[type-arg]
    """``checkpoint["state_dict"]`` of a DCP folder read shard by shard: it holds no tensors -- each rank reads its
    shards from the folder after the module's ``on_load_checkpoint`` (:func:`load_model`). Reading an entry raises a
    ``KeyError`` that says so; an entry a hook writes (a key migration) is refused by :func:`refuse_written_weights`
    when the weights are loaded, since it would be ignored (before: silently)."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def __missing__(self, key: Any) -> Any:
        raise KeyError(
            f"{key!r}: checkpoint['state_dict'] of the checkpoint folder {self.folder} holds no tensors -- each rank "
            "reads its shards from the folder after on_load_checkpoint. To change weights when resuming, change the "
            "module's in on_train_start (it holds them then), or resume from a consolidated file (lightning-parallel "
            "consolidate).")


def refuse_written_weights(state: Any, folder: str) -> None:
    """Raise where a module's ``on_load_checkpoint`` wrote into the :class:`WeightsInFolder` of a DCP folder, or put
    a ``state_dict`` of its own in its place."""
    if not isinstance(state, WeightsInFolder) or len(state):
        n = len(state) if isinstance(state, Mapping) else 0
        raise ValueError(
            f"on_load_checkpoint wrote {n} entr{'y' if n == 1 else 'ies'} "
            f"({', '.join(map(repr, list(state)[:3])) if n else 'a new dict'}) into checkpoint['state_dict'] of the "
            f"checkpoint folder {folder}, whose weights each rank reads from the folder into its shards: the change "
            "would be "
            "ignored. Fix: change the module's weights in on_train_start (the module holds the resumed ones then), or "
            "resume from a consolidated file (lightning-parallel consolidate), whose state_dict the hook can edit.")


def load_model(folder: str | Path, model: nn.Module) -> None:
    """Load the ``model`` entry into the (already parallelized) module in place: each rank reads its shards."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    dcp.load({DCP_MODEL_KEY: state}, checkpoint_id=str(folder))
    model.load_state_dict(state)


def _optim_template(folder: Path, index: int, model: nn.Module) -> dict[str, dict[str, Tensor]]:
    """Tensors shaped like the saved state of optimizer ``index``, laid out like their parameters (from the DCP
    metadata: a state tensor with the parameter's global shape is a ``zeros_like(param)``, anything else plain)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    params = dict(model.named_parameters())
    prefix = f"{DCP_OPTIM_KEY}.{index}.state."
    template: dict[str, dict[str, Tensor]] = {}
    for key, meta in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items():
        if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        rest = key[len(prefix):]
        name = max((n for n in params if rest.startswith(n + ".")), key=len, default=None)
        if name is None:
            continue  # a parameter this rank does not hold (another pipeline stage's)
        p = params[name]
        slot = rest[len(name) + 1:]
        if tuple(meta.size) == tuple(p.shape):
            template.setdefault(name, {})[slot] = torch.zeros_like(p)
        else:
            template.setdefault(name, {})[slot] = torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
    return template


def load_optimizer(folder: str | Path, index: int, model: nn.Module) -> dict[str, Any]:
    """Optimizer ``index``'s state by parameter name, each tensor laid out like its parameter on this rank
    (collective read), with the saved ``param_groups``: ``{"state": {fqn: {...}}, "param_groups": [...]}``."""
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    template = _optim_template(folder, index, model)
    dcp.load({DCP_OPTIM_KEY: {str(index): {"state": template}}}, checkpoint_id=str(folder))
    meta = torch.load(folder / META_FILE, map_location="cpu", weights_only=True)  # as load() read it
    return {"state": template, "param_groups": meta[OPTIMIZER_GROUPS_KEY][index]}


# ---------------------------------------------------------------------------------------------- offline read
def saved_layout(path: str | Path) -> dict[str, Any]:
    """A DCP folder's ``layout.json`` (``{}`` for folders written before that file existed); its format version is
    checked (:func:`~.common.check_format_version`)."""
    file = Path(path) / LAYOUT_FILE
    if not file.is_file():
        return {}
    try:
        record = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointFormatError(f"{file}: unreadable ({err}); expected the layout record of a DCP checkpoint "
                                    "folder.") from err
    if not isinstance(record, dict):
        raise CheckpointFormatError(f"{file}: a {type(record).__name__}, not the layout record of a DCP folder.")
    check_format_version(record, where=file, key="format_version")
    return record


def saved_strategy(path: str | Path) -> str:
    """The strategy that wrote a checkpoint folder, from its ``layout.json`` (``lp_tensor`` for folders written
    before that file existed)."""
    return str(saved_layout(path).get("strategy", "lp_tensor"))


def looks_like_dcp_folder(path: str | Path) -> bool:
    """A folder with DCP shard files (``*.distcp``), DCP's ``.metadata`` or a ``layout.json``: written by :func:`save`,
    complete or not."""
    path = Path(path)
    return path.is_dir() and ((path / DCP_METADATA_FILE).is_file() or (path / LAYOUT_FILE).is_file()
                              or any(path.glob("*.distcp")))


def is_dcp_folder(path: str | Path) -> bool:
    """True for a folder written by :func:`save` (``meta.pt`` and DCP's ``.metadata``)."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / DCP_METADATA_FILE).is_file()


def detect(folder: Path, *, trusted: bool = False) -> CheckpointInfo | None:
    """The folder's :class:`CheckpointInfo` (which strategy wrote it, from ``layout.json``), or None if it is not a
    DCP folder."""
    if not is_dcp_folder(folder):
        if looks_like_dcp_folder(folder):
            have = sorted(x.name for x in folder.iterdir())[:8]
            missing = [n for n in (META_FILE, DCP_METADATA_FILE) if not (folder / n).is_file()]
            raise CheckpointFormatError(
                f"{folder}: a DCP checkpoint folder (lp_tensor/lp_pipeline/lp_hybrid) without {' and '.join(missing)} "
                f"(it holds {have}): {DCP_METADATA_FILE} is torch DCP's index of the .distcp shards, {META_FILE} the "
                "rest of the Lightning checkpoint; an incomplete copy or a damaged folder. Fix: copy the whole folder "
                "again, or use another checkpoint."
            )
        return None
    wrote = saved_strategy(folder)
    fmt: CheckpointFormat = "lp_pipeline" if wrote == "lp_pipeline" else (
        "lp_hybrid" if wrote == "lp_hybrid" else "lp_tensor")
    return CheckpointInfo(format=fmt, path=folder, files=tuple(sorted(folder.iterdir())))


def read_full_checkpoint(folder: str | Path) -> dict[str, Any]:
    """The one-device Lightning checkpoint from a DCP checkpoint folder, offline (no process group).

    ``state_dict``: the module's names, whole tensors (every tp/dp shard joined); ``optimizer_states``: torch's
    per-index form (indices in param-group order, as the unsharded module's optimizer numbers them); everything
    else as saved (epoch, global_step, loops, lr_schedulers, callbacks, hyper_parameters). Loads with
    ``Module.load_from_checkpoint`` / ``Trainer.fit(ckpt_path=...)`` on one device after ``torch.save``.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = Path(folder)
    if not is_dcp_folder(folder):
        raise ValueError(f"{str(folder)!r} is not an lp_tensor/lp_pipeline checkpoint folder ({META_FILE} and DCP "
                         f"{DCP_METADATA_FILE}).")
    tensors: dict[str, Any] = {}
    _load_state_dict(tensors, storage_reader=FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    checkpoint: dict[str, Any] = torch.load(folder / META_FILE, map_location="cpu", weights_only=False)
    check_format_version(checkpoint, where=folder / META_FILE)
    groups_by_opt = checkpoint.pop(OPTIMIZER_GROUPS_KEY, [])
    for key in DCP_LAYOUT_KEYS.values():
        checkpoint.pop(key, None)
    checkpoint["state_dict"] = dict(tensors[DCP_MODEL_KEY])
    optimizer_states = []
    for i, groups in enumerate(groups_by_opt):
        saved = tensors.get(DCP_OPTIM_KEY, {}).get(str(i), {}).get("state", {})
        index: dict[str, int] = {}
        out_groups = []
        for group in groups:
            ids = []
            for name in group["params"]:
                index.setdefault(name, len(index))
                ids.append(index[name])
            out_groups.append({**group, "params": ids})
        state = {index[name]: dict(s) for name, s in saved.items()}
        optimizer_states.append({"state": state, "param_groups": out_groups})
    checkpoint["optimizer_states"] = optimizer_states
    return checkpoint


def read_full(info: CheckpointInfo, *, trusted: bool = False) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``(state_dict under the module's names, every other key -- optimizer states in the one-device form
    included)``: every tp/dp shard joined into whole tensors, offline."""
    full = read_full_checkpoint(info.path)
    state = strip_wrapper_prefixes(full.pop("state_dict"))
    return state, full
