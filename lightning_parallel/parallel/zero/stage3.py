"""ZeRO stage 3 over the ``dp`` axis: torch FSDP2 ``fully_shard`` (runs on CPU with gloo), and its checkpoints.

Sharded along ``dp`` (``N`` ranks): parameters, gradients and optimizer states; every parameter is a DTensor
``Shard(0)`` (dim 0 padded to a multiple of ``N``). Per rank: ``(P + G + K) Psi / N``. Collectives per step: in
forward each sharded unit (each transformer block, then the root's remaining parameters) all-gathers its parameters
and frees them afterwards; in backward it all-gathers them again and reduce-scatters the gradients; the optimizer
step is local. ``3 Psi (N-1)/N`` elements sent per rank and step -- ``(3 Psi - Psi_last) (N-1)/N`` where the unit
that runs last in forward (the head) keeps its parameters gathered into the backward, which begins with it
(``keep_last_gathered``, torchtitan's default). No Lightning import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

__all__ = [
    "apply_zero3",
    "fsdp2_dtype_refusal",
    "fsdp2_parameter_refusal",
    "last_in_forward",
    "zero3_full_model_state",
    "zero3_full_optimizer_state",
    "zero3_load_full_model_state",
    "zero3_load_full_optimizer_state",
    "zero3_load_local_state",
    "zero3_local_state",
]


def _units(model: nn.Module) -> list[nn.Module]:
    """The units sharded one by one: the members of every ``nn.ModuleList``/``nn.ModuleDict`` (transformer blocks,
    kept in a dict keyed by layer index so that names survive a pipeline split), then every other
    direct child of the root that holds parameters (embedding, head). Left with no parameters of its own, the root
    keeps nothing gathered from forward to backward (it is never resharded after its forward), so a step moves
    exactly ``3 Psi``."""
    units: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            units.extend(module)
        elif isinstance(module, nn.ModuleDict):
            units.extend(module.values())
    covered = {id(p) for u in units for p in u.parameters()}
    for child in model.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            continue
        if any(id(p) not in covered for p in child.parameters()):
            units.append(child)
    return units


def _groups(units: list[nn.Module]) -> list[list[nn.Module]]:
    """The units as FSDP2 groups: units that share a parameter they manage (tied input and output embeddings) are
    sharded as one group -- FSDP2 refuses a parameter managed by two groups -- the others one each, in order. A unit
    manages its parameters but those of the units nested in it (a Hugging Face model's body holds its layers)."""
    return _grouped(units)[0]


def _grouped(units: list[nn.Module]) -> tuple[list[list[nn.Module]], list[set[int]]]:
    """:func:`_groups`, with the ids of the parameters each group manages."""
    def managed(unit: nn.Module) -> set[int]:
        nested = {id(p) for other in units if other is not unit and any(other is m for m in unit.modules())
                  for p in other.parameters()}
        return {id(p) for p in unit.parameters()} - nested

    groups: list[list[nn.Module]] = []
    owned: list[set[int]] = []
    for unit in units:
        ids = managed(unit)
        tied = [i for i, group_ids in enumerate(owned) if group_ids & ids]
        if not tied:
            groups.append([unit])
            owned.append(ids)
            continue
        first = tied[0]
        groups[first] = [m for i in tied for m in groups[i]] + [unit]
        owned[first] = set().union(*(owned[i] for i in tied), ids)
        groups = [group for i, group in enumerate(groups) if i not in tied[1:]]
        owned = [group_ids for i, group_ids in enumerate(owned) if i not in tied[1:]]
    return groups, owned


def fsdp2_dtype_refusal(model: nn.Module, key: str = "zero_stage=3") -> str | None:
    """Why FSDP2 cannot shard ``model`` as :func:`apply_zero3` groups it, or None: each group's parameters (a unit's,
    and the root's own, those outside every unit) become one flat buffer, so they must share one dtype -- FSDP2
    failed in every rank on "FSDP expects uniform original parameter dtype" (a module that cast its head alone to
    bf16)."""
    params = {id(p): (name, p) for name, p in model.named_parameters()}
    names = {id(m): name for name, m in model.named_modules()}
    groups, owned = _grouped(_units(model))
    covered = set().union(*owned) if owned else set()
    parts = [(", ".join(names.get(id(m), "?") for m in group), ids) for group, ids in zip(groups, owned, strict=True)]
    parts.append(("the module itself (parameters outside every unit)", set(params) - covered))
    for label, ids in parts:
        mine = [params[i] for i in ids if i in params]
        dtypes = sorted({str(p.dtype).replace("torch.", "") for _, p in mine})
        if len(dtypes) > 1:
            shown = ", ".join(f"{name} {str(p.dtype).replace('torch.', '')}" for name, p in mine[:6])
            return (f"{key}: FSDP2 shards the parameters of each unit as one flat buffer of one dtype, and {label} "
                    f"holds {' and '.join(dtypes)} ({shown}{', ...' if len(mine) > 6 else ''}). Fix: give the module "
                    "one dtype (precision='bf16-true' casts all of it; precision='bf16-mixed' keeps fp32 weights and "
                    "computes in bf16), or use zero_stage=1 with the dtypes in separate param groups.")
    return None


def last_in_forward(model: nn.Module) -> nn.Module | None:
    """The unit that runs last in forward, by the layout models follow (embedding, blocks, head): the last direct
    child of the root that :func:`_units` shards and that is defined after every child holding blocks (the GPT's
    ``head``, a Hugging Face causal LM's ``lm_head``); None when no such child exists (no blocks, or nothing with
    parameters after them), or when it shares a parameter with another unit (tied embeddings: one group with the
    embedding, which runs first)."""
    children = list(model.children())
    holds_blocks = [i for i, child in enumerate(children)
                    if any(isinstance(m, nn.ModuleList | nn.ModuleDict) for m in child.modules())]
    if not holds_blocks:
        return None
    units = _units(model)
    after = [child for child in children[holds_blocks[-1] + 1:] if any(child is u for u in units)]
    if not after:
        return None
    alone = next(group for group in _groups(units) if any(after[-1] is m for m in group))
    return after[-1] if len(alone) == 1 else None


def fsdp2_parameter_refusal(model: nn.Module, key: str = "zero_stage=3") -> str | None:
    """Why FSDP2 cannot shard ``model`` (``key``: the layout setting that asks for it), or None: FSDP2 refuses a 0-d
    (scalar) parameter, which has no dimension to shard. (A non-contiguous parameter, which it refuses too, is made
    contiguous in place by :func:`apply_zero3`: the same values.)"""
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if not scalars:
        return None
    shown = ", ".join(repr(n) for n in scalars[:5]) + (f" and {len(scalars) - 5} more" if len(scalars) > 5 else "")
    return (f"{key}: FSDP2 shards every parameter along its first dimension, and {shown} "
            f"{'is a 0-d (scalar) parameter' if len(scalars) == 1 else 'are 0-d (scalar) parameters'} with none "
            "to shard (torch's fully_shard refuses them in every rank). Fix: make each 1-D with one element "
            "(nn.Parameter(torch.tensor([value])), which broadcasts as the scalar did), or use zero_stage=1 (whole "
            "parameters, the optimizer state sharded).")


def apply_zero3(model: nn.Module, *, mesh: DeviceMesh, reshard_after_forward: bool = True,
                keep_last_gathered: bool = False, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` every unit (blocks, then the root's other children; units that share a parameter, such as
    tied input and output embeddings, as one group), then the root, over the 1-D dp mesh (or HSDP's 2-D
    ``(dp_replicate, dp_shard)`` mesh: sharded inside a group, gradients all-reduced across groups).

    In place: ``model`` becomes an ``FSDPModule`` whose parameters are DTensors; returns it. ``param_dtype`` /
    ``reduce_dtype`` (FSDP2's ``MixedPrecisionPolicy``, e.g. bf16 / fp32 for ``bf16-mixed``): the sharded parameters
    stay in their dtype (the fp32 masters the optimizer steps), each unit's all-gather sends and computes in
    ``param_dtype`` (half the bytes of fp32), and the gradients are reduce-scattered in ``reduce_dtype``.
    ``keep_last_gathered`` (with ``reshard_after_forward``): the unit that runs last in forward
    (:func:`last_in_forward`) keeps its parameters gathered from its forward into the backward, which begins with it
    -- freeing them would only make the backward wait at once for the same all-gather again (torchtitan keeps its
    final norm and output projection so). Its gradients are reduce-scattered and its parameters freed after its
    backward as every unit's.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh.ndim not in (1, 2):
        raise ValueError(f"apply_zero3 needs the 1-D dp sub-mesh (or the 2-D (replicate, shard) mesh of HSDP), got a "
                         f"{mesh.ndim}-D mesh {mesh.mesh_dim_names}.")
    why = fsdp2_parameter_refusal(model) or fsdp2_dtype_refusal(model)
    if why is not None:  # where the module is only complete in the ranks (configure_model)
        from lightning_parallel.config import LayoutError

        raise LayoutError(why)
    for p in model.parameters():
        if not p.is_contiguous():  # a transposed view (w.t()): fully_shard refuses it; the same values, contiguous
            p.data = p.data.contiguous()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kept = last_in_forward(model) if reshard_after_forward and keep_last_gathered else None
    for group in _groups(_units(model)):
        fully_shard(group[0] if len(group) == 1 else group, mesh=mesh,  # type: ignore[arg-type]
                    reshard_after_forward=reshard_after_forward and group[0] is not kept, mp_policy=policy)
    # the root's own parameters (one on the LightningModule itself, outside every unit) stay gathered after its
    # forward, as torch's default for a root does: the backward gathers them first anyway, and a training_step that
    # reads one after the forward (a temperature scaling the loss) would meet a sharded DTensor
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    return model


def _copy(value: Any) -> Any:
    # get_*_state_dict(cpu_offload=True) may alias live tensors on CPU (docs/limits.md): copy.
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def zero3_full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """The full (unsharded) model state dict on every rank (collective: all-gathers every parameter)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return _copy(state)


def zero3_load_full_model_state(model: nn.Module, state: dict[str, Tensor], *, strict: bool = True) -> None:
    """Load a full state dict (every rank holds it) into the sharded model: each rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict))  # type: ignore[arg-type]


def _param_names(model: nn.Module, optimizer: Optimizer) -> list[str]:
    """The FQN of each optimizer parameter, in the order torch numbers them in ``optimizer.state_dict()``."""
    from lightning_parallel.parallel.compile import strip_compile_prefix

    # torch's state-dict helpers name parameters without torch.compile's "_orig_mod." (a compiled submodule)
    name_of = {id(p): strip_compile_prefix(n) for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def zero3_full_optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The full optimizer state in the standard per-parameter-index form (loads into the same optimizer class on
    the unsharded model on one device). Collective: all-gathers every state tensor."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    by_name: Any = get_optimizer_state_dict(model, optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    index = {name: i for i, name in enumerate(_param_names(model, optimizer))}
    state = {index[name]: _copy(s) for name, s in by_name["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
              for g in by_name["param_groups"]]
    return {"state": state, "param_groups": groups}


def zero3_load_full_optimizer_state(model: nn.Module, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Load a per-parameter-index optimizer state (from :func:`zero3_full_optimizer_state` or one device)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _param_names(model, optimizer)
    state = {names[int(i)]: s for i, s in state_dict["state"].items()}
    groups = [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state_dict["param_groups"]]
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True))


def _to_local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, dict):
        return {k: _to_local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_local(v) for v in value]
    return _copy(value)


def zero3_local_state(model: nn.Module | None, optimizer: Optimizer | None = None) -> dict[str, Any]:
    """This rank's shards of the model and/or optimizer state as plain tensors (a sharded checkpoint; no
    collective). Loads back with :func:`zero3_load_local_state` on the same dp size."""
    out: dict[str, Any] = {}
    if model is not None:
        out["model"] = _to_local(dict(model.state_dict()))
    if optimizer is not None:
        out["optim"] = _to_local(optimizer.state_dict())
    return out


@torch.no_grad()
def zero3_load_local_state(model: nn.Module, optimizer: Optimizer | None, state: dict[str, Any]) -> None:
    """Load :func:`zero3_local_state` output (``model`` and/or ``optim``) saved by this dp rank, same layout."""
    from torch.distributed.tensor import DTensor

    for name, tensor in (model.state_dict().items() if "model" in state else ()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        saved = state["model"][name]
        if saved.shape != local.shape:
            raise ValueError(
                f"sharded checkpoint: {name} has local shape {tuple(saved.shape)} on this rank, but the model's shard "
                f"is {tuple(local.shape)}. Each entry of the folder's checkpoint['state_dict'] is this rank's dim-0 "
                "shard (a module's on_load_checkpoint that put a whole tensor there does this). Fix: resume on the "
                "layout it was saved with, change whole weights in on_train_start instead of on_load_checkpoint, or "
                "use a consolidated checkpoint (lightning-parallel consolidate)."
            )
        local.copy_(saved)
    if optimizer is None or "optim" not in state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    osd = state["optim"]
    for i, slot in osd["state"].items():
        p = params[int(i)]
        for key, value in list(slot.items()):
            if isinstance(p, DTensor) and isinstance(value, Tensor) and value.shape == p.to_local().shape:
                slot[key] = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
    optimizer.load_state_dict(osd)
