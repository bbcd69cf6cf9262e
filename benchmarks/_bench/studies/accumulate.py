"""``--study accumulate``: what gradient accumulation does to each layout's optimizer step, measured next to the
planner's prediction.

    python benchmarks/bench.py --study accumulate --quick   # a = 4: ddp, zero1-3, tp, pp, ppzero3, hsdp
    python benchmarks/bench.py --study accumulate --accumulate 8 --cases ddp,zero3

A step that accumulates ``a`` batches runs the forward and backward of every batch (and every collective those run:
tensor-parallel all-reduces, pipeline sends, FSDP2's all-gathers), but reduces the gradient and steps the optimizer
once. So the step grows by less than ``a`` where the gradient exchange and the optimizer are a large share of it
(DDP, ZeRO-1/2), and by about ``a`` where the per-batch work dominates (ZeRO-3's all-gathers, tensor parallelism) --
and a planner that ignored accumulation would rank the layouts of an accumulating run as if it did not. Each case runs
the library's strategy under the Trainer (``accumulate_grad_batches`` = 1 and ``a``, the same batch per rank, so the
step with ``a`` trains ``a`` times the samples), in interleaved repetitions; a timed step is an optimizer step, from its
first batch to its last. ``x a=1`` is the median of the per-repetition ratios step(a) / step(1) (in brackets their
range); the prediction is the planner's (``planner.cost.estimate_step`` with ``accumulate_grad_batches``, the rates of
this machine's cached calibration, else the defaults: ``lightning-parallel plan --calibrate`` first). Writes
``accumulate.md`` and ``accumulate.json``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from ..cases import CASES
from ..predict import predict_case, rates_here
from . import median_ms, paired_rows, write_study

KEYS = ("ddp", "zero1", "zero2", "zero3", "tp", "pp", "ppzero3", "hsdp")
DEFAULT_ACCUMULATE = 4
PRESETS: dict[str, dict[str, Any]] = {
    "default": dict(warmup=2, steps=6, reps=3),
    "quick": dict(warmup=2, steps=5, reps=3),
}


def _keys(a: argparse.Namespace) -> list[str]:
    """The cases given (checked by the command line), or this study's own when --cases is the table's default."""
    given = [k for k in str(getattr(a, "cases", "") or "").split(",") if k]
    return list(KEYS) if not given or given == list(CASES) else given


def run(a: argparse.Namespace, folder: Path, header: str) -> int:
    acc = int(a.accumulate or DEFAULT_ACCUMULATE)
    keys = _keys(a)
    variants = {n: argparse.Namespace(**{**vars(a), "accumulate": n}) for n in (1, acc)}

    def row(case: Any, reps: list[dict[Any, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
        one = [median_ms(r[1]) for r in reps]
        many = [median_ms(r[acc]) for r in reps]
        ratios = [m / o for m, o in zip(many, one, strict=True)]
        rates = rates_here(a, case.world)
        p_one = predict_case(variants[1], case, rates).step_s * 1e3
        p_many = predict_case(variants[acc], case, rates).step_s * 1e3
        measured, predicted = statistics.median(ratios), p_many / p_one
        return (f"| {case.title} | {statistics.median(one):.1f} | {statistics.median(many):.1f} | "
                f"{measured:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {p_one:.1f} | {p_many:.1f} | "
                f"{predicted:.2f} | {predicted / measured:.2f} |",
                {"case": case.key, "accumulate": acc, "one_ms": one, "many_ms": many, "ratios": ratios,
                 "predicted_one_ms": p_one, "predicted_many_ms": p_many, "rates": rates.source})

    body, records, failed = paired_rows("accumulate", keys, variants, a.reps, row, columns=8)
    lines = [f"Batches per optimizer step: 1 and {acc}; the batch per rank the same (global batch {a.batch} per "
             f"batch); {a.steps} timed steps after {a.warmup} warm-up, {a.reps} interleaved repetitions.", "",
             f"| case | ms/step a=1 | ms/step a={acc} | measured x a=1 (range) | predicted a=1 | predicted a={acc} | "
             f"predicted x a=1 | predicted / measured x |", "|---|---|---|---|---|---|---|---|", *body]
    done = [r for r in records if "error" not in r]
    if done:
        lines += ["", f"Rates: {done[0]['rates']}.",
                  "Ranking by measured step at a=1: " + " < ".join(r["case"] for r in sorted(
                      done, key=lambda r: statistics.median(r["one_ms"]))),
                  f"Ranking by measured step at a={acc}: " + " < ".join(r["case"] for r in sorted(
                      done, key=lambda r: statistics.median(r["many_ms"]))),
                  f"Ranking by predicted step at a={acc}: " + " < ".join(r["case"] for r in sorted(
                      done, key=lambda r: r["predicted_many_ms"]))]
    return write_study(folder, "accumulate", header, lines, records, failed)
