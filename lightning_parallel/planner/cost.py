"""A rough time per training step, used only to rank layouts that fit, and the link each layout stresses.

Nothing is assumed to overlap, so it is an upper bound; the figures are for ordering candidates, not promises.
Per device and step, with ``P`` = parameters on the device, ``m`` micro-batches of ``b`` sequences of ``s`` tokens:

* compute: ``6 P b s m`` FLOPs (``8`` with full recompute, +3 % selective) at 50 % of peak, times
  ``1 + (p - 1) / (v m)`` for the pipeline bubble;
* dp: ``2 g P (N_d - 1) / N_d`` bytes (all-reduce, or reduce-scatter + all-gather under ZeRO-1/2), ``3 g P``-based
  under ZeRO-3 (the ZeRO paper's 2 Psi and 3 Psi), over the link the dp group spans;
* tp: 4 all-reduces of ``e s b h`` per layer and micro-batch (2 forward, 2 backward, Megatron), ring factor
  ``2 (t - 1) / t``, on the intra-node link (6 with full recompute);
* pp: one activation ``e s b h`` forward and one gradient backward per micro-batch and stage boundary;
* offload: 16-bit gradients out and weights back over PCIe (``2 g P / N_d``; ZeRO-3 fetches weights in forward and
  backward, ``+ 2 p P / N_d``), the host optimizer at 2.5e8 parameters/s per rank, NVMe reading and writing the
  optimizer state once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_parallel.config import ParallelConfig
from lightning_parallel.planner.hardware import LINK_BANDWIDTH, Hardware
from lightning_parallel.planner.model import ModelSpec
from lightning_parallel.planner.settings import TrainingSettings

__all__ = ["HOST_OPTIMIZER_PARAMS_PER_S", "MFU", "RECOMPUTE_FLOPS", "StepCost", "axis_links", "estimate_step"]

MFU = 0.5
"""Share of peak FLOP/s a step is taken to reach."""
HOST_OPTIMIZER_PARAMS_PER_S = 2.5e8
"""Parameters per second a host (CPU) optimizer updates, per rank."""
RECOMPUTE_FLOPS: dict[str, float] = {"none": 6.0, "selective": 6.0 * 1.03, "full": 8.0}
"""FLOPs per parameter and token: forward 2 + backward 4; full recompute repeats the forward (+2); selective
recompute costs a few per cent (Korthikanti et al. 2022 measure 2-4 %)."""


@dataclass(frozen=True)
class StepCost:
    """Seconds per step by part, and the tokens the whole world processes in it."""

    compute_s: float
    comm_s: dict[str, float]
    tokens: int
    links: dict[str, str]

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else math.inf

    def stressed_link(self) -> str:
        """The busiest link, e.g. ``inter-node slow (dp)``, or ``none`` when nothing is communicated."""
        busy = {k: v for k, v in self.comm_s.items() if v > 0}
        if not busy:
            return "none"
        axis = max(busy, key=lambda k: busy[k])
        return f"{self.links.get(axis, axis)} ({axis})"


def axis_links(layout: ParallelConfig, hardware: Hardware) -> dict[str, str]:
    """Which link each mesh axis spans; tp innermost, then pp, then dp (the mesh order of ``docs/architecture.md``)."""
    dp, pp, tp = int(layout.data_parallel_size), layout.pipeline_parallel_size, layout.tensor_parallel_size
    intra, inter = f"intra-node {hardware.intra_node}", f"inter-node {hardware.inter_node}"
    g = hardware.gpus_per_node
    return {
        "tp": intra if tp <= g else inter,
        "pp": intra if pp * tp <= g else inter,
        "dp": intra if dp * pp * tp <= g else inter,
        "offload": "host PCIe",
        "nvme": "NVMe",
    }


def _bandwidth(link: str) -> float:
    special = {"host PCIe": "host", "NVMe": "nvme"}
    return LINK_BANDWIDTH[special.get(link, link.split()[-1])]


def estimate_step(model: ModelSpec, training: TrainingSettings, hardware: Hardware, layout: ParallelConfig) -> StepCost:
    """Seconds per step of ``layout``: compute plus every axis's traffic over its link, without overlap."""
    dp, pp, tp = int(layout.data_parallel_size), layout.pipeline_parallel_size, layout.tensor_parallel_size
    local = model.params_per_device(pp=pp, tp=tp)
    shape = model.shape
    s = training.sequence_length(shape.block_size if shape else 2048)
    b, m = training.micro_batch_size, training.micro_batches(pp)
    flops = RECOMPUTE_FLOPS[layout.activation_checkpointing] * local * b * s * m
    rate = hardware.peak_tflops * 1e12 * MFU / (1 if training.mixed else 4)
    compute = flops / rate
    if pp > 1:
        compute *= 1 + (pp - 1) / (layout.virtual_pipeline_stages * m)
    links = axis_links(layout, hardware)
    traffic = _traffic(model, training, layout, hardware, local=local, seq_len=s)
    comm = {axis: bytes_ / _bandwidth(links[axis]) for axis, bytes_ in traffic.items() if axis != "host_optimizer"}
    if "host_optimizer" in traffic:
        comm["offload"] = comm.get("offload", 0.0) + traffic["host_optimizer"] / HOST_OPTIMIZER_PARAMS_PER_S
    return StepCost(compute_s=compute, comm_s=comm, tokens=dp * m * b * s, links=links)


def _traffic(
    model: ModelSpec,
    training: TrainingSettings,
    layout: ParallelConfig,
    hardware: Hardware,
    *,
    local: int,
    seq_len: int,
) -> dict[str, float]:
    """Bytes per device and step on each axis (``host_optimizer`` is a parameter count, not bytes)."""
    dp, pp, tp = int(layout.data_parallel_size), layout.pipeline_parallel_size, layout.tensor_parallel_size
    state, e = training.state_bytes, training.activation_bytes
    b, m = training.micro_batch_size, training.micro_batches(pp)
    out: dict[str, float] = {}
    if dp > 1:
        factor = 3 if layout.zero == 3 else 2
        out["dp"] = factor * state.grad * local * (dp - 1) / dp
    shape = model.shape
    if shape is not None and tp > 1:
        collectives = 6 if layout.activation_checkpointing == "full" else 4
        per_layer = collectives * 2 * (tp - 1) / tp * e * seq_len * b * shape.n_embd
        out["tp"] = per_layer * math.ceil(shape.n_layer / pp) * m
    if shape is not None and pp > 1:
        out["pp"] = 2 * m * e * seq_len * b * shape.n_embd / (tp if layout.sequence_parallel else 1)
    if layout.offload_device != "none":
        shard = local / dp
        out["offload"] = 2 * state.grad * shard + (2 * state.param * shard if layout.zero == 3 else 0)
        out["host_optimizer"] = shard
        if layout.offload_device == "nvme":
            ranks = min(hardware.gpus_per_node, dp)
            out["nvme"] = 2 * state.optimizer * shard * ranks
    return out
