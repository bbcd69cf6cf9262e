"""``--study bubble``: pipeline bubbles and activation memory, measured: each rank's busy and idle time per step
under the four schedules next to the textbook bubble ``bubble_fraction(schedule, p, m, v)``, the peak number of
micro-batches in flight per rank (and the peak bytes autograd keeps saved for backward), and the step time against one
process on the same global batch. Writes ``bubble.md``, ``bubble.json`` (every rank, every step) and ``bubble.png``
(measured idle fraction against the formula).

    python benchmarks/bench.py --study bubble [--layers 8 --hidden 128 --heads 4 --seq 64 --batch 32 --steps 6]
    python benchmarks/bench.py --study bubble --quick            # p=2 only, m in {p, 2p}, 2 timed steps
    python benchmarks/bench.py --study bubble --pp 2 --m-factors 1,2,4,8 --schedules 1f1b,interleaved_1f1b

No Lightning: the reference GPT is cut with ``plan_stages`` + ``prune_to`` and run by ``PipelineRunner`` on gloo
ranks forked by ``run_distributed`` (``--threads`` per rank, default one: a "device" is one core), AdamW after
each step. Schedules: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` (v=2 chunks per rank), ``zero_bubble`` (v=1); p = 2
and 4; m in {p, 2p, 4p} micro-batches of one fixed global batch (``--pp``, ``--m-factors``, ``--schedules``;
combinations ``check_micro_batches`` refuses are skipped with a note). Each configuration runs one untimed warm-up
step (torch's shape inference), ``--steps`` timed steps and one more step that only measures saved-activation bytes
(its hooks cost time, so it is not timed).

Busy time: this study wraps torch's ``PipelineStage.forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk`` (and the loss function, which the schedules call outside them) with
``time.perf_counter`` accumulators; a step's wall time is the rank's ``train_step`` from a common start (a barrier);
idle = wall - busy (waiting for p2p messages, the schedule's own bookkeeping, the loss broadcast). In flight:
forwards done minus backwards completed (a full backward, or zero bubble's deferred weight backward; its
input-gradient half keeps the graph alive), the max over a step, per rank (summed over a rank's chunks). Saved
bytes: ``torch.autograd.graph.saved_tensors_hooks`` tracking the storages autograd holds for backward (parameters
excluded), their peak over a step.

A machine with fewer cores than ranks (p=4 on 2 cores) runs oversubscribed: ranks share cores, compute stretches
while another rank runs, and those timings are contended -- the table marks them ``*``. The CPU time a rank got
while computing, over the wall time it spent there ("busy cpu/wall"), shows contention: rows below 0.9 with no more
ranks than cores are marked ``+`` (other processes took the cores) and drawn with open markers. A lower idle
fraction is not a shorter step when busy time grows (torch's zero-bubble split of the backward into input and weight
halves costs more compute than one full backward on CPU): read the step-time column next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.config import check_micro_batches
from lightning_parallel.models import GPT
from lightning_parallel.parallel.pipeline import (
    PipelineRunner,
    bubble_fraction,
    plan_stages,
    prune_to,
)
from lightning_parallel.testing import run_distributed

SCHEDULE_CHUNKS: dict[str, int] = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 1}
PRESETS: dict[str, dict[str, Any]] = {  # over the table's presets: enough layers for p x v = 8 stages
    "default": dict(layers=8, hidden=128, heads=4, seq=64, vocab=256, batch=32, steps=6),
    "quick": dict(layers=8, hidden=128, heads=4, seq=64, vocab=256, batch=32, steps=2),
}
CONTENDED = 0.9  # busy cpu/wall below this without oversubscription: other processes took the cores
PATCHED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


# ---------------------------------------------------------------------------------------------- measuring
class _Meter:
    """Busy-time accumulators and the in-flight count of one rank, fed by the wrapped stage methods."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.cpu = 0.0
        self.depth = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.calls: dict[str, int] = {}
        self.events: list[tuple[str, int, int, float, float]] = []
        self.origin = 0.0

    def start_step(self) -> None:
        self.in_flight, self.events, self.origin = 0, [], time.perf_counter()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(stage: Any, *args: Any, **kwargs: Any) -> Any:
            if self.depth:  # a wrapped call inside another: counted by the outer one
                return fn(stage, *args, **kwargs)
            self.depth += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(stage, *args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.depth -= 1
                self.busy += t1 - t0
                self.cpu += time.thread_time() - c0
                self.calls[name] = self.calls.get(name, 0) + 1
                mb = int(args[0]) if args else int(kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1)))
                self.events.append((name, int(getattr(stage, "stage_index", -1)), mb, t0 - self.origin,
                                    t1 - self.origin))
                self._count(name, args, kwargs)

        return timed

    def _count(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name == "forward_one_chunk":
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        elif name == "backward_weight_one_chunk":
            self.in_flight -= 1
        elif name == "backward_one_chunk":
            full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
            if full:
                self.in_flight -= 1

    @contextmanager
    def patched(self) -> Iterator[None]:
        """Wrap the torch ``PipelineStage`` methods in this process for the duration (restored after)."""
        from torch.distributed.pipelining import PipelineStage

        saved = {name: PipelineStage.__dict__.get(name) for name in PATCHED}
        try:
            for name in PATCHED:
                setattr(PipelineStage, name, self.wrap(name, getattr(PipelineStage, name)))
            yield
        finally:
            for name, own in saved.items():
                if own is None:
                    delattr(PipelineStage, name)
                else:
                    setattr(PipelineStage, name, own)


class _Held:
    """What the pack hook stores in the graph instead of a tensor: the tensor, and a release when the graph drops it."""

    __slots__ = ("key", "owner", "tensor")

    def __init__(self, owner: _SavedBytes, key: int, tensor: Tensor) -> None:
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self) -> None:
        self.owner.release(self.key)


class _SavedBytes:
    """Bytes of the distinct storages autograd holds saved for backward (parameters excluded): now and peak."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.current = 0
        self.peak = 0

    def pack(self, t: Tensor) -> Any:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        key = storage.data_ptr()
        if key in self.exclude or key == 0:
            return t
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        # hold a detached alias: keeping ``t`` itself would make a saved output point at its own grad_fn (a cycle
        # through C++ that gc cannot see), leaking whatever a retain_graph=True backward leaves unreleased
        return _Held(self, key, t.detach())

    @staticmethod
    def unpack(held: Any) -> Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    @contextmanager
    def tracking(self) -> Iterator[None]:
        self.peak = self.current
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


# ---------------------------------------------------------------------------------------------- the runs
def _model(cfg: dict[str, Any]) -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=cfg["layers"], n_head=cfg["heads"], n_embd=cfg["hidden"], block_size=cfg["seq"],
               vocab_size=cfg["vocab"], bias=True, warmup_steps=2)


def _batch(cfg: dict[str, Any]) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    return x, y


def _param_ptrs(model: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _one_process(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The whole model on one rank: forward + backward of the whole batch, AdamW."""
    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(cfg)

    def step() -> float:
        opt.zero_grad()
        loss = model.pipeline_loss(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    step()  # warm-up
    times, cpu = [], 0.0
    for _ in range(max(5, cfg["steps"])):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu += time.thread_time() - c0
    saved = _SavedBytes(_param_ptrs(model))
    with saved.tracking():
        step()
    return {"step_s": statistics.median(times), "steps_s": times, "cpu_over_wall": cpu / sum(times),
            "saved_bytes_peak": saved.peak}


def _pipeline_rank(rank: int, world: int, cfg: dict[str, Any], schedule: str, m: int) -> dict[str, Any]:
    v = SCHEDULE_CHUNKS[schedule]
    model = _model(cfg)
    plan = plan_stages(model, model.pipeline_layers(), pp=world, chunks=v, pp_rank=rank)
    chunks = prune_to(model, plan)
    meter = _Meter()

    def loss_fn(output: Tensor, target: Tensor) -> Tensor:  # the schedules call it outside the stage methods
        meter.depth += 1
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return model.pipeline_loss(output, target)
        finally:
            meter.depth -= 1
            meter.busy += time.perf_counter() - t0
            meter.cpu += time.thread_time() - c0

    group = dist.new_group(list(range(world)))
    runner = PipelineRunner(list(zip(plan.my_stages, chunks, strict=True)), num_stages=plan.num_stages,
                            schedule=schedule, num_micro_batches=m, group=group, group_ranks=list(range(world)),
                            device=torch.device("cpu"), loss_fn=loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(cfg)
    walls, steps, busys, cpus, step_cpus, peaks, left = [], [], [], [], [], [], []
    events: list[tuple[str, int, int, float, float]] = []
    saved = _SavedBytes(_param_ptrs(model))
    with meter.patched():
        for i in range(cfg["steps"] + 2):  # warm-up, timed steps, the saved-bytes step
            measure_bytes = i == cfg["steps"] + 1
            dist.barrier()
            opt.zero_grad()
            busy0, cpu0 = meter.busy, meter.cpu
            meter.peak_in_flight = 0
            meter.start_step()
            t0, c0 = time.perf_counter(), time.thread_time()
            if measure_bytes:
                with saved.tracking():
                    runner.train_step(x, y)
            else:
                runner.train_step(x, y)
            t1, c1 = time.perf_counter(), time.thread_time()
            opt.step()
            t2 = time.perf_counter()
            if 0 < i <= cfg["steps"]:
                walls.append(t1 - t0)
                steps.append(t2 - t0)
                busys.append(meter.busy - busy0)
                cpus.append(meter.cpu - cpu0)
                step_cpus.append(c1 - c0)
                peaks.append(meter.peak_in_flight)
                left.append(meter.in_flight)
                events = list(meter.events)
    wall, busy = sum(walls), sum(busys)
    return {"rank": rank, "stages": plan.my_stages, "layers": plan.kept, "wall_s": wall / len(walls),
            "step_s": statistics.median(steps), "steps_s": steps, "busy_s": busy / len(busys),
            "busy_cpu_s": sum(cpus) / len(cpus), "wall_cpu_s": sum(step_cpus) / len(step_cpus),
            "idle_fraction": (wall - busy) / wall,
            "peak_in_flight": max(peaks), "in_flight_left": max(left, key=abs), "calls": meter.calls,
            "saved_bytes_peak": saved.peak, "timeline_last_step": events}


def _run_config(cfg: dict[str, Any], p: int, schedule: str, m: int) -> dict[str, Any]:
    ranks = run_distributed(_pipeline_rank, p, cfg, schedule, m, timeout_s=600)
    v = SCHEDULE_CHUNKS[schedule]
    idle = [r["idle_fraction"] for r in ranks]
    return {"p": p, "schedule": schedule, "v": v, "m": m, "micro_batch": cfg["batch"] // m,
            "formula": bubble_fraction(schedule, p=p, m=m, v=v),
            "idle_mean": sum(idle) / len(idle), "idle_max": max(idle),
            "step_s": statistics.median(max(step) for step in zip(*(r["steps_s"] for r in ranks), strict=True)),
            "wall_s": max(r["wall_s"] for r in ranks),
            "oversubscribed": p > (os.cpu_count() or 1), "ranks": ranks}


# ---------------------------------------------------------------------------------------------- output
def _table(rows: list[dict[str, Any]], base_s: float) -> str:
    lines = ["| p | schedule | v | m | step ms | vs 1 process | idle measured: mean / max | formula | busy ms per "
             "rank | busy cpu/wall | in flight per rank (peak) | saved activations MiB per rank (peak) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ranks = r["ranks"]
        busy = ", ".join(f"{1000 * k['busy_s']:.0f}" for k in ranks)
        cpu = sum(k["busy_cpu_s"] for k in ranks) / max(1e-12, sum(k["busy_s"] for k in ranks))
        flight = ", ".join(str(k["peak_in_flight"]) for k in ranks)
        mib = ", ".join(f"{k['saved_bytes_peak'] / 2**20:.1f}" for k in ranks)
        over = " *" if r["oversubscribed"] else (" +" if cpu < CONTENDED else "")
        lines.append(f"| {r['p']}{over} | {r['schedule']} | {r['v']} | {r['m']} | {1000 * r['step_s']:.0f} | "
                     f"{base_s / r['step_s']:.2f}x | {r['idle_mean']:.3f} / {r['idle_max']:.3f} | "
                     f"{r['formula']:.3f} | {busy} | {cpu:.2f} | {flight} | {mib} |")
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = sorted({r["p"] for r in rows})
    fig, axes = plt.subplots(1, len(ps), figsize=(5.6 * len(ps), 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, p in zip(axes[0], ps, strict=True):
        # schedules whose formula curves coincide (gpipe, 1f1b, zero bubble's upper bound) share one dashed line
        formulas: dict[tuple[tuple[int, float], ...], list[tuple[str, str, int]]] = {}
        for i, schedule in enumerate(SCHEDULE_CHUNKS):
            pts = sorted((r for r in rows if r["p"] == p and r["schedule"] == schedule), key=lambda r: r["m"])
            if not pts:
                continue
            color = colors[i % len(colors)]
            label = schedule + (f" (v={pts[0]['v']})" if pts[0]["v"] > 1 else "")
            ax.plot([r["m"] for r in pts], [r["idle_mean"] for r in pts], "o-", color=color, label=f"{label} measured")
            shared = [r for r in pts if r.get("flag")]  # contended by other processes: open markers
            ax.plot([r["m"] for r in shared], [r["idle_mean"] for r in shared], "o", color=color,
                    markerfacecolor="white")
            formulas.setdefault(tuple((r["m"], r["formula"]) for r in pts), []).append((label, color, pts[0]["v"]))
        for curve, users in formulas.items():
            color = users[0][1] if len(users) == 1 else "black"
            expr = "(p-1)/(vm+p-1)" if users[0][2] > 1 else "(p-1)/(m+p-1)"
            ax.plot([m for m, _ in curve], [f for _, f in curve], "--", color=color, alpha=0.7,
                    label=f"formula {expr}: " + " = ".join(label for label, _, _ in users))
        over = " (oversubscribed: p ranks > cores)" if p > (os.cpu_count() or 1) else ""
        ax.set_title(f"p = {p}{over}", fontsize=10)
        ax.set_xlabel("micro-batches m (fixed global batch)")
        ax.set_ylabel("idle fraction of a step (mean over ranks)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["m"] for r in rows if r["p"] == p}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if any(r.get("flag") for r in rows if r["p"] == p):
            ax.plot([], [], "o", color="gray", markerfacecolor="white", label="open: contended by other processes")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(a: argparse.Namespace, folder: Path, header: str) -> int:
    """The sweep over ``--pp`` x ``--schedules`` x ``--m-factors``: ``bubble.md``, ``bubble.json``, ``bubble.png``."""
    worlds = a.pp or ([2] if a.quick else [2, 4])
    factors = a.m_factors or ([1, 2] if a.quick else [1, 2, 4])
    schedules = a.schedules.split(",") if a.schedules else list(SCHEDULE_CHUNKS)
    unknown = sorted(set(schedules) - set(SCHEDULE_CHUNKS))
    if unknown:
        print(f"bench.py: error: --schedules: unknown {unknown}; choose from {list(SCHEDULE_CHUNKS)}")
        return 2
    torch.set_num_threads(a.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    cfg = {k: getattr(a, k) for k in ("layers", "hidden", "heads", "vocab", "seq", "batch", "steps")}
    cores = os.cpu_count() or 1

    plan: list[tuple[int, str, int]] = []
    notes: list[str] = []
    for p in worlds:
        for schedule in schedules:
            for m in sorted({f * p for f in factors}):
                why = check_micro_batches(schedule, p=p, m=m)
                if why is None and schedule == "1f1b" and m < p:  # torch's Schedule1F1B; check_micro_batches misses it
                    why = f"torch's Schedule1F1B needs m >= p stages ({m} < {p})"
                if why is None and a.batch % m:
                    why = f"the global batch {a.batch} does not split into {m} equal micro-batches"
                if why is None and p * SCHEDULE_CHUNKS[schedule] > a.layers + 2:
                    why = f"{p * SCHEDULE_CHUNKS[schedule]} stages need at least that many layers"
                if why is not None:
                    notes.append(f"skipped p={p} {schedule} m={m}: {why}")
                    print(f"note: {notes[-1]}", flush=True)
                    continue
                plan.append((p, schedule, m))

    psi = sum(t.numel() for t in _model(cfg).parameters())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"GPT {a.layers} x {a.hidden} ({psi:,} parameters), vocab {a.vocab}, global batch {a.batch} x seq {a.seq}, "
          f"fp32 AdamW; {len(plan)} pipeline configurations, 1 warm-up + {a.steps} timed steps each; {cores} cores, "
          f"one thread per rank (load average {load:.2f} at start)", flush=True)
    started = time.perf_counter()
    base_runs = [run_distributed(_one_process, 1, cfg, timeout_s=600)[0]]
    print(f"[one process] step {1000 * base_runs[0]['step_s']:.0f} ms, cpu/wall {base_runs[0]['cpu_over_wall']:.2f}  "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    rows: list[dict[str, Any]] = []
    for k, (p, schedule, m) in enumerate(plan, 1):
        row = _run_config(cfg, p, schedule, m)
        rows.append(row)
        flight = [r["peak_in_flight"] for r in row["ranks"]]
        print(f"[{k}/{len(plan)}] p={p} {schedule} v={row['v']} m={m}: step {1000 * row['step_s']:.0f} ms, idle "
              f"{row['idle_mean']:.3f} mean / {row['idle_max']:.3f} max (formula {row['formula']:.3f}), in flight "
              f"{flight}  ({time.perf_counter() - started:.0f} s)", flush=True)
    base_runs.append(run_distributed(_one_process, 1, cfg, timeout_s=600)[0])
    base_s = sum(r["step_s"] for r in base_runs) / len(base_runs)
    elapsed = time.perf_counter() - started
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for row in rows:
        ranks = row["ranks"]
        row["busy_cpu_over_wall"] = sum(k["busy_cpu_s"] for k in ranks) / max(1e-12, sum(k["busy_s"] for k in ranks))
        row["flag"] = not row["oversubscribed"] and row["busy_cpu_over_wall"] < CONTENDED

    before, after = base_runs
    lines = [header, "", f"GPT {a.layers} x {a.hidden} ({psi:,} parameters), vocab {a.vocab}, global batch {a.batch} x "
             f"seq {a.seq}, fp32 AdamW; 1 warm-up + {a.steps} timed steps per configuration; {cores} cores, "
             f"{a.threads} thread(s) per rank.", "",
             f"One process (whole model, whole batch): step {1000 * base_s:.0f} ms (mean of a run before the sweep, "
             f"{1000 * before['step_s']:.0f} ms at cpu/wall {before['cpu_over_wall']:.2f}, and after it, "
             f"{1000 * after['step_s']:.0f} ms at cpu/wall {after['cpu_over_wall']:.2f}; each the median of its "
             f"steps), saved activations peak {before['saved_bytes_peak'] / 2**20:.1f} MiB.", "",
             _table(rows, base_s), "",
             f"step = barrier-to-end of train_step + AdamW, max over ranks, median of {a.steps} steps; vs 1 process = "
             "one-process step time / pipeline step time (> 1: faster). idle = 1 - busy / train_step wall per rank; "
             "busy = time inside forward_one_chunk / backward_one_chunk / backward_weight_one_chunk / loss; busy "
             "cpu/wall = thread CPU time over wall time inside them (< 1: the rank was descheduled while computing). "
             "formula = bubble_fraction(schedule, p, m, v): equal stages, no communication or schedule overhead."]
    if any(r["oversubscribed"] for r in rows):
        lines.append(f"\n* oversubscribed: p={max(worlds)} ranks share {cores} cores, so their compute stretches while "
                     "other ranks run: those step times and busy/idle splits are contended, not what p devices would "
                     "show.")
    if any(r["flag"] for r in rows):
        lines.append(f"\n+ contended by other processes: busy cpu/wall < {CONTENDED} with no more ranks than cores "
                     f"(load average {load:.2f} at start, {load_end:.2f} at the end): this machine was shared during "
                     "those runs.")
    lines += [f"\nnote: {note}" for note in notes]
    lines.append(f"\nWall time of the sweep: {elapsed:.0f} s.\n")
    text = "\n".join(lines)
    print(f"\n{text}")
    (folder / "bubble.md").write_text(text)
    (folder / "bubble.json").write_text(json.dumps({
        "header": header, "args": vars(a), "cores": cores, "parameters": psi, "one_process": base_runs,
        "one_process_step_s": base_s, "configs": rows, "notes": notes, "elapsed_s": elapsed,
        "load_average": [load, load_end]}, indent=1, default=str))
    title = (f"pipeline bubble, measured vs formula: GPT {a.layers} x {a.hidden}, batch {a.batch} x {a.seq}\n"
             f"gloo on {cores} CPU cores, {a.threads} thread(s) per rank")
    _plot(rows, folder / "bubble.png", title)
    print(f"[bench] wrote {folder / 'bubble.md'}, {folder / 'bubble.json'}, {folder / 'bubble.png'}")
    return 0
