"""``lp_ddp``: distributed data parallel over the ``dp`` axis of a layout.

Layout ``(N, 1, 1, 0)``: every rank holds the whole model and a ``1/N`` slice of the global batch (with
``context_parallel_size = c``: ``N/c`` replicas, each batch's sequences split over ``c`` ranks, gradients averaged
over all ``N``: DDP's group is the mesh's ``dp_cp``). At start the
parameters are broadcast from dp rank 0 (DDP's constructor); in backward the gradients are averaged over the ``dp``
process group by bucketed all-reduces overlapped with the backward pass (``2 * (N-1)/N * Psi`` elements sent per
rank and step with a ring). Forward runs no collective. For validate/test/predict the module is not wrapped (no
gradients to sync); the replicas are made equal by one broadcast from dp rank 0 over ``dp``.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import _augment_message
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_parallel.config import ParallelConfig
from lightning_parallel.parallel.compose import DataParallelPlan, data_parallel_plan
from lightning_parallel.parallel.counters import CommCounter, CountingHookState, counting_allreduce_hook

from .base import LayoutStrategy

__all__ = ["CommHook", "LPDDPStrategy"]

CommHook = Literal["none", "fp16", "bf16", "powersgd", "count"]


class LPDDPStrategy(LayoutStrategy):
    """Torch DDP over the ``dp`` axis of the layout mesh.

    Args:
        parallel: the layout; ``lp_ddp`` runs pure data-parallel layouts (pp = tp = 1, zero_stage = 0).
        bucket_cap_mb: DDP gradient bucket size (MB); bigger buckets mean fewer, larger all-reduces. None (the
            default): torch's own bucketing, a 1 MB first bucket (the last layers' gradients, all-reduced while the
            backward goes on) then 25 MB buckets; a number makes every bucket that size, the first included.
        gradient_as_bucket_view: gradients are views into the buckets (saves one gradient copy of memory).
        static_graph: the set of used parameters never changes between steps (lets DDP skip bookkeeping).
        find_unused_parameters: tolerate parameters that receive no gradient in a step.
        comm_hook: gradient compression before the all-reduce: ``fp16`` / ``bf16`` (halve the bytes, lossy),
            ``powersgd`` (low-rank, lossy) or ``none`` (exact); ``count`` is the exact all-reduce that also counts
            each bucket's bytes in :attr:`exchange_counter` (the DP-vs-DDP benchmark's accounting).
        powersgd_rank: matrix approximation rank for ``powersgd``. powersgd_start_iter: exact all-reduce before it.
        kwargs: see :class:`~lightning_parallel.strategies.base.LayoutStrategy`.
    """

    strategy_name = "lp_ddp"
    preset = {"zero_stage": 0, "offload": "none"}

    def __init__(
        self,
        parallel: ParallelConfig | dict[str, Any] | None = None,
        *,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        comm_hook: CommHook = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        **kwargs: Any,
    ) -> None:
        if comm_hook not in ("none", "fp16", "bf16", "powersgd", "count"):
            raise ValueError(f"comm_hook={comm_hook!r} is not one of ['none', 'fp16', 'bf16', 'powersgd', 'count'].")
        if bucket_cap_mb is not None and bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be > 0.")
        super().__init__(parallel, **kwargs)
        self._ddp_kwargs: dict[str, Any] = {
            **({"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb is not None else {}),
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "find_unused_parameters": find_unused_parameters,
        }
        self._forward_redirection = _DDPForwardRedirection()  # manual optimization: DDP's reducer off in forward
        self._comm_hook_name = comm_hook
        self._powersgd = (powersgd_rank, powersgd_start_iter)
        self.exchange_counter = CommCounter()
        """All-reduce calls and bytes per training step of this rank (filled with ``comm_hook="count"``)."""

    @override
    def data_parallel_plan(self) -> DataParallelPlan:
        """``(N, 1, 1, 0)``: torch DDP over the dp group with this strategy's bucket options."""
        return data_parallel_plan(self.layout, self.dims, ddp_options=self._ddp_kwargs)

    @override
    def parallelize(self, model: nn.Module, *, trainer_fn: TrainerFn) -> nn.Module:
        """The composition (fit: torch DDP over the dp group, whose constructor broadcasts dp rank 0's weights;
        otherwise the module itself, its replicas made equal by one broadcast over ``dp``), then the comm hook."""
        model = super().parallelize(model, trainer_fn=trainer_fn)
        if isinstance(model, DistributedDataParallel):
            self._register_comm_hook(model)
        return model

    def _register_comm_hook(self, ddp: DistributedDataParallel) -> None:
        # The compression hooks run on gloo too (Lightning registers its hooks on CUDA only).
        if self._comm_hook_name == "none" and self.comm_counter is not None:
            # counted: torch's exact default all-reduce, in Python, so the communication counter sees each bucket
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(self.mesh.get_group(self.dims.replica_axis), default_hooks.allreduce_hook)
        if self._comm_hook_name == "none":
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        group = self.mesh.get_group(self.dims.replica_axis)  # dp, or dp x cp with context parallelism
        if self._comm_hook_name == "count":
            ddp.register_comm_hook(CountingHookState(group, self.exchange_counter), counting_allreduce_hook)
        elif self._comm_hook_name == "fp16":
            ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        elif self._comm_hook_name == "bf16":
            ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
        else:
            rank, start = self._powersgd
            state = powerSGD_hook.PowerSGDState(
                process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=start
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    @override
    def ddp_rewrapped(self, model: nn.Module) -> None:
        """The comm hook on the new wrapper as on the first."""
        super().ddp_rewrapped(model)
        if isinstance(model, DistributedDataParallel):
            self._register_comm_hook(model)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Manual optimization: tell DDP's reducer which outputs the backward starts from."""
        from lightning.pytorch.overrides.distributed import prepare_for_backward

        super().pre_backward(closure_loss)

        module = self.lightning_module
        if isinstance(self.model, DistributedDataParallel) and module is not None and \
                not module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._comm_hook_name == "count":
            self.exchange_counter.step()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """torch DDP's error for a parameter that got no gradient names its own constructor's argument: say the
        strategy's (as Lightning's ``ddp`` does for its own)."""
        _augment_message(
            exception, pattern=".*Expected to have finished reduction in the prior iteration.*",
            new_message=(
                "A parameter of the module got no gradient in this step (a layer used on some steps only, a GAN's "
                "other network), which torch DDP does not allow by default. If it is intended: "
                "LPDDPStrategy(find_unused_parameters=True) (a recipe: trainer.strategy.init_args."
                "find_unused_parameters: true) -- or lp_sharded, whose ZeRO leaves such a parameter as one device "
                "does."))
        super().on_exception(exception)
