"""The step-time model behind :func:`lightning_parallel.planner.cost.estimate_step` (its docstring has the formulas).

Pure arithmetic on a :class:`~lightning_parallel.planner.rates.Rates`; no process group, no measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_parallel.config import ParallelConfig
from lightning_parallel.planner.cost import DDP_BUCKET_BYTES, RECOMPUTE_FLOPS, StepCost, _traffic, axis_links
from lightning_parallel.planner.flops import Kernels, head_work, layer_work, model_flops_per_token
from lightning_parallel.planner.hardware import Hardware
from lightning_parallel.planner.model import ModelSpec
from lightning_parallel.planner.rates import LinkRates, Rates
from lightning_parallel.planner.settings import TrainingSettings

__all__ = ["RECOMPUTE_PARTS", "StageTimes", "bubble_factor", "stage_times", "step_cost"]

RECOMPUTE_PARTS: dict[str, tuple[float, float, float]] = {
    "none": (0.0, 0.0, 0.0),
    "selective": (0.0, 1.0, 0.0),
    "full": (1.0, 1.0, 1.0),
    "selective-op": (0.5, 0.0, 1.0),
}
"""Share of the forward's GEMMs, attention core and memory-bound ops each recomputation runs again: ``selective`` is
Korthikanti et al.'s (the attention core; this library's), ``selective-op`` torchtitan's per-op policy (every second
matmul and every op outside its save list; the attention kernel's output is kept)."""


@dataclass(frozen=True)
class StageTimes:
    """One micro-batch on the busiest pipeline stage (one tp rank), in seconds."""

    forward: float
    backward: float
    recompute: float
    layers: int
    """Transformer layers on the stage."""

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


def _dtype(training: TrainingSettings) -> str:
    return {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}[training.precision]


def stage_times(model: ModelSpec, training: TrainingSettings, layout: ParallelConfig, rates: Rates, *,
                kernels: Kernels | None = None, recompute: str | None = None) -> StageTimes:
    """Compute of one micro-batch on the busiest stage: GEMMs at their shape's rate, the attention core at
    ``attention_efficiency`` of it, the memory-bound ops at the memory bandwidth (:mod:`.flops`)."""
    pp, tp, cp = layout.pipeline_parallel_size, layout.tensor_parallel_size, layout.context_parallel_size
    dtype = _dtype(training)
    shape = model.shape
    b = training.micro_batch_size
    if shape is None:  # a bare parameter count: 6 P T at the large-GEMM rate
        s = training.sequence_length(2048)
        flops = RECOMPUTE_FLOPS[layout.activation_checkpointing] * model.params_per_device(pp=pp, tp=tp) * b * s / cp
        total = flops / rates.matmul_rate(dtype)
        extra = total * (RECOMPUTE_FLOPS[layout.activation_checkpointing] / 6.0 - 1.0)
        return StageTimes(forward=(total - extra) / 3, backward=2 * (total - extra) / 3, recompute=extra, layers=0)
    s = training.sequence_length(shape.block_size)
    work = layer_work(shape, batch=b, seq=s, tp=tp, element_bytes=training.activation_bytes, cp=cp, kernels=kernels)
    gemm = sum(2.0 * m * n * k / rates.matmul_rate(dtype, m=m, n=n, k=k) for m, n, k in work.gemms)
    attention = work.attention_flops / (rates.matmul_rate(dtype, m=s / cp, n=s, k=shape.n_embd / shape.n_head)
                                        * rates.attention_efficiency)
    elementwise = work.elementwise_bytes / rates.memory_bandwidth
    layers = math.ceil(shape.n_layer / pp)
    m, n, k = head_work(shape, batch=b, seq=s, tp=tp, cp=cp)
    head = 2.0 * m * n * k / rates.matmul_rate(dtype, m=m, n=n, k=k)
    forward = layers * (gemm + attention + elementwise) + head
    share = RECOMPUTE_PARTS[recompute or layout.activation_checkpointing]
    again = layers * (share[0] * gemm + share[1] * attention + share[2] * elementwise)
    return StageTimes(forward=forward, backward=2 * forward, recompute=again, layers=layers)


def bubble_factor(layout: ParallelConfig, micro_batches: int) -> float:
    """Stage-times per step over micro-batches: ``(m + p - 1) / m`` (GPipe, 1F1B), ``(m + (p - 1) / v) / m``
    (interleaved 1F1B), ``(m + (p - 1) / 3) / m`` (zero bubble); 1 without a pipeline."""
    p, m = layout.pipeline_parallel_size, micro_batches
    if p == 1:
        return 1.0
    idle = {"interleaved_1f1b": (p - 1) / layout.virtual_pipeline_stages,
            "zero_bubble": (p - 1) / 3}.get(layout.pipeline_schedule, p - 1)
    return (m + idle) / m


def _send(link: LinkRates, collective: str, sent_bytes: float, calls: float) -> float:
    """``calls x alpha + sent_bytes / beta``: ``sent_bytes`` is what one rank sends (the bus-bandwidth bytes)."""
    if sent_bytes <= 0:
        return 0.0
    rate = link.collectives[collective]
    return calls * rate.alpha + sent_bytes / rate.beta


def _link(rates: Rates, link_name: str) -> LinkRates:
    return rates.links["inter_node" if link_name.startswith("inter-node") else "intra_node"]


def _dp_exposed(axis: str, seconds: float, layout: ParallelConfig, stage: StageTimes, m: int, rates: Rates,
                last_bucket: float) -> float:
    """The part of a dp-axis exchange the step waits for."""
    fsdp = layout.zero == 3 or (layout.pipeline_parallel_size > 1 and layout.zero >= 2) or axis != "dp"
    if fsdp:  # gathers prefetched under forward and backward, reduce-scatters under backward
        hide = rates.overlap * m * (stage.total - stage.forward / max(stage.layers, 1))
        first_gather = seconds / max(3 * (stage.layers + 1), 1)
        return max(seconds - hide, 0.0) + first_gather
    if layout.zero in (1, 2) or layout.pipeline_parallel_size > 1:
        return seconds  # flat shards after the backward; a pipeline's dp all-reduce after the schedule
    hide = rates.overlap * stage.backward  # DDP buckets under the last micro-batch's backward
    return max(seconds - hide, min(last_bucket, seconds))


def step_cost(model: ModelSpec, training: TrainingSettings, hardware: Hardware, layout: ParallelConfig, *,
              rates: Rates, kernels: Kernels | None = None, recompute: str | None = None) -> StepCost:
    """The step of ``layout``: compute, every axis's collectives and what of them is exposed, offload, the optimizer
    step and the host overhead (:func:`lightning_parallel.planner.cost.estimate_step`)."""
    dp, pp, tp = int(layout.data_parallel_size), layout.pipeline_parallel_size, layout.tensor_parallel_size
    cp = layout.context_parallel_size
    shape = model.shape
    s = training.sequence_length(shape.block_size if shape else 2048)
    b, m = training.micro_batch_size, training.micro_batches(pp)
    local = model.params_per_device(pp=pp, tp=tp)
    stage = stage_times(model, training, layout, rates, kernels=kernels, recompute=recompute)
    bubble = bubble_factor(layout, m)
    links = axis_links(layout, hardware)
    traffic = _traffic(model, training, layout, hardware, local=local, seq_len=s)
    layers = stage.layers or 1
    comm: dict[str, float] = {}
    exposed: dict[str, float] = {}
    if "tp" in traffic:  # on the critical path of every micro-batch, and so stretched by the bubble like compute
        calls = (6 if layout.activation_checkpointing == "full" else 4) * layers * m
        comm["tp"] = _send(_link(rates, links["tp"]), "all_reduce", traffic["tp"], calls)
        exposed["tp"] = comm["tp"] * bubble
    if "pp" in traffic:
        v = layout.virtual_pipeline_stages
        comm["pp"] = _send(_link(rates, links["pp"]), "p2p", traffic["pp"] * v, 2 * m * v)
        exposed["pp"] = comm["pp"] * bubble
    if "cp" in traffic:
        comm["cp"] = _send(_link(rates, links["cp"]), "p2p", traffic["cp"], 2 * (cp - 1) * layers * m)
        attention_s = 0.0 if shape is None else _attention_share(model, training, layout, rates) * m
        exposed["cp"] = max(comm["cp"] - rates.overlap * attention_s, 0.0)
    state = training.state_bytes
    for axis in ("dp", "dp_shard", "dp_replicate"):
        if axis not in traffic:
            continue
        link = _link(rates, links[axis])
        if axis == "dp" and layout.zero == 0 and pp == 1:
            grad_bytes = local * state.grad
            comm[axis] = _send(link, "all_reduce", traffic[axis], math.ceil(grad_bytes / DDP_BUCKET_BYTES))
            last = _send(link, "all_reduce", traffic[axis] * min(1.0, DDP_BUCKET_BYTES / max(grad_bytes, 1)), 1)
        else:
            collective = "all_reduce" if axis == "dp_replicate" or layout.zero == 0 else "reduce_scatter"
            calls = 3 * (layers + 1) if (layout.zero == 3 or axis == "dp_shard") else 2
            comm[axis] = _send(link, collective, traffic[axis], calls)
            last = 0.0
        exposed[axis] = _dp_exposed(axis, comm[axis], layout, stage, m, rates, last)
    offload = 0.0
    if "offload" in traffic:
        offload = (traffic["offload"] / rates.host_link_bandwidth
                   + traffic["host_optimizer"] / rates.host_optimizer_params_per_s
                   + traffic.get("nvme", 0.0) / rates.nvme_bandwidth)
        comm["offload"] = exposed["offload"] = offload
    shard = local / (dp * cp) if layout.zero >= 1 else local
    optimizer = 0.0 if layout.offload_device != "none" else (
        shard * (2 * state.param + state.grad + 2 * state.optimizer) / rates.memory_bandwidth)
    compute = m * stage.total * bubble
    flops = 0.0
    if shape is not None:
        flops = model_flops_per_token(shape, seq=s) * b * s * m / (pp * tp * cp)
    else:
        flops = 6.0 * model.n_params * b * s * m / (pp * tp * cp)
    return StepCost(
        compute_s=compute,
        comm_s=comm,
        tokens=dp * m * b * s,
        links=links,
        exposed_s=exposed,
        overhead_s=optimizer + rates.host_overhead_s,
        model_flops=flops,
        peak_flops=rates.peak(_dtype(training)),
        rates_source=rates.source,
    )


def _attention_share(model: ModelSpec, training: TrainingSettings, layout: ParallelConfig, rates: Rates) -> float:
    """Seconds of attention core (forward and backward) per micro-batch on the busiest stage: what ring attention's
    transfers hide under."""
    shape = model.shape
    assert shape is not None
    s = training.sequence_length(shape.block_size)
    cp, tp = layout.context_parallel_size, layout.tensor_parallel_size
    work = layer_work(shape, batch=training.micro_batch_size, seq=s, tp=tp, cp=cp)
    rate = rates.matmul_rate(_dtype(training), m=s / cp, n=s, k=shape.n_embd / shape.n_head)
    rate *= rates.attention_efficiency
    return 3.0 * math.ceil(shape.n_layer / layout.pipeline_parallel_size) * work.attention_flops / rate
