"""The planner's output: a readable table and reasoning (:func:`format_plan`), or a JSON object (:func:`plan_json`).

On several nodes both also give the mesh order of each layout (``order`` column, ``mesh_order`` key) and, for the
recommended layout, the bytes each axis moves between nodes per step in both orders (the table after the
recommendation, ``recommendation.cross_node_bytes_per_step``), summed over all ranks
(:func:`lightning_parallel.planner.cost.cross_node_bytes`).

The dependency goes one way: this module reads a :class:`~lightning_parallel.planner.plan.Plan`; ``plan.py`` does not
import it.
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.config import ParallelConfig
from lightning_parallel.parallel.dims import MESH_AXES
from lightning_parallel.planner.guide import Candidate
from lightning_parallel.planner.plan import Plan
from lightning_parallel.planner.settings import StateBytes, TrainingSettings
from lightning_parallel.planner.units import format_bytes, format_count

__all__ = ["candidate_json", "cross_node_json", "format_cross_node", "format_plan", "plan_json",
           "recommendation_json"]

_COLUMNS = (
    "#",
    "strategy",
    "dp",
    "pp",
    "tp",
    "zero",
    "offload",
    "recompute",
    "params",
    "grads",
    "optim",
    "activ",
    "buffers",
    "total",
    "fits",
    "host/node",
    "stresses",
    "tokens/s",
    "MFU",
)
_LEFT = {"strategy", "order", "offload", "recompute", "stresses"}
"""Columns aligned left (names); the numbers are aligned right."""


def _columns(plan: Plan) -> tuple[str, ...]:
    """The table's columns; ``acc`` (batches accumulated per optimizer step) after ``recompute`` when a global batch
    makes it differ by layout; ``cp`` after ``tp`` when a candidate splits sequences; ``order`` (the mesh order) after
    them on several nodes only."""
    columns: tuple[str, ...] = _COLUMNS
    if plan.training.global_batch_size is not None:
        at = columns.index("recompute") + 1
        columns = (*columns[:at], "acc", *columns[at:])
    i = columns.index("tp") + 1
    if any(c.layout.context_parallel_size > 1 for c in plan.candidates):
        columns = (*columns[:i], "cp", *columns[i:])
        i += 1
    if plan.hardware.nodes == 1:
        return columns
    return (*columns[:i], "order", *columns[i:])


def _unit(candidates: list[Candidate]) -> tuple[str, float]:
    """GB for real models, MB when every layout is under a gigabyte (the tiny models of tests and CPU runs)."""
    largest = max((c.memory.total for c in candidates), default=0)
    return ("GB", 1e9) if largest >= 1e9 else ("MB", 1e6)


def _row(rank: str, c: Candidate, scale: float, columns: tuple[str, ...], training: TrainingSettings) -> list[str]:
    lay, mem = c.layout, c.memory

    def _gb(num: int | None) -> str:
        return "n/a" if num is None else f"{num / scale:.1f}" if num >= 0.05 * scale else f"{num / scale:.2f}"

    offload = lay.offload_device + ("+tiled" if c.tiled_layers else "")
    cells = [
        rank,
        c.strategy + ("" if c.available else " (n/a)"),
        str(lay.data_parallel_size) + (f" s{lay.data_parallel_shard_size}" if lay.data_parallel_shard_size else ""),
        str(lay.pipeline_parallel_size),
        str(lay.tensor_parallel_size),
        str(lay.zero),
        offload,
        lay.activation_checkpointing,
        _gb(mem.params),
        _gb(mem.grads),
        _gb(mem.optimizer),
        _gb(mem.activations),
        _gb(mem.buffers),
        _gb(mem.total),
        "yes" if c.fits else "no",
        _gb(mem.host_per_node) if mem.host_per_node else "-",
        c.cost.stressed_link(),
        f"{c.cost.tokens_per_s:,.0f}",
        f"{c.cost.mfu:.0%}",
    ]
    optional = {"cp": str(lay.context_parallel_size), "order": lay.mesh_order,
                "acc": str(_accumulation(training, lay) or "-")}
    for name in sorted((name for name in optional if name in columns), key=columns.index):  # left to right
        cells.insert(columns.index(name), optional[name])
    return cells


def _accumulation(training: TrainingSettings, layout: ParallelConfig) -> int | None:
    """Batches ``layout`` accumulates per optimizer step (None while its dp is ``auto``)."""
    dp = layout.data_parallel_size
    return training.accumulation(dp, layout.pipeline_parallel_size) if isinstance(dp, int) else None


def _table(rows: list[list[str]]) -> str:
    """``rows[0]`` is the header: the columns named in :data:`_LEFT` are aligned left, the others right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    left = [name in _LEFT for name in rows[0]]
    lines = [
        "  ".join(
            cell.ljust(w) if left[i] else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _state_text(training: TrainingSettings) -> str:
    """``p+g+K`` of the library's engines, and the offload engine's where it differs (16-bit weights)."""
    sb, off = training.state_bytes, training.state_bytes_for(offload="cpu")
    text = f"{sb.param}+{sb.grad}+{sb.optimizer} bytes"
    if (off.param, off.grad, off.optimizer) != (sb.param, sb.grad, sb.optimizer):
        text += f", {off.param}+{off.grad}+{off.optimizer} in the offload engine"
    return text


def _state_json(state: StateBytes) -> dict[str, int]:
    """Bytes per parameter of weight, gradient and optimizer state, and of the weights gathered and the gradients
    reduced (ZeRO-3's gather of FSDP2 under bf16-mixed: 2)."""
    return {"param": state.param, "grad": state.grad, "optimizer": state.optimizer, "gathered": state.gathered,
            "reduced": state.reduced}


def format_plan(plan: Plan, *, top: int = 12) -> str:
    """Header, the table of candidates (sizes in GB = 1e9 bytes per device), the recommendation and its reason."""
    m, t = plan.model, plan.training
    lines = [
        f"Model: {'' if m.name == 'model' else m.name + ', '}{format_count(m.n_params)} parameters"
        + (f", largest layer {format_count(m.largest_layer_params)}" if m.largest_layer_params else ""),
        f"Training: {t.precision}, {t.optimizer} (model state per parameter: {_state_text(t)}), micro-batch "
        f"{t.micro_batch_size}, activation checkpointing {t.activation_checkpointing}"
        + (f", {t.accumulation_text}" if t.accumulation_text else ""),
        f"Hardware: {plan.hardware.describe()}",
        f"Allowance per device (the buffers column): {plan.hardware.reserved_text()} reserved for the runtime, + 10% "
        "of model states and activations (fragmentation, communication buckets), + under ZeRO-3 the gathered "
        "largest layer",
        "",
        "Model states per device, pure data parallel over all "
        f"{plan.hardware.world_size} device(s): "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.model_states_bytes.items()),
        "",
    ]
    shown = _select(plan.candidates, top)
    unit, scale = _unit(plan.candidates)
    columns = _columns(plan)
    rows = [list(columns)] + [
        _row(str(i + 1) if c.fits and c.available else "-", c, scale, columns, t) for i, c in shown
    ]
    source = plan.candidates[0].cost.rates_source if plan.candidates else ""
    lines.append(f"Candidate layouts ({unit} per device; tokens/s and MFU from the step-time model, rates: "
                 f"{source or 'defaults'}):")
    lines.append(_table(rows))
    if len(shown) < len(plan.candidates):
        lines.append(f"... {len(plan.candidates) - len(shown)} more layouts not shown (--top 0 shows all)")
    if any(not c.available for _, c in shown):
        lines.append("(n/a): the guide's strategy for that layout is not available in this version; never recommended")
    lines += ["", _recommendation_text(plan)]
    chosen = plan.recommended or (plan.candidates[0] if plan.candidates else None)
    if chosen is not None and chosen.cross_node_bytes:
        lines += ["", format_cross_node(chosen)]
    return "\n".join(lines)


def format_cross_node(c: Candidate) -> str:
    """The bytes each axis of ``c``'s layout moves between nodes per step in each mesh order, the chosen one marked.

    Example (gpt3-175b, dp=2 x pp=16 x tp=4 on 16 nodes of 8)::

        Bytes between nodes per step (dp=2 pp=16 tp=4 zero=1, all ranks; rank r on node r // 8):
          order         dp        pp   tp     total
          dp-pp-tp  741.9 GB   90.2 GB  0 B  832.1 GB
          pp-dp-tp       0 B  193.3 GB  0 B  193.3 GB  <- chosen
    """
    lay = c.layout
    head = ["order", *MESH_AXES, "total", ""]
    rows = [head] + [
        [order, *(format_bytes(axes[a]) for a in MESH_AXES), format_bytes(axes["total"]),
         "<- chosen" if order == lay.mesh_order else ""]
        for order, axes in c.cross_node_bytes.items()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  " + "  ".join(cell.ljust(w) if i in (0, len(head) - 1) else cell.rjust(w)
                              for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for row in rows]
    base = lay.replace(mesh_order="dp-pp-tp").describe()
    return "\n".join([f"Bytes between nodes per step ({base}, all ranks together; ranks fill nodes in order):",
                      *lines])


def _select(candidates: list[Candidate], top: int) -> list[tuple[int, Candidate]]:
    """The first ``top`` by rank, plus the best of each family and strategy and every pure data-parallel layout
    with the lightest recompute (the ZeRO paper's rows), so that what was ruled out shows too."""
    if top <= 0:
        return list(enumerate(candidates))
    keep: set[int] = set(range(min(top, len(candidates))))
    seen: set[str] = set()
    lightest = min(
        (c.layout.activation_checkpointing for c in candidates), key=("none", "selective", "full").index, default="none"
    )
    for i, c in enumerate(candidates):
        for key in (c.family, c.strategy):
            if key not in seen:
                seen.add(key)
                keep.add(i)
        lay = c.layout
        pure = lay.pipeline_parallel_size == lay.tensor_parallel_size == 1 and lay.offload_device == "none"
        if pure and c.layout.activation_checkpointing == lightest:
            keep.add(i)
    return [(i, candidates[i]) for i in sorted(keep)]


def _recommendation_text(plan: Plan) -> str:
    rec = recommendation_json(plan)
    if plan.recommended is None:
        head = "Recommendation: none fits."
    else:
        head = (
            f"Recommendation: {rec['strategy']} (data_parallel_size={rec['data_parallel_size']}, "
            f"pipeline_parallel_size={rec['pipeline_parallel_size']}, tensor_parallel_size="
            f"{rec['tensor_parallel_size']}, zero_stage={rec['zero_stage']}, offload={rec['offload']}, "
            + (f"data_parallel_shard_size={rec['data_parallel_shard_size']}, "
               if rec.get("data_parallel_shard_size") else "")
            + (f"context_parallel_size={rec['context_parallel_size']}, "
               if rec.get("context_parallel_size", 1) > 1 else "")
            + f"tiled_layers={rec['tiled_layers']}"
            + (f", mesh_order={rec['mesh_order']})" if plan.hardware.nodes > 1 else ")")
        )
    return f"{head}\nBranch: {plan.branch}\nWhy: {plan.reason}"


def candidate_json(c: Candidate, training: TrainingSettings | None = None) -> dict[str, Any]:
    """One candidate, machine-readable; with ``training``, the batches it accumulates per optimizer step too (with a
    global batch they differ by layout: ``global / (batch x dp)``)."""
    lay, mem = c.layout, c.memory
    accumulation = {"accumulate_grad_batches": _accumulation(training, lay)} if training is not None else {}
    return {
        "strategy": c.strategy,
        "available": c.available,
        "family": c.family,
        "data_parallel_size": lay.data_parallel_size,
        "pipeline_parallel_size": lay.pipeline_parallel_size,
        "tensor_parallel_size": lay.tensor_parallel_size,
        "zero_stage": lay.zero_stage,
        "data_parallel_shard_size": lay.data_parallel_shard_size,
        "offload": lay.offload,
        "sequence_parallel": lay.sequence_parallel,
        "mesh_order": lay.mesh_order,
        "tiled_layers": c.tiled_layers,
        **accumulation,
        "memory_bytes": {
            "params": mem.params,
            "grads": mem.grads,
            "optimizer": mem.optimizer,
            "activations": mem.activations,
            "buffers": mem.buffers,
            "total": mem.total,
            "host_per_node": mem.host_per_node,
            "nvme_per_node": mem.nvme_per_node,
        },
        "fits": c.fits,
        "why_not": c.why_not,
        "stresses": c.cost.stressed_link(),
        "est_step_seconds": c.cost.step_s,
        "est_tokens_per_second": c.cost.tokens_per_s,
        "est_mfu": c.cost.mfu,
        "est_exposed_seconds": dict(c.cost.exposed_s),
        "rates": c.cost.rates_source,
    }


def recommendation_json(plan: Plan) -> dict[str, Any]:
    """The recommendation; when nothing fits, the nearest layout with ``fits: false``."""
    chosen = plan.recommended or (plan.candidates[0] if plan.candidates else None)
    base: dict[str, Any] = {"branch": plan.branch, "reason": plan.reason, "fits": plan.recommended is not None}
    if chosen is None:
        return {**base, "strategy": None}
    lay = chosen.layout
    return {
        "strategy": chosen.strategy,
        "data_parallel_size": lay.data_parallel_size,
        "pipeline_parallel_size": lay.pipeline_parallel_size,
        "tensor_parallel_size": lay.tensor_parallel_size,
        "zero_stage": lay.zero_stage,
        "data_parallel_shard_size": lay.data_parallel_shard_size,
        "context_parallel_size": lay.context_parallel_size,
        "offload": lay.offload,
        "tiled_layers": chosen.tiled_layers,
        "sequence_parallel": lay.sequence_parallel,
        "num_micro_batches": lay.num_micro_batches,
        "accumulate_grad_batches": _accumulation(plan.training, lay),
        "mesh_order": lay.mesh_order,
        "cross_node_bytes_per_step": cross_node_json(chosen),
        "memory_bytes": candidate_json(chosen)["memory_bytes"],
        **base,
    }


def cross_node_json(c: Candidate) -> dict[str, dict[str, int]] | None:
    """``{order: {dp, pp, tp, total}}``: bytes moved between nodes per step, all ranks together, in each mesh order
    (``layout.mesh_order`` is the chosen one); None on one node."""
    if not c.cross_node_bytes:
        return None
    return {order: {k: round(v) for k, v in axes.items()} for order, axes in c.cross_node_bytes.items()}


def plan_json(plan: Plan) -> dict[str, Any]:
    """The machine-readable plan (``lightning-parallel plan --json``): model, training, hardware, model states per
    device for pure data parallelism, the recommendation and every candidate."""
    return {
        "model": {
            "name": plan.model.name,
            "params": plan.model.n_params,
            "largest_layer_params": plan.model.largest_layer_params,
        },
        "training": {
            "precision": plan.training.precision,
            "optimizer": plan.training.optimizer,
            "state_bytes_per_param": _state_json(plan.training.state_bytes),
            "offload_state_bytes_per_param": _state_json(plan.training.state_bytes_for(offload="cpu")),
            "master_weights": plan.training.master_weights,
            "micro_batch_size": plan.training.micro_batch_size,
            "batch_per_replica": plan.training.batch_per_replica,
            "accumulate_grad_batches": plan.training.accumulate_grad_batches,
            "global_batch_size": plan.training.global_batch_size,
            "activation_checkpointing": plan.training.activation_checkpointing,
        },
        "hardware": vars(plan.hardware),
        "model_states_bytes": plan.model_states_bytes,
        "single_device_bytes": plan.situation.single_device.total,
        "recommendation": recommendation_json(plan),
        "candidates": [candidate_json(c, plan.training) for c in plan.candidates],
    }
