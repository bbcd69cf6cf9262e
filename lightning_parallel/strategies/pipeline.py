"""``lp_pipeline``: pipeline parallelism over the ``pp`` axis, data parallelism (plain, ZeRO-1 or FSDP2) over ``dp``.

Layout ``(N/p, p, 1, z)``, z in 0..3: the module's
:meth:`~lightning_parallel.module_hooks.ParallelModuleMixin.pipeline_layers` are cut into ``n = p x v`` contiguous
stages (balanced by parameter count, or ``parallel.pipeline_stage_layers``); pipeline rank ``r`` keeps stages
``r, r + p, ...`` and deletes the other layers from its copy of the module, so each rank holds ``~1/p`` of the
weights, gradients and optimizer state, under the whole model's parameter names. ``d = N/p``
replicas of the pipeline split the global batch (the sampler takes rank and size from ``dp``).

Each training batch (``b`` samples per dp rank) is split into ``m = num_micro_batches`` micro-batches that flow
through the stages under ``pipeline_schedule`` (:mod:`lightning_parallel.parallel.pipeline`): forward activations
``b/m x ...`` go point-to-point from stage ``k`` to ``k + 1`` over ``pp``, their gradients back; idle fraction
``(p-1)/(m+p-1)`` (GPipe, 1F1B) or ``(p-1)/(v m + p-1)`` (interleaved). Then, over ``dp``, by ``zero_stage``:

* 0 -- one all-reduce (mean) of this stage's gradients after the step's last backward;
* 1 -- ZeRO-1 on this stage's parameters: reduce-scatter of the flat gradient, the optimizer steps ``1/d`` of it,
  all-gather of the parameters;
* 2, 3 -- FSDP2 ``fully_shard`` on each of this rank's stage chunks over ``dp`` (over ``(dp_replicate, dp_shard)``
  with ``parallel.data_parallel_shard_size``): parameters, gradients and optimizer state sharded ``1/d`` between
  steps; the micro-batches' gradients add into the stage's whole gradient and torch's schedule reduce-scatters it
  once, after the step's last micro-batch. Parameters are all-gathered in forward; ``reshard_after_forward``
  (:func:`~lightning_parallel.parallel.compose.reshard_policy`) decides whether they are freed after each forward:
  ZeRO-2 never (one all-gather per step), ZeRO-3 on every stage but the last under the 1F1B-family schedules (an
  all-gather per micro-batch and one more).

Lightning integration: the module's ``training_step`` / ``validation_step`` / ``test_step`` are not called (they
define the one-device computation); the strategy runs the schedule on ``pipeline_batch(batch) -> (input, target)``
and ``pipeline_loss(output, target)``, and logs ``train_loss`` (the mean over micro-batches, reduced from the last
stage to every rank and averaged over ``dp``: the one-device loss of the global batch), ``val_loss`` and
``test_loss`` (forward-only schedules). ``predict_step`` returns the last stage's output on every rank. Gradient
clipping by norm uses the norm of the whole model's gradient (summed over stages and ZeRO shards); LR schedulers
and gradient accumulation work as usual. Checkpoints are DCP folders, one shard per stage
(:class:`~lightning_parallel.strategies.dcp.DCPCheckpointMixin`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.module_hooks import ParallelModuleMixin, require_hook
from lightning_parallel.parallel.context_parallel import loss_labels
from lightning_parallel.parallel.counters import uncounted_all_reduce

from .base import LayoutStrategy
from .dcp import DCPCheckpointMixin
from .layout import check_context_batch, check_context_labels, own_functions

__all__ = ["LPPipelineStrategy"]

_MINIMAL_HOOKS = (
    "class MyModel(lightning_parallel.ParallelModuleMixin, L.LightningModule):\n"
    "    def pipeline_layers(self):            # the model as an ordered list of tensor -> tensor modules\n"
    "        return [self.embed, *self.blocks, self.head]\n"
    "    def pipeline_loss(self, output, target):   # the loss of one micro-batch\n"
    "        return F.cross_entropy(output.flatten(0, 1), target.flatten())"
)


class LPPipelineStrategy(DCPCheckpointMixin, LayoutStrategy):
    """Pipeline parallelism over ``pp`` x data parallelism over ``dp`` (``zero_stage`` 0, 1, 2 or 3).

    Args:
        parallel: the layout: ``pipeline_parallel_size``, ``data_parallel_size`` (auto or d), ``num_micro_batches``,
            ``pipeline_schedule`` (gpipe, 1f1b, interleaved_1f1b, zero_bubble), ``virtual_pipeline_stages``,
            ``pipeline_stage_layers``, ``activation_checkpointing``, ``zero_stage`` 0 (unset), 1, 2 or 3,
            ``reshard_after_forward``, ``data_parallel_shard_size``; tp = 1.
        kwargs: see :class:`~lightning_parallel.strategies.base.LayoutStrategy`.
    """

    strategy_name = "lp_pipeline"
    preset = {"zero_stage": 0, "offload": "none"}
    shape_checks = ("n_head", "vocab_size")
    pipelined = True

    def __init__(self, parallel: ParallelConfig | dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(parallel, **kwargs)
        self.runner: Any = None
        self.stage_plan: Any = None

    # ------------------------------------------------------------------ the layout and the module
    @property
    def zero_stage(self) -> int:
        return self.layout.zero

    @override
    def check_module(self, module: pl.LightningModule) -> None:
        """Before spawning: the hooks (named, with a minimal implementation), enough layers for ``p x v`` stages,
        ``pipeline_stage_layers`` against the layers (a module that builds them in ``configure_model()`` is refused
        with the meta-device way), and no parameter shared across stages."""
        super().check_module(module)
        own = sorted({name for name, _ in own_functions(type(module))
                      if name in ("training_step", "validation_step", "test_step", "predict_step")})
        if own:
            rank_zero_warn(
                f"{self.strategy_name} runs {type(module).__name__}'s layers through its pipeline schedule and does "
                f"not call its {', '.join(own)}: it logs train_loss, val_loss and test_loss itself (one device's "
                "values) and predicts the last stage's output; anything else those methods compute or log is not "
                "computed here (hooks such as on_validation_epoch_end still run).")
        for hook in ("pipeline_layers", "pipeline_loss"):
            try:
                require_hook(module, hook, strategy=self.strategy_name)
            except LayoutError as err:
                raise LayoutError(f"{err} A minimal implementation:\n{_MINIMAL_HOOKS}") from None
        from lightning_parallel.module_hooks import as_pipeline_layer, check_layer_signature
        from lightning_parallel.parallel.pipeline import layer_names, stage_ranges

        try:
            specs = [as_pipeline_layer(layer) for layer in module.pipeline_layers()]  # type: ignore[operator]
        except TypeError as err:
            raise LayoutError(f"{type(module).__name__}: {err}") from None
        layers = [spec.module for spec in specs]
        p, v = self.layout.pipeline_parallel_size, self.layout.virtual_pipeline_stages
        n = p * v
        if not layers and is_overridden("configure_model", module):
            raise LayoutError(
                f"{type(module).__name__}.pipeline_layers() returns {len(layers)} layers before its "
                f"configure_model() has run, and {self.strategy_name} cuts the layers into {n} stages before any rank "
                "starts (each rank keeps only its stage's), so they must exist when the module is made. Fix: build "
                "the layers in __init__ -- for a model too large for one host, under `with torch.device('meta'):` "
                "with an init_weights() that fills the present layers in place (each rank then materializes its own "
                "stage only; see the library's GPT)."
            )
        if len(layers) < n:
            raise LayoutError(
                f"parallel.pipeline_parallel_size={p} x virtual_pipeline_stages={v} = {n} stages, but "
                f"{type(module).__name__}.pipeline_layers() returns {len(layers)} layers (each stage needs at least "
                f"one). Fix: pipeline_parallel_size x virtual_pipeline_stages <= {len(layers)}."
            )
        try:
            names = layer_names(module, layers)
            ranges = stage_ranges(len(layers), n, layers_per_stage=self.layout.pipeline_stage_layers)
        except ValueError as err:
            raise LayoutError(f"{type(module).__name__}: {err}") from None
        for spec, name in zip(specs, names, strict=True):
            check_layer_signature(spec, name)
        owner: dict[int, tuple[int, str]] = {}
        for s, (a, b) in enumerate(ranges):
            for i in range(a, b):
                for pname, param in layers[i].named_parameters(remove_duplicate=False):
                    seen = owner.setdefault(id(param), (s, f"{names[i]}.{pname}"))
                    if seen[0] != s:
                        raise LayoutError(
                            f"{type(module).__name__} shares one parameter between pipeline stage {seen[0]} "
                            f"({seen[1]}) and stage {s} ({names[i]}.{pname}), e.g. tied input and output "
                            "embeddings: a stage cannot hold another stage's weight. Fix: untie them (the library's "
                            "GPT: tie_embeddings=False), or put both layers in one stage with "
                            "parallel.pipeline_stage_layers."
                        )
        outside = [name for name, param in module.named_parameters() if id(param) not in owner]
        if outside:
            rank_zero_warn(
                f"{type(module).__name__} has parameters outside every layer of pipeline_layers() "
                f"({', '.join(outside[:4])}{' ...' if len(outside) > 4 else ''}): {self.strategy_name} runs the "
                "layers, never the module's forward, so such a parameter is used only where pipeline_loss uses it "
                "(on the last stage); one the forward applies between layers is not applied here. Fix: make it part "
                "of a layer of pipeline_layers().")

    def check_data(self, launch_args: tuple[Any, ...], probe: Any = None) -> None:
        """Before spawning: the per-rank training batch must split into ``num_micro_batches`` equal micro-batches
        (read from a DataLoader or a data module's ``batch_size`` among ``trainer.fit``'s arguments), and one real
        training batch (``probe``: :class:`~lightning_parallel.strategies.layout.TrainingDataProbe`) must go through
        the module's ``pipeline_batch`` into an input tensor and a target; and automatic optimization (the schedule
        runs each batch's forward, backward and the optimizer step through Lightning's loop; a module's own
        ``training_step`` never runs here; evaluation takes any module)."""
        module = launch_args[0] if launch_args and isinstance(launch_args[0], pl.LightningModule) else None
        if module is not None and not module.automatic_optimization:
            raise LayoutError(
                f"{self.strategy_name} runs every training batch through its pipeline schedule (forward and backward "
                f"of each micro-batch on its stage) and never calls {type(module).__name__}.training_step, so "
                "automatic_optimization=False (manual optimization: manual_backward, opt.step()) would never step. "
                "Fix: use automatic optimization (return the loss from training_step; gradient clipping and "
                "accumulation go through the Trainer), or a strategy that runs training_step as written: lp_ddp, "
                "lp_sharded or lp_tensor."
            )
        m = self.layout.micro_batches
        for source, batch_size in _batch_sizes(launch_args):
            if batch_size % m:
                raise LayoutError(
                    f"{source} batch_size={batch_size} (per data-parallel rank) does not split into "
                    f"parallel.num_micro_batches={m} equal micro-batches: {batch_size} % {m} = {batch_size % m}. "
                    f"Fix: batch_size a multiple of {m} (e.g. {max(m, batch_size - batch_size % m)}), or "
                    f"num_micro_batches a divisor of {batch_size}."
                )
        batch = probe.first_batch() if probe is not None else None
        if module is None or batch is None:
            return
        own = "pipeline_batch" in {k for c in type(module).__mro__ if c is not ParallelModuleMixin for k in vars(c)}
        try:
            inputs, target = self._split_batch(module, batch)
        except Exception as err:
            raise LayoutError(
                f"lp_pipeline cannot split a real training batch of {probe.source} (a {_batch_kind(batch)}) into "
                f"(input, target) with {type(module).__name__}.pipeline_batch: {type(err).__name__}: {err}"
                + ("" if own or "Fix:" in str(err) else " Fix: override pipeline_batch(self, batch) on the module "
                   "and return the input tensor and the target, e.g. `return batch['input_ids'], batch['labels']`.")
            ) from None
        if not isinstance(inputs, Tensor) or target is None:
            raise LayoutError(
                f"{type(module).__name__}.pipeline_batch(batch) must return (input tensor, target) for a training "
                f"batch of {probe.source} (a {_batch_kind(batch)}); it returned ({type(inputs).__name__}, "
                f"{type(target).__name__}). Fix: return the tensor the first stage takes and the target "
                "pipeline_loss compares the last stage's output with."
            )
        strict = self.layout.context_parallel_size > 1
        if strict or loss_labels(module) is not None:  # the last stage weighs each micro-batch by its tokens
            check_context_labels(module, probe, target, strict=strict)
            if self.dims.cp > 1:
                check_context_batch(module, probe, self.dims.cp)

    def check_last_training_batch(self, probe: Any) -> None:
        """Before spawning (after ``parallel.global_batch_size`` has set the accumulation): with ``drop_last=False`` an
        epoch whose samples per dp rank are not a multiple of ``batch_size`` ends on a shorter batch, which must split
        into ``num_micro_batches`` too -- found only when it arrived (after a whole epoch of training) before. The
        samples per rank are what the loader's sampler yields: split over dp where Lightning will put its
        ``DistributedSampler`` over it (``use_distributed_sampler`` and a sampler that is not one already), as they
        are otherwise. Not checked for an iterable dataset, a batch sampler of the user's, or when the run never
        reaches the short batch (``max_steps`` or ``limit_train_batches`` end the epoch first)."""
        from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset

        loader, trainer = probe.loader, probe.trainer
        if loader is None or trainer is None or getattr(loader, "drop_last", False) \
                or not getattr(loader, "batch_size", None) or isinstance(loader.dataset, IterableDataset) \
                or type(loader.batch_sampler) is not BatchSampler:
            return
        try:
            samples = len(loader.sampler)
        except TypeError:
            return
        m, dp, size = self.layout.micro_batches, self.dims.dp, int(loader.batch_size)
        connector = getattr(trainer, "_accelerator_connector", None)
        split = bool(getattr(connector, "use_distributed_sampler", True)) and not isinstance(loader.sampler,
                                                                                             DistributedSampler)
        per_rank = -(-samples // dp) if split else samples
        last = per_rank % size
        if last == 0 or last % m == 0:
            return
        batches = -(-per_rank // size)
        limit = trainer.limit_train_batches
        used = batches if limit is None else (min(batches, int(limit)) if isinstance(limit, int)
                                              else int(batches * float(limit)))
        steps, accumulate = trainer.max_steps, trainer.accumulate_grad_batches or 1
        if used < batches or (steps not in (-1, None) and steps * accumulate < batches):
            return
        spread = f"{samples:,} samples over dp={dp} ranks are {per_rank:,} per rank" if split else \
            f"the sampler yields {per_rank:,} samples on each rank"
        raise LayoutError(
            f"{probe.source}: {spread}, so with batch_size={size} and drop_last=False each epoch ends on a batch of "
            f"{last} samples, which does not split into parallel.num_micro_batches={m} equal micro-batches ({last} % "
            f"{m} = {last % m}); the run would stop there, after the epoch's other batches. Fix: drop_last=True on "
            f"the training DataLoader (the short batch is skipped), or {per_rank - last:,} or "
            f"{per_rank - last + size:,} samples per rank.")

    @staticmethod
    def _split_batch(module: Any, batch: Any) -> tuple[Any, Any]:
        hook = getattr(module, "pipeline_batch", None)
        if callable(hook):
            return hook(batch)  # type: ignore[no-any-return]
        return ParallelModuleMixin.pipeline_batch(module, batch)

    @override
    def describe(self) -> str:
        """``lp_pipeline (dp=1 x pp=2 x tp=1 = 2 ranks, 1f1b, m=4)``, plus v, ZeRO and recomputation when set."""
        text = super().describe()
        if self._dims is None:
            return text
        extra = f", {self.layout.pipeline_schedule}, m={self.layout.micro_batches}"
        if self.layout.virtual_pipeline_stages > 1:
            extra += f", v={self.layout.virtual_pipeline_stages}"
        return text[:-1] + extra + ")"

    def describe_cut(self, module: nn.Module) -> str:
        """Which layers each stage of ``module`` (whole, meta device fine) gets under this layout, e.g.
        ``stage 0 (pp rank 0): embed .. blocks.1 (3 layers); stage 1 (pp rank 1): blocks.2 .. head (3 layers)``."""
        from lightning_parallel.parallel.pipeline import plan_stages

        plan = plan_stages(module, module.pipeline_layers(), pp=self.layout.pipeline_parallel_size,  # type: ignore[operator]
                           chunks=self.layout.virtual_pipeline_stages, pp_rank=0,
                           layers_per_stage=_as_list(self.layout.pipeline_stage_layers))
        return plan.describe()

    @override
    def parallelize(self, model: nn.Module, *, trainer_fn: TrainerFn) -> nn.Module:
        """The composition (:mod:`lightning_parallel.parallel.compose`: this rank's stages kept, TP on them when
        tp > 1, recomputation, dp replicas made equal), then the runner for the stages (kept across fit / validate
        / test / predict)."""
        from lightning_parallel.parallel.pipeline import PipelineRunner

        if self.runner is not None:
            return model
        module = self.lightning_module
        assert module is not None
        model = super().parallelize(model, trainer_fn=trainer_fn)
        composition = self.composition
        assert composition is not None
        self.stage_plan = composition.stage_plan
        assert self.stage_plan is not None

        def module_loss(output: Tensor, target: Tensor) -> Tensor:
            return module.pipeline_loss(output, target)  # type: ignore[operator,no-any-return]

        loss_fn: Callable[[Tensor, Tensor], Tensor] = module_loss
        if self.loss_labels is not None:
            self._tokens = _BatchTokens()
            loss_fn = _token_weighed(module_loss, self.loss_labels.ignore_index, self._tokens)

        self.runner = PipelineRunner(
            list(zip(self.stage_plan.my_stages, composition.chunks, strict=True)),
            num_stages=self.stage_plan.num_stages,
            schedule=self.layout.pipeline_schedule, num_micro_batches=self.layout.micro_batches,
            group=self.mesh.get_group("pp"), group_ranks=self.dims.group_ranks("pp", self.global_rank),
            device=self.root_device, loss_fn=loss_fn, plan=self.stage_plan)
        return model

    @override
    def full_state_for_main_process(self, module: nn.Module) -> dict[str, Any] | None:
        """The whole model's weights, joined from every stage (an all-gather of objects over ``pp``)."""
        if self.stage_plan is None or self.runner is None:
            return None
        from .tensor import full_model_state

        mine = {k: v.cpu() for k, v in full_model_state(module).items()}  # DTensors gathered over tp
        parts: list[Any] = [None] * self.dims.pp
        dist.all_gather_object(parts, mine, group=self.runner.group)  # the mesh is gone after teardown
        return {k: v for part in parts for k, v in part.items()}

    # ------------------------------------------------------------------ steps: the schedule instead of *_step
    def _inputs(self, batch: Any) -> tuple[Any, Tensor | None]:
        module = self.lightning_module
        hook = getattr(module, "pipeline_batch", None)
        if callable(hook):
            return hook(batch)  # type: ignore[no-any-return]
        return ParallelModuleMixin.pipeline_batch(module, batch)  # type: ignore[arg-type]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """Forward + backward of every micro-batch under the schedule; logs and returns the step's mean loss (the
        gradients are already in ``.grad``: :meth:`backward` runs no autograd)."""
        assert self.runner is not None and self.lightning_module is not None
        batch = args[0] if args else kwargs["batch"]
        inputs, target = self._inputs(self.context_batch(batch))  # with cp: this rank's tokens
        if target is None:
            raise ValueError("lp_pipeline: pipeline_batch(batch) returned no target for a training batch.")
        self.buffers_before_forward(training=True)
        window = self.step_tokens.take() if self.step_tokens is not None else None  # one per training batch
        log_scale = self._count_tokens(batch, micro_batches=self.runner.m, window=window)
        guard = self._agreeing_guard()
        scaler = getattr(self.precision_plugin, "scaler", None)  # 16-mixed: the loss scaled before each backward
        with self.precision_plugin.train_step_context(), self._tp_loss(), self.attention_check():
            loss = self.runner.train_step(inputs, target, accumulate=self.accumulate_grad_batches,
                                          everywhere=guard is None,
                                          loss_scale=scaler.scale if scaler is not None else None)
        if log_scale is not None:  # with a window the step's loss is A x (its tokens' sum) / N_step: as the batch's
            loss = loss * log_scale  # mean for the log and the guard
        if guard is not None:
            # one world all-reduce for the loss and the non-finite guard, in place of three collectives (the loss's
            # broadcast over pp, its mean over dp, the guard's agreement at the batch's end): the last stage's ranks
            # add their loss to the guard's value and count, every other rank only its preemption flag
            numbers = guard.local_numbers(self.lightning_module.trainer, loss, counted=self.runner.last)
            assert numbers is not None
            uncounted_all_reduce(numbers)
            guard.agree(numbers)
            loss = guard.agreed_loss(numbers)
        else:
            loss = self.train_step.reduce_mean(loss)
        self.lightning_module.log("train_loss", loss, prog_bar=True, sync_dist=False)
        return loss

    def _eval(self, batch: Any, name: str, prog_bar: bool) -> Tensor:
        assert self.runner is not None and self.lightning_module is not None
        self.buffers_before_forward(training=False)
        inputs, target = self._inputs(self.context_batch(batch, complete=False))
        if target is None:
            raise ValueError(f"lp_pipeline: pipeline_batch(batch) returned no target for a {name} batch.")
        self._count_tokens(batch, micro_batches=1)  # the eval loss is the whole batch's
        with self.precision_plugin.val_step_context(), self._tp_loss(), self.attention_check():
            loss, _ = self.runner.eval_loss(inputs, target)
        self.lightning_module.log(name, loss, prog_bar=prog_bar, sync_dist=True)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Tensor:
        return self._eval(args[0] if args else kwargs["batch"], "val_loss", True)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Tensor:
        with self.precision_plugin.test_step_context():
            return self._eval(args[0] if args else kwargs["batch"], "test_loss", False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """The last stage's output for the batch, on every rank (a broadcast over ``pp``)."""
        assert self.runner is not None
        batch = self.context_batch(args[0] if args else kwargs["batch"], complete=False)
        inputs = batch if isinstance(batch, Tensor) else self._inputs(batch)[0]
        with self.precision_plugin.predict_step_context(), self._tp_loss(), self.attention_check():
            out = self.runner.forward_only(inputs)
            return self.context_unshard(self.runner.outputs_everywhere(out), local_len=inputs.shape[1])

    _tokens: _BatchTokens | None = None

    def _count_tokens(self, batch: Any, *, micro_batches: int, window: tuple[int, int] | None = None
                      ) -> Tensor | None:
        """With the module's token labels named: the counted tokens the last stage divides each micro-batch's
        weighed token mean by -- the global batch's (this rank's whole batch, summed over ``dp``), or with ``window``
        (this rank's counted tokens of the optimizer step's batches, read ahead, and the ``k`` > 1 batches it holds)
        the step's, the loss then multiplied by ``k`` too (Lightning divides it by its accumulation) -- and the
        losses they are averaged over (``dp x cp x micro_batches``). One all-reduce of one or two numbers over dp
        (none with dp = 1). Returns what the step's mean loss is multiplied by to log the global batch's mean
        (``N_step / (k N_batch)``; None without a window)."""
        tokens = self._tokens
        if tokens is None:
            return None
        from lightning_parallel.parallel.context_parallel import counted_tokens

        assert self.loss_labels is not None
        accumulation = 1 if window is None else window[1]
        count = counted_tokens(batch, self.loss_labels)
        numbers = count.reshape(1) if window is None or accumulation == 1 else torch.stack(
            (count, torch.full_like(count, window[0])))
        numbers = self.sum_over_dp(numbers)
        pieces = self.dims.dp * self.dims.cp * micro_batches
        if numbers.numel() == 1:
            tokens.total, tokens.pieces = numbers[0], pieces
            return None
        tokens.total, tokens.pieces = numbers[1], pieces * accumulation
        return numbers[1] / (accumulation * numbers[0].clamp(min=1))

    def _tp_loss(self) -> contextlib.AbstractContextManager[Any]:
        """With tp > 1 the head's logits are split by vocabulary: the loss is torch's ``loss_parallel``."""
        if self.dims.tp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule ran the backward in :meth:`training_step`: only the hooks (``on_before_backward``,
        ``on_after_backward``) and, on the step's last batch, the dp gradient sync."""
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    # ------------------------------------------------------------------ checkpoints: DCP, one shard per stage
    @override
    def checkpoint_layout(self) -> dict[str, Any]:
        plan = self.stage_plan
        return {"dp": self.dims.dp, "pp": self.dims.pp, "tp": self.dims.tp,
                "virtual_pipeline_stages": self.layout.virtual_pipeline_stages, "zero_stage": self.zero_stage,
                "pipeline_schedule": self.layout.pipeline_schedule,
                "sequence_parallel": self.layout.sequence_parallel,
                "stages": [list(plan.names[a:b]) for a, b in plan.ranges] if plan is not None else None}

    @override
    def can_read_saved_layout(self, saved: dict[str, Any]) -> bool:
        """Everything is stored under the whole model's parameter names, so any cut reads its own tensors from the
        files: another ``pp``, ``virtual_pipeline_stages``, schedule, ``dp`` or ZeRO stage. A folder of another
        ``tp`` is joined into the one-device form first."""
        return int(saved.get("tp", 1)) == self.dims.tp

    @override
    def merge_saved_param_groups(self, gathered: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """Each rank's optimizer ``param_groups`` (names of its stage's parameters) joined into the whole model's,
        in layer order (the order a one-device optimizer numbers them)."""
        plan = self.stage_plan
        assert plan is not None
        position = {name: i for i, name in enumerate(plan.names)}

        def key(name: str) -> int:
            prefix = max((n for n in position if name == n or name.startswith(n + ".")), key=len, default=None)
            return position[prefix] if prefix is not None else -1

        merged: list[dict[str, Any]] = []
        for i, group in enumerate(gathered[0]):
            names: list[str] = []
            for rank_groups in gathered:
                names.extend(n for n in rank_groups[i]["params"] if n not in names)
            order = {n: j for j, n in enumerate(names)}
            merged.append({**group, "params": sorted(names, key=lambda n: (key(n), order[n]))})
        return merged


def _batch_kind(batch: Any) -> str:
    if isinstance(batch, dict):
        return f"dict with keys {sorted(map(str, batch))[:6]}"
    if isinstance(batch, (list, tuple)):
        return f"{type(batch).__name__} of {len(batch)}"
    return type(batch).__name__


def _as_list(value: Any) -> list[int] | None:
    return None if value is None else [int(v) for v in value]


def _batch_sizes(launch_args: tuple[Any, ...]) -> Iterator[tuple[str, int]]:
    """``(what, batch_size)`` of the training DataLoader or data module among ``trainer.fit``'s arguments ``(model,
    train_dataloaders, val_dataloaders, datamodule, ckpt_path)``: the validation DataLoaders take any batch size."""
    for i, arg in enumerate(launch_args):
        if i == 2:  # val_dataloaders
            continue
        if isinstance(arg, DataLoader) and isinstance(arg.batch_size, int):
            yield "the training DataLoader's", arg.batch_size
        elif isinstance(arg, pl.LightningDataModule):
            size = getattr(arg, "batch_size", None)
            if size is None:
                size = getattr(arg, "hparams", {}).get("batch_size") if hasattr(arg, "hparams") else None
            if isinstance(size, int) and not isinstance(size, bool):
                yield f"the data module {type(arg).__name__}'s", size



class _BatchTokens:
    """The token count of the batch a pipeline runs (set by the strategy before each schedule): ``total`` counted
    tokens of the global batch (or of the optimizer step's batches) and the ``pieces`` (token-mean losses: ``dp x cp
    x`` micro-batches, times the step's batches) they are averaged over."""

    total: Tensor | None = None
    pieces: int = 1


def _token_weighed(loss_fn: Callable[[Tensor, Tensor], Tensor], ignore_index: int,
                   tokens: _BatchTokens) -> Callable[[Tensor, Tensor], Tensor]:
    """With the module's token labels named: each micro-batch's loss on the last stage multiplied by its share of the
    counted tokens, ``pieces x n_micro / N`` (its target's labels other than ``ignore_index``; ``N`` and ``pieces``
    from :class:`_BatchTokens`), so the mean over the micro-batches, the cp ranks, the dp ranks (and the step's
    batches) is the mean over every counted token of the global batch (of the step). No collective here."""
    from lightning_parallel.parallel.context_parallel import token_share, weigh
    from lightning_parallel.parallel.tensor.local import plain

    def weighed(output: Tensor, target: Tensor) -> Tensor:
        assert tokens.total is not None, "the batch's tokens are counted before its schedule runs"
        mine = (target != ignore_index).sum()
        return weigh(plain(loss_fn(output, target)), token_share(mine, tokens.total.to(mine.device), tokens.pieces))

    return weighed
