"""Where a DeepSpeed engine keeps the model states of this rank: device, host or NVMe bytes, by role.

On a GPU the split can be read from ``tensor.device``; on DeepSpeed's CPU accelerator device and host are the same
memory, so tensors are classified by the role DeepSpeed gives them (what it would place on the accelerator versus on
the offload target), read from the engine's own structures:

* parameters -- stage 1-2: the module's full working parameters (device); stage 3: each rank's partition
  (``ds_tensor``; on the ``offload_param`` target) plus the small "persistent" parameters kept whole (device);
* gradients -- the fp32 gradient partition next to the offloaded optimizer (host), or the gradient partition /
  reduce buckets the engine keeps on the device;
* optimizer -- the fp32 master partition and the optimizer's moments (on the ``offload_optimizer`` target).

Formulas to compare against: :func:`lightning_parallel.planner.memory.model_states` (ZeRO / ZeRO-Offload papers) and
DeepSpeed's own ``estimate_zero{2,3}_model_states_mem_needs`` (mixed precision: 2-byte weights and gradients).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

__all__ = ["engine_state_bytes"]


def _nbytes(tensors: Iterable[Any]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, Tensor) and t.numel() and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _target(device: str) -> str:
    return {"none": "device", "cpu": "host", "nvme": "nvme"}[device]


def _states(opt: Any, flats: list[Tensor]) -> int:
    state = opt.optimizer.state
    return _nbytes(v for f in flats for v in state.get(f, {}).values() if isinstance(v, Tensor) and v.dim() > 0)


def _zero3(engine: Any, opt_target: str, param_target: str, out: dict[str, dict[str, int]]) -> None:
    opt = engine.optimizer
    params = list(engine.module.parameters())
    persistent = [p for p in params if getattr(p, "ds_persist", False)]
    partitioned = [p for p in params if not getattr(p, "ds_persist", False)]
    out["device"]["params"] += _nbytes(p.ds_tensor for p in persistent)
    out[param_target]["params"] += sum(p.ds_tensor.ds_numel * p.ds_tensor.element_size() for p in partitioned)
    flats = list(opt.fp32_partitioned_groups_flat)
    numel = sum(int(n) for n in opt.fp16_partitioned_groups_flat_numel)
    out[opt_target]["optimizer"] += numel * 4 + _states(opt, flats)
    if opt_target == "device":
        out["device"]["grads"] += numel * 4
    else:  # the fp32 gradient partition lives next to the host optimizer (the staging buffer under NVMe)
        out["host"]["grads"] += numel * 4


def _zero12(engine: Any, opt_target: str, out: dict[str, dict[str, int]]) -> None:
    opt = engine.optimizer
    out["device"]["params"] += _nbytes(engine.module.parameters())
    flats = list(opt.single_partition_of_fp32_groups)
    out[opt_target]["optimizer"] += _nbytes(flats) + _states(opt, flats)
    if opt_target == "host":
        out["host"]["grads"] += _nbytes(f.grad for f in flats if f.grad is not None)
        buckets = [b for b in (getattr(opt, "ipg_buffer", None) or []) if isinstance(b, Tensor)]
        out["device"]["grads"] += _nbytes(buckets)
    else:
        numel = sum(f.numel() for f in flats)
        out["device"]["grads"] += numel * flats[0].element_size() if flats else 0


def engine_state_bytes(engine: Any) -> dict[str, dict[str, int]]:
    """``{"device"|"host"|"nvme": {"params"|"grads"|"optimizer": bytes}}`` of this rank's engine (after a step)."""
    zero = engine.zero_optimization_stage()
    cfg = engine.config.get("zero_optimization", {}) if isinstance(engine.config, dict) else {}
    opt_dev = (cfg.get("offload_optimizer") or {}).get("device", "none") or "none"
    par_dev = (cfg.get("offload_param") or {}).get("device", "none") or "none"
    out = {where: {"params": 0, "grads": 0, "optimizer": 0} for where in ("device", "host", "nvme")}
    if int(zero) == 3:
        _zero3(engine, _target(str(opt_dev)), _target(str(par_dev)), out)
    else:
        _zero12(engine, _target(str(opt_dev)), out)
    return out
