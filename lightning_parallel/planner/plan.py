"""A plan: every candidate layout ranked, and the recommendation with the guide's branch and the reasoning.

Output lives in :mod:`lightning_parallel.planner.report` (``format_plan``, ``plan_json``), which imports this module,
never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

from lightning_parallel.config import Offload
from lightning_parallel.planner.guide import (
    BRANCH_FAMILIES,
    Candidate,
    Situation,
    assess,
    choose_branch,
    enumerate_layouts,
    evaluate,
)
from lightning_parallel.planner.hardware import Hardware
from lightning_parallel.planner.memory import model_states_bytes
from lightning_parallel.planner.model import ModelSpec
from lightning_parallel.planner.settings import TrainingSettings
from lightning_parallel.planner.units import format_bytes

__all__ = ["Plan", "make_plan", "mesh_order_sentence", "no_fit_fixes"]

_BRANCH_TEXT: dict[str, str] = {
    "one-gpu/fits": "one GPU, the model fits: train normally",
    "one-gpu/does-not-fit": "one GPU, the model does not fit: ZeRO + CPU offload (NVMe as extra storage)",
    "one-gpu/largest-layer-does-not-fit": "one GPU, the largest layer does not fit: Memory Centric Tiling "
    "(ZeRO-3 + offload + tiled layers)",
    "one-node/fits": "one node, the model fits on one GPU: DDP (ZeRO is an alternative)",
    "one-node/does-not-fit/nvlink": "one node, the model does not fit on one GPU, NVLink: PP, ZeRO and TP perform "
    "about the same; ZeRO first because it needs no model change",
    "one-node/does-not-fit/pcie": "one node, the model does not fit on one GPU, no NVLink: PP is usually faster "
    "than TP or ZeRO",
    "one-node/largest-layer-does-not-fit": "one node, the largest layer does not fit on one GPU: ZeRO (with tiled "
    "layers); if ZeRO cannot be used, TP is the only choice",
    "several-nodes/fits": "several nodes, the model fits on one GPU: DDP (ZeRO is an alternative)",
    "several-nodes/does-not-fit/fast": "several nodes, fast inter-node links: ZeRO (almost no model change), or "
    "PP+TP+DP (less communication, substantial model changes)",
    "several-nodes/does-not-fit/slow": "several nodes, slow inter-node links, too little GPU memory: DP+PP+TP+ZeRO-1",
    "several-nodes/largest-layer-does-not-fit/fast": "several nodes, the largest layer does not fit on one GPU, "
    "fast inter-node links: ZeRO with tiled layers, or TP inside the node",
    "several-nodes/largest-layer-does-not-fit/slow": "several nodes, the largest layer does not fit on one GPU, "
    "slow inter-node links: DP+PP+TP+ZeRO-1 with TP splitting the layer",
    "one-node/sequence-does-not-fit": "one node, the model states fit on one GPU but the sequence's activations do "
    "not, and splitting the sequence over cp ranks makes them fit: context parallelism (before recomputation)",
    "several-nodes/sequence-does-not-fit": "several nodes, the model states fit on one GPU but the sequence's "
    "activations do not, and splitting the sequence over cp ranks of a node makes them fit: context parallelism "
    "(before recomputation)",
}


_FAMILY_TEXT: dict[str, str] = {
    "single": "one device",
    "cp": "context parallelism (with or without DP/TP/PP/ZeRO)",
    "ddp": "DDP",
    "zero": "ZeRO (1-3)",
    "offload": "ZeRO-offload",
    "pp": "PP",
    "tp": "TP",
    "3d-zero1": "DP+PP+TP+ZeRO-1",
    "fsdp-pp": "ZeRO-2/3 (FSDP2) inside pipeline stages, with or without TP",
    "hybrid": "other PP/TP/ZeRO mixes",
}


@dataclass(frozen=True)
class Plan:
    """The result of :func:`make_plan`; :func:`lightning_parallel.planner.report.plan_json` gives its JSON form."""

    model: ModelSpec
    training: TrainingSettings
    hardware: Hardware
    situation: Situation
    branch: str
    candidates: list[Candidate]
    """Ranked: those that fit first (guide's family order, then throughput), then the rest by memory."""
    recommended: Candidate | None
    """The best candidate that fits and whose strategy exists in this version; None when there is none."""
    reason: str
    guide_choice: Candidate | None = None
    """The best candidate that fits, whether or not its strategy exists yet (the guide's own answer)."""

    @property
    def model_states_bytes(self) -> dict[str, int]:
        """Model states per device for pure data parallelism over all devices: ddp, zero1, zero2, zero3."""
        n = self.model.params_per_device(pp=1, tp=1)
        return model_states_bytes(n, self.training.state_bytes, dp=self.hardware.world_size)


def _rank_key(candidate: Candidate, families: tuple[str, ...]) -> tuple[Any, ...]:
    layout = candidate.layout
    family_rank = families.index(candidate.family) if candidate.family in families else len(families)
    per_token = float(f"{1.0 / candidate.cost.tokens_per_s:.3g}")
    offload_rank = get_args(Offload).index(layout.offload_device)
    model_parallel = layout.pipeline_parallel_size * layout.tensor_parallel_size
    recompute = ("none", "selective", "full").index(layout.activation_checkpointing)
    if candidate.family == "cp":  # the sequence branch: cp first, recomputation only when cp alone does not fit
        return (family_rank, recompute, per_token, layout.context_parallel_size, model_parallel, layout.zero)
    return (family_rank, candidate.tiled_layers, per_token, model_parallel, layout.zero, offload_rank)


def make_plan(model: ModelSpec, training: TrainingSettings, hardware: Hardware) -> Plan:
    """Assess the model on the machine, take the guide's branch, evaluate every layout and rank them."""
    situation = assess(model, training, hardware)
    branch = choose_branch(situation, hardware)
    families = BRANCH_FAMILIES[branch]
    context = branch.endswith("sequence-does-not-fit")  # cp layouts are tried only where the sequence is the problem
    evaluated = [evaluate(model, training, hardware, layout)
                 for layout in enumerate_layouts(model, training, hardware, context=context)]
    fitting = sorted((c for c in evaluated if c.fits), key=lambda c: _rank_key(c, families))
    rest = sorted((c for c in evaluated if not c.fits), key=lambda c: c.memory.total)
    ranked = fitting + rest
    guide_choice = fitting[0] if fitting else None
    recommended = next((c for c in fitting if c.available), None)
    reason = _reason(situation, hardware, branch, recommended, ranked, training)
    if guide_choice is not None and guide_choice is not recommended:
        reason += (
            f" The guide's first choice, {guide_choice.strategy} {guide_choice.layout.describe()}, is not available "
            "in this version, so it is not recommended."
        )
    return Plan(
        model=model,
        training=training,
        hardware=hardware,
        situation=situation,
        branch=branch,
        candidates=ranked,
        recommended=recommended,
        reason=reason,
        guide_choice=guide_choice,
    )


def _facts(situation: Situation, hardware: Hardware) -> str:
    single = situation.single_device
    verdict = "fits" if situation.fits_one_device else "does not fit"
    text = (
        f"On one device the model needs {format_bytes(single.total)} ({format_bytes(single.model_states)} model "
        f"states) and {verdict} in {format_bytes(hardware.gpu_memory)}."
    )
    pooled = hardware.world_size * hardware.gpu_memory
    if hardware.world_size > 1 and pooled < single.model_states:
        text += (
            f" All {hardware.world_size} devices together hold {format_bytes(pooled)}, less than the model states: "
            "only offload can fit it."
        )
    if single.activations is None:
        text += (
            " Activations are not counted: the model's shape is unknown (give --model or --layers/--hidden/--heads)."
        )
    if situation.largest_layer_bytes is None:
        text += " The largest layer is unknown and assumed to fit (give --largest-layer-params)."
    elif not situation.largest_layer_fits:
        layer = situation.largest_layer_bytes
        text += (f" Its largest layer alone needs {format_bytes(layer)} (weights + gradients); with the "
                 f"{format_bytes(hardware.reserved)} reserved per device for the runtime that is "
                 f"{format_bytes(layer + hardware.reserved)}, more than the {format_bytes(hardware.gpu_memory)} of "
                 "one device.")
    return text


def no_fit_fixes(hardware: Hardware, training: TrainingSettings, *, activations_counted: bool = True) -> list[str]:
    """What could make a layout fit, naming only what was not already given or tried (and nothing about activations
    when they are not counted: recomputation or a smaller batch would not change the verdict)."""
    fixes = ["more devices or more memory per device"]
    if activations_counted and training.activation_checkpointing in ("none", "selective"):
        fixes.append("activation checkpointing (--activation-checkpointing full or auto)")
    if activations_counted and training.micro_batch_size > 1:
        fixes.append(f"a smaller micro-batch (now {training.micro_batch_size})")
    if not hardware.nvme:
        fixes.append("an NVMe disk for ZeRO-Infinity offload (--nvme)")
    if hardware.reserved_memory:
        fixes.append(f"a smaller --reserved-memory if the runtime takes less than {format_bytes(hardware.reserved)}")
    return fixes


def _reason(
    situation: Situation, hardware: Hardware, branch: str, chosen: Candidate | None, ranked: list[Candidate],
    training: TrainingSettings,
) -> str:
    families = BRANCH_FAMILIES[branch]
    text = f"{_facts(situation, hardware)} Guide branch: {_BRANCH_TEXT[branch]}."
    if chosen is None:
        nearest = ranked[0] if ranked else None
        hint = f" The nearest is {nearest.layout.describe()} ({nearest.why_not})." if nearest else ""
        return (f"{text} No layout fits on {hardware.describe()}.{hint} Fix: "
                + "; or ".join(no_fit_fixes(hardware, training,
                                            activations_counted=situation.single_device.activations is not None))
                + ".")
    if chosen.family != families[0]:
        before = families[: families.index(chosen.family)] if chosen.family in families else families
        skipped = ", ".join(_FAMILY_TEXT[f] for f in before)
        text += (f" No layout of {skipped} both fits and has a strategy in this version, so the next in the guide's "
                 "order is used.")
    mem = chosen.memory
    text += (
        f" Chosen: {chosen.strategy} {chosen.layout.describe()}: {format_bytes(mem.total)} per device "
        f"({format_bytes(mem.model_states)} model states) of {format_bytes(hardware.gpu_memory)}."
    )
    text += mesh_order_sentence(chosen, hardware)
    if chosen.tiled_layers:
        text += " The largest layer runs tiled (Memory Centric Tiling) so that ZeRO-3 gathers one tile at a time."
    if mem.host_per_node:
        host, limit = format_bytes(mem.host_per_node), format_bytes(hardware.cpu_memory_per_node)
        text += f" Host memory per node: {host} of {limit}."
    text += _cheaper_not_fitting(chosen, ranked)
    return text


def mesh_order_sentence(chosen: Candidate, hardware: Hardware) -> str:
    """On several nodes: the chosen mesh order and what each order moves between nodes per step (empty on one
    node)."""
    cross = chosen.cross_node_bytes
    if not cross:
        return ""
    order = chosen.layout.mesh_order
    mine = cross[order]["total"]
    others = [(o, v["total"]) for o, v in cross.items() if o != order]
    if all(total == mine for _, total in others):
        return (f" Mesh order {order}: both orders move {format_bytes(mine)} between nodes per step "
                "(they place these ranks alike or cross nodes equally).")
    compare = ", ".join(f"{format_bytes(total)} with {o}" for o, total in others)
    text = f" Mesh order {order}: {format_bytes(mine)} between nodes per step instead of {compare}"
    if mine > min(total for _, total in others):
        return text + (f" (kept: the inter-node link, {hardware.inter_node}, is no slower than the intra-node one, "
                       f"{hardware.intra_node}, so crossing nodes costs nothing extra in this estimate).")
    if order == "pp-dp-tp" and cross[order]["dp"] == 0:
        return text + " (only pipeline activations cross nodes; the dp gradient exchange stays inside a node)."
    return text + "."


def _cheaper_not_fitting(chosen: Candidate, ranked: list[Candidate]) -> str:
    """Name the lighter layout of the same family that was ruled out (e.g. ZeRO-1 when ZeRO-2 is chosen)."""
    lighter = [
        c
        for c in ranked
        if not c.fits
        and c.family == chosen.family
        and c.layout.zero < chosen.layout.zero
        and c.layout.pipeline_parallel_size == chosen.layout.pipeline_parallel_size
        and c.layout.tensor_parallel_size == chosen.layout.tensor_parallel_size
        and c.layout.offload_device == chosen.layout.offload_device
        and c.layout.data_parallel_shard_size == chosen.layout.data_parallel_shard_size
    ]
    if not lighter:
        return ""
    best = max(lighter, key=lambda c: c.layout.zero)
    return f" ZeRO-{best.layout.zero} of the same shape does not fit ({best.why_not})."
