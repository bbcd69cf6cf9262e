"""The one table from a layout to the strategy that runs it.

Every process-based strategy of the library is a preset of the layout ``(dp, pp, tp, zero_stage, offload)``; this
module says which named strategy runs which region of that space, and whether that strategy exists in this version.
It is the only place that answers the question; everything else reads :data:`LAYOUT_STRATEGIES`:

* :func:`strategy_for` -- the strategy that runs a layout (the planner writes its recipes for it);
* :func:`refusal` -- why a strategy does not run a layout, naming the one that does (every strategy's
  ``check_layout``, through :class:`~lightning_parallel.strategies.layout.LayoutMixin`);
* :func:`zero_and_offload` -- the ``(zero_stage, offload)`` pairs some strategy runs at given sizes (the planner's
  candidates);
* :attr:`LayoutStrategyEntry.region` -- the region as text, ``(N/t, 1, t, 0|1|3, none)`` (the registry's
  descriptions); and the registry (every name the table calls available is registered, checked by a test).

No Lightning import: the planner uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

from lightning_parallel.config import Offload, ParallelConfig

__all__ = ["LAYOUT_KEYS", "LAYOUT_STRATEGIES", "LayoutStrategyEntry", "available_strategies", "entry", "refusal",
           "strategy_for", "strategy_for_key", "zero_and_offload"]

LAYOUT_KEYS = ("pipeline_parallel_size", "tensor_parallel_size", "zero_stage", "offload", "context_parallel_size")
"""The keys whose values the table bounds, in the order a refusal checks them (``data_parallel_size`` is free)."""


@dataclass(frozen=True)
class LayoutStrategyEntry:
    """One row: a strategy, the region of the layout space it runs, and whether it exists in this version.

    ``data_parallel_size`` is whatever remains of the world (``N``, ``N/p``, ``N/t`` or ``d``); the other keys are
    bounded here. A row runs a layout when each of the layout's values is among the row's.
    """

    name: str
    pipeline: bool
    """Runs ``pipeline_parallel_size`` > 1 (else only 1)."""
    tensor: bool
    """Runs ``tensor_parallel_size`` > 1 (else only 1)."""
    zero_stages: tuple[tuple[int, str], ...]
    """The ZeRO stages it runs over dp, each with what that stage does here."""
    offloads: tuple[str, ...]
    """The ``offload`` values it runs."""
    shape: str
    """What it does with the model, completing "``name`` ..." (refusals quote it)."""
    zero_why: str = ""
    """Why the stages it does not run do not (a refusal of ``zero_stage`` adds it after the value)."""
    zero_fix: str = ""
    """The fix a refusal of ``zero_stage`` gives (``{use}``: the strategy that runs the layout, else named after the
    fix; ``{stages}``: the row's stages; ``{preset}``: the strategy's stage for an unset one); empty: the fix of the
    other keys."""
    available: bool = True
    """False for a strategy that is planned but not in this version: never recommended, never named as a fix."""
    pipeline_stages: tuple[int, ...] = ()
    """ZeRO stages it runs with tp > 1 only inside a pipeline (pp > 1): there they run as FSDP2 per stage; without a
    pipeline that is ``lp_tensor``'s layout, where they are not composed."""
    context: bool = True
    """Runs ``context_parallel_size`` > 1 (sequences split over a ``cp`` axis, gradients averaged over dp x cp)."""

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(stage for stage, _ in self.zero_stages)

    def allowed(self, key: str) -> tuple[Any, ...]:
        """The values of ``key`` this row runs (sizes: ``(1,)``, or ``()`` for "any")."""
        if key == "pipeline_parallel_size":
            return () if self.pipeline else (1,)
        if key == "tensor_parallel_size":
            return () if self.tensor else (1,)
        if key == "zero_stage":
            return self.stages
        if key == "offload":
            return self.offloads
        if key == "context_parallel_size":
            return () if self.context else (1,)
        raise KeyError(f"{key!r} is not a key of the layout table; its keys are {list(LAYOUT_KEYS)}.")

    def runs(self, layout: ParallelConfig, keys: tuple[str, ...] = LAYOUT_KEYS) -> bool:
        """Whether ``layout``'s values of ``keys`` are all this row's (unset zero_stage/offload read as 0/none)."""
        return all(_runs(self.allowed(key), _value(layout, key)) for key in keys) and not (
            "zero_stage" in keys and self._needs_pipeline(layout))

    def _needs_pipeline(self, layout: ParallelConfig) -> bool:
        return (layout.zero in self.pipeline_stages and layout.tensor_parallel_size > 1
                and layout.pipeline_parallel_size == 1)

    @property
    def region(self) -> str:
        """The region as ``(dp, pp, tp, zero_stage, offload)``, e.g. ``(N/t, 1, t, 0|1|3, none)``."""
        dp = {(False, False): "N", (True, False): "N/p", (False, True): "N/t", (True, True): "d"}[
            (self.pipeline, self.tensor)]
        sizes = ("p" if self.pipeline else "1", "t" if self.tensor else "1")
        return (f"({dp}, {sizes[0]}, {sizes[1]}, {'|'.join(str(s) for s in self.stages)}, "
                f"{'|'.join(self.offloads)})")


def _value(layout: ParallelConfig, key: str) -> Any:
    return {"zero_stage": layout.zero, "offload": layout.offload_device}.get(key, getattr(layout, key, None))


def _runs(allowed: tuple[Any, ...], value: Any) -> bool:
    return not allowed or value in allowed


LAYOUT_STRATEGIES: tuple[LayoutStrategyEntry, ...] = (
    # strategy_for takes the first row that runs a layout: the narrower regions come first.
    LayoutStrategyEntry(
        "lp_ddp", pipeline=False, tensor=False, zero_stages=((0, "gradients all-reduced over dp"),),
        offloads=("none",), shape="replicates the whole model on every rank"),
    LayoutStrategyEntry(
        "lp_sharded", pipeline=False, tensor=False,
        zero_stages=((1, "optimizer states sharded"), (2, "+ gradients"), (3, "+ parameters, FSDP2")),
        offloads=("none",), shape="shards the model over the dp axis only",
        zero_why=" (no sharding)",
        zero_fix="use strategy {use} for plain data parallelism, or set zero_stage to {stages} (or leave it unset: "
                 "stage {preset})"),
    LayoutStrategyEntry(
        "lp_zero_offload", pipeline=False, tensor=False,
        zero_stages=((1, "DeepSpeed ZeRO-1"), (2, "ZeRO-2"), (3, "ZeRO-3")), offloads=("none", "cpu", "nvme"),
        shape="is data parallel only, on the DeepSpeed engine", zero_why=" (no ZeRO)", context=False,
        zero_fix="set zero_stage to {stages} (or leave it unset: stage {preset}), or use strategy {use} for plain "
                 "data parallelism"),
    LayoutStrategyEntry(
        "lp_pipeline", pipeline=True, tensor=False,
        zero_stages=((0, "gradient all-reduce over dp"), (1, "ZeRO-1: optimizer states sharded over dp"),
                     (2, "FSDP2 per stage, parameters gathered once per step"),
                     (3, "FSDP2 per stage, parameters resharded after forward")),
        offloads=("none",), shape="splits the layers into pipeline stages over pp and replicates them over dp"),
    LayoutStrategyEntry(
        "lp_tensor", pipeline=False, tensor=True,
        zero_stages=((0, "gradient all-reduce over dp"), (1, "ZeRO-1 on the local shards"),
                     (3, "FSDP2 over dp x TP over tp")),
        offloads=("none",), shape="splits layers over tp and replicates them over dp",
        zero_fix="zero_stage=1 (same traffic as 2, the gradients stay whole) or 3"),
    LayoutStrategyEntry(
        "lp_hybrid", pipeline=True, tensor=True,
        zero_stages=((0, "all-reduce of the stage's gradient shards over dp"), (1, "ZeRO-1 on them"),
                     (2, "FSDP2 on each stage's TP shards, gathered once per step"),
                     (3, "FSDP2 on each stage's TP shards, resharded after forward")),
        offloads=("none",), shape="composes dp x pp x tp (+ ZeRO 1, 2 or 3 over dp)", pipeline_stages=(2,)),
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
    """The strategy that runs ``layout`` (its ``zero_stage``/``offload`` read as set; unset = 0 / none): the first
    available row that runs it; for a layout no row runs (a ZeRO stage no strategy has at these sizes), the first
    that runs its sizes and offload, whose refusal then names the stages it runs.

    So offload is the DeepSpeed engine's; pure data parallelism is ``lp_ddp`` (no ZeRO) or ``lp_sharded`` (ZeRO 1-3,
    also plain ZeRO-3 without offload); anything with ``pp`` or ``tp`` > 1 is a model-parallel strategy.
    """
    rows = [e for e in LAYOUT_STRATEGIES if e.available]
    for row in rows:
        if row.runs(layout):
            return row.name
    for row in rows:
        if row.runs(layout, ("pipeline_parallel_size", "tensor_parallel_size", "offload")):
            return row.name
    raise KeyError(f"no strategy of this version runs the layout {layout.describe()}.")


def strategy_for_key(key: str) -> str:
    """For a refusal: which existing strategies run a value of ``key`` that the plain layout's strategy
    (``lp_ddp``) does not, or that none does yet.

    Returns a clause such as ``"or use strategy lp_pipeline or lp_hybrid"``, or ``"(no strategy of this version runs
    pipeline parallelism yet)"``: only names of strategies that exist.
    """
    names = [e.name for e in LAYOUT_STRATEGIES[1:] if e.available and _widens(e, key)]
    if names:
        return "or use strategy " + " or ".join(names)
    what = {"pipeline_parallel_size": "pipeline", "tensor_parallel_size": "tensor",
            "context_parallel_size": "context"}.get(key, key)
    return f"(no strategy of this version runs {what} parallelism yet)"


def _widens(row: LayoutStrategyEntry, key: str) -> bool:
    """Whether ``row`` runs a value of ``key`` that the plain layout's row (the first) does not."""
    plain, values = LAYOUT_STRATEGIES[0].allowed(key), row.allowed(key)
    if not values:  # any value
        return bool(plain)
    return bool(set(values) - set(plain))


def refusal(name: str, layout: ParallelConfig, *, keys: tuple[str, ...] = LAYOUT_KEYS,
            preset: dict[str, Any] | None = None) -> str | None:
    """Why strategy ``name`` does not run ``layout`` (None when it does, or when ``name`` has no row): the first of
    ``keys`` the layout sets to a value outside the row, what the strategy runs, and the fix -- naming the strategy
    that runs the layout (:func:`strategy_for`) where one does. Only keys the layout sets count (unset ones take the
    strategy's ``preset``, quoted in the fix)."""
    row = _BY_NAME.get(name)
    if row is None:
        return None
    for key in keys:
        value = getattr(layout, key)
        if value is None or _runs(row.allowed(key), value):
            continue
        other = _runner(layout, besides=name)
        if key == "zero_stage" and (row.zero_why or row.zero_fix):
            runs = _either([f"{stage} ({what})" for stage, what in row.zero_stages])
            fix = row.zero_fix.format(use=other or "another strategy", stages=_either([str(s) for s in row.stages]),
                                      preset=(preset or {}).get("zero_stage"))
            if other and "{use}" not in row.zero_fix:
                fix += f", or use strategy {other}"
            return f"{name} runs zero_stage {runs}, but parallel.zero_stage={value}{row.zero_why}. Fix: {fix}."
        use = f"or use strategy {other}" if other else strategy_for_key(key)
        allowed = " or ".join(repr(v) for v in row.allowed(key))
        return (f"{name} {row.shape} (layout {row.region}), but parallel.{key}={value!r}. Fix: set {key} to {allowed} "
                f"{use}.")
    if "zero_stage" in keys and row._needs_pipeline(layout):
        return (f"{name} runs zero_stage={layout.zero} as FSDP2 per pipeline stage, but pipeline_parallel_size=1 "
                f"(tensor_parallel_size={layout.tensor_parallel_size}, no pipeline): "
                f"parallel.zero_stage={layout.zero}. "
                "Fix: zero_stage=1 (the same bytes, the gradients stay whole) or 3 (FSDP2 over the TP shards), or "
                "pipeline_parallel_size > 1.")
    return None


def _either(items: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join(filter(None, [", ".join(items[:-1]), items[-1]]))


def _runner(layout: ParallelConfig, *, besides: str) -> str | None:
    """The strategy that runs ``layout``, when one other than ``besides`` does."""
    try:
        name = strategy_for(layout)
    except KeyError:
        return None
    return name if name != besides and _BY_NAME[name].runs(layout) else None


def zero_and_offload(*, pipeline: bool, tensor: bool) -> list[tuple[int, str]]:
    """Every ``(zero_stage, offload)`` that some available strategy runs with ``pp > 1`` (``pipeline``) and
    ``tp > 1`` (``tensor``) or not: no offload first, then by offload device, stages ascending. Cross-field rules of
    the layout (offload needs ZeRO 2 or 3) are :class:`ParallelConfig`'s."""
    rows = [e for e in LAYOUT_STRATEGIES if e.available and (e.pipeline or not pipeline) and (e.tensor or not tensor)]
    pairs = {(stage, offload) for e in rows for stage in e.stages for offload in e.offloads}
    order = get_args(Offload)
    return sorted(pairs, key=lambda pair: (order.index(pair[1]), pair[0]))
