"""The fairscale backend of ZeRO stages 1-2: ``OSS`` (+ torch DDP for stage 1, ``ShardedDataParallel`` for stage 2).

What is sharded along ``dp``: fairscale's ``OSS`` deals *whole parameters* to ranks (greedy by size), so per-rank
optimizer state is only roughly ``K Psi / N`` -- the native backend's flat shards are exactly balanced. Stage 1:
gradients all-reduced by torch DDP in backward, each rank steps its parameters, then every rank broadcasts its
parameters to the others. Stage 2: ``ShardedDataParallel`` reduces each gradient to its owner rank in backward
(``reduce``) and frees the others; the step ends with the same broadcasts.

fairscale's trap (``docs/limits.md``, "fairscale ShardedDataParallel + OSS is wrong with
``zero_grad(set_to_none=True)``"): ``ShardedDataParallel + OSS`` is silently wrong with ``set_to_none=True``;
:func:`exact_oss` builds an ``OSS`` whose ``zero_grad`` always zeroes in place, which makes it exact.
No Lightning import.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

__all__ = ["FairscaleUnavailableError", "exact_oss", "fairscale_sharded_ddp", "require_fairscale"]


class FairscaleUnavailableError(ImportError):
    """fairscale is missing or does not work with the installed torch."""


def require_fairscale() -> None:
    """Import fairscale's OSS and ShardedDataParallel, or raise an error that says why and what to use instead."""
    try:
        from fairscale.nn.data_parallel import ShardedDataParallel  # noqa: F401
        from fairscale.optim import OSS  # noqa: F401
    except Exception as err:  # any failure to import means the backend cannot run
        import torch

        raise FairscaleUnavailableError(
            f"backend='fairscale' needs fairscale's OSS and ShardedDataParallel, but importing them failed with "
            f"torch {torch.__version__}: {type(err).__name__}: {err}. Fix: `pip install 'lightning-parallel"
            "[fairscale]'` (fairscale 0.4.13), or use backend='native' (the default: ZeRO 1-3 on torch alone)."
        ) from err


def exact_oss(optimizer: Optimizer, *, group: dist.ProcessGroup | None) -> Optimizer:
    """An ``OSS`` over ``optimizer``'s param groups (same dicts, so LR schedulers keep working), same class and
    defaults; its ``zero_grad`` never sets gradients to None (the fairscale trap)."""
    from fairscale.optim import OSS

    class ExactOSS(OSS):
        def zero_grad(self, set_to_none: bool = False) -> None:  # type: ignore[override]
            super().zero_grad(set_to_none=False)

    if any(len(s) for s in optimizer.state.values()):
        raise ValueError("the fairscale backend needs an optimizer without state; wrap it before the first step.")
    groups: list[dict[str, Any]] = optimizer.param_groups
    # OSS rebuilds the optimizer class from its defaults; torch adds defaults its __init__ does not take
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    return ExactOSS(groups, optim=type(optimizer), group=group, **defaults)


def fairscale_sharded_ddp(module: nn.Module, oss: Optimizer, *, group: dist.ProcessGroup | None) -> nn.Module:
    """ZeRO-2 gradient sharding: ``ShardedDataParallel`` reduces each gradient to the rank that owns it."""
    from fairscale.nn.data_parallel import ShardedDataParallel

    return ShardedDataParallel(module, sharded_optimizer=oss, process_group=group)  # type: ignore[arg-type]
