"""``lp_zero_offload``: DeepSpeed ZeRO-2/3 with CPU or NVMe offload, on CUDA and on CPU (gloo).

A different engine in kind: the DeepSpeed engine owns the data-parallel collectives, so this subclasses Lightning's
``DeepSpeedStrategy`` (engine wrapping, checkpoint folders, launchers) rather than ``LayoutStrategy``, but shares its
layout machinery (:class:`~lightning_parallel.strategies.layout.LayoutMixin`): the same ``parallel=`` layout, resolved
against ``devices x num_nodes`` before any process starts (``data_parallel_size`` must be the world size: the engine is
data parallel only), and the run summary from the resolved dims. The layout is the source of truth for
``zero_stage`` and ``offload``; presets fill them only when the layout leaves them unset, and an explicit value runs as
written (``offload: none`` is DeepSpeed ZeRO without offload, with the module's own optimizer):

* ``lp_zero_offload``: stage and offload from the layout; by default stage 2 with the optimizer offloaded to CPU --
  per rank the device keeps the parameters (``p Psi``) and gradient buckets; the host keeps 1/N_d of the fp32 master
  weights, Adam moments and an fp32 gradient partition and runs CPU Adam. Backward reduce-scatters gradients
  (buckets, overlapped with ``overlap_comm``) and copies the partition to the host; after the host step the updated
  weights are all-gathered.
* ``lp_zero3_offload``: stage 3, optimizer and parameters on CPU -- the device holds only the gathered layers in
  flight: each layer's parameters are all-gathered before its forward and its backward, gradients reduce-scattered.
* ``lp_zero3_offload_nvme``: stage 3 with both on NVMe under ``parallel.nvme_path`` (ZeRO-Infinity, needs libaio).

CPU runs use DeepSpeed's CPU accelerator over gloo; ``root_device`` is ``cpu:<local_rank>``. Checkpoints are the
engine's folders; NVMe-offloaded state, which DeepSpeed 0.19.8 neither saves nor restores, is written per rank next
to them and restored and verified on resume (:mod:`lightning_parallel.checkpoint.formats.deepspeed`).
:meth:`LPZeroOffloadStrategy.consolidated_state_dict` and :func:`convert_to_fp32_state_dict` give one fp32 state
dict that loads on one device.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Generator
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.deepspeed import _validate_device_index_selection
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators.cuda import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.checkpoint.formats import deepspeed as deepspeed_format
from lightning_parallel.checkpoint.formats.deepspeed import convert_to_fp32_state_dict
from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.layouts import refusal
from lightning_parallel.parallel.faults import interrupts
from lightning_parallel.parallel.offload import (
    LIBAIO_HELP,
    OffloadConfigError,
    OffloadEngineConfig,
    OpsUnavailableError,
    build_engine,
    check_batch_sizes,
    consolidated_state_dict,
    ensure_ops,
    libaio_available,
    load_deepspeed_config,
    offload_targets,
    required_ops,
)
from lightning_parallel.parallel.offload.config import check_nvme_folder

from .base import resolve_collective_timeout
from .layout import LayoutMixin
from .resumable import ResumableDataMixin

__all__ = ["LPZeroOffloadStrategy", "convert_to_fp32_state_dict"]

_DEFAULT_STAGE, _DEFAULT_OFFLOAD = 2, "cpu"


class LPZeroOffloadStrategy(LayoutMixin, ResumableDataMixin, DeepSpeedStrategy):
    """DeepSpeed ZeRO with offload, configured by a layout plus typed DeepSpeed keys.

    Args:
        parallel: the layout (``ParallelConfig`` or mapping): ``zero_stage`` 1-3, ``offload`` none|cpu|nvme,
            ``nvme_path``; pp = tp = 1. Stage/offload left unset take ``zero_stage``/``offload`` below.
        zero_stage, offload: the preset's stage and offload target (a layout that names others is an error).
        zero_optimization: typed ``zero_optimization`` keys in DeepSpeed's names (``overlap_comm``,
            ``reduce_bucket_size``, ``offload_optimizer.pin_memory``, ``sub_group_size``, ...); unknown keys are
            refused with the nearest name. ``stage`` and the offload ``device``s come from the layout.
        aio: typed ``aio`` keys (NVMe I/O: ``block_size``, ``queue_depth``, ...).
        config: a whole DeepSpeed config (JSON path or dict) used as the base; typed keys override it, and a base
            that contradicts the layout or the run (stage, offload device, batch sizes) is refused.
        start_method: ``popen`` (re-run the script per rank, like torchrun), ``spawn`` or ``fork`` (cheapest inside
            an already-imported process; CPU only).
        timeout: timeout of every collective.
        kwargs: passed to Lightning's ``DeepSpeedStrategy`` (accelerator, parallel_devices, cluster_environment,
            precision_plugin, process_group_backend, logging_level, load_full_weights, ...).
    """

    _nonfinite_guard: Any = None
    """The Trainer's non-finite-loss guard of the current fit (set when training starts)."""

    strategy_name = "lp_zero_offload"

    def __init__(
        self,
        parallel: ParallelConfig | dict[str, Any] | None = None,
        *,
        zero_stage: int | None = None,
        offload: Literal["none", "cpu", "nvme"] | None = None,
        zero_optimization: dict[str, Any] | None = None,
        aio: dict[str, Any] | None = None,
        config: str | Path | dict[str, Any] | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        timeout: timedelta | None = None,
        logging_level: int = logging.WARN,
        **kwargs: Any,
    ) -> None:
        if zero_stage is not None and zero_stage not in (1, 2, 3):
            raise LayoutError(f"zero_stage={zero_stage!r} must be 1, 2 or 3 (0 is plain DDP: use lp_ddp).")
        if offload is not None and offload not in ("none", "cpu", "nvme"):
            raise LayoutError(f"offload={offload!r} is not one of ['none', 'cpu', 'nvme'].")
        self.pinned = {k: v for k, v in (("zero_stage", zero_stage), ("offload", offload)) if v is not None}
        self.preset = {"zero_stage": zero_stage if zero_stage is not None else _DEFAULT_STAGE,
                       "offload": offload if offload is not None else _DEFAULT_OFFLOAD}
        typed: dict[str, Any] = {}
        if zero_optimization:
            typed["zero_optimization"] = dict(zero_optimization)
        if aio:
            typed["aio"] = dict(aio)
        self._typed = OffloadEngineConfig.from_dict(typed)
        self._base = load_deepspeed_config(config)
        self.init_layout(parallel)
        self._timeout_given = timeout
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise LayoutError(
                "lp_zero_offload runs on DeepSpeed's engine, which is not installed in this environment. Fix: pip "
                "install 'lightning-parallel[deepspeed]' (scripts/_env.sh builds it and its ops), or ZeRO without "
                "offload under lp_sharded (zero_stage 1-3), which needs no DeepSpeed.")
        super().__init__(config=self._effective_config(), timeout=timeout or default_pg_timeout,
                         logging_level=logging_level, **kwargs)
        self._start_method = start_method
        self._final_state: dict[str, torch.Tensor] | None = None
        self.ops_built: dict[str, float] = {}
        """Seconds spent building each DeepSpeed op in this process (empty when all were cached)."""

    # ------------------------------------------------------------------ the layout
    @override
    def init_layout(self, parallel: ParallelConfig | dict[str, Any] | None) -> None:
        """An explicit stage 0 is refused first (before the preset's offload meets it); then the mixin's checks."""
        given = ParallelConfig.from_dict(parallel)
        why = refusal(self.strategy_name, given, keys=("zero_stage",), preset=self.preset)
        if why:  # before the preset's offload meets it: the fix is another strategy
            raise LayoutError(why)
        super().init_layout(given)

    @override
    def set_layout(self, parallel: ParallelConfig | dict[str, Any]) -> None:
        """Replace the layout (the CLI's ``parallel`` section); only before the Trainer is built."""
        self.init_layout(parallel)
        self.config = self._effective_config()
        self._config_initialized = False

    @override
    def check_layout(self, layout: ParallelConfig) -> None:
        """Refuse, before anything starts: what its row of the layout table does not run (pp/tp > 1, stage 0), NVMe
        below stage 3, NVMe without libaio."""
        super().check_layout(layout)
        if layout.reshard_after_forward != "auto":
            raise LayoutError(
                f"parallel.reshard_after_forward={layout.reshard_after_forward} is an FSDP2 setting; "
                f"{self.strategy_name} runs DeepSpeed's engine, which decides that itself. Fix: remove it.")
        if layout.reduce_each_batch:
            raise LayoutError(
                f"parallel.reduce_each_batch=true: {self.strategy_name} runs DeepSpeed's engine, which reduces each "
                "accumulated batch's gradient already. Fix: remove it.")
        if layout.data_parallel_shard_size is not None:
            raise LayoutError(
                f"{self.strategy_name} runs DeepSpeed's ZeRO over the whole dp axis, but parallel."
                f"data_parallel_shard_size={layout.data_parallel_shard_size} asks for HSDP (FSDP2 over replicate x "
                "shard groups). Fix: remove data_parallel_shard_size, or use strategy lp_sharded (zero_stage 2 or 3) "
                "for HSDP without offload.")
        if layout.offload_device == "nvme" and not layout.nvme_path:
            raise LayoutError(
                "NVMe offload needs parallel.nvme_path: a folder on a fast local disk the swapper writes into."
            )
        if layout.offload_device == "nvme" and layout.nvme_path:
            check_nvme_folder(layout.nvme_path)  # created when missing; before any op build or rank
        if layout.offload_device == "nvme" and layout.zero != 3:
            raise LayoutError(
                f"parallel.offload='nvme' needs zero_stage=3 (ZeRO-Infinity); DeepSpeed offloads to NVMe only at "
                f"stage 3, got zero_stage={layout.zero}. Fix: zero_stage=3, or offload='cpu'."
            )
        if layout.offload_device != "none" and layout.zero < 2:
            raise LayoutError(
                f"parallel.offload={layout.offload_device!r} needs ZeRO stage 2 or 3, but zero_stage={layout.zero}. "
                "Fix: zero_stage=2 (optimizer offload) or zero_stage=3 (optimizer and parameter offload)."
            )
        if layout.offload_device == "nvme" and not libaio_available():
            raise OpsUnavailableError(LIBAIO_HELP)

    # ------------------------------------------------------------------ the DeepSpeed config
    def _effective_config(self) -> dict[str, Any]:
        """Typed defaults < base DeepSpeed config < explicit typed keys < the layout's stage/offload/nvme_path."""
        layout = self._layout
        param_device = layout.offload_device if layout.zero == 3 else "none"
        explicit_param = self._typed.explicit_dict().get("zero_optimization", {}).get("offload_param", {})
        if "device" in explicit_param and layout.zero == 3:
            param_device = explicit_param["device"]  # stage 3 may keep parameters on the device: 'none'
        from_layout: dict[str, Any] = {"stage": layout.zero, "offload_optimizer": {"device": layout.offload_device},
                       "offload_param": {"device": param_device}}
        self._check_agrees(from_layout, param_device)
        if layout.nvme_path:
            from_layout["offload_optimizer"]["nvme_path"] = layout.nvme_path
            from_layout["offload_param"]["nvme_path"] = layout.nvme_path
        typed = self._typed.replace({"zero_optimization": from_layout})
        cfg = typed.to_deepspeed(self._base)
        zero = cfg["zero_optimization"]
        for key in ("offload_optimizer", "offload_param"):
            if zero[key]["device"] == "none":
                del zero[key]
        if layout.zero < 3:
            zero.pop("offload_param", None)
        return cfg

    def _check_agrees(self, from_layout: dict[str, Any], param_device: str) -> None:
        for source, cfg in (("zero_optimization=", self._typed.explicit_dict()), ("the DeepSpeed config", self._base)):
            stage, opt, par = offload_targets({"zero_optimization": {"stage": from_layout["stage"],
                                                                     **(cfg.get("zero_optimization") or {})}})
            if stage != from_layout["stage"]:
                raise OffloadConfigError(
                    f"{source} sets zero_optimization.stage={stage}, but the layout says zero_stage="
                    f"{from_layout['stage']}. Fix: set parallel.zero_stage (the layout is the source of truth)."
                )
            given = (cfg.get("zero_optimization") or {}).get("offload_optimizer", {}).get("device")
            if given is not None and given != from_layout["offload_optimizer"]["device"]:
                raise OffloadConfigError(
                    f"{source} sets zero_optimization.offload_optimizer.device={opt!r}, but the layout says "
                    f"offload={from_layout['offload_optimizer']['device']!r}. Fix: set parallel.offload."
                )
            given = (cfg.get("zero_optimization") or {}).get("offload_param", {}).get("device")
            if given is not None and given not in (param_device, "none"):
                raise OffloadConfigError(
                    f"{source} sets zero_optimization.offload_param.device={par!r}, but the layout says "
                    f"offload={self._layout.offload_device!r}. Fix: set parallel.offload (or offload_param.device: "
                    "none to keep stage-3 parameters on the device)."
                )

    @override
    def _format_batch_size_and_grad_accum_config(self) -> None:
        """Pass the Trainer's accumulation, the DataLoader's batch and ``gradient_clip_val`` to the engine; refuse
        a DeepSpeed config that disagrees (never rewrite it silently)."""
        assert isinstance(self.config, dict)
        if self.lightning_module is None:
            return
        trainer = self.lightning_module.trainer
        accumulation = int(trainer.accumulate_grad_batches)
        micro = self._auto_select_batch_size() if trainer.fit_loop._data_source.is_defined() else None
        check_batch_sizes(self.config, micro_batch=micro, accumulation=accumulation, world_size=self.world_size)
        self.config["gradient_accumulation_steps"] = accumulation
        self.config.setdefault("train_micro_batch_size_per_gpu", micro or 1)
        clip = trainer.gradient_clip_val
        given = self.config.get("gradient_clipping")
        if given is not None and clip is not None and float(given) != float(clip):
            raise OffloadConfigError(
                f"the DeepSpeed config sets gradient_clipping={given}, but Trainer(gradient_clip_val={clip}). "
                "Fix: set one of them (the engine clips the global gradient norm)."
            )
        self.config["gradient_clipping"] = float(given if given is not None else (clip or 0.0))

    # ------------------------------------------------------------------ processes and devices
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        device = self.parallel_devices[self.local_rank]
        return torch.device("cpu", self.local_rank) if device.type == "cpu" else device

    def _on_cpu(self) -> bool:
        return not isinstance(self.accelerator, CUDAAccelerator)

    @override
    def check_launch(self) -> None:
        """Before any process exists: a precision DeepSpeed would not honour is refused."""
        self.check_precision()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``training_step``; the values it logs are combined over the (data-parallel) world first, so
        the logged curve is one device's (:mod:`lightning_parallel.strategies.logged`)."""
        from lightning_parallel.parallel.step import reduce_logged_batch

        from .logged import training_step_agreed

        self._follow_the_loops_window()
        size = self.world_size

        def reduce(values: Any, extra: torch.Tensor | None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
            return reduce_logged_batch(values, group=None, size=size, extra=extra)

        window = self.step_tokens.take() if self.step_tokens is not None else None  # one per training batch
        tokens = self._batch_tokens(args[0] if args else kwargs.get("batch"), window)
        return training_step_agreed(self.lightning_module, lambda: super(LPZeroOffloadStrategy, self).training_step(
            *args, **kwargs), reduce if size > 1 else None, self._nonfinite_guard if size > 1 else None, tokens=tokens)

    def _batch_tokens(self, batch: Any, window: tuple[int, int] | None) -> Any:
        """With the module's token labels named (``context_parallel_plan()['labels']``) under automatic
        optimization: this rank's token weighing (:class:`~lightning_parallel.strategies.logged.TokenWeights`):
        its mean-logged values multiplied by ``dp x n_rank / N_batch`` and its loss by ``dp x n_rank / N_batch`` or,
        with an accumulation window (``window``: this rank's counted tokens of the step's batches, read ahead),
        ``k x dp x n_rank / N_step`` (``k`` the window's batches) -- the counts summed in the step's all-reduce of
        its logged values -- so every
        counted token of the step weighs as on one device; None otherwise."""
        from lightning_parallel.parallel.context_parallel import counted_tokens

        from .logged import TokenWeights

        module = self.lightning_module
        if module is None or batch is None or not module.automatic_optimization:  # manual: its own backward
            return None
        labels = self.token_labels()
        if labels is None:
            return None
        step = window if window is not None and window[1] > 1 else None
        if self.world_size == 1 and step is None:
            return None
        count = counted_tokens(batch, labels)
        return TokenWeights(local=count * self.world_size, count=count, dp=self.world_size,
                            accumulation=1 if step is None else step[1],
                            window=None if step is None else torch.full((1,), float(step[0]), device=count.device))

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning's loop decides where an optimizer step ends, as on one device (a short window at an
        epoch's end steps too) and calls the engine's ``step`` there only; :meth:`_follow_the_loops_window` hands
        the engine that decision. Lightning's DeepSpeed strategy lets the engine decide by its own count instead,
        which runs across epochs: with an epoch of an odd number of batches and windows of 2, every window after
        the first epoch held the last batch of one epoch and the first of the next (9.2e-3 from one device after
        7 steps, measured)."""
        return False

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: the engine reduces at the window's end by the boundary it is given (ZeRO-0/1) or
        reduces each micro-batch's gradients into its partitions (ZeRO-2/3, whose ``no_sync`` refuses to run)."""
        yield None

    def _follow_the_loops_window(self) -> None:
        """Before a training batch: tell the engine whether this batch ends an optimizer step, as Lightning's loop
        decided it (``not fit_loop._should_accumulate()``). The engine's own rule counts its micro-steps since it was
        built, and a resumed engine starts that count at 0: from a checkpoint written inside an accumulation window
        (after a validation whose ``val_check_interval`` is not a multiple of the accumulation) the engine stepped one
        batch after Lightning did, every window of the resumed run shifted by one batch (1.3e-2 from one device's
        resume)."""
        module = self.lightning_module
        set_boundary = getattr(self.model, "set_gradient_accumulation_boundary", None)
        if module is None or not module.automatic_optimization or not callable(set_boundary):
            return
        set_boundary(not module.trainer.fit_loop._should_accumulate())

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
                 ) -> torch.Tensor:
        """DeepSpeed's ``engine.backward`` without its own division by ``gradient_accumulation_steps``: Lightning's
        loop has already divided the loss by ``accumulate_grad_batches``; dividing again scaled every accumulated
        gradient by 1/a^2, which Adam nearly hides but clipping and the optimizer's epsilon do not (4.9e-4 off one
        device after 10 steps with accumulation 2 and clipping 0.5, measured)."""
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def check_precision(self) -> None:
        """Refuse, before any process starts, a precision DeepSpeed would not honour: ``bf16-true``/``16-true`` --
        DeepSpeed's ZeRO keeps fp32 master weights and optimizer state and casts the half-precision model from them
        (its ``bf16``/``fp16`` mode), which is mixed-precision training, not the pure half-precision training the
        name asks for (that ran silently as ``bf16-mixed`` before); and fp16 on CPUs, where DeepSpeed has no fp16
        (Lightning turns ``16-mixed`` into ``bf16-mixed`` on a CPU for its other strategies, not for DeepSpeed's
        precision: the ranks failed in ``deepspeed.initialize`` with "Type fp16 is not supported on your device")."""
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision not in ("bf16-true", "16-true", "16-mixed"):
            return
        half = "bf16" if precision.startswith("bf16") else "fp16"
        if half == "fp16" and self._on_cpu():
            raise LayoutError(
                f"precision={precision!r} on CPUs under {self.strategy_name}: DeepSpeed runs no fp16 on a CPU (its "
                "engine would fail in every rank: 'Type fp16 is not supported on your device'). Fix: "
                "precision='bf16-mixed' (bf16 forward and backward, fp32 optimizer step), or fp16 on GPUs.")
        if precision == "16-mixed":
            return
        mixed = precision.replace("-true", "-mixed")
        raise LayoutError(
            f"precision={precision!r} cannot run under {self.strategy_name}: DeepSpeed's ZeRO keeps fp32 master "
            f"weights and optimizer state (on the host with offload) and casts the model to {half} from them -- "
            f"that is {mixed!r} training, not the pure half-precision training {precision!r} means (half-precision "
            f"weights and optimizer state, as one device runs it). Fix: precision={mixed!r} (what DeepSpeed runs: "
            f"{half} forward and backward, fp32 optimizer step), or {precision!r} under lp_ddp, lp_sharded, "
            "lp_tensor, lp_pipeline or lp_hybrid."
        )

    def before_launch(self) -> None:
        """Called by the checked launchers after the module check, before the ranks start: build DeepSpeed's ops."""
        self.prepare_ops()

    @override
    def check_module(self, module: pl.LightningModule) -> None:
        """Before spawning: the layout's module checks, and -- with offload -- the optimizers of the module's
        ``configure_optimizers`` must have a host implementation (torch Adam/AdamW, DeepSpeed's CPU optimizers)."""
        from lightning_parallel.parallel.offload.optim import offload_refusal

        from .layout import configured_optimizers

        super().check_module(module)
        if self._layout.offload_device == "none":
            return
        configured = configured_optimizers(module)
        for optimizer in configured[0] if configured else []:
            why = offload_refusal(optimizer)
            if why:
                raise LayoutError(f"lp_zero_offload with offload={self._layout.offload_device!r}: {why}")

    @override
    def full_state_for_main_process(self, module: nn.Module) -> dict[str, Any] | None:
        """Spawn/fork after a ZeRO-3 fit: the consolidated weights taken in ``teardown`` (rank 0's partitions are not
        the model); None otherwise."""
        final, self._final_state = self._final_state, None
        return final

    def prepare_ops(self) -> dict[str, float]:
        """Select DeepSpeed's accelerator (CPU or CUDA) and build the C++ ops this run loads, with a progress message
        for each build; called by the launcher before the ranks start."""
        _select_deepspeed_accelerator("cpu" if self._on_cpu() else "cuda")
        _, opt, par = offload_targets(self.config or {})
        names = required_ops(accelerator="cpu" if self._on_cpu() else "cuda", offload_optimizer=opt,
                             offload_param=par)
        self.ops_built.update(ensure_ops(names))
        return self.ops_built

    @override
    def setup_environment(self) -> None:
        # Lightning's DeepSpeedStrategy refuses anything but CUDA here; DeepSpeed's CPU accelerator runs on gloo.
        device_type = "cpu" if self._on_cpu() else "cuda"
        _select_deepspeed_accelerator(device_type)
        self._timeout = resolve_collective_timeout(self.layout, self._timeout_given, device_type)
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        assert self.parallel_devices is not None
        if not self._on_cpu():
            _validate_device_index_selection(self.parallel_devices)
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Activation checkpointing and ``parallel.compile`` as the layout says (before the engine wraps the module,
        the composition's order), then Lightning's
        DeepSpeed set-up: the engine for fit, the inference engine for validate/test/predict."""
        if self.model is not None:
            from lightning_parallel.parallel.compile import apply_compile, unwrap_compiled

            if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
                # Trainer(sync_batchnorm=True): SyncBatchNorm before the engine wraps the module, as lp_ddp does
                # (Lightning's DeepSpeed strategy ignores the flag); on CPU it is refused before launch
                self.model = self._layer_sync.apply(self.model)
            unwrap_compiled(self.model)
            self.apply_activation_checkpointing(self.model)
            apply_compile(self.model, self._layout.compile)  # each block, before the engine wraps the module
        super().setup(trainer)

    @override
    def _setup_model_and_optimizer(self, model: nn.Module, optimizer: Optimizer | None,
                                   lr_scheduler: Any = None) -> tuple[Any, Any]:
        assert self.config is not None
        engine, engine_optimizer, _ = build_engine(model, config=self.config, optimizer=optimizer,
                                                   lr_scheduler=lr_scheduler, device_rank=self.root_device.index)
        return engine, engine_optimizer

    # ------------------------------------------------------------------ checkpoints
    @property
    def offloads_to_nvme(self) -> bool:
        return self._layout.offload_device == "nvme"

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        """DeepSpeed's folder (and, with NVMe offload, each rank's state under ``lp_offload_state/``), written into
        ``<path>.partial`` and renamed into place once every rank is done: a crash mid-save leaves the previous
        checkpoint of that name whole (:func:`lightning_parallel.checkpoint.formats.deepspeed.save`)."""
        deepspeed_format.save(
            self, checkpoint, filepath,
            write_engine_folder=lambda c, path: super(LPZeroOffloadStrategy, self).save_checkpoint(c, path,
                                                                                              storage_options),
            nvme_engine=self.deepspeed_engine if self.offloads_to_nvme else None)

    def check_resume_source(self, path: _PATH) -> None:
        """Before spawning (``--ckpt_path``) and when loading: a DeepSpeed folder, or -- at ZeRO-1/2 without NVMe
        offload -- any other checkpoint of the library (:func:`check_resume_source`)."""
        check_resume_source(path, zero_stage=int(self._layout.zero), offload=self._layout.offload_device)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """A DeepSpeed folder: DeepSpeed's own load (plus the NVMe state). Any other checkpoint of the library
        (ZeRO-1/2, CPU offload or none): read into the one-device form; each rank puts the fp32 masters and Adam's
        moments into its partitions with DeepSpeed's ``safe_set_full_*``
        (:mod:`lightning_parallel.parallel.offload.resume`)."""
        from lightning_parallel.checkpoint.resume import ResumeError
        from lightning_parallel.checkpoint.verify import verify_folder_on_rank_zero

        self.check_resume_source(checkpoint_path)
        path = Path(checkpoint_path)
        verify_folder_on_rank_zero(self, path)  # checksums (rank 0; every rank stops on a mismatch)
        if not deepspeed_format.is_deepspeed_folder(path):
            return self._load_other_layout(path)
        mismatch = deepspeed_format.layout_mismatch(path, zero_stage=int(self._layout.zero),
                                                    world_size=self.world_size)
        if mismatch is not None:
            if int(self._layout.zero) in (1, 2) and not self.offloads_to_nvme:
                return self._load_other_layout(path)  # through the one-device form
            raise ResumeError(mismatch)
        module, nvme_engine, fitting = self.lightning_module, None, True
        if self.offloads_to_nvme and module is not None:
            nvme_engine, fitting = self.deepspeed_engine, module.trainer.state.fn == TrainerFn.FITTING
        return deepspeed_format.load(
            self, path, nvme_engine=nvme_engine, fitting=fitting,
            read_engine_folder=lambda: super(LPZeroOffloadStrategy, self).load_checkpoint(checkpoint_path,
                                                                                         weights_only))

    def _load_other_layout(self, path: Path) -> dict[str, Any]:
        from lightning_parallel.checkpoint.resume import ResumeError, resume_one_device
        from lightning_parallel.parallel.offload.resume import load_one_device_state

        module = self.lightning_module
        assert module is not None and self.deepspeed_engine is not None

        def place(checkpoint: dict[str, Any]) -> None:
            try:
                load_one_device_state(self.deepspeed_engine, checkpoint,
                                      load_optimizer=module.trainer.state.fn == TrainerFn.FITTING)
            except ValueError as err:
                raise ResumeError(f"lp_zero_offload cannot resume from {path}: {err}") from None

        return resume_one_device(self, path, optimizers=[], place=place)

    @override
    def on_train_start(self) -> None:
        """After a resume, give the host optimizer the learning rates of the restored schedulers: DeepSpeed's ZeRO
        checkpoint restores the optimizer *state* but not its param groups, so without this the first resumed step
        would run at the scheduler's initial lr. Also the RNG states of a resumed checkpoint, now."""
        from lightning_parallel.callbacks.nonfinite import install as install_nonfinite_guard
        from lightning_parallel.checkpoint.rng import apply_restored_rng_states

        super().on_train_start()
        apply_restored_rng_states()
        if self.lightning_module is not None:
            guard = self._nonfinite_guard = install_nonfinite_guard(self.lightning_module.trainer)
            interrupts.install(self.lightning_module.trainer,
                               request_stop=guard.request_stop if guard.agrees_on_preemption else None)
        for config in self.lr_scheduler_configs:
            last = getattr(config.scheduler, "_last_lr", None)
            optimizer = getattr(config.scheduler, "optimizer", None)
            if last is None or optimizer is None or len(last) != len(optimizer.param_groups):
                continue
            for group, lr in zip(optimizer.param_groups, last, strict=True):
                group["lr"] = lr

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 weights keyed as ``LightningModule.state_dict()`` (collective: call on every rank)."""
        assert self.lightning_module is not None
        return consolidated_state_dict(self.lightning_module)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        fitting = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        if fitting and isinstance(self._launcher, _MultiProcessingLauncher) and self.zero_stage_3:
            # spawn/fork hand rank 0's weights back to the main process; under ZeRO-3 they are partitioned
            self._final_state = self.consolidated_state_dict()
        interrupts.uninstall()
        super().teardown()



def check_resume_source(path: _PATH, *, zero_stage: int, offload: str) -> None:
    """What ``lp_zero_offload`` resumes: its DeepSpeed folders; at ZeRO-1/2 without NVMe offload also every other
    checkpoint of the library (through the one-device form). Anything else is refused with the reason and the fix."""
    from lightning_parallel.checkpoint.resume import ResumeError

    folder = Path(path)
    if deepspeed_format.is_deepspeed_folder(folder):
        return
    if not folder.exists():
        raise ResumeError(f"lp_zero_offload cannot resume from {path}: no such file or folder.")
    if zero_stage in (1, 2) and offload != "nvme":
        return
    why = "NVMe offload" if offload == "nvme" else "ZeRO-3"
    raise ResumeError(
        f"lp_zero_offload with {why} resumes only DeepSpeed folders it wrote itself (same stage and world size); "
        f"{path} is another layout's checkpoint (its state would have to be written into DeepSpeed's ZeRO-3 "
        "partitions or NVMe swap files, which the library does not do). Fix: resume it under lp_zero_offload at "
        "zero_stage 1 or 2 with CPU offload, or under lp_ddp, lp_sharded (zero_stage 1-3), lp_tensor, lp_pipeline "
        "or lp_hybrid, which read any of the library's checkpoints; or start a new run here from its weights only "
        f"(`lightning-parallel consolidate {path} model.ckpt`, then Module.load_from_checkpoint)."
    )


def _select_deepspeed_accelerator(kind: str) -> None:
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator()._name == kind:
        return
    if kind == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    else:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        set_accelerator(CUDA_Accelerator())
