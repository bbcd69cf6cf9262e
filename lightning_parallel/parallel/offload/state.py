"""Engine state outside DeepSpeed's own checkpoint: a consolidated fp32 state dict, and NVMe-offloaded state.

``consolidated_state_dict`` returns the full fp32 master weights of every parameter (plus buffers) under any stage
and offload target, keyed as ``module.state_dict()``, so the result loads into the plain module on one device. Each
parameter is one collective: stage 1-2 all-reduce the fragments of the fp32 master partition, stage 3 all-gathers the
partition (swapped in from NVMe first when it lives there). Every rank gets the full tensors.

NVMe offload (ZeRO-Infinity, stage 3): DeepSpeed 0.19.8 trains, but its ``save_checkpoint`` writes the swapped-out
(empty) fp32 partitions and its ``load_checkpoint`` restores nothing, silently. :func:`local_state` therefore
gathers this rank's own partition -- fp32 master weights and the optimizer moments of every parameter, plus the
optimizer step counts -- swapped in through DeepSpeed's public ``safe_get_local_*`` API (no collective, 1/N_d of the
state per rank); :func:`restore_local_state` writes them back with ``safe_set_local_*`` (which swaps them out again),
refreshes the working (16-bit or fp32) parameter partitions from the masters the way the engine's step does, and then
*verifies* every restored value against what was saved, so a resume that did not resume raises instead of training on.
Where that state is stored (one file per rank beside DeepSpeed's folder) is the checkpoint format's business:
:mod:`lightning_parallel.checkpoint.formats.deepspeed`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "ResumeVerificationError",
    "consolidated_state_dict",
    "local_state",
    "restore_local_state",
]

_FORMAT = 1


class ResumeVerificationError(RuntimeError):
    """The engine's state after a restore differs from the saved state (a resume that did not resume)."""


def _full_fp32(param: nn.Parameter) -> Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    value = safe_get_full_fp32_param(param)
    if value is not None:
        return value.detach().float().cpu().clone().reshape(getattr(param, "ds_shape", param.shape))
    if hasattr(param, "ds_id"):  # a frozen ZeRO-3 parameter: no fp32 master, gather the working copy
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().float().cpu().clone()
    return param.detach().float().cpu().clone()


def consolidated_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """The full fp32 state dict of a module trained by a DeepSpeed engine (collective: call on every rank)."""
    by_id = {id(p): _full_fp32(p) for p in module.parameters()}
    out: dict[str, Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        out[key] = by_id[id(value)] if id(value) in by_id else value.detach().cpu().clone()
    return out


def _optimizer_keys(engine: Any) -> list[str]:
    base = engine.optimizer.optimizer  # the host optimizer under ZeRO (CPU Adam: exp_avg, exp_avg_sq, step)
    keys: set[str] = set()
    for state in base.state.values():
        keys |= {k for k, v in state.items() if isinstance(v, Tensor) and v.dim() > 0}
    return sorted(keys) or ["exp_avg", "exp_avg_sq"]


def _steps(engine: Any) -> list[Any]:
    """The host optimizer's step count of each ZeRO-3 sub-group (its fp32 flat partition), in sub-group order."""
    opt = engine.optimizer
    return [opt.optimizer.state.get(flat, {}).get("step") for flat in opt.fp32_partitioned_groups_flat]


def _materialize_optimizer_state(engine: Any, keys: list[str]) -> None:
    """Create the optimizer state of every sub-group the way CPU Adam's first step would (zeros, step 0), so that
    a fresh engine has tensors -- registered with the NVMe swapper -- to restore into."""
    opt = engine.optimizer
    for i, flat in enumerate(opt.fp32_partitioned_groups_flat):
        state = opt.optimizer.state.get(flat, {})
        if all(k in state for k in keys):
            continue
        swappable = opt._swappable_optimizer_subgroup(i)
        if swappable:
            opt._optimizer_states_and_gradient_swap_in(i)
        state = opt.optimizer.state[flat]
        state.setdefault("step", 0)
        for key in keys:
            if key not in state:
                state[key] = torch.zeros_like(flat.data, dtype=torch.float32)
        if swappable:
            opt._optimizer_states_and_gradient_swap_out(i)


def _local_entries(engine: Any, keys: list[str]) -> dict[str, dict[str, Tensor]]:
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    out: dict[str, dict[str, Tensor]] = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        entry = {"fp32": safe_get_local_fp32_param(p).detach().cpu().clone()}
        for key in keys:
            entry[key] = safe_get_local_optimizer_state(p, key).detach().cpu().clone()
        out[name] = entry
    return out


def local_state(engine: Any, *, rank: int) -> dict[str, Any]:
    """This rank's ZeRO-3 partition (fp32 masters, optimizer moments, step counts, the parameters' full shapes), as
    plain CPU tensors in plain containers (``torch.load(weights_only=True)`` reads it back)."""
    if int(engine.zero_optimization_stage()) != 3:
        raise ValueError("local_state reads ZeRO-3 partitions; stages 1-2 are saved by the engine itself.")
    keys = _optimizer_keys(engine)
    _materialize_optimizer_state(engine, keys)  # a checkpoint before the first step saves zeros, as CPU Adam starts
    return {"format": _FORMAT, "world_size": engine.dp_world_size, "rank": rank, "keys": keys,
            "steps": _steps(engine), "params": _local_entries(engine, keys),
            "shapes": {n: list(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters()}}


def _set_steps(engine: Any, steps: list[Any]) -> None:
    opt = engine.optimizer
    if len(steps) != len(opt.fp32_partitioned_groups_flat):
        raise ValueError(f"the checkpoint has {len(steps)} optimizer sub-groups, this engine "
                         f"{len(opt.fp32_partitioned_groups_flat)} (another sub_group_size or model).")
    for flat, step in zip(opt.fp32_partitioned_groups_flat, steps, strict=True):
        if step is not None:
            opt.optimizer.state[flat]["step"] = step


def _refresh_working_params(engine: Any) -> None:
    """Copy the restored fp32 masters into the working parameter partitions (and swap those out), exactly the
    sequence the engine's optimizer step runs after updating each sub-group."""
    opt = engine.optimizer
    timers: set[str] = set()
    opt._partition_all_parameters()
    for sub_group_id in range(len(opt.fp16_groups)):
        opt._prepare_sub_group(sub_group_id, timers)
        opt._reassign_or_swap_out_partitioned_parameters(sub_group_id)
        opt._release_sub_group(sub_group_id, timers)
    opt._post_step(timers)


def restore_local_state(engine: Any, payload: dict[str, Any], *, where: str = "the checkpoint") -> int:
    """Restore this rank's partition from :func:`local_state`'s ``payload``, then verify it; returns the tensors
    checked. ``where`` names the source in the errors.

    Raises ``ValueError`` for another world size or model, and :class:`ResumeVerificationError` if any restored value
    differs from the saved one.
    """
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    if payload["world_size"] != engine.dp_world_size:
        raise ValueError(
            f"{where} was saved by {payload['world_size']} data-parallel ranks, this run has {engine.dp_world_size}: "
            "NVMe-offloaded partitions resume only on the same number of ranks."
        )
    params = dict(engine.module.named_parameters())
    missing = sorted(set(payload["params"]) - set(params))
    if missing:
        raise ValueError(f"{where} holds parameters this model does not have: {missing[:5]}.")
    _materialize_optimizer_state(engine, payload["keys"])
    for name, entry in payload["params"].items():
        safe_set_local_fp32_param(params[name], entry["fp32"])
        for key in payload["keys"]:
            safe_set_local_optimizer_state(params[name], entry[key], key)
    _set_steps(engine, payload["steps"])
    _refresh_working_params(engine)
    return _verify(engine, payload)


def _verify(engine: Any, payload: dict[str, Any]) -> int:
    now = _local_entries(engine, payload["keys"])
    if _steps(engine) != payload["steps"]:
        raise ResumeVerificationError(f"optimizer step counts {_steps(engine)} != saved {payload['steps']}.")
    checked = 0
    for name, entry in payload["params"].items():
        for key, saved in entry.items():
            if not torch.equal(now[name][key], saved):
                diff = float((now[name][key].float() - saved.float()).abs().max())
                raise ResumeVerificationError(
                    f"after restoring the NVMe-offloaded state, {name}[{key}] differs from the checkpoint "
                    f"(max abs diff {diff:.3e}): the engine did not take the saved state. Refusing to train on."
                )
            checked += 1
    for name, p in engine.module.named_parameters():  # the working copy the forward pass reads
        if p.requires_grad and name in payload["params"]:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                working = p.detach().float().cpu().clone()
            if not torch.equal(working.flatten(), _full_fp32(p).flatten()):
                raise ResumeVerificationError(
                    f"after restoring the NVMe-offloaded state, the working copy of {name} differs from its fp32 "
                    "master: the forward pass would not see the restored weights. Refusing to train on."
                )
            checked += 1
    return checked
