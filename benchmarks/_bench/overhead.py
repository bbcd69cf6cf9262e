"""``--overhead``: where one step's time goes, per variant of a case, split by who spends it.

One more run of each variant (library, hand-written torch loop, Lightning's built-in) with three times the timed
steps, in three equal windows, rank 0's clock:

1. plain: the step time (median over the window), nothing profiled;
2. torch.profiler: ``compute`` (self time of ``aten::`` ops) and ``collectives`` (c10d and
   functional-collective ops, their waits included), milliseconds per step;
3. cProfile alone: each Python function's *self* time, summed by where its code lives --
   ``library`` (``lightning_parallel`` but its reference models), ``Lightning`` (``lightning``, ``lightning_fabric``,
   ``torchmetrics``, ``lightning_utilities``), ``torch`` (torch's Python: ``nn.Module.__call__``, the optimizers,
   autograd's Python, DTensor, FSDP2, pipelining), ``model`` (the GPT's own Python, the hand-written loop, the
   benchmark's clock), ``other`` (the standard library, DeepSpeed, the rest).

cProfile slows Python down, so its per-category times are scaled by (plain step / cProfile-run step); ``rest`` is
what is left of the plain step (the C++ dispatcher and autograd engine, allocator, waiting on another rank). The
split is an estimate (two profilers, noisy machine) but it is the same estimate for every variant, so a regression
shows *which part* grew. Under ``library`` each of its functions that costs more than 1 % of its Python time is listed
with its self and cumulative milliseconds per step and calls per step.
"""

from __future__ import annotations

import argparse
import pstats
from typing import Any

__all__ = ["CATEGORIES", "categorize", "overhead_table", "python_split"]

CATEGORIES = ("library", "lightning", "torch", "model", "other")

_LIGHTNING = ("/lightning/", "/lightning_fabric/", "/torchmetrics/", "/lightning_utilities/")


def categorize(filename: str) -> str | None:
    """The category of a Python function's file (:data:`CATEGORIES`); None for a built-in (C) function, whose time
    is an op's or a collective's (torch.profiler counts it)."""
    if filename == "~" or filename.startswith("<built-in"):
        return None
    path = filename.replace("\\", "/")
    if "/lightning_parallel/models/" in path or "/benchmarks/" in path:
        return "model"
    if "/lightning_parallel/" in path:
        return "library"
    if any(part in path for part in _LIGHTNING):
        return "lightning"
    if "/torch/" in path:
        return "torch"
    return "other"


def python_split(profiler: Any, steps: int, top_share: float = 0.01) -> dict[str, Any]:
    """Self time by category (ms per step) of a cProfile ``profiler`` run over ``steps`` steps, Python function calls
    by category per step (``calls``: exact, unlike the times, so a few more calls per step show in any run), and the
    library's functions over ``top_share`` of the library's time: ``[file:line(name), self ms, cumulative ms,
    calls]``."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    ms: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    counts: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    library: list[tuple[str, float, float, float]] = []
    for (filename, line, name), (_, calls, self_s, cum_s, _callers) in stats.items():
        category = categorize(filename)
        if category is None:
            continue
        ms[category] += self_s * 1e3 / steps
        counts[category] += calls / steps
        if category == "library":
            short = filename.replace("\\", "/").split("/lightning_parallel/", 1)[-1]
            library.append((f"{short}:{line}({name})", self_s * 1e3 / steps, cum_s * 1e3 / steps, calls / steps))
    total = ms["library"] or 1.0
    library = sorted((f for f in library if f[1] >= top_share * total), key=lambda f: -f[1])
    return {"python_ms": ms, "calls": counts, "library_functions": library}


def _scaled(plain_ms: float, breakdown: dict[str, float], python: dict[str, Any]) -> dict[str, float]:
    """The plain step split: compute and collectives from torch.profiler, the Python categories from cProfile scaled
    by the cProfile run's slow-down, ``rest`` the remainder."""
    scale = plain_ms / python["wall_ms"] if python.get("wall_ms") else 1.0
    out = {"step": plain_ms, "compute": breakdown["compute_ms"], "collectives": breakdown["collectives_ms"]}
    for category in CATEGORIES:
        out[category] = python["python_ms"][category] * scale
    out["rest"] = plain_ms - sum(v for k, v in out.items() if k != "step")
    return out


def overhead_table(a: argparse.Namespace, case_name: str, runs: dict[str, dict[str, Any]]) -> str:
    """The split of every variant of one case (``runs[role] = {"plain_ms", "ops", "python"}``), with the
    library's functions and the library's own Python next to the Lightning loop's cost where both anchors ran."""
    head = ("| variant | step ms | compute | collectives | library Python | Lightning Python | torch Python | "
            "model + loop Python | other Python | rest (dispatch, autograd engine, waits) |")
    lines = [f"### {case_name}", "", head, "|---|---|---|---|---|---|---|---|---|---|"]
    splits: dict[str, dict[str, float]] = {}
    for role, run in runs.items():
        if "error" in run:
            lines.append(f"| {role} | failed | | | | | | | | |")
            continue
        sp = splits[role] = _scaled(run["plain_ms"], run["ops"], run["python"])
        lines.append(f"| {role} | {sp['step']:.1f} | {sp['compute']:.1f} | {sp['collectives']:.1f} | "
                     f"{sp['library']:.2f} | {sp['lightning']:.2f} | {sp['torch']:.2f} | {sp['model']:.2f} | "
                     f"{sp['other']:.2f} | {sp['rest']:.1f} |")
    calls = {role: run["python"].get("calls") for role, run in runs.items() if "error" not in run}
    if all(calls.values()):
        lines += ["", "Python function calls per step (cProfile's count: exact, the same in every run of the same "
                  "code, so a few calls more per step show where the times above are noise):", "",
                  "| variant | library | Lightning | torch | model + loop | other | all |",
                  "|---|---|---|---|---|---|---|"]
        for role, c in calls.items():
            counts = " | ".join(f"{c[k]:,.0f}" for k in CATEGORIES)
            lines.append(f"| {role} | {counts} | {sum(c.values()):,.0f} |")
    ours = runs.get("ours", {})
    functions = ours.get("python", {}).get("library_functions", [])
    if functions:
        scale = ours["plain_ms"] / ours["python"]["wall_ms"]
        lines += ["", f"The library's Python in `ours` ({len(functions)} functions over 1 % of it; ms per step, scaled "
                  "as above; cumulative includes what they call):", "",
                  "| function | self ms | cumulative ms | calls/step |", "|---|---|---|---|"]
        lines += [f"| `{name}` | {self_ms * scale:.3f} | {cum_ms * scale:.3f} | {calls:.1f} |"
                  for name, self_ms, cum_ms, calls in functions[:25]]
    return "\n".join(lines)
