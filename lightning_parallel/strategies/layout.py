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
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_parallel.config import LayoutError, ParallelConfig, check_model_compat
from lightning_parallel.layouts import refusal
from lightning_parallel.parallel.dims import ParallelDims, RankCoords
from lightning_parallel.parallel.faults.watchdog import enable_fault_handler

__all__ = ["CheckedMultiProcessingLauncher", "CheckedSubprocessLauncher", "LayoutMixin", "check_data_modules",
           "clip_by_norm_replaced", "oversubscription_warning"]


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
        environment = getattr(self, "cluster_environment", None)
        assert environment is not None
        start_method: Any = getattr(self, "_start_method", "popen")
        launcher: Any
        if start_method == "popen":
            launcher = CheckedSubprocessLauncher(self, environment, self.num_processes, self.num_nodes)
        else:
            launcher = CheckedMultiProcessingLauncher(self, start_method=start_method)
        self._launcher = launcher

    def check_layout(self, layout: ParallelConfig) -> None:
        """Refuse, before anything starts, a layout outside this strategy's row of the layout table
        (:func:`lightning_parallel.layouts.refusal`: the key, the value, what the strategy runs and the strategy that
        runs the layout). Subclasses add only their own rules."""
        why = refusal(self.strategy_name, layout, preset=self.preset)
        if why:
            raise LayoutError(why)

    def check_module(self, module: pl.LightningModule) -> None:
        """Refuse, before spawning, a module whose shape does not fit the layout (heads % tp, layers >= pp), or that
        lacks the hook its activation checkpointing needs (the error names the hook)."""
        shape_fn = getattr(module, "parallel_shape", None)
        shape = shape_fn() if callable(shape_fn) else {}
        check_model_compat(self.layout, **{k: shape[k] for k in self.shape_checks if k in shape})
        if self.layout.activation_checkpointing != "none":
            from lightning_parallel.parallel.activation_checkpointing import activation_checkpointing_targets

            activation_checkpointing_targets(module, self.layout.activation_checkpointing)

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
        """Resolve the layout against :attr:`layout_world_size`; :class:`LayoutError` with the arithmetic."""
        if self.num_processes < 1:
            raise LayoutError(f"{type(self).__name__} needs at least one device, got parallel_devices=[].")
        self._dims = ParallelDims.from_config(
            self.layout, world_size=self.layout_world_size, devices_per_node=self.num_processes,
            num_nodes=self.num_nodes,
        )
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
        enable_fault_handler()  # in the rank, first thing
        super()._wrapping_function(process_idx, *args, **kwargs)

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: pl.Trainer) -> None:
        """Lightning's, plus: a module the main process built on the meta device (a pipeline's large-model path)
        takes the trained weights as its tensors (``assign=True``) instead of ignoring them."""
        module = trainer.lightning_module
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
def clip_by_norm_replaced(precision: Any, clip: Callable[[Any, float], None]) -> Generator[None, None, None]:
    """Route Lightning's ``gradient_clip_val`` (by norm) to ``clip(raw_optimizer, clip_val)`` while the context is
    open (a strategy's set-up to teardown), then restore the precision plugin's own method.

    Lightning clips ``precision.main_params(optimizer)`` by their *local* norm; under sharding (ZeRO shards, tensor
    shards) the norm of the whole gradient needs a reduction over the right axes, which only the strategy knows.
    ``clip`` receives the unwrapped optimizer and the clip value.
    """
    original = precision.clip_grad_by_norm

    def clip_grad_by_norm(optimizer: Any, clip_val: float | int) -> None:
        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        clip(raw, float(clip_val))

    shadowed = "clip_grad_by_norm" in vars(precision)
    precision.clip_grad_by_norm = clip_grad_by_norm
    try:
        yield None
    finally:
        if shadowed:
            precision.clip_grad_by_norm = original
        else:
            del precision.clip_grad_by_norm


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


def check_ckpt_path(strategy: Any, ckpt_path: Any) -> None:
    """Before spawning: a ``ckpt_path`` given as a path must exist, and the strategy must be able to resume its kind
    (``check_resume_source(path)`` where the strategy defines it). Lightning's keywords (``last``, ``best``, ...)
    are resolved later, in the ranks."""
    from lightning_parallel.checkpoint.formats import CheckpointFormatError

    if not isinstance(ckpt_path, (str, os.PathLike)):
        return
    text = str(ckpt_path)
    if text in ("last", "best", "hpc") or text.startswith("registry"):
        return
    if "://" not in text and not os.path.exists(text):
        raise CheckpointFormatError(f"--ckpt_path {text}: no such file or folder. Fix: give the path of a checkpoint "
                                    "(a .ckpt file or folder trainer.save_checkpoint wrote), or 'last'.")
    check = getattr(strategy, "check_resume_source", None)
    if callable(check) and "://" not in text:
        check(text)


def check_data_modules(strategy: Any, trainer: pl.Trainer | None, args: tuple[Any, ...]) -> None:
    """Before spawning: every data module among ``trainer.fit``'s arguments that defines ``check_before_launch``
    (:class:`~lightning_parallel.data.TextDataModule` does) checks its data against the data-parallel size (a missing
    or empty path, a corpus smaller than one batch per rank), once, in the launching process."""
    dims = getattr(strategy, "_dims", None)
    dp = int(getattr(dims, "dp", 0) or 0) or int(getattr(strategy, "num_processes", 1) or 1) * int(
        getattr(strategy, "num_nodes", 1) or 1)
    module = trainer.lightning_module if trainer is not None else None
    for arg in args:
        check = getattr(arg, "check_before_launch", None) if isinstance(arg, pl.LightningDataModule) else None
        if callable(check):
            check(data_parallel_size=dp, model=module)


def _before_launch(strategy: Any, trainer: pl.Trainer | None, args: tuple[Any, ...] = ()) -> None:
    if trainer is not None and trainer.lightning_module is not None:
        strategy.check_module(trainer.lightning_module)
    check_data = getattr(strategy, "check_data", None)
    fitting = trainer is not None and trainer.state.fn == "fit"
    if callable(check_data) and fitting:
        check_data(args)  # the arguments of trainer.fit (model, dataloaders, datamodule, ckpt_path)
    if fitting:
        from lightning_parallel.callbacks.global_batch import apply_global_batch

        apply_global_batch(strategy, trainer, args)  # parallel.global_batch_size -> accumulate_grad_batches
        check_data_modules(strategy, trainer, args)
    if fitting and len(args) > 4:
        check_ckpt_path(strategy, args[4])
    devices = getattr(strategy, "parallel_devices", None) or []
    warning = oversubscription_warning(processes=len(devices), device_type=devices[0].type if devices else "cpu",
                                       cores=os.cpu_count())
    if warning and getattr(strategy, "global_rank", 0) == 0:
        rank_zero_warn(warning)
    prepare = getattr(strategy, "before_launch", None)
    if callable(prepare):
        prepare()
