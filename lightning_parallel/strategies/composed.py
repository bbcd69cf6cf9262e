"""``ComposedMixin``: the model-parallel strategies (``lp_tensor``, ``lp_pipeline``, ``lp_hybrid``) build the module
through the one composition :func:`lightning_parallel.parallel.compose.compose` (pipeline split -> tensor parallel
plan -> activation checkpointing -> data-parallel sync); this mixin is how a
:class:`~lightning_parallel.strategies.base.LayoutStrategy` hands the module to it, once per process."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_parallel.parallel.compose import Composition, compose

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_parallel.config import ParallelConfig
    from lightning_parallel.parallel.dims import ParallelDims

__all__ = ["ComposedMixin"]

_MARK = "_lp_composition"


class ComposedMixin:
    """Mix in before ``LayoutStrategy``: placement and recomputation move into :func:`compose` (so they follow the
    pipeline split and the tensor-parallel plan), and :meth:`compose_module` runs it once per module."""

    if TYPE_CHECKING:
        layout: ParallelConfig
        dims: ParallelDims
        mesh: DeviceMesh
        global_rank: int
        root_device: torch.device

    composition: Composition | None = None
    pipelined = False
    """Cut the module into pipeline stages (``lp_pipeline``, ``lp_hybrid``)."""

    def model_to_device(self) -> None:
        """Nothing here: :func:`compose` places the module after the pipeline split (only the layers this rank
        keeps are moved, or materialized from the meta device)."""

    def apply_activation_checkpointing(self, module: nn.Module) -> list[str]:
        """Nothing here: :func:`compose` applies it after the split and the tensor-parallel plan."""
        return []

    def compose_module(self, model: nn.Module) -> Composition:
        """Compose ``model`` for this rank, or return what an earlier ``fit``/``validate`` of this process did."""
        done = getattr(model, _MARK, None)
        if isinstance(done, Composition):
            self.composition = done
            return done
        composition = compose(model, layout=self.layout, dims=self.dims, rank=self.global_rank, mesh=self.mesh,
                              device=self.root_device, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
                              pipeline=self.pipelined)
        object.__setattr__(model, _MARK, composition)
        self.composition = composition
        return composition

    def composition_record(self) -> dict[str, Any]:
        """What a checkpoint records about the composition."""
        c = self.composition
        if c is None or c.stage_plan is None:
            return {}
        plan = c.stage_plan
        return {"stages": [list(plan.names[a:b]) for a, b in plan.ranges]}
