"""``lp_hybrid``: data x pipeline x tensor parallelism (+ ZeRO 1-3) from one ``parallel`` section -- the layout for
several nodes when the model does not fit one device: TP inside a node, PP across nodes, DP over the rest.

Layout ``(d, p, t, 0|1|2|3)`` on ``d x p x t`` ranks, mesh ``("dp", "pp", "tp")`` (``tp`` innermost, so tensor-parallel
peers are neighbouring ranks of one node). The module is composed by
:func:`lightning_parallel.parallel.compose.compose` in the fixed order pipeline split -> tensor parallel plan on each
stage -> activation checkpointing -> compile (with ``parallel.compile``) -> data-parallel sync:

* along ``pp`` -- each rank keeps ``~1/p`` of the layers (its stages, the whole model's names); activations of each
  micro-batch go point-to-point between neighbouring stages (the tp ranks of a stage each send their own shard to
  the same tp rank of the next stage); the schedule and bubble are :mod:`lightning_parallel.strategies.pipeline`'s;
* along ``tp`` -- inside each stage the plan's matrices are split (Megatron column/row/vocab; with
  ``sequence_parallel`` norms and dropout on ``s/t`` positions); two all-reduces (or all-gather + reduce-scatter)
  of ``b/m x s x h`` activations per layer and micro-batch in forward and two in backward; the head's logits stay
  split by vocabulary and the loss is ``loss_parallel``'s;
* along ``dp`` -- after the step's last micro-batch, zero_stage 0 all-reduces each local gradient shard (mean),
  zero_stage 1 reduce-scatters the flat local shards and all-gathers the updated parameters (ZeRO-1 on the stage's
  TP-local shards); zero_stage 2 and 3 put FSDP2 on each stage chunk over ``dp`` on top of TP (2-D DTensors
  ``(dp, tp)``): the stage's gradient is reduce-scattered once, after the step's last micro-batch, and the
  parameters are all-gathered once per step (ZeRO-2) or per micro-batch where ``reshard_after_forward`` frees them
  (ZeRO-3, every stage but the last under the 1F1B-family schedules). With pp = 1, zero_stage 2 is refused when
  the module is composed (zero_stage 1 moves the same bytes).

Clipping by norm uses the whole model's gradient norm: squares summed over ``tp`` (tp-replicated tensors counted
once), ``pp`` and, where the gradients are sharded there (ZeRO 1-3), ``dp`` (under HSDP its shard group).
Everything else -- the Lightning integration (``train_loss`` / ``val_loss`` / ``test_loss`` logged with one-device
values, predict on every rank, accumulation, schedulers), checkpoints (DCP folder, one shard per rank, resumable
with another pipeline cut but the same ``tp``) -- is ``lp_pipeline``'s.
"""

from __future__ import annotations

import lightning.pytorch as pl
from typing_extensions import override

from .pipeline import LPPipelineStrategy
from .tensor import check_tensor_plan, require_plan_hook

__all__ = ["LPHybridStrategy"]


class LPHybridStrategy(LPPipelineStrategy):
    """Data x pipeline x tensor parallelism, ``zero_stage`` 0, 1, 2 or 3 over ``dp``.

    Args:
        parallel: the whole layout: ``data_parallel_size``, ``pipeline_parallel_size``, ``tensor_parallel_size``,
            ``sequence_parallel``, ``num_micro_batches``, ``pipeline_schedule``, ``virtual_pipeline_stages``,
            ``pipeline_stage_layers``, ``activation_checkpointing``, ``zero_stage`` 0 (unset), 1, 2 or 3,
            ``reshard_after_forward``, ``data_parallel_shard_size``.
        kwargs: see :class:`~lightning_parallel.strategies.base.LayoutStrategy`.
    """

    strategy_name = "lp_hybrid"

    @override
    def check_module(self, module: pl.LightningModule) -> None:
        """Before spawning: the pipeline's checks (hooks, layers >= p x v, no weight shared across stages, batch
        against m) and, with tp > 1, the tensor plan's (the hook, every key names a submodule, each split dimension
        divisible by t)."""
        super().check_module(module)
        if self.layout.tensor_parallel_size > 1:
            require_plan_hook(module, self.strategy_name)
            check_tensor_plan(module, self.layout.tensor_parallel_size)

    @override
    def describe(self) -> str:
        text = super().describe()
        if self._dims is not None and self.layout.sequence_parallel:
            text = text[:-1] + ", sequence parallel)"
        return text
