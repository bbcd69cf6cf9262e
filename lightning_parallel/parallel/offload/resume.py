"""Resume a DeepSpeed engine from the one-device form of any other checkpoint (ZeRO-1/2/3, CPU offload or none).

DeepSpeed restores its optimizer from its own flat partitions only. For a checkpoint written under another layout,
the library reads it into the one-device form (:func:`~lightning_parallel.checkpoint.resume.read_resumable`) and puts
each parameter's fp32 master and Adam moments into this rank's partitions with DeepSpeed's own
``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` (each rank keeps its fragment of the whole tensor),
then sets the host optimizer's step count. No collective runs: every rank reads the whole checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["load_one_device_state"]

_WRAPPER_PREFIXES = ("_forward_module.", "module.")


def _module_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def load_one_device_state(engine: Any, checkpoint: dict[str, Any], *, load_optimizer: bool) -> None:
    """Put the weights (and, with ``load_optimizer``, Adam's moments and step) of a one-device checkpoint into a
    DeepSpeed engine built by ``lp_zero_offload``.

    The per-index optimizer state is matched to parameters by the one-device numbering: the engine's param groups in
    order (DeepSpeed keeps the user's groups and their order). Raises ``ValueError`` naming the mismatch when the
    groups or shapes differ.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    module: nn.Module = engine.module
    weights = checkpoint["state_dict"]
    named = [(_module_name(n), p) for n, p in module.named_parameters()]
    missing = [n for n, _ in named if n not in weights]
    if missing:
        raise ValueError(f"the checkpoint has no {missing[:4]} ({len(missing)} parameters of this model missing).")
    for name, p in named:
        value = weights[name]
        if tuple(value.shape) != tuple(getattr(p, "ds_shape", p.shape)):
            raise ValueError(f"{name} has shape {list(value.shape)} in the checkpoint, "
                             f"{list(getattr(p, 'ds_shape', p.shape))} in this model.")
        safe_set_full_fp32_param(p, value.float())  # this rank's fragment of the fp32 master
        if not hasattr(p, "ds_shape"):  # ZeRO-1/2: the working parameter is whole on every rank
            with torch.no_grad():
                p.data.copy_(value.to(p.dtype))
    with torch.no_grad():  # buffers are not partitioned: copy them as they are
        for name, buf in module.named_buffers():
            key = _module_name(name)
            if key in weights and isinstance(buf, Tensor):
                buf.copy_(weights[key].to(buf.dtype))
    if not load_optimizer:
        return
    states = checkpoint.get("optimizer_states") or []
    if len(states) != 1:
        raise ValueError(f"the checkpoint holds {len(states)} optimizer states; lp_zero_offload runs one optimizer.")
    saved = states[0]
    _init_optimizer_state(engine)
    id_of = {id(p): n for n, p in named}
    live_groups = [[p for p in g["params"] if id(p) in id_of] for g in _user_param_groups(engine)]
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes != [len(g) for g in live_groups]:
        raise ValueError(f"the checkpoint's optimizer has param groups of {sizes} parameters, this run's "
                         f"{[len(g) for g in live_groups]}: another configure_optimizers or model.")
    step = None
    for saved_group, params in zip(saved["param_groups"], live_groups, strict=True):
        for idx, p in zip(saved_group["params"], params, strict=True):
            slot = saved["state"].get(idx, saved["state"].get(str(idx), {}))
            for key, value in slot.items():
                if key == "step":
                    step = int(value.item() if isinstance(value, Tensor) else value)
                elif isinstance(value, Tensor) and value.dim() > 0:
                    safe_set_full_optimizer_state(p, value.float(), key)
    if step is not None:
        _set_step(engine, step)


def _init_optimizer_state(engine: Any) -> None:
    """Create the host optimizer's state for every flat fp32 partition (DeepSpeed creates it lazily, at the first
    step) and link it to the parameters' fragments, so that ``safe_set_full_optimizer_state`` can write into it."""
    opt = engine.optimizer
    flats = getattr(opt, "single_partition_of_fp32_groups", None)
    if flats is None:
        raise ValueError(f"{type(opt).__name__} (ZeRO stage 3): putting another layout's optimizer state into its "
                         "partitions is not supported; lp_zero_offload resumes it at ZeRO-1/2 only.")
    host = getattr(opt, "optimizer", opt)
    cpu_adam = type(host).__name__ == "DeepSpeedCPUAdam"  # keeps an int step, torch's Adam a tensor
    for flat in flats:
        state = host.state[flat]
        if not state:
            state["step"] = 0 if cpu_adam else torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(flat)
            state["exp_avg_sq"] = torch.zeros_like(flat)
    opt._lazy_init_hp_params_optimizer_state()


def _user_param_groups(engine: Any) -> list[dict[str, Any]]:
    """The param groups over the module's own parameters, in the order the user's optimizer had them (ZeRO-1/2:
    ``bit16_groups``; ZeRO-3: ``fp16_groups``)."""
    opt = engine.optimizer
    for attr in ("bit16_groups", "fp16_groups"):
        groups = getattr(opt, attr, None)
        if groups:
            return [{"params": list(g)} for g in groups]
    raise ValueError(f"{type(opt).__name__}: cannot find the engine's parameter groups.")


def _set_step(engine: Any, step: int) -> None:
    """The host optimizer's step count (Adam's bias correction), in its state and its param groups where it keeps
    one (DeepSpeed's CPU Adam keeps ``step`` per group)."""
    host = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for group in host.param_groups:
        if "step" in group:
            group["step"] = step
        for p in group["params"]:
            state = host.state.get(p)
            if state is not None and "step" in state:
                current = state["step"]
                state["step"] = torch.tensor(float(step)) if isinstance(current, Tensor) else step
