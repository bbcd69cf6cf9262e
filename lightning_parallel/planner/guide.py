"""The decision guide (docs/formulas.md, "Choosing a strategy") as code: which branch a model and a machine fall in,
which layouts fit, and which one to use.

Branches::

    one GPU        fits -> train normally; does not fit -> ZeRO + CPU offload (NVMe as extra storage);
                   largest layer does not fit -> Memory Centric Tiling (ZeRO-3 + offload + tiled layers)
    one node       fits on one GPU -> DDP (ZeRO an alternative);
                   does not fit -> PP, ZeRO or TP: with NVLink about equal (ZeRO first: no model change),
                   without NVLink PP first; largest layer does not fit -> ZeRO (tiled), else TP
    several nodes  fits -> DDP; does not fit, fast inter-node -> ZeRO, or PP+TP+DP;
                   slow inter-node -> DP+PP+TP+ZeRO-1; largest layer does not fit -> ZeRO (tiled) or TP
    one node or several, the model states fit one device but the sequence's activations do not (with the
                   lightest recomputation tried), and splitting the sequence over the cp ranks of a node makes it
                   fit without more recomputation -> context parallelism (cp ranks each hold s / cp tokens; cp next
                   to tp inside a node); when no such split fits, the branches above decide, with recomputation

Within the branch's first family that has a layout that fits, the layout with the best estimated throughput
(:mod:`.cost`) wins; ties go to the smaller model-parallel degree, then the lower ZeRO stage. Every layout that
fits is ranked the same way, family by family.

Mesh order (``parallel.mesh_order``): on several nodes each layout gets the order that moves fewer bytes between
nodes per step (:func:`.cost.cross_node_bytes`) when the inter-node link is slower than the intra-node one -- with
pp > 1 across nodes that is ``pp-dp-tp`` (only pipeline activations cross nodes) -- and its step is estimated in
that order; on one node, on a tie (dp = 1 or pp = 1: both orders place the ranks alike) or when crossing nodes costs
no more than staying inside one, the default ``dp-pp-tp`` is kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.layouts import entry, strategy_for, zero_and_offload
from lightning_parallel.planner.cost import StepCost, cross_node_bytes_by_order, estimate_step
from lightning_parallel.planner.hardware import LINK_BANDWIDTH, Hardware
from lightning_parallel.planner.memory import MemoryEstimate, estimate_memory, layout_state_bytes
from lightning_parallel.planner.model import ModelSpec
from lightning_parallel.planner.settings import TrainingSettings
from lightning_parallel.planner.units import format_bytes

__all__ = [
    "BRANCH_FAMILIES",
    "TILE_FRACTION",
    "Candidate",
    "Situation",
    "assess",
    "choose_branch",
    "choose_mesh_order",
    "context_sizes",
    "enumerate_layouts",
    "evaluate",
    "family_of",
    "strategy_name",
]

TILE_FRACTION = 0.05
"""Tiled layers are cut so that one tile's weights and gradients take at most this share of device memory."""

BRANCH_FAMILIES: dict[str, tuple[str, ...]] = {
    "one-gpu/fits": ("single",),
    "one-gpu/does-not-fit": ("offload",),
    "one-gpu/largest-layer-does-not-fit": ("offload",),
    "one-node/fits": ("ddp", "zero"),
    "one-node/does-not-fit/nvlink": ("zero", "pp", "tp", "fsdp-pp", "hybrid", "offload"),
    "one-node/does-not-fit/pcie": ("pp", "zero", "tp", "fsdp-pp", "hybrid", "offload"),
    "one-node/largest-layer-does-not-fit": ("zero", "offload", "tp", "fsdp-pp", "hybrid"),
    "several-nodes/fits": ("ddp", "zero"),
    "several-nodes/does-not-fit/fast": ("zero", "fsdp-pp", "3d-zero1", "hybrid", "pp", "tp", "offload"),
    "several-nodes/does-not-fit/slow": ("3d-zero1", "fsdp-pp", "hybrid", "pp", "tp", "zero", "offload"),
    "several-nodes/largest-layer-does-not-fit/fast": ("zero", "fsdp-pp", "3d-zero1", "hybrid", "tp", "offload"),
    "several-nodes/largest-layer-does-not-fit/slow": ("3d-zero1", "fsdp-pp", "hybrid", "tp", "zero", "offload"),
    "one-node/sequence-does-not-fit": ("cp", "ddp", "zero", "tp", "pp", "fsdp-pp", "hybrid", "offload"),
    "several-nodes/sequence-does-not-fit": ("cp", "ddp", "zero", "fsdp-pp", "3d-zero1", "hybrid", "tp", "pp",
                                            "offload"),
}
"""For each branch of the guide, the families of layouts in the order the guide prefers them."""


@dataclass(frozen=True)
class Candidate:
    """One layout with its memory, its estimated step, and whether it fits."""

    layout: ParallelConfig
    strategy: str
    family: str
    memory: MemoryEstimate
    cost: StepCost
    fits: bool
    why_not: str
    """Empty when it fits; else which limit it breaks, with the numbers."""
    tiled_layers: bool = False
    available: bool = True
    """Its strategy exists in this version (:mod:`lightning_parallel.layouts`); only such layouts are recommended."""
    cross_node_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    """On several nodes: for each mesh order, the bytes each axis (and ``total``) moves between nodes per step,
    summed over all ranks (:func:`lightning_parallel.planner.cost.cross_node_bytes`); empty on one node.
    ``layout.mesh_order`` is the order chosen from it (:func:`choose_mesh_order`)."""


@dataclass(frozen=True)
class Situation:
    """The facts the guide's branches rest on."""

    world_size: int
    nodes: int
    single_device: MemoryEstimate
    fits_one_device: bool
    largest_layer_bytes: int | None
    """(p + g) x largest layer: what one device must hold of it at once; None when unknown."""
    largest_layer_fits: bool
    activations_fit: bool = True
    """One device holds the model with the lightest activation checkpointing tried (``none`` under ``auto``)."""
    states_fit: bool = True
    """One device holds the model states (with the runtime's reserved memory), activations aside."""
    sequence_split_fits: bool = False
    """Some cp > 1 inside a node (dp the rest, no ZeRO, the lightest recomputation tried) fits each device: the
    guide's sequence branch is open."""


def strategy_name(layout: ParallelConfig, *, world_size: int) -> str:
    """The strategy a layout runs under: ``single_device`` for one device without offload, else the layout table's
    (:func:`lightning_parallel.layouts.strategy_for`; each named strategy is a preset of the layout)."""
    if world_size == 1 and layout.offload_device == "none":
        return "single_device"
    return strategy_for(layout)


def family_of(layout: ParallelConfig, *, world_size: int) -> str:
    """single | cp (context parallelism, with anything else) | ddp | zero (HSDP included) | offload | pp | tp |
    3d-zero1 (dp, pp, tp > 1 and ZeRO-1) | fsdp-pp (ZeRO-2/3 over FSDP2 inside pipeline stages, with or without TP:
    torchtitan's FSDP x TP x PP) | hybrid (other mixes)."""
    pp, tp, zero = layout.pipeline_parallel_size, layout.tensor_parallel_size, layout.zero
    if layout.context_parallel_size > 1:
        return "cp"
    if int(layout.data_parallel_size) > 1 and pp > 1 and tp > 1 and zero == 1:
        return "3d-zero1"
    if int(layout.data_parallel_size) > 1 and pp > 1 and zero >= 2 and layout.offload_device == "none":
        return "fsdp-pp"
    if layout.offload_device != "none":
        return "offload"
    if world_size == 1:
        return "single"
    if pp == tp == 1:
        return "ddp" if zero == 0 else "zero"
    if zero == 0 and tp == 1:
        return "pp"
    if zero == 0 and pp == 1:
        return "tp"
    return "hybrid"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: ModelSpec, training: TrainingSettings, hardware: Hardware, *,
                      context: bool = False) -> list[ParallelConfig]:
    """Every layout the library can run on this machine: tp <= devices per node (dividing heads and vocabulary), pp
    dividing the layers (and, with a fixed number of micro-batches, at most that many stages), dp the rest; ZeRO 1-3
    over dp; offload (ZeRO 2/3, data parallel only). With ``context`` (the guide's sequence branch) also every cp > 1
    that keeps cp x tp inside a node, splits the sequence into 2 x cp chunks and runs without attention dropout (ZeRO
    over dp x cp, no offload)."""
    world, shape = hardware.world_size, model.shape
    # Without a shape activations are not estimated, so checkpointing options would only repeat each layout.
    checkpointing = training.checkpointing_options if shape is not None else training.checkpointing_options[:1]
    layouts: list[ParallelConfig] = []
    for tp in _divisors(hardware.gpus_per_node):
        if shape is not None and (shape.n_head % tp or shape.vocab_size % tp):
            continue
        for pp in _divisors(world // tp) if world % tp == 0 else []:
            if shape is not None and shape.n_layer % pp:
                continue
            if pp > 1 and training.num_micro_batches is not None and training.num_micro_batches < pp:
                continue  # a fixed m under 1F1B needs a micro-batch per stage at least (the layout would be refused)
            layouts.extend(_layouts_for(world // (tp * pp), pp, tp, training, hardware, checkpointing))
            for cp in context_sizes(model, training, hardware, world=world // (tp * pp), tp=tp) if context else []:
                layouts.extend(_layouts_for(world // (tp * pp * cp), pp, tp, training, hardware, checkpointing,
                               cp=cp))
    return layouts


def _layouts_for(
    dp: int, pp: int, tp: int, training: TrainingSettings, hardware: Hardware, checkpointing: tuple[str, ...],
    *, cp: int = 1,
) -> list[ParallelConfig]:
    base: dict[str, Any] = {
        "data_parallel_size": dp,
        "pipeline_parallel_size": pp,
        "tensor_parallel_size": tp,
        "sequence_parallel": tp > 1,
        "num_micro_batches": training.micro_batches(pp) if pp > 1 else None,
    }
    if cp > 1:
        base["context_parallel_size"] = cp
    # The (zero_stage, offload) pairs the layout table runs at these sizes and the layout's rules accept (offload
    # needs ZeRO 2/3); without offload no ZeRO with one replica (nothing to shard over); NVMe only where there is one.
    # Context parallelism: the cp ranks are replicas too (ZeRO shards over dp x cp), no offload.
    stages = [(zero, offload) for zero, offload in zero_and_offload(pipeline=pp > 1, tensor=tp > 1)
              if (offload != "none" or dp * cp > 1 or zero == 0) and (offload != "nvme" or hardware.nvme)
              and (cp == 1 or offload == "none") and not (zero == 2 and tp > 1 and pp == 1)  # no strategy runs it
              and _accepted(zero_stage=zero, offload=offload, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                            **_nvme(offload))]
    shard = _node_shard(dp, pp, tp, hardware) if cp == 1 else None
    out = []
    for recompute in checkpointing:
        for zero, offload in stages:
            keys = {**base, "zero_stage": zero, "offload": offload, "activation_checkpointing": recompute,
                    **_nvme(offload)}
            out.append(ParallelConfig.from_dict(keys))
            if shard is not None and zero >= 2 and offload == "none" and (pp > 1 or tp == 1 or zero == 3):
                out.append(ParallelConfig.from_dict({**keys, "data_parallel_shard_size": shard}))
    return out


def _node_shard(dp: int, pp: int, tp: int, hardware: Hardware) -> int | None:
    """HSDP on several nodes: the largest shard-group size whose groups stay inside a node (so only the all-reduce
    of the gradient shards crosses nodes); None on one node or when no split of dp does."""
    from lightning_parallel.parallel.dims import ParallelDims

    if hardware.nodes == 1 or dp == 1:
        return None
    for s in sorted((d for d in _divisors(dp) if d < dp), reverse=True):
        dims = ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dp * pp * tp, dp_shard=s)
        if s > 1 and not dims.shard_group_crosses_nodes(hardware.gpus_per_node):
            return s
    return None


def _nvme(offload: str) -> dict[str, str]:
    return {"nvme_path": NVME_PATH} if offload == "nvme" else {}


def _accepted(**keys: Any) -> bool:
    """Whether a layout of these keys alone passes the layout's own rules."""
    try:
        ParallelConfig.from_dict(keys)
    except LayoutError:
        return False
    return True


NVME_PATH = "/local_nvme/lightning_parallel"
"""Placeholder folder written for NVMe offload; point it at a fast local disk."""


def _layer_bytes(model: ModelSpec, training: TrainingSettings, *, tp: int, layout: ParallelConfig | None = None
                 ) -> int | None:
    """The largest layer's weights and gradients on a device, in the bytes ``layout``'s engine gathers and reduces
    them in (without a layout: the fewest of the engines that shard the weights, FSDP2's and the offload one's)."""
    if model.largest_layer_params is None:
        return None
    layouts = [layout] if layout is not None else [ParallelConfig(data_parallel_size=2, zero_stage=3, offload=o)
                                                   for o in ("none", "cpu")]
    per_element = min(s.gathered + s.reduced for s in (layout_state_bytes(training, lay) for lay in layouts))
    return per_element * model.largest_layer_per_device(tp=tp)


DEFAULT_MESH_ORDER = "dp-pp-tp"


def choose_mesh_order(cross: Mapping[str, Mapping[str, float]], hardware: Hardware) -> str:
    """The mesh order for a layout whose cross-node bytes per order are ``cross``
    (:func:`lightning_parallel.planner.cost.cross_node_bytes_by_order`): the one with the fewer ``total`` bytes
    between nodes when the inter-node link is slower than the intra-node one; the default ``dp-pp-tp`` on one node, on
    a tie, or when crossing nodes costs no more than staying inside one (pcie inside, a fast fabric between)."""
    if hardware.nodes == 1 or not cross:
        return DEFAULT_MESH_ORDER
    if LINK_BANDWIDTH[hardware.inter_node] >= LINK_BANDWIDTH[hardware.intra_node]:
        return DEFAULT_MESH_ORDER
    return min(cross, key=lambda order: (cross[order]["total"], order != DEFAULT_MESH_ORDER))


def evaluate(
    model: ModelSpec,
    training: TrainingSettings,
    hardware: Hardware,
    layout: ParallelConfig,
    *,
    choose_order: bool = True,
) -> Candidate:
    """Memory, cost and feasibility of one layout; ZeRO-3 layouts tile the largest layer when it does not fit.

    On several nodes the cross-node bytes of both mesh orders are counted and, with ``choose_order``, the layout
    takes the order :func:`choose_mesh_order` picks before its step is estimated (else its own order is kept).
    """
    world = hardware.world_size
    training = training.for_pipeline(layout.pipeline_parallel_size)
    cross = cross_node_bytes_by_order(model, training, hardware, layout) if hardware.nodes > 1 else {}
    if choose_order and cross:
        order = choose_mesh_order(cross, hardware)
        if order != layout.mesh_order:
            layout = layout.replace(mesh_order=order)
    limit = hardware.gpu_memory
    layer = _layer_bytes(model, training, tp=layout.tensor_parallel_size, layout=layout) or 0
    layer_fits = layer + hardware.reserved <= limit
    tiles = 1
    if not layer_fits and layout.zero == 3:
        tiles = max(2, math.ceil(layer / (TILE_FRACTION * limit)))
    memory = estimate_memory(model, training, hardware, layout, tiles=tiles)
    why = _why_not(memory, hardware, layout) or training.global_batch_refusal(
        int(layout.data_parallel_size), layout.pipeline_parallel_size)
    if not layer_fits and tiles == 1 and not why:
        why = f"largest layer {format_bytes(layer)} (weights + gradients) does not fit in {format_bytes(limit)}"
    strategy = strategy_name(layout, world_size=world)
    return Candidate(
        layout=layout,
        strategy=strategy,
        family=family_of(layout, world_size=world),
        memory=memory,
        cost=estimate_step(model, training, hardware, layout),
        fits=not why,
        why_not=why,
        tiled_layers=tiles > 1,
        available=strategy == "single_device" or entry(strategy).available,
        cross_node_bytes=cross,
    )


def _why_not(memory: MemoryEstimate, hardware: Hardware, layout: ParallelConfig) -> str:
    if memory.total > hardware.gpu_memory:
        return f"device {format_bytes(memory.total)} > {format_bytes(hardware.gpu_memory)}"
    if memory.host_per_node > hardware.cpu_memory_per_node:
        return f"host {format_bytes(memory.host_per_node)} > {format_bytes(hardware.cpu_memory_per_node)} per node"
    if layout.offload_device == "nvme" and not hardware.nvme:
        return "no NVMe disk"
    return ""



def assess(model: ModelSpec, training: TrainingSettings, hardware: Hardware) -> Situation:
    """Does the model fit on one device (with the lightest activation checkpointing that fits), and its largest
    layer?"""
    options = [
        estimate_memory(
            model,
            training,
            hardware,
            ParallelConfig.from_dict({"data_parallel_size": 1, "activation_checkpointing": ac}),
        )
        for ac in training.checkpointing_options
    ]
    single = next((m for m in options if m.total <= hardware.gpu_memory), options[-1])
    layer = _layer_bytes(model, training, tp=1)
    layer_fits = layer is None or layer + hardware.reserved <= hardware.gpu_memory
    lightest = options[0]
    return Situation(
        sequence_split_fits=_sequence_split_fits(model, training, hardware),
        world_size=hardware.world_size,
        nodes=hardware.nodes,
        single_device=single,
        fits_one_device=single.total <= hardware.gpu_memory,
        largest_layer_bytes=layer,
        largest_layer_fits=layer_fits,
        activations_fit=lightest.activations is None or lightest.total <= hardware.gpu_memory,
        states_fit=lightest.model_states + hardware.reserved <= hardware.gpu_memory,
    )


def context_sizes(model: ModelSpec, training: TrainingSettings, hardware: Hardware, *, world: int | None = None,
                  tp: int = 1) -> list[int]:
    """The cp > 1 the planner tries: dividing ``world`` (the devices left by tp and pp), cp x tp inside a node, the
    sequence in 2 x cp chunks, and no attention dropout (refused under cp); none without the model's shape."""
    shape = model.shape
    if shape is None or shape.dropout > 0:
        return []
    seq = training.sequence_length(shape.block_size)
    n = hardware.world_size if world is None else world
    return [cp for cp in _divisors(n) if cp > 1 and cp * tp <= hardware.gpus_per_node and seq % (2 * cp) == 0]


def _sequence_split_fits(model: ModelSpec, training: TrainingSettings, hardware: Hardware) -> bool:
    lightest = training.checkpointing_options[0]
    for cp in context_sizes(model, training, hardware):
        layout = ParallelConfig.from_dict({"data_parallel_size": hardware.world_size // cp,
                                           "context_parallel_size": cp, "activation_checkpointing": lightest})
        if estimate_memory(model, training, hardware, layout).total <= hardware.gpu_memory:
            return True
    return False


def choose_branch(situation: Situation, hardware: Hardware) -> str:
    """The guide's branch, e.g. ``one-node/does-not-fit/pcie``."""
    if situation.world_size == 1:
        scope = "one-gpu"
    else:
        scope = "one-node" if situation.nodes == 1 else "several-nodes"
    if (scope != "one-gpu" and not situation.activations_fit and situation.states_fit
            and situation.largest_layer_fits and situation.sequence_split_fits):
        return f"{scope}/sequence-does-not-fit"  # the sequence is the problem and splitting it suffices: cp
    if situation.fits_one_device:
        return f"{scope}/fits"
    if not situation.largest_layer_fits:
        suffix = f"/{hardware.inter_node}" if scope == "several-nodes" else ""
        return f"{scope}/largest-layer-does-not-fit{suffix}"
    if scope == "one-gpu":
        return "one-gpu/does-not-fit"
    if scope == "one-node":
        return f"one-node/does-not-fit/{hardware.intra_node}"
    return f"several-nodes/does-not-fit/{hardware.inter_node}"
