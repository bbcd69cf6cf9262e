"""``lp_tensor``: tensor parallelism over the ``tp`` axis, data parallelism (with ZeRO-1 or FSDP2) over ``dp``.

Layout ``(N/t, 1, t, z)``: ``tensor_parallel_size = t`` ranks (neighbours on a node) split each weight matrix of the
module's :meth:`~lightning_parallel.module_hooks.ParallelModuleMixin.tensor_parallel_plan` (Megatron's column / row /
vocab-parallel split, :mod:`lightning_parallel.parallel.tensor`) and see the same batch; ``d = N/t`` replicas of
that group split the global batch (the sampler takes rank and size from ``dp``). Per rank, each split matrix holds
``1/t`` of its elements; norms, row-linear biases and modules outside the plan are replicated over ``tp``.

Collectives, per micro-batch and transformer layer, over ``tp`` (activations ``b x s x h``): forward two
all-reduces (after the row linears of attention and MLP), backward two (of the column linears' input gradients);
with ``sequence_parallel`` all-gather + reduce-scatter of the same buffers instead, and norms/dropout run on
``s/t`` positions. The vocab-parallel embedding all-reduces its lookups, the head leaves its logits split by
vocabulary and the loss is computed by ``loss_parallel`` (all-reduces of ``b x s`` statistics): the loss the
training step sees and logs is one replicated value. Over ``dp``, by ``parallel.zero_stage``:

* 0 -- after the step's last backward, one all-reduce (mean) of this rank's local gradients;
* 1 -- ZeRO-1 on the local shards (:class:`~lightning_parallel.parallel.tensor.LocalShardZeroOptimizer`):
  reduce-scatter of the flat local gradients, the optimizer steps ``1/d`` of them, all-gather of the parameters;
* 3 -- FSDP2 ``fully_shard`` over the dp sub-mesh on top of TP (parameters 2-D DTensors ``(dp, tp)``):
  all-gathers per block in forward and backward, reduce-scatter of gradients.

Clipping (``gradient_clip_val``, by norm) uses the norm of the whole model's gradient: tp-sharded tensors count once
(each rank its shard), tp-replicated ones once. Checkpoints: see :meth:`LPTensorStrategy.save_checkpoint`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.module_hooks import require_hook
from lightning_parallel.parallel.tensor import PlanError, expand_plan
from lightning_parallel.parallel.zero import CommCounter

from .base import LayoutStrategy
from .composed import ComposedMixin
from .dcp import DCPCheckpointMixin
from .layout import clip_by_norm_replaced

__all__ = ["LPTensorStrategy", "check_tensor_plan", "full_model_state", "require_plan_hook"]

_MINIMAL_PLAN = ('def tensor_parallel_plan(self):\n'
                 '    return {"layers.*.fc1": "column", "layers.*.fc2": "row"}   # fc1 -> act -> fc2 per layer')


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _is_parallelized(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _replicated_local(value: Any) -> Any:
    """A DTensor output as a plain tensor: a replicated one (the loss) keeps its graph (``to_local``); a sharded one
    (logits) is gathered (``full_tensor``, a collective every tp rank runs)."""
    from torch.distributed.tensor import DTensor, Replicate

    def convert(t: DTensor) -> Tensor:
        if all(isinstance(p, Replicate) for p in t.placements):
            return t.to_local()
        return t.full_tensor()

    return apply_to_collection(value, DTensor, convert)


def full_model_state(module: nn.Module) -> dict[str, Tensor]:
    """The module's whole state dict with plain full tensors, on every rank (collective: gathers each DTensor)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}


def require_plan_hook(module: nn.Module, strategy: str) -> None:
    """Refuse a module without ``tensor_parallel_plan()``, showing a minimal plan."""
    try:
        require_hook(module, "tensor_parallel_plan", strategy=strategy)
    except LayoutError as err:
        raise LayoutError(f"{err} A minimal plan for a module with layers.<i>.fc1/fc2 linears:\n"
                          f"{_MINIMAL_PLAN}") from None


def check_tensor_plan(module: nn.Module, t: int) -> None:
    """Before spawning: every key of the module's ``tensor_parallel_plan()`` names a submodule, and each dimension
    its style splits is divisible by ``t`` (:class:`LayoutError` with the arithmetic and the fix)."""
    try:
        plan = expand_plan(module, module.tensor_parallel_plan())  # type: ignore[operator]
    except PlanError as err:
        raise LayoutError(str(err)) from None
    for name, style in plan.items():
        sub = module.get_submodule(name)
        split = {("column", "Linear"): ("out_features", "output features"),
                 ("row", "Linear"): ("in_features", "input features"),
                 ("vocab", "Linear"): ("out_features", "vocabulary (output features)"),
                 ("vocab", "Embedding"): ("num_embeddings", "vocabulary (rows)")}.get(
                     (style if isinstance(style, str) else "", type(sub).__name__))
        if split is None or not isinstance(sub, (nn.Linear, nn.Embedding)):
            continue
        size = int(getattr(sub, split[0]))
        if size % t:
            fix = (f"pad the vocabulary to {-(-size // t) * t} (a multiple of {t}; the extra rows are never "
                   "targets)" if style == "vocab" else
                   f"make the hidden size a multiple of {t}, or tensor_parallel_size a divisor of {size}")
            raise LayoutError(
                f"parallel.tensor_parallel_size={t} does not divide {name}.{split[0]}={size} ({split[1]} split "
                f"by the '{style}' style): {size} % {t} = {size % t}. Fix: {fix}."
            )


class LPTensorStrategy(ComposedMixin, DCPCheckpointMixin, LayoutStrategy):
    """Tensor parallelism over ``tp`` x data parallelism over ``dp`` (``zero_stage`` 0, 1 or 3).

    Args:
        parallel: the layout: ``tensor_parallel_size``, ``data_parallel_size`` (auto or d), ``sequence_parallel``,
            ``activation_checkpointing``, ``zero_stage`` 0 (unset), 1 or 3; pp = 1, no offload.
        kwargs: see :class:`~lightning_parallel.strategies.base.LayoutStrategy`.
    """

    strategy_name = "lp_tensor"
    preset = {"zero_stage": 0, "offload": "none"}

    def __init__(self, parallel: ParallelConfig | dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(parallel, **kwargs)
        self.comm_counter = CommCounter()
        """Bytes of the dp-axis collectives (gradient sync, ZeRO-1) since the step began."""
        self._accumulating = False
        self.applied_plan: dict[str, Any] = {}

    # ------------------------------------------------------------------ the layout and the module
    @override
    def check_layout(self, layout: ParallelConfig) -> None:
        self.refuse_keys(layout, {"pipeline_parallel_size": (1,), "offload": ("none",)},
                         shape="splits layers over tp and replicates them over dp (layout (N/t, 1, t, 0|1|3))")
        if layout.zero_stage not in (None, 0, 1, 3):
            raise LayoutError(
                f"lp_tensor runs zero_stage 0 (gradient all-reduce over dp), 1 (ZeRO-1 on the local shards) or 3 "
                f"(FSDP2 over dp x TP over tp), but parallel.zero_stage={layout.zero_stage}. Fix: zero_stage=1 "
                "(same traffic as 2, the gradients stay whole) or 3."
            )

    @override
    def check_module(self, module: pl.LightningModule) -> None:
        """Before spawning: the layout's model rules, the plan hook (named, with a minimal plan), every plan key
        against the module, and each split dimension divisible by ``t``."""
        super().check_module(module)
        require_plan_hook(module, self.strategy_name)
        check_tensor_plan(module, self.layout.tensor_parallel_size)

    @override
    def full_state_for_main_process(self, module: nn.Module) -> dict[str, Any] | None:
        """The whole weights (rank 0 holds DTensor shards); a collective every rank runs."""
        return full_model_state(module) if _is_parallelized(module) else None

    @property
    def zero_stage(self) -> int:
        return self.layout.zero

    @override
    def parallelize(self, model: nn.Module, *, trainer_fn: TrainerFn) -> nn.Module:
        """The composition without a pipeline split: TP over ``tp`` as the module's plan says, recomputation, dp
        replicas made equal by a broadcast of the local tensors over ``dp``, then FSDP2 over ``dp`` at zero_stage 3
        (kept if an earlier ``fit`` of this process already did it)."""
        self.applied_plan = self.compose_module(model).tensor_plan
        return model

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """ZeRO-1: wrap each optimizer on the local shards (the user's optimizer object and its schedulers stay)."""
        super().setup_optimizers(trainer)
        if self.zero_stage != 1 or trainer.state.fn != TrainerFn.FITTING:
            return
        from lightning_parallel.parallel.tensor.sync import LocalShardZeroOptimizer

        self.optimizers = [LocalShardZeroOptimizer(opt, group=self.mesh.get_group("dp"),
                                                   tp_group=self.mesh.get_group("tp"), tp_size=self.dims.tp,
                                                   counter=self.comm_counter) for opt in self.optimizers]

    @override
    def fit_patches(self) -> list[contextlib.AbstractContextManager[Any]]:
        """While fitting: clip by the norm of the whole model's gradient across tp (and dp)."""
        return [_clip_by_global_norm(self)]

    # ------------------------------------------------------------------ steps: vocab-parallel loss, replicated outputs
    @contextlib.contextmanager
    def _step_context(self) -> Generator[None, None, None]:
        """``loss_parallel`` (the logits are split by vocabulary) and ``self.log`` of plain replicated values."""
        from torch.distributed.tensor.parallel import loss_parallel

        module = self.lightning_module
        assert module is not None
        original = module.log

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            original(name, _replicated_local(value), *args, **kwargs)

        module.log = log  # type: ignore[method-assign]
        try:
            with loss_parallel():
                yield
        finally:
            del module.log

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return _replicated_local(super().training_step(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return _replicated_local(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return _replicated_local(super().test_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return _replicated_local(super().predict_step(*args, **kwargs))

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():  # the vocab-parallel cross-entropy's backward runs under it too
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-batch: gradients stay local (no dp sync) until the step's last backward."""
        self._accumulating = True
        try:
            model: Any = self.model
            if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
                model.set_requires_gradient_sync(False)
                try:
                    yield None
                finally:
                    model.set_requires_gradient_sync(True)
            else:
                yield None
        finally:
            self._accumulating = False

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Last backward of the step: settle partial (sequence-parallel) gradients over tp, then the dp sync of
        zero_stage 0 (all-reduce) or 1 (reduce-scatter), before Lightning's clipping."""
        from lightning_parallel.parallel.tensor.sync import (
            LocalShardZeroOptimizer,
            allreduce_gradients,
            settle_gradients,
        )

        super().post_backward(closure_loss)
        if self._accumulating:
            return
        assert self.model is not None
        settle_gradients(self.model.parameters())
        if self.zero_stage == 0:
            allreduce_gradients(self.model.parameters(), group=self.mesh.get_group("dp"), counter=self.comm_counter)
        for opt in self.optimizers:
            if isinstance(opt, LocalShardZeroOptimizer):
                opt.reduce_gradients()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        module = self.lightning_module
        accumulate = module.trainer.accumulate_grad_batches if module is not None and module._trainer else 1
        if batch_idx % accumulate == 0:
            self.comm_counter.reset()


    # ------------------------------------------------------------------ checkpoints: DCP, one shard per rank
    @override
    def checkpoint_layout(self) -> dict[str, Any]:
        return {"dp": self.dims.dp, "tp": self.dims.tp, "zero_stage": self.zero_stage,
                "sequence_parallel": self.layout.sequence_parallel}

    @override
    def can_read_saved_layout(self, saved: dict[str, Any]) -> bool:
        """A folder of the same ``tp`` is read shard by shard (DCP re-shards over another ``dp``); one of another
        ``tp`` is joined into the one-device form first."""
        return int(saved.get("tp", 1)) == self.dims.tp


def _clip_by_global_norm(strategy: LPTensorStrategy) -> contextlib.AbstractContextManager[None]:
    """Lightning's ``gradient_clip_val`` (norm) by the norm of the whole model's gradient across tp (and dp)."""
    from lightning_parallel.parallel.tensor.sync import LocalShardZeroOptimizer, clip_grad_norm_

    def clip(raw: Any, clip_val: float) -> None:
        if isinstance(raw, LocalShardZeroOptimizer):
            raw.clip_grad_norm_(clip_val)
            return
        groups = [strategy.mesh.get_group("tp")]
        if strategy.zero_stage == 3:
            groups.append(strategy.mesh.get_group("dp"))
        params = [p for g in raw.param_groups for p in g["params"]]
        clip_grad_norm_(params, clip_val, tp_size=strategy.dims.tp, groups=groups)

    return clip_by_norm_replaced(strategy.precision_plugin, clip)
