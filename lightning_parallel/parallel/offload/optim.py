"""The user's optimizer, mapped to the host optimizer ZeRO-Offload steps on CPU.

With ``offload_optimizer.device`` cpu or nvme the optimizer step runs on the host, on the fp32 master partition of
each rank (1/N_d of the parameters), with DeepSpeed's vectorized C++ optimizers. ``torch.optim.Adam`` and
``AdamW`` map to ``DeepSpeedCPUAdam`` (``adamw_mode`` False = L2 added to the gradient like torch Adam, True =
decoupled decay like AdamW) with the same parameter groups and hyper-parameters; DeepSpeed's own CPU optimizers
pass through. Anything else cannot be offloaded and is refused with the fix. A learning-rate scheduler built on the
original optimizer is re-bound to the new one, so it drives the host optimizer's ``lr``.

CPU Adam computes the same update as torch's Adam in fp32, but in another order (fused, SIMD, ``1/sqrt`` through a
vector intrinsic): results agree to a few ulp per step, not bit for bit (see the equivalence tests' tolerance).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["OptimizerNotOffloadableError", "is_host_optimizer", "offload_refusal", "rebind_scheduler",
           "to_host_optimizer"]

_HOST_OPTIMIZERS = ("DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion")
_CPU_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


class OptimizerNotOffloadableError(ValueError):
    """The LightningModule's optimizer has no host (CPU) implementation for ZeRO-Offload."""


def is_host_optimizer(optimizer: Optimizer) -> bool:
    """True for DeepSpeed's CPU optimizers (they step offloaded partitions on the host)."""
    return type(optimizer).__name__ in _HOST_OPTIMIZERS


def offload_refusal(optimizer: Optimizer) -> str | None:
    """Why ``optimizer`` cannot run offloaded (no DeepSpeed import: checked before any rank starts), or None."""
    if is_host_optimizer(optimizer):
        return None
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return (
            f"configure_optimizers returned {type(optimizer).__name__}, which cannot be offloaded: ZeRO-Offload runs "
            "the optimizer step on the host with DeepSpeed's CPU optimizers, and only torch.optim.Adam and AdamW "
            "are mapped to one (DeepSpeedCPUAdam). Fix: return torch.optim.Adam/AdamW (or a DeepSpeed CPU "
            "optimizer: DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion), or train without offload "
            "(parallel.offload='none', or strategy lp_sharded)."
        )
    for group in optimizer.param_groups:
        bad = [k for k in ("amsgrad", "maximize") if group.get(k)]
        if bad:
            return (f"{type(optimizer).__name__}({bad[0]}=True) has no DeepSpeedCPUAdam counterpart. Fix: "
                    f"{bad[0]}=False, or offload='none'.")
    return None


def to_host_optimizer(optimizer: Optimizer) -> Optimizer:
    """``optimizer`` as DeepSpeed's CPU Adam (same groups, hyper-parameters and weight-decay mode), or itself when
    it already is a DeepSpeed CPU optimizer. Raises :class:`OptimizerNotOffloadableError` for other optimizers."""
    if is_host_optimizer(optimizer):
        return optimizer
    why = offload_refusal(optimizer)
    if why:
        raise OptimizerNotOffloadableError(why)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.param_groups[0].get("decoupled_weight_decay", False)
    )
    groups = [{"params": list(g["params"]), **{k: g[k] for k in _CPU_ADAM_KEYS}} for g in optimizer.param_groups]
    host = DeepSpeedCPUAdam(groups, adamw_mode=decoupled)
    for new, old in zip(host.param_groups, optimizer.param_groups, strict=True):
        for key, value in old.items():  # scheduler bookkeeping (initial_lr, ...) travels with the group
            if key != "params" and key not in new:
                new[key] = value
    return host


def rebind_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Point a torch LR scheduler built on another optimizer at ``optimizer`` (same group structure).

    The groups' ``initial_lr`` were copied by :func:`to_host_optimizer`; ``optimizer.step`` gets the marker torch's
    schedulers use to check that ``optimizer.step()`` ran before ``scheduler.step()``.
    """
    if scheduler is None or getattr(scheduler, "optimizer", None) is optimizer:
        return
    old = scheduler.optimizer
    if len(old.param_groups) != len(optimizer.param_groups):
        raise ValueError("the scheduler's optimizer and the host optimizer have different parameter groups.")
    for new, previous in zip(optimizer.param_groups, old.param_groups, strict=True):
        new["lr"] = previous["lr"]
    scheduler.optimizer = optimizer
    step = optimizer.step
    if not hasattr(step, "_wrapped_by_lr_sched"):

        @functools.wraps(step)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            optimizer._opt_called = True  # type: ignore[attr-defined]
            return step(*args, **kwargs)

        wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = wrapper  # type: ignore[method-assign]
