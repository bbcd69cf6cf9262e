"""The one table from a layout to the strategy that runs it.

Every process-based strategy of the library is a preset of the layout ``(dp, pp, tp, zero_stage, offload)``; this
module says which named strategy runs which region of that space, and whether that strategy exists in this version.
It is the only place that answers the question: the strategies' refusals ("lp_ddp does not run zero_stage=2: use
lp_sharded"), the planner (which strategy a recommended layout is written for) and the registry (every name the
table calls available is registered, checked by a test) all read it. No Lightning import: the planner uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel.config import ParallelConfig

__all__ = ["LAYOUT_STRATEGIES", "LayoutStrategyEntry", "available_strategies", "entry", "strategy_for",
           "strategy_for_key"]


@dataclass(frozen=True)
class LayoutStrategyEntry:
    """One row: a strategy name, the layouts it runs, and whether it exists in this version."""

    name: str
    layouts: str
    """The region of the layout space, as ``(dp, pp, tp, zero_stage, offload)``."""
    available: bool
    """False for a strategy that is planned but not in this version: never recommended, never named as a fix."""


LAYOUT_STRATEGIES: tuple[LayoutStrategyEntry, ...] = (
    LayoutStrategyEntry("lp_ddp", "(N, 1, 1, 0, none): the whole model on every rank, gradients all-reduced", True),
    LayoutStrategyEntry("lp_sharded", "(N, 1, 1, 1|2|3, none): ZeRO over dp (native engine or fairscale)", True),
    LayoutStrategyEntry("lp_zero_offload", "(N, 1, 1, 1|2|3, none|cpu|nvme): the DeepSpeed engine, offload", True),
    LayoutStrategyEntry("lp_pipeline", "(N/p, p, 1, 0|1, none): pipeline stages", True),
    LayoutStrategyEntry("lp_tensor", "(N/t, 1, t, 0|1|3, none): tensor-parallel layers", True),
    LayoutStrategyEntry("lp_hybrid", "(d, p, t, 0|1, none): DP + PP + TP (+ ZeRO-1)", True),
)

_BY_NAME = {e.name: e for e in LAYOUT_STRATEGIES}


def entry(name: str) -> LayoutStrategyEntry:
    """The row of ``name``; KeyError names the rows."""
    if name not in _BY_NAME:
        raise KeyError(f"{name!r} is not in the layout table; its strategies are {sorted(_BY_NAME)}.")
    return _BY_NAME[name]


def available_strategies() -> list[str]:
    """The names of the table that exist in this version (each is registered with Lightning)."""
    return [e.name for e in LAYOUT_STRATEGIES if e.available]


def strategy_for(layout: ParallelConfig) -> str:
    """The strategy that runs ``layout`` (its ``zero_stage``/``offload`` read as set; unset = 0 / none).

    Offload needs the DeepSpeed engine; pure data parallelism is ``lp_ddp`` (no ZeRO) or ``lp_sharded`` (ZeRO 1-3,
    also plain ZeRO-3 without offload); anything with ``pp`` or ``tp`` > 1 is a model-parallel strategy.
    """
    pp, tp, zero, offload = (layout.pipeline_parallel_size, layout.tensor_parallel_size, layout.zero,
                             layout.offload_device)
    if offload != "none":
        return "lp_zero_offload"
    if pp == tp == 1:
        return "lp_ddp" if zero == 0 else "lp_sharded"
    if tp == 1:
        return "lp_pipeline"
    if pp == 1:
        return "lp_tensor"
    return "lp_hybrid"


def strategy_for_key(key: str) -> str:
    """For a refusal: which existing strategy runs a layout that sets ``key``, or that none does yet.

    Returns a clause such as ``"or use strategy lp_sharded or lp_zero_offload"``, or ``"(no strategy of this
    version runs pipeline parallelism yet)"``: only names of strategies that exist.
    """
    wanted = {
        "pipeline_parallel_size": ("lp_pipeline", "lp_hybrid"),
        "tensor_parallel_size": ("lp_tensor", "lp_hybrid"),
        "zero_stage": ("lp_sharded", "lp_zero_offload"),
        "offload": ("lp_zero_offload",),
    }[key]
    names = [n for n in wanted if _BY_NAME[n].available]
    if names:
        return "or use strategy " + " or ".join(names)
    what = {"pipeline_parallel_size": "pipeline", "tensor_parallel_size": "tensor"}.get(key, key)
    return f"(no strategy of this version runs {what} parallelism yet)"
