"""Per-device memory of a layout: model states (ZeRO paper), activations (Korthikanti et al. 2022), buffers.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 5 / Fig. 1), bytes per device, with ``P`` parameters on the
device before ZeRO (``Psi / (pp x tp)``, the busiest stage when the shape is known), ``N_d`` = data_parallel_size,
``p, g, K`` the bytes per parameter of weight, gradient and optimizer state as the layout's engine keeps them
(:func:`layout_state_bytes`), shards rounded up to whole elements. In fp32 and under Lightning's mixed precision
(autocast over fp32 weights: every engine of the library but the offload one) ``p = g = 4`` and ``K`` is the
optimizer's state alone (Adam: 8); with 16-bit weights and an fp32 master copy in the optimizer (the offload
engine, DeepSpeed; Megatron-LM) ``p = g = 2``, ``K = 4 +`` the state -- the ZeRO paper's::

                                            Adam, fp32 weights          16-bit weights + fp32 master
    stage 0 (DDP)   (p + g + K) P           16 P                        16 P
    stage 1         (p + g) P + K P / N_d   8 P + 8 P / N_d             4 P + 12 P / N_d
    stage 2         p P + (g + K) P / N_d   4 P + 12 P / N_d            2 P + 14 P / N_d
    stage 3         (p + g + K) P / N_d     16 P / N_d                  16 P / N_d

ZeRO-Offload (stage 2 or 3, ``offload`` cpu or nvme) moves the optimizer state and an fp32 gradient partition,
``(K + 4) P / N_d`` bytes per rank, to the host (DeepSpeed's estimator: 16 bytes per parameter); stage 3 moves
the 16-bit weights too (``+ p P / N_d``, DeepSpeed's 18). Gradients then stream through device buckets. In fp32
``K`` holds only the moments; at stage 2 the host optimizer keeps its own fp32 copy of the partition, ``+ 4 P /
N_d`` (measured with DeepSpeed's CPU offload: 16 bytes per partition element on the host at stage 2 and at stage 3,
where the offloaded weight partition is the optimizer's copy).

Inside pipeline stages ZeRO-2/3 run as FSDP2 whose reduce-scatter waits for a step's last micro-batch: at the peak
of a step the stage's gradient is whole (``g P``) and, unless resharded after forward (ZeRO-3), the weights stay
gathered beside their shards (``a P + p P / N_d``, ``a`` the gathered copy's bytes: 2 under ``bf16-mixed``, else
``p``): ZeRO-2 ``(a + g) P + (p + K) P / N_d``, ZeRO-3 ``g P + (p + K) P / N_d``; between steps ``(p + g + K) P /
N_d``. HSDP (``data_parallel_shard_size = s``) runs ZeRO-2 as FSDP2 too and divides by ``s`` instead of ``N_d``.
Gradient accumulation does the same outside pipelines: ZeRO-2/3 (without offload or ``reduce_each_batch``) reduce
once per step, after its last batch, so every batch before it leaves the whole local gradient in place
(``TrainingSettings.accumulation``). That whole gradient is counted in fp32 (:data:`WHOLE_GRAD_BYTES`) whatever the
precision.

Buffers: a stated allowance = the hardware's reserved memory (CUDA context, workspaces) + 10 % of model states
and activations (allocator fragmentation, communication buckets) + under ZeRO-3 the gathered largest layer,
``(a + r) x largest layer / tp``, ``r`` the bytes the gradients are reduced in (DeepSpeed's ``4 x
largest_layer_params`` for 16-bit weights and gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_parallel.config import ParallelConfig
from lightning_parallel.planner.activations import activation_bytes
from lightning_parallel.planner.hardware import Hardware
from lightning_parallel.planner.model import ModelSpec
from lightning_parallel.planner.settings import StateBytes, TrainingSettings

__all__ = [
    "BUFFER_FRACTION",
    "HOST_FP32_GRAD_BYTES",
    "MemoryEstimate",
    "ModelStates",
    "estimate_memory",
    "keeps_head_gathered",
    "layout_state_bytes",
    "model_states",
    "model_states_bytes",
    "reshards",
]

BUFFER_FRACTION = 0.10
"""Share of model states + activations allowed for fragmentation and communication buckets."""
HOST_FP32_GRAD_BYTES = 4
"""Bytes per parameter of the fp32 gradient partition ZeRO-Offload keeps next to the host optimizer."""
WHOLE_GRAD_BYTES = 4
"""Bytes per element of the whole gradient ZeRO-2/3 keep while a step's micro-batches or accumulated batches add
into it: fp32 whatever the precision (FSDP2 upcasts it to its fp32 ``reduce_dtype`` while the sync is off; the flat
ZeRO-2 runs under autocast, whose parameters and gradients are fp32)."""


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes on one device, and what offload puts on the host and the NVMe disk (per rank)."""

    params: int
    grads: int
    optimizer: int
    host: int = 0
    nvme: int = 0

    @property
    def device(self) -> int:
        return self.params + self.grads + self.optimizer


def model_states(
    n_params: int, state: StateBytes, *, dp: int = 1, zero_stage: int = 0, offload: str = "none",
    shard: int | None = None, pipeline: bool = False, reshard: bool = True, accumulate: bool = False,
) -> ModelStates:
    """The ZeRO paper's formulas for ``n_params`` parameters on a device, sharded ``zero_stage``-deep over dp.

    ``state``: the bytes of the layout's engine (:meth:`TrainingSettings.state_bytes_for`). ``shard``: HSDP's
    shard-group size (model states divide by it instead of ``dp``; the other dp ranks hold replicas; ZeRO-2 then runs
    as FSDP2). ``pipeline``: ZeRO-2/3 over FSDP2 inside pipeline stages, at the peak of a step: each micro-batch's
    gradient adds into the stage's whole, unsharded gradient until the step's last micro-batch reduce-scatters it
    (``g P``). FSDP2 (ZeRO-3; ZeRO-2 in pipelines and under HSDP) keeps its weights' shards and, unless ``reshard``
    (ZeRO-3's default) frees them after each forward, the gathered weights through the step (``gather`` bytes
    each: 2 under ``bf16-mixed``); between steps everything is sharded, ``(p + g + K) P / s``. ``accumulate``: the step
    accumulates gradients over several batches; ZeRO-2/3 without offload keep each batch's gradient local and whole
    until the step's last batch reduces it (one reduction per step), so the peak holds ``g P`` as in a pipeline
    (DeepSpeed's offload engine reduces every batch: its gradient stays sharded)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3.")
    full, shard_n = n_params, math.ceil(n_params / (shard or dp))
    in_pipeline = pipeline and zero_stage >= 2
    whole_grad = zero_stage >= 2 and (in_pipeline or (accumulate and offload == "none"))
    hsdp = shard is not None and shard < dp
    fsdp = offload == "none" and (zero_stage >= 3 or (zero_stage == 2 and (pipeline or hsdp)))
    if not fsdp:  # DDP, the flat ZeRO-1/2 (and the offload engine): every rank keeps the whole weights
        params = state.param * (shard_n if zero_stage >= 3 else full)
    elif reshard:  # FSDP2 frees each unit's gathered weights after its forward and its backward
        params = state.param * shard_n
    else:  # FSDP2 keeps the gathered (``gather``-byte) weights from the forward to the step, beside its shards
        params = state.gathered * full + state.param * shard_n
    grads = (max(state.grad, WHOLE_GRAD_BYTES) * full if whole_grad
             else state.grad * (full if zero_stage < 2 else shard_n))
    optimizer = state.optimizer * (shard_n if zero_stage >= 1 else full)
    shard = shard_n
    if offload == "none":
        return ModelStates(params=params, grads=grads, optimizer=optimizer)
    if zero_stage < 2:
        raise ValueError(f"offload={offload!r} needs zero_stage 2 or 3, got {zero_stage}.")
    # The host optimizer steps fp32 master weights of its partition. Under mixed precision they are part of
    # ``state.optimizer`` (4 + moments). In fp32 at stage 2 the device keeps the model's whole fp32 weights, so the
    # host holds its own fp32 copy of the partition next to the moments and the gradient (measured with DeepSpeed:
    # 16 bytes per partition element); at stage 3 the offloaded fp32 weight partition counted below is that copy
    # (measured: 16 bytes per element, weight + moments + gradient).
    master = 4 if state.param == 4 and zero_stage == 2 else 0
    offloaded = (state.optimizer + master + HOST_FP32_GRAD_BYTES) * shard
    if zero_stage == 3:
        offloaded += state.param * shard
        params = 0
    if offload == "cpu":
        return ModelStates(params=params, grads=0, optimizer=0, host=offloaded)
    # NVMe: the states live on disk; the host keeps the fp32 gradient partition as the staging buffer.
    return ModelStates(params=params, grads=0, optimizer=0, host=HOST_FP32_GRAD_BYTES * shard, nvme=offloaded)


def model_states_bytes(n_params: int, state: StateBytes, *, dp: int) -> dict[str, int]:
    """``{"ddp", "zero1", "zero2", "zero3"}`` -> device bytes of model states for pure data parallelism over dp."""
    names = ("ddp", "zero1", "zero2", "zero3")
    return {name: model_states(n_params, state, dp=dp, zero_stage=z).device for z, name in enumerate(names)}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one layout, split as the report prints it."""

    params: int
    grads: int
    optimizer: int
    activations: int | None
    """None when the model's shape is unknown (a bare --params)."""
    buffers: int
    host_per_node: int
    nvme_per_node: int

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + (self.activations or 0) + self.buffers


def estimate_memory(
    model: ModelSpec, training: TrainingSettings, hardware: Hardware, layout: ParallelConfig, *, tiles: int = 1
) -> MemoryEstimate:
    """Per-device memory of ``layout`` (dp must be a number) for ``model`` trained with ``training``.

    ``tiles`` > 1: the largest layer runs tiled (Memory Centric Tiling), so ZeRO-3 gathers one tile at a time.
    """
    dp, pp, tp = _degrees(layout)
    cp = layout.context_parallel_size  # the cp ranks are replicas too: ZeRO shards over dp x cp (HSDP: shard x cp)
    n_local = model.params_per_device(pp=pp, tp=tp)
    state = layout_state_bytes(training, layout)
    shard = layout.data_parallel_shard_size
    states = model_states(n_local, state, dp=dp * cp, zero_stage=layout.zero, offload=layout.offload_device,
                          shard=shard * cp if shard else None, pipeline=pp > 1, reshard=reshards(layout),
                          accumulate=training.accumulation(dp, pp) > 1 and not layout.reduce_each_batch)
    acts = (activation_bytes(model, training, layout, gpu=hardware.accelerator != "cpu") if model.shape is not None
            else None)
    buffers = hardware.reserved + round(BUFFER_FRACTION * (states.device + (acts or 0)))
    if layout.zero == 3:
        buffers += math.ceil((state.gathered + state.reduced) * model.largest_layer_per_device(tp=tp) / tiles)
    ranks_per_node = min(hardware.gpus_per_node, dp * pp * tp * cp)
    return MemoryEstimate(
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        activations=acts,
        buffers=buffers,
        host_per_node=round(states.host * ranks_per_node * (1 + BUFFER_FRACTION)),
        nvme_per_node=states.nvme * ranks_per_node,
    )


def layout_state_bytes(training: TrainingSettings, layout: ParallelConfig) -> StateBytes:
    """The bytes per parameter of ``layout``'s model states as its engine keeps them
    (:meth:`TrainingSettings.state_bytes_for`)."""
    return training.state_bytes_for(offload=layout.offload_device, fsdp=layout.runs_fsdp2)


def reshards(layout: ParallelConfig) -> bool:
    """Whether FSDP2 frees gathered parameters after forward on the busiest (first) stage: as set, else at ZeRO-3."""
    if layout.reshard_after_forward != "auto":
        return bool(layout.reshard_after_forward)
    return layout.zero == 3


def keeps_head_gathered(layout: ParallelConfig) -> bool:
    """Whether FSDP2 keeps the unit that runs last in forward (the head) gathered into the backward instead of
    resharding it: ZeRO-3 with ``reshard_after_forward`` left to ``auto``, outside pipelines (the library's
    ``apply_zero3(keep_last_gathered=True)``, for a module whose head is a child of its own defined after the blocks
    and not tied to the embedding: ``parallel.zero.last_in_forward``; ``lp_pipeline``/``lp_hybrid`` at
    ``pipeline_parallel_size`` 1 still run stages, which keep nothing)."""
    return (layout.reshard_after_forward == "auto" and layout.zero == 3 and layout.pipeline_parallel_size == 1
            and layout.runs_fsdp2)


def _degrees(layout: ParallelConfig) -> tuple[int, int, int]:
    dp = layout.data_parallel_size
    if not isinstance(dp, int):
        raise ValueError("estimate_memory needs a numeric data_parallel_size, not 'auto'.")
    return dp, layout.pipeline_parallel_size, layout.tensor_parallel_size
