"""Pipeline parallelism over the ``pp`` axis on ``torch.distributed.pipelining``: cut a module's ordered layers into
stages (:mod:`.stage`, names kept), the stage arithmetic and the schedules' bubble (:mod:`.partition`; the schedules'
names and rules are :data:`lightning_parallel.config.SCHEDULES`), and the runtime that runs a rank's stages for
training and evaluation (:mod:`.runtime`). No Lightning import; the ``lp_pipeline`` strategy uses it."""

from .partition import balanced_partition, bubble_fraction, stage_ranges, stages_of_rank
from .runtime import PipelineRunner, largest_divisor_at_most
from .stage import (
    META_BY_CHECK,
    LayerFlow,
    PipelineFlowError,
    PrunedLayer,
    StageChunk,
    StagePlan,
    has_meta_tensors,
    input_names,
    layer_names,
    materialize,
    needs_init_weights,
    plan_stages,
    prune_to,
)

__all__ = ["META_BY_CHECK", "LayerFlow", "PipelineFlowError", "PipelineRunner", "PrunedLayer", "StageChunk",
           "StagePlan", "balanced_partition", "bubble_fraction", "has_meta_tensors", "input_names",
           "largest_divisor_at_most", "layer_names", "materialize", "needs_init_weights", "plan_stages", "prune_to",
           "stage_ranges", "stages_of_rank"]
