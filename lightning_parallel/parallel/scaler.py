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
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.amp.grad_scaler import OptState
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from lightning_parallel.parallel.counters import uncounted_all_reduce

__all__ = ["AgreedGradScaler", "after_skipped_step"]


class AgreedGradScaler(ShardedGradScaler):
    """torch's ``ShardedGradScaler`` that checks and unscales each gradient's local tensor, ``DTensor`` or not, and
    takes the largest inf/NaN flag over ``process_group`` (default: every rank) -- in ``unscale_`` and in the check a
    fused optimizer's step makes instead (``fused=True`` optimizers unscale inside their step: Lightning does not
    call ``unscale_`` for them). The flags are 0 or 1, as a fused optimizer's kernel expects."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """``GradScaler.unscale_`` with the flags agreed (MAX over ``process_group``)."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        assert self._scale is not None
        inv_scale = self._scale.double().reciprocal().float()  # in fp64, as torch does
        found_inf = torch.full((1,), 0.0, dtype=torch.float32, device=self._scale.device)
        state["found_inf_per_device"] = self._agree(self._unscale_grads_(optimizer, inv_scale, found_inf, True))
        state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        """The check a fused optimizer's step makes (no unscaling), agreed as :meth:`unscale_`'s."""
        return self._agree(super()._check_inf_per_device(optimizer))

    def _agree(self, flags: dict[Any, Any]) -> dict[Any, Any]:
        """Every flag (in place) the largest over this rank's devices and over ``process_group``: one all-reduce,
        whatever devices this rank's gradients are on (ranks holding gradients on different numbers of devices make
        the same collectives); on the device where the scaler runs (NCCL reduces device tensors)."""
        first = next(iter(flags.values()))
        home = self._scale.device if self._scale is not None else first.device
        agreed = torch.zeros(1, dtype=torch.float32, device=home)
        for flag in flags.values():
            agreed = torch.maximum(agreed, flag.reshape(1).to(home, torch.float32))
        if self._device != "cpu" and agreed.device.type == "cpu":
            agreed = agreed.to(self._device)
        uncounted_all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.process_group)  # control, not traffic
        for flag in flags.values():
            flag.copy_(agreed.to(flag.device).reshape(flag.shape))
        return flags

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor,
                        allow_fp16: bool = True) -> dict[torch.device, Tensor]:
        """Divide every gradient of ``optimizer`` by the scale in place (its local shard; a sparse gradient's
        values) and set each device's flag where one is not finite; returns the flags by device (the
        callers agree them)."""
        flags: dict[torch.device, Tensor] = {}
        inverse: dict[torch.device, Tensor] = {}
        grads: defaultdict[torch.device, defaultdict[torch.dtype, list[Tensor]]] = defaultdict(
            lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    if not allow_fp16 and local.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if local.is_sparse:  # as torch's scalers: an fp16 one coalesced first (the sum may overflow)
                        if local.dtype is torch.float16:  # coalesce has no fp16 kernel
                            local = param.grad = local.type(torch.float32).coalesce().type(torch.float16)
                        local = local._values()
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


def after_skipped_step(scaler: Any, optimizer: Any) -> None:
    """A step skipped after ``scaler`` unscaled ``optimizer``'s gradients (the non-finite-loss guard raises in
    ``on_before_optimizer_step``, which Lightning runs after ``unscale_``): the skip is recorded (``update``: the scale
    backs off when the gradients were not finite), so that the next step may unscale again. Nothing without an
    enabled scaler or before ``unscale_``."""
    if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
        return
    state = scaler._per_optimizer_states.get(id(optimizer))
    if state is not None and state["stage"] is OptState.UNSCALED:
        scaler.update()
