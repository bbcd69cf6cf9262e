"""Logged values as one device logs them: what a module logs in ``training_step`` is combined over ``dp``.

A module's ``self.log("train_loss", loss)`` (``sync_dist=False``, Lightning's default) under data parallelism logs
each rank's value for its part of the global batch, so rank 0's curve is not the one-device curve (``lp_ddp`` logged
rank 0's half-batch loss, 7e-3 relative off one device, while the weights agreed to 1e-7). While a training step
runs, :func:`global_batch_logs` routes ``self.log`` (and ``log_dict``) so that every floating-point tensor logged
without ``sync_dist`` is first combined over the data-parallel ranks by its ``reduce_fx`` (``mean``: the global
batch's mean, ``sum``, ``max``, ``min``; :func:`~lightning_parallel.parallel.step.reduce_logged`), one all-reduce
of a scalar each, issued without a host synchronisation. Left as they are: values logged with ``sync_dist=True``
(Lightning reduces them over every rank, which under model parallelism is the same mean), with
``rank_zero_only=True`` or ``enable_graph=True``, with a custom ``reduce_fx``, and anything but a floating-point
tensor (a number, a torchmetrics ``Metric``).

As with ``sync_dist=True``, every data-parallel rank must log the value (a ``self.log`` under ``if
self.global_rank == 0`` would wait for the others at the all-reduce). Model-parallel peers (``tp``, ``pp``) hold the
same value already; ``lp_pipeline``/``lp_hybrid`` log their ``train_loss`` themselves, averaged over ``dp``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

__all__ = ["global_batch_logs"]

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)


@contextlib.contextmanager
def global_batch_logs(module: Any, reduce: Callable[[Tensor, Any], Tensor] | None) -> Generator[None, None, None]:
    """While open, ``module.log`` combines what it logs over dp with ``reduce(value, reduce_fx)`` (module
    docstring); ``reduce`` None (one dp rank) changes nothing. The module's own ``log`` (or one a strategy put in
    place before) is restored on exit."""
    if module is None or reduce is None:
        yield
        return
    had_own = "log" in vars(module)
    previous = module.log

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, Tensor) and value.is_floating_point():
            bound = _LOG_SIGNATURE.bind_partial(module, name, value, *args, **kwargs).arguments
            if not (bound.get("sync_dist") or bound.get("rank_zero_only") or bound.get("enable_graph")):
                value = reduce(_plain(value), bound.get("reduce_fx", "mean"))
        previous(name, value, *args, **kwargs)

    module.log = log
    try:
        yield
    finally:
        if had_own:
            module.log = previous
        else:
            del module.log


def _plain(value: Tensor) -> Tensor:
    """A DTensor (a tensor-parallel loss: replicated over tp) as a plain tensor, detached."""
    from torch.distributed.tensor import DTensor

    value = value.detach()
    return value.full_tensor() if isinstance(value, DTensor) else value
