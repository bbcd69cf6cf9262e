"""Resume under another layout: any checkpoint the library writes, read into the *one-device* form with its optimizer.

:func:`read_resumable` turns a checkpoint of any supported format into the dict a one-device Lightning run would
have saved: ``state_dict`` (whole tensors under the LightningModule's names), ``optimizer_states`` in torch's
per-index form (state tensors as large as their parameters, indices numbered as a one-device optimizer numbers them:
group by group, in each group's order), ``lr_schedulers``, ``loops`` (epoch and batch position), ``callbacks``,
``hyper_parameters`` and the rest as saved. Every strategy resumes from that form by re-sharding it for its own
layout (``lp_ddp``/``lp_dp``: as is; ``lp_sharded``: its ZeRO optimizer shards the per-index state; ``lp_tensor``,
``lp_pipeline``, ``lp_hybrid``: each rank takes the tensors it holds, by name, cut like its parameters).

How each format is joined (offline, in one CPU process, no process group):

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
name, checking that the saved param groups match the live ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .formats import CheckpointFormatError, CheckpointInfo, load_torch_file
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
    "read_resumable",
    "resume_note",
]

RESUMED_FROM_KEY = "lp_resumed_from"
"""Set in the dict :func:`read_resumable` returns: a description of the source (format, stage, ranks)."""


class ResumeError(CheckpointFormatError):
    """A checkpoint that cannot be resumed under the requested layout (the message says why and what to do)."""


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
        checkpoint["optimizer_states"] = _join_sharded_optimizer(info, trusted=trusted)
    elif info.format == "deepspeed":
        if not trusted:
            raise ResumeError(
                f"{info.path} is a {info.describe()}: its optimizer files hold DeepSpeed objects that only "
                "torch.load(weights_only=False) reads, which runs code stored in them. If you trust the folder, set "
                f"{TRUST_ENV}=1 (resuming) or pass --trust (lightning-parallel consolidate --resumable)."
            )
        checkpoint["optimizer_states"] = [_join_deepspeed_optimizer(info)]
    checkpoint[RESUMED_FROM_KEY] = info.describe()
    return checkpoint


# ---------------------------------------------------------------------------------------------- lp_sharded
def _join_sharded_optimizer(info: CheckpointInfo, *, trusted: bool) -> list[dict[str, Any]]:
    parts = [load_torch_file(f, trusted=trusted, what="a rank file of an lp_sharded checkpoint")
             for f in info.files[1:]]
    per_rank: list[list[dict[str, Any]]] = []
    for f, part in zip(info.files[1:], parts, strict=True):
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
        if info.zero_stage == 3:
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


# ---------------------------------------------------------------------------------------------- DeepSpeed
_DS_SKIP_GROUP_KEYS = frozenset({"params", "bias_correction"})  # DeepSpeed CPU Adam only: torch Adam always corrects


def _join_deepspeed_optimizer(info: CheckpointInfo) -> dict[str, Any]:
    """Adam's per-parameter state from a DeepSpeed ZeRO folder: each state key's flat partitions (one per rank and
    param group) put through DeepSpeed's own ``zero_to_fp32`` reconstruction, as the fp32 masters are."""
    from deepspeed.utils import zero_to_fp32 as z

    from .read import deepspeed_quietly

    assert info.tag is not None
    folder = info.path / info.tag
    with deepspeed_quietly():
        model_states = z.parse_model_states(z.get_model_state_files(str(folder)))
        files = z.get_optim_files(str(folder))
        parts = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
    stage = int(parts[0]["zero_stage"])
    # the host optimizer over each rank's flat partitions (ZeRO-1/2: base_optimizer_state; ZeRO-3: optimizer_state_dict)
    base = [p.get("base_optimizer_state") or p["optimizer_state_dict"] for p in parts]
    n_groups = len(model_states[0].param_shapes)  # the user's param groups (ZeRO-1/2 keep one flat group each)
    if stage == 3 and len(base[0]["param_groups"]) != n_groups:
        raise ResumeError(
            f"{info.path}: a ZeRO-3 DeepSpeed folder whose optimizer holds {len(base[0]['param_groups'])} sub-groups "
            f"for {n_groups} param groups; the files do not say which sub-group belongs to which group (their "
            "hyper-parameters, such as weight decay, may differ). Fix: resume it with lp_zero_offload at ZeRO-3, or "
            "save with a sub_group_size at least the model's parameter count."
        )
    first = base[0]["state"][min(base[0]["state"])] if base[0]["state"] else {}
    keys = [k for k, v in first.items() if isinstance(v, Tensor) and v.dim() == 1]
    step = first.get("step", base[0]["param_groups"][0].get("step", 0))
    per_key: dict[str, dict[str, Tensor]] = {}
    for key in keys:
        if stage <= 2:
            flat = [[b["state"][g][key] for g in range(n_groups)] for b in base]
            paddings = parts[0].get("param_alignment_paddings")
            with deepspeed_quietly():
                rebuilt = z._get_fp32_state_dict_from_zero2_checkpoint(len(parts), flat, model_states, True, paddings)
        else:  # one flat partition per sub-group, in the host optimizer's order
            flat3 = [[b["state"][i][key] for i in sorted(b["state"])] for b in base]
            with deepspeed_quietly():
                rebuilt = z.to_torch_tensor(  # ZeRO-3 returns lazily gathered tensors
                    z._get_fp32_state_dict_from_zero3_checkpoint(len(parts), flat3, model_states, True))
        per_key[key] = {k: v.detach().clone() for k, v in rebuilt.items()}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for g, shapes in enumerate(model_states[0].param_shapes):
        ids = []
        for name in shapes:
            state[index] = {key: per_key[key][name] for key in keys}
            state[index]["step"] = torch.tensor(float(step))
            ids.append(index)
            index += 1
        saved = base[0]["param_groups"][min(g, len(base[0]["param_groups"]) - 1)]
        groups.append({**{k: v for k, v in saved.items() if k not in _DS_SKIP_GROUP_KEYS and k != "step"},
                       "params": ids})
    return {"state": state, "param_groups": groups}


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
    if whole_module:
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
