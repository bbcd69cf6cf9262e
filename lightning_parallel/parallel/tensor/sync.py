"""The dp-axis sync of a tensor-parallel module, and clipping by the global gradient norm.

Under TP each rank holds DTensor parameters whose local tensors are its ``1/t`` shards (``column``/``row``/``vocab``)
or whole replicated tensors (norms, biases of row linears, anything not in the plan). Torch DDP and
``ZeroRedundancyOptimizer`` refuse DTensor parameters, so the sync over ``dp`` works on the local tensors:

* zero_stage 0 -- :func:`allreduce_gradients`: after the step's last backward, one all-reduce (mean) over ``dp`` of
  all local gradients flattened into one buffer: ``2 (d-1)/d x Psi/t``-ish elements per rank and step (the
  replicated tensors count whole).
* zero_stage 1 -- :class:`LocalShardZeroOptimizer`: the project's :class:`~lightning_parallel.parallel.zero.
  ZeroOptimizer` over the local tensors: reduce-scatter of the flat local gradients over ``dp`` at the step
  boundary, the inner optimizer steps ``1/d`` of them, all-gather of the updated parameters. The DTensor
  parameters' local tensors become views into the flat buffer, so forward reads the gathered values.

Clipping (:func:`clip_grad_norm_`): the norm of the whole model's gradient counts each tp-sharded tensor once --
every rank's local shard adds its squares -- and each tp-replicated tensor once (weighted ``1/t`` on each of the
``t`` ranks that hold it); the sum is all-reduced over ``tp`` (and over ``dp`` when the gradients are sharded over
``dp``: ZeRO-1 and FSDP2). No Lightning import.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_parallel.parallel.zero import ZeroOptimizer

__all__ = ["LocalShardZeroOptimizer", "allreduce_gradients", "clip_grad_norm_",
           "is_tp_sharded", "local_tensor", "settle_gradients"]


def local_tensor(t: Tensor) -> Tensor:
    """The tensor this rank stores for ``t``: a DTensor's local shard (the same storage, not a copy), else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined]


def is_tp_sharded(t: Tensor, axis: str = "tp") -> bool:
    """True for a DTensor split (``Shard``) along the mesh axis named ``axis``; False for replicated tensors."""
    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return axis in names and isinstance(t.placements[names.index(axis)], Shard)


@torch.no_grad()
def settle_gradients(params: Iterable[Tensor]) -> int:
    """Give every DTensor gradient its parameter's placements; returns how many needed a collective.

    Under sequence parallelism a norm's replicated weight gets a ``Partial`` gradient (each tp rank summed over its
    own positions only); it is all-reduced over ``tp`` here, once per step (Megatron all-reduces the gradients of its
    sequence-parallel parameters the same way). A plain parameter the plan leaves whole that meets a DTensor in the
    forward (a temperature scaling the vocab-parallel logits) gets a DTensor gradient (``Partial``: each tp rank's
    share of the vocabulary): it becomes the whole plain gradient (``full_tensor``: an all-reduce over ``tp``),
    where torch's optimizers failed on the mix. Call at the step boundary, before the dp sync and clipping.
    """
    changed = 0
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor):
            continue
        if not isinstance(p, DTensor):
            p.grad = g.full_tensor()
            changed += 1
        elif tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
            changed += 1
    return changed


@torch.no_grad()
def allreduce_gradients(params: Iterable[Tensor], *, group: dist.ProcessGroup) -> None:
    """Average the local gradients over ``group`` (the ``dp`` axis) with one all-reduce of a flat buffer."""
    world = dist.get_world_size(group)
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if world == 1 or not grads:
        return
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _reduce(value: Tensor, groups: Iterable[dist.ProcessGroup | None]) -> Tensor:
    """Sum ``value`` over each group in turn; ``None`` entries (an axis this run does not have) are skipped."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(value, group=group)
    return value


@torch.no_grad()
def clip_grad_norm_(params: Iterable[Tensor], max_norm: float, *, tp_size: int,
                    groups: Iterable[dist.ProcessGroup | None]) -> Tensor:
    """Clip by the L2 norm of the whole model's gradient; returns that norm (replicated on every rank).

    ``groups``: where the gradients differ -- the ``tp`` group, plus the ``dp`` group when they are sharded over dp
    (FSDP2). Each tp-sharded local gradient adds its squares; a tp-replicated one adds them divided by ``tp_size``.
    """
    grads = [(p.grad, is_tp_sharded(p)) for p in params if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float64)
    for g, sharded in grads:
        part = local_tensor(g).double().pow(2).sum()
        squares += part if sharded else part / tp_size
    total = _reduce(squares, list(groups)).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _ in grads:
        local_tensor(g).mul_(coef.to(g.dtype))
    return total.float()


class LocalShardZeroOptimizer(ZeroOptimizer):
    """ZeRO-1 over ``dp`` on the local tensors of a tensor-parallel module.

    The user's optimizer (built by the LightningModule over DTensor parameters) is re-pointed at their local
    tensors, then wrapped by :class:`ZeroOptimizer` (stage 1: a persistent flat local gradient; the optimizer state
    of ``1/d`` of it per rank). Each DTensor parameter keeps its identity (Lightning, schedulers and checkpoints see
    the same parameters) while its local tensor becomes a view into the flat buffer. DTensor gradients are copied
    into the flat gradient at the step boundary (:meth:`reduce_gradients`) and dropped.

    Args:
        optimizer: a fresh torch optimizer over the module's parameters (DTensor or plain).
        group: the ``dp`` process group. tp_group: the ``tp`` group; tp_size: its size (for clipping).
        norm_groups: further groups whose ranks hold other parameters (the ``pp`` group of a pipeline): the
            clipping norm sums over them too.
    """

    def __init__(self, optimizer: Optimizer, *, group: dist.ProcessGroup, tp_group: dist.ProcessGroup | None,
                 tp_size: int, norm_groups: Iterable[dist.ProcessGroup] = ()) -> None:
        self.dtensor_params: list[tuple[DTensor, Tensor]] = []
        self.original_params: list[list[Tensor]] = [list(pg["params"]) for pg in optimizer.param_groups]
        self._weights: list[Tensor] = []
        self.tp_group, self.tp_size = tp_group, tp_size
        self.norm_groups = list(norm_groups)
        groups_sharded: list[list[bool]] = []
        for pg in optimizer.param_groups:
            locals_: list[Tensor] = []
            flags: list[bool] = []
            for p in pg["params"]:
                if isinstance(p, DTensor):
                    local = local_tensor(p)
                    self.dtensor_params.append((p, local))
                    locals_.append(local)
                    made = optimizer.state.pop(p, None)  # state an optimizer makes in its constructor (Adagrad)
                    if made:
                        optimizer.state[local] = {k: local_tensor(v) if isinstance(v, DTensor) else v
                                                  for k, v in made.items()}
                else:
                    locals_.append(p)
                flags.append(is_tp_sharded(p))
            pg["params"] = locals_
            groups_sharded.append(flags)
        super().__init__(optimizer, stage=1, group=group)
        for shard, flags in zip(self.shards, groups_sharded, strict=True):
            weight = torch.zeros(shard.padded_numel, dtype=torch.float64)
            offset = 0
            for n, sharded in zip(shard.numels, flags, strict=True):
                weight[offset:offset + n] = 1.0 if sharded else 1.0 / tp_size
                offset += n
            self._weights.append(shard.shard_of(weight).clone())

    def model_parameters(self) -> list[Tensor]:
        """The module's parameters this optimizer steps (the DTensors themselves, not their local tensors)."""
        return [p for params in self.original_params for p in params]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Copy the DTensor gradients' local tensors into the flat gradient, then reduce-scatter it over ``dp``. A
        further reduction in the same step (manual optimization: several backwards, each reduced) adds them onto
        their views instead: this rank's slot holds the step's reduced gradient and the rest is zero, as the
        reduction of the flat ZeRO-1 expects of gradients autograd accumulated there."""
        again = self._grads_reduced
        for p, local in self.dtensor_params:
            grad = local_tensor(p.grad) if p.grad is not None else None
            if not again:
                local.grad = grad
            elif grad is not None:
                assert local.grad is not None  # the view the first reduction attached
                local.grad.add_(grad)
        super().reduce_gradients()
        for p, _ in self.dtensor_params:
            p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p, _ in self.dtensor_params:
            p.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the reduced shards by the norm of the whole model's gradient (all-reduces over ``dp`` and ``tp``);
        tp-replicated elements count once (weight ``1/t``)."""
        if norm_type != 2.0:
            raise ValueError(f"LocalShardZeroOptimizer clips by the L2 norm only, got norm_type={norm_type}.")
        if not self._grads_reduced:
            self.reduce_gradients()
        squares = torch.zeros((), dtype=torch.float64)
        grads = []
        for shard, weight in zip(self.shards, self._weights, strict=True):
            g = shard.shard_param.grad
            assert g is not None
            squares += (g.double().pow(2) * weight).sum()
            grads.append(g)
        total = _reduce(squares, [self.tp_group, self.group, *self.norm_groups]).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total.float()

    # ------------------------------------------------------------------ checkpoints by parameter name
    def state_by_name(self, model: nn.Module) -> dict[str, Any]:
        """The whole optimizer state per parameter name, each state tensor laid out like its parameter (a DTensor
        for tp-sharded ones): the format of :func:`~lightning_parallel.parallel.tensor.state.
        optimizer_state_by_name`. Collective over ``dp`` (all-gathers the flat shards)."""
        name_of = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        full = self.consolidated_state_dict()
        flat = [p for group in self.original_params for p in group]
        state: dict[str, Any] = {}
        for idx, slot in full["state"].items():
            p = flat[int(idx)]
            state[name_of[id(p)]] = {k: _like_param(v, p) for k, v in slot.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(p)] for p in params]}
                  for g, params in zip(full["param_groups"], self.original_params, strict=True)]
        return {"state": state, "param_groups": groups}

    def load_state_by_name(self, model: nn.Module, by_name: dict[str, Any]) -> None:
        """Load :meth:`state_by_name` output (e.g. from a DCP checkpoint): re-sharded over ``dp`` as this rank's
        flat shard."""
        name_of = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        names = [name_of[id(p)] for group in self.original_params for p in group]
        index = {n: i for i, n in enumerate(names)}
        state = {index[n]: {k: local_tensor(v) if isinstance(v, Tensor) else v for k, v in slot.items()}
                 for n, slot in by_name["state"].items()}
        # this rank's own parameters per group (a pipeline stage holds some of the saved groups' names)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[name_of[id(p)]] for p in own]}
                  for g, own in zip(by_name["param_groups"], self.original_params, strict=True)]
        self.load_state_dict({"state": state, "param_groups": groups})


def _like_param(value: Any, p: Tensor) -> Any:
    if isinstance(p, DTensor) and isinstance(value, Tensor) and value.shape == local_tensor(p).shape:
        return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return value
