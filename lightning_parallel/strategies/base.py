"""``LayoutStrategy``: the one base that turns a parallel layout into a DeviceMesh and a parallelized module.

Built on Lightning's ``ParallelStrategy`` (as Lightning's own ``ModelParallelStrategy`` is), not on ``DDPStrategy``:
nothing here assumes the model is wrapped in torch DDP, that rank 0 holds the whole model, or that the module only
needs preparing for ``fit``. What it does, in order:

* ``Trainer.__init__`` (before any process exists): the layout is resolved against ``devices x num_nodes``
  (:class:`~lightning_parallel.strategies.layout.LayoutMixin`) and refused with the arithmetic and the fix; the
  launchers check the module against the layout before they start the ranks.
* ``setup_environment`` (in each process): the default process group (gloo on CPU, NCCL on CUDA, a timeout on every
  collective), then the named ``("dp", "pp", "tp")`` mesh from :class:`~lightning_parallel.parallel.dims.ParallelDims`.
* ``setup`` (for every ``TrainerFn``: fit, validate, test, predict): the module is moved to its device, activation
  checkpointing is applied as the layout says, and :meth:`LayoutStrategy.parallelize` -- the subclass's choice --
  turns it into what this rank runs (a DDP wrapper, a ZeRO-sharded module, a pipeline stage, tensor shards).
  Optimizers are set up after that, when fitting.
* The DataLoader sampler takes rank and size from the ``dp`` axis only: pipeline, tensor and context peers see the
  same batch. With context parallelism (cp > 1) each step keeps this rank's head and tail chunks of the batch
  tensors the module's ``context_parallel_plan()`` names, and tensors logged from a step are averaged over
  ``dp x cp`` (the one-device value of a mean over tokens).

Checkpoints: by default rank 0 writes the Lightning checkpoint (right when every rank holds the whole model);
strategies whose ranks hold different parts override ``save_checkpoint``/``lightning_module_state_dict``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import os
from collections.abc import Generator
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.parallel.compose import (
    Composition,
    DataParallelPlan,
    compose,
    data_parallel_plan,
    rewrap_if_trainable_changed,
)
from lightning_parallel.parallel.context_parallel import weigh
from lightning_parallel.parallel.counters import CommCounter, uncounted_all_reduce
from lightning_parallel.parallel.faults import interrupts, watchdog
from lightning_parallel.parallel.step import TrainStep, logged_reduce_op, reduce_logged

from .layout import (
    LayoutMixin,
    _methods_replaced,
    check_callbacks,
    check_pipeline_monitors,
    clip_by_norm_replaced,
    clip_by_value_on_local_tensors,
    toggles_by_model_parameters,
    zero_grad_before_training_step,
)
from .logged import TokenWeights, log_options, training_step_agreed, weighed_when_logged
from .resumable import ResumableDataMixin

__all__ = ["CPU_COLLECTIVE_TIMEOUT", "LayoutStrategy", "StartMethod", "resolve_collective_timeout"]

CPU_COLLECTIVE_TIMEOUT = timedelta(minutes=10)
"""The default collective timeout of CPU (gloo) runs; ``parallel.collective_timeout`` changes it."""


def resolve_collective_timeout(layout: ParallelConfig, given: timedelta | None, device_type: str) -> timedelta:
    """``parallel.collective_timeout`` (seconds), else the strategy's ``timeout`` argument, else
    :data:`CPU_COLLECTIVE_TIMEOUT` on CPU and Lightning's default (30 minutes) on accelerators; every strategy that
    builds a process group takes its timeout from here."""
    if layout.collective_timeout is not None:
        return timedelta(seconds=layout.collective_timeout)
    if given is not None:
        return given
    return CPU_COLLECTIVE_TIMEOUT if device_type == "cpu" else default_pg_timeout

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class LayoutStrategy(LayoutMixin, ResumableDataMixin, ParallelStrategy):
    """Base strategy: a parallel layout -> resolved degrees -> named DeviceMesh -> a parallelized module.

    Args:
        parallel: the layout (a ``ParallelConfig`` or a mapping with its keys); None = all ranks data parallel.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every Lightning
            strategy (the Trainer fills them from ``accelerator``/``devices``/``num_nodes``/``plugins``).
        process_group_backend: ``gloo``/``nccl``; None = the device's default (gloo on CPU, NCCL on CUDA).
        start_method: how Lightning starts the ranks: ``popen`` (re-runs the script, like ``torchrun``), ``spawn``,
            ``fork`` (cheapest inside an already-imported process; CPU only).
        timeout: timeout of every collective, so a failing rank cannot leave the others hanging forever; None: 10
            minutes on CPU (gloo), Lightning's 30 minutes on accelerators. ``parallel.collective_timeout`` (seconds,
            a recipe key) wins over it.
    """

    _nonfinite_guard: Any = None
    """The Trainer's non-finite-loss guard of the current fit (set when training starts)."""

    def __init__(
        self,
        parallel: ParallelConfig | dict[str, Any] | None = None,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: StartMethod = "popen",
        timeout: timedelta | None = None,
    ) -> None:
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method={start_method!r} is not one of ['popen', 'spawn', 'fork', 'forkserver'].")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method: StartMethod = start_method
        self._mesh: DeviceMesh | None = None
        self._fit_patches: contextlib.ExitStack | None = None
        self.composition: Composition | None = None
        self._train_step: TrainStep | None = None
        self._comm_counter: CommCounter | None = None
        self.init_layout(parallel)

    # ------------------------------------------------------------------ processes and devices
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def world_size(self) -> int:
        return self.layout_world_size  # known before any process starts (the cluster environment's comes later)

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning for ``self.log(..., sync_dist=True)`` and the distributed sampler: always True."""
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def mesh(self) -> DeviceMesh:
        """The named ``("dp", "pp", "tp")`` mesh; exists after the process group is set up."""
        if self._mesh is None:
            raise RuntimeError(f"{type(self).__name__}.mesh is built in setup_environment(); it does not exist yet.")
        return self._mesh

    def determine_device_ids(self) -> list[int] | None:
        """``device_ids`` for torch wrappers and NCCL barriers: None on CPU, this rank's device index on CUDA."""
        return None if self.root_device.type == "cpu" else [self.root_device.index]

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the accelerator sets up the root device
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (self._process_group_backend
                                       or _get_default_process_group_backend_for_device(self.root_device))
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend,
                              timeout=self.collective_timeout(), device_id=device_id)
        self._mesh = self.dims.build_mesh(self.root_device.type)
        # Lightning leaves the process group alive after fit (a script may go on to test). Tear it down before the
        # interpreter finalizes, so the backend's threads are joined in order rather than destroyed at exit.
        atexit.unregister(_destroy_process_group_at_exit)
        atexit.register(_destroy_process_group_at_exit)
        watchdog.start(rank=self.global_rank, world_size=self.world_size)  # heartbeat: names a lost rank on failure

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.dims.dp, "rank": self.coords.dp}

    # ------------------------------------------------------------------ context parallelism: this rank's tokens
    _attention_checked = False

    def attention_check(self) -> contextlib.AbstractContextManager[Any]:
        """With cp > 1, around the first step of the run (training, evaluation or prediction): an attention kernel
        the module calls outside the routed submodules of its plan is refused
        (:func:`~lightning_parallel.parallel.context_parallel.unrouted_attention_check`); then nothing (the check
        sees every torch call: once is enough for a module's structure)."""
        module = self.lightning_module
        if self.dims.cp == 1 or self._attention_checked or module is None or self.layout.compile:
            return contextlib.nullcontext()  # (torch.compile cannot trace a torch-function mode: not checked there)
        self._attention_checked = True
        from lightning_parallel.parallel.context_parallel import unrouted_attention_check

        plan = self.composition.context_plan if self.composition is not None else None
        return unrouted_attention_check(module, plan)  # type: ignore[no-any-return]

    def context_batch(self, batch: Any, *, complete: bool = True) -> Any:
        """``batch`` as this rank sees it: with cp > 1, the tensors of the module's ``context_parallel_plan()``
        cut to this rank's head and tail chunks along their sequence dims; otherwise ``batch`` itself. ``complete``
        False (an evaluation or prediction batch): an entry the plan names may be absent (no labels to predict)."""
        plan = self.composition.context_plan if self.composition is not None else None
        if plan is None:
            return batch
        from lightning_parallel.parallel.context_parallel import split_batch

        return split_batch(batch, plan, self._sequence_shard(), complete=complete)

    def context_token_share(self, batch: Any, *, optional: bool = False) -> Tensor | None:
        """With cp > 1 and a plan that names the labels: this rank's share of the whole ``batch``'s counted tokens,
        ``cp x n_rank / n_batch`` (:func:`~lightning_parallel.parallel.context_parallel.batch_token_share`), by
        which its loss and its mean-logged values are multiplied; None otherwise. A batch without the labels entry
        is refused (a training batch: checked before launch), or with ``optional`` (an evaluation batch) not
        weighed."""
        plan = self.composition.context_plan if self.composition is not None else None
        if plan is None or plan.labels is None:
            return None
        from lightning_parallel.parallel.context_parallel import batch_token_share

        try:
            return batch_token_share(batch, plan, self._sequence_shard())
        except ValueError:
            if optional:
                return None
            raise

    @property
    def loss_labels(self) -> Any:
        """The token labels the composed module's ``context_parallel_plan()`` names (a
        :class:`~lightning_parallel.parallel.context_parallel.ContextParallelPlan`, read once per module by
        :meth:`~lightning_parallel.strategies.resumable.ResumableDataMixin.token_labels` when it is composed), or
        None."""
        return self._labels

    def batch_share(self, batch: Any, *, optional: bool = False) -> Tensor | None:
        """This rank's share of the counted tokens of the global batch, by which its loss and its mean-logged values
        are multiplied: ``dp x cp x n_rank / N`` (``n_rank``: the labels this rank's loss counts, its cp chunks of its
        dp batch; ``N``: those of every dp rank's batch, summed over ``dp`` in one all-reduce of one number), so the
        mean over the replicas counts every token of the global batch once. None (no weighing) when the module
        names no labels or there is one replica. A batch without the labels entry is refused (a training batch:
        checked before launch), or with ``optional`` (an evaluation batch) not weighed. (A training step under
        automatic optimization sums ``N`` in its logged values' all-reduce instead: :meth:`batch_tokens`.)"""
        tokens = self.batch_tokens(batch, optional=optional)
        if tokens is None or tokens.count is None:
            return tokens.local if tokens is not None else None
        return tokens.share(self.sum_over_dp(tokens.count))

    def sum_over_dp(self, numbers: Tensor) -> Tensor:
        """``numbers`` summed over this rank's dp group (a new tensor; ``numbers`` itself with dp = 1): one
        all-reduce of control traffic, not counted as the layout's own communication."""
        if self.dims.dp == 1:
            return numbers
        total = numbers.clone()
        uncounted_all_reduce(total, group=self.mesh.get_group("dp"))
        return total

    def batch_tokens(self, batch: Any, *, optional: bool = False, window: tuple[int, int] | None = None
                     ) -> TokenWeights | None:
        """What this rank knows of the token weighing of ``batch`` before any collective
        (:class:`~lightning_parallel.strategies.logged.TokenWeights`): with cp only, its cp share ``cp x n_rank /
        n_batch`` (no count: nothing to sum); with dp > 1 or an accumulation window (``window``: this rank's counted
        tokens of the optimizer step's batches, read ahead, and how many batches the window holds) the multiplier
        ``dp x cp x n_rank``, the count ``n_batch`` of its whole batch and the window's, whose sums over dp divide
        it. None when nothing is weighed (see :meth:`batch_share`)."""
        labels, dp = self.loss_labels, self.dims.dp
        windowed = window is not None and window[1] > 1
        if labels is None or batch is None or (dp == 1 and self.dims.cp == 1 and not windowed):
            return None
        try:
            share = self.context_token_share(batch) if self.dims.cp > 1 else None
            if dp == 1 and not windowed:
                return None if share is None else TokenWeights(local=share)
            from lightning_parallel.parallel.context_parallel import counted_tokens

            count = counted_tokens(batch, labels)
        except ValueError:
            if optional:
                return None
            raise
        scaled = count * dp
        # dp x cp x n_rank: the cp share is cp x n_rank / n_batch (1 where the batch counts none: then 0 here)
        step = window if windowed else None
        return TokenWeights(local=scaled if share is None else share * scaled, count=count,
                            window=None if step is None else torch.full((1,), float(step[0]), device=count.device),
                            accumulation=1 if step is None else step[1], copies=self.dims.cp, dp=dp)

    def _sequence_shard(self) -> Any:
        from lightning_parallel.parallel.context_parallel import SequenceShard

        return SequenceShard(self.dims.cp, self.dims.coord(self.global_rank, "cp"))

    def _context_args(self, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                      labels: Literal["required", "optional", "none"] = "required"
                      ) -> tuple[tuple[Any, ...], dict[str, Any], Tensor | None]:
        """The step's arguments with this rank's part of the batch, and its token share (None: no weighting):
        ``labels`` ``required`` for a training batch, ``optional`` for an evaluation batch (one without labels is not
        weighed), ``none`` for a prediction."""
        batch = kwargs["batch"] if "batch" in kwargs else args[0] if args else None
        share = self.batch_share(batch, optional=labels == "optional") if labels != "none" else None
        return *self._local_args(args, kwargs, complete=labels == "required"), share

    def _local_args(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, complete: bool = True
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The step's arguments with this rank's part of the batch (:meth:`context_batch`)."""
        if "batch" in kwargs:
            return args, {**kwargs, "batch": self.context_batch(kwargs["batch"], complete=complete)}
        return ((self.context_batch(args[0], complete=complete), *args[1:]) if args else args), kwargs

    @contextlib.contextmanager
    def context_parallel_logging(self, share: Tensor | None = None) -> Generator[None, None, None]:
        """With cp > 1: tensors the module logs inside the block are averaged over ``dp x cp`` (each cp rank's value
        is a mean over its ``s / cp`` tokens, so their mean is the one-device value of the global batch; those logged
        with ``reduce_fx`` max, min or sum take the maximum, minimum or sum over the ranks instead -- a sum with
        ``sync_dist=True`` is left to Lightning, which sums it over the world; with
        ``share``, this rank's :meth:`batch_share`, those logged with a mean are weighed by it first, so the mean
        counts every token once however the ignored labels fall). A collective per logged tensor: every rank logs
        the same names in the same order. With cp = 1 and ``share`` (dp ranks weighing their counted tokens):
        values logged with ``sync_dist=True`` and a mean are weighed, and Lightning averages them over the ranks."""
        module = self.lightning_module
        cp = self.dims.cp
        if (cp == 1 and share is None) or module is None:
            yield None
            return
        from lightning_parallel.parallel.tensor.local import plain

        had = "log" in vars(module)
        original = module.log

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(value, Tensor) and value.is_floating_point():
                options = log_options(module, name, value, args, kwargs)
                if cp > 1:
                    value = plain(value).detach()  # combined by a collective here: its graph is not kept
                    op = logged_reduce_op(options.get("reduce_fx", "mean"))
                    if op == "sum" and options.get("sync_dist"):
                        pass  # Lightning sums the ranks' parts over the world: the whole sum
                    elif op in ("max", "min", "sum"):  # the extreme, the sum over every token (not a mean of them)
                        value = reduce_logged(value, group=self.train_step.dp_group, size=self.dims.replicas,
                                              reduce_fx=op)
                    else:
                        if share is not None and weighed_when_logged(options):
                            value = weigh(value, share)
                        value = self.train_step.reduce_mean(value)
                elif share is not None and options.get("sync_dist") and weighed_when_logged(options):
                    value = weigh(plain(value).detach(), share)  # Lightning's sync_dist takes the mean over dp
            original(name, value, *args, **kwargs)

        module.log = log  # type: ignore[method-assign]
        try:
            yield None
        finally:
            if had:
                module.log = original  # type: ignore[method-assign]
            else:
                del module.log

    def buffers_before_forward(self, *, training: bool) -> None:
        """torch DDP's rule for the module's buffers, for the layouts DDP does not wrap (ZeRO-1/2/3, tensor and
        pipeline parallelism over dp) and for manual optimization under every layout: before the first forward of
        a fit and the first forward after a backward whose gradients were synchronised over the replicas (the first
        forward of each optimizer step, the first validation forward after training), the buffers of the first
        replica are copied to the others
        (:meth:`~lightning_parallel.parallel.step.TrainStep.broadcast_buffers`), so that every replica validates,
        saves and trains on the same running statistics, as under ``lp_ddp``. During a fit only (a test or predict
        run starts from the same module on every rank, and its ranks may run different numbers of batches)."""
        step, module = self._train_step, self.lightning_module
        if step is None or module is None or module._trainer is None or module.trainer.state.fn != TrainerFn.FITTING:
            return
        # torch DDP's own forward copies them under automatic optimization; under manual optimization Lightning's
        # forward redirection turns that off after the first forward
        if self._buffers_due and not (step.plan.wraps_module and module.automatic_optimization):
            assert self.model is not None
            step.broadcast_buffers(self.model)
        self._buffers_due = False

    _buffers_due = True
    """A buffer copy is due before the next forward: at a fit's start, and after each backward whose gradients were
    synchronised over the replicas (:meth:`post_backward`)."""

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.buffers_before_forward(training=False)
        if self.dims.cp == 1 and (self.dims.dp == 1 or self.loss_labels is None):
            return super().validation_step(*args, **kwargs)
        args, kwargs, share = self._context_args(args, kwargs, labels="optional")
        with self.context_parallel_logging(share), self.attention_check():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.dims.cp == 1 and (self.dims.dp == 1 or self.loss_labels is None):
            return super().test_step(*args, **kwargs)
        args, kwargs, share = self._context_args(args, kwargs, labels="optional")
        with self.context_parallel_logging(share), self.attention_check():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """With cp > 1 the module predicts on this rank's tokens; tensor outputs that carry them (the split length
        along the batch's sequence dim) are gathered back over cp into the whole sequence, in order."""
        if self.dims.cp == 1 or self.composition is None or self.composition.context_plan is None:
            return super().predict_step(*args, **kwargs)
        from lightning_parallel.parallel.context_parallel import split_length

        args, kwargs, _ = self._context_args(args, kwargs, labels="none")
        local = kwargs["batch"] if "batch" in kwargs else args[0]
        local_len = split_length(local, self.composition.context_plan)  # along an entry the plan split
        with self.attention_check():
            out = super().predict_step(*args, **kwargs)
        return out if local_len is None else self.context_unshard(out, local_len=local_len)

    def _context_dim(self) -> int:
        plan = self.composition.context_plan if self.composition is not None else None
        if plan is None:
            return 1
        return plan.batch if isinstance(plan.batch, int) else next(iter(plan.batch.values()), 1)

    def context_unshard(self, out: Any, *, local_len: int) -> Any:
        """With cp > 1: the tensors of ``out`` that hold this rank's ``local_len`` tokens along the batch's sequence
        dim, gathered over cp into the whole sequence in order (a collective: every cp rank calls it)."""
        if self.dims.cp == 1:
            return out
        from lightning_utilities.core.apply_func import apply_to_collection

        from lightning_parallel.parallel.context_parallel import SequenceShard, unshard_sequence

        dim = self._context_dim()
        shard = SequenceShard(self.dims.cp, self.dims.coord(self.global_rank, "cp"))
        group = self.mesh.get_group("cp")
        return apply_to_collection(out, Tensor, lambda t: unshard_sequence(t, dim, shard, group)
                                   if t.dim() > dim and t.shape[dim] == local_len else t)

    # ------------------------------------------------------------------ the module: one composition
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """For every ``TrainerFn``: :meth:`parallelize` (the one composition); the optimizers when fitting."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:  # again in the rank: a module's configure_callbacks() adds its callbacks after the launch
            check_callbacks(self, trainer)
        if fitting and self._layer_sync:
            self.model = self.apply_layer_sync(self.model)
        self.precision_plugin.convert_module(self.model)
        assert trainer.state.fn is not None
        self.model = self.parallelize(self.model, trainer_fn=trainer.state.fn)
        self.metrics_over_replicas()
        if fitting:
            self.setup_optimizers(trainer)
            check_pipeline_monitors(self, trainer)  # the LR schedulers' monitors, now that they exist
        self.setup_precision_plugin()
        if fitting:
            self.agree_loss_scaler()
            _optimizers_to_device(self.optimizers, self.root_device)
            self._fit_patches = contextlib.ExitStack()
            for patch in self.fit_patches():
                self._fit_patches.enter_context(patch)

    def apply_layer_sync(self, model: nn.Module) -> nn.Module:
        """``Trainer(sync_batchnorm=True)``: Lightning's plugin converts every BatchNorm to torch's ``SyncBatchNorm``
        over the whole world; where the world holds tensor- or pipeline-parallel peers of each replica, the layers
        normalise over the replicas' group instead (``dp``, ``dp x cp``: the ranks that see different samples of
        the global batch, each with the same layers) -- over the world, a pipeline stage's statistics collective
        would wait on ranks of other stages that never call it. (GPUs only: ``SyncBatchNorm`` refuses CPU tensors,
        and the flag is refused on CPU before launch.)"""
        from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

        assert self._layer_sync is not None
        if self.world_size == self.dims.replicas or type(self._layer_sync) is not TorchSyncBatchNorm:
            return self._layer_sync.apply(model)  # the whole world, or a plugin of the user's own
        group = self.mesh.get_group(self.dims.replica_axis)
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)

    @override
    def on_validation_start(self) -> None:
        """The dp ranks' validation batch counts must agree where a validation batch runs a collective over them
        (:meth:`_check_even_eval_batches`)."""
        super().on_validation_start()
        trainer = self._trainer_or_none()
        if trainer is not None:  # (in a fit's sanity check already: its counts are the whole validation's)
            self._check_even_eval_batches("validation", trainer.num_val_batches,
                                          "fit" if trainer.state.fn == TrainerFn.FITTING else "validate")

    @override
    def on_test_start(self) -> None:
        """As :meth:`on_validation_start`, for the test batches."""
        super().on_test_start()
        trainer = self._trainer_or_none()
        if trainer is not None:
            self._check_even_eval_batches("test", trainer.num_test_batches, "test")

    @override
    def on_predict_start(self) -> None:
        """Under FSDP2 over ``dp`` (ZeRO-3; ZeRO-2 in a pipeline; HSDP) every forward all-gathers over the dp ranks,
        so they must run the same number of batches; Lightning's predict sampler splits a dataset without padding
        (9 samples in batches of 2 over 2 ranks: 3 batches and 2), and the ranks' gathers then mismatch (gloo:
        "Received data size doesn't match expected size"; NCCL: a hang). Refused here, on every rank alike, with the
        counts and the fix (:meth:`_check_even_eval_batches`)."""
        super().on_predict_start()
        trainer = self._trainer_or_none()
        if trainer is not None:
            self._check_even_eval_batches("predict", trainer.num_predict_batches, "predict", fsdp_only=True)

    def _trainer_or_none(self) -> pl.Trainer | None:
        module = self.lightning_module
        return module.trainer if module is not None and module._trainer is not None else None

    def _check_even_eval_batches(self, stage: str, counts: list[int | float], fn: str, *,
                                 fsdp_only: bool = False) -> None:
        """Every dp rank must run as many ``stage`` batches of each dataloader as the others where each batch runs a
        collective over them: FSDP2's all-gathers in every forward (ZeRO-3; ZeRO-2 in a pipeline; HSDP), and --
        validation and test, where the module names its token labels (or with context parallelism) -- the sum of
        the batch's counted tokens over the replicas that weighs its loss. A rank with a batch more than another
        waited in that collective until the collective timeout (Lightning's validation and test samplers pad a
        dataset to equal counts; a sampler of the user's, or Lightning's predict sampler, may not). Refused on
        every rank alike, with the counts and the fix: one all-reduce of two numbers per dataloader. Counts not
        known ahead (an iterable dataset) are not checked."""
        if self.dims.dp == 1 or self._train_step is None:
            return
        fsdp = self.train_step.plan.sync == "fsdp"
        weighed = not fsdp_only and (self.dims.cp > 1 or self.loss_labels is not None)
        if not (fsdp or weighed):
            return
        local = [int(c) if math.isfinite(c) else -1 for c in counts]
        if not local:
            return
        both = torch.tensor(local + [-c for c in local], dtype=torch.int64, device=self.root_device)
        group = self.mesh.get_group(self.dims.replica_axis if weighed else self.dims.fsdp_axes[-1])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        n = len(local)
        most, fewest = both[:n].tolist(), [-v for v in both[n:].tolist()]
        uneven = [(i, low, high) for i, (low, high) in enumerate(zip(fewest, most, strict=True))
                  if low >= 0 and low != high]
        if not uneven:
            return
        i, low, high = uneven[0]
        where = f" (dataloader {i})" if n > 1 else ""
        why = ("FSDP2 all-gathers the parameters in every forward" if fsdp else
               "each batch's loss is weighed by its share of the counted tokens, summed over the ranks in every "
               "batch (the module names its token labels)")
        # a layout without FSDP2 that this strategy runs: ZeRO-2 is FSDP2 in pipelines and under HSDP, and lp_tensor
        # runs zero_stage 0, 1 or 3
        whole = "zero_stage 0 or 1" if self.pipelined or self.dims.tp > 1 or self.dims.hsdp else "zero_stage 1 or 2"
        if self.dims.hsdp:
            whole += " without data_parallel_shard_size"
        fix = (f"predict under lp_ddp / {whole} (whole parameters on each rank), or on one device" if
               stage == "predict" else
               "use_distributed_sampler=True (Lightning's sampler pads the set to equal counts), or evaluate on one "
               "device")
        raise LayoutError(
            f"trainer.{fn} under {self.describe()}: the data-parallel ranks would run {low} to {high} {stage} "
            f"batches{where}, and {why}, so a rank with a batch more would wait on the others. Fix: a dataset whose "
            f"length splits into the same number of batches on each of the {self.dims.dp} ranks, or {fix}.")

    def metrics_over_replicas(self) -> None:
        """torchmetrics ``Metric`` modules of the LightningModule sync their states over the whole world unless given a
        process group; the tensor- and pipeline-parallel peers of one model replica see the same batches, so a sum,
        a count or a concatenation came out once per peer (a count of samples seen: 20 for one device's 10 under
        tp=2). Each metric without a group of its own syncs over the model's replicas (``dp``, or ``dp x cp``)
        instead. Metrics made after ``setup`` are the user's to give that group
        (``trainer.strategy.mesh.get_group(trainer.strategy.dims.replica_axis)``)."""
        module = self.lightning_module
        if module is None or self.world_size == self.dims.replicas:
            return
        try:
            from torchmetrics import Metric
        except ImportError:
            return
        group = self.mesh.get_group(self.dims.replica_axis)
        for metric in module.modules():
            if isinstance(metric, Metric) and metric.process_group is None:
                metric.process_group = group

    def fit_patches(self) -> list[contextlib.AbstractContextManager[Any]]:
        """Context managers held open from the end of ``setup`` (fitting) to ``teardown``: by default, Lightning's
        ``gradient_clip_val`` (by norm) clips by the norm of the whole model's gradient
        (:meth:`~lightning_parallel.parallel.step.TrainStep.clip_grad_norm_`); under a pipeline and where FSDP2 shards
        the module, the loop's zero-grad runs in front of ``training_step``
        (:func:`~lightning_parallel.strategies.layout.zero_grad_before_training_step`)."""
        original = self.precision_plugin.clip_grad_by_norm

        def clip(optimizer: Optimizer, clip_val: float) -> None:
            if self.train_step.clip_grad_norm_(optimizer, clip_val) is None:
                original(optimizer, clip_val)  # whole gradients (DDP) or globally-normed DTensors (FSDP2)

        patches: list[contextlib.AbstractContextManager[Any]] = [clip_by_norm_replaced(self.precision_plugin, clip),
                                                                 clip_by_value_on_local_tensors(self.precision_plugin)]
        module = self.lightning_module
        if module is not None and any(callable(getattr(o, "model_parameters", None)) for o in self.optimizers):
            patches.append(toggles_by_model_parameters(module, lambda: self.optimizers))
        if module is not None and (self.pipelined or self.layout.runs_fsdp2):
            patches.append(zero_grad_before_training_step(module.trainer,
                                                          required=self.strategy_name if self.pipelined else None))
        if self._comm_counter is not None:
            self._comm_counter.dims, self._comm_counter.rank = self.dims, self.global_rank
            patches.append(self._comm_counter.counting())
        return patches

    def agree_loss_scaler(self) -> None:
        """Under ``16-mixed`` (Lightning's gradient scaler), where the gradients the scaler checks for inf/NaN differ
        from rank to rank -- ZeRO's shards over ``dp`` (the flat ZeRO-1/2 shard, FSDP2's), tp's shards, a pipeline's
        stages: replace the scaler by :class:`~lightning_parallel.parallel.scaler.AgreedGradScaler` over every rank,
        with the same settings and state. Its check is all-reduced (one all-reduce of a flag per optimizer step,
        in ``unscale_`` or in a fused optimizer's step), so every rank skips or takes the optimizer step alike and the
        scales stay equal; it reads a ``DTensor`` gradient's local shard (torch's own scaler refuses the mix of
        ``DTensor`` and plain gradients a tensor-parallel model has). With each rank's own check, a rank whose
        gradients overflowed would skip the step while the others took it: the flat ZeRO's all-gather of the updated
        shards then waits for it until the collective timeout. Nothing changes where every rank holds the same whole
        gradients (DDP, context parallelism), on one rank, or without a scaler (``32-true``, ``bf16-mixed``). A
        scaler of another class than torch's own (a subclass with behaviour of its own) is refused: the swap would
        drop that behaviour, keeping it would leave the check unagreed; the error names the fix."""
        from lightning_parallel.parallel.scaler import AgreedGradScaler

        scaler = getattr(self.precision_plugin, "scaler", None)
        if not isinstance(scaler, torch.amp.GradScaler) or isinstance(scaler, AgreedGradScaler):
            return
        if not scaler.is_enabled() or self.world_size == 1:
            return
        if self.layout.zero == 0 and self.dims.tp == 1 and self.dims.pp == 1 and not self.pipelined:
            return
        if type(scaler) not in (torch.amp.GradScaler, torch.cuda.amp.GradScaler):
            raise ValueError(
                f"the precision plugin's gradient scaler is a {type(scaler).__qualname__}; under "
                f"{self.strategy_name} ({self.layout.describe()}) the ranks hold different gradients, so the scaler's "
                "inf/NaN check must be agreed over every rank, which the library does by replacing torch's GradScaler "
                "with lightning_parallel.parallel.scaler.AgreedGradScaler -- and a subclass's own behaviour would be "
                "lost. Fix: derive the scaler from AgreedGradScaler (same constructor, plus process_group), or pass "
                "torch.amp.GradScaler itself.")
        agreed = AgreedGradScaler(device=self.root_device.type, process_group=dist.group.WORLD)
        agreed.load_state_dict(scaler.state_dict())
        self.precision_plugin.scaler = agreed  # type: ignore[attr-defined]

    skips_nonfinite_steps = True
    """A ``NonFiniteLossGuard(action="skip")`` can skip this strategy's optimizer step (:meth:`optimizer_step`)."""

    pipelined = False
    """Cut the module into pipeline stages (``lp_pipeline``, ``lp_hybrid``), even a one-stage pipeline."""

    def data_parallel_plan(self) -> DataParallelPlan:
        """How the dp replicas are wrapped and synced for this layout (subclasses add their options: DDP's
        buckets, the fairscale backend). A pipeline of one stage over dp (``pipeline_parallel_size=1``) all-reduces
        its gradients after the step's last backward instead of wrapping the module in torch DDP: the schedule calls
        the stage modules, never the wrapper's forward, so DDP's reducer averaged nothing (each replica trained on
        its own gradient)."""
        plan = data_parallel_plan(self.layout, self.dims)
        if self.pipelined and plan.wraps_module:
            return dataclasses.replace(plan, sync="allreduce", ddp_options={})
        return plan

    def precision_plan(self, plan: DataParallelPlan) -> DataParallelPlan:
        """The data-parallel plan with the run's precision: under ``bf16-mixed``, FSDP2 (``sync="fsdp"``) takes
        its ``MixedPrecisionPolicy`` -- parameters all-gathered and computed in bf16, gradients reduce-scattered in
        fp32, the fp32 shards stepped by the optimizer (Lightning's autocast still runs around the step). Other
        precisions and plans: unchanged (``bf16-true`` parameters are bf16 already)."""
        if plan.sync == "fsdp" and getattr(self.precision_plugin, "precision", None) == "bf16-mixed":
            return dataclasses.replace(plan, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return plan

    def parallelize(self, model: nn.Module, *, trainer_fn: TrainerFn) -> nn.Module:
        """The one composition (:func:`~lightning_parallel.parallel.compose.compose`: pipeline split -> placement ->
        tensor plan -> context parallel -> activation checkpointing -> compile -> data-parallel wrap) of ``model`` for
        this rank, and the train step that goes with it. Called in ``setup`` for fit, validate, test and predict alike
        (a module composed by an earlier call of this process is reused); returns what the loops call."""
        composition = self.compose_module(model, fitting=trainer_fn == TrainerFn.FITTING)
        return composition.module

    def compose_module(self, model: nn.Module, *, fitting: bool = True) -> Composition:
        """Compose ``model`` for this rank (:func:`~lightning_parallel.parallel.compose.compose`) and build
        :attr:`train_step` for it."""
        composition = compose(model, layout=self.layout, dims=self.dims, rank=self.global_rank, mesh=self.mesh,
                              device=self.root_device, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
                              data_parallel=self.precision_plan(self.data_parallel_plan()), fitting=fitting,
                              pipeline=self.pipelined)
        self.composition = composition
        self._labels_of = None  # read again for each composition; the step (loss_labels) and the read-ahead share it
        self.token_labels(model)
        self._train_step = TrainStep(composition.data_parallel, dims=self.dims, mesh=self.mesh)
        self._buffers_due = True  # torch DDP copies the buffers at a fit's first forward
        self._first_batch_checked = False
        return composition

    @property
    def train_step(self) -> TrainStep:
        """The step-time data-parallel work of the composed module (exists after :meth:`parallelize`)."""
        if self._train_step is None:
            raise RuntimeError(f"{type(self).__name__}.train_step is built in setup(); it does not exist yet.")
        return self._train_step

    # ------------------------------------------------------------------ the one train step
    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning builds the module's optimizers and schedulers; ZeRO wraps them over ``dp`` (the user's
        optimizer objects stay, so schedulers stay bound to them)."""
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.model is not None
        self.train_step.check_optimizers(self.optimizers, describe=self.describe())
        self.optimizers, self.model = self.train_step.wrap_optimizers(self.optimizers, self.model)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``training_step`` on this rank's part of the batch (with context parallelism: its head and
        tail chunks of the sequence); the values it logs are combined over the model's replicas (``dp``, ``dp x cp``)
        first, so the logged curve is one device's (:mod:`lightning_parallel.strategies.logged`). In a multi-rank run
        the non-finite guard's agreement rides in that all-reduce, then over every rank (tp peers hold the same
        values): one collective per batch for both. When the module names its token labels, the step's loss is
        weighed by this rank's share of the optimizer step's counted tokens and its mean-logged values by its share
        of the global batch's (:meth:`batch_tokens`; the counts summed over dp in that same all-reduce, the step's
        read ahead by the training loader: :attr:`step_tokens`), so every counted token weighs as on one device.
        (Under manual optimization the loss ``manual_backward`` is given inside the step is weighed, so the count
        is summed before the step: one all-reduce of one number more.)"""
        self.buffers_before_forward(training=True)
        replicas = self.dims.replicas
        guard = self._agreeing_guard()
        reduce: Any = None
        world = guard is not None and replicas != self.world_size
        if guard is not None:  # the logged values and the guard: one world all-reduce
            reduce = self.train_step.reduce_logged_world if world else self.train_step.reduce_logged_batch
        elif replicas > 1:
            reduce = self.train_step.reduce_logged_batch
        module = self.lightning_module
        manual = module is not None and not module.automatic_optimization
        tokens: TokenWeights | None = None
        window = self.step_tokens.take() if self.step_tokens is not None else None  # one per training batch
        if self.dims.cp > 1 or (self.loss_labels is not None and (self.dims.dp > 1 or window is not None)):
            batch = kwargs["batch"] if "batch" in kwargs else args[0] if args else None
            if manual:  # manual_backward inside the step: the whole weight is needed before it
                share = self.batch_share(batch)
                tokens = None if share is None else TokenWeights(local=share)
            else:
                tokens = self.batch_tokens(batch, window=window)
                if world and tokens is not None and tokens.count is not None:  # each batch's count on all its peers
                    tokens = dataclasses.replace(tokens, copies=self.world_size // self.dims.dp)
            args, kwargs = self._local_args(args, kwargs)
        self._manual_share = tokens.local if manual and tokens is not None else None  # weighed in backward
        try:
            with self.attention_check():
                return training_step_agreed(module, lambda: super(LayoutStrategy, self).training_step(*args, **kwargs),
                                            reduce, guard, tokens=tokens)
        finally:
            self._manual_share = None

    _manual_share: Tensor | None = None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each training batch, after the callbacks' batch-start hooks: a torch DDP wrapper whose module's set
        of trainable parameters changed since it was built (``BackboneFinetuning`` unfreezing a backbone) is built
        again, so that every trainable parameter's gradient is averaged over the replicas
        (:func:`~lightning_parallel.parallel.compose.rewrap_if_trainable_changed`)."""
        super().on_train_batch_start(batch, batch_idx)
        if not self._first_batch_checked:
            self._first_batch_checked = True
            self.check_first_batch(batch)
        model = self.model
        if model is None or self._train_step is None:
            return
        rewrapped = rewrap_if_trainable_changed(model, plan=self.train_step.plan, mesh=self.mesh)
        if rewrapped is not model:
            self.model = rewrapped
            if self.composition is not None and self.composition.module is model:
                self.composition.module = rewrapped  # the old wrapper and its reducer are dropped
            self.ddp_rewrapped(rewrapped)

    _first_batch_checked = False

    def check_first_batch(self, batch: Any) -> None:
        """Once per fit, at the first training batch: every rank's batch described by a fingerprint (each tensor's
        shape, dtype and a digest of its bytes), gathered over the world (one ``all_gather_object``). The ranks of one
        model replica (its tensor-, pipeline- and context-parallel peers) must hold the same batch: a dataset that
        splits itself by the global rank (an ``IterableDataset`` reading ``torch.distributed.get_rank()``), or random
        augmentation seeded per process, gave tp peers different inputs and a pipeline's last stage another rank's
        labels, silently (2.3e-02 from one device after 4 steps at tp2 and pp2). Refused on every rank alike. Where
        the data-parallel replicas all hold the same batch, each would train on the same samples (a dataset that
        does not split itself, ``use_distributed_sampler=False`` without a ``DistributedSampler``): warned."""
        if self.world_size == 1 or not _distributed_is_initialized():
            return
        from lightning_utilities.core.apply_func import apply_to_collection

        leaves: list[Tensor] = []
        apply_to_collection(batch, Tensor, leaves.append)
        mine = [(tuple(t.shape), str(t.dtype), _fingerprint(t)) for t in leaves]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        dims = self.dims
        for rank, seen in enumerate(every):
            replica = dims.coord(rank, "dp")
            first = dims.rank_of((replica, 0, 0))  # the replica's first rank
            if seen != every[first]:
                raise LayoutError(
                    f"{self.describe()}: the first training batch differs between global ranks {first} and {rank}, "
                    f"which belong to one model replica (data-parallel rank {replica}) and must read the same batch: "
                    "tensor-parallel peers compute one layer together, a pipeline's last stage scores the first "
                    "stage's inputs with its own labels. A dataset that splits itself by the global rank (an "
                    "IterableDataset reading torch.distributed.get_rank()) or random augmentation seeded per process "
                    "(Lightning's seed_everything(workers=True) seeds each DataLoader worker from the global rank) "
                    "does this. Fix: split by the data-parallel coordinates, "
                    "trainer.strategy.distributed_sampler_kwargs (num_replicas, rank), and seed any randomness of "
                    "the data by them (a worker_init_fn that seeds from that rank and the worker id).")
        firsts = [every[dims.rank_of((d, 0, 0))] for d in range(dims.dp)]
        if dims.dp > 1 and firsts[0] and all(f == firsts[0] for f in firsts):
            rank_zero_warn(
                f"{self.describe()}: the first training batch is the same on all {dims.dp} data-parallel replicas, so "
                "each would train on the same samples (a dataset that does not split itself -- an IterableDataset --, "
                "or use_distributed_sampler=False without a DistributedSampler). Split the data by "
                "trainer.strategy.distributed_sampler_kwargs (num_replicas, rank), or let Lightning add its sampler.")

    def ddp_rewrapped(self, model: nn.Module) -> None:
        """After :meth:`on_train_batch_start` built the DDP wrapper again: what the strategy adds to a new wrapper
        (``lp_ddp``: its comm hook)."""
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        rank_zero_info(f"{self.strategy_name}: the module's trainable parameters changed (now {trainable:,} of "
                       f"{total:,} elements); DDP was built again over them, so that every trainable parameter's "
                       "gradient is averaged over the replicas.")

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward; under manual optimization with context parallelism and the plan's labels, the
        loss ``manual_backward`` is given is weighed by this rank's token share first (under automatic optimization
        the step's returned loss is, in :meth:`training_step`)."""
        if self._manual_share is not None:
            from lightning_parallel.parallel.tensor.local import plain

            closure_loss = weigh(plain(closure_loss), self._manual_share)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _agreeing_guard(self) -> Any:
        """The non-finite-loss guard when the ranks agree on it in the step's own all-reduce (a multi-rank run with
        the check on), else None."""
        guard = self._nonfinite_guard
        return guard if self.world_size > 1 and guard is not None and guard.action != "off" else None

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-batch: gradients stay local (no dp sync) until the step's last backward."""
        assert self.model is not None
        with self.train_step.no_sync(self.model):
            yield None

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Before a backward: the step's last reduces ZeRO-2's gradient chunks as it completes them."""
        super().pre_backward(closure_loss)
        self.train_step.prepare_gradients(self.optimizers)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """The step's last backward: the dp gradient sync (before Lightning's clipping, which must see it)."""
        super().post_backward(closure_loss)
        assert self.model is not None
        self.train_step.sync_gradients(self.model, self.optimizers)
        if not self.train_step.accumulating:
            self._buffers_due = True  # (buffers_before_forward)

    @property
    def accumulate_grad_batches(self) -> int:
        """The Trainer's ``accumulate_grad_batches`` (1 outside a Trainer)."""
        module = self.lightning_module
        if module is None or module._trainer is None:
            return 1
        return int(module.trainer.accumulate_grad_batches)

    # ------------------------------------------------------------------ measurement, off the hot path
    @property
    def comm_counter(self) -> CommCounter | None:
        """The communication counter of this run, or None (the default: a step runs no counting code)."""
        return self._comm_counter

    def count_communication(self) -> CommCounter:
        """Count every collective this rank issues while fitting, by kind and mesh axis
        (:class:`~lightning_parallel.parallel.counters.CommCounter`); call before ``fit`` (the ``ZeroStats``
        callback does). Returns the counter."""
        if self._comm_counter is None:
            self._comm_counter = CommCounter()
        return self._comm_counter

    def collective_timeout(self) -> timedelta:
        """How long a collective waits for a peer: ``parallel.collective_timeout`` (seconds), else the ``timeout``
        argument, else :data:`CPU_COLLECTIVE_TIMEOUT` on CPU (a stuck gloo rank is found in minutes, not half an
        hour) and Lightning's default (30 minutes) on accelerators."""
        return resolve_collective_timeout(self.layout, self._timeout, self.root_device.type)

    @override
    def on_train_start(self) -> None:
        """The RNG states of a resumed checkpoint are set here, after the training iterator exists
        (:func:`~lightning_parallel.checkpoint.rng.restore_rng_states`)."""
        from lightning_parallel.callbacks.nonfinite import install as install_nonfinite_guard
        from lightning_parallel.checkpoint.rng import apply_restored_rng_states

        super().on_train_start()
        apply_restored_rng_states()
        if self.lightning_module is not None:
            guard = self._nonfinite_guard = install_nonfinite_guard(self.lightning_module.trainer)
            interrupts.install(self.lightning_module.trainer,
                               request_stop=guard.request_stop if guard.agrees_on_preemption else None)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step; a step the :class:`~lightning_parallel.callbacks.NonFiniteLossGuard` skips
        (``action="skip"``: the loss was not finite on some rank, agreed on every rank) ends before the update; under
        ``16-mixed`` the gradient scaler records the skip
        (:func:`~lightning_parallel.parallel.scaler.after_skipped_step`)."""
        from lightning_parallel.callbacks.nonfinite import SkippedStep
        from lightning_parallel.parallel.scaler import after_skipped_step

        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        except SkippedStep:
            after_skipped_step(getattr(self.precision_plugin, "scaler", None), optimizer)
            return None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's one-file save (rank 0 writes), with every rank's RNG states added (a collective;
        :mod:`lightning_parallel.checkpoint.formats.lightning_file`)."""
        from lightning_parallel.checkpoint.formats import lightning_file

        lightning_file.save(self, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Any checkpoint the library writes, under any layout: read into the one-device form (whole weights,
        per-index optimizer state, loops) by :func:`~lightning_parallel.checkpoint.resume.read_resumable`, with
        ``torch.load(weights_only=True)``; the strategy's ``load_*_state_dict`` re-shard it for this layout."""
        from lightning_parallel.checkpoint.resume import resume_one_device

        return resume_one_device(self, self.broadcast(str(checkpoint_path)))

    @override
    def model_to_device(self) -> None:
        """Not called by :meth:`setup` (placement is a step of the composition, after the pipeline split)."""
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def teardown(self) -> None:
        """Unwrap the model (the LightningModule stays what the user holds), revert SyncBatchNorm, drop the mesh and
        the process's context-parallel state (the routed attention runs its own forward again)."""
        from lightning_parallel.parallel.context_parallel import deactivate

        deactivate()
        watchdog.stop()
        interrupts.uninstall()
        if self._fit_patches is not None:
            self._fit_patches.close()
            self._fit_patches = None
        module = self.lightning_module
        if module is not None and self.model is not module:
            self.model = module
        if (module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
                and self._layer_sync):
            assert self.model is not None
            self.model = self._layer_sync.revert(self.model)
        from lightning_parallel.parallel.pipeline import has_meta_tensors

        if module is None or not has_meta_tensors(module):
            super().teardown()
        else:  # a run refused before its ranks started: Lightning's move to the CPU would raise over the refusal
            with _methods_replaced(module, cpu=lambda: module):
                super().teardown()
        self._mesh = None

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A failed collective: print which rank is gone (:mod:`~lightning_parallel.parallel.faults.watchdog`); on the
        process that started the other ranks, end those that do not stop by themselves (a frozen rank)."""
        watchdog.on_exception(exception)
        super().on_exception(exception)
        watchdog.end_started_ranks(self._launcher, exception)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=self.determine_device_ids())
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> Tensor | Any:
        """Reduce over the world (or ``group``); non-tensors pass through (``self.log(..., sync_dist=True)`` comes
        here). Over the world, the ranks of one model replica -- its tensor- and pipeline-parallel peers -- see the
        same batch and so log the same values: a sum (``reduce_fx="sum"``) counts each replica once, the world's sum
        divided by those copies, as one device sums the replicas' batches; a mean, max or min is the same either
        way. A DTensor value (one computed from a ZeRO-3 or tensor-parallel parameter) is reduced as its whole
        tensor."""
        if not isinstance(tensor, Tensor):
            return tensor
        from lightning_parallel.parallel.tensor.local import plain

        out = _sync_ddp_if_available(plain(tensor), group, reduce_op=reduce_op)  # a DTensor value: its whole tensor
        copies = self.world_size // self.dims.replicas if group is None else 1
        if copies > 1 and _is_sum(reduce_op):  # in place, as the all-reduce is: the tensor given holds the result too
            out = out.div_(copies) if out.is_floating_point() or out.is_complex() else out.floor_divide_(copies)
        return out

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank's vote counts (``ModelCheckpoint`` and ``EarlyStopping`` agree this way): a sum over the whole
        world, not :meth:`reduce`'s per-replica one."""
        votes = torch.tensor(int(decision), device=self.root_device)
        total = _sync_ddp_if_available(votes, None, reduce_op="sum")
        return bool(total == self.world_size) if all else bool(total)


def _is_sum(reduce_op: ReduceOp | str | None) -> bool:
    """Lightning's reading of a reduce op: None and "sum" (any case) sum, as ``ReduceOp.SUM``."""
    if reduce_op is None:
        return True
    if isinstance(reduce_op, str):
        return reduce_op.lower() == "sum"
    return reduce_op == ReduceOp.SUM


def _destroy_process_group_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _fingerprint(t: Tensor) -> str:
    """A digest of the tensor's bytes (exact: equal tensors, NaN included, give equal digests); a sparse tensor by its
    coalesced indices and values; a tensor whose bytes cannot be read this way (nested, quantized) by its layout
    only."""
    import hashlib

    t = t.detach()
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
        return _fingerprint(t.indices()) + _fingerprint(t.values())
    if t.layout != torch.strided or t.is_nested or t.is_quantized:
        return str(t.layout)
    data = t.contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()
