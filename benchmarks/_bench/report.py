"""The formulas next to the measurements, the rows of the table, ``results.md`` and the plots."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.parallel.counters import ring_bytes

from .cases import CASES, DEFAULT_DP, Case, lightning_name


def _local_params(a: argparse.Namespace, case: Case) -> int:
    """Parameters of the busiest pipeline stage on one tp rank, before any dp sharding (the formulas' Psi): the
    planner's count for the GPT's shape."""
    from lightning_parallel.models import GPT
    from lightning_parallel.planner.detect import model_spec_from_module

    with torch.device("meta"):
        model = GPT(n_layer=a.layers, n_head=a.heads, n_embd=a.hidden, block_size=a.seq, vocab_size=a.vocab)
    spec, _ = model_spec_from_module(model)
    return spec.params_per_device(pp=case.pp, tp=case.tp)


def _head_params(a: argparse.Namespace, case: Case) -> int:
    """Parameters of the GPT's head (final norm and vocabulary projection) on one tp rank: the unit ZeRO-3 keeps
    gathered from its forward into its backward (the library's ``apply_zero3(keep_last_gathered=True)``, and the
    hand-written anchors alike), so that a step gathers it once, not twice."""
    from lightning_parallel.models import GPT
    from lightning_parallel.planner.detect import model_spec_from_module

    with torch.device("meta"):
        model = GPT(n_layer=a.layers, n_head=a.heads, n_embd=a.hidden, block_size=a.seq, vocab_size=a.vocab)
    spec, _ = model_spec_from_module(model)
    assert spec.shape is not None
    return spec.shape.head_params(case.tp)


def _stage_params(a: argparse.Namespace, case: Case) -> list[int]:
    """Parameters of each pipeline stage as the library cuts the GPT (balanced by parameter count)."""
    from lightning_parallel.models import GPT
    from lightning_parallel.parallel.pipeline import plan_stages

    with torch.device("meta"):
        model = GPT(n_layer=a.layers, n_head=a.heads, n_embd=a.hidden, block_size=a.seq, vocab_size=a.vocab)
    layers = model.pipeline_layers()
    plan = plan_stages(model, layers, pp=case.pp, chunks=1, pp_rank=0)
    return [sum(p.numel() for layer in layers[start:stop] for p in layer.parameters()) for start, stop in plan.ranges]


def _stage_layers(a: argparse.Namespace, case: Case) -> list[tuple[int, bool, bool]]:
    """(blocks, has the embedding, has the head) of each pipeline stage."""
    from lightning_parallel.parallel.pipeline import stage_ranges

    n = a.layers + 2
    return [(len([i for i in range(start, stop) if 0 < i < n - 1]), start == 0, stop == n)
            for start, stop in stage_ranges(n, case.pp)]


def states_formula(a: argparse.Namespace, case: Case) -> int:
    """Model-state bytes of the busiest rank by the ZeRO paper's formulas (fp32 AdamW: 4 + 4 + 8 per parameter)."""
    from lightning_parallel.planner.memory import model_states
    from lightning_parallel.planner.settings import StateBytes

    if case.key == "dp":
        return 0
    n = _local_params(a, case)
    # measured at the end of a step: at rest, FSDP2 inside pipeline stages holds everything sharded too
    s = model_states(n, StateBytes(param=4, grad=4, optimizer=8), dp=case.dp, zero_stage=case.zero,
                     offload=case.offload, shard=case.shard or None)
    return s.device + s.host


def comm_theory(a: argparse.Namespace, case: Case, role: str = "ours") -> dict[str, float]:
    """Bytes one rank sends per step by axis (ring model): the technique's textbook figure. The library's strategies
    (``role="ours"``) also average the logged training loss over the replicas (dp, or dp x cp), so that the logged
    curve is one device's; the hand loops and Lightning's strategies log each rank's own value and do not. That value
    rides in the non-finite-loss guard's per-batch all-reduce over the whole world (under tensor and pipeline
    parallelism too), control traffic in place of Lightning's broadcast, not counted: the same bytes for every
    role."""
    out: dict[str, float] = {}
    psi = _local_params(a, case) * 4
    d, b, s, h = case.dp, a.batch // case.dp, a.seq, a.hidden
    if d > 1 and case.key == "dp":  # lp_dp, through device 0: the weights out to and the gradients back from each of
        # the N-1 other replicas, and their share of the token ids (inputs and targets, int64); the outputs and the
        # loss gradient sent back are a few bytes each (docs/formulas.md, "DP versus DDP")
        out["dp"] = 2 * (d - 1) * psi + (d - 1) / d * a.batch * s * 8 * 2
    elif d > 1 and case.shard:  # HSDP: ZeRO-3 inside each shard group (the head gathered once, kept into its
        # backward), the gradient shards all-reduced across
        s, r = case.shard, d // case.shard
        out["dp_shard"] = (3 * psi - 4 * _head_params(a, case)) * (s - 1) / s
        out["dp_replicate"] = 2 * (r - 1) / r * psi / s
    elif d > 1 and case.pp > 1 and case.zero >= 2:  # FSDP2 per stage: one reduce-scatter per step; all-gathers:
        # m + 1 on a stage that reshards after forward (every stage but the last under 1F1B), else 1
        per_stage = _stage_params(a, case)
        m = a.micro_batches
        out["dp"] = max(((m + 1 if i < len(per_stage) - 1 and case.zero == 3 else 1) + 1) * n * 4
                        for i, n in enumerate(per_stage)) * (d - 1) / d
    elif d > 1 and case.zero == 3:  # all-gather in forward and in backward, reduce-scatter; the head gathered once
        out["dp"] = (3 * psi - 4 * _head_params(a, case)) * (d - 1) / d
    elif d > 1:  # DDP's all-reduce, ZeRO-1/2's reduce-scatter and all-gather: 2 Psi
        out["dp"] = 2 * (d - 1) / d * psi
    if case.tp > 1:  # per micro-batch on each stage, x = (t-1)/t (b/m) s h 4; the busiest stage
        m = a.micro_batches if case.pp > 1 else 1
        x = (case.tp - 1) / case.tp * (b // m) * s * h * 4
        loss = 3 * ring_bytes("all_reduce", full_bytes=(b // m) * s * 4, world_size=case.tp)
        stages = []
        for blocks, embed, head in _stage_layers(a, case):
            stages.append(8 * blocks * x + (2 * x if embed else 0.0) + (2 * x + loss if head else 0.0))
        out["tp"] = m * max(stages)
    if case.pp > 1:  # each micro-batch's activation forward, its gradient backward: b s h 4 per step each way
        out["pp"] = float(b * s * h * 4)
    if case.cp > 1:  # ring attention per layer: k and v (2 b (s/cp) h, fp32) cp - 1 hops forward, cp - 1 again
        # backward plus the dk/dv accumulator (fp32) cp hops; then the DDP all-reduce over dp x cp
        c = case.cp
        block = 2 * b * (s // c) * h * 4
        out["cp"] = a.layers * ((c - 1) + (c - 1) + c) * block
        replicas = d * c
        key = "cp" if d == 1 else "dp_cp"  # with dp = 1 the replicas' group is the cp group
        out[key] = out.get(key, 0.0) + 2 * (replicas - 1) / replicas * psi
        out.pop("dp", None)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(a: argparse.Namespace, case: Case, reps: list[dict[str, dict[str, Any]]],
              counted: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per role: medians, paired ratios, memory and traffic."""
    rows = []
    roles = [r for r in reps[0] if "error" not in reps[0][r]] if reps else []
    for role in reps[0] if reps else []:
        row: dict[str, Any] = {"case": case.name, "key": case.key, "dp": case.dp, "world": case.world,
                               "title": case.title, "role": role}
        runs = [rep[role] for rep in reps]
        failed = next((r for r in runs if "error" in r), None)
        if failed is not None:
            row["error"] = failed["error"].strip().splitlines()[-1][:300]
            row["error_full"] = failed["error"]
            rows.append(row)
            continue
        per_rep = [median(run["ranks"][0]["step_s"]) for run in runs]
        row["step_s_reps"] = per_rep
        row["step_s"] = median(per_rep)
        row["tokens_per_s"] = a.batch * a.seq / row["step_s"]
        row["cpu_s_reps"] = [median(run["ranks"][0]["cpu_s"]) for run in runs]
        row["cpu_s"] = median(row["cpu_s_reps"])
        for anchor in ("torch", "lightning"):
            if anchor == role or role != "ours" or anchor not in roles:
                continue
            for key, prefix in (("step_s", "x"), ("cpu_s", "cpu_x")):  # paired: the same repetition's runs
                ratios = [median(run["ranks"][0][key]) / median(rep[anchor]["ranks"][0][key])
                          for run, rep in zip(runs, reps, strict=True)]
                row[f"{prefix}_{anchor}"] = median(ratios)
                row[f"{prefix}_{anchor}_reps"] = ratios
        ranks = runs[-1]["ranks"]
        last_pp = case.pp - 1
        losses = [r["losses"] for r in ranks if r["coords"][1] == last_pp and r["coords"][2] == 0]
        steps = len(losses[0]) if losses else 0
        row["losses"] = [sum(ls[i] for ls in losses) / len(losses) for i in range(steps)] if losses else []
        row["peak_bytes"] = max(r["peak_bytes"] for r in ranks)
        if a.device == "cpu":
            row["peak_growth_bytes"] = max(r["peak_bytes"] - r["start_bytes"] for r in ranks)
        count = counted.get(role)
        if count is not None and "error" not in count:
            states = [sum(r["states"].values()) for r in count["ranks"] if r.get("states")]
            row["states_bytes"] = max(states) if states else None
            row["states_detail"] = max((r["states"] for r in count["ranks"] if r.get("states")),
                                       key=lambda s: sum(s.values()), default=None)
            comm: dict[str, float] = defaultdict(float)
            for r in count["ranks"]:
                for axis, v in r.get("comm", {}).items():
                    comm[axis] = max(comm[axis], v)
            row["comm"] = dict(comm)
            row["comm_calls"] = count["ranks"][0].get("comm_calls", {})
        elif count is not None:
            row["count_error"] = count["error"].strip().splitlines()[-1][:300]
        row["states_formula"] = states_formula(a, case)
        row["comm_theory"] = comm_theory(a, case, role)
        rows.append(row)
    torch_row = next((r for r in rows if r["role"] == "torch" and "losses" in r), None)
    for row in rows:
        if torch_row is not None and row is not torch_row and row.get("losses"):
            row["dloss"] = max(abs(x - y) for x, y in zip(row["losses"], torch_row["losses"], strict=False))
    return rows


def case_of(row: dict[str, Any]) -> Case:
    """The case a row measured (rows written before ``--dp`` carry only the case's key)."""
    case = CASES[row.get("key", row["case"])]
    return case.with_dp(row["dp"]) if case.scalable and "dp" in row else case


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _comm_text(comm: dict[str, float]) -> str:
    shown = [f"{axis} {v / 2**20:.2f}" for axis, v in sorted(comm.items()) if v > 0]
    return ", ".join(shown) if shown else "0"


def _ratio_text(row: dict[str, Any], anchor: str, prefix: str = "x") -> str:
    """``1.013 (0.98-1.04)``: the median paired ratio and the range over repetitions."""
    key = f"{prefix}_{anchor}"
    if key not in row:
        return "-"
    reps = row.get(f"{key}_reps") or [row[key]]
    return f"{row[key]:.3f} ({min(reps):.2f}-{max(reps):.2f})"


def table(a: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    memory = "peak RSS MB (growth)" if a.device == "cpu" else "peak alloc MB"
    head = (f"| case | variant | step ms | x torch | x Lightning | CPU ms/step | CPU x torch | CPU x Lightning | "
            f"tokens/s | states MB/rank (formula) | sent MB/step/rank by axis (theory) | {memory} | dloss vs torch |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        case = case_of(r)
        name = {"ours": case.title, "torch": f"torch: {case.anchor}",
                "lightning": f"Lightning `{lightning_name(case, a.device)}`"}[r["role"]]
        if "error" in r:
            lines.append(f"| {case.name} | {name} | failed: {r['error']} |" + " |" * 10)
            continue
        xt = _ratio_text(r, "torch")
        xl = _ratio_text(r, "lightning") if "x_lightning" in r else ("-" if r["role"] != "ours" else
                                                                     (case.lightning_missing or "-"))
        theory = _comm_text(r["comm_theory"])
        comm = _comm_text(r["comm"]) if "comm" in r else r.get("count_error", "-")
        peak = f"{r['peak_bytes'] / 2**20:.0f}"
        if "peak_growth_bytes" in r:
            peak += f" ({r['peak_growth_bytes'] / 2**20:+.0f})"
        dloss = f"{r['dloss']:.1e}" if "dloss" in r else "-"
        formula = _mb(r["states_formula"]) if r["states_formula"] else "-"
        cpu = f"{r['cpu_s'] * 1e3:.1f}" if "cpu_s" in r else "-"
        lines.append(f"| {case.name} | {name} | {r['step_s'] * 1e3:.1f} | {xt} | {xl} | {cpu} | "
                     f"{_ratio_text(r, 'torch', 'cpu_x')} | {_ratio_text(r, 'lightning', 'cpu_x')} | "
                     f"{r['tokens_per_s']:.0f} | "
                     f"{_mb(r.get('states_bytes'))} ({formula}) | {comm} ({theory}) | {peak} | {dloss} |")
    return "\n".join(lines)


def plots(a: argparse.Namespace, rows: list[dict[str, Any]], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ours = [r for r in rows if r["role"] == "ours" and "step_s" in r]
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(ours))
    for offset, anchor, colour in ((-0.2, "torch", "tab:blue"), (0.2, "lightning", "tab:orange")):
        values = [r.get(f"x_{anchor}", math.nan) for r in ours]
        ax.bar([x + offset for x in xs], values, width=0.4, color=colour,
               label=f"library / {'hand-written torch' if anchor == 'torch' else 'Lightning built-in'}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.03, color="grey", lw=0.8, ls="--", label="+3%")
    ax.set_xticks(list(xs), [r["case"] for r in ours])
    ax.set_ylabel("step-time ratio (median of reps)")
    ax.set_title(f"lightning-parallel vs anchors ({a.device}, GPT {a.layers}x{a.hidden}, batch {a.batch}x{a.seq})")
    written.append(_save(fig, ax, folder / "step_time_ratios.png"))

    fig, ax = plt.subplots(figsize=(10, 4))
    measured = [r for r in rows if r.get("states_bytes")]
    labels = [f"{r['case']}\n{r['role']}" for r in measured]
    ax.bar(range(len(measured)), [r["states_bytes"] / 2**20 for r in measured], color="tab:green",
           label="measured (busiest rank)")
    ax.scatter(range(len(measured)), [r["states_formula"] / 2**20 for r in measured], color="black", marker="_",
               s=400, label="ZeRO / Megatron formula", zorder=3)
    ax.set_xticks(range(len(measured)), labels, fontsize=7)
    ax.set_ylabel("model states per rank (MB)")
    written.append(_save(fig, ax, folder / "memory_per_rank.png"))
    return written


def _save(fig: Any, ax: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path




def split_text(prof: dict[str, Any]) -> str:
    if "wall_ms" not in prof:
        return "-"
    calls = f"; {prof['aten_calls']:.0f} aten op calls/step" if "aten_calls" in prof else ""
    return (f"{prof['wall_ms']:.1f} ms/step = compute {prof['compute_ms']:.1f} + collectives "
            f"{prof['collectives_ms']:.1f} + other {prof['other_ms']:.1f}{calls}")



def split_table(rows: list[dict[str, Any]]) -> str:
    """Where the time goes, for the cases :func:`where_time_goes` profiled (ms per step, rank 0)."""
    shown = [r for r in rows if "split" in r]
    if not shown:
        return ""
    lines = ["| case | variant | profiled step ms | compute (aten ops) | collectives | other: Python, dispatch, "
             "framework | other vs torch | aten op calls/step |", "|---|---|---|---|---|---|---|---|"]
    for r in shown:
        sp = r["split"]
        torch_row = next((t for t in shown if t["case"] == r["case"] and t["role"] == "torch"), None)
        delta = ("-" if torch_row is None or torch_row is r
                 else f"{sp['other_ms'] - torch_row['split']['other_ms']:+.1f}")
        calls = f"{sp['aten_calls']:.0f}" if "aten_calls" in sp else "-"
        lines.append(f"| {r['case']} | {r['role']} | {sp['wall_ms']:.1f} | {sp['compute_ms']:.1f} | "
                     f"{sp['collectives_ms']:.1f} | {sp['other_ms']:.1f} | {delta} | {calls} |")
    return "\n".join(lines)


GOAL_X_LIGHTNING = 1.02
"""The library at most this much slower than Lightning's built-in of the same technique."""
GOAL_X_LOOP = 1.05
"""The library at most this much slower than the hand-written loop plus Lightning's own per-step cost."""


def _reps_ms(run: dict[str, Any], key: str) -> list[float]:
    """A variant's per-repetition medians in ms (``step_s`` or ``cpu_s``; an older run kept only the median)."""
    reps = run.get(f"{key}_reps") or ([run[key]] * len(run.get("step_s_reps", [])) if key in run else [])
    return [x * 1e3 for x in reps]


def row_world(row: dict[str, Any]) -> int:
    """The ranks a row's case ran on (a run written before rows kept it: from the case at the row's dp size)."""
    if "world" in row:
        return int(row["world"])
    case = CASES.get(row.get("key", row["case"]))
    return DEFAULT_DP if case is None else dataclasses.replace(case, dp=row.get("dp", case.dp)).world


def lightning_loop_ms(rows: list[dict[str, Any]], key: str = "step_s", world: int = DEFAULT_DP) -> list[float]:
    """Lightning's own cost per step on ``world`` ranks, one figure per repetition: its ``ddp`` minus torch DDP at
    that data-parallel size."""
    ddp = {r["role"]: r for r in rows if r.get("key", r["case"]) == "ddp" and "error" not in r
           and r.get("dp", DEFAULT_DP) == world}
    if "torch" not in ddp or "lightning" not in ddp:
        return []
    pairs = zip(_reps_ms(ddp["lightning"], key), _reps_ms(ddp["torch"], key), strict=False)
    return [lt - t for lt, t in pairs]


def _goal_cells(ours: dict[str, Any], torch_run: dict[str, Any], loop: list[float], key: str) -> str:
    """``ours ms | torch + loop ms | x (torch + loop) | own ms`` for one measure (wall or CPU), paired by repetition."""
    o, t = _reps_ms(ours, key), _reps_ms(torch_run, key)
    n = min(len(o), len(t), len(loop))
    if n == 0:
        return "- | - | - | -"
    o, t, lp = o[:n], t[:n], loop[:n]
    x_loop = median([oi / (ti + li) for oi, ti, li in zip(o, t, lp, strict=True)])
    own = median([oi - ti - li for oi, ti, li in zip(o, t, lp, strict=True)])
    mark = "yes" if x_loop <= GOAL_X_LOOP else "**no**"
    return f"{median(o):.1f} | {median(t) + median(lp):.1f} | {x_loop:.3f} {mark} | {own:+.1f}"


def _loop_text(wall: list[float], cpu: list[float]) -> str:
    return (f"**{median(wall):.1f} ms** by the wall clock ({', '.join(f'{x:.1f}' for x in wall)}), "
            f"**{median(cpu):.1f} ms** of CPU time")


def goals_table(rows: list[dict[str, Any]]) -> str:
    """The per-step overhead goals: each case against Lightning's built-in and against torch + Lightning's loop.

    Paired by repetition (the same repetition's runs), then the median over repetitions; by the wall clock and by
    rank 0's CPU time (blind to other processes taking the cores). ``own ms`` is the library's step minus the hand
    loop's minus Lightning's loop cost: what the library adds on top of both. Lightning's loop cost is the one
    measured on as many ranks as the case (``ddp-dpN`` rows, :func:`~_bench.cases.loop_cases`), else the one of
    the default two ranks (said under the table).
    """
    loops = {DEFAULT_DP: (lightning_loop_ms(rows), lightning_loop_ms(rows, "cpu_s"))}
    if not loops[DEFAULT_DP][0]:
        return ""
    for w in sorted({row_world(r) for r in rows} - {DEFAULT_DP}):
        wall = lightning_loop_ms(rows, world=w)
        if wall:
            loops[w] = (wall, lightning_loop_ms(rows, "cpu_s", w))
    more = [f"on {w} ranks {_loop_text(*v)}" for w, v in loops.items() if w != DEFAULT_DP]
    sizes = (f" on {DEFAULT_DP} ranks; {'; '.join(more)}. Each case is compared with the cost on as many ranks as it "
             "runs on." if more else ".")
    lines = [f"Lightning's own per-step cost, its `ddp` minus torch DDP (median of the repetitions): "
             f"{_loop_text(*loops[DEFAULT_DP])}{sizes}", "",
             f"| case | ours ms | torch + loop ms | x (torch + loop) (goal <= {GOAL_X_LOOP}) | library's own ms | "
             f"x Lightning (goal <= {GOAL_X_LIGHTNING}) | CPU: ours ms | CPU: torch + loop ms | "
             f"CPU: x (torch + loop) | CPU: library's own ms | CPU: x Lightning |", "|---|" + "---|" * 10]
    by_case: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        if "error" not in r and "step_s_reps" in r:
            by_case[r["case"]][r["role"]] = r
    borrowed: list[str] = []
    for name, roles in by_case.items():
        ours, torch_run = roles.get("ours"), roles.get("torch")
        if ours is None or torch_run is None:
            continue
        world = row_world(ours)
        wall, cpu = loops.get(world, loops[DEFAULT_DP])
        if world not in loops and world != 1:
            borrowed.append(f"{name} ({world} ranks)")
        cells = []
        for key, prefix in (("step_s", "x"), ("cpu_s", "cpu_x")):
            x = ours.get(f"{prefix}_lightning")
            xl = "-" if x is None else f"{x:.3f} " + ("yes" if x <= GOAL_X_LIGHTNING else "**no**")
            cells.append(f"{_goal_cells(ours, torch_run, wall if key == 'step_s' else cpu, key)} | {xl}")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    if borrowed:
        lines += ["", f"Compared with Lightning's cost on {DEFAULT_DP} ranks (no `ddp` on as many ranks in this run): "
                  f"{', '.join(borrowed)}."]
    return "\n".join(lines)


def render(path: Path) -> None:
    """The table and the plots of an earlier run, from its ``results.json`` (written next to it); a ``--predict`` run
    that kept its calibrations (``start_rates``, ``case_rates``) gets its predicted tables again from them, with the
    step-time model of this checkout."""
    data = json.loads(path.read_text())
    a = argparse.Namespace(**{**data["args"], "profile": None})
    rows = data["rows"]
    text = markdown(a, rows, data.get("header", ""), data.get("skipped", {}))
    if data["args"].get("predict") and "start_rates" in data:
        from lightning_parallel.planner.rates import rates_from_dict

        from .predict import predicted_section

        case_rates = {k: rates_from_dict(v) for k, v in data.get("case_rates", {}).items()}
        section, _ = predicted_section(a, rows, case_rates=case_rates, start=rates_from_dict(data["start_rates"]))
        text += ("\n\n" + section + "\n\n(Predicted tables rendered again with `--render`: the step-time model of "
                 "the checkout that rendered them, on the calibrations this run kept.)")
    (path.parent / "results.md").write_text(text)
    written = plots(a, rows, path.parent)
    print(f"{text}\n[bench] wrote {path.parent / 'results.md'}, {', '.join(str(p) for p in written)}")


def markdown(a: argparse.Namespace, rows: list[dict[str, Any]], header: str, skipped: dict[str, str]) -> str:
    """``results.md``: the header, the table, where the time goes (cases above 3 %), the skipped cases."""
    text = f"{header}\n\n{table(a, rows)}\n"
    goals = goals_table(rows)
    if goals:
        text += f"\nPer-step overhead against the goals (paired by repetition, medians):\n\n{goals}\n"
    split = split_table(rows)
    if split:
        text += ("\nWhere the time goes, for the cases above 3 % (rank 0, torch.profiler over the timed steps of one "
                 "more run of each variant; compute = self time of aten ops, collectives = c10d and functional "
                 f"collective ops with their waits, other = the rest of the wall time):\n\n{split}\n")
    if skipped:
        text += "\n" + "\n".join(f"- {k}: skipped, {v}" for k, v in skipped.items()) + "\n"
    return text


