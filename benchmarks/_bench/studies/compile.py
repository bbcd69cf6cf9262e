"""``--study compile``: ``parallel.compile`` on and off under every strategy -- the library's step time with each
block compiled (inductor) over the same run without, and how far the losses move.

    python benchmarks/bench.py --study compile            # ddp, zero1, zero3, offload, tp, pp, hybrid
    python benchmarks/bench.py --study compile --quick    # a smaller GPT, fewer steps

Each run is a fresh world of ranks (as in the table) running the library's strategy under the Trainer on the
reference GPT; ``compiled`` sets ``parallel.compile: true`` (inductor; ranks compile in process,
``TORCHINDUCTOR_COMPILE_THREADS=1``). The warm-up steps hold the compilation (the first step compiles the block's
forward and backward; inductor's on-disk cache makes later runs of the same graph start faster); the timed steps
come after. Repetitions are interleaved (eager, compiled, then compiled, eager, ...); ``x eager`` is the median over
repetitions of the paired ratio compiled / eager of one repetition (< 1: compiling is faster), in brackets its range;
``dloss`` the largest difference of the loss at any step between the two runs of the first repetition (inductor's
fused kernels round differently from eager, ~1e-6 relative). Writes ``compile.md`` and ``compile.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
from pathlib import Path
from typing import Any

from . import median_ms, paired_rows, write_study

KEYS = ("ddp", "zero1", "zero3", "offload", "tp", "pp", "hybrid")
PRESETS: dict[str, dict[str, Any]] = {
    "default": dict(layers=4, hidden=128, heads=4, seq=64, batch=8, warmup=3, steps=8, reps=3),
    "quick": dict(layers=2, hidden=64, heads=4, seq=32, batch=8, warmup=3, steps=6, reps=3),
}


def run(a: argparse.Namespace, folder: Path, header: str) -> int:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    a.micro_batches = min(a.micro_batches, a.batch // 2)
    keys = [k for k in KEYS if k != "offload" or importlib.util.find_spec("deepspeed") is not None]
    variants = {name: argparse.Namespace(**{**vars(a), "compile": name == "compiled"})
                for name in ("eager", "compiled")}

    def row(case: Any, reps: list[dict[Any, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
        eager = [median_ms(r["eager"]) for r in reps]
        compiled = [median_ms(r["compiled"]) for r in reps]
        ratios = [c / e for c, e in zip(compiled, eager, strict=True)]
        first = reps[0]
        dloss = max(abs(x - y) for x, y in zip(first["eager"]["ranks"][0]["losses"],
                                               first["compiled"]["ranks"][0]["losses"], strict=True)
                    if x is not None and y is not None)
        return (f"| {case.title} | {statistics.median(eager):.1f} | {statistics.median(compiled):.1f} | "
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {dloss:.1e} |",
                {"case": case.key, "eager_ms": eager, "compiled_ms": compiled, "ratios": ratios, "dloss": dloss})

    body, records, failed = paired_rows("compile", keys, variants, a.reps, row, columns=5)
    lines = ["| case | eager ms/step | compiled ms/step | x eager (range) | dloss |", "|---|---|---|---|---|", *body]
    return write_study(folder, "compile", header, lines, records, failed)
