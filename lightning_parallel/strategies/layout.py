"""``LayoutMixin``: the layout machinery every strategy of the library shares, whatever Lightning base it sits on.

A strategy that takes a layout holds a :class:`~lightning_parallel.config.ParallelConfig` (as given and with its
preset filled in), resolves it against the world size (``devices x num_nodes``) into
:class:`~lightning_parallel.parallel.dims.ParallelDims` when Lightning configures the launcher -- in
``Trainer.__init__``, before any process exists -- and refuses what it does not run with the key, the value and the
fix, naming only strategies that exist (:mod:`lightning_parallel.layouts`). The module is checked against the layout
(heads % tp, layers >= pp, vocab % tp) by the checked launchers below, again before any process starts.

:class:`~lightning_parallel.strategies.base.LayoutStrategy` (on Lightning's ``ParallelStrategy``) and
``lp_zero_offload`` (on Lightning's ``DeepSpeedStrategy``) both use it.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_parallel.config import LayoutError, ParallelConfig, check_model_compat
from lightning_parallel.layouts import refusal
from lightning_parallel.parallel.dims import ParallelDims, RankCoords
from lightning_parallel.parallel.faults.watchdog import enable_fault_handler

__all__ = [
    "CKPT_KEYWORDS",
    "LAUNCH_NOTES_ONLY",
    "CheckedMultiProcessingLauncher",
    "CheckedSubprocessLauncher",
    "LayoutMixin",
    "RanksPreempted",
    "TrainingDataProbe",
    "check_batch_size_finder",
    "check_callbacks",
    "check_ckpt_path",
    "check_context_batch",
    "check_context_labels",
    "check_data_modules",
    "check_detect_anomaly",
    "check_evaluation_ckpt",
    "check_evaluation_data",
    "check_finetuning_callbacks",
    "check_layer_sync",
    "check_meta_module",
    "check_nonfinite_guard",
    "check_output_dirs",
    "check_overfit_batches",
    "check_pipeline_monitors",
    "check_weight_averaging_callbacks",
    "clip_by_norm_replaced",
    "clip_by_value_on_local_tensors",
    "configured_optimizers",
    "data_parallel_size",
    "launch_environment_refusal",
    "oversubscription_warning",
    "own_functions",
    "preflight",
    "report_interrupted_saves",
    "toggles_by_model_parameters",
    "zero_grad_before_training_step",
]


class LayoutMixin:
    """The layout, its preset, its resolution against the world size, and the refusals before spawn.

    Subclasses set :attr:`strategy_name` (its row of the layout table says which layouts it runs), :attr:`preset`
    (what the strategy fills into keys the layout leaves unset) and extend :meth:`check_layout` with rules of their
    own. The host Lightning strategy supplies ``num_nodes`` and ``num_processes``.
    """

    strategy_name = "lp_layout"
    preset: dict[str, Any] = {}
    """Values for the keys a layout leaves unset (``zero_stage``, ``offload``): what "not set" means here."""
    shape_checks: tuple[str, ...] = ("n_layer", "n_head", "vocab_size")
    """Which ``parallel_shape()`` facts :meth:`check_module` checks the layout against (a pipeline checks its exact
    layer count itself: the embedding and head are pipeline layers too)."""
    pinned: dict[str, Any] = {}
    """Keys fixed by the strategy's own arguments (a preset name such as ``lp_zero1`` or ``lp_zero3_offload``): a
    layout that sets one of them to another value is refused."""

    if TYPE_CHECKING:  # supplied by the host Lightning strategy
        num_nodes: int

        @property
        def num_processes(self) -> int: ...

        @property
        def global_rank(self) -> int: ...

    def init_layout(self, parallel: ParallelConfig | dict[str, Any] | None) -> None:
        """Take the layout (constructor and :meth:`set_layout`): keep it as given, fill the preset, check it."""
        given = ParallelConfig.from_dict(parallel)
        for key, wanted in self.pinned.items():
            have = getattr(given, key)
            if have is not None and have != wanted:
                raise LayoutError(
                    f"the layout says parallel.{key}={have!r} but the strategy preset says {key}={wanted!r} "
                    f"({self.strategy_name} was built with it). Fix: keep one: the layout's value counts, so drop "
                    f"the strategy's {key} argument, or use the preset name that matches the layout."
                )
        layout = given.with_preset(**self.preset)
        self.check_layout(layout)
        self._explicit_layout = given
        self._layout = layout
        self._dims: ParallelDims | None = None
        self.launch_note: str | None = None

    @property
    def layout(self) -> ParallelConfig:
        """The layout that runs: as given, with the keys it left unset filled by the strategy's preset."""
        return self._layout

    @property
    def explicit_layout(self) -> ParallelConfig:
        """The layout as given (``parallel=`` or the CLI's section), before the preset filled unset keys."""
        return self._explicit_layout

    def set_layout(self, parallel: ParallelConfig | dict[str, Any]) -> None:
        """Replace the layout (the CLI's ``parallel`` section); only before the Trainer is built."""
        self.init_layout(parallel)

    def _configure_launcher(self) -> None:
        """Lightning's hook, in ``Trainer.__init__`` before any process exists: resolve the layout against the world
        size (refused with the arithmetic when it does not fit), then the checked launcher of the start method."""
        self.resolve_dims()
        self.check_launch()
        environment = getattr(self, "cluster_environment", None)
        assert environment is not None
        start_method: Any = getattr(self, "_start_method", "popen")
        launcher: Any
        if start_method == "popen":
            launcher = CheckedSubprocessLauncher(self, environment, self.num_processes, self.num_nodes)
        else:
            launcher = CheckedMultiProcessingLauncher(self, start_method=start_method)
        self._launcher = launcher

    def check_launch(self) -> None:
        """More refusals in ``Trainer.__init__``, once the Trainer's plugins are set (subclasses: e.g. a precision
        the engine cannot honour). Nothing by default."""

    def check_layout(self, layout: ParallelConfig) -> None:
        """Refuse, before anything starts, a layout outside this strategy's row of the layout table
        (:func:`lightning_parallel.layouts.refusal`: the key, the value, what the strategy runs and the strategy that
        runs the layout). Subclasses add only their own rules."""
        why = refusal(self.strategy_name, layout, preset=self.preset)
        if why:
            raise LayoutError(why)
        if layout.reduce_each_batch and getattr(self, "pipelined", False):
            raise LayoutError(
                f"parallel.reduce_each_batch=true: {self.strategy_name} runs every batch through its pipeline "
                "schedule, which reduces each batch's gradient already (at any pipeline_parallel_size). Fix: remove "
                "it.")

    def check_module(self, module: pl.LightningModule) -> None:
        """Refuse, before spawning, a module whose shape does not fit the layout (heads % tp, layers >= pp), or that
        lacks the hook its activation checkpointing or ``compile`` needs (the error names the hook); the module's
        own ``check_parallel_layout``; with context parallelism, one without ``context_parallel_plan()`` (the error
        shows a minimal one) or whose attention cannot be split (parameters, attention dropout, a non-causal mask).
        Submodules the user compiled are unwrapped first (compiled in place), so every name checked here and used
        later is the module's own."""
        from lightning_parallel.parallel.compile import check_backend, compile_targets, unwrap_compiled

        unwrap_compiled(module)  # the user's torch.compile(submodule): names without "_orig_mod." from here on
        check_meta_module(module)
        shape_fn = getattr(module, "parallel_shape", None)
        shape = shape_fn() if callable(shape_fn) else {}
        check_model_compat(self.layout, **{k: shape[k] for k in self.shape_checks if k in shape})
        own = getattr(module, "check_parallel_layout", None)
        if callable(own):
            own(self.layout)  # the module's own refusals first (e.g. a Hugging Face family without a tensor plan)
        if self.layout.context_parallel_size > 1:
            from lightning_parallel.config import check_context_compat
            from lightning_parallel.parallel.context_parallel import check_context_plan

            check_context_plan(module)
            if "n_head" in shape:
                check_context_compat(self.layout, n_head=shape["n_head"])
        self._check_dtypes(module)
        if self.layout.activation_checkpointing != "none":
            from lightning_parallel.parallel.activation_checkpointing import activation_checkpointing_targets

            activation_checkpointing_targets(module, self.layout.activation_checkpointing)
        if self.layout.compile:
            check_backend(self.layout.compile)
            compile_targets(module)

    def _check_dtypes(self, module: pl.LightningModule) -> None:
        """Before spawning, what the sharding engines cannot flatten: under FSDP2 a 0-d parameter, and parameters of
        several dtypes in one unit; under the flat ZeRO-1/2 several dtypes in one param group of
        ``configure_optimizers``. Not where the precision casts the whole module in the ranks (``*-true``)."""
        from lightning_parallel.parallel.zero import flat_group_refusal, fsdp2_dtype_refusal, fsdp2_parameter_refusal

        key = f"zero_stage={self.layout.zero}"
        precision = str(getattr(getattr(self, "precision_plugin", None), "precision", "32-true"))
        casts_all = precision in ("bf16-true", "16-true", "64-true")
        why = None
        if self.layout.runs_fsdp2:
            why = fsdp2_parameter_refusal(module, key) or (None if casts_all else fsdp2_dtype_refusal(module, key))
        elif (self.layout.zero in (1, 2) and self.layout.offload_device == "none" and not casts_all
              and len({p.dtype for p in module.parameters()}) > 1):  # configure_optimizers called only then
            configured = configured_optimizers(module)
            for optimizer in configured[0] if configured else []:
                for i, group in enumerate(getattr(optimizer, "param_groups", [])):
                    why = why or flat_group_refusal(list(group["params"]), i)
            why = f"{key}: {why}" if why else None
        if why is not None:
            raise LayoutError(why)

    def full_state_for_main_process(self, module: nn.Module) -> dict[str, Any] | None:
        """The whole weights a spawn/fork launcher hands back to the main process when the ranks hold shards (called
        on every rank, so it may be a collective), or None when rank 0's own ``state_dict()`` is already whole."""
        return None

    def apply_activation_checkpointing(self, module: nn.Module) -> list[str]:
        """Recompute activations in backward as ``parallel.activation_checkpointing`` says (none/selective/full),
        before the module is wrapped; parameter names do not change. Returns the recomputed submodules' names."""
        mode = self.layout.activation_checkpointing
        if mode == "none":
            return []
        from lightning_parallel.parallel.activation_checkpointing import apply_activation_checkpointing

        return apply_activation_checkpointing(module, mode)

    @property
    def layout_world_size(self) -> int:
        """``num_nodes x devices``: the world the layout is resolved against (known before any process starts)."""
        return int(self.num_nodes) * int(self.num_processes)

    def resolve_dims(self) -> ParallelDims:
        """Resolve the layout against :attr:`layout_world_size`; :class:`LayoutError` with the arithmetic. Also
        refused here, before any process exists: ``num_nodes > 1`` with nothing to start the other nodes
        (:func:`launch_environment_refusal`)."""
        if self.num_processes < 1:
            raise LayoutError(f"{type(self).__name__} needs at least one device, got parallel_devices=[].")
        dims = ParallelDims.from_config(
            self.layout, world_size=self.layout_world_size, devices_per_node=self.num_processes,
            num_nodes=self.num_nodes,
        )  # the layout's own refusals first
        why = launch_environment_refusal(self.num_nodes, getattr(self, "cluster_environment", None))
        self.launch_note = why
        if why and not LAUNCH_NOTES_ONLY["on"]:
            raise LayoutError(why)
        self._dims = dims
        return self._dims

    @property
    def dims(self) -> ParallelDims:
        """The layout resolved against this Trainer's world size (devices x num_nodes)."""
        return self._dims if self._dims is not None else self.resolve_dims()

    @property
    def coords(self) -> RankCoords:
        """This process's ``(dp, pp, tp)`` coordinates."""
        return self.dims.coords(self.global_rank)

    def describe(self) -> str:
        """``lp_ddp (dp=2 x pp=1 x tp=1 = 2 ranks, zero=0)``: the resolved layout once known, else the layout."""
        if self._dims is None:
            return f"{self.strategy_name} ({self.layout.describe()})"
        extra = f", zero={self.layout.zero}" if self.layout.zero else ""
        if self.layout.offload_device != "none":
            extra += f", offload={self.layout.offload_device}"
        if self.layout.activation_checkpointing != "none":
            extra += f", recompute={self.layout.activation_checkpointing}"
        if self.layout.compile:
            extra += ", compile" if self.layout.compile is True else f", compile={self.layout.compile}"
        if self.layout.context_parallel_size > 1 and self.layout.context_parallel_style != "ring":
            extra += f", cp_style={self.layout.context_parallel_style}"
        return f"{self.strategy_name} ({self._dims.describe()}{extra})"


class CheckedSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher (``popen``, also under torchrun/SLURM): the module is checked against the layout
    and :meth:`before_launch` runs before the other ranks start. Every process that gets here is a rank (the
    script runs it in each): a fatal signal prints its threads' Python stacks, unless it already has a handler."""

    def __init__(self, strategy: Any, *args: Any) -> None:
        super().__init__(*args)
        self._lp_strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        enable_fault_handler(replace=False)
        _before_launch(self._lp_strategy, trainer, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class RanksPreempted(SystemExit):
    """The ranks a ``spawn``/``fork`` launcher started stopped on a preemption (SIGTERM), their callbacks'
    ``on_exception`` run there (a ``PreemptionCheckpoint`` saves); the launching process ends too, as every ``popen``
    rank does. Not Lightning's ``SIGTERMException``: this
    process's callbacks must not save their own (untrained) copy of the module again."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def __str__(self) -> str:
        return (f"the ranks stopped on a preemption at global step {self.step} (their callbacks' on_exception ran "
                "there: a PreemptionCheckpoint saved)")


class _Preempted:
    """What rank 0 sends the launching process in place of its results after a preemption (picklable)."""

    def __init__(self, step: int) -> None:
        self.step = step


class CheckedMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher: the module is checked against the layout before spawning, each rank prints
    its threads' Python stacks on a fatal signal (SIGSEGV: otherwise only "process 1 terminated with signal
    SIGSEGV"), and the main process gets back whole weights where the ranks hold shards (the strategy's
    ``full_state_for_main_process``)."""

    def __init__(self, strategy: Any, start_method: Literal["spawn", "fork", "forkserver"]) -> None:
        super().__init__(strategy, start_method=start_method)
        self._lp_strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        _before_launch(self._lp_strategy, trainer, args)
        if self._start_method != "fork":
            return super().launch(function, *args, trainer=trainer, **kwargs)
        # The ranks are copies of this process: collect its garbage here, once, and freeze the rest while they run,
        # so that no rank's garbage collector runs the destructors of objects it inherited (C++ ones among them:
        # DeepSpeedCPUAdam's crashes outside DeepSpeed; a process group's would close this process's sockets).
        gc.collect()
        gc.freeze()
        _stop_tqdm_monitor()  # a thread the ranks would inherit mid-use; tqdm starts a new one with its next bar
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            gc.unfreeze()

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        """In the rank. A preemption (``SIGTERMException``, a ``SystemExit`` that the rank's ``function`` raises
        where Lightning's ``popen`` ranks have its interrupt handling around it) gets that handling here: the
        callbacks' ``on_exception`` -- the preemption checkpoint of the rank's real state, every rank together --
        and the teardown; then rank 0 tells the launching process, which would otherwise wait forever for a result
        that no rank sends (the ranks exit cleanly)."""
        from lightning.pytorch.trainer.call import _interrupt
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        enable_fault_handler()  # in the rank, first thing
        try:
            super()._wrapping_function(process_idx, *args, **kwargs)
        except SIGTERMException as err:
            trainer, return_queue = args[0], args[4]
            if trainer is not None:
                _interrupt(trainer, err)
                trainer._teardown()
            if process_idx == 0:
                return_queue.put(_Preempted(trainer.global_step if trainer is not None else -1))

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: pl.Trainer) -> None:
        """Lightning's, plus: a module that builds its layers in ``configure_model()`` builds them here first (the
        ranks built them; Lightning loads the trained weights without strictness, so they went nowhere: the main
        process's module had no layers after the fit, under Lightning's own ``ddp_fork`` too); a module the main
        process built on the meta device (a pipeline's large-model path) takes the trained weights as its tensors
        (``assign=True``) instead of ignoring them; ranks stopped by a preemption end this process with
        :class:`RanksPreempted`."""
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if isinstance(worker_output, _Preempted):
            raise RanksPreempted(worker_output.step)
        module = trainer.lightning_module
        if worker_output.weights_path is not None and module is not None and is_overridden("configure_model", module):
            try:  # Lightning's contract: the hook is idempotent (a second call builds nothing)
                with trainer.precision_plugin.module_init_context():  # bf16-true: the layers in bf16, as in the ranks
                    module.configure_model()
            except Exception as err:  # the fit succeeded: its checkpoints hold the weights
                rank_zero_warn(
                    f"{type(module).__name__}.configure_model() failed in the calling process after the fit "
                    f"({type(err).__name__}: {err}); the trained weights go only where the module already has "
                    "layers. The run's checkpoints hold them all.")
        if worker_output.weights_path is not None and module is not None:
            # bf16-true / 64-true: the ranks trained the module in that dtype; cast this process's module alike, or
            # the trained weights would be rounded into its fp32 tensors (Lightning's own ddp_fork does that)
            trainer.precision_plugin.convert_module(module)
        if (worker_output.weights_path is None or module is None
                or not any(t.is_meta for t in (*module.parameters(), *module.buffers()))):
            super()._recover_results_in_main_process(worker_output, trainer)
            return
        weights = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
        module.load_state_dict(weights, strict=False, assign=True)
        self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
        worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        module = trainer.lightning_module
        gather = getattr(self._lp_strategy, "full_state_for_main_process", None)
        full = gather(module) if module is not None and callable(gather) else None  # may be a collective: all ranks
        if full is None:
            return super()._collect_rank_zero_results(trainer, results)
        assert module is not None
        module.state_dict = lambda *args, **kwargs: full  # type: ignore[method-assign,assignment]
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict


def _stop_tqdm_monitor() -> None:
    """End tqdm's monitor thread if one runs in this process (any progress bar shown earlier starts it)."""
    import sys

    tqdm_module = sys.modules.get("tqdm.std")
    monitor = getattr(getattr(tqdm_module, "tqdm", None), "monitor", None) if tqdm_module is not None else None
    if monitor is not None:
        with contextlib.suppress(Exception):
            monitor.exit()
        tqdm_module.tqdm.monitor = None  # type: ignore[union-attr]


@contextlib.contextmanager
def _methods_replaced(obj: Any, **methods: Callable[..., Any]) -> Generator[None, None, None]:
    """Set ``methods`` on the instance ``obj`` while the context is open, then put back what the instance had (its own
    attribute, or none: the class's method again)."""
    own = vars(obj)
    shadowed = {name: own[name] for name in methods if name in own}
    for name, method in methods.items():
        setattr(obj, name, method)
    try:
        yield None
    finally:
        for name in methods:
            if name in shadowed:
                setattr(obj, name, shadowed[name])
            else:
                delattr(obj, name)


@contextlib.contextmanager
def clip_by_norm_replaced(precision: Any, clip: Callable[[Any, float], None]) -> Generator[None, None, None]:
    """Route Lightning's ``gradient_clip_val`` (by norm) to ``clip(raw_optimizer, clip_val)`` while the context is
    open (a strategy's set-up to teardown), then restore the precision plugin's own method.

    Lightning clips ``precision.main_params(optimizer)`` by their *local* norm; under sharding (ZeRO shards, tensor
    shards) the norm of the whole gradient needs a reduction over the right axes, which only the strategy knows.
    ``clip`` receives the unwrapped optimizer and the clip value.
    """
    def clip_grad_by_norm(optimizer: Any, clip_val: float | int) -> None:
        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        clip(raw, float(clip_val))

    with _methods_replaced(precision, clip_grad_by_norm=clip_grad_by_norm):
        yield None


@contextlib.contextmanager
def clip_by_value_on_local_tensors(precision: Any) -> Generator[None, None, None]:
    """While the context is open, Lightning's ``gradient_clip_algorithm="value"`` clamps each gradient's local tensor
    (a DTensor's shard, a plain tensor itself) one by one: clamping is element-wise, so this is the clamp of the
    whole gradient, and it runs where torch's ``clip_grad_value_`` refuses a tensor-parallel model's mix of DTensor
    and plain gradients (``_foreach_clamp_min_`` "got mixed torch.Tensor and DTensor")."""
    from lightning_parallel.parallel.tensor.sync import local_tensor

    def clip_grad_by_value(optimizer: Any, clip_val: float | int) -> None:
        with torch.no_grad():
            for p in precision.main_params(optimizer):
                if p.grad is not None:
                    local_tensor(p.grad).clamp_(min=-clip_val, max=clip_val)

    with _methods_replaced(precision, clip_grad_by_value=clip_grad_by_value):
        yield None


@contextlib.contextmanager
def zero_grad_before_training_step(trainer: Any, *, required: str | None = None) -> Generator[None, None, None]:
    """While the context is open, Lightning's automatic optimization zeroes the gradients in front of
    ``training_step`` instead of between it and ``backward`` -- the same call (``on_before_zero_grad``, then the
    module's ``optimizer_zero_grad``, on each accumulation window's first batch), the same progress counters, moved.

    Needed where the module's parameters are not the optimizer's between the forward and the backward: FSDP2 keeps
    the units it does not reshard after their forward (the root, ZeRO-3's head, every unit under ZeRO-2 over FSDP2)
    gathered into plain unsharded parameters until their backward, so a module's ``optimizer_zero_grad`` that zeroes
    ``self.parameters()`` itself would reach those copies and leave the sharded gradients of the last step to be
    added to (3.0e-03 from one device after 4 steps at ZeRO-3, 4.8e-03 under HSDP ZeRO-2). Before the forward every
    parameter is the optimizer's. A pipeline's ``training_step`` runs the schedule's backward itself, so the loop's
    zero-grad after it would erase the gradients the schedule made.

    ``required``: the strategy's name where the move is needed for correctness whatever the module does (a
    pipeline): a Lightning without the loop's ``_make_closure`` is then refused; otherwise nothing is moved there."""
    loop = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "automatic_optimization", None)
    make = getattr(loop, "_make_closure", None)
    if loop is None or not callable(make):
        if required is not None:
            raise RuntimeError(
                f"{required}: this Lightning's training loop has no _AutomaticOptimization._make_closure "
                "(lightning 2.4-2.6 have it), so the loop's zero-grad cannot be moved in front of the pipeline "
                "schedule, and after it would erase the gradients the schedule made. Fix: lightning>=2.4,<2.7.")
        yield None
        return

    def make_closure(*args: Any, **kwargs: Any) -> Any:
        closure = make(*args, **kwargs)
        zero, step = getattr(closure, "_zero_grad_fn", None), getattr(closure, "_step_fn", None)
        if zero is not None and step is not None:
            def zero_then_step() -> Any:
                zero()
                return step()

            closure._zero_grad_fn, closure._step_fn = None, zero_then_step
        return closure

    loop._make_closure = make_closure
    try:
        yield None
    finally:
        if vars(loop).get("_make_closure") is make_closure:
            del loop._make_closure


@contextlib.contextmanager
def toggles_by_model_parameters(module: pl.LightningModule,
                                optimizers: Callable[[], list[Any]]) -> Generator[None, None, None]:
    """While the context is open: ``module.toggle_optimizer`` / ``untoggle_optimizer`` (and so ``toggled_optimizer``)
    freeze and restore the module's parameters of each optimizer, read with its ``model_parameters()`` where it has
    one (the library's ZeRO-1/2 optimizers, whose ``param_groups`` hold flat shards: Lightning's own methods toggled
    those and left the other optimizer's layers trainable, so their gradients leaked into the next optimizer's
    step), else from its ``param_groups``, as Lightning does. ``optimizers()`` gives the strategy's optimizers. A
    module whose class overrides either method keeps its own."""

    def unwrap(optimizer: Any) -> Any:
        """The strategy's optimizer behind ``optimizer``: Lightning's wrapper's, or the ZeRO optimizer around the
        user's own optimizer object (kept so that schedulers stay bound to it; its groups hold the flat shards)."""
        optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return next((o for o in optimizers() if getattr(o, "optim", None) is optimizer), optimizer)

    def params_of(optimizer: Any) -> list[Tensor]:
        optimizer = unwrap(optimizer)
        own = getattr(optimizer, "model_parameters", None)
        return own() if callable(own) else [p for group in optimizer.param_groups for p in group["params"]]

    def toggle(optimizer: Any) -> None:
        state: dict[Tensor, bool] = {}
        for opt in optimizers():
            for p in params_of(opt):
                if p not in state:
                    state[p] = p.requires_grad
                    p.requires_grad = False
        for p in params_of(optimizer):
            p.requires_grad = state[p]
        module._param_requires_grad_state = state  # type: ignore[assignment]  # (Lightning keys it by parameter)

    def untoggle(optimizer: Any) -> None:
        state: Any = module._param_requires_grad_state
        for opt in optimizers():
            if opt is not unwrap(optimizer):
                for p in params_of(opt):
                    if p in state:
                        p.requires_grad = state[p]
        module._param_requires_grad_state = {}

    names = ("toggle_optimizer", "untoggle_optimizer")
    overridden = [name for name in names if getattr(type(module), name) is not getattr(pl.LightningModule, name)]
    if overridden:  # the module's own toggling is its author's
        rank_zero_warn(
            f"{type(module).__name__} overrides {' and '.join(overridden)}; the library leaves it as it is. Its "
            "optimizers' param_groups hold ZeRO's flat shards, not the module's parameters, so Lightning's own "
            "toggling (super()) would freeze the shards and leave the other optimizers' layers trainable: read "
            "each optimizer's model_parameters() instead.")
        yield None
        return
    with _methods_replaced(module, toggle_optimizer=toggle, untoggle_optimizer=untoggle):
        yield None


def oversubscription_warning(*, processes: int, device_type: str, cores: int | None) -> str | None:
    """The warning for more CPU ranks on this node than it has cores (each rank then gets a fraction of a core and
    training crawls without a word), or None. GPU ranks do their work on their devices: no warning."""
    if device_type != "cpu" or not cores or processes <= cores:
        return None
    return (
        f"{processes} processes on this node's {cores} CPU core(s): each rank gets {cores / processes:.2g} of a core, "
        "so the run will be much slower than with fewer ranks (the layout is still exact). Fix: devices <= "
        f"{cores}, or use a GPU node; to keep {processes} ranks for a test, expect it to be slow."
    )


CKPT_KEYWORDS = ("last", "best", "hpc")
"""Lightning's ``ckpt_path`` keywords: resolved in the ranks, not paths to check before launch."""


def check_ckpt_path(strategy: Any, ckpt_path: Any, *, module: Any = None, finetuning: Sequence[Any] = ()) -> None:
    """Before spawning: a ``ckpt_path`` given as a path must exist, and the strategy must be able to resume its kind
    (``check_resume_source(path)`` where the strategy defines it). With ``module``, the checkpoint -- any format --
    must also fit it: its format version readable, a DCP folder's checksum list present, the tensors' shapes, the
    optimizers and the LR schedulers of ``configure_optimizers``
    (:func:`~lightning_parallel.checkpoint.summary.resume_refusal`). ``finetuning``: the run's ``BaseFinetuning``
    callbacks -- they freeze layers before ``configure_optimizers`` runs in the ranks (done here too, on the module,
    then undone) and add param groups during the fit, which they add again on restore. Lightning's keywords
    (``last``, ``best``, ...) are resolved later, in the ranks."""
    from lightning_parallel.checkpoint.formats import CheckpointFormatError

    if not isinstance(ckpt_path, (str, os.PathLike)):
        return
    from lightning.pytorch.utilities.model_registry import _is_registry

    text = str(ckpt_path)
    if text in CKPT_KEYWORDS or _is_registry(text):
        return
    if "://" not in text and not os.path.exists(text):
        raise CheckpointFormatError(f"--ckpt_path {text}: no such file or folder. Fix: give the path of a checkpoint "
                                    "(a .ckpt file or folder trainer.save_checkpoint wrote), or 'last'.")
    check = getattr(strategy, "check_resume_source", None)
    if callable(check) and "://" not in text:
        check(text)
    library = strategy is None or getattr(strategy, "resumes_dataloaders", False)  # every strategy of the library
    if "://" not in text and os.path.isdir(text) and not library and _loads_files_only(strategy):
        from lightning_parallel.checkpoint.formats import detect_format

        try:
            kind = detect_format(text).describe()
        except CheckpointFormatError:
            kind = "a folder"
        raise CheckpointFormatError(
            f"--ckpt_path {text} is a checkpoint folder ({kind}), and {type(strategy).__name__} (Lightning's own "
            "strategy) loads one checkpoint file only. Fix: join it into one file with `lightning-parallel "
            f"consolidate --resumable {text} OUT.ckpt` and resume from OUT.ckpt, or run under one of the library's "
            "strategies (e.g. strategy lp_ddp, on any number of devices), which read every format.")
    if module is None or "://" in text or not library:  # Lightning's own strategies read their own formats
        return
    from lightning_parallel.checkpoint.errors import ResumeError
    from lightning_parallel.checkpoint.resume import TRUST_ENV
    from lightning_parallel.checkpoint.summary import resume_refusal, summarize
    from lightning_parallel.checkpoint.verify import require_manifest

    require_manifest(text)
    summary = summarize(text, trusted=os.environ.get(TRUST_ENV, "") == "1")
    flags = [(p, p.requires_grad) for p in module.parameters()]
    try:
        for callback in finetuning:
            callback.freeze_before_training(module)
        configured = configured_optimizers(module)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    why = resume_refusal(summary, module=module, optimizers=configured[0] if configured else None,
                         schedulers=configured[1] if configured else None, groups_may_grow=bool(finetuning),
                         partial_module=_builds_in_ranks(module))
    if why:
        raise ResumeError(why)


def _builds_in_ranks(module: Any) -> bool:
    """Whether ``module`` builds layers in ``configure_model()``, which runs in the ranks: before launch its tensors
    may be only some of those it trains."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return isinstance(module, pl.LightningModule) and is_overridden("configure_model", module)


def _loads_files_only(strategy: Any) -> bool:
    """Lightning's own single-device and DDP strategies with Lightning's file checkpoint IO: they read one file
    (Lightning's DeepSpeed, FSDP and model-parallel strategies read folders of their own, a custom IO may too)."""
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    folders = (DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy)
    return (isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and not isinstance(strategy, folders)
            and type(getattr(strategy, "checkpoint_io", None)) is TorchCheckpointIO)


def configured_optimizers(module: Any) -> tuple[list[Any], list[Any]] | None:
    """The optimizers and LR schedulers the module's ``configure_optimizers`` returns, built in this process before
    any rank starts (no optimizer state is allocated; works on a meta-device module), or None when it cannot be
    called here (it needs the running Trainer, or raises)."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    configure = getattr(module, "configure_optimizers", None)
    if not callable(configure):
        return None
    attached = getattr(module, "_trainer", None)
    try:
        module._trainer = None  # no Trainer-driven work here (estimated_stepping_batches would load the data)
        conf = configure()
        if conf is None:
            return [], []
        optimizers, schedulers, _ = _configure_optimizers(conf)
    except Exception:
        return None
    finally:
        module._trainer = attached
    return list(optimizers), [s["scheduler"] if isinstance(s, dict) else s for s in schedulers]


LAUNCH_NOTES_ONLY = {"on": False}
"""Set by ``lightning-parallel check``: a recipe for several nodes is checked on a machine that does not start them
(a login node); :func:`launch_environment_refusal` is then kept on the strategy (``launch_note``) and printed, not
raised -- ``fit`` started the same way here is refused."""


def launch_environment_refusal(num_nodes: int, cluster_environment: Any) -> str | None:
    """Why ``num_nodes > 1`` cannot start from here, or None: without a launcher that starts the other nodes
    (torchrun, SLURM, ... -- a cluster environment that creates the processes) and without ``MASTER_ADDR`` /
    ``NODE_RANK`` set for a manual start on each node, the ranks of this node would wait at the rendezvous for nodes
    that nobody starts."""
    if int(num_nodes or 1) <= 1 or cluster_environment is None:
        return None
    if getattr(cluster_environment, "creates_processes_externally", False):
        return None
    if type(cluster_environment).__name__ != "LightningEnvironment":
        return None  # SLURM, LSF, Kubeflow, MPI, ...: the scheduler starts the nodes
    if any(os.environ.get(key) for key in ("MASTER_ADDR", "NODE_RANK", "GROUP_RANK")):
        return None  # started by hand on every node with the rendezvous address and the node's rank
    n = int(num_nodes)
    others = "node 1" if n == 2 else f"nodes 1..{n - 1}"
    return (
        f"trainer.num_nodes={num_nodes}, but nothing starts {others}: no launcher (torchrun, SLURM) runs this "
        "command and MASTER_ADDR / NODE_RANK are not set, so the ranks of this node would wait at the rendezvous for "
        f"{others} for ever. Fix: start it on every node with "
        f"scripts/launch/torchrun.sh --nnodes {num_nodes} --node-rank R --master-addr NODE0 RECIPE (under SLURM: "
        f"sbatch --nodes {num_nodes} scripts/launch/slurm.sbatch RECIPE), or set MASTER_ADDR, MASTER_PORT and "
        "NODE_RANK on each node; on one machine use trainer.num_nodes=1."
    )


def check_data_modules(strategy: Any, trainer: pl.Trainer | None, args: tuple[Any, ...],
                       probe: TrainingDataProbe | None = None) -> None:
    """Before spawning: every data module among ``trainer.fit``'s arguments that defines ``check_before_launch``
    (:class:`~lightning_parallel.data.TextDataModule` does) checks its data against the data-parallel size (a missing
    or empty path, a corpus smaller than one batch per rank), once, in the launching process; then the training
    DataLoader itself (:class:`TrainingDataProbe`): it must give at least one batch per data-parallel rank, and an
    integer ``val_check_interval`` must fit in the epoch. With context parallelism, a data module's ``block_size``
    (its sequence length) must divide by 2 x cp."""
    layout = getattr(strategy, "layout", None)
    if layout is not None and layout.context_parallel_size > 1:
        from lightning_parallel.config import check_context_compat

        for arg in args:
            if isinstance(arg, pl.LightningDataModule):
                hparams = getattr(arg, "hparams", None)
                block = getattr(arg, "block_size", None) or (hparams.get("block_size") if hparams else None)
                if isinstance(block, int) and not isinstance(block, bool):
                    check_context_compat(layout, sequence_length=block,
                                         where=f"the data module {type(arg).__name__}'s block_size")
    dp = data_parallel_size(strategy, trainer)
    module = trainer.lightning_module if trainer is not None else None
    for arg in args:
        check = getattr(arg, "check_before_launch", None) if isinstance(arg, pl.LightningDataModule) else None
        if callable(check):
            check(data_parallel_size=dp, model=module)
    if trainer is None:
        return
    probe = probe or TrainingDataProbe(args, module=module)
    if layout is not None and (layout.context_parallel_size > 1 or dp > 1) and module is not None \
            and not getattr(strategy, "pipelined", False):  # a pipeline's check_data checks them with its target
        check_context_labels(module, probe, strict=layout.context_parallel_size > 1)
        if layout.context_parallel_size > 1:
            check_context_batch(module, probe, layout.context_parallel_size)
    batches = probe.batches_per_rank(dp)
    if batches is None:
        return
    limit = trainer.limit_train_batches
    if isinstance(limit, int):
        batches = min(batches, limit)
    elif isinstance(limit, float) and limit < 1.0:
        batches = int(batches * limit)
    if batches == 0 and limit != 0 and trainer.max_steps != 0:
        raise LayoutError(
            f"{probe.source} gives 0 training batches per data-parallel rank ({probe.describe(dp)}): the fit would "
            "end after 0 steps without a word. Fix: more data, a smaller batch_size, drop_last=False, or fewer "
            "data-parallel ranks."
        )
    interval = trainer.val_check_interval
    if (isinstance(interval, int) and not isinstance(interval, bool) and batches and interval > batches
            and trainer.check_val_every_n_epoch is not None and trainer.limit_val_batches != 0
            and getattr(trainer, "_val_check_time_interval", None) is None):
        raise LayoutError(
            f"trainer.val_check_interval={interval} batches, but an epoch has only {batches} training batches per "
            f"data-parallel rank ({probe.describe(dp)}): Lightning would stop after the ranks start. Fix: "
            f"val_check_interval <= {batches}, a fraction of the epoch (e.g. 0.5), or check_val_every_n_epoch=null "
            "to count batches across epochs."
        )


_EVAL_HOOKS = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}


def check_evaluation_data(trainer: pl.Trainer | None, module: Any, args: tuple[Any, ...]) -> None:
    """Before spawning ``validate``, ``test`` or ``predict``: without DataLoaders among the call's arguments, the
    data module (or the module) must define the stage's DataLoader hook -- Lightning's default raises only inside
    the ranks (e.g. ``predict`` of a recipe whose ``TextDataModule`` has no ``predict_dataloader``)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    fn = str(trainer.state.fn.value if trainer is not None and trainer.state.fn is not None else "")
    hook = _EVAL_HOOKS.get(fn)
    if hook is None:
        return
    given = args[1] if len(args) > 1 else None  # trainer.validate/test/predict(model, dataloaders, ...)
    if given is not None and not isinstance(given, pl.LightningDataModule):
        return  # DataLoaders, a list of batches, a CombinedLoader...: Lightning iterates what it is given
    data = next((a for a in args if isinstance(a, pl.LightningDataModule)), None)
    if data is not None and is_overridden(hook, data):
        return
    if data is None and module is not None and is_overridden(hook, module):
        return
    owner = f"the data module {type(data).__name__}" if data is not None else (
        f"the module {type(module).__name__}" if module is not None else "the call")
    raise LayoutError(
        f"trainer.{fn} needs its data, and {owner} does not define {hook}() (nor were DataLoaders given): Lightning "
        f"would fail inside the ranks after they start. Fix: pass dataloaders to trainer.{fn}(...), or define "
        f"{hook}() on the data module.")


def check_evaluation_ckpt(strategy: Any, trainer: pl.Trainer | None, module: Any, args: tuple[Any, ...]) -> None:
    """Before spawning ``validate``, ``test`` or ``predict`` with a ``ckpt_path`` given as a path: it must exist and be
    readable by the strategy (:func:`check_ckpt_path`), and its weights must fit the module -- names and shapes, any
    format (:func:`~lightning_parallel.checkpoint.summary.resume_refusal` on the weights only), as ``fit`` checks a
    checkpoint it resumes. A model configured otherwise than the saved one failed inside the ranks, under a DCP
    folder with torch's "Size mismatch" only in the ranks' output."""
    from lightning.pytorch.utilities.model_registry import _is_registry

    fn = str(trainer.state.fn.value if trainer is not None and trainer.state.fn is not None else "")
    position = {"validate": 2, "test": 2, "predict": 4}.get(fn)  # (model, dataloaders, ckpt_path | datamodule, ...)
    path = args[position] if position is not None and len(args) > position else None
    if (not isinstance(path, (str, os.PathLike)) or str(path) in CKPT_KEYWORDS or "://" in str(path)
            or _is_registry(str(path))):  # a model registry's name: Lightning downloads it in the ranks
        return
    check_ckpt_path(strategy, path)
    if module is None or not getattr(strategy, "resumes_dataloaders", False):  # Lightning's own: its own formats
        return
    from lightning_parallel.checkpoint.errors import ResumeError
    from lightning_parallel.checkpoint.resume import TRUST_ENV
    from lightning_parallel.checkpoint.summary import resume_refusal, summarize

    why = resume_refusal(summarize(str(path), trusted=os.environ.get(TRUST_ENV, "") == "1"), module=module,
                         weights_only=True, partial_module=_builds_in_ranks(module))
    if why:
        raise ResumeError(f"trainer.{fn}(ckpt_path=...): {why}")


def check_layer_sync(strategy: Any) -> None:
    """Before spawning: ``Trainer(sync_batchnorm=True)`` on CPU is refused -- it converts every BatchNorm layer to
    torch's ``SyncBatchNorm``, whose forward runs on GPUs only (it failed inside the ranks at the first batch)."""
    if getattr(strategy, "_layer_sync", None) is None:
        return
    devices = getattr(strategy, "parallel_devices", None) or []
    kind = devices[0].type if devices else "cpu"
    if kind == "cpu":
        raise LayoutError(
            "Trainer(sync_batchnorm=True) turns every BatchNorm layer into torch's SyncBatchNorm, which normalises "
            "over the whole global batch with a collective in its forward and runs on GPUs only (CUDA, XPU); this "
            "run is on CPU. Fix: sync_batchnorm=False (each data-parallel rank then normalises over its own part of "
            "the batch: statistics of batch_size samples instead of the global batch's), a norm that does not "
            "depend on the batch (LayerNorm, GroupNorm), or GPUs with a strategy of one process per device "
            "(lp_ddp, lp_sharded, ...).")


def check_meta_module(module: nn.Module) -> None:
    """Before spawning: a module built on the meta device (no memory) needs an ``init_weights()`` that fills its
    parameters in place once each rank has given them memory (the layout strategies materialize it: a pipeline rank
    only its stage). Without one the ranks failed in their set-up, the error hidden behind Lightning's teardown
    ("Cannot copy out of meta tensor")."""
    from lightning_parallel.parallel.pipeline import needs_init_weights

    if needs_init_weights(module) and not callable(getattr(module, "init_weights", None)):
        raise LayoutError(
            f"{type(module).__name__} was built on the meta device (its tensors have no memory) but has no "
            "init_weights(): the ranks give the tensors memory and then need that method to fill them. Fix: "
            "implement init_weights() (re-initialize every present parameter and buffer in place, as the library's "
            "GPT does), or build the module on a real device.")


def check_detect_anomaly(strategy: Any, trainer: pl.Trainer | None) -> None:
    """Before spawning: ``Trainer(detect_anomaly=True)`` with tensor parallelism is refused -- anomaly mode checks
    every backward output for NaN with ``aten._is_any_true``, which DTensor has no sharding rule for, so the first
    backward failed inside the ranks ("Operator aten._is_any_true.default does not have a sharding strategy
    registered"). The other layouts run it (their backward sees plain tensors: FSDP2 computes on gathered ones)."""
    dims = getattr(strategy, "dims", None)
    tp = getattr(dims, "tp", 1) if dims is not None else 1
    if not getattr(trainer, "_detect_anomaly", False) or tp <= 1:
        return
    raise LayoutError(
        f"Trainer(detect_anomaly=True) with tensor parallelism (tensor_parallel_size={tp}): torch's anomaly mode "
        "checks each backward output for NaN with an operator (aten._is_any_true) that DTensor cannot run on the "
        "sharded gradients, so the first backward would fail inside the ranks. Fix: detect_anomaly=False, or hunt "
        "the NaN in a run without tensor parallelism (lp_ddp, lp_sharded, lp_pipeline: the same training, where "
        "anomaly mode runs).")


def check_context_labels(module: Any, probe: TrainingDataProbe, target: Any = None, *, strict: bool = True) -> None:
    """Before spawning, where the token labels weigh the losses (context parallelism, dp ranks, a pipeline's
    micro-batches): the batch entry the module's ``context_parallel_plan()`` names as ``labels`` holds integer token
    labels in a real training batch; ``target`` (a pipeline's, from ``pipeline_batch``): it must be those labels,
    since a pipeline's last stage counts the target's tokens. ``strict`` (cp > 1): the whole plan is checked;
    otherwise only its labels are read (:func:`~lightning_parallel.parallel.context_parallel.loss_labels`)."""

    from lightning_parallel.parallel.context_parallel import describe_labels, labels_of, loss_labels, read_plan

    plan = read_plan(module) if strict else loss_labels(module)
    if plan is None or plan.labels is None:
        return
    batch = probe.first_batch()
    if batch is None or _transfer_hooks(module, probe):
        return  # the step sees the batch the transfer hooks make, not the loader's: nothing to judge here
    try:
        labels = labels_of(batch, plan)
    except ValueError as err:
        raise LayoutError(f"{type(module).__name__}.{err} (a training batch of {probe.source}: a "
                          f"{type(batch).__name__})") from err.__cause__
    if target is not None and not (isinstance(target, torch.Tensor) and target.shape == labels.shape
                                   and torch.equal(target, labels)):
        raise LayoutError(
            f"{type(module).__name__}.context_parallel_plan() names {describe_labels(plan.labels)} as the labels, "
            f"but pipeline_batch(batch) returns a different target ({_describe_tensor(target)} vs the labels' "
            f"{_describe_tensor(labels)}): a pipeline's last stage weighs each micro-batch's loss by the counted "
            "tokens of the target it receives. Fix: return the labels entry as the target, or leave 'labels' out of "
            "the plan (the loss is then not reweighted).")


def check_context_batch(module: Any, probe: TrainingDataProbe, cp: int) -> None:
    """Before spawning, with cp > 1: a real training batch splits as the module's ``context_parallel_plan()`` says --
    every entry it names there, with the sequence dim it names and a length that ``2 x cp`` divides (these failed in
    the ranks: an IndexError for a per-sample tensor under an int plan, the length's refusal). Entries it does not
    name that have the sequence's length (a loss mask) are warned about: each rank would get them whole."""

    from lightning_parallel.parallel.context_parallel import SequenceShard, read_plan, split_batch, unsplit_sequences

    batch = probe.first_batch()
    if batch is None or _transfer_hooks(module, probe):
        return
    plan = read_plan(module)
    try:
        split_batch(batch, plan, SequenceShard(cp=cp, rank=0))
    except (ValueError, KeyError, TypeError) as err:
        text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        raise LayoutError(f"{type(module).__name__}: {text} (a training batch of {probe.source}, under "
                          f"context_parallel_size={cp})") from None
    unsplit = unsplit_sequences(batch, plan)
    if unsplit:
        rank_zero_warn(
            f"{type(module).__name__}.context_parallel_plan()['batch'] does not split the batch entries "
            f"{', '.join(unsplit)}, which have the sequence's length: each of the {cp} context-parallel ranks gets "
            "them whole while the tokens are cut (a loss mask or per-token weights would not line up with the "
            "rank's tokens). Fix: name them in 'batch' if they are per token.")


def _transfer_hooks(module: Any, probe: TrainingDataProbe) -> bool:
    """Whether the module or a data module among the fit's arguments overrides a batch-transfer hook: the step then
    sees the batch those hooks make, not the loader's."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    owners = [module, *(a for a in probe._args if isinstance(a, pl.LightningDataModule))]
    return any(owner is not None and is_overridden(hook, owner) for owner in owners
               for hook in ("on_before_batch_transfer", "on_after_batch_transfer"))


def _describe_tensor(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def data_parallel_size(strategy: Any, trainer: pl.Trainer | None = None) -> int:
    """How many data-parallel ranks split each global batch: the resolved layout's dp, a Lightning strategy's
    sampler replicas, 1 for one process (``lp_dp`` splits each batch itself)."""
    dims = getattr(strategy, "_dims", None)
    if dims is not None:
        return int(dims.dp)
    try:
        kwargs = strategy.distributed_sampler_kwargs if strategy is not None else None
    except Exception:
        kwargs = None
    if kwargs and kwargs.get("num_replicas"):
        return int(kwargs["num_replicas"])
    if strategy is not None and getattr(strategy, "strategy_name", "") == "lp_dp":
        return 1
    return int(getattr(strategy, "num_processes", 1) or 1) * int(getattr(strategy, "num_nodes", 1) or 1)


class TrainingDataProbe:
    """The training DataLoader of ``trainer.fit``'s arguments (a DataLoader, or a data module's
    ``train_dataloader()`` after its ``setup("fit")``), built once in the launching process; its length and one real
    batch, for the checks before any rank starts. Anything that cannot be built here (a data module that needs the
    running Trainer) is left to the ranks: :attr:`loader` is None."""

    def __init__(self, args: tuple[Any, ...], *, module: Any = None, trainer: pl.Trainer | None = None) -> None:
        self._args = args
        self._module = module
        self.trainer = trainer
        """The Trainer of the launch (its ``max_steps``, ``limit_train_batches``), when known."""
        self._loader: Any = None
        self._built = False
        self._batch: Any = None
        self._batch_error: BaseException | None = None
        self._fetched = False
        self.source = "the training DataLoader"

    @property
    def loader(self) -> Any:
        if not self._built:
            self._built = True
            self._loader = self._build()
        return self._loader

    def _build(self) -> Any:
        from torch.utils.data import DataLoader

        train = self._args[1] if len(self._args) > 1 else None
        datamodule = self._args[3] if len(self._args) > 3 else None
        if isinstance(train, (list, tuple)) and train and isinstance(train[0], DataLoader):
            train = train[0]
        if isinstance(train, DataLoader):
            return train
        if isinstance(train, pl.LightningDataModule):
            datamodule = train
        if isinstance(datamodule, pl.LightningDataModule):
            self.source = f"the data module {type(datamodule).__name__}'s training DataLoader"
            try:
                datamodule.setup("fit")
                loader = datamodule.train_dataloader()
            except Exception:
                return None
            return loader if isinstance(loader, DataLoader) else None
        return None

    def batches_per_rank(self, dp: int) -> int | None:
        """Training batches per epoch on each of ``dp`` ranks (the loader built here reads every sample; the ranks'
        samplers split them), or None when unknown (an iterable dataset, no length)."""
        loader = self.loader
        if loader is None:
            return None
        try:
            return len(loader) // max(1, dp)
        except TypeError:
            return None

    def describe(self, dp: int) -> str:
        loader = self.loader
        try:
            samples = f"{len(loader.dataset):,} samples, "
        except TypeError:
            samples = ""
        drop = ", drop_last" if getattr(loader, "drop_last", False) else ""
        return f"{samples}batch_size {loader.batch_size}{drop}, {len(loader):,} batches for {dp} data-parallel rank(s)"

    def first_batch(self) -> Any:
        """One real training batch (the first of the loader), or None when the loader cannot give one here."""
        if not self._fetched:
            self._fetched = True
            loader = self.loader
            if loader is not None:
                try:
                    self._batch = next(iter(loader))
                except Exception as err:
                    self._batch_error = err
        return self._batch


def check_output_dirs(trainer: pl.Trainer | None) -> None:
    """Before spawning: every folder the run writes -- ``trainer.default_root_dir``, each logger's folder, each
    ``ModelCheckpoint``'s ``dirpath`` -- must be creatable and writable (otherwise rank 0 fails after the ranks
    started)."""
    from lightning_parallel.checkpoint.atomic import check_writable_dir

    if trainer is None:
        return
    for what, folder in _output_dirs(trainer):
        check_writable_dir(folder, what=what)


def _output_dirs(trainer: pl.Trainer) -> list[tuple[str, str]]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    found: list[tuple[str, str]] = []
    if trainer.default_root_dir:
        found.append(("trainer.default_root_dir", str(trainer.default_root_dir)))
    for logger in trainer.loggers:
        folder = getattr(logger, "save_dir", None) or getattr(logger, "root_dir", None)
        if folder:
            found.append((f"the logger {type(logger).__name__}'s save_dir", str(folder)))
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            found.append((f"{type(callback).__name__}(dirpath)", str(callback.dirpath)))
    return [(w, f) for w, f in found if "://" not in f]


def report_interrupted_saves(trainer: pl.Trainer | None) -> list[Path]:
    """Before spawning, on the launching rank: name the saves an earlier run left cut short under this run's folders
    (``<name>.partial``: an incomplete new checkpoint, never resumed from; ``<name>.old``: a previous checkpoint moved
    aside by a rename that did not finish). They are not deleted here (another run may be writing into the same
    folder); the next save of the same name replaces a ``.partial``."""
    from lightning_parallel.checkpoint.atomic import interrupted_saves
    from lightning_parallel.checkpoint.names import OLD_SUFFIX, PARTIAL_SUFFIX

    if trainer is None:
        return []
    folders = [Path(f) for _, f in _output_dirs(trainer)]
    leftovers = interrupted_saves(list(dict.fromkeys(folders)))
    if leftovers and getattr(trainer, "global_rank", 0) == 0:
        for path in leftovers[:8]:
            target = path.with_name(path.name[: -len(PARTIAL_SUFFIX if path.name.endswith(PARTIAL_SUFFIX)
                                                        else OLD_SUFFIX)])
            if path.name.endswith(PARTIAL_SUFFIX):
                what = (f"an interrupted save of {target.name} (incomplete: never resumed from; {target.name} "
                        f"{'is the previous, complete checkpoint' if target.exists() else 'does not exist'}); the next "
                        f"save of {target.name} replaces it, or remove it")
            else:
                what = (f"the previous {target.name}, moved aside by a save that stopped between its two renames "
                        f"({target.name}{PARTIAL_SUFFIX} may hold the complete new one); remove it once "
                        f"{target.name} is in place")
            print(f"lightning-parallel: found {path}: {what}.", flush=True)
        if len(leftovers) > 8:
            print(f"lightning-parallel: ... and {len(leftovers) - 8} more interrupted saves", flush=True)
    return leftovers


def check_nonfinite_guard(strategy: Any, trainer: pl.Trainer | None) -> None:
    """Before spawning: a ``NonFiniteLossGuard(action="skip")`` needs a strategy whose optimizer step it can skip
    (``skips_nonfinite_steps``: every strategy of the library but ``lp_zero_offload``, whose DeepSpeed engine owns
    the step and its gradient partitions)."""
    from lightning_parallel.callbacks.nonfinite import NonFiniteLossGuard

    for callback in _callbacks_of(trainer, NonFiniteLossGuard):
        if callback.action == "skip" and not getattr(strategy, "skips_nonfinite_steps", False):
            name = getattr(strategy, "strategy_name", type(strategy).__name__)
            raise LayoutError(
                f"NonFiniteLossGuard(action='skip') cannot skip a step under {name}: "
                + ("the DeepSpeed engine owns the optimizer step and its gradient partitions. " if name ==
                   "lp_zero_offload" else "the strategy's optimizer step is not the library's. ")
                + "Fix: action='stop' (the default: the run stops on that step with the newest good checkpoint), "
                "or one of lp_ddp, lp_sharded, lp_tensor, lp_pipeline, lp_hybrid, lp_dp."
            )


def _callbacks_of(trainer: pl.Trainer | None, kinds: type | tuple[type, ...]) -> list[Any]:
    """The trainer's callbacks of ``kinds`` (none without a trainer)."""
    return [c for c in getattr(trainer, "callbacks", None) or [] if isinstance(c, kinds)]


def check_callbacks(strategy: Any, trainer: pl.Trainer | None) -> None:
    """The callbacks the layout cannot run (:func:`check_finetuning_callbacks`,
    :func:`check_weight_averaging_callbacks`, :func:`check_batch_size_finder`): before spawning, and again in the
    rank, where a module's ``configure_callbacks()`` has added its own. (The monitors a pipeline cannot serve,
    :func:`check_pipeline_monitors`: before spawning, and in the rank once its optimizers exist.)"""
    check_finetuning_callbacks(strategy, trainer)
    check_weight_averaging_callbacks(strategy, trainer)
    check_batch_size_finder(strategy, trainer)


def check_batch_size_finder(strategy: Any, trainer: pl.Trainer | None) -> None:
    """Before spawning: Lightning's ``BatchSizeFinder`` callback runs in one process only -- on a world of several
    ranks each rank raised "The Batch size finder is not supported with distributed strategies" once started
    (``Tuner.scale_batch_size`` is refused by Lightning before the launch already)."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    world = getattr(strategy, "world_size", 1) or 1
    if not _callbacks_of(trainer, BatchSizeFinder) or world <= 1:
        return
    raise LayoutError(
        f"BatchSizeFinder searches the batch size in one process, and this run has {world} ranks (Lightning raises "
        "'not supported with distributed strategies' in each of them once started). Fix: find the batch size on "
        "one device (Trainer(devices=1) with the callback, or Tuner(trainer).scale_batch_size), then set the "
        "DataLoader's batch_size -- per data-parallel rank, so the global batch is batch_size x dp x "
        "accumulate_grad_batches.")


_STEP_METHODS = ("training_step", "validation_step", "test_step")
_PIPELINE_LOGS = ("train_loss", "val_loss", "test_loss")
_DECLARING_METHODS = ("configure_optimizers", "configure_callbacks")  # where a monitor is named, not logged


_NOT_LOGGERS = ("torch", "math", "np", "numpy", "F", "cmath")  # receivers of a .log() that is a logarithm


def _log_calls(function: Any) -> tuple[set[str], bool]:
    """The names ``function`` logs under as literals (``self.log("k", ...)``, ``pl_module.log_dict({"k": ...})``), and
    whether it logs anything under a name computed at run time (or its source cannot be read: then unknown)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return set(), True
    keys: set[str] = set()
    dynamic = False
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("log", "log_dict")):
            continue
        if isinstance(node.func.value, ast.Name) and node.func.value.id in _NOT_LOGGERS:
            continue
        first = node.args[0] if node.args else next(
            (k.value for k in node.keywords if k.arg in ("name", "dictionary")), None)
        if node.func.attr == "log" and isinstance(first, ast.Constant) and isinstance(first.value, str):
            keys.add(first.value)
        elif (node.func.attr == "log_dict" and isinstance(first, ast.Dict)
              and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in first.keys)):
            keys.update(k.value for k in first.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        else:
            dynamic = True
    return keys, dynamic


def own_functions(cls: type) -> list[tuple[str, Any]]:
    """``(name, function)`` of the methods defined by ``cls`` and its bases that are not Lightning's, torch's or the
    library's."""
    import inspect

    found: list[tuple[str, Any]] = []
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in ("lightning", "pytorch_lightning", "torch", "builtins",
                                              "lightning_parallel"):
            continue
        for name, member in vars(klass).items():
            function = getattr(member, "__func__", member)
            if inspect.isfunction(function):
                found.append((name, function))
    return found


def _logged_only_in_steps(module: Any, key: str, callbacks: list[Any]) -> list[str]:
    """The step methods (``training_step``, ``validation_step``, ``test_step``) of ``module``'s own classes that log
    ``key`` by name, when nothing else the run holds can log it: no other method of those classes (but
    ``configure_optimizers`` and ``configure_callbacks``, which name monitors) and no method of the user's own
    callbacks logs it by name or logs any name computed at run time. Empty otherwise (nothing is refused)."""
    steps: list[str] = []
    elsewhere: list[tuple[str, Any]] = []
    for name, function in own_functions(type(module)):
        if name in _STEP_METHODS:
            if key in _log_calls(function)[0] and name not in steps:
                steps.append(name)
        elif name not in _DECLARING_METHODS:
            elsewhere.append((name, function))
    if not steps:
        return []
    for callback in callbacks:
        elsewhere.extend(own_functions(type(callback)))
    for _, function in elsewhere:
        keys, dynamic = _log_calls(function)
        if dynamic or key in keys:
            return []
    return steps


def check_pipeline_monitors(strategy: Any, trainer: pl.Trainer | None) -> None:
    """Under a pipeline strategy (``lp_pipeline``, ``lp_hybrid``): the schedule runs the layers in place of the
    module's ``training_step`` / ``validation_step`` / ``test_step`` and logs ``train_loss``, ``val_loss`` and
    ``test_loss`` itself, so a value the module logs only in those methods does not exist. A callback
    (``EarlyStopping``, ``ModelCheckpoint``) or an LR scheduler (``ReduceLROnPlateau``'s ``monitor``, once the
    optimizers exist) that monitors such a value failed after the launch (``strict=True``) or skipped every update
    without a word (``strict=False``: the LR never fell). Refused before spawning -- and in the rank for the
    schedulers -- where the module's source shows the key logged only in those steps
    (:func:`_logged_only_in_steps`)."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    if not getattr(strategy, "pipelined", False) or module is None:
        return
    watchers = [(f"{type(c).__name__}(monitor={c.monitor!r})", c.monitor)
                for c in _callbacks_of(trainer, (EarlyStopping, ModelCheckpoint)) if getattr(c, "monitor", None)]
    watchers += [(f"the LR scheduler {type(config.scheduler).__name__} (monitor={config.monitor!r})", config.monitor)
                 for config in getattr(strategy, "lr_scheduler_configs", None) or [] if config.monitor]
    name = getattr(strategy, "strategy_name", type(strategy).__name__)
    callbacks = getattr(trainer, "callbacks", None) or []
    for who, key in watchers:
        if key in _PIPELINE_LOGS:
            continue
        # self.log(k, on_step=True, on_epoch=True) logs k_step and k_epoch
        base = key[:-len("_step")] if key.endswith("_step") else key[:-len("_epoch")] if key.endswith("_epoch") else key
        if base in _PIPELINE_LOGS:
            raise LayoutError(
                f"{who} watches '{key}', but under {name} the strategy logs '{base}' itself, under that name only "
                f"(train_loss on each step, val_loss and test_loss per epoch), so '{key}' never exists (Lightning "
                f"would skip the callback's saves or updates with a warning). Fix: monitor '{base}'.")
        steps = _logged_only_in_steps(module, key, callbacks) or (
            _logged_only_in_steps(module, base, callbacks) if base != key else [])
        if steps:
            raise LayoutError(
                f"{who} watches '{key}', which {type(module).__name__} logs only in {' and '.join(steps)}; under "
                f"{name} the pipeline schedule runs the layers in place of the module's training_step, "
                "validation_step and test_step, so that value is never logged (Lightning would fail after the "
                "launch, or with strict=False skip every update silently). The strategy logs train_loss, val_loss "
                f"and test_loss, one device's values. Fix: monitor one of those, log '{key}' from a hook the "
                "pipeline runs (on_train_batch_end gets the step's loss; on_validation_epoch_end), or use a strategy "
                "that runs the module's steps as written (lp_ddp, lp_sharded, lp_tensor).")


def check_finetuning_callbacks(strategy: Any, trainer: pl.Trainer | None) -> None:
    """Before spawning: Lightning's ``BaseFinetuning`` callbacks (``BackboneFinetuning``) read the optimizer's param
    groups parameter by parameter -- they look each one up by name and compare the parameters they unfreeze with
    those already there (``torch.equal``) before adding them as a new group -- which three kinds of layout cannot
    serve: the flat ZeRO-1/2 optimizers hold one flat shard per param group (a ``KeyError`` at the first epoch),
    tensor parallelism mixes DTensor and plain parameters or meshes (``torch.equal`` refuses them), and
    ``lp_zero_offload``'s DeepSpeed engine (Lightning refuses the callback there). Refused here, with the layouts that
    run it: ``lp_ddp`` (built again over the unfrozen parameters), ZeRO-3, pipelines without tensor parallelism."""
    from lightning.pytorch.callbacks import BaseFinetuning

    found = _callbacks_of(trainer, BaseFinetuning)
    if not found:
        return
    layout = getattr(strategy, "layout", None)
    name = getattr(strategy, "strategy_name", type(strategy).__name__)
    if not isinstance(layout, ParallelConfig):
        return
    zero, tp = layout.zero, layout.tensor_parallel_size
    plan = getattr(strategy, "data_parallel_plan", None)
    flat = callable(plan) and plan().sync in ("zero", "fairscale")  # the plan that picks the optimizer
    reason = ("the DeepSpeed engine owns the optimizer (Lightning refuses the callback under DeepSpeed)"
              if name == "lp_zero_offload" else
              f"tensor_parallel_size={tp}: the callback compares parameters with torch.equal, which refuses a mix of "
              "DTensor and plain parameters or of device meshes" if tp > 1 else
              f"zero_stage={zero} keeps one flat shard per param group in the optimizer, where the callback looks "
              "each parameter up by name" if flat else None)
    if reason is None:
        return
    raise LayoutError(
        f"{type(found[0]).__name__} (a BaseFinetuning callback: it unfreezes layers and adds them to the optimizer as "
        f"a new param group) cannot run under {name} ({layout.describe()}): {reason}. Fix: lp_ddp (torch DDP is "
        "built again over the unfrozen parameters), zero_stage=3 without tensor parallelism, or a pipeline without "
        "tensor parallelism and with zero_stage 0, 2 or 3; or keep every layer trainable and hold the frozen ones "
        "with a learning rate of 0 in their own param group.")


def check_weight_averaging_callbacks(strategy: Any, trainer: pl.Trainer | None) -> None:
    """Before spawning (and again in the rank): Lightning's ``StochasticWeightAveraging`` and ``WeightAveraging``
    (``EMAWeightAveraging``) keep a whole copy of the module and pair its parameters with the live ones one by one;
    where this rank's live parameters are not whole -- sharded by FSDP2 (ZeRO-3, a pipeline's ZeRO-2, HSDP), split
    over ``tp``, or only this pipeline stage's layers -- the pairing fails at the averaging's first update (after
    ``swa_epoch_start`` epochs of SWA), and under ``lp_zero_offload`` Lightning refuses SWA in the rank. Refused here
    with the layouts that run them (measured equal to one device: ``lp_ddp``, ZeRO-1/2, ``lp_dp``)."""
    from lightning.pytorch import callbacks as lightning_callbacks

    kinds = tuple(kind for name in ("StochasticWeightAveraging", "WeightAveraging")
                  if isinstance(kind := getattr(lightning_callbacks, name, None), type))
    found = _callbacks_of(trainer, kinds)
    layout = getattr(strategy, "layout", None)
    if not found or not isinstance(layout, ParallelConfig):
        return
    name = getattr(strategy, "strategy_name", type(strategy).__name__)
    plan = getattr(strategy, "data_parallel_plan", None)
    reason = ("DeepSpeed's engine owns the parameters (Lightning refuses the callback there)"
              if name == "lp_zero_offload" else
              f"tensor_parallel_size={layout.tensor_parallel_size} splits each layer over the tp ranks"
              if layout.tensor_parallel_size > 1 else
              f"pipeline_parallel_size={layout.pipeline_parallel_size}: each rank holds its stages' layers only"
              if layout.pipeline_parallel_size > 1 else
              f"zero_stage={layout.zero} shards every parameter over the dp ranks (FSDP2)"
              if callable(plan) and plan().sync == "fsdp" else None)
    if reason is None:
        return
    raise LayoutError(
        f"{type(found[0]).__name__} keeps a whole copy of the module and averages the live parameters into it one by "
        f"one, which cannot run under {name} ({layout.describe()}): {reason}. Fix: lp_ddp, or lp_sharded with "
        "zero_stage 1 or 2 (each rank holds whole parameters; measured equal to one device), or drop the callback.")


def check_overfit_batches(strategy: Any, trainer: pl.Trainer | None) -> None:
    """Before spawning: ``overfit_batches`` with ``use_distributed_sampler=False`` over dp > 1. Lightning replaces the
    training sampler with a sequential one over the whole dataset -- a ``DistributedSampler`` of the data module's
    own (the library's resumable data modules', the fixed-order recipe's) included -- so every dp rank trains on the
    same batches and the step counts each sample dp times (a tiny GPT, 6 SGD steps, dp=2: 8.0e-02 from one device).
    With Lightning's own sampler it splits the overfit batches over the ranks and equals one device."""
    overfit = getattr(trainer, "overfit_batches", 0) or 0
    connector = getattr(trainer, "_accelerator_connector", None)
    dims = getattr(strategy, "dims", None)
    replicas = getattr(dims, "dp", 1) if dims is not None else 1  # what samplers split over (cp ranks share batches)
    if not overfit or connector is None or connector.use_distributed_sampler or replicas <= 1:
        return
    raise LayoutError(
        f"trainer.overfit_batches={overfit} with use_distributed_sampler=False over {replicas} data-parallel replicas: "
        "Lightning replaces the training sampler with a sequential one over the whole dataset (the data module's "
        "own DistributedSampler included), so every replica would train on the same batches. Fix: "
        "use_distributed_sampler=True for the overfit run (Lightning then splits the batches over the replicas), "
        "or overfit on one device.")


def preflight(strategy: Any, trainer: pl.Trainer | None, args: tuple[Any, ...] = ()) -> None:
    """Everything checked before any rank starts, for ``trainer.fit(*args)`` (the checked launchers,
    ``lightning-parallel check``, and the CLI for strategies without a checked launcher): the module against the
    layout, the strategy's own data rules (with one real batch), ``parallel.global_batch_size`` (the accumulation it
    sets, or the refusal of a world that cannot keep it), the training DataLoader's length, the output
    folders, leftovers of interrupted saves, and ``ckpt_path`` against the module and its optimizers."""
    module = trainer.lightning_module if trainer is not None else (args[0] if args else None)
    check_module = getattr(strategy, "check_module", None)
    if module is not None and callable(check_module):
        check_module(module)
    fitting = trainer is None or trainer.state.fn == "fit"
    if not fitting:
        check_evaluation_data(trainer, module, args)
        check_evaluation_ckpt(strategy, trainer, module, args)
        return
    check_nonfinite_guard(strategy, trainer)
    check_callbacks(strategy, trainer)
    check_pipeline_monitors(strategy, trainer)
    check_overfit_batches(strategy, trainer)
    check_layer_sync(strategy)
    check_detect_anomaly(strategy, trainer)
    # A rank a launcher started after these checks passed in the launching process (Lightning's popen launcher
    # re-runs the script with LOCAL_RANK > 0) skips what reads the data and the checkpoint: done once per node.
    first = int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
    probe = TrainingDataProbe(args if first else (), module=module, trainer=trainer)
    check_data = getattr(strategy, "check_data", None)
    if callable(check_data):
        check_data(args, probe=probe)  # the arguments of trainer.fit (model, dataloaders, datamodule, ckpt_path)
    from lightning_parallel.callbacks.global_batch import apply_global_batch

    apply_global_batch(strategy, trainer, args)  # parallel.global_batch_size -> accumulate_grad_batches (every rank)
    check_last = getattr(strategy, "check_last_training_batch", None)
    if callable(check_last):  # (a pipeline's: the accumulation known now)
        check_last(probe)
    check_data_modules(strategy, trainer, args, probe=probe)
    check_output_dirs(trainer)
    if first:
        report_interrupted_saves(trainer)
    if len(args) > 4:
        from lightning.pytorch.callbacks import BaseFinetuning

        check_ckpt_path(strategy, args[4], module=module if first else None,
                        finetuning=_callbacks_of(trainer, BaseFinetuning))


def _before_launch(strategy: Any, trainer: pl.Trainer | None, args: tuple[Any, ...] = ()) -> None:
    preflight(strategy, trainer, args)
    devices = getattr(strategy, "parallel_devices", None) or []
    warning = oversubscription_warning(processes=len(devices), device_type=devices[0].type if devices else "cpu",
                                       cores=os.cpu_count())
    if warning and getattr(strategy, "global_rank", 0) == 0:
        rank_zero_warn(warning)
    prepare = getattr(strategy, "before_launch", None)
    if callable(prepare):
        prepare()
