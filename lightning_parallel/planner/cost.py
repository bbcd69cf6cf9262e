"""Time per training step of a layout, from the layer shapes and the machine's rates, and the link each layout
stresses.

The rates (:class:`~lightning_parallel.planner.rates.Rates`) are a calibration of this machine or a profile's vendor
figures. Per device and step, with ``m`` micro-batches of ``b`` sequences of ``s`` tokens, ``p`` stages, ``v`` model
chunks per stage:

* compute (:mod:`.flops`): each layer's GEMMs at the calibrated matmul rate of their shape and dtype, the attention
  core at ``attention_efficiency`` of it plus ``attention_call_s`` per call, the memory-bound rest at the memory
  bandwidth; backward twice the forward; recomputation adds the forward (``full``) or the attention core
  (``selective``). A stage's micro-batch time ``t`` is its layers (the busiest stage: the head's logits on the last)
  plus its exposed tensor-parallel and point-to-point time; the pipeline runs ``(m + p - 1) t`` (GPipe, 1F1B),
  ``(m + (p - 1) / v) t`` (interleaved 1F1B) or ``(m + (p - 1) / 3) t`` (zero bubble: the weight-gradient passes
  fill two thirds of the 1F1B bubble);
* each axis's collectives from the alpha-beta model: ``calls x alpha + bytes sent per rank / beta`` (bus bandwidth),
  ``bytes`` per rank as below; what is exposed:

  - tp: 4 all-reduces of ``e s b h`` per layer and micro-batch (6 with full recomputation): on the critical path;
    with a calibrated pair of DTensor linears (:attr:`Rates.tp_pair_s`), half of it per linear of the stage
    (:attr:`ModelShape.block_linears` per block -- q, k, v, out, the MLP's -- and the embedding's and head's) in
    place of the all-reduces' latency: each linear pays DTensor's dispatch in forward and backward;
  - pp: one activation forward and one gradient backward per micro-batch and boundary: on the critical path;
  - dp, DDP: ``2 g P (N_d - 1) / N_d`` in 25 MB buckets under the last micro-batch's backward; exposed: what does not
    fit under it (``overlap`` of the rates) and the last bucket;
  - dp, ZeRO-1/2 (flat shards, one per param group: :data:`FLAT_GROUPS`): a reduce-scatter and an all-gather each,
    after the backward: exposed; ZeRO-2 (no offload) reduces each rank's chunk during the backward instead (``N``
    reduces per group, priced as reduce-scatters of their bytes): hidden under it like DDP's buckets, the last
    chunk's exposed, the all-gather after the step exposed;
  - dp, ZeRO-3 / FSDP2 (and HSDP's parts): the all-gathers prefetched under forward and backward, the reduce-scatter
    under backward: exposed beyond the compute they hide under, plus the first layer's gather; a calibrated unit's
    cost scales with its collectives per step (inside pipeline stages one all-gather per micro-batch and one more
    when resharding after forward; outside them at ZeRO-3's ``auto`` the head, kept gathered into the backward, one
    all-gather per batch fewer);
  - cp (ring attention): per layer its calibrated cost (a fixed part and a part per element of a rank's queries)
    and its bytes, under the attention core it overlaps;
* offload: 16-bit gradients out and weights back over the host link, the host optimizer at
  ``host_optimizer_params_per_s``, NVMe reading and writing the optimizer state, and the engine's calibrated cost
  per step and per parameter tensor (``offload_step_s``, ``offload_tensor_s``: it then holds the flat exchange's
  latency) and per parameter beyond those bytes (``offload_param_s``, its copies into and out of its partitions):
  exposed;
* the optimizer step on the device: parameters, gradients and states read and written at the calibrated optimizer
  rate, plus its calibrated cost per parameter tensor (higher per ``DTensor``: FSDP2 and tensor-parallel parameters;
  a flat shard per param group under ZeRO-1/2); the framework's host overhead per step, and the eager ops' dispatch
  (``op_overhead_s`` per op, :data:`OPS_PER_LAYER` per layer and micro-batch; :data:`ADAM_OPS_PER_TENSOR` per
  parameter tensor where the optimizer's per-tensor cost is not calibrated): on CPU it adds to the step, on GPUs
  only what the kernels do not cover;
* CPU ranks beyond the machine's cores share them: the step is the longer of the step as calibrated and a rank's
  CPU work (compute, overheads, and the calibrated CPU share of each axis's costs, :attr:`Rates.busy`) stretched by
  :meth:`~lightning_parallel.planner.rates.Rates.core_share` -- while one rank waits at a collective, another
  computes -- every part scaled alike; a calibrated collective's latency follows the ring of the group
  (:meth:`~lightning_parallel.planner.rates.Rates.ring_latency_scale`);
* gradient accumulation (``a`` batches per optimizer step, :meth:`TrainingSettings.accumulation`): the compute, the
  per-batch collectives (tp, pp, cp, FSDP2's all-gathers) and the dispatch ``a`` times, each pipeline batch with its
  bubble; the optimizer step once, the gradient reduction once too -- but each batch's in a pipeline at ZeRO-2/3
  (torch's schedule reduces at the end of every batch), under ``reduce_each_batch`` and in the offload engine; the
  host overhead ``1 + (a - 1) r`` times (:attr:`Rates.host_batch_share`); the step's tokens ``a`` times a batch's.

The bytes each axis moves (:func:`axis_bytes_per_rank`) are the same in every mesh order; ``g`` and ``p`` are the
bytes per element of the gradients reduced and the weights gathered as the layout's engine holds them
(:func:`~lightning_parallel.planner.memory.layout_state_bytes`): under Lightning's mixed precision fp32 gradients
(4) and weights (4), bf16 weights (2) for FSDP2's all-gathers under ``bf16-mixed``; 2 and 2 in the offload engine:

* dp: ``2 g P (N_d - 1) / N_d`` bytes (all-reduce, or reduce-scatter + all-gather under ZeRO-1/2), ``(g + 2 p)
  P``-based under ZeRO-3 (the ZeRO paper's 2 Psi and 3 Psi), over the link the dp group spans;
* tp: 4 all-reduces of ``s b h`` elements per layer and micro-batch (2 forward of ``e`` bytes, 2 backward of ``r``:
  the residual stream's gradient; Megatron), ring factor ``2 (t - 1) / t``, on the intra-node link (6 with full
  recompute: 2 more forward);
* pp: one activation ``r s b h`` forward and one gradient backward per micro-batch and stage boundary (``r`` the
  residual stream's bytes: 4 under Lightning's autocast, :meth:`TrainingSettings.residual_bytes`; ``/ t``
  with sequence parallelism);
* cp (context parallelism, ring attention): per layer and micro-batch, the k/v block ``2 e b (s/c) h / t`` travels
  ``c - 1`` hops forward and ``c - 1`` backward, and its fp32 dk/dv accumulator ``2 x 4 b (s/c) h / t`` ``c`` hops;
  compute divides by ``c`` (each rank runs ``s / c`` tokens) and the dp exchange runs over the ``dp x c`` replicas;
* offload: 16-bit gradients out and weights back over PCIe (``2 g P / N_d``; ZeRO-3 fetches weights in forward and
  backward, ``+ 2 p P / N_d``), the host optimizer, NVMe reading and writing the optimizer state once per step;
  accumulating ``a`` batches, each batch's gradient goes out (``(a + 1) g P / N_d``) and ZeRO-3's weights move in
  every batch (``2 a p P / N_d``).

Each axis's traffic goes over the link its groups span (:func:`axis_links`), which follows ``parallel.mesh_order``:
with ``dp-pp-tp`` on several nodes the dp gradient exchange crosses nodes, with ``pp-dp-tp`` it stays inside a node
when ``dp x tp`` devices fit one. :func:`cross_node_bytes` counts what each axis moves between nodes in one step,
the figure the planner chooses the mesh order by.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from lightning_parallel.config import ParallelConfig
from lightning_parallel.parallel.dims import MESH_AXES, MESH_ORDERS, ParallelDims
from lightning_parallel.planner.calibrate import rates_for
from lightning_parallel.planner.flops import Kernels, head_work, layer_work, model_flops_per_token
from lightning_parallel.planner.hardware import Hardware
from lightning_parallel.planner.memory import keeps_head_gathered, layout_state_bytes, reshards
from lightning_parallel.planner.model import ModelShape, ModelSpec
from lightning_parallel.planner.rates import LinkRates, Rates
from lightning_parallel.planner.settings import TrainingSettings

__all__ = [
    "ADAM_OPS_PER_TENSOR",
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "FLAT_GROUPS",
    "OPS_PER_LAYER",
    "OPS_PER_STEP",
    "RECOMPUTE_FLOPS",
    "RECOMPUTE_PARTS",
    "TENSORS_PER_LAYER",
    "StageTimes",
    "StepCost",
    "axis_bytes_per_rank",
    "axis_links",
    "bubble_factor",
    "cross_node_bytes",
    "cross_node_bytes_by_order",
    "ddp_bucket_bytes",
    "estimate_step",
    "layout_dims",
    "stage_times",
    "step_cost",
]

RECOMPUTE_FLOPS: dict[str, float] = {"none": 6.0, "selective": 6.0 * 1.03, "full": 8.0}
"""FLOPs per parameter and token when the model's shape is unknown: forward 2 + backward 4; full recompute repeats
the forward (+2); selective recompute costs a few per cent (Korthikanti et al. 2022 measure 2-4 %)."""
OPS_PER_LAYER = 130
"""Eager ops one transformer layer dispatches per micro-batch, forward and backward: 129 counted at the dispatcher
(a ``TorchDispatchMode`` counter) on the library's GPT block, torch 2.13 (norms, linears, head reshapes, attention,
activation, adds, and their gradients)."""
OPS_PER_STEP = 40
"""Ops per micro-batch outside the layers (embedding, head, loss and their gradients): 37 counted the same way."""
ADAM_OPS_PER_TENSOR = 10
"""Ops torch's per-tensor (``foreach=False``, its CPU default) AdamW step dispatches per parameter tensor: 10 counted
the same way, after the first step."""
FLAT_GROUPS = 2
"""Flat shards a ZeRO-1/2 step exchanges and steps: one per optimizer param group, and training recipes for GPT-like
models (this library's GPT, nanoGPT, Hugging Face's Trainer) make two -- the weight-decayed matrices and the rest."""
TENSORS_PER_LAYER = 12
"""Parameter tensors of a transformer layer with biases (two norms' weight and bias, four linears' weight and
bias); 5 more outside the layers (embeddings, final norm, head)."""
DDP_BUCKET_BYTES = 25 * 2**20
"""torch DDP's gradient bucket (``bucket_cap_mb`` left to torch: 25 MB after a first bucket of
:data:`DDP_FIRST_BUCKET_BYTES`); the last one is all-reduced after the backward ends."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""torch DDP's first bucket under its default bucketing (the last layers' gradients, ready first)."""


def ddp_bucket_bytes(grad_bytes: float) -> list[float]:
    """The bytes of each DDP bucket in the order they are all-reduced, as torch's default bucketing fills them: a
    first bucket of :data:`DDP_FIRST_BUCKET_BYTES`, then :data:`DDP_BUCKET_BYTES` each, the last one the rest."""
    buckets = [min(grad_bytes, float(DDP_FIRST_BUCKET_BYTES))]
    rest = grad_bytes - buckets[0]
    while rest > 0:
        buckets.append(min(rest, float(DDP_BUCKET_BYTES)))
        rest -= buckets[-1]
    return buckets


@dataclass(frozen=True)
class StepCost:
    """Seconds per step by part, and the tokens the whole world processes in it.

    ``comm_s`` is each axis's whole communication time, ``exposed_s`` the part of it the step waits for (the rest
    hides under compute); the step is ``compute_s + sum(exposed_s) + overhead_s``."""

    compute_s: float
    comm_s: dict[str, float]
    tokens: int
    links: dict[str, str]
    exposed_s: dict[str, float] = field(default_factory=dict)
    """Per axis, the communication the step waits for."""
    overhead_s: float = 0.0
    """The device optimizer step and the framework's host overhead."""
    model_flops: float = 0.0
    """Model FLOPs per device and step (forward + backward, no recomputation): what MFU counts."""
    peak_flops: float = 0.0
    """The peak FLOP/s MFU is against (calibrated, or the vendor's)."""
    rates_source: str = ""
    """Where the rates came from."""

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.exposed_s.values()) + self.overhead_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization: model FLOPs per second of one device over its peak (0 when unknown)."""
        if self.step_s <= 0 or self.peak_flops <= 0:
            return 0.0
        return self.model_flops / self.step_s / self.peak_flops

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


def layout_dims(layout: ParallelConfig, hardware: Hardware) -> ParallelDims:
    """The layout's degrees and mesh order on all of ``hardware``'s devices (``data_parallel_size`` resolved)."""
    return ParallelDims.from_config(layout, world_size=hardware.world_size)


def _nodes_spanned(group: list[int], gpus_per_node: int) -> int:
    return len({rank // gpus_per_node for rank in group})


def axis_links(layout: ParallelConfig, hardware: Hardware) -> dict[str, str]:
    """Which link each mesh axis spans in ``layout.mesh_order``: inter-node when any of its groups has ranks on two
    nodes (rank ``r`` on node ``r // gpus_per_node``), else intra-node."""
    intra, inter = f"intra-node {hardware.intra_node}", f"inter-node {hardware.inter_node}"
    g = hardware.gpus_per_node
    axes = (*MESH_AXES, *(("cp",) if layout.context_parallel_size > 1 else ()), *DP_PARTS)
    out = {axis: intra for axis in axes}
    if hardware.nodes > 1:
        dims = layout_dims(layout, hardware)
        for axis in axes:
            if any(_nodes_spanned(group, g) > 1 for group in _groups(dims, axis)):
                out[axis] = inter
    return {**out, "offload": "host PCIe", "nvme": "NVMe"}


DP_PARTS = ("dp_shard", "dp_replicate")
"""HSDP's two parts of the dp axis: the FSDP2 shard groups and the groups of replicas of one shard."""


def _groups(dims: ParallelDims, axis: str) -> list[list[int]]:
    """Every group of a mesh axis, or of one of HSDP's dp parts (each once, ordered by first rank). With context
    parallelism the gradient exchange booked on ``dp`` runs over the ``dp x cp`` replicas: their groups."""
    if axis == "dp" and dims.cp > 1 and not dims.hsdp:
        groups: dict[int, list[int]] = {}
        for r in range(dims.world_size):
            replicas = dims.replica_group_ranks(r)
            groups.setdefault(replicas[0], replicas)
        return [groups[k] for k in sorted(groups)]
    if axis in (*MESH_AXES, "cp"):
        return dims.axis_groups(axis)
    seen: dict[int, list[int]] = {}
    for rank in range(dims.world_size):
        group = dims.dp_subgroup_ranks(axis, rank)
        seen.setdefault(group[0], group)
    return [seen[k] for k in sorted(seen)]


def cross_node_bytes(
    dims: ParallelDims, *, gpus_per_node: int, bytes_per_rank: Mapping[str, float], virtual_stages: int = 1
) -> dict[str, float]:
    """Bytes each mesh axis moves between nodes in one step, summed over the whole world, in ``dims.order``.

    Rank ``r`` runs on node ``r // G`` (``G = gpus_per_node``; launchers fill nodes in rank order).
    ``B_a = bytes_per_rank[a]`` is what one rank sends on axis ``a`` per step (:func:`axis_bytes_per_rank`; a missing
    axis sends nothing):

    * ``dp``, ``tp`` (rings: all-reduce, or reduce-scatter + all-gather): each member sends ``B_a`` to the next
      member of its group in rank order (``B_dp = 2 g P (d - 1) / d`` for ``P`` parameters per rank of ``g`` bytes,
      ``3 g P (d - 1) / d`` under ZeRO-3). A group's ranks on one node are consecutive in that order, so a ring over
      ``k`` nodes has ``k`` edges between nodes when ``k > 1`` and none when ``k = 1``::

          cross[a] = B_a * sum over the groups of a of (k if k > 1 else 0)

    * ``pp`` (point to point): ``B_pp = 2 m e b s h`` (``/ t`` with sequence parallelism) is one activation forward
      and one gradient backward per micro-batch over one stage boundary. A pp group is the chain of its ``p`` stages
      in rank order; with ``v`` model chunks per rank (``virtual_stages``) the chain is walked ``v`` times and wraps
      from the last rank back to the first ``v - 1`` times::

          cross[pp] = B_pp * sum over the pp groups of (v * c + (v - 1) * w)

      with ``c`` the boundaries ``i -> i + 1`` between two nodes and ``w = 1`` when the last and first stage are on
      different nodes (else 0).

    Example, ``dp = pp = tp = 2`` on 2 nodes of 4: ``dp-pp-tp`` has 4 dp groups ``[0, 4] ... [3, 7]`` of ``k = 2``
    (``cross[dp] = 8 B_dp``) and pp groups inside a node (``cross[pp] = 0``); ``pp-dp-tp`` has dp inside a node and
    4 pp groups ``[0, 4] ... [3, 7]`` with one boundary each (``cross[pp] = 4 B_pp``).
    """
    if gpus_per_node < 1 or virtual_stages < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node} and virtual_stages={virtual_stages} must be >= 1.")
    out: dict[str, float] = {}
    for axis in (*MESH_AXES, *(("cp",) if dims.cp > 1 else ()), *DP_PARTS):
        per_rank = float(bytes_per_rank.get(axis, 0.0))
        edges = 0
        for group in _groups(dims, axis) if per_rank and len(_groups(dims, axis)[0]) > 1 else []:
            if axis == "pp":
                nodes = [rank // gpus_per_node for rank in group]
                chain = sum(a != b for a, b in itertools.pairwise(nodes))
                edges += virtual_stages * chain + (virtual_stages - 1) * (nodes[-1] != nodes[0])
            else:
                k = _nodes_spanned(group, gpus_per_node)
                edges += k if k > 1 else 0
        key = "dp" if axis in DP_PARTS else axis  # HSDP's parts are the dp axis's traffic
        out[key] = out.get(key, 0.0) + per_rank * edges
    return out


def estimate_step(model: ModelSpec, training: TrainingSettings, hardware: Hardware, layout: ParallelConfig, *,
                  rates: Rates | None = None, kernels: Kernels | None = None, recompute: str | None = None) -> StepCost:
    """Seconds per step of ``layout`` on ``hardware`` (the module docstring's model). ``rates`` default to
    :func:`~lightning_parallel.planner.rates.rates_for` ``(hardware)``; ``kernels`` to this library's GPT
    (:data:`~lightning_parallel.planner.flops.KERNELS`); ``recompute`` overrides the layout's recomputation with a
    policy of :data:`~lightning_parallel.planner.cost.RECOMPUTE_PARTS` (e.g. torchtitan's ``selective-op``)."""
    return step_cost(model, training, hardware, layout, rates=rates or rates_for(hardware), kernels=kernels,
                     recompute=recompute)


def axis_bytes_per_rank(
    model: ModelSpec, training: TrainingSettings, layout: ParallelConfig, hardware: Hardware
) -> dict[str, float]:
    """Bytes one rank sends per step on each mesh axis (dp, tp, pp; the module docstring's formulas), the same in
    every mesh order; absent axes move nothing."""
    pp, tp = layout.pipeline_parallel_size, layout.tensor_parallel_size
    s = training.sequence_length(model.shape.block_size if model.shape else 2048)
    traffic = _traffic(model, training, layout, hardware, local=model.params_per_device(pp=pp, tp=tp), seq_len=s)
    return {axis: traffic[axis] for axis in (*MESH_AXES, "cp", *DP_PARTS) if axis in traffic}


def cross_node_bytes_by_order(
    model: ModelSpec, training: TrainingSettings, hardware: Hardware, layout: ParallelConfig
) -> dict[str, dict[str, float]]:
    """For each mesh order (``dp-pp-tp``, ``pp-dp-tp``): :func:`cross_node_bytes` of ``layout`` on ``hardware``, per
    axis, plus ``total``. All zero on one node."""
    per_rank = axis_bytes_per_rank(model, training, layout, hardware)
    out: dict[str, dict[str, float]] = {}
    for order in MESH_ORDERS:
        dims = layout_dims(layout.replace(mesh_order=order), hardware)
        axes = cross_node_bytes(dims, gpus_per_node=hardware.gpus_per_node, bytes_per_rank=per_rank,
                                virtual_stages=layout.virtual_pipeline_stages)
        out[order] = {**axes, "total": sum(axes.values())}
    return out


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
    cp = layout.context_parallel_size
    state, e = layout_state_bytes(training, layout), training.activation_bytes
    b, m = training.micro_batch_size, training.micro_batches(pp)
    acc = training.accumulation(dp, pp)
    out: dict[str, float] = {}
    if cp > 1 and model.shape is not None:  # ring attention: k/v blocks forward and backward, dk/dv accumulators
        block = 2 * b * (seq_len / cp) * model.shape.n_embd / tp
        per_layer = (2 * (cp - 1) * e + cp * 4) * block
        out["cp"] = per_layer * math.ceil(model.shape.n_layer / pp) * m * acc
    dp = dp * cp  # the replicas the gradients are exchanged over: dp x cp
    if dp > 1:
        s = (layout.data_parallel_shard_size or dp // cp) * cp
        per_param: float
        if pp > 1 and layout.zero >= 2:
            # FSDP2 in pipeline stages (measured): the reduce-scatter once per step; one all-gather per step, or,
            # resharding after forward (ZeRO-3), one per micro-batch and one more
            gathers = (m + 1 if reshards(layout) else 1) * acc
            per_param = gathers * state.gathered + _reductions(layout, acc) * state.reduced
        elif layout.zero == 3 or (layout.zero == 2 and s < dp):  # FSDP2 (ZeRO-3; ZeRO-2 under HSDP): its
            # all-gathers every batch, the reduce-scatter once per step (each batch's under reduce_each_batch); the
            # head kept gathered from its forward into its backward is gathered once per batch, not twice
            per_param = ((2 if reshards(layout) else 1) * acc * state.gathered
                         + _reductions(layout, acc) * state.reduced
                         - acc * state.gathered * _kept_params(model, layout) / max(local, 1))
        elif layout.zero == 2:  # the flat shards: the gradient's reduction (per batch under reduce_each_batch), the
            # parameters' all-gather once
            per_param = _reductions(layout, acc) * state.reduced + state.gathered
        else:  # DDP's all-reduce, or ZeRO-1's reduce-scatter and all-gather
            per_param = state.reduced + (state.gathered if layout.zero == 1 else state.reduced)
        if s < dp:  # HSDP: FSDP2's collectives inside each shard group, then an all-reduce of the shards across
            r = dp // s
            out["dp_shard"] = per_param * local * (s - 1) / s
            out["dp_replicate"] = 2 * _reductions(layout, acc) * state.reduced * (local / s) * (r - 1) / r
        else:
            out["dp"] = per_param * local * (dp - 1) / dp
    shape = model.shape
    r = training.residual_bytes(offload=layout.offload_device, fsdp=layout.runs_fsdp2)  # the residual stream's
    if shape is not None and tp > 1:
        # the forward's all-reduces carry the linears' 16-bit outputs (twice more when fully recomputed), the
        # backward's the gradients of the residual stream (fp32 under autocast: measured 0.80 of fp32's bytes under
        # bf16-mixed, 0.50 under bf16-true)
        forward = 4 if layout.activation_checkpointing == "full" else 2
        grad = training.norm_bytes(offload=layout.offload_device, fsdp=layout.runs_fsdp2,
                                   gpu=hardware.accelerator != "cpu")  # the LayerNorm output's gradient
        # under sequence parallelism half of the forward's traffic is the all-gather of the LayerNorm output
        forward_bytes = (e + grad) / 2 if layout.sequence_parallel else e
        per_layer = (forward * forward_bytes + 2 * grad) * 2 * (tp - 1) / tp * (seq_len // cp) * b * shape.n_embd
        out["tp"] = per_layer * math.ceil(shape.n_layer / pp) * m * acc
    if shape is not None and pp > 1:  # a stage sends the residual stream
        out["pp"] = 2 * m * acc * r * seq_len / cp * b * shape.n_embd / (tp if layout.sequence_parallel else 1)
    if layout.offload_device != "none":
        shard = local / dp
        # each batch's gradient out (the engine reduces every batch), the weights back once; at stage 3 the weights
        # both ways every batch
        out["offload"] = ((acc + 1) * state.grad * shard
                          + (2 * acc * state.param * shard if layout.zero == 3 else 0))
        out["host_optimizer"] = shard
        if layout.offload_device == "nvme":
            ranks = min(hardware.gpus_per_node, dp)
            out["nvme"] = 2 * state.optimizer * shard * ranks
    return out


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
    ``attention_efficiency`` of it plus its calibrated cost per call (a third in forward, two in backward), the
    memory-bound ops at the memory bandwidth (:mod:`.flops`)."""
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
                                        * rates.attention_efficiency) + rates.attention_call_s / 3
    elementwise = work.elementwise_bytes / rates.elementwise_rate
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


def _send(link: LinkRates, collective: str, sent_bytes: float, calls: float, *, rates: Rates | None = None,
          ranks: int = 2) -> float:
    """``calls x alpha + sent_bytes / beta``: ``sent_bytes`` is what one rank sends (the bus-bandwidth bytes); a
    calibrated ``alpha`` is scaled to a ring of ``ranks`` (:meth:`Rates.ring_latency_scale`)."""
    if sent_bytes <= 0:
        return 0.0
    rate = link.collectives[collective]
    scale = rates.ring_latency_scale(collective, ranks) if rates is not None else 1.0
    return calls * rate.alpha * scale + sent_bytes / rate.beta


def _per_unit(link: LinkRates, collective: str, sent_bytes: float, seconds: float) -> float:
    """A calibrated per-unit cost in place of ``calls x alpha`` (:attr:`Rates.fsdp_unit_s`, :attr:`Rates.tp_pair_s`,
    :attr:`Rates.pp_micro_batch_s`, :attr:`Rates.cp_layer_s`: ``seconds`` is units x cost, scaled by the caller to
    the group): ``seconds + sent_bytes / beta``."""
    return seconds + _send(link, collective, sent_bytes, 0)


def _link(rates: Rates, link_name: str) -> LinkRates:
    return rates.links["inter_node" if link_name.startswith("inter-node") else "intra_node"]


def _kept_params(model: ModelSpec, layout: ParallelConfig) -> int:
    """Parameters (per tp rank) of the unit FSDP2 keeps gathered from its forward into its backward
    (:func:`~lightning_parallel.planner.memory.keeps_head_gathered`): the head -- final norm and vocabulary
    projection -- when the layer shapes are known, else none counted; none with tied embeddings (the head shares the
    embedding's FSDP2 group, which runs first)."""
    if model.shape is None or model.shape.tie_embeddings or not keeps_head_gathered(layout):
        return 0
    return model.shape.head_params(layout.tensor_parallel_size)


def _reductions(layout: ParallelConfig, acc: int) -> int:
    """Gradient reductions per step of ``acc`` accumulated batches: one (DDP, ZeRO-1, the flat ZeRO-2 and FSDP2
    outside pipelines keep the batches' gradients local), or each batch's -- under ``reduce_each_batch``, in a
    pipeline at ZeRO-2/3 (torch's schedule reduce-scatters at the end of each of its steps) and in the offload
    engine."""
    each = (layout.reduce_each_batch or layout.offload_device != "none"
            or (layout.pipeline_parallel_size > 1 and layout.zero >= 2))
    return acc if each else 1


def _fsdp_exchange(layout: ParallelConfig, axis: str) -> bool:
    """Whether a dp axis's exchange is FSDP2's per unit (ZeRO-3; ZeRO-2 inside pipeline stages; HSDP's two parts)
    rather than a DDP all-reduce or ZeRO-1/2's flat shards."""
    return layout.zero == 3 or (layout.pipeline_parallel_size > 1 and layout.zero >= 2) or axis in DP_PARTS


def _fsdp_collectives(layout: ParallelConfig, axis: str, m: int, acc: int = 1) -> int:
    """FSDP2's collectives per unit and step on a dp axis: under HSDP one all-reduce of the unit's gradient shard
    over the replicas (``dp_replicate``); else the reduce-scatter of its gradient and its all-gathers -- one in
    forward and one in backward when it reshards after forward (ZeRO-3), one when not (ZeRO-2); inside pipeline
    stages one per micro-batch and one more when resharding (measured: the schedule's backwards keep the parameters
    gathered until the last), else one per step; the all-gathers again for each of the ``acc`` batches a step
    accumulates (the reduction waits for the last)."""
    if axis == "dp_replicate":
        return _reductions(layout, acc)
    if layout.pipeline_parallel_size > 1:
        return (m + 1 if reshards(layout) else 1) * acc + _reductions(layout, acc)
    return (2 if reshards(layout) else 1) * acc + _reductions(layout, acc)


def _dp_exposed(axis: str, seconds: float, layout: ParallelConfig, stage: StageTimes, m: int, rates: Rates,
                last_bucket: float, acc: int = 1) -> float:
    """The part of a dp-axis exchange the step waits for (``acc``: batches accumulated per step)."""
    if _fsdp_exchange(layout, axis):  # gathers prefetched under forward and backward, reduce-scatters under backward
        hide = rates.overlap * m * acc * (stage.total - stage.forward / max(stage.layers, 1))
        first_gather = acc * seconds / max(_fsdp_collectives(layout, axis, m, acc) * (stage.layers + 1), 1)
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
    acc = training.accumulation(dp, pp)  # batches per optimizer step, each of m micro-batches (_reductions)
    local = model.params_per_device(pp=pp, tp=tp)
    stage = stage_times(model, training, layout, rates, kernels=kernels, recompute=recompute)
    bubble = bubble_factor(layout, m)
    links = axis_links(layout, hardware)
    traffic = _traffic(model, training, layout, hardware, local=local, seq_len=s)
    layers = stage.layers or 1
    comm: dict[str, float] = {}
    exposed: dict[str, float] = {}
    if "tp" in traffic:  # on the critical path of every micro-batch, and so stretched by the bubble like compute
        passes = 1.5 if layout.activation_checkpointing == "full" else 1.0  # a recomputed forward: half again
        calls = 4 * passes * layers * m * acc
        if rates.tp_pair_s > 0:  # the calibrated cost of a column + row pair of DTensor linears, per two linears
            linears = (shape.block_linears if shape is not None else 4) * layers + (2 if pp == 1 else 1)
            comm["tp"] = _per_unit(_link(rates, links["tp"]), "all_reduce", traffic["tp"],
                                   linears / 2 * passes * m * acc * rates.tp_pair_s
                                   * rates.ring_latency_scale("all_reduce", tp))
        else:
            comm["tp"] = _send(_link(rates, links["tp"]), "all_reduce", traffic["tp"], calls, rates=rates, ranks=tp)
        exposed["tp"] = comm["tp"] * bubble
    if "pp" in traffic:
        v = layout.virtual_pipeline_stages
        if rates.pp_micro_batch_s > 0:  # the calibrated cost of a micro-batch through the runtime, per chunk
            comm["pp"] = _per_unit(_link(rates, links["pp"]), "p2p", traffic["pp"] * v,
                                   m * acc * v * rates.pp_micro_batch_s)
        else:
            comm["pp"] = _send(_link(rates, links["pp"]), "p2p", traffic["pp"] * v, 2 * m * acc * v)
        exposed["pp"] = comm["pp"] * bubble
    if "cp" in traffic:
        if rates.cp_layer_s > 0:  # the calibrated ring of the calibration's ranks, stretched to cp - 1 hops
            hops = (cp - 1) / max(rates.calibrated_ranks - 1, 1)
            queries = b * (s / cp) * (shape.n_embd / tp if shape is not None else 0.0)  # a rank's, per layer
            comm["cp"] = _per_unit(_link(rates, links["cp"]), "p2p", traffic["cp"],
                                   layers * m * acc * (rates.cp_layer_s + rates.cp_element_s * queries) * hops)
        else:
            comm["cp"] = _send(_link(rates, links["cp"]), "p2p", traffic["cp"], 2 * (cp - 1) * layers * m * acc)
        attention_s = 0.0 if shape is None else _attention_share(model, training, layout, rates) * m * acc
        exposed["cp"] = max(comm["cp"] - rates.overlap * attention_s, 0.0)
    state = layout_state_bytes(training, layout)
    shard_size = layout.data_parallel_shard_size or dp * cp
    group = {"dp": dp * cp, "dp_shard": shard_size, "dp_replicate": max(1, dp * cp // shard_size)}
    for axis in ("dp", "dp_shard", "dp_replicate"):
        if axis not in traffic:
            continue
        link = _link(rates, links[axis])
        if axis == "dp" and layout.zero == 0 and pp == 1:
            buckets = ddp_bucket_bytes(local * state.reduced)
            comm[axis] = _send(link, "all_reduce", traffic[axis], len(buckets), rates=rates, ranks=group[axis])
            last = _send(link, "all_reduce", traffic[axis] * buckets[-1] / max(sum(buckets), 1.0), 1,
                         rates=rates, ranks=group[axis])
        else:
            collective = "all_reduce" if axis == "dp_replicate" or layout.zero == 0 else "reduce_scatter"
            fsdp = _fsdp_exchange(layout, axis)
            per_unit = _fsdp_collectives(layout, axis, m, acc)
            kept = acc if axis != "dp_replicate" and _kept_params(model, layout) else 0  # the head's second gather
            calls = per_unit * (layers + 1) - kept if fsdp else 2
            if fsdp and rates.fsdp_unit_s > 0:  # the stage's blocks, the embedding and/or head, the root
                units = layers + (3 if pp == 1 else 2)
                # calibrated with FSDP2's default: two all-gathers and a reduce-scatter per unit and step
                unit_s = rates.fsdp_unit_s / 3 * rates.ring_latency_scale("all_gather", group[axis])
                comm[axis] = _per_unit(link, collective, traffic[axis], (units * per_unit - kept) * unit_s)
            elif collective == "reduce_scatter" and not fsdp:  # ZeRO-1/2's flat shards: one of each per param
                # group, half the bytes (the offload engine's calibrated step holds their latency)
                offloaded = layout.offload_device != "none"
                flat_calls = 0 if offloaded and rates.offload_step_s > 0 else FLAT_GROUPS
                if layout.zero == 2 and not offloaded:  # ZeRO-2: a reduce per rank's chunk, under the backward
                    n, each = group[axis], _reductions(layout, acc)  # (of every batch under reduce_each_batch)
                    sent = traffic[axis] / (each + 1)  # the bytes of one reduction, and of the all-gather
                    reduces = _send(link, "reduce_scatter", sent * each, n * flat_calls * each, rates=rates, ranks=n)
                    gather = _send(link, "all_gather", sent, flat_calls, rates=rates, ranks=n)
                    last = _send(link, "reduce_scatter", sent / n, flat_calls, rates=rates, ranks=n)
                    comm[axis] = reduces + gather
                    hide = rates.overlap * stage.backward * each
                    exposed[axis] = gather + max(reduces - hide, min(last, reduces))
                    continue
                each = _reductions(layout, acc)  # the offload engine reduces every batch
                comm[axis] = (_send(link, "reduce_scatter", traffic[axis] * each / (each + 1), flat_calls * each,
                                    rates=rates, ranks=group[axis])
                              + _send(link, "all_gather", traffic[axis] / (each + 1), flat_calls, rates=rates,
                                      ranks=group[axis]))
            else:
                comm[axis] = _send(link, collective, traffic[axis], calls, rates=rates, ranks=group[axis])
            last = 0.0
        exposed[axis] = _dp_exposed(axis, comm[axis], layout, stage, m, rates, last, acc)
    offload = 0.0
    if "offload" in traffic:
        offload = (traffic["offload"] / rates.host_link_bandwidth
                   + traffic["host_optimizer"] / rates.host_optimizer_params_per_s
                   + traffic.get("nvme", 0.0) / rates.nvme_bandwidth
                   + rates.offload_step_s + rates.offload_tensor_s * _stage_tensors(layout, layers, shape)
                   + _offload_residual(rates) * local)
        comm["offload"] = exposed["offload"] = offload
    compute = acc * m * stage.total * bubble
    sharded = local / shard_size if layout.zero >= 1 else local  # HSDP: sharded over its shard groups only
    optimizer, adam_ops = _optimizer_step(sharded, layout, layers, rates, state.param, state.grad, state.optimizer,
                                          shape)
    dispatch = (acc * m * (OPS_PER_LAYER * layers + OPS_PER_STEP) + adam_ops) * rates.op_overhead_s
    launch = dispatch if rates.overlap == 0 else max(dispatch - compute, 0.0)  # GPUs run while the host enqueues
    # the framework's time: its calibrated share recurs with every batch a step accumulates (the loop, its hooks,
    # the logged values), the rest once per step, as the optimizer
    framework = (1 + (acc - 1) * rates.host_batch_share) * rates.host_overhead(dp * pp * tp * cp)
    overhead = optimizer + framework + launch
    # CPU ranks beyond the machine's cores take turns on them: a rank's CPU work stretches by the share, its waits
    # do not; the step is the longer of the two (all ranks' CPU work over the cores, or the step as calibrated)
    share = rates.core_share(min(dp * pp * tp * cp, hardware.gpus_per_node))
    if share != 1.0:
        wall = compute + sum(exposed.values()) + overhead
        busy = compute + overhead + sum(v * rates.busy_share(_busy_part(k, layout, rates)) for k, v in exposed.items())
        share = max(1.0, share * busy / wall) if wall > 0 else share
        compute *= share
        comm = {k: v * share for k, v in comm.items()}
        exposed = {k: v * share for k, v in exposed.items()}
    flops = 0.0
    if shape is not None:
        flops = model_flops_per_token(shape, seq=s) * b * s * m * acc / (pp * tp * cp)
    else:
        flops = 6.0 * model.n_params * b * s * m * acc / (pp * tp * cp)
    return StepCost(
        compute_s=compute,
        comm_s=comm,
        tokens=dp * m * acc * b * s,
        links=links,
        exposed_s=exposed,
        overhead_s=overhead * share,
        model_flops=flops,
        peak_flops=rates.peak(_dtype(training)),
        rates_source=rates.source,
    )


def _busy_part(axis: str, layout: ParallelConfig, rates: Rates) -> str:
    """The calibrated cost an axis's time is mostly made of, whose CPU share (:attr:`Rates.busy`) it takes."""
    unit = {"tp": ("tp_pair", rates.tp_pair_s), "pp": ("pp_micro_batch", rates.pp_micro_batch_s),
            "cp": ("cp_layer", rates.cp_layer_s)}.get(axis)
    if unit is None and axis.startswith("dp") and _fsdp_exchange(layout, axis):
        unit = ("fsdp_unit", rates.fsdp_unit_s)
    if axis == "offload":
        return "offload_step"
    return unit[0] if unit is not None and unit[1] > 0 else "collectives"


def _optimizer_step(shard: float, layout: ParallelConfig, layers: int, rates: Rates, param: float, grad: float,
                    moments: float, shape: ModelShape | None) -> tuple[float, int]:
    """Seconds of the device's optimizer step, and the eager ops to count at ``op_overhead_s`` when no per-tensor cost
    is calibrated: ``shard`` parameters' bytes (``2 P + G + 2 K`` each) at :attr:`Rates.optimizer_rate`, plus (CPU:
    in series; GPUs: under the kernels) the calibrated cost per parameter tensor -- a flat shard per param group
    (:data:`FLAT_GROUPS`) under ZeRO-1/2 without a pipeline, else the stage's blocks' and edges' tensors
    (:attr:`ModelShape.block_tensors`; a bare parameter count: :data:`TENSORS_PER_LAYER` per layer and 5 more), each
    a ``DTensor`` under FSDP2 (ZeRO-3, ZeRO-2 in a pipeline) and tensor parallelism. An offloaded optimizer runs on
    the host (counted with offload)."""
    if layout.offload_device != "none":
        return 0.0, 0
    memory = shard * (2 * param + grad + 2 * moments) / rates.optimizer_rate
    flat = layout.zero in (1, 2) and layout.pipeline_parallel_size == 1  # the sharded optimizer steps flat shards
    tensors = FLAT_GROUPS if flat else _stage_tensors(layout, layers, shape)
    dtensors = not flat and (_fsdp_exchange(layout, "dp") or layout.tensor_parallel_size > 1)
    per_tensor = (rates.optimizer_dtensor_s or rates.optimizer_tensor_s) if dtensors else rates.optimizer_tensor_s
    if per_tensor <= 0:
        return memory, ADAM_OPS_PER_TENSOR * tensors
    host = tensors * per_tensor
    return (memory + host if rates.overlap == 0 else max(memory, host)), 0


def _offload_residual(rates: Rates) -> float:
    """Seconds per parameter of the offload engine's calibrated cost (:attr:`Rates.offload_param_s`, fp32 over the
    calibration's ``n`` ranks) beyond what the model counts on its own at ``n`` ranks: the host link's ``2 g / n``
    bytes, the host Adam's ``1 / n`` parameter, the flat reduce-scatter's and all-gather's ``g (n - 1) / n`` bytes
    each (``g`` = 4, the calibration's fp32 gradient) -- the engine's copies into and out of its partitions, counted
    alike in every dtype."""
    if rates.offload_param_s <= 0:
        return 0.0
    grad = 4.0
    n = max(rates.calibrated_ranks, 1)
    link = rates.links["intra_node"]
    counted = 2 * grad / n / rates.host_link_bandwidth + 1 / n / rates.host_optimizer_params_per_s
    counted += sum(grad * (n - 1) / n / link.collectives[c].beta for c in ("reduce_scatter", "all_gather"))
    return max(rates.offload_param_s - counted, 0.0)


def _stage_tensors(layout: ParallelConfig, layers: int, shape: ModelShape | None) -> int:
    """Parameter tensors on the busiest stage: its blocks' (:attr:`ModelShape.block_tensors`) and the larger of the
    embedding's and the head's; without a shape :data:`TENSORS_PER_LAYER` per layer and 5 more."""
    if shape is None:
        return TENSORS_PER_LAYER * layers + 5
    if layout.pipeline_parallel_size == 1:
        return shape.block_tensors * layers + shape.edge_tensors()
    return shape.block_tensors * layers + max(shape.edge_tensors(last=False), shape.edge_tensors(first=False))


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
