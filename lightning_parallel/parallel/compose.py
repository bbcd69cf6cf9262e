"""One composition of the model-parallel techniques, in one fixed order, for every model-parallel strategy.

``lp_tensor`` (pp = 1), ``lp_pipeline`` (tp = 1) and ``lp_hybrid`` (both) are presets of :func:`compose`, which
turns the whole module into what one rank of the ``(dp, pp, tp)`` mesh runs:

1. **pipeline split** (pp > 1): the module's ``pipeline_layers()`` are cut into ``pp x v`` stages
   (:mod:`lightning_parallel.parallel.pipeline`); this rank's copy keeps only its stages' layers, under the whole
   model's names; a meta-device module is materialized now, only for what the rank keeps;
2. **tensor parallel plan on each stage** (tp > 1): the module's ``tensor_parallel_plan()`` splits the layers that
   are present over ``tp`` (entries naming other stages' layers are skipped);
3. **activation checkpointing** (``parallel.activation_checkpointing``): recompute the named submodules in backward
   (class swap: names unchanged, the TP hooks stay on the submodules);
4. **data-parallel replicas made equal**: every tensor of this rank (local TP shards included) is broadcast from dp
   rank 0 of its dp group; then, at ``zero_stage=3`` without a pipeline, FSDP2 ``fully_shard`` over ``dp``.
   The dp-axis gradient sync itself (all-reduce, ZeRO-1 on the local shards) belongs to the step and the optimizer
   (:mod:`lightning_parallel.parallel.tensor.sync`).

No Lightning import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.config import ParallelConfig
from lightning_parallel.parallel.dims import ParallelDims

from .pipeline import StageChunk, StagePlan, has_meta_tensors, materialize, plan_stages, prune_to

__all__ = ["COMPOSITION_ORDER", "Composition", "compose"]

COMPOSITION_ORDER = ("pipeline split", "tensor parallel plan", "activation checkpointing", "data-parallel sync")


@dataclass
class Composition:
    """What :func:`compose` did to the module on this rank."""

    stage_plan: StagePlan | None = None
    """The cut of the whole model into stages (None without a pipeline)."""
    chunks: list[StageChunk] = field(default_factory=list)
    """This rank's stages, in order (empty without a pipeline)."""
    tensor_plan: dict[str, Any] = field(default_factory=dict)
    """The expanded tensor-parallel plan applied here (empty without TP)."""
    recomputed: list[str] = field(default_factory=list)
    """Submodules recomputed in backward."""
    fully_sharded: bool = False
    """FSDP2 over dp (zero_stage 3)."""


def compose(module: nn.Module, *, layout: ParallelConfig, dims: ParallelDims, rank: int, mesh: DeviceMesh,
            device: torch.device, seed: int, pipeline: bool | None = None) -> Composition:
    """Turn ``module`` in place into global ``rank``'s part of the layout (see the module docstring for the order).

    Args:
        layout: the resolved layout (schedule, v, stage layer counts, sequence parallel, recomputation, ZeRO stage).
        dims: the degrees; ``rank``: this process's global rank; ``mesh``: the named ``(dp, pp, tp)`` mesh.
        device: where the module runs; ``seed``: what a meta-device module's ``init_weights()`` starts from.
        pipeline: cut into stages (default: ``dims.pp > 1``).
    """
    from lightning_parallel.parallel.tensor.sync import broadcast_local_states

    out = Composition()
    coords = dims.coords(rank)
    if pipeline if pipeline is not None else dims.pp > 1:
        layers = module.pipeline_layers()  # type: ignore[operator]
        counts = None if layout.pipeline_stage_layers is None else [int(c) for c in layout.pipeline_stage_layers]
        out.stage_plan = plan_stages(module, layers, pp=dims.pp, chunks=layout.virtual_pipeline_stages,
                                     pp_rank=coords.pp, layers_per_stage=counts)
        out.chunks = prune_to(module, out.stage_plan)
    if has_meta_tensors(module):
        materialize(module, device, seed=seed)
    else:
        module.to(device)
    if dims.tp > 1:
        from lightning_parallel.parallel.tensor import apply_tensor_parallel

        out.tensor_plan = apply_tensor_parallel(module, module.tensor_parallel_plan(),  # type: ignore[operator]
                                                mesh=mesh["tp"], sequence_parallel=layout.sequence_parallel,
                                                skip_missing=out.stage_plan is not None)
    if layout.activation_checkpointing != "none":
        from lightning_parallel.parallel.activation_checkpointing import apply_activation_checkpointing

        out.recomputed = apply_activation_checkpointing(module, layout.activation_checkpointing)
    broadcast_local_states(module, group=mesh.get_group("dp"), src_rank=dims.group_ranks("dp", rank)[0])
    if layout.zero == 3 and out.stage_plan is None:
        from lightning_parallel.parallel.zero import apply_zero3

        apply_zero3(module, mesh=mesh["dp"])
        out.fully_sharded = True
    return out
