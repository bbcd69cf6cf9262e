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

from .base import LayoutStrategy
from .dcp import DCPCheckpointMixin

__all__ = ["LPTensorStrategy", "check_tensor_plan", "full_model_state", "require_plan_hook"]

_MINIMAL_PLAN = ('def tensor_parallel_plan(self):\n'
                 '    return {"layers.*.fc1": "column", "layers.*.fc2": "row"}   # fc1 -> act -> fc2 per layer')


def _is_parallelized(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _replicated_local(value: Any) -> Any:
    """Every DTensor in a step's output as a plain tensor (:func:`~lightning_parallel.parallel.tensor.local.plain`:
    a replicated one, the loss, keeps its graph; a sharded one, logits, is gathered by a collective every tp rank
    runs)."""
    from torch.distributed.tensor import DTensor

    from lightning_parallel.parallel.tensor.local import plain

    return apply_to_collection(value, DTensor, plain)


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


class LPTensorStrategy(DCPCheckpointMixin, LayoutStrategy):
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
        self._in_step = False  # inside a step's loss_parallel (_step_context)
        self.applied_plan: dict[str, Any] = {}

    # ------------------------------------------------------------------ the layout and the module
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
        model = super().parallelize(model, trainer_fn=trainer_fn)
        assert self.composition is not None
        self.applied_plan = self.composition.tensor_plan
        return model

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
        self._in_step = True
        try:
            with loss_parallel():
                yield
        finally:
            self._in_step = False
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

        # the vocab-parallel cross-entropy's backward runs under it too; a manual_backward inside training_step is
        # under the step's already (loss_parallel does not nest: the inner exit removes the outer's handlers)
        with contextlib.nullcontext() if self._in_step else loss_parallel():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

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

