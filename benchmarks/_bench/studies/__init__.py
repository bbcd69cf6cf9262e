"""The studies of ``benchmarks/bench.py --study NAME``: what the table does not show, one question each.

Each module has ``PRESETS`` (its own default sizes per preset, under the command line's) and
``run(a, folder, header) -> exit status``, which writes ``NAME.md`` and ``NAME.json`` into ``folder``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

STUDIES: dict[str, str] = {
    "recompute": "bytes one step keeps for backward under activation checkpointing none / selective / full, measured "
                 "next to the planner's formula (one process)",
    "bubble": "each pipeline rank's idle time per schedule and micro-batch count next to the textbook bubble, with "
              "the micro-batches in flight and the saved activations",
    "offload": "ZeRO-2/3 with and without CPU offload: device and host bytes per rank next to the formulas, step "
               "time against no offload (CUDA: the largest GPT that trains on one GPU)",
    "checkpoint": "step time with a checkpoint every 10 steps written in the background vs in the step vs none "
                  "(one file, lp_sharded folder, DCP folder), and how long a save held the step",
    "compile": "parallel.compile on and off under every strategy: the step time compiled over eager, and how far "
               "the losses move",
    "context": "context parallelism: activation bytes per rank at cp = 1, 2, 4 next to the formula, and the longest "
               "sequence that trains within a per-rank activation budget at cp = 1 and 4",
    "accumulate": "gradient accumulation: each layout's optimizer step with 1 and a batches, measured next to the "
                  "planner's prediction, and the layouts' ranking at both",
}


def load_study(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def median_ms(res: dict[str, Any]) -> float:
    """Rank 0's median step of one run, in milliseconds."""
    return float(statistics.median(res["ranks"][0]["step_s"])) * 1e3


def interleaved(study: str, case: Any, variants: dict[Any, argparse.Namespace], reps: int
                ) -> tuple[list[dict[Any, dict[str, Any]]], str | None]:
    """``reps`` repetitions of the library's run of ``case`` under each of two ``variants`` (the arguments of each
    run), in alternating order (no variant always first), each printed as it ends; every repetition's results by
    variant, and the first error (printed; None when every run trained)."""
    from ..world import run_world

    names = list(variants)
    out: list[dict[Any, dict[str, Any]]] = []
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        results = {name: run_world(variants[name], case, "ours", count=False) for name in order}
        for name, res in results.items():
            status = "failed" if "error" in res else f"median {median_ms(res):.1f} ms"
            print(f"[bench] {study} {case.key} rep {rep + 1}/{reps} {name}: {status}", flush=True)
        out.append(results)
    errors = [r[n]["error"] for r in out for n in r if "error" in r[n]]
    if errors:
        print(f"[bench] {study} {case.key} failed:\n{errors[0]}", flush=True)
    return out, (errors[0] if errors else None)


def paired_rows(study: str, keys: list[str], variants: dict[Any, argparse.Namespace], reps: int,
                row: Callable[[Any, list[dict[Any, dict[str, Any]]]], tuple[str, dict[str, Any]]], columns: int
                ) -> tuple[list[str], list[dict[str, Any]], int]:
    """A table of paired runs: for each case of ``keys``, :func:`interleaved` repetitions of the two ``variants``,
    then ``row(case, repetitions)`` -> its table line (of ``columns`` cells) and its record; a
    case whose runs failed gets a line saying so and its error. The lines, the records and how many cases failed."""
    from ..cases import CASES

    lines: list[str] = []
    records: list[dict[str, Any]] = []
    failed = 0
    for key in keys:
        case = CASES[key]
        results, error = interleaved(study, case, variants, reps)
        if error is not None:
            failed += 1
            lines.append(f"| {case.title} | failed | failed |" + " |" * (columns - 3))
            records.append({"case": key, "error": error})
            continue
        line, record = row(case, results)
        lines.append(line)
        records.append(record)
        print(line, flush=True)
    return lines, records, failed


def write_study(folder: Path, name: str, header: str, lines: list[str], records: list[dict[str, Any]],
                failed: int) -> int:
    """``NAME.md`` (the header and ``lines``) and ``NAME.json`` (the records) in ``folder``, printed; the exit status
    (1 when a case failed)."""
    text = f"{header}\n\n" + "\n".join(lines) + "\n"
    print(text)
    (folder / f"{name}.md").write_text(text)
    (folder / f"{name}.json").write_text(json.dumps({"header": header, "rows": records}, indent=1))
    print(f"[bench] wrote {folder / f'{name}.md'}, {folder / f'{name}.json'}")
    return 1 if failed else 0
