"""The one train step of every composed layout: the data-parallel work around forward and backward.

:func:`~lightning_parallel.parallel.compose.compose` builds what a rank runs; :class:`TrainStep` owns what happens
to it at step time, for every layout strategy alike (``lp_ddp``, ``lp_sharded``, ``lp_tensor``, ``lp_pipeline``,
``lp_hybrid``):

* **gradient accumulation** -- :meth:`TrainStep.no_sync` around every backward but the step's last: torch DDP's
  ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``, fairscale's ``no_sync``; the explicit syncs wait;
* **the dp gradient sync** -- :meth:`TrainStep.sync_gradients` after the step's last backward, before clipping:
  sequence-parallel partial gradients all-reduced over ``tp`` (each DTensor gradient given its parameter's
  placements), then by the plan's ``sync``: ``allreduce`` -- one flat all-reduce (mean) of the local gradients over
  ``dp``; ``zero`` -- each ZeRO optimizer reduce-scatters its flat gradient over ``dp``; ``ddp``/``fsdp``/
  ``fairscale`` -- nothing more (their hooks ran in backward);
* **ZeRO's optimizer** -- :meth:`TrainStep.wrap_optimizers`: ZeRO-1/2 flat shards over ``dp``
  (:class:`~lightning_parallel.parallel.zero.ZeroOptimizer`, or
  :class:`~lightning_parallel.parallel.tensor.LocalShardZeroOptimizer` on DTensor shards / pipeline stages), or
  fairscale's ``OSS`` (+ ``ShardedDataParallel`` at stage 2);
* **clipping by the global norm** -- :meth:`TrainStep.clip_grad_norm_`: the L2 norm of the whole model's gradient,
  each shard counted once: squares summed over ``tp`` (tp-replicated tensors weighted ``1/t``), over ``pp`` (other
  stages), and over ``dp`` where gradients are sharded there (ZeRO, FSDP2 with TP);
* **the logged values** -- :meth:`TrainStep.reduce_mean`: a value averaged over ``dp`` (the one-device value of the
  global batch when each dp rank holds the mean of its part); :func:`reduce_logged_batch`
  (:meth:`TrainStep.reduce_logged_batch`): the values a module logs in a step, each combined over ``dp`` by its
  ``reduce_fx`` (mean, sum, max, min) -- one all-reduce per kind, no host synchronisation.

With context parallelism (cp > 1) the replicas of the model are the ``dp x cp`` ranks (the plan's ``axis``,
``dp_cp``): each cp rank's gradient is that of the mean loss over its own tokens, its share of the ring attention's
key/value gradients included, so the gradient of the one-device mean is their average over ``dp x cp`` -- the
all-reduce, ZeRO's reduce-scatter and FSDP2's run over ``dp_cp`` (FSDP2 under HSDP over ``dp_shard_cp``), and the
logged loss is averaged over ``dp x cp`` (every cp rank holds ``s / cp`` tokens: the mean of the means is the mean).

No Lightning import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_parallel.parallel.compose import DataParallelPlan
from lightning_parallel.parallel.counters import uncounted_all_reduce
from lightning_parallel.parallel.dims import ParallelDims
from lightning_parallel.parallel.zero import ZeroOptimizer

__all__ = ["TrainStep", "logged_reduce_op", "reduce_logged", "reduce_logged_batch"]


class TrainStep:
    """The step-time data-parallel work of one composed rank (see the module docstring).

    Args:
        plan: the composition's data-parallel plan (:func:`~lightning_parallel.parallel.compose.data_parallel_plan`).
        dims: the degrees; mesh: the named ``(dp, pp, tp)`` mesh.
    """

    def __init__(self, plan: DataParallelPlan, *, dims: ParallelDims, mesh: DeviceMesh) -> None:
        self.plan, self.dims, self.mesh = plan, dims, mesh
        self.dp_group = mesh.get_group(plan.axis)
        """The replicas' group: ``dp``, or ``dp_cp`` with context parallelism."""
        self.accumulating = False
        """True inside :meth:`no_sync`: a backward whose gradients stay local."""
        self._dtensor_params: tuple[nn.Module, list[tuple[nn.Module, str]]] | None = None
        """The model of the last step and where its DTensor parameters live (:meth:`_distributed_parameters`)."""
        self._buffer_places: tuple[nn.Module, list[tuple[nn.Module, str]]] | None = None
        """The model of the last buffer broadcast and where its buffers live (:meth:`broadcast_buffers`)."""

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of ``axis``, or None when the axis has one rank (nothing to reduce over)."""
        return self.mesh.get_group(axis) if self.dims.size(axis) > 1 else None

    # ------------------------------------------------------------------ set-up
    def wrap_optimizers(self, optimizers: list[Optimizer], model: nn.Module) -> tuple[list[Optimizer], nn.Module]:
        """ZeRO's optimizers over ``dp`` (each keeps the user's optimizer object, so LR schedulers stay bound), and
        the module the loops call (fairscale stage 2 wraps it in ``ShardedDataParallel``). Other plans: unchanged."""
        sync, stage = self.plan.sync, self.plan.zero_stage
        if sync == "zero" and self.dims.pp == 1 and self.dims.tp == 1:
            return [ZeroOptimizer(opt, stage=stage, group=self.dp_group)
                    for opt in optimizers], model
        if sync == "zero":
            from lightning_parallel.parallel.tensor.sync import LocalShardZeroOptimizer

            if stage != 1:
                raise ValueError(f"ZeRO-{stage} on local shards is not composed; ZeRO-1 is.")
            return [LocalShardZeroOptimizer(opt, group=self.dp_group, tp_group=self.group("tp"),
                                            tp_size=self.dims.tp, norm_groups=[self.mesh.get_group("pp")])
                    for opt in optimizers], model
        if sync == "fairscale":
            from lightning_parallel.parallel.zero import exact_oss, fairscale_sharded_ddp

            if len(optimizers) != 1:
                raise ValueError(f"backend='fairscale' runs one optimizer, got {len(optimizers)}.")
            oss = exact_oss(optimizers[0], group=self.dp_group)
            if stage == 2:
                model = fairscale_sharded_ddp(model, oss, group=self.dp_group)
            return [oss], model
        return optimizers, model

    def check_optimizers(self, optimizers: Iterable[Any], *, describe: str) -> None:
        """Refuse, before any step, an optimizer the plan would silently change or that fails on DTensors: under the
        flat ZeRO-1/2 shards (one 1-D tensor per param group) an optimizer whose update reads a parameter's shape or
        the whole tensor (:data:`_PER_TENSOR`: Adafactor's factored moments, LAMB's and LARS's trust ratios, ...)
        computes something else (torch's Adafactor: 4.3e-02 from one device after 4 steps, silently); on DTensor
        parameters (ZeRO-3 / FSDP2, tensor parallelism) torch's Adafactor and Rprop fail at their first step with an
        in-place operation DTensor cannot place (:data:`_DTENSOR_FAILS`)."""
        from lightning_parallel.config import LayoutError

        flat = self.plan.sync == "zero"
        # (tp ZeRO-1 hands the optimizer the DTensors' local tensors: plain ones)
        dtensors = self.plan.sync == "fsdp" or (self.dims.tp > 1 and self.plan.sync != "zero")
        for opt in optimizers:
            raw = getattr(opt, "_optimizer", opt)
            names = [klass.__name__ for klass in type(raw).__mro__]  # a subclass of a listed optimizer is listed
            name = next((n for n in names if n in _PER_TENSOR or n in _DTENSOR_FAILS), type(raw).__name__)
            if flat and name in _PER_TENSOR:
                raise LayoutError(
                    f"{name} under {describe}: ZeRO-{self.plan.zero_stage} (flat) flattens each param group into one "
                    f"1-D shard per rank, and {name}'s update uses {_PER_TENSOR[name]}, so it would compute another "
                    "update without an error. Fix: lp_ddp (or zero_stage=0), or an optimizer whose update is element "
                    "by element (SGD, Adam, AdamW, Adagrad, RMSprop, ...)"
                    + ("; zero_stage=3 keeps each parameter's shape." if name not in _DTENSOR_FAILS else "."))
            if dtensors and name in _DTENSOR_FAILS:
                raise LayoutError(
                    f"{name} under {describe}: the parameters are DTensors (ZeRO-3's FSDP2 shards or tensor-parallel "
                    f"shards), and torch's {name} runs {_DTENSOR_FAILS[name]} at its first step, which DTensor cannot "
                    "run. Fix: lp_ddp, "
                    + ("" if name in _PER_TENSOR else "lp_sharded with zero_stage 1 or 2, ")
                    + "or another optimizer (Adam, AdamW, SGD, ...).")

    # ------------------------------------------------------------------ backward
    @contextlib.contextmanager
    def no_sync(self, model: Any) -> Generator[None, None, None]:
        """An accumulation micro-batch: its gradients stay local (no dp communication) until the step's last -- but
        under ``reduce_each_batch`` (ZeRO-2/3), where each batch reduces its gradient to the shards as it goes."""
        self.accumulating = True
        try:
            if self.plan.reduce_each_batch:  # FSDP2 keeps syncing; the flat ZeRO-2 is armed (prepare_gradients)
                yield None
            elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
                model.set_requires_gradient_sync(False)
                try:
                    yield None
                finally:
                    model.set_requires_gradient_sync(True)
            elif hasattr(model, "no_sync"):  # torch DDP, fairscale ShardedDataParallel
                with model.no_sync():
                    yield None
            else:
                yield None
        finally:
            self.accumulating = False

    def sync_gradients(self, model: nn.Module, optimizers: Iterable[Any]) -> None:
        """After a backward outside :meth:`no_sync` (the step's last): the dp sync of the plan, before clipping."""
        if self.accumulating:
            return
        if self.dims.tp > 1:
            from lightning_parallel.parallel.tensor.sync import settle_gradients

            settle_gradients(self._tp_parameters(model))  # sequence-parallel partial gradients over tp
        if self.plan.sync == "allreduce" and self.dims.replicas > 1:
            from lightning_parallel.parallel.tensor.sync import allreduce_gradients

            allreduce_gradients(model.parameters(), group=self.dp_group)
        for opt in _zero_optimizers(optimizers):
            opt.reduce_gradients()

    def prepare_gradients(self, optimizers: Iterable[Any]) -> None:
        """Before a backward: the step's last (outside :meth:`no_sync`; every one under ``reduce_each_batch``)
        reduces ZeRO-2's gradient chunks as it completes them (:meth:`ZeroOptimizer.overlap_backward`)."""
        if self.accumulating and not self.plan.reduce_each_batch:
            return
        for opt in _zero_optimizers(optimizers):
            opt.overlap_backward()

    def _tp_parameters(self, model: nn.Module) -> list[Tensor]:
        """``model``'s parameters (DTensors, and plain ones a DTensor may give a gradient), read each step
        from where the first step of this model found them (walking the module tree every step cost a few hundred
        Python calls); a parameter replaced since is read as it is now."""
        if self._dtensor_params is None or self._dtensor_params[0] is not model:
            self._dtensor_params = (model, [(module, name) for module in model.modules()
                                            for name, p in module._parameters.items() if p is not None])
        return [p for module, name in self._dtensor_params[1] if (p := module._parameters.get(name)) is not None]

    # ------------------------------------------------------------------ buffers
    def broadcast_buffers(self, model: nn.Module) -> None:
        """``model``'s buffers (a BatchNorm's running statistics, a counter a forward updates) copied from the first
        rank of the replicas' group (``dp``, ``dp x cp``) to the others, as torch DDP copies them before a forward:
        each replica updates its buffers from its own part of the batch, so without the copy they drift apart and
        each rank evaluates with statistics of its own. One broadcast per dtype (the buffers' concatenation) over
        the replicas' group; nothing on one replica or for a module without buffers. Every buffer, as torch DDP
        copies them -- non-persistent ones too: most are constants (a causal mask, rotary frequencies), but one a
        forward updates from the data (a running input normaliser) would drift apart otherwise (4.8e-01 from
        ``lp_ddp`` after 4 steps, measured). Where the buffers live is read once per model (a buffer replaced since
        is read as it is now). When to call it is the strategy's
        (:meth:`~lightning_parallel.strategies.base.LayoutStrategy.buffers_before_forward`)."""
        if self.dims.replicas == 1:
            return
        if self._buffer_places is None or self._buffer_places[0] is not model:
            self._buffer_places = (model, [(module, name) for module in model.modules()
                                           for name, b in module._buffers.items() if b is not None])
        from lightning_parallel.parallel.zero.comm import broadcast_coalesced, local_data

        buffers = [local_data(b) for module, name in self._buffer_places[1]
                   if (b := module._buffers.get(name)) is not None]  # (a DTensor's local shard: alike on replicas)
        broadcast_coalesced(buffers, src_rank=dist.get_global_rank(self.dp_group, 0), group=self.dp_group)

    # ------------------------------------------------------------------ clipping
    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> Tensor | None:
        """Clip ``optimizer``'s gradients by the L2 norm of the whole model's gradient; returns that norm, or None
        when the gradients are whole on every rank (torch DDP) or DTensors whose norm torch computes globally
        (FSDP2 without TP): the caller's own clipping is then exact."""
        from lightning_parallel.parallel.tensor.sync import clip_grad_norm_

        if isinstance(optimizer, ZeroOptimizer):
            return optimizer.clip_grad_norm_(max_norm)
        if callable(getattr(optimizer, "clip_grad_norm", None)):  # fairscale OSS
            return optimizer.clip_grad_norm(max_norm)  # type: ignore[attr-defined,no-any-return]
        if self.dims.tp == 1 and self.dims.pp == 1:
            return None
        groups = [self.group("tp"), self.group("pp")]
        if self.plan.sync == "fsdp":  # gradients sharded over dp (over each HSDP shard group, replicated across)
            shard_axis = self.plan.fsdp_axes[-1]
            groups.append(self.mesh.get_group(shard_axis) if self.dims.hsdp or self.dims.replicas > 1 else None)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return clip_grad_norm_(params, max_norm, tp_size=self.dims.tp, groups=groups)

    # ------------------------------------------------------------------ the logged values
    def reduce_mean(self, value: Tensor) -> Tensor:
        """``value`` averaged over ``dp`` (``dp x cp`` with context parallelism; a copy that keeps its graph,
        ``value`` itself is left as it is)."""
        if self.dims.replicas == 1:
            return value
        value = value.clone()
        dist.all_reduce(value, group=self.dp_group)
        value /= self.dims.replicas
        return value

    def reduce_logged_batch(self, values: Sequence[tuple[Tensor, Any]], extra: Tensor | None = None
                            ) -> tuple[list[Tensor], Tensor | None]:
        """Every value a training step logged, combined over ``dp`` (``dp x cp``) in as few all-reduces as their
        reductions allow, ``extra`` summed in the first (:func:`reduce_logged_batch`)."""
        return reduce_logged_batch(values, group=self.dp_group, size=self.dims.replicas, extra=extra)

    def reduce_logged_world(self, values: Sequence[tuple[Tensor, Any]], extra: Tensor | None = None
                            ) -> tuple[list[Tensor], Tensor | None]:
        """As :meth:`reduce_logged_batch`, in one all-reduce over every rank: each value is held alike by the
        ``world / replicas`` model-parallel peers of its replica (tp, the loss of a tensor-parallel model), so the
        world's sum is that many times the replicas' sum. For ``extra`` summed over the whole world (the non-finite
        guard's numbers) where the replicas are not the whole world: one collective for both."""
        return reduce_logged_batch(values, group=None, size=self.dims.replicas,
                                   copies=self.dims.world_size // self.dims.replicas, extra=extra)


_PER_TENSOR = {
    "Adafactor": "second moments factored by each matrix's rows and columns",
    "LAMB": "a trust ratio per parameter tensor", "Lamb": "a trust ratio per parameter tensor",
    "FusedLAMB": "a trust ratio per parameter tensor", "LARS": "a trust ratio per parameter tensor",
    "Lars": "a trust ratio per parameter tensor", "Shampoo": "preconditioners per matrix dimension",
    "DistributedShampoo": "preconditioners per matrix dimension", "SOAP": "preconditioners per matrix dimension",
    "Muon": "an orthogonalised update of each matrix", "LBFGS": "curvature pairs over the whole parameter vector",
    "Prodigy": "a step size estimated from sums over every parameter",
    "DAdaptAdam": "a step size estimated from sums over every parameter",
    "DAdaptSGD": "a step size estimated from sums over every parameter",
    "DAdaptAdaGrad": "a step size estimated from sums over every parameter",
    "DAdaptLion": "a step size estimated from sums over every parameter",
}
"""Optimizers whose update is not element by element: the flat ZeRO-1/2 shard would change it."""
_DTENSOR_FAILS = {
    "Adafactor": "an in-place power on a partial-norm placement (aten.pow_)",
    "Rprop": "an indexed in-place write that would change a placement (aten.index_put_)",
}
"""torch optimizers whose first step fails on DTensor parameters (measured with torch 2.13)."""

_OPS = {"mean": "mean", "sum": "sum", "add": "sum", "max": "max", "amax": "max", "min": "min", "amin": "min"}


def _zero_optimizers(optimizers: Iterable[Any]) -> Iterator[ZeroOptimizer]:
    for opt in optimizers:
        raw = getattr(opt, "_optimizer", opt)  # Lightning's LightningOptimizer wraps it
        if isinstance(raw, ZeroOptimizer):
            yield raw


def logged_reduce_op(reduce_fx: Any) -> str | None:
    """``mean``/``sum``/``max``/``min`` for a logged ``reduce_fx`` (a name or ``torch.mean``, ``torch.sum``, ...);
    None for another callable (its combination over ranks is unknown)."""
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", None)
    return _OPS.get(name) if isinstance(name, str) else None


def reduce_logged(value: Tensor, *, group: dist.ProcessGroup | None, size: int, reduce_fx: Any = "mean") -> Tensor:
    """``value`` (each rank's value of the same metric, e.g. the loss of its part of the global batch) combined over
    the ``size`` ranks of ``group`` (None: the world) by ``reduce_fx``: the mean of equal parts' means is the global
    batch's mean, the sum of their sums its sum. A detached copy; ``value`` is returned as it is when ``size`` is 1 or
    ``reduce_fx`` is not one of mean/sum/max/min. One all-reduce (:func:`reduce_logged_batch` of one value), issued
    without waiting on the host (every rank of ``group`` must log the value: as for Lightning's ``sync_dist=True``)."""
    return reduce_logged_batch([(value, reduce_fx)], group=group, size=size)[0][0]


_SUMMED = ("mean", "sum")


def _flat(value: Tensor) -> Tensor:
    """``value`` detached and 1-D, with no tensor operation where it already is (each costs a step its dispatch)."""
    if value.requires_grad:
        value = value.detach()
    return value if value.dim() == 1 else value.reshape(-1)


def reduce_logged_batch(values: Sequence[tuple[Tensor, Any]], *, group: dist.ProcessGroup | None, size: int,
                        extra: Tensor | None = None, copies: int = 1) -> tuple[list[Tensor], Tensor | None]:
    """Several logged ``(value, reduce_fx)`` pairs combined as :func:`reduce_logged` combines each, batched: every
    ``mean``/``sum`` value of one dtype (and ``extra``, a tensor of numbers to be summed over the same ranks, such as
    the non-finite-loss guard's flags) in ONE all-reduce of their concatenation, ``max`` and ``min`` values in one
    more each. Returns the combined values (detached copies; values of another ``reduce_fx`` as they are) and
    ``extra`` summed (None when not given).

    ``copies``: each of the ``size`` replicas' values is held by that many ranks of ``group`` alike (its
    model-parallel peers; ``group`` has ``size x copies`` ranks): a mean divides the sum by ``size x copies``, a sum
    by ``copies``.

    Every rank of ``group`` must call it with values of the same count, reductions and dtypes in the same order (as
    for :func:`reduce_logged`). When ``extra`` is given the all-reduce is control traffic that the communication
    counter does not book (it replaces Lightning's per-batch broadcast; the logged values ride in it)."""
    out = [value for value, _ in values]
    buckets: dict[tuple[str, torch.dtype], list[int]] = {}
    ops = [logged_reduce_op(fx) if size > 1 else None for _, fx in values]
    for i, op in enumerate(ops):
        if op is not None:
            kind = "sum" if op in _SUMMED else op
            buckets.setdefault((kind, out[i].dtype), []).append(i)
    if extra is not None and size * copies > 1:
        buckets = {("sum", extra.dtype): buckets.pop(("sum", extra.dtype), []), **buckets}  # extra rides first
    all_reduce = uncounted_all_reduce if extra is not None else dist.all_reduce
    summed_extra = extra
    for (kind, _dtype), members in buckets.items():
        parts = [_flat(out[i]) for i in members]
        with_extra = extra is not None and kind == "sum" and _dtype == extra.dtype and summed_extra is extra
        if with_extra:
            assert extra is not None
            flat_extra = _flat(extra)
            if parts and flat_extra.device != parts[0].device:
                flat_extra = flat_extra.to(parts[0].device)
            parts.append(flat_extra)
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[kind]
        all_reduce(flat, op=reduce_op, group=group)
        offset = 0
        for i in members:
            n = out[i].numel()
            combined = flat[offset] if out[i].dim() == 0 else flat[offset:offset + n].reshape(out[i].shape)
            divisor = {"mean": size * copies, "sum": copies}.get(ops[i] or "", 1)
            out[i] = combined / divisor if divisor > 1 else combined
            offset += n
        if with_extra:
            assert extra is not None
            summed_extra = flat[offset:] if extra.dim() == 1 else flat[offset:].reshape(extra.shape)
    return out, summed_extra
