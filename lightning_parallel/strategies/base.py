"""``LayoutStrategy``: the one base that turns a parallel layout into a DeviceMesh for Lightning.

Every process-based strategy of the library is a preset of this class: it takes a
:class:`~lightning_parallel.config.ParallelConfig`, resolves it against the world size (``devices x num_nodes``)
when Lightning configures the launcher -- in ``Trainer.__init__``, before any process is spawned -- and refuses a
layout that does not fit with the arithmetic and the fix. The module is checked against the layout (heads % tp,
layers >= pp) when ``fit`` launches, again before spawning. In each process it builds the named
``("dp", "pp", "tp")`` mesh right after the default process group, and gives the DataLoader sampler the rank and size
of the ``dp`` axis only (pipeline and tensor peers see the same batch).

How the model is wrapped (the gradient sync over ``dp``) is the subclass's :meth:`wrap_model`: torch DDP for plain
data-parallel layouts (``lp_ddp``), other engines where DDP cannot serve.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_parallel.config import LayoutError, ParallelConfig, check_model_compat
from lightning_parallel.parallel.dims import ParallelDims, RankCoords

__all__ = ["LayoutStrategy"]

# Which strategy runs a layout that sets this key (for refusals).
_STRATEGY_FOR_KEY = {
    "pipeline_parallel_size": "lp_pipeline or lp_hybrid (DP+PP+TP+ZeRO-1)",
    "tensor_parallel_size": "lp_tensor or lp_hybrid",
    "zero_stage": "lp_sharded",
    "offload": "lp_zero_offload",
}


class LayoutStrategy(DDPStrategy):
    """Base strategy: a parallel layout -> resolved degrees -> named DeviceMesh -> a wrapped model.

    Args:
        parallel: the layout (a ``ParallelConfig`` or a mapping with its keys); None = all ranks data parallel.
        start_method: how Lightning starts the ranks: ``popen`` (re-runs the script, like ``torchrun``), ``spawn``,
            ``fork`` (cheapest inside an already-imported process; CPU only).
        timeout: timeout of every collective, so a failing rank cannot leave the others hanging forever.
        kwargs: passed to Lightning's ``DDPStrategy`` (accelerator, parallel_devices, cluster_environment, ...).
    """

    strategy_name = "lp_layout"

    def __init__(
        self,
        parallel: ParallelConfig | dict[str, Any] | None = None,
        *,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(start_method=start_method, timeout=timeout, **kwargs)
        self._layout = ParallelConfig.from_dict(parallel)
        self.check_layout(self._layout)
        self._dims: ParallelDims | None = None
        self._mesh: DeviceMesh | None = None

    # ------------------------------------------------------------------ the layout
    @property
    def layout(self) -> ParallelConfig:
        return self._layout

    def set_layout(self, parallel: ParallelConfig | dict[str, Any]) -> None:
        """Replace the layout (the CLI's ``parallel`` section); only before the Trainer is built."""
        self._layout = ParallelConfig.from_dict(parallel)
        self.check_layout(self._layout)
        self._dims = None

    def check_layout(self, layout: ParallelConfig) -> None:
        """Presets override this to refuse layouts they do not run (the base runs what its subclass wraps)."""

    def refuse_keys(self, layout: ParallelConfig, keys: tuple[str, ...], *, shape: str) -> None:
        """Refuse a layout that sets any of ``keys`` away from its default, naming the strategy that runs it.

        ``shape`` says what this strategy runs, e.g. ``"replicates the whole model on every rank (N, 1, 1, 0)"``.
        """
        default = ParallelConfig()
        for key in keys:
            value = getattr(layout, key)
            if value != getattr(default, key):
                raise LayoutError(
                    f"{self.strategy_name} {shape}, but parallel.{key}={value!r}. Fix: use strategy "
                    f"{_STRATEGY_FOR_KEY[key]}, or set {key} back to its default."
                )

    def check_module(self, module: pl.LightningModule) -> None:
        """Refuse, before spawning, a module whose shape does not fit the layout (heads % tp, layers >= pp)."""
        shape_fn = getattr(module, "parallel_shape", None)
        shape = shape_fn() if callable(shape_fn) else {}
        check_model_compat(self._layout, **{k: shape[k] for k in ("n_layer", "n_head", "vocab_size") if k in shape})

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def dims(self) -> ParallelDims:
        """The layout resolved against this Trainer's world size (devices x num_nodes)."""
        if self._dims is None:
            self._dims = ParallelDims.from_config(
                self._layout, world_size=self.world_size, devices_per_node=self.num_processes,
                num_nodes=self.num_nodes,
            )
        return self._dims

    @property
    def coords(self) -> RankCoords:
        """This process's ``(dp, pp, tp)`` coordinates."""
        return self.dims.coords(self.global_rank)

    @property
    def mesh(self) -> DeviceMesh:
        """The named ``("dp", "pp", "tp")`` mesh; exists after the process group is set up."""
        if self._mesh is None:
            raise RuntimeError(f"{type(self).__name__}.mesh is built in setup_environment(); it does not exist yet.")
        return self._mesh

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def _configure_launcher(self) -> None:
        if self.num_processes < 1:
            raise LayoutError(f"{type(self).__name__} needs at least one device, got parallel_devices=[].")
        self._dims = None
        _ = self.dims  # resolve now: Trainer.__init__, before any process exists
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _CheckedSubprocessLauncher(self, self.cluster_environment, self.num_processes,
                                                        self.num_nodes)
        else:
            self._launcher = _CheckedMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # initializes the default process group
        self._mesh = self.dims.build_mesh(self.root_device.type)
        # Lightning leaves the process group alive after fit (a script may go on to test). Tear it down before the
        # interpreter finalizes, so the backend's threads are joined in order rather than destroyed at exit.
        atexit.unregister(_destroy_process_group_at_exit)
        atexit.register(_destroy_process_group_at_exit)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.dims.dp, "rank": self.coords.dp}

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        return self.wrap_model(model)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Wrap the module for training under the layout; subclasses choose the dp-axis gradient sync."""
        raise NotImplementedError(f"{type(self).__name__} must implement wrap_model().")

    @override
    def teardown(self) -> None:
        super().teardown()
        self._mesh = None

    def describe(self) -> str:
        dims = self._dims.describe() if self._dims is not None else self._layout.describe()
        return f"{self.strategy_name} ({dims})"


def _destroy_process_group_at_exit() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _CheckedSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher, checking the module against the layout before the other ranks start."""

    def __init__(self, strategy: LayoutStrategy, *args: Any) -> None:
        super().__init__(*args)
        self._lp_strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None and trainer.lightning_module is not None:
            self._lp_strategy.check_module(trainer.lightning_module)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _CheckedMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, checking the module against the layout before spawning."""

    def __init__(self, strategy: LayoutStrategy, start_method: str) -> None:
        super().__init__(strategy, start_method=start_method)  # type: ignore[arg-type]
        self._lp_strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None and trainer.lightning_module is not None:
            self._lp_strategy.check_module(trainer.lightning_module)
        return super().launch(function, *args, trainer=trainer, **kwargs)
