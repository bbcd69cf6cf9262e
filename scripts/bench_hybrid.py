"""lp_hybrid (dp x pp x tp + ZeRO-1), timed and counted: the step time of dp2 x pp2 x tp2 (ZeRO-1, 1F1B, sequence
parallel, m micro-batches) against one process and lp_ddp on the same global batch, and the bytes each axis moves
per training step on one rank of each pipeline stage, counted at every call, next to the formulas.

    python scripts/bench_hybrid.py [--layers 4 --hidden 128 --heads 4 --seq 64 --batch 16 --m 2 --steps 20]
    python scripts/bench_hybrid.py --quick                     # 4 timed steps, no lp_ddp on 2 ranks
    python scripts/bench_hybrid.py --json hybrid.json

Everything runs under the Lightning Trainer (fork-started gloo ranks, one thread per process: a "device" is one core),
fixed random tokens served in order, split by the dp axis only (``use_distributed_sampler=False``), the GPT's own
AdamW + LR schedule. A callback times each training batch (``on_train_batch_start`` -> ``on_train_batch_end``, which
includes the optimizer step) and reports rank 0's mean after ``--warmup`` batches; fork workers return nothing, so
ranks write their numbers to files.

Counting: lp_hybrid runs one more batch after the timed ones (not timed: the counters slow it down) during which, on
every rank,

* tp -- :class:`~lightning_parallel.parallel.tensor.comm.TPCommCounter` (a TorchDispatchMode) records every functional
  collective DTensor issues, by phase: torch's ``PipelineStage.forward_one_chunk`` / ``backward_one_chunk`` and the
  loss are wrapped to set the phase; anything else (the step boundary's ``settle_gradients``: the norms' gradients,
  partial sums over each rank's sequence shard under sequence parallelism, all-reduced over tp) is ``step``.
  Formula per micro-batch of ``b/m`` samples, ``x = (t-1)/t (b/m) s h 4`` bytes: each block 4x forward and 4x
  backward (sequence parallel: 2 all-gathers + 2 reduce-scatters each way), the embedding 2x forward (the
  vocab-parallel lookup's all-reduce) and x backward, the head x each way, the loss 3 all-reduces of ``(b/m) s``
  floats; the stages of one pipeline sum to :func:`~lightning_parallel.parallel.tensor.comm.megatron_tp_bytes` for
  the whole model; times m per step. Step boundary: ``2 (t-1)/t`` x the bytes of the stage's norm parameters.
  (Megatron also all-reduces the row linears' biases there, which it adds after the reduce-scatter; DTensor adds a
  replicated bias to the partial sum before it, as ``bias/t`` on each rank, so that gradient comes out whole.)
* dp -- the strategy's own ``strategy.comm_counter`` (reset at each batch start, filled by the ZeRO-1 optimizer's
  reduce-scatter and all-gather of the flat local shards). Formula: ``2 (d-1)/d x local parameters x 4`` bytes.
* pp -- ``torch.distributed.isend`` / ``irecv`` are wrapped in the worker (torch's schedules build ``P2POp`` objects
  from them and run them directly or through ``batch_isend_irecv``; both paths go through the wrapped functions).
  Formula: each micro-batch's activation crosses the stage boundary forward and its gradient backward, each the tp
  rank's sequence shard: ``m x (b/m) x (s/t) x h x 4`` bytes each way. The step's loss broadcast over pp (4 bytes)
  is not a p2p message and is not counted.

Ring model throughout (as the library's counters): per rank, all-reduce ``2 (N-1)/N B``, reduce-scatter and
all-gather ``(N-1)/N B`` of a full buffer of ``B`` bytes; a p2p message counts its bytes once at the sender.

On a machine with fewer cores than ranks (8 single-threaded ranks on 2 cores) the ranks share cores and the hybrid
is slower than one process: what the CPU run shows is that the composition runs, and what each axis moves.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_parallel  # noqa: F401  (registers the strategies)
from lightning_parallel.models import GPT

STAGE_METHODS = {"forward_one_chunk": "forward", "backward_one_chunk": "backward",
                 "backward_weight_one_chunk": "backward"}


def _model(a: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=a.layers, n_head=a.heads, n_embd=a.hidden, block_size=a.seq, vocab_size=a.vocab,
               bias=True, warmup_steps=2)


def _hybrid_layout(a: argparse.Namespace) -> dict[str, Any]:
    return {"data_parallel_size": 2, "pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1,
            "sequence_parallel": True, "pipeline_schedule": "1f1b", "num_micro_batches": a.m}


# ---------------------------------------------------------------------------------------------- counting
class _P2PCount:
    """Bytes and calls of ``torch.distributed.isend`` / ``irecv`` in this process while :meth:`patched` is open."""

    def __init__(self) -> None:
        self.bytes = {"send": 0, "recv": 0}
        self.calls = {"send": 0, "recv": 0}
        self.shapes: set[tuple[int, ...]] = set()

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        originals = {"isend": c10d.isend, "irecv": c10d.irecv}

        def counting(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def wrapper(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
                self.bytes[kind] += tensor.numel() * tensor.element_size()
                self.calls[kind] += 1
                self.shapes.add(tuple(tensor.shape))
                return fn(tensor, *args, **kwargs)

            return wrapper

        # the same wrapper in both modules: P2POp checks ``op in [isend, irecv]`` against distributed_c10d's names
        # and batch_isend_irecv tells sends from receives by ``op is isend``
        wrapped = {"isend": counting("send", originals["isend"]), "irecv": counting("recv", originals["irecv"])}
        try:
            for name, fn in wrapped.items():
                setattr(c10d, name, fn)
                setattr(dist, name, fn)
            yield
        finally:
            for name, fn in originals.items():
                setattr(c10d, name, fn)
                setattr(dist, name, fn)


@contextlib.contextmanager
def _phases(counter: Any, runner: Any) -> Iterator[None]:
    """Set ``counter.phase`` inside torch's stage forward / backward and the runner's loss; ``step`` elsewhere."""
    from torch.distributed.pipelining import PipelineStage

    def phased(phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before, counter.phase = counter.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                counter.phase = before

        return wrapper

    saved = {name: PipelineStage.__dict__.get(name) for name in STAGE_METHODS}
    loss_fn = runner.loss_fn
    counter.phase = "step"
    try:
        for name, phase in STAGE_METHODS.items():
            setattr(PipelineStage, name, phased(phase, getattr(PipelineStage, name)))
        runner.loss_fn = phased("loss", loss_fn)
        yield
    finally:
        runner.loss_fn = loss_fn
        for name, own in saved.items():
            if own is None:
                delattr(PipelineStage, name)
            else:
                setattr(PipelineStage, name, own)


def _stage_facts(module: nn.Module) -> dict[str, Any]:
    """What the formulas need about this rank's stage: blocks, embedding, head, local parameter count, and the
    bytes of the parameters whose gradients are partial over tp under sequence parallelism (the norms')."""
    from lightning_parallel.parallel.tensor.sync import local_tensor

    gpt: Any = module
    blocks = [name for name, _ in gpt._present_blocks()]
    plan = gpt.tensor_parallel_plan()
    partial = 0
    for name, sub in module.named_modules():
        style = plan.get(name)
        for p in sub.parameters(recurse=False):
            if style == "sequence":
                partial += local_tensor(p).numel() * p.element_size()
    local = sum(local_tensor(p).numel() for p in module.parameters())
    return {"blocks": len(blocks), "embed": getattr(gpt, "embed", None) is not None,
            "head": getattr(gpt, "head", None) is not None, "local_params": local, "partial_grad_bytes": partial}


class _Probe(pl.Callback):
    """Times each training batch (rank 0's mean after warm-up goes to ``folder/times.json``); on batch ``count_at``
    (lp_hybrid only) counts what every axis moves and writes ``folder/bytes_rank<r>.json``."""

    def __init__(self, warmup: int, steps: int, folder: Path, count: bool) -> None:
        self.warmup, self.steps, self.folder, self.count = warmup, steps, folder, count
        self.times: list[float] = []
        self._t = 0.0
        self._stack: contextlib.ExitStack | None = None
        self._tp: Any = None
        self._p2p: _P2PCount | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.count and batch_idx == self.warmup + self.steps:
            from lightning_parallel.parallel.tensor.comm import TPCommCounter

            self._tp, self._p2p = TPCommCounter(), _P2PCount()
            self._stack = contextlib.ExitStack()
            self._stack.enter_context(_phases(self._tp, trainer.strategy.runner))  # type: ignore[attr-defined]
            self._stack.enter_context(self._p2p.patched())
            self._stack.enter_context(self._tp)
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        dt = time.perf_counter() - self._t
        if self.warmup <= batch_idx < self.warmup + self.steps:
            self.times.append(dt)
        if self._stack is not None:
            self._stack.close()
            self._stack = None
            self._write_bytes(trainer, pl_module)

    def _write_bytes(self, trainer: pl.Trainer, pl_module: Any) -> None:
        strategy: Any = trainer.strategy
        tp, p2p = self._tp, self._p2p
        assert tp is not None and p2p is not None
        coords = strategy.dims.coords(trainer.global_rank)
        record = {
            "rank": trainer.global_rank, "coords": {"dp": coords.dp, "pp": coords.pp, "tp": coords.tp},
            "layers": strategy.stage_plan.kept, **_stage_facts(pl_module),
            "tp": {phase: tp.total(phase) for phase in ("forward", "backward", "loss", "step")},
            "tp_calls": {f"{p}/{k}": n for (p, k), n in sorted(tp.calls.items())},
            "pp": dict(p2p.bytes), "pp_calls": dict(p2p.calls), "pp_shapes": sorted(p2p.shapes),
            "dp": dict(strategy.comm_counter.bytes_by_kind),
            "dp_calls": dict(strategy.comm_counter.calls_by_kind),
        }
        (self.folder / f"bytes_rank{trainer.global_rank}.json").write_text(json.dumps(record))

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            (self.folder / "times.json").write_text(json.dumps({"steps_s": self.times}))


# ---------------------------------------------------------------------------------------------- timing
class _Data(pl.LightningDataModule):
    """Fixed random tokens in order; dp rank r of d gets samples r, r+d, ... (one process: all of them)."""

    def __init__(self, a: argparse.Namespace, batch_size: int, batches: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        data = torch.randint(0, a.vocab, (batches * a.batch, a.seq + 1), generator=g)
        self.dataset, self.batch_size = TensorDataset(data[:, :-1], data[:, 1:]), batch_size

    def train_dataloader(self) -> DataLoader:
        trainer: Any = self.trainer
        kwargs = trainer.strategy.distributed_sampler_kwargs if trainer.world_size > 1 else None
        sampler: DistributedSampler[Any] | None = (DistributedSampler(self.dataset, shuffle=False, **kwargs)
                                                   if kwargs else None)
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)


def _fit(a: argparse.Namespace, strategy: Any, devices: int, dp: int, count: bool) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="bench_hybrid_"))
    batches = a.warmup + a.steps + int(count)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=batches, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[_Probe(a.warmup, a.steps, folder, count)])
    trainer.fit(_model(a), datamodule=_Data(a, a.batch // dp, batches))
    steps = json.loads((folder / "times.json").read_text())["steps_s"]
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("bytes_rank*.json"))]
    return {"step_s": statistics.mean(steps), "steps_s": steps, "bytes": sorted(ranks, key=lambda r: r["rank"])}


# ---------------------------------------------------------------------------------------------- formulas
def _formulas(a: argparse.Namespace, r: dict[str, Any]) -> dict[str, float]:
    """Bytes one rank sends (and, for pp, receives) per step, by the module docstring's formulas."""
    t = d = 2
    m = a.m
    b = a.batch // d  # per dp rank
    mb, s, h = b // m, a.seq, a.hidden
    x = (t - 1) / t * mb * s * h * 4
    fwd = 4 * r["blocks"] * x + (2 * x if r["embed"] else 0.0) + (x if r["head"] else 0.0)
    bwd = 4 * r["blocks"] * x + (x if r["embed"] else 0.0) + (x if r["head"] else 0.0)
    loss = 3 * 2 * (t - 1) / t * mb * s * 4 if r["head"] else 0.0
    boundary = b * (s // t) * h * 4  # m micro-batches x (b/m) x (s/t) x h x 4
    zero = (d - 1) / d * r["local_params"] * 4
    return {"tp forward": m * fwd, "tp backward": m * bwd, "tp loss": m * loss,
            "tp step boundary": 2 * (t - 1) / t * r["partial_grad_bytes"],
            "pp sent": boundary, "pp received": boundary,
            "dp reduce-scatter": zero, "dp all-gather": zero}


def _measured(r: dict[str, Any]) -> dict[str, float]:
    return {"tp forward": r["tp"]["forward"], "tp backward": r["tp"]["backward"], "tp loss": r["tp"]["loss"],
            "tp step boundary": r["tp"]["step"], "pp sent": r["pp"]["send"], "pp received": r["pp"]["recv"],
            "dp reduce-scatter": r["dp"].get("reduce_scatter", 0.0), "dp all-gather": r["dp"].get("all_gather", 0.0)}


WHAT = {
    "tp forward": "per block 2 all-gathers + 2 reduce-scatters; embedding all-reduce; head all-gather (x m)",
    "tp backward": "per block the same; embedding all-gather; head reduce-scatter (x m)",
    "tp loss": "vocab-parallel cross-entropy: 3 all-reduces of (b/m) x s floats (x m)",
    "tp step boundary": "settle_gradients: the SP norms' partial gradients all-reduced, 2 (t-1)/t x their bytes",
    "pp sent": "activation (stage 0) or its gradient (stage 1), m x (b/m) x (s/t) x h x 4",
    "pp received": "gradient (stage 0) or activation (stage 1), the same size",
    "dp reduce-scatter": "ZeRO-1 flat local gradient, (d-1)/d x local params x 4",
    "dp all-gather": "ZeRO-1 updated flat local parameters, (d-1)/d x local params x 4",
}


def _bytes_table(a: argparse.Namespace, ranks: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    shown = [r for r in ranks if r["coords"]["dp"] == 0 and r["coords"]["tp"] == 0]
    rows: list[dict[str, Any]] = []
    head = "| axis: collective | what (formula) |"
    sep = "|---|---|"
    for r in shown:
        head += (f" pp stage {r['coords']['pp']}, rank {r['rank']} ({r['layers'][0]} .. {r['layers'][-1]}): "
                 "measured / formula / ratio |")
        sep += "---|"
    lines = [head, sep]
    totals = [[0.0, 0.0] for _ in shown]
    for key in WHAT:
        cells = []
        for i, r in enumerate(shown):
            got, want = _measured(r)[key], _formulas(a, r)[key]
            if key != "pp received":
                totals[i][0] += got
                totals[i][1] += want
            ratio = f"{got / want:.3f}" if want else ("-" if not got else "inf")
            cells.append(f"{got:,.0f} / {want:,.0f} / {ratio}")
            rows.append({"rank": r["rank"], "item": key, "measured": got, "formula": want})
        lines.append(f"| {key} | {WHAT[key]} | " + " | ".join(cells) + " |")
    lines.append("| total sent | tp + pp sent + dp | " + " | ".join(
        f"{got:,.0f} / {want:,.0f} / {got / want:.3f}" for got, want in totals) + " |")
    return "\n".join(lines), rows


def _symmetry(a: argparse.Namespace, ranks: list[dict[str, Any]]) -> float:
    """The largest relative difference of any measured item between ranks of the same pipeline stage."""
    worst = 0.0
    for stage in (0, 1):
        same = [_measured(r) for r in ranks if r["coords"]["pp"] == stage]
        for key in WHAT:
            values = [s[key] for s in same]
            if max(values):
                worst = max(worst, (max(values) - min(values)) / max(values))
    return worst


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (a multiple of 8 and of 2 x m)")
    parser.add_argument("--m", type=int, default=2, help="micro-batches per dp rank and step (1F1B needs m >= 2)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-ddp2", action="store_true", help="skip lp_ddp on 2 ranks")
    parser.add_argument("--quick", action="store_true", help="4 timed steps after 2 warm-up, no lp_ddp on 2 ranks")
    parser.add_argument("--json", metavar="PATH", help="write every number (each rank's counts, each step) here")
    a = parser.parse_args()
    if a.quick:
        a.steps, a.warmup, a.no_ddp2 = 4, 2, True
    if a.batch % 8 or a.batch % (2 * a.m) or a.m < 2:
        parser.error(f"--batch {a.batch} must split over 8 ranks and into 2 dp ranks x m={a.m} micro-batches, m >= 2")
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in ("lightning.pytorch", "lightning.fabric"):  # the Trainer's per-run banners; warnings stay
        logging.getLogger(name).setLevel(logging.WARNING)
    from lightning_parallel.strategies import LPDDPStrategy, LPHybridStrategy

    cores = os.cpu_count() or 1
    psi = sum(p.numel() for p in _model(a).parameters())
    load = os.getloadavg()[0]
    print(f"GPT {a.layers} x {a.hidden} ({psi:,} parameters), vocab {a.vocab}, global batch {a.batch} x seq {a.seq}, "
          f"fp32 AdamW; {a.warmup} warm-up + {a.steps} timed steps per run; {cores} cores, one thread per rank "
          f"(load average {load:.2f} at start)", flush=True)
    layout = _hybrid_layout(a)
    runs: list[tuple[str, Callable[[], Any], int, int, str]] = [  # name, strategy, processes, dp, layout
        ("one process", lambda: "auto", 1, 1, "whole model, whole batch"),
        ("lp_ddp x2", lambda: LPDDPStrategy(start_method="fork"), 2, 2, "dp=2"),
        ("lp_ddp x8", lambda: LPDDPStrategy(start_method="fork"), 8, 8, "dp=8"),
        ("lp_hybrid x8", lambda: LPHybridStrategy(layout, start_method="fork"), 8, 2,
         f"dp2 x pp2 x tp2, ZeRO-1, 1F1B, SP, m={a.m}"),
    ]
    if a.no_ddp2:
        runs = [run for run in runs if run[0] != "lp_ddp x2"]
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for k, (name, make, devices, dp, what) in enumerate(runs, 1):
        t0 = time.perf_counter()
        results[name] = _fit(a, make(), devices, dp, count=name.startswith("lp_hybrid"))
        print(f"[{k}/{len(runs) + 1}] {name} ({what}): {1000 * results[name]['step_s']:.1f} ms/step, fit took "
              f"{time.perf_counter() - t0:.0f} s  ({time.perf_counter() - started:.0f} s)", flush=True)
    # the baseline once more at the end (this machine is shared: its load drifts during the run); the table's one
    # process row is the mean of both runs' steps
    again = _fit(a, "auto", 1, 1, count=False)
    print(f"[{len(runs) + 1}/{len(runs) + 1}] one process again: {1000 * again['step_s']:.1f} ms/step  "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    first = results["one process"]
    results["one process"] = {"step_s": statistics.mean(first["steps_s"] + again["steps_s"]),
                              "steps_s": first["steps_s"] + again["steps_s"], "bytes": [],
                              "runs_step_s": [first["step_s"], again["step_s"]]}
    elapsed = time.perf_counter() - started
    load_end = os.getloadavg()[0]

    base = results["one process"]["step_s"]
    hybrid = results["lp_hybrid x8"]["step_s"]
    print(f"\nstep time, global batch {a.batch}: mean of rank 0's {a.steps} steps after {a.warmup} warm-up "
          "(on_train_batch_start -> end, optimizer step included), one run each (one process: two runs, "
          f"{' and '.join(f'{1000 * x:.1f}' for x in results['one process']['runs_step_s'])} ms, first and last)\n")
    print("| run | processes | layout | samples per rank per step | step ms (mean) | median | min / max ms | vs one "
          "process | lp_hybrid vs this |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, _, devices, dp, what in runs:
        r = results[name]
        over = " *" if devices > cores else ""
        print(f"| {name} | {devices}{over} | {what} | {a.batch // dp} | {1000 * r['step_s']:.1f} | "
              f"{1000 * statistics.median(r['steps_s']):.1f} | {1000 * min(r['steps_s']):.1f} / "
              f"{1000 * max(r['steps_s']):.1f} | {base / r['step_s']:.2f}x | "
              f"{r['step_s'] / hybrid:.2f}x |")
    print("\nvs one process = one-process step time / this run's (> 1: faster); lp_hybrid vs this = this run's "
          "step time / lp_hybrid's (> 1: the hybrid is faster); both on the means. A wide min / max spread means "
          f"other processes took the cores during that run (load average {load:.2f} at start, {load_end:.2f} at the "
          "end of the runs).")
    if any(devices > cores for _, _, devices, _, _ in runs):
        print(f"* oversubscribed: 8 single-threaded ranks share {cores} cores, so every rank's compute stretches while "
              "the others run, and the gloo messages between processes on one machine cost CPU time too: here the "
              f"hybrid takes {hybrid / base:.1f}x the one-process step time, and these numbers say nothing about 8 "
              "real devices. On CPU the point is that dp x pp x tp + ZeRO-1 runs under the Trainer, and what each "
              "axis moves (below).")

    ranks = results["lp_hybrid x8"]["bytes"]
    table, rows = _bytes_table(a, ranks)
    b = a.batch // 2
    print(f"\nbytes sent per training step per rank by lp_hybrid, counted on one extra (untimed) step, on dp rank 0 / "
          f"tp rank 0 of each pipeline stage; b = {b} samples per dp rank, m = {a.m}, s = {a.seq}, h = {a.hidden}, "
          "t = d = 2, fp32\n")
    print(table)
    from lightning_parallel.parallel.tensor.comm import megatron_tp_bytes

    whole = megatron_tp_bytes(n_layer=a.layers, batch=b // a.m, seq=a.seq, hidden=a.hidden, tp=2,
                              sequence_parallel=True)
    stages = [_formulas(a, r) for r in ranks if r["coords"]["dp"] == 0 and r["coords"]["tp"] == 0]
    split = sum(f["tp forward"] + f["tp backward"] + f["tp loss"] for f in stages)
    r0 = ranks[0]
    print(f"\ntp formula check: the two stages' forward + backward + loss = {split:,.0f} bytes = m x "
          f"megatron_tp_bytes(whole model, b/m={b // a.m}).total = {a.m * whole['total']:,.0f}. "
          f"Collectives counted on rank 0: {', '.join(f'{k} {v}' for k, v in r0['tp_calls'].items())}; p2p "
          f"messages: {r0['pp_calls']['send']} sent, {r0['pp_calls']['recv']} received, shapes {r0['pp_shapes']}; "
          f"dp: {dict(r0['dp_calls'])}.")
    print(f"every rank counted: the largest difference between ranks of one stage is {100 * _symmetry(a, ranks):.2f} % "
          "of an item.")
    ddp = 2 * 7 / 8 * psi * 4
    print(f"for scale, lp_ddp on 8 ranks all-reduces the whole gradient: 2 x 7/8 x {psi:,} x 4 = {ddp:,.0f} bytes "
          "per rank per step (formula, not counted here).")
    print(f"\nwall time: {elapsed:.0f} s (load average {load:.2f} at start, {load_end:.2f} at the end)")
    if a.json:
        path = Path(a.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"args": vars(a), "cores": cores, "parameters": psi, "layout": layout,
                                    "runs": results, "bytes_rows": rows, "megatron_tp_bytes_whole": whole,
                                    "elapsed_s": elapsed, "load_average": [load, load_end]}, indent=1))
        print(f"json: {path}")


if __name__ == "__main__":
    main()
