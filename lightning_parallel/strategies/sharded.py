"""``lp_sharded`` (alias ``ddp_sharded``): ZeRO stages 1, 2 and 3 over the ``dp`` axis of a layout.

Layout ``(N, 1, 1, z)`` with ``z`` in 1..3 (``parallel.zero_stage``, the source of truth; left unset, the strategy
runs its ``zero_stage`` argument or :data:`DEFAULT_ZERO_STAGE` = 2; an explicit 0 is refused: that is ``lp_ddp``).
Over the ``dp`` process
group of ``N`` ranks (``Psi`` parameters; ``P``, ``G``, ``K`` bytes per parameter of parameters, gradients and
optimizer state):

* stage 1 -- optimizer states sharded: ``(P+G) Psi + K Psi/N`` per rank;
* stage 2 -- + gradients: ``P Psi + (G+K) Psi/N``;
* stage 3 -- + parameters (torch FSDP2 ``fully_shard`` on every block and the root): ``(P+G+K) Psi/N``.

Collectives: stages 1-2 run none in forward or backward (gradients accumulate locally, also across accumulation
micro-batches); at the step boundary gradients are reduce-scattered (after the last backward, before clipping) and
after the step the updated parameter shards are all-gathered: ``2 Psi (N-1)/N`` elements per rank and step. Stage 3
all-gathers each block's parameters in forward and again in backward, and reduce-scatters its gradients in backward:
``3 Psi (N-1)/N``. The mechanics are :mod:`lightning_parallel.parallel.zero`; this file adapts them to Lightning.

Checkpoints: ``checkpoint="full"`` (default) writes one consolidated file that loads on one device into the plain
module and optimizer (and resumes under any layout); ``checkpoint="sharded"`` writes a folder with ``meta.pt`` and one
``rank_XXXXX.pt`` per rank (no gathering), which resumes exactly on the same layout.

Measurement (opt-in, off the hot path): the ``ZeroStats`` callback logs this rank's bytes of parameters, gradients
and optimizer state after every optimizer step, and the bytes its collectives
sent during that step (all micro-batches).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.checkpoint.formats import sharded as sharded_format
from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.parallel.compose import DataParallelPlan, data_parallel_plan
from lightning_parallel.parallel.zero import (
    ZeroOptimizer,
    require_fairscale,
    zero3_full_model_state,
    zero3_full_optimizer_state,
    zero3_load_full_model_state,
    zero3_load_full_optimizer_state,
    zero3_load_local_state,
    zero3_local_state,
)

from .base import LayoutStrategy

__all__ = ["DEFAULT_ZERO_STAGE", "LPShardedStrategy", "ShardedBackend", "ShardedCheckpoint"]

ShardedBackend = Literal["native", "fairscale"]
ShardedCheckpoint = Literal["full", "sharded"]
DEFAULT_ZERO_STAGE = 2
"""The stage ``lp_sharded`` runs when the layout leaves ``zero_stage`` unset: 2, what Lightning 1.x's fairscale
``ddp_sharded`` ran (optimizer states and gradients sharded, the same traffic as DDP)."""

class LPShardedStrategy(LayoutStrategy):
    """ZeRO 1/2/3 over the ``dp`` axis of the layout mesh.

    Args:
        parallel: the layout; pp = tp = 1, offload none; ``zero_stage`` 1-3 (unset: ``zero_stage`` below).
        zero_stage: the stage to run when the layout leaves ``zero_stage`` unset (None =
            :data:`DEFAULT_ZERO_STAGE`); if the layout names another stage, that is an error.
        backend: ``native`` (torch only: flat balanced shards for 1-2, FSDP2 for 3) or ``fairscale`` (``OSS`` +
            DDP for 1, ``OSS`` + ``ShardedDataParallel`` for 2; whole parameters dealt to ranks; no stage 3).
        checkpoint: ``full`` (one consolidated file, loads on one device) or ``sharded`` (a folder, one file per
            rank, same-layout resume).
        kwargs: see :class:`~lightning_parallel.strategies.base.LayoutStrategy`.
    """

    strategy_name = "lp_sharded"

    def __init__(
        self,
        parallel: ParallelConfig | dict[str, Any] | None = None,
        *,
        zero_stage: int | None = None,
        backend: ShardedBackend = "native",
        checkpoint: ShardedCheckpoint = "full",
        **kwargs: Any,
    ) -> None:
        if backend not in ("native", "fairscale"):
            raise ValueError(f"backend={backend!r} is not one of ['native', 'fairscale'].")
        if checkpoint not in ("full", "sharded"):
            raise ValueError(f"checkpoint={checkpoint!r} is not one of ['full', 'sharded'].")
        if backend == "fairscale" and checkpoint == "sharded":
            raise ValueError("backend='fairscale' writes consolidated checkpoints only (OSS gathers on rank 0). "
                             "Fix: checkpoint='full', or backend='native' for sharded checkpoints.")
        if zero_stage is not None and zero_stage not in (1, 2, 3):
            raise LayoutError(f"zero_stage={zero_stage!r} must be 1, 2 or 3 (0 is plain DDP: use lp_ddp).")
        self.preset = {"zero_stage": zero_stage or DEFAULT_ZERO_STAGE, "offload": "none"}
        self.pinned = {"zero_stage": zero_stage} if zero_stage is not None else {}
        self._backend: ShardedBackend = backend
        self._checkpoint_kind: ShardedCheckpoint = checkpoint
        super().__init__(parallel, **kwargs)
        if backend == "fairscale":
            require_fairscale()

    # ------------------------------------------------------------------ the layout
    @property
    def zero_stage(self) -> int:
        """The stage that runs: the layout's, or the preset's when the layout leaves it unset."""
        return self.layout.zero

    @property
    def backend(self) -> ShardedBackend:
        return self._backend

    @override
    def check_layout(self, layout: ParallelConfig) -> None:
        """Refuse, before spawning, what lp_sharded does not run (its row of the layout table), and fairscale's
        stage 3."""
        super().check_layout(layout)
        if self._backend == "fairscale" and layout.zero_stage == 3:
            raise LayoutError(
                "backend='fairscale' runs ZeRO stages 1-2 (OSS, ShardedDataParallel); fairscale's stage 3 "
                "(FullyShardedDataParallel) is CUDA-only. Fix: backend='native' for zero_stage=3 (torch FSDP2)."
            )
        if self._backend == "fairscale" and layout.reduce_each_batch:
            raise LayoutError(
                "parallel.reduce_each_batch=true runs on the native engines (the flat ZeRO-2, FSDP2); backend="
                "'fairscale' does not arm its reduction per batch. Fix: backend='native', or remove "
                "reduce_each_batch.")
        if self._backend == "fairscale" and layout.data_parallel_shard_size is not None:
            raise LayoutError(
                f"backend='fairscale' shards over the whole dp axis, but parallel.data_parallel_shard_size="
                f"{layout.data_parallel_shard_size} asks for HSDP (FSDP2 over replicate x shard groups). Fix: "
                "backend='native', or remove data_parallel_shard_size.")
        if (layout.zero == 2 and layout.data_parallel_shard_size is None and layout.reshard_after_forward != "auto"):
            raise LayoutError(
                f"parallel.reshard_after_forward={layout.reshard_after_forward} is an FSDP2 setting, but lp_sharded "
                "runs zero_stage=2 over the whole dp axis with its flat-shard optimizer (parameters are never "
                "sharded). Fix: remove reshard_after_forward, or zero_stage=3, or set data_parallel_shard_size "
                "(HSDP runs ZeRO-2 over FSDP2).")

    @override
    def full_state_for_main_process(self, module: nn.Module) -> dict[str, Any] | None:
        """Stage 3: the all-gathered weights (rank 0 holds DTensor shards); stages 1-2 hold whole weights."""
        return zero3_full_model_state(module) if _is_fsdp(module) else None

    @override
    def describe(self) -> str:
        return f"{super().describe()} backend={self._backend}"

    # ------------------------------------------------------------------ the composition's data-parallel wrap
    @override
    def data_parallel_plan(self) -> DataParallelPlan:
        """Stages 1-2: replicas broadcast from dp rank 0, the sync is the optimizer's (native flat shards, or
        fairscale's OSS with DDP at stage 1 / ShardedDataParallel at stage 2); stage 3: FSDP2 over ``dp``."""
        return data_parallel_plan(self.layout, self.dims, backend=self._backend)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The one train step wraps the optimizers the LightningModule returned (after Lightning built them and their
        schedulers): the native engine keeps the user's optimizer object (schedulers stay bound to it) and swaps its
        param groups to flat shards; fairscale's ``OSS`` shares the param-group dicts and the schedulers are re-bound
        to it."""
        if (trainer.state.fn == TrainerFn.FITTING and self._backend == "fairscale" and self.zero_stage == 2
                and trainer.accumulate_grad_batches > 1):
            raise ValueError(
                f"backend='fairscale' at zero_stage=2 with accumulate_grad_batches={trainer.accumulate_grad_batches}: "
                "fairscale's ShardedDataParallel drifts from one device once a validation runs between accumulated "
                "steps (max weight difference 7e-3 after 4 steps, measured; without accumulation it is exact). "
                "Fix: backend='native' (exact with accumulation), or accumulate_grad_batches=1."
            )
        super().setup_optimizers(trainer)
        if self._backend == "fairscale" and trainer.state.fn == TrainerFn.FITTING:
            for config in self.lr_scheduler_configs:
                config.scheduler.optimizer = self.optimizers[0]  # type: ignore[union-attr]

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the flattened / sharded model and the wrapped optimizer

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full weights (stage 3: all-gathered on every rank, a collective) or, for sharded checkpoints at stage 3,
        this rank's local shards; stages 1-2 copy their replicated parameters out of the flat buffers."""
        assert self.model is not None and self.lightning_module is not None
        if _is_fsdp(self.lightning_module):
            if self._checkpoint_kind == "sharded":
                return zero3_local_state(self.lightning_module)["model"]
            return zero3_full_model_state(self.lightning_module)
        # stages 1-2: parameters are views into flat buffers; copy so a checkpoint does not save the buffers
        return {k: v.detach().clone() for k, v in self.lightning_module.state_dict().items()}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Consolidated per-parameter state (all-gathered: a collective every rank runs) or this rank's shard."""
        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        sharded = self._checkpoint_kind == "sharded"
        if isinstance(raw, ZeroOptimizer):
            return raw.state_dict() if sharded else raw.consolidated_state_dict()
        if self.lightning_module is not None and _is_fsdp(self.lightning_module):
            if sharded:
                return zero3_local_state(None, raw)["optim"]
            return zero3_full_optimizer_state(self.lightning_module, raw)
        consolidate = getattr(raw, "consolidate_state_dict", None)
        if callable(consolidate):  # fairscale OSS: gather on rank 0 (sharded form not offered)
            consolidate(recipient_rank=0)
            return raw.state_dict() if self.global_rank == 0 else {}
        return raw.state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """``full``: rank 0 writes one file. ``sharded``: a folder, ``meta.pt`` from rank 0 and one file per rank,
        written into ``<path>.partial`` and renamed into place once every rank is done (never a half folder under
        the checkpoint's name; :mod:`lightning_parallel.checkpoint.formats.sharded`)."""
        if self._checkpoint_kind == "full":
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        sharded_format.save(self, checkpoint, filepath, zero_stage=self.zero_stage,
                            shard_ranks=self.dims.shard_group_ranks(0),
                            fsdp=self.lightning_module is not None and _is_fsdp(self.lightning_module))

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Remove a checkpoint file or sharded folder (rank 0)."""
        if self.is_global_zero and Path(filepath).is_dir():
            shutil.rmtree(filepath)
        else:
            super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded folder written on this layout: ``meta.pt`` + this rank's file, as saved. Anything else -- a
        file, a sharded folder of another world size or stage, another strategy's folder -- is joined into the
        one-device form and re-sharded (:meth:`LayoutStrategy.load_checkpoint`)."""
        from lightning_parallel.checkpoint.verify import verify_folder_on_rank_zero

        path = Path(self.broadcast(str(checkpoint_path)))
        verify_folder_on_rank_zero(self, path)  # checksums (rank 0; every rank stops on a mismatch)
        checkpoint = sharded_format.load(self, path, zero_stage=self.zero_stage,
                                         shard_ranks=self.dims.shard_group_ranks(0), fsdp=self.layout.runs_fsdp2)
        return checkpoint if checkpoint is not None else super().load_checkpoint(path)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Into the set-up model: stage 3 scatters a full state (or loads local shards); 1-2 copy into the views."""
        module = self.lightning_module
        assert module is not None
        state = checkpoint["state_dict"]
        if _is_fsdp(module):
            if sharded_format.loaded_as_shards(checkpoint):
                zero3_load_local_state(module, None, {"model": state})
            else:
                zero3_load_full_model_state(module, state, strict=strict)
            return
        module.load_state_dict(state, strict=strict)  # copies into the flat buffers' views

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Into the wrapped optimizers: a per-parameter state is re-sharded, a sharded one loaded as is."""
        module = self.lightning_module
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            if module is not None and _is_fsdp(module):
                if sharded_format.loaded_as_shards(checkpoint):
                    zero3_load_local_state(module, optimizer, {"optim": state})
                else:
                    zero3_load_full_optimizer_state(module, optimizer, state)
            else:
                optimizer.load_state_dict(state)


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)

