"""The studies of ``benchmarks/bench.py --study NAME``: what the table does not show, one question each.

Each module has ``PRESETS`` (its own default sizes per preset, under the command line's) and
``run(a, folder, header) -> exit status``, which writes ``NAME.md`` and ``NAME.json`` into ``folder``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

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
}


def load_study(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")
