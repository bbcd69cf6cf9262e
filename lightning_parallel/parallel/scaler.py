"""``AgreedGradScaler``: ``16-mixed``'s gradient scaler for layouts whose ranks hold different gradients.

A gradient scaler multiplies the loss by its scale before the backward, then, before the optimizer step, divides
every gradient by it and checks them for inf/NaN: if any is not finite the step is skipped and the scale halved,
else the step is taken (and every ``growth_interval`` clean steps the scale grows). torch's ``GradScaler`` checks the
gradients this process's optimizer holds. Where those differ from rank to rank -- ZeRO's shards over ``dp`` (the flat
ZeRO-1/2 shard, FSDP2's ``DTensor`` shards), tp's shards, a pipeline's stages -- one rank can find an overflow that the
others do not: it skips the step while they take it (the flat ZeRO's all-gather of the updated shards then waits for
it until the collective timeout; a pipeline's stages train on different steps), and their scales part.

This scaler reads each gradient's local tensor (a ``DTensor``'s shard; torch's own scalers refuse a list mixing
``DTensor`` and plain gradients, as a tensor-parallel model's optimizer holds) and all-reduces the inf/NaN flag over
``process_group`` (torch's ``ShardedGradScaler.unscale_``): one collective of one number per optimizer step, after
which every rank skips or steps alike and every scale stays equal. Nothing is sharded by it; its state
(``state_dict``) is ``GradScaler``'s. No Lightning import.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

__all__ = ["AgreedGradScaler"]


class AgreedGradScaler(ShardedGradScaler):
    """torch's ``ShardedGradScaler`` (the inf/NaN flag all-reduced over ``process_group``, default: every rank) that
    checks and unscales each gradient's local tensor, ``DTensor`` or not."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor,
                        allow_fp16: bool = True) -> dict[torch.device, Tensor]:
        """Divide every gradient of ``optimizer`` by the scale in place (its local shard) and set each device's flag
        where one is not finite; returns the flags by device (``unscale_`` all-reduces them)."""
        flags: dict[torch.device, Tensor] = {}
        inverse: dict[torch.device, Tensor] = {}
        grads: defaultdict[torch.device, defaultdict[torch.dtype, list[Tensor]]] = defaultdict(
            lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                    if not allow_fp16 and local.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if local.is_sparse:
                        raise ValueError("AgreedGradScaler: sparse gradients are not supported.")
                    grads[local.device][local.dtype].append(local)
            for device, by_dtype in grads.items():
                flags[device] = found_inf.to(device, copy=True)
                inverse[device] = inv_scale.to(device, copy=True)
                for tensors in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(tensors, flags[device], inverse[device])
        if not flags:  # a rank without gradients still takes part in the flag's all-reduce
            assert self._scale is not None
            flags[self._scale.device] = found_inf.to(self._scale.device, copy=True)
        return flags
