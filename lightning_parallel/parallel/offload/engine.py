"""Build the DeepSpeed engine for ZeRO-offload from the typed config (no Lightning here).

``build_engine`` maps the optimizer to the host optimizer when the optimizer state is offloaded, re-binds the LR
scheduler to it, and calls ``deepspeed.initialize`` with the effective DeepSpeed config. The engine then owns the
data-parallel collectives: ZeRO-2 reduce-scatters gradients in backward (bucketed) and all-gathers the updated
weights after the host step; ZeRO-3 also all-gathers each layer's parameters before its forward and again before its
backward, and frees them after. On CPU DeepSpeed runs on its CPU accelerator over the gloo process group.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer

from .optim import rebind_scheduler, to_host_optimizer

__all__ = ["build_engine", "offload_targets"]


def offload_targets(config: Mapping[str, Any]) -> tuple[int, str, str]:
    """``(stage, offload_optimizer.device, offload_param.device)`` of a DeepSpeed config ('none' when absent)."""
    zero = config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    opt = (zero.get("offload_optimizer") or {}).get("device", "none") or "none"
    par = (zero.get("offload_param") or {}).get("device", "none") or "none"
    return stage, str(opt), str(par)


def build_engine(
    model: nn.Module,
    *,
    config: dict[str, Any],
    optimizer: Optimizer | None,
    lr_scheduler: Any = None,
    device_rank: int | None = None,
    model_parameters: Iterable[nn.Parameter] | None = None,
) -> tuple[Any, Any, Any]:
    """``(engine, engine_optimizer, lr_scheduler)`` for ``model``; the process group must already exist.

    With ``offload_optimizer.device`` cpu/nvme, ``optimizer`` is replaced by its host counterpart (see
    :func:`~lightning_parallel.parallel.offload.optim.to_host_optimizer`) and ``lr_scheduler`` re-bound to it.
    """
    import deepspeed

    _, offload_opt, _ = offload_targets(config)
    if optimizer is not None and offload_opt != "none":
        host = to_host_optimizer(optimizer)
        rebind_scheduler(lr_scheduler, host)
        optimizer = host
    params = model_parameters if model_parameters is not None else (p for p in model.parameters() if p.requires_grad)
    engine, engine_optimizer, _, scheduler = deepspeed.initialize(
        args=argparse.Namespace(device_rank=device_rank) if device_rank is not None else None,
        config=config,
        model=model,
        model_parameters=params,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dist_init_required=False,
    )
    return engine, engine_optimizer, scheduler
