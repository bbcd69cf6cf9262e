"""Resume under another layout: any checkpoint the library writes, read into the *one-device* form with its optimizer.

:func:`read_resumable` turns a checkpoint of any supported format into the dict a one-device Lightning run would
have saved: ``state_dict`` (whole tensors under the LightningModule's names), ``optimizer_states`` in torch's
per-index form (state tensors as large as their parameters, indices numbered as a one-device optimizer numbers them:
group by group, in each group's order), ``lr_schedulers``, ``loops`` (epoch and batch position), ``callbacks``,
``hyper_parameters`` and the rest as saved. Every strategy resumes from that form by re-sharding it for its own
layout (``lp_ddp``/``lp_dp``: as is; ``lp_sharded``: its ZeRO optimizer shards the per-index state; ``lp_tensor``,
``lp_pipeline``, ``lp_hybrid``: each rank takes the tensors it holds, by name, cut like its parameters).

How each format is joined (offline, in one CPU process, no process group; each format's module in
:mod:`lightning_parallel.checkpoint.formats` does it):

* ``lightning`` (one file): already in that form.
* ``lp_sharded`` folder: weights as :func:`~lightning_parallel.checkpoint.full_state_dict` joins them; the optimizer
  from the rank files -- stages 1-2: each rank's flat shard of each param group, concatenated in rank order and cut
  back into per-parameter tensors by the recorded shapes (the padding at the end dropped); stage 3: each parameter's
  ``Shard(0)`` state pieces concatenated along dim 0 in rank order.
* ``lp_tensor`` / ``lp_pipeline`` / ``lp_hybrid`` DCP folders: every shard joined by name, then numbered by the saved
  param groups (which hold names).
* DeepSpeed folders (``lp_zero_offload`` with CPU offload or none, ZeRO-1/2/3): the weights are DeepSpeed's fp32
  masters; Adam's moments are rebuilt from each rank's flat partition of the optimizer state the same way DeepSpeed's
  ``zero_to_fp32`` rebuilds the masters (partitions joined in rank order, cut by the recorded parameter shapes,
  alignment padding dropped), numbered group by group in the recorded order. Their optimizer files hold DeepSpeed
  objects, so they are read only when trusted (:data:`TRUST_ENV`). NVMe-offloaded folders are refused: their state
  is in DeepSpeed's swap files.

:func:`optimizer_by_name` / :func:`optimizer_by_index` convert between the per-index form and one keyed by parameter
name, checking that the saved param groups match the live ones. :func:`resume_one_device` is what every strategy's
``load_checkpoint`` does with a checkpoint that is not its own format on its own layout; :func:`place_model_state` and
:func:`place_optimizer_state` cut the one-device form for a rank of a model-parallel layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from . import rng
from .errors import CheckpointFormatError, ResumeError
from .formats import deepspeed, sharded
from .formats.common import CheckpointStrategy
from .names import RESUMED_FROM_KEY
from .read import read_checkpoint

__all__ = [
    "RESUMED_FROM_KEY",
    "TRUST_ENV",
    "ResumeError",
    "check_fits",
    "check_state_shapes",
    "load_for_resume",
    "optimizer_by_index",
    "optimizer_by_name",
    "place_model_state",
    "place_optimizer_state",
    "read_resumable",
    "resume_note",
    "resume_one_device",
]


class ResumingStrategy(CheckpointStrategy, Protocol):
    """What :func:`resume_one_device` uses of the strategy (any of the library's)."""

    strategy_name: str

    @property
    def optimizers(self) -> list[Any]: ...

    def describe(self) -> str: ...


def read_resumable(path: str | Path, *, trusted: bool = False) -> dict[str, Any]:
    """The one-device Lightning checkpoint (weights, per-index optimizer state, schedulers, loops) of ``path``.

    Raises:
        CheckpointFormatError: the path is not a checkpoint of a known format, or is incomplete or corrupt.
        ResumeError: a DeepSpeed folder (see the module docstring), or a checkpoint without optimizer state where
            one is needed (the caller decides: :func:`read_resumable` itself returns what the file holds).
    """
    state, rest, info = read_checkpoint(path, trusted=trusted)
    if info.format == "deepspeed_nvme":
        raise ResumeError(
            f"{info.path} is a {info.describe()}: its optimizer state lives in DeepSpeed's NVMe swap files, which only "
            "lp_zero_offload with NVMe offload reads back. Fix: resume it with lp_zero_offload (NVMe offload, the "
            f"same world size, {info.world_size}); or take its weights with `lightning-parallel consolidate "
            f"{info.path} OUT.ckpt` and start a new fit from them (load_from_checkpoint), without the optimizer state."
        )
    checkpoint = dict(rest)
    checkpoint["state_dict"] = state
    if info.format == "lp_sharded":
        checkpoint["optimizer_states"] = sharded.read_optimizer_states(info, trusted=trusted)
    elif info.format == "deepspeed":
        if not trusted:
            raise ResumeError(
                f"{info.path} is a {info.describe()}: its optimizer files hold DeepSpeed objects that only "
                "torch.load(weights_only=False) reads, which runs code stored in them. If you trust the folder, set "
                f"{TRUST_ENV}=1 (resuming) or pass --trust (lightning-parallel consolidate --resumable)."
            )
        checkpoint["optimizer_states"] = [deepspeed.read_optimizer_state(info)]
    checkpoint[RESUMED_FROM_KEY] = info.describe()
    return checkpoint


# ---------------------------------------------------------------------------------------------- by name / index
def _flat_ids(groups: Sequence[dict[str, Any]]) -> list[Any]:
    return [p for g in groups for p in g["params"]]


def optimizer_by_name(saved: dict[str, Any], names: Sequence[Sequence[str]], *, where: str = "the checkpoint"
                      ) -> dict[str, Any]:
    """A per-index optimizer state as ``{"state": {name: slot}, "param_groups": [{..., "params": [name, ...]}]}``.

    ``names``: the live optimizer's parameter names, group by group, in the one-device order (what a one-device
    optimizer built by the same ``configure_optimizers`` would hold). Raises :class:`ResumeError` when the group sizes
    differ (another ``configure_optimizers``).
    """
    groups = saved.get("param_groups", [])
    sizes = [len(g["params"]) for g in groups]
    live = [len(n) for n in names]
    if sizes != live:
        raise ResumeError(
            f"{where}: the saved optimizer has param groups of sizes {sizes}, this run's optimizer {live}; they were "
            "built by different configure_optimizers (or another model). Fix: resume with the same module and "
            "optimizer set-up."
        )
    by_id: dict[Any, str] = {}
    out_groups = []
    for g, group_names in zip(groups, names, strict=True):
        for pid, name in zip(g["params"], group_names, strict=True):
            by_id[pid] = name
            by_id[str(pid)] = name
        out_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(group_names)})
    state = {by_id[pid]: dict(slot) for pid, slot in saved.get("state", {}).items()}
    return {"state": state, "param_groups": out_groups}


def optimizer_by_index(by_name: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_by_name`: torch's per-index form, numbered group by group."""
    index: dict[str, int] = {}
    groups = []
    for g in by_name["param_groups"]:
        ids = []
        for name in g["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
    return {"state": {index[n]: dict(s) for n, s in by_name["state"].items()}, "param_groups": groups}


def check_state_shapes(by_name: dict[str, Any], shapes: dict[str, torch.Size], *, where: str) -> None:
    """Refuse optimizer state whose tensors do not have their parameter's full shape (another model shape)."""
    for name, slot in by_name["state"].items():
        shape = shapes.get(name)
        if shape is None:
            continue
        for key, value in slot.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != shape:
                raise ResumeError(f"{where}: the optimizer state {name}.{key} has shape {list(value.shape)}, the "
                                  f"parameter {list(shape)}; the checkpoint is from another model shape.")


TRUST_ENV = "LIGHTNING_PARALLEL_TRUST_CHECKPOINTS"
"""Set to ``1`` to let resuming read checkpoints with ``torch.load(weights_only=False)`` (runs code stored in the file:
only for files you trust). Unset, every file is read with ``weights_only=True``."""


def load_for_resume(path: str | Path, *, strategy: str) -> dict[str, Any]:
    """What a strategy's ``load_checkpoint`` returns when resuming from ``path`` written under any layout:
    :func:`read_resumable` with ``trusted`` from :data:`TRUST_ENV`, errors prefixed with the strategy's name."""
    import os

    trusted = os.environ.get(TRUST_ENV, "") == "1"
    try:
        return read_resumable(path, trusted=trusted)
    except ResumeError:
        raise
    except CheckpointFormatError as err:
        raise CheckpointFormatError(f"{strategy} cannot resume from {path}: {err}") from None


def resume_note(checkpoint: dict[str, Any], *, strategy: str, layout: str) -> str | None:
    """A one-line note for rank 0 when the checkpoint came from another format than one file (re-sharded)."""
    source = checkpoint.get(RESUMED_FROM_KEY)
    if source is None or source == "Lightning file":
        return None
    return (f"lightning-parallel: {strategy} resumes from the {source}: weights and optimizer state joined into the "
            f"one-device form and re-sharded for {layout}.")


def check_fits(checkpoint: dict[str, Any], *, module: Any, optimizers: Sequence[Any], path: str | Path,
               whole_module: bool = True) -> None:
    """Refuse, naming the file and the mismatch, a one-device checkpoint that does not fit the module (a tensor of
    another shape; with ``whole_module``, a tensor missing or left over) or whose optimizer does not match the
    run's (another number of optimizers or param-group sizes). ``module`` is the LightningModule (its state dict
    under the module's own names; DTensor and FSDP2 parameters report their full shape)."""
    saved = checkpoint.get("state_dict") or {}
    live = {k: v for k, v in module.state_dict().items()}
    mismatched = [(k, list(saved[k].shape), list(v.shape)) for k, v in live.items()
                  if k in saved and isinstance(saved[k], Tensor) and isinstance(v, Tensor)
                  and saved[k].shape != v.shape]
    hp = _hparams_diff(checkpoint.get("hyper_parameters"), getattr(module, "hparams", None))
    if mismatched:
        name, got, want = mismatched[0]
        raise ResumeError(
            f"{path}: {name} has shape {got} in the checkpoint but {want} in this model ({len(mismatched)} tensor(s) "
            f"differ){hp}. The checkpoint is from another model shape: resume with the model it was saved with."
        )
    if whole_module and getattr(module, "strict_loading", True):  # strict_loading=False: what matches, as Lightning
        missing = sorted(set(live) - set(saved))
        extra = sorted(set(saved) - set(live))
        if missing or extra:
            raise ResumeError(
                f"{path}: the checkpoint does not hold this model's tensors: missing {missing[:4]}"
                f"{' ...' if len(missing) > 4 else ''}, unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}"
                f"{hp}. Resume with the model it was saved with."
            )
    states = checkpoint.get("optimizer_states")
    if states is None or not optimizers:
        return
    if len(states) != len(optimizers):
        raise ResumeError(f"{path}: holds {len(states)} optimizer state(s); this run has {len(optimizers)} "
                          "optimizer(s). Resume with the same configure_optimizers.")
    for i, (state, optimizer) in enumerate(zip(states, optimizers, strict=True)):
        saved_sizes = [len(g["params"]) for g in state.get("param_groups", [])]
        raw = getattr(optimizer, "_optimizer", optimizer)
        if hasattr(raw, "shards"):  # the library's ZeroOptimizer: one flat shard per group
            live_sizes = [len(shard.params) for shard in raw.shards]
        else:
            groups = getattr(raw, "original_params", None) or [g["params"] for g in raw.param_groups]
            live_sizes = [len(g) for g in groups]
        if whole_module and saved_sizes != live_sizes:
            raise ResumeError(
                f"{path}: optimizer {i} was saved with param groups of {saved_sizes} parameters; this run's has "
                f"{live_sizes}. The optimizer does not match (another configure_optimizers or model): resume with "
                "the one it was saved with."
            )


def _hparams_diff(saved: Any, live: Any) -> str:
    """`` (hyper-parameters: n_layer 4 in the checkpoint, 2 here)`` for the keys that differ, or ``""``."""
    if not isinstance(saved, dict) or live is None:
        return ""
    try:
        diffs = [f"{k} {saved[k]!r} in the checkpoint, {live[k]!r} here" for k in saved
                 if k in live and isinstance(saved[k], (int, float, str, bool)) and saved[k] != live[k]]
    except (KeyError, TypeError):
        return ""
    return f" (hyper-parameters: {'; '.join(diffs[:4])})" if diffs else ""


# ---------------------------------------------------------------------------------------------- for the strategies
def resume_one_device(strategy: ResumingStrategy, path: str | Path, *, optimizers: Sequence[Any] | None = None,
                      whole_module: bool = True, place: Callable[[dict[str, Any]], None] | None = None
                      ) -> dict[str, Any]:
    """What a strategy's ``load_checkpoint`` returns for a checkpoint written under any layout: the one-device form
    (:func:`load_for_resume`), refused if it does not fit the module (:func:`check_fits` with ``optimizers``, the
    strategy's own by default, and ``whole_module``), put into the strategy's state by ``place`` where the strategy
    loads it itself, a note on rank 0 when it was re-sharded, and this rank's RNG states kept for the start of
    training. ``path`` is the same on every rank (broadcast by the caller). A folder is first checked against its
    checksums on rank 0 (every rank stops on a mismatch; :func:`~.verify.verify_folder_on_rank_zero`)."""
    from .verify import verify_folder_on_rank_zero

    verify_folder_on_rank_zero(strategy, path)
    checkpoint = load_for_resume(path, strategy=strategy.strategy_name)
    module = strategy.lightning_module
    if module is not None:
        check_fits(checkpoint, module=module, optimizers=strategy.optimizers if optimizers is None else optimizers,
                   path=path, whole_module=whole_module)
    if place is not None:
        place(checkpoint)
    note = resume_note(checkpoint, strategy=strategy.strategy_name, layout=strategy.describe())
    if note and strategy.is_global_zero:
        print(note, flush=True)
    rng.restore_rng_states(checkpoint, rank=strategy.global_rank, world_size=strategy.world_size, module=module)
    return checkpoint


def place_model_state(module: torch.nn.Module, full: dict[str, Any], *, strict: bool = True) -> None:
    """Copy a one-device ``state_dict`` into a model-parallel module, each whole tensor placed as this rank holds it
    (a DTensor is cut by its placements; no collective). Tensors this rank does not hold (other pipeline stages) are
    skipped; with ``strict``, a tensor of this rank missing from ``full`` is a ``KeyError``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    state = dict(module.state_dict())
    missing = [name for name in state if name not in full]
    if missing and strict:
        raise KeyError(f"the checkpoint has no {missing[:5]} ({len(missing)} tensors of this rank missing).")
    with torch.no_grad():
        for name, current in state.items():
            if name not in full:
                continue
            value = full[name]
            if isinstance(current, DTensor):
                value = distribute_tensor(value.to(current.dtype), current.device_mesh, current.placements)
            current.copy_(value)


def place_optimizer_state(module: torch.nn.Module, raw: Any, saved: dict[str, Any],
                          merge_param_groups: Callable[[list[list[dict[str, Any]]]], list[dict[str, Any]]]
                          ) -> dict[str, Any]:
    """A one-device (per-index) optimizer state -> by name, only the parameters this rank holds, each state
    tensor cut like its parameter (a DTensor for tp-sharded ones; cut locally, no collective).

    The indices are matched to names by the one-device numbering: every rank's param-group names, gathered
    and joined by ``merge_param_groups`` as they are joined when saving (one ``all_gather_object``)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    from lightning_parallel.parallel.tensor.sync import LocalShardZeroOptimizer

    name_of = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    own_groups = raw.original_params if isinstance(raw, LocalShardZeroOptimizer) else [
        list(g["params"]) for g in raw.param_groups]
    live = [{"params": [name_of[id(p)] for p in group]} for group in own_groups]
    gathered: list[Any] = [live]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, live)
    names = [g["params"] for g in merge_param_groups(gathered)]
    by_name = optimizer_by_name(saved, names, where="the checkpoint")
    params = dict(module.named_parameters())
    check_state_shapes(by_name, {n: p.shape for n, p in params.items()}, where="the checkpoint")
    state: dict[str, Any] = {}
    for name, slot in by_name["state"].items():
        p = params.get(name)
        if p is None:
            continue  # held by another pipeline stage
        placed: dict[str, Any] = {}
        for key, value in slot.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                value = value.to(device=p.device)
                if isinstance(p, DTensor):
                    value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
            placed[key] = value
        state[name] = placed
    return {"state": state, "param_groups": by_name["param_groups"]}
