"""One benchmark for every strategy: the library against the hand-written torch loop of the same technique and
against Lightning's built-in strategies, on the same GPT, global batch and seed.

    python benchmarks/bench.py                     # CPU: the full table (2, 4 and 8 gloo ranks), ~20-25 min here
    python benchmarks/bench.py --quick             # a smaller GPT, fewer steps (CPU ~6 min; one 8-GPU node < 5 min)
    python benchmarks/bench.py --device cuda       # NCCL on the GPUs present (cases needing more are skipped)
    python benchmarks/bench.py --device cuda --large   # a 3B GPT: most of an 80 GB GPU's memory under lp_ddp
    python benchmarks/bench.py --cases ddp,zero3 --reps 5
    python benchmarks/bench.py --profile ddp       # torch.profiler of the library and its anchor: where the time goes
    python benchmarks/bench.py --quick --overhead all   # each variant's step split: compute / collectives / library
                                                   # Python / Lightning Python / torch Python / the rest
    python benchmarks/bench.py --cases ddp,zero1,zero2,zero3 --dp 1,2,4   # data parallelism over 1, 2 and 4 ranks
    python benchmarks/bench.py --study bubble      # one of the studies below instead of the table
    python benchmarks/bench.py --study compile --quick   # parallel.compile on/off under every strategy
    python benchmarks/bench.py --quick --predict   # the planner's predicted step of each case next to the measured
    python benchmarks/bench.py --quick --predict --calibrate-each   # also with a calibration just before each case

**Cases** (``--cases``; the anchors are written with torch only, no framework):

=========  ==========================  ===============================================  =============================
case       the library                 hand-written torch loop                          Lightning's built-in
=========  ==========================  ===============================================  =============================
dp         lp_dp (N replicas, 1 proc)  one process, same global batch (CUDA: nn.DataP.)  none (removed in Lightning 2)
ddp        lp_ddp                      DistributedDataParallel + AdamW                  ``ddp``
zero1      lp_sharded zero_stage=1     DDP + ZeroRedundancyOptimizer                    CUDA: ``deepspeed`` stage 1
zero2      lp_sharded zero_stage=2     FSDP2 fully_shard(reshard_after_forward=False)   CUDA: ``deepspeed`` stage 2
zero3      lp_sharded zero_stage=3     FSDP2 fully_shard: blocks, embed, head, root     ModelParallelStrategy dp=N
offload    lp_zero_offload z2 + CPU    bare deepspeed.initialize engine, same config    CUDA: ``deepspeed`` offload
tp         lp_tensor tp=2              DTensor parallelize_module, Megatron plan        ModelParallelStrategy tp=2
tp2d       lp_tensor dp2 x tp2 zero3   DTensor TP + FSDP2 over dp                       ModelParallelStrategy 2 x 2
pp         lp_pipeline pp=2 (1F1B)     torch.distributed.pipelining Schedule1F1B        none (removed in Lightning 2)
hybrid     lp_hybrid dp2 x pp2 x tp2   pipelining over DTensor TP + dp all-reduce       none
=========  ==========================  ===============================================  =============================

**How it runs.** Every run of every variant is a fresh world of ranks forked from this process (which never
initializes CUDA itself, so forking is safe on GPUs too; ``--start-method spawn`` if a platform needs it) and
started the way torchrun starts them (``RANK``/``WORLD_SIZE``/``TORCHELASTIC_RUN_ID`` set, the process group
created first), so the library's strategies, Lightning's and the hand-written loops all run in the same kind of
process, none paying a launcher inside the timed steps. Repetitions are interleaved (rep 1: every variant of the
case, rep 2: every variant, ..., each repetition starting with the next variant); a variant's step time is the
median over its timed steps of the time from one step's start to the next (forward, backward, optimizer step,
fetching the next batch), rank 0's clock; ratios are the median over repetitions of the paired ratio of the same
repetition. Lightning runs with no logger, progress bar, checkpointing or model summary (the hand loop has none
either); the GPT logs its loss every step as it ships.
Each variant also runs once more, untimed, with counters: on its last step every collective is counted per axis
(``torch.distributed`` functions wrapped, DTensor's functional collectives through a dispatch mode, DDP buckets through
a Python comm hook that routes them through ``torch.distributed``). The same losses are checked: ``dloss`` is the
largest difference of the loss at every step from the hand-written loop's.

**Columns.** step (ms), ``x torch`` / ``x Lightning`` (library / anchor, < 1 is faster; in brackets the range over
repetitions), CPU ms/step and its ratios (rank 0's process CPU time per step, all its threads: work done, blind to
other processes taking the cores, so it shows framework work where the wall clock is noisy), tokens/s (global batch x
sequence / step), model-state bytes per rank (busiest rank: parameters + gradients + optimizer state on the device,
plus what offload keeps on the host) next to the ZeRO / Megatron formula (fp32 AdamW: 4 + 4 + 8 bytes per parameter
of the rank's stage and tensor shard, divided over dp by the ZeRO stage), bytes each rank sends per step by axis next
to the ring-model theory (all-reduce ``2(N-1)/N B``, reduce-scatter and all-gather ``(N-1)/N B``, a p2p message its
bytes at the sender), and peak memory: CPU the rank's peak resident set (``VmHWM``; it includes the ~0.5 GB of the
forked interpreter with torch and Lightning) and its growth over the start; CUDA the peak allocated bytes.

**Scaling** (``--dp``): the data-parallel-only cases (dp, ddp, zero1-3, offload) run once per size given, each row
named ``case-dpN`` unless N is 2 (``--dp 1`` runs them on one rank: with one GPU, the framework's cost on its own).
lp_dp's exchanges through device 0 are counted by its engine (the library's ``CommCounter``) on the counted step, as the
``dp`` axis, next to the textbook figure (weights out and gradients back for each of N-1 replicas, and the inputs).

**Output** (``--out``, default ``benchmarks/<date>``): ``results.json`` (every step time of every repetition),
``results.md`` (the table), ``step_time_ratios.png`` and ``memory_per_rank.png``.

**Studies** (``--study NAME``, written as ``NAME.md`` and ``NAME.json`` in the same folder; the size options apply over
each study's own defaults): ``recompute`` -- the bytes one step keeps for backward under activation checkpointing
``none`` / ``selective`` / ``full``, measured, next to the planner's and the CPU-exact formula (one process);
``bubble`` -- each pipeline rank's busy and idle time per schedule and number of micro-batches against the textbook
bubble, the micro-batches in flight and the saved activations (``--pp``, ``--m-factors``, ``--schedules``);
``offload`` -- ZeRO-2/3 with and without CPU offload: device and host bytes per rank against the formulas and
DeepSpeed's estimator, step time against no offload (with ``--device cuda``: the largest GPT that trains on one GPU);
``compile`` -- ``parallel.compile`` on and off under every strategy: step time compiled over eager and the loss
difference; ``accumulate`` -- each layout's optimizer step with 1 and ``--accumulate`` batches, measured next to the
planner's prediction (``--cases``). ``--compile`` makes the table's library runs compile their blocks.

On a machine with fewer cores than ranks (this CPU: 2 cores; 4 and 8 single-threaded ranks) the ranks share cores:
the absolute times are slow, the ratios between variants of one case still compare the same work.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (ROOT, HERE):  # the package and this benchmark's own modules (``_bench``)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from _bench.cases import CASES, Case, expand, lightning_name, loop_cases  # noqa: E402
from _bench.cli import parse_args  # noqa: E402
from _bench.report import markdown, median, plots, render, split_text, summarize, table  # noqa: E402
from _bench.studies import load_study  # noqa: E402
from _bench.world import run_world  # noqa: E402


def _machine(a: argparse.Namespace) -> str:
    import platform

    import lightning

    cores = os.cpu_count()
    text = (f"{platform.node()}: {cores} CPU cores, {platform.processor() or platform.machine()}, torch "
            f"{torch.__version__}, lightning {lightning.__version__}")
    if a.device == "cuda":
        text += f", {torch.cuda.device_count()} x {_gpu_name()}"
    return text


def _gpu_name() -> str:
    """The GPU's name from nvidia-smi: asking torch would initialize CUDA in this process, and the ranks fork from
    it."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "GPU"
    return out.splitlines()[0].strip() if out.strip() else "GPU"


def _has_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def available(a: argparse.Namespace, case: Case) -> str | None:
    """Why ``case`` cannot run here, or None."""
    if case.offload != "none" and not _has_deepspeed():
        return "needs DeepSpeed (pip install -e '.[deepspeed]')"
    if a.device == "cuda":
        n = torch.cuda.device_count()
        need = case.dp if case.key == "dp" else case.world  # lp_dp: one process, a device per replica
        if n < need:
            return f"needs {need} GPUs, {n} present"
    return None


def _lightning_missing(a: argparse.Namespace, case: Case) -> str | None:
    """Why Lightning's built-in of ``case`` cannot run here (it has none on this device, or it needs DeepSpeed)."""
    name = lightning_name(case, a.device)
    if name is None:
        return case.lightning_missing or "none"
    if name.startswith("deepspeed") and not _has_deepspeed():
        return f"Lightning's {name} needs DeepSpeed, which is not installed"
    return None


def _roles(a: argparse.Namespace, case: Case) -> list[str]:
    return [r for r in a.roles if r != "lightning" or _lightning_missing(a, case) is None]


def profile(a: argparse.Namespace, case: Case) -> None:
    """Run the library and its anchors under torch.profiler and cProfile on rank 0 (4 steps after warm-up); print
    the top ops by self CPU time, the Python functions by cumulative time, and the time split of each."""
    print(f"profiling {case.name}: {case.title} vs torch: {case.anchor}", flush=True)
    for role in _roles(a, case):
        res = run_world(a, case, role, count=False, profile="full")
        if "error" in res:
            print(f"{role}: failed\n{res['error']}")
            continue
        prof = res["ranks"][0].get("profile", {})
        print(f"\n== {role}: median step {median(res['ranks'][0]['step_s']) * 1e3:.1f} ms; profiled: "
              f"{split_text(prof)}\n{prof.get('table', '')}\nPython functions (cProfile, the same steps, by "
              f"cumulative time):\n{prof.get('python', '')}")



def overhead(a: argparse.Namespace, cases: list[Case], folder: Path, command: str) -> int:
    """``--overhead``: each variant of each case run once more with three times the timed steps, in three windows
    (plain, torch.profiler, cProfile), and its step split by who spends it (``_bench.overhead``); the tables are
    printed and written to ``overhead.md``, rank 0's cProfile statistics of each variant to ``CASE_ROLE.pstats``."""
    from _bench.overhead import overhead_table

    folder.mkdir(parents=True, exist_ok=True)
    a = argparse.Namespace(**{**vars(a), "steps": 3 * a.steps, "pstats_dir": str(folder)})
    texts: list[str] = []
    for case in cases:
        why = available(a, case)
        if why is not None:
            print(f"[bench] {case.name}: skipped ({why})", flush=True)
            continue
        runs: dict[str, dict[str, Any]] = {}
        for role in _roles(a, case):
            res = run_world(a, case, role, count=False, profile="split")
            if "error" in res:
                print(f"[bench] {case.name} {role} failed:\n{res['error']}", flush=True)
            runs[role] = {"error": res["error"]} if "error" in res else res["ranks"][0]["profile"]
        texts.append(overhead_table(a, case.name, runs))
        print(texts[-1] + "\n", flush=True)
    (folder / "overhead.md").write_text(f"`{command}`\n\n" + "\n\n".join(texts) + "\n")
    print(f"[bench] wrote {folder / 'overhead.md'}")
    return 0


def where_time_goes(a: argparse.Namespace, case: Case, rows: list[dict[str, Any]]) -> None:
    """For a case where the library is more than 3 % slower (wall clock or CPU time) than its hand-written loop,
    profile every variant once over the timed steps and keep the split (``row["split"]``)."""
    ours = next((r for r in rows if r["role"] == "ours" and "step_s" in r), None)
    if ours is None or max(ours.get("x_torch", 0.0), ours.get("cpu_x_torch", 0.0)) <= 1.03:
        return
    for row in rows:
        if "error" in row:
            continue
        res = run_world(a, case, row["role"], count=False, profile="breakdown")
        if "error" not in res and "profile" in res["ranks"][0]:
            row["split"] = res["ranks"][0]["profile"]
            print(f"[bench] {case.key} {row['role']} profiled: {split_text(row['split'])}", flush=True)



def _calibrate_for(a: argparse.Namespace, case: Case) -> Any:
    """``--calibrate-each``: this machine's rates measured now (two ranks, one measurement where ``plan --calibrate``
    keeps the median of three; not cached)."""
    from lightning_parallel.planner.calibrate import calibrate

    t0 = time.perf_counter()
    rates = calibrate(ranks=2, save=False, repeats=1)
    print(f"[bench] {case.name}: calibrated in {time.perf_counter() - t0:.1f} s ({rates.source})", flush=True)
    return rates


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv, description=__doc__.split("\n\n")[0])
    if a.render is not None:
        render(Path(a.render))
        return 0
    import lightning_parallel  # noqa: F401  (registers the strategies; imported once, before forking)

    date = datetime.date.today().isoformat()
    folder = Path(a.out) if a.out else ROOT / "benchmarks" / date
    command = f"python benchmarks/bench.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    if a.study is not None:
        folder.mkdir(parents=True, exist_ok=True)
        return load_study(a.study).run(a, folder, f"Measured {date} on {_machine(a)}; `{command}`")
    if ("offload" in a.cases or a.profile == "offload" or "offload" in (a.overhead or [])) and _has_deepspeed():
        import deepspeed  # noqa: F401  (import once in the parent; the ops were built by the set-up)
    if a.overhead is not None:
        return overhead(a, expand(a.overhead, a.dp), folder, command)
    if a.profile is not None:
        case = CASES[a.profile]
        profile(a, case.with_dp(a.dp[0]) if case.scalable else case)
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    machine = _machine(a)
    print(f"[bench] {machine}; GPT {a.layers} layers x {a.hidden} (heads {a.heads}), seq {a.seq}, vocab {a.vocab}, "
          f"global batch {a.batch}; {a.warmup} warm-up + {a.steps} timed steps; {a.reps} interleaved reps; "
          f"device {a.device}", flush=True)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    case_rates: dict[str, Any] = {}
    cases = expand(a.cases, a.dp)
    for case in cases + loop_cases(cases, a.roles):
        key = case.name
        why = available(a, case)
        if why is not None:
            skipped[key] = why
            print(f"[bench] {key}: skipped ({why})", flush=True)
            continue
        roles = _roles(a, case)
        missing = _lightning_missing(a, case)
        if "lightning" in a.roles and missing is not None and lightning_name(case, a.device) is not None:
            skipped[f"{key} (Lightning)"] = missing
            print(f"[bench] {key}: Lightning's built-in skipped ({missing})", flush=True)
        if a.calibrate_each and case.key != "dp" and not case.loop_cost:  # lp_dp has no planner layout
            case_rates[key] = _calibrate_for(a, case)
        reps: list[dict[str, dict[str, Any]]] = []
        for rep in range(a.reps):
            results: dict[str, dict[str, Any]] = {}
            for role in roles[rep % len(roles):] + roles[:rep % len(roles)]:  # rotated: no variant always first
                t0 = time.perf_counter()
                results[role] = run_world(a, case, role, count=False)
                status = "failed" if "error" in results[role] else \
                    f"median step {median(results[role]['ranks'][0]['step_s']) * 1e3:.1f} ms"
                print(f"[bench] {key} rep {rep + 1}/{a.reps} {role}: {status} ({time.perf_counter() - t0:.1f} s "
                      f"with start-up; {time.perf_counter() - started:.0f} s in all)", flush=True)
            reps.append(results)
        counted = {role: run_world(a, case, role, count=True) for role in roles}
        case_rows = summarize(a, case, reps, counted)
        if not case.loop_cost:
            where_time_goes(a, case, case_rows)
        for r in case_rows:
            if "error" in r:
                print(f"[bench] {key} {r['role']} failed:\n{r['error_full']}", flush=True)
        rows.extend(case_rows)
        print(table(a, case_rows), flush=True)
    elapsed = time.perf_counter() - started
    header = (f"Measured {date} on {machine}; device {a.device}; GPT {a.layers} x {a.hidden}, seq {a.seq}, global "
              f"batch {a.batch}, fp32 AdamW; {a.reps} interleaved repetitions of {a.steps} timed steps (median); "
              f"`{command}` took {elapsed:.0f} s.")
    text = markdown(a, rows, header, skipped)
    start = None
    if a.predict:
        from _bench.predict import predicted_section

        section, start = predicted_section(a, rows, case_rates=case_rates)
        text += "\n\n" + section
    (folder / "results.md").write_text(text)
    (folder / "results.json").write_text(json.dumps({
        "machine": machine, "date": date, "header": header, "args": vars(a),
        "rows": [{k: v for k, v in r.items() if k != "error_full"} for r in rows], "skipped": skipped,
        **({"case_rates": {k: r.to_dict() for k, r in case_rates.items()}} if case_rates else {}),
        **({"start_rates": start.to_dict()} if start is not None else {}),
        "seconds": elapsed}, indent=1, default=str))
    written = plots(a, rows, folder)
    print(f"\n{text}")
    print(f"[bench] wrote {folder / 'results.json'}, {folder / 'results.md'}, "
          f"{', '.join(str(p) for p in written)}")
    failed = [r for r in rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
