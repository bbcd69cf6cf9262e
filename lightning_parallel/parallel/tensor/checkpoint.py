"""Distributed checkpoints of a tensor- or pipeline-parallel module (torch DCP): per-rank shards, resume, and the
offline reading of such a folder into the one-device state dict -- no process group needed for that.

A folder holds:

* ``layout.json`` (rank 0): the strategy and layout that wrote it (readable without unpickling anything);
* ``meta.pt`` (rank 0): everything of the Lightning checkpoint but the tensors -- epoch, step, loops, LR schedulers,
  callbacks, hyper-parameters -- plus each optimizer's ``param_groups`` with parameters named by their FQN, and
  ``lp_tensor_checkpoint`` or ``lp_pipeline_checkpoint`` = the layout that wrote it;
* DCP files (``.metadata`` + ``__<rank>_0.distcp``): ``model`` (the module's ``state_dict()``: each rank writes its
  tp/dp shards of every DTensor, replicated tensors are written once) and ``optim.<i>.state.<fqn>.<key>`` (each
  optimizer state tensor laid out like its parameter). The optimizer state is stored by parameter name in every
  zero stage (ZeRO-1 gathers its flat dp shards per parameter first), so the format does not depend on the stage.

:func:`read_full_checkpoint` joins the shards offline (DCP's ``_EmptyStateDictLoadPlanner``, ``no_dist=True``) into
the one-device Lightning checkpoint: ``state_dict`` with the module's own names and whole tensors, and
``optimizer_states`` in torch's per-index form. No Lightning import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = [
    "LAYOUT_FILE",
    "META_FILE",
    "PIPELINE_KEY",
    "TENSOR_KEY",
    "apply_optimizer_state",
    "is_tensor_checkpoint",
    "load_model",
    "load_optimizer",
    "optimizer_state_by_name",
    "read_full_checkpoint",
    "save_sharded",
    "saved_strategy",
]

META_FILE = "meta.pt"
LAYOUT_FILE = "layout.json"
TENSOR_KEY = "lp_tensor_checkpoint"
PIPELINE_KEY = "lp_pipeline_checkpoint"


def saved_strategy(path: str | Path) -> str:
    """The strategy that wrote a checkpoint folder, from its ``layout.json`` (``lp_tensor`` for folders written
    before that file existed)."""
    import json

    layout = Path(path) / LAYOUT_FILE
    if not layout.is_file():
        return "lp_tensor"
    return str(json.loads(layout.read_text()).get("strategy", "lp_tensor"))


def is_tensor_checkpoint(path: str | Path) -> bool:
    """True for a folder written by :func:`save_sharded` (``meta.pt`` holding :data:`TENSOR_KEY`, DCP metadata)."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}


def optimizer_state_by_name(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``{"state": {fqn: {key: tensor}}, "param_groups": [{..., "params": [fqn, ...]}]}`` for a torch optimizer over
    the module's (DTensor or plain) parameters; state tensors keep their DTensor layout. No collective."""
    name_of = _names(model)
    state: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        names = [name_of[id(p)] for p in group["params"]]
        for p, name in zip(group["params"], names, strict=True):
            if optimizer.state.get(p):
                state[name] = dict(optimizer.state[p])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


def save_sharded(folder: str | Path, *, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]],
                 meta: dict[str, Any] | None, rank: int) -> None:
    """Write a checkpoint folder (collective: every rank calls it with its shards; ``meta`` from rank 0).

    ``optimizer_states``: :func:`optimizer_state_by_name` of each optimizer; their ``param_groups`` go to
    ``meta.pt``, their state tensors to DCP.
    """
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    dcp.save({"model": model_state, "optim": {str(i): {"state": s["state"]} for i, s in enumerate(optimizer_states)}},
             checkpoint_id=str(folder))
    if rank == 0:
        assert meta is not None
        meta = {**meta, "optimizer_param_groups": [s["param_groups"] for s in optimizer_states]}
        torch.save(meta, folder / META_FILE)


def load_model(folder: str | Path, model: nn.Module) -> None:
    """Load the ``model`` entry into the (already parallelized) module in place: each rank reads its shards."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(folder))
    model.load_state_dict(state)


def _optim_template(folder: Path, index: int, model: nn.Module) -> dict[str, dict[str, Tensor]]:
    """Tensors shaped like the saved state of optimizer ``index``, laid out like their parameters (from the DCP
    metadata: a state tensor with the parameter's global shape is a ``zeros_like(param)``, anything else plain)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    params = dict(model.named_parameters())
    prefix = f"optim.{index}.state."
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
    dcp.load({"optim": {str(index): {"state": template}}}, checkpoint_id=str(folder))
    meta = torch.load(folder / META_FILE, map_location="cpu", weights_only=False)
    return {"state": template, "param_groups": meta["optimizer_param_groups"][index]}


def apply_optimizer_state(model: nn.Module, optimizer: Optimizer, by_name: dict[str, Any]) -> None:
    """Put a by-name state (:func:`load_optimizer`) into a torch optimizer over the module's parameters."""
    name_of = _names(model)
    for group, saved in zip(optimizer.param_groups, by_name["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
        for p in group["params"]:  # this rank's parameters (a pipeline stage holds some of the saved names)
            name = name_of[id(p)]
            if name in by_name["state"]:
                optimizer.state[p] = dict(by_name["state"][name])


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    return value


def read_full_checkpoint(folder: str | Path) -> dict[str, Any]:
    """The one-device Lightning checkpoint from a tensor-parallel checkpoint folder, offline (no process group).

    ``state_dict``: the module's names, whole tensors (every tp/dp shard joined); ``optimizer_states``: torch's
    per-index form (indices in param-group order, as the unsharded module's optimizer numbers them); everything
    else as saved (epoch, global_step, loops, lr_schedulers, callbacks, hyper_parameters). Loads with
    ``Module.load_from_checkpoint`` / ``Trainer.fit(ckpt_path=...)`` on one device after ``torch.save``.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = Path(folder)
    if not is_tensor_checkpoint(folder):
        raise ValueError(f"{str(folder)!r} is not an lp_tensor/lp_pipeline checkpoint folder (meta.pt and DCP "
                         ".metadata).")
    tensors: dict[str, Any] = {}
    _load_state_dict(tensors, storage_reader=FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    checkpoint: dict[str, Any] = torch.load(folder / META_FILE, map_location="cpu", weights_only=False)
    groups_by_opt = checkpoint.pop("optimizer_param_groups", [])
    checkpoint.pop(TENSOR_KEY, None)
    checkpoint.pop(PIPELINE_KEY, None)
    checkpoint.pop("lp_hybrid_checkpoint", None)
    checkpoint["state_dict"] = dict(tensors["model"])
    optimizer_states = []
    for i, groups in enumerate(groups_by_opt):
        saved = tensors.get("optim", {}).get(str(i), {}).get("state", {})
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
