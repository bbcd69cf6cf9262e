"""Tensor parallelism over the ``tp`` axis of the layout mesh with ``torch.distributed.tensor`` (Megatron-LM's
column/row split, vocab-parallel embedding and loss, sequence parallelism), and what it needs around it: the
dp-axis gradient sync of tp-sharded parameters, clipping by the global norm, ZeRO-1 on local shards, counted
collectives and the optimizer state by parameter name (its checkpoints' format is
:mod:`lightning_parallel.checkpoint.formats.dcp`). No Lightning import."""

from .plan import PLAN_STYLES, PlanError, apply_tensor_parallel, expand_plan, make_style

__all__ = ["PLAN_STYLES", "PlanError", "apply_tensor_parallel", "expand_plan", "make_style"]
