"""The command line of ``benchmarks/bench.py``: the table's options and those of the studies."""

from __future__ import annotations

import argparse

from .cases import CASES, DEFAULT_DP, PRESETS, ROLES, SIZE_KEYS, expand
from .studies import STUDIES, load_study


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers, each at least 1")
    return values


def parse_args(argv: list[str] | None = None, description: str = "") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.py", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small GPT, few steps")
    size.add_argument("--large", action="store_true", help="a GPT that fills most of a GPU (CUDA)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, out of {','.join(CASES)}")
    p.add_argument("--roles", default=",".join(ROLES), help="ours,torch,lightning (ours is always run)")
    for key in SIZE_KEYS:
        p.add_argument(f"--{key}", type=int, help=f"override the preset's {key}")
    p.add_argument("--dp", type=_ints, default=[DEFAULT_DP], metavar="N[,N...]",
                   help="data-parallel sizes of the data-parallel-only cases (dp, ddp, zero1-3, offload), each run "
                        f"once per size (default {DEFAULT_DP}; e.g. 1,2,4 for their scaling)")
    p.add_argument("--micro-batches", type=int, default=4, help="pipeline micro-batches (pp, hybrid)")
    p.add_argument("--threads", type=int, default=1, help="CPU: intra-op threads per rank")
    p.add_argument("--compile", action="store_true",
                   help="the library's runs compile each block (parallel.compile: true, inductor; the anchors and "
                        "Lightning's built-ins stay eager); --study compile times both")
    p.add_argument("--start-method", choices=["fork", "forkserver", "spawn"], default="fork",
                   help="how the ranks of each run start (fork: cheap; this process never initializes CUDA; "
                        "forkserver: forked from a clean server that imported torch and Lightning once, not from "
                        "this process)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take before it is ended")
    p.add_argument("--out", help="output folder (default benchmarks/<date>)")
    p.add_argument("--predict", action="store_true",
                   help="after the table: the planner's predicted step of each case next to the measured one, the "
                        "ratio and the ranking comparison (rates: this machine's cached calibration, else defaults; "
                        "`lightning-parallel plan --calibrate` first)")
    p.add_argument("--calibrate-each", action="store_true",
                   help="with --predict: also calibrate this machine just before each case's repetitions (not "
                        "cached; ~10 s each on CPU) and predict the case with those rates as well, so that the "
                        "machine's drift between one calibration and a case measured minutes later is left out")
    p.add_argument("--profile", metavar="CASE", help="profile the library and its anchor on CASE; no table")
    p.add_argument("--overhead", metavar="CASE[,CASE...]",
                   help="where a step's time goes for each variant of CASE (all: every case): compute / collectives / "
                        "library Python / Lightning Python / torch Python / the rest; three more runs per variant; "
                        "no table")
    p.add_argument("--render", metavar="RESULTS_JSON",
                   help="write the markdown table and the plots again from a results.json; run nothing")
    s = p.add_argument_group("studies", "what the table does not show, one question each (--roles and --dp do not "
                             "apply, nor --cases but to accumulate; the size options do, over the study's own "
                             "defaults)")
    s.add_argument("--study", choices=list(STUDIES),
                   help="; ".join(f"{name}: {what}" for name, what in STUDIES.items()))
    s.add_argument("--time", action="store_true", help="recompute: also time a step against `none` (idle machine)")
    s.add_argument("--pp", type=_ints, metavar="P[,P...]", help="bubble: pipeline sizes (default 2,4; --quick 2)")
    s.add_argument("--m-factors", type=_ints, metavar="F[,F...]",
                   help="bubble: micro-batch counts as multiples of p (default 1,2,4; --quick 1,2)")
    s.add_argument("--schedules", help="bubble: comma-separated schedules (default all four)")
    s.add_argument("--accumulate", type=int, default=None, metavar="A",
                   help="accumulate: batches per optimizer step compared with 1 (default 4); --cases picks the cases "
                        "(default ddp,zero1,zero2,zero3,tp,pp,ppzero3,hsdp)")
    s.add_argument("--budget-mib", type=float, default=None,
                   help="context: per-rank budget of saved activations, MiB (default 16; --quick 4)")
    a = p.parse_args(argv)
    preset_name = "quick" if a.quick else "large" if a.large else "default"
    preset = dict(PRESETS[preset_name])
    if a.study is not None:
        preset.update(load_study(a.study).PRESETS.get(preset_name, {}))
    a.given = [key for key in SIZE_KEYS if getattr(a, key) is not None]
    for key, value in preset.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.hidden % a.heads:
        p.error(f"--hidden {a.hidden} must be divisible by --heads {a.heads}.")
    if a.budget_mib is None:
        a.budget_mib = 4.0 if a.quick else 16.0
    if a.accumulate is not None and a.study != "accumulate":
        p.error("--accumulate goes with --study accumulate (the table's steps are one batch each).")
    if a.study == "accumulate":
        if a.accumulate is not None and a.accumulate < 2:
            p.error(f"--accumulate {a.accumulate}: the study compares a >= 2 batches per step with 1.")
        given = [c for c in a.cases.split(",") if c]
        bad = [c for c in given if c not in CASES or CASES[c].key == "dp"] if given != list(CASES) else []
        if bad:
            p.error(f"--study accumulate --cases {','.join(bad)}: not a case with a planner layout; the cases are "
                    f"{', '.join(k for k in CASES if CASES[k].key != 'dp')}.")
    if a.study is not None:
        if a.profile is not None or a.render is not None or a.overhead is not None:
            p.error("--study runs on its own: without --profile, --overhead or --render.")
        if a.large and a.device == "cpu":
            p.error("--large is sized for GPUs; use it with --device cuda.")
        return a
    a.cases = [c for c in a.cases.split(",") if c]
    unknown = [c for c in a.cases if c not in CASES]
    if unknown:
        p.error(f"--cases {','.join(unknown)}: unknown; the cases are {', '.join(CASES)}.")
    a.roles = ["ours", *[r for r in a.roles.split(",") if r and r != "ours"]]
    if any(r not in ROLES for r in a.roles):
        p.error(f"--roles {','.join(a.roles)}: out of {', '.join(ROLES)}.")
    if a.overhead is not None:
        a.overhead = list(CASES) if a.overhead == "all" else [c for c in a.overhead.split(",") if c]
        bad = [c for c in a.overhead if c not in CASES]
        if bad:
            p.error(f"--overhead {','.join(bad)}: unknown; the cases are {', '.join(CASES)} (or all).")
    if a.calibrate_each and not a.predict:
        p.error("--calibrate-each goes with --predict (it calibrates for the predictions).")
    if a.reps < 3 and a.profile is None:
        p.error(f"--reps {a.reps}: at least 3 (the table reports medians of interleaved repetitions).")
    if a.profile is not None and a.profile not in CASES:
        p.error(f"--profile {a.profile}: unknown; the cases are {', '.join(CASES)}.")
    for case in expand(a.cases, a.dp):
        if a.batch % case.dp or (case.pp > 1 and (a.batch // case.dp) % a.micro_batches):
            p.error(f"--batch {a.batch}: case {case.name} needs it divisible by dp={case.dp}"
                    + (f" and the per-dp batch by --micro-batches {a.micro_batches}" if case.pp > 1 else "") + ".")
    if a.device == "cpu" and a.large:
        p.error("--large is sized for GPUs; use it with --device cuda.")
    return a
