"""One benchmark for every strategy: the library against the hand-written torch loop of the same technique and
against Lightning's built-in strategies, on the same GPT, global batch and seed.

    python scripts/bench.py                       # CPU: the full table (2, 4 and 8 gloo ranks), ~10-15 min here
    python scripts/bench.py --quick               # a smaller GPT and fewer steps (CPU ~5 min; one 8-GPU node < 5 min)
    python scripts/bench.py --device cuda         # GPUs with NCCL (cases that need more GPUs than present are skipped)
    python scripts/bench.py --device cuda --large # a 3B GPT: most of an 80 GB GPU's memory under lp_ddp
    python scripts/bench.py --cases ddp,zero3 --reps 5
    python scripts/bench.py --profile ddp         # torch.profiler of the library and its anchor: where the time goes

**Cases** (``--cases``; the anchors are written with torch only, no framework):

=========  ==========================  ===============================================  =============================
case       the library                 hand-written torch loop                          Lightning's built-in
=========  ==========================  ===============================================  =============================
dp         lp_dp (N replicas, 1 proc)  one process, same global batch (CUDA: nn.DataP.)  none (removed in Lightning 2)
ddp        lp_ddp                      DistributedDataParallel + AdamW                  ``ddp``
zero1      lp_sharded zero_stage=1     DDP + ZeroRedundancyOptimizer                    CUDA: ``deepspeed`` stage 1
zero2      lp_sharded zero_stage=2     FSDP2 fully_shard(reshard_after_forward=False)   CUDA: ``deepspeed`` stage 2
zero3      lp_sharded zero_stage=3     FSDP2 fully_shard per block + root               ModelParallelStrategy dp=N
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

**Output** (``--out``, default ``benchmarks/<date>``): ``results.json`` (every step time of every repetition),
``results.md`` (the table), ``step_time_ratios.png`` and ``memory_per_rank.png``.

On a machine with fewer cores than ranks (this CPU: 2 cores; 4 and 8 single-threaded ranks) the ranks share cores:
the absolute times are slow, the ratios between variants of one case still compare the same work.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import inspect
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from lightning_parallel.parallel.zero.comm import ring_bytes  # noqa: E402

ROLES = ("ours", "torch", "lightning")


# ============================================================================================== the cases
@dataclass(frozen=True)
class Case:
    key: str
    title: str
    dp: int
    pp: int = 1
    tp: int = 1
    zero: int = 0
    offload: str = "none"
    anchor: str = ""
    """What the hand-written torch loop is."""
    lightning: str | None = None
    """Lightning's built-in on CPU (None: the reason in ``lightning_missing``)."""
    lightning_cuda: str | None = None
    lightning_missing: str = ""
    processes: int | None = None
    """Processes to start (default dp x pp x tp; lp_dp: one)."""

    @property
    def world(self) -> int:
        return self.processes if self.processes is not None else self.dp * self.pp * self.tp


CASES: dict[str, Case] = {c.key: c for c in (
    Case("dp", "lp_dp (2 replicas, 1 process)", dp=2, processes=1,
         anchor="one process, whole batch (nn.DataParallel on CUDA; it refuses CPU)",
         lightning_missing="Lightning 2 removed dp"),
    Case("ddp", "lp_ddp x2", dp=2, anchor="torch DistributedDataParallel", lightning="ddp", lightning_cuda="ddp"),
    Case("zero1", "lp_sharded zero1 x2", dp=2, zero=1, anchor="DDP + torch ZeroRedundancyOptimizer",
         lightning_cuda="deepspeed_stage_1", lightning_missing="Lightning has no ZeRO-1 on CPU (deepspeed: CUDA only)"),
    Case("zero2", "lp_sharded zero2 x2", dp=2, zero=2, anchor="FSDP2 fully_shard(reshard_after_forward=False)",
         lightning_cuda="deepspeed_stage_2", lightning_missing="Lightning has no ZeRO-2 on CPU (deepspeed: CUDA only)"),
    Case("zero3", "lp_sharded zero3 x2", dp=2, zero=3, anchor="FSDP2 fully_shard per block + root",
         lightning="model_parallel", lightning_cuda="model_parallel"),
    Case("offload", "lp_zero_offload z2+cpu x2", dp=2, zero=2, offload="cpu",
         anchor="bare deepspeed.initialize engine, same config", lightning_cuda="deepspeed_stage_2_offload",
         lightning_missing="Lightning's deepspeed refuses CPU"),
    Case("tp", "lp_tensor tp2", dp=1, tp=2, anchor="DTensor parallelize_module (Megatron plan) + loss_parallel",
         lightning="model_parallel", lightning_cuda="model_parallel"),
    Case("tp2d", "lp_tensor dp2 x tp2 zero3", dp=2, tp=2, zero=3, anchor="DTensor TP + FSDP2 over dp",
         lightning="model_parallel", lightning_cuda="model_parallel"),
    Case("pp", "lp_pipeline pp2 1F1B", dp=1, pp=2, anchor="torch.distributed.pipelining Schedule1F1B",
         lightning_missing="Lightning 2 removed pipelines"),
    Case("hybrid", "lp_hybrid dp2 x pp2 x tp2", dp=2, pp=2, tp=2,
         anchor="pipelining over DTensor TP + dp gradient all-reduce", lightning_missing="no hybrid in Lightning"),
)}


def lightning_name(case: Case, device: str) -> str | None:
    return case.lightning_cuda if device == "cuda" else case.lightning


# ============================================================================================== sizes
PRESETS: dict[str, dict[str, Any]] = {
    "default": dict(layers=4, hidden=256, heads=4, seq=128, vocab=256, batch=16, warmup=3, steps=10, reps=3),
    "quick": dict(layers=2, hidden=128, heads=4, seq=64, vocab=256, batch=8, warmup=2, steps=5, reps=3),
    # ~3.0B parameters: 48 GB of fp32 AdamW model states under lp_ddp plus activations, sized for 80 GB GPUs
    "large": dict(layers=24, hidden=3072, heads=24, seq=1024, vocab=50304, batch=8, warmup=3, steps=10, reps=3),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small GPT, few steps")
    size.add_argument("--large", action="store_true", help="a GPT that fills most of a GPU (CUDA)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, out of {','.join(CASES)}")
    p.add_argument("--roles", default=",".join(ROLES), help="ours,torch,lightning (ours is always run)")
    for key in ("layers", "hidden", "heads", "seq", "vocab", "batch", "warmup", "steps", "reps"):
        p.add_argument(f"--{key}", type=int, help=f"override the preset's {key}")
    p.add_argument("--micro-batches", type=int, default=4, help="pipeline micro-batches (pp, hybrid)")
    p.add_argument("--threads", type=int, default=1, help="CPU: intra-op threads per rank")
    p.add_argument("--start-method", choices=["fork", "spawn"], default="fork",
                   help="how the ranks of each run start (fork: cheap; this process never initializes CUDA)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take before it is ended")
    p.add_argument("--out", help="output folder (default benchmarks/<date>)")
    p.add_argument("--profile", metavar="CASE", help="profile the library and its anchor on CASE; no table")
    p.add_argument("--render", metavar="RESULTS_JSON",
                   help="write the markdown table and the plots again from a results.json; run nothing")
    a = p.parse_args(argv)
    preset = PRESETS["quick" if a.quick else "large" if a.large else "default"]
    for key, value in preset.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.cases = [c for c in a.cases.split(",") if c]
    unknown = [c for c in a.cases if c not in CASES]
    if unknown:
        p.error(f"--cases {','.join(unknown)}: unknown; the cases are {', '.join(CASES)}.")
    a.roles = ["ours", *[r for r in a.roles.split(",") if r and r != "ours"]]
    if any(r not in ROLES for r in a.roles):
        p.error(f"--roles {','.join(a.roles)}: out of {', '.join(ROLES)}.")
    if a.reps < 3 and a.profile is None:
        p.error(f"--reps {a.reps}: at least 3 (the table reports medians of interleaved repetitions).")
    if a.hidden % a.heads:
        p.error(f"--hidden {a.hidden} must be divisible by --heads {a.heads}.")
    if a.profile is not None and a.profile not in CASES:
        p.error(f"--profile {a.profile}: unknown; the cases are {', '.join(CASES)}.")
    for case in (CASES[k] for k in a.cases):
        if a.batch % case.dp or (case.pp > 1 and (a.batch // case.dp) % a.micro_batches):
            p.error(f"--batch {a.batch}: case {case.key} needs it divisible by dp={case.dp}"
                    + (f" and the per-dp batch by --micro-batches {a.micro_batches}" if case.pp > 1 else "") + ".")
    if a.device == "cpu" and a.large:
        p.error("--large is sized for GPUs; use it with --device cuda.")
    return a


# ============================================================================================== counting
# name -> (kind, the argument holding the full-size buffer, how to get its bytes)
_PATCHED: dict[str, tuple[str, str, str]] = {
    "all_reduce": ("all_reduce", "tensor", "one"),
    "reduce": ("reduce", "tensor", "one"),
    "broadcast": ("broadcast", "tensor", "one"),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "one"),
    "reduce_scatter_single": ("reduce_scatter", "input", "one"),
    "_reduce_scatter_base": ("reduce_scatter", "input", "one"),
    "reduce_scatter": ("reduce_scatter", "input_list", "list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor", "one"),
    "all_gather_single": ("all_gather", "output_tensor", "one"),
    "_all_gather_base": ("all_gather", "output_tensor", "one"),
    "all_gather": ("all_gather", "tensor_list", "list"),
    "all_to_all_single": ("all_to_all", "input", "one"),
    "isend": ("send", "tensor", "p2p"),
    "send": ("send", "tensor", "p2p"),
}


class CommCount:
    """Bytes this rank sends per axis while :attr:`active` (ring model), from every path a collective can take."""

    def __init__(self, rank: int, dims: Any) -> None:
        self.rank, self.dims = rank, dims
        self.active = False
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._depth = threading.local()
        self._originals: dict[tuple[Any, str], Any] = {}

    # ---------------------------------------------------------------- axis of a group
    def axis_of_ranks(self, ranks: list[int]) -> str:
        if len(ranks) == self.dims.world_size and sum(self.dims.size(a) > 1 for a in ("dp", "pp", "tp")) > 1:
            return "world"
        for axis in ("dp", "pp", "tp"):
            if self.dims.size(axis) > 1 and sorted(ranks) == sorted(self.dims.group_ranks(axis, self.rank)):
                return axis
        return "other"

    def axis_of_peer(self, peer: int) -> str:
        mine, theirs = self.dims.coords(self.rank), self.dims.coords(peer)
        moved = [a for a in ("dp", "pp", "tp") if getattr(mine, a) != getattr(theirs, a)]
        return moved[0] if len(moved) == 1 else "other"

    def record(self, axis: str, kind: str, nbytes: float) -> None:
        self.bytes[axis] += nbytes
        self.calls[f"{axis}:{kind}"] += 1

    # ---------------------------------------------------------------- torch.distributed functions
    def install(self) -> None:
        """Wrap the ``torch.distributed`` functions (both module namespaces) for the rest of the process."""
        from torch.distributed import distributed_c10d as c10d

        wrapped: dict[str, Any] = {}
        for name in _PATCHED:
            fn = getattr(c10d, name, None)
            if fn is not None:
                wrapped[name] = self._wrap(name, fn)
        for module in (c10d, dist):
            for name, fn in wrapped.items():
                self._originals[(module, name)] = getattr(module, name, None)
                setattr(module, name, fn)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        kind, arg, how = _PATCHED[name]
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if self.active and depth == 0:
                try:
                    self._count(kind, arg, how, signature.bind(*args, **kwargs).arguments)
                except Exception as err:  # never break the run for the counter
                    self.record("error", f"{name}: {err}", 0.0)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return wrapper

    def _count(self, kind: str, arg: str, how: str, bound: dict[str, Any]) -> None:
        group = bound.get("group")
        if how == "p2p":
            tensor = bound[arg]
            peer = bound.get("dst")
            if peer is None:
                peer = dist.get_global_rank(group, bound["group_dst"])
            self.record(self.axis_of_peer(int(peer)), kind, tensor.numel() * tensor.element_size())
            return
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        n = len(ranks)
        if n <= 1:
            return
        value = bound[arg]
        if how == "list":
            full = float(sum(t.numel() * t.element_size() for t in value))
        else:
            full = float(value.numel() * value.element_size())
        self.record(self.axis_of_ranks(ranks), kind, ring_bytes(kind, full_bytes=int(full), world_size=n))

    # ---------------------------------------------------------------- DTensor's functional collectives
    @contextlib.contextmanager
    def functional(self) -> Iterator[None]:
        """DTensor's functional collectives, through the library's dispatch-mode counter, booked by axis."""
        from lightning_parallel.parallel.tensor.comm import TPCommCounter

        counter = self

        class _ByAxis(TPCommCounter):
            def _add(self, kind: str, group: Any, nbytes: float) -> None:
                if counter.active:
                    counter.record(counter.axis_of_ranks(dist.get_process_group_ranks(group)), kind, nbytes)

        with _ByAxis():
            yield


def _python_allreduce_hook(model: Any) -> None:
    """DDP's buckets through ``torch.distributed.all_reduce`` (counted), instead of the C++ default hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(None, default_hooks.allreduce_hook)


# ============================================================================================== one rank's context
@dataclass
class Ctx:
    a: argparse.Namespace
    case: Case
    role: str
    rank: int
    world: int
    device: torch.device
    dims: Any
    counter: CommCount | None
    tokens: Tensor
    profile: str | None = None
    """None, "full" (``--profile``) or "breakdown" (where the time of a case above 3 % goes)."""
    out: dict[str, Any] = field(default_factory=dict)

    @property
    def total_steps(self) -> int:
        return self.a.warmup + self.a.steps + 1  # the last one is counted (count runs) and never timed

    @property
    def coords(self) -> Any:
        return self.dims.coords(self.rank)

    def model(self, cls: Any = None) -> Any:
        """The GPT (or its subclass ``cls``), seed 0, constant learning rate."""
        from lightning_parallel.models import GPT

        torch.manual_seed(0)
        a = self.a
        return (cls or GPT)(n_layer=a.layers, n_head=a.heads, n_embd=a.hidden, block_size=a.seq, vocab_size=a.vocab,
                   warmup_steps=0, min_lr_ratio=1.0)

    def dataset(self) -> TensorDataset:
        return TensorDataset(self.tokens[:, :-1], self.tokens[:, 1:])

    def loader(self) -> DataLoader:
        """This rank's batches: dp rank r of d gets samples r, r+d, ... (the same split every strategy makes)."""
        dp, r = self.case.dp if self.case.processes is None else 1, self.coords.dp
        sampler = DistributedSampler(self.dataset(), num_replicas=dp, rank=r, shuffle=False) if dp > 1 else None
        return DataLoader(self.dataset(), batch_size=self.a.batch // dp, sampler=sampler, drop_last=True)


class Timer:
    """Step starts (rank 0's clock), losses, the counted last step, and (``ctx.profile``) a profile of timed steps:
    ``"full"`` -- torch.profiler's op table and cProfile's Python functions over 4 steps (``--profile``);
    ``"breakdown"`` -- torch.profiler over every timed step, summed as compute / collectives / the rest."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.starts: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float | None] = []
        self._stack: contextlib.ExitStack | None = None
        self._profiler: Any = None
        self._python: Any = None
        self._profile_wall = 0.0
        self.profile: dict[str, Any] = {}
        a = ctx.a
        steps = 4 if ctx.profile == "full" else a.steps
        self._profile_steps = (range(a.warmup, a.warmup + min(steps, a.steps))
                               if ctx.profile is not None and ctx.rank == 0 else range(0))

    def begin(self, i: int) -> None:
        if len(self._profile_steps) and i == self._profile_steps[0]:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.ctx.device.type == "cuda" else [])
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()
            if self.ctx.profile == "full":
                import cProfile

                self._python = cProfile.Profile()
                self._python.enable()
            self._profile_wall = time.perf_counter()
        if self.ctx.counter is not None and i == self.ctx.total_steps - 1:
            self._stack = contextlib.ExitStack()
            self._stack.enter_context(self.ctx.counter.functional())
            self.ctx.counter.active = True
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def end(self, i: int, loss: Any) -> None:
        self.losses.append(None if loss is None else float(loss))
        if self._profiler is not None and i == self._profile_steps[-1]:
            self._finish_profile()
        if self._stack is not None:
            assert self.ctx.counter is not None
            self.ctx.counter.active = False
            self._stack.close()
            self._stack = None

    def _finish_profile(self) -> None:
        wall = time.perf_counter() - self._profile_wall
        if self._python is not None:
            self._python.disable()
        self._profiler.__exit__(None, None, None)
        events = self._profiler.key_averages()
        self._profiler = None
        n = len(self._profile_steps)
        if self.ctx.profile == "breakdown":
            self.profile = {"steps": n, **breakdown(events, wall, n)}
            return
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(self._python, stream=text).sort_stats("cumulative").print_stats(45)
        self.profile = {"table": events.table(sort_by="self_cpu_time_total", row_limit=30),
                        "python": text.getvalue(), "steps": n, **breakdown(events, wall, n)}

    def result(self) -> dict[str, Any]:
        a = self.ctx.a
        periods = [b - s for s, b in zip(self.starts, self.starts[1:], strict=False)]
        cpu = [b - s for s, b in zip(self.cpu, self.cpu[1:], strict=False)]
        out: dict[str, Any] = {"step_s": periods[a.warmup:a.warmup + a.steps], "losses": self.losses,
                               "cpu_s": cpu[a.warmup:a.warmup + a.steps]}
        if self.profile:
            out["profile"] = self.profile
        return out


_COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:", "record_param_comms")


def breakdown(events: Any, wall_s: float, steps: int) -> dict[str, float]:
    """Milliseconds per step of a profiled stretch of ``steps`` steps: ``compute`` (self time of ``aten::`` ops),
    ``collectives`` (self time of c10d and functional-collective ops, their waits included) and ``other`` (the rest
    of the wall time: Python, tensor-subclass dispatch, the framework's hooks, the optimizer's Python, idle)."""
    compute = comm = 0.0
    calls = 0
    for e in events:
        if e.key.startswith("aten::"):
            compute += e.self_cpu_time_total
            calls += e.count
        elif e.key.startswith(_COLLECTIVE_PREFIXES):
            comm += e.self_cpu_time_total
    wall_ms, compute_ms, comm_ms = wall_s * 1e3 / steps, compute / 1e3 / steps, comm / 1e3 / steps
    return {"wall_ms": wall_ms, "compute_ms": compute_ms, "collectives_ms": comm_ms,
            "other_ms": wall_ms - compute_ms - comm_ms, "aten_calls": calls / steps}


def _device_batch(ctx: Ctx, batch: Any) -> tuple[Tensor, Tensor]:
    x, y = batch
    return x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)


def _hand_loop(ctx: Ctx, step: Callable[[Tensor, Tensor], Any]) -> dict[str, Any]:
    timer = Timer(ctx)
    batches = iter(ctx.loader())
    for i in range(ctx.total_steps):
        x, y = _device_batch(ctx, next(batches))
        timer.begin(i)
        loss = step(x, y)
        timer.end(i, loss)
    return timer.result()


def _states(model: Any = None, optimizer: Any = None, *, engine: Any = None) -> dict[str, int]:
    from lightning_parallel.callbacks.model_states import model_state_bytes

    return model_state_bytes(model, optimizer, engine=engine)


def _plain_step(model: Any, net: Any, opt: Any) -> Callable[[Tensor, Tensor], float]:
    """One training step of ``net`` (the model or its wrapper): zero the gradients first, as Lightning does, so the
    last step's gradients are still there to be measured."""

    def step(x: Tensor, y: Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = model.pipeline_loss(net(x), y)
        loss.backward()
        opt.step()
        return float(loss.item())

    return step


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The GPT's own optimizer (AdamW, decayed and non-decayed groups), built from the parameters as they are now."""
    return model.configure_optimizers()["optimizer"]  # type: ignore[operator,no-any-return]


# ============================================================================================== hand-written loops
def hand_one(ctx: Ctx) -> dict[str, Any]:
    model = ctx.model().to(ctx.device)
    if ctx.device.type == "cuda" and ctx.a.dp_devices > 1:
        net: Any = nn.DataParallel(model, device_ids=list(range(ctx.a.dp_devices)))
    else:
        net = model
    opt = _adamw(model)
    out = _hand_loop(ctx, _plain_step(model, net, opt))
    out["states"] = _states(model, opt)
    return out


def hand_ddp(ctx: Ctx, zero: bool = False) -> dict[str, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = ctx.model().to(ctx.device)
    ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    if ctx.counter is not None:
        _python_allreduce_hook(ddp)
    if zero:
        groups = _adamw(model).param_groups
        opt: Any = ZeroRedundancyOptimizer(
            [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
            optimizer_class=torch.optim.AdamW, lr=groups[0]["lr"], betas=groups[0]["betas"])
    else:
        opt = _adamw(model)
    out = _hand_loop(ctx, _plain_step(model, ddp, opt))
    if zero:  # ZeroRedundancyOptimizer's local optimizer holds this rank's share of the states
        out["states"] = _states(model, opt.optim)
    else:
        out["states"] = _states(model, opt)
    return out


def _fsdp(model: Any, mesh: Any = None, reshard: bool = True) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def hand_fsdp(ctx: Ctx, reshard: bool = True) -> dict[str, Any]:
    model = ctx.model().to(ctx.device)
    _fsdp(model, reshard=reshard)
    opt = _adamw(model)
    out = _hand_loop(ctx, _plain_step(model, model, opt))
    out["states"] = _states(model, opt)
    return out


def _offload_config(ctx: Ctx) -> dict[str, Any]:
    from lightning_parallel.parallel.offload.config import OffloadEngineConfig

    cfg = OffloadEngineConfig.from_dict({"zero_optimization": {
        "stage": ctx.case.zero, "offload_optimizer": {"device": ctx.case.offload}}}).to_deepspeed()
    cfg.update(train_micro_batch_size_per_gpu=ctx.a.batch // ctx.case.dp, gradient_accumulation_steps=1,
               gradient_clipping=0.0)
    return cfg


def _host_adam(model: Any) -> Any:
    """DeepSpeed's CPU Adam (AdamW mode) over the GPT's own parameter groups and hyper-parameters."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups = _adamw(model).param_groups
    return DeepSpeedCPUAdam([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                            lr=groups[0]["lr"], betas=groups[0]["betas"], adamw_mode=True)


def hand_deepspeed(ctx: Ctx) -> dict[str, Any]:
    import deepspeed

    model = ctx.model()
    opt = _host_adam(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_offload_config(ctx),
                                      dist_init_required=False)

    def step(x: Tensor, y: Tensor) -> float:
        loss = model.pipeline_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    out = _hand_loop(ctx, step)
    out["states"] = _states(engine=engine)
    engine.destroy()
    return out


def tp_plan(model: Any) -> dict[str, Any]:
    """Megatron's split with torch's stock styles: q/k/v and fc_in column, out_proj and fc_out row, the token
    embedding vocab-parallel (row-wise lookup, all-reduce), lm_head column-parallel with vocab-sharded logits (the loss
    under ``loss_parallel``); attention and MLP inputs declared replicated DTensors so that their consumers' input
    gradients are summed first and all-reduced once per block input (Megatron's ``f``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    plan: dict[str, Any] = {}
    if getattr(model, "embed", None) is not None:
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for i in model.blocks:
        for sub in ("attn", "mlp"):
            plan[f"blocks.{i}.{sub}"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                           desired_input_layouts=(Replicate(),))
        for lin in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"):
            plan[f"blocks.{i}.{lin}"] = ColwiseParallel()
        for lin in ("attn.out_proj", "mlp.fc_out"):
            plan[f"blocks.{i}.{lin}"] = RowwiseParallel()
    if getattr(model, "head", None) is not None:
        plan["head.lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def apply_tp(model: Any, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, tp_plan(model))


def _mesh(ctx: Ctx) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, ctx.dims.shape, mesh_dim_names=ctx.dims.order)


def hand_tp(ctx: Ctx) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = _mesh(ctx)
    model = ctx.model().to(ctx.device)
    apply_tp(model, mesh["tp"])
    if ctx.case.dp > 1:
        _fsdp(model, mesh=mesh["dp"])
    opt = _adamw(model)

    def step(x: Tensor, y: Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = model.pipeline_loss(model(x), y)
            loss.backward()
        opt.step()
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    out = _hand_loop(ctx, step)
    out["states"] = _states(model, opt)
    return out


def _stage_module(ctx: Ctx, model: Any) -> Any:
    """Keep this pipeline rank's layers of ``[embed, block 0..L-1, head]`` (balanced by layer count)."""
    from lightning_parallel.parallel.pipeline import stage_ranges

    layers = ["embed", *[f"blocks.{i}" for i in model.blocks], "head"]
    start, stop = stage_ranges(len(layers), ctx.case.pp)[ctx.coords.pp]
    keep = set(layers[start:stop])
    if "embed" not in keep:
        model.embed = None
    if "head" not in keep:
        model.head = None
    for i in list(model.blocks):
        if f"blocks.{i}" not in keep:
            del model.blocks[i]
    return model


def hand_pipeline(ctx: Ctx) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = _mesh(ctx)
    model = _stage_module(ctx, ctx.model()).to(ctx.device)
    tp = ctx.case.tp > 1
    if tp:
        apply_tp(model, mesh["tp"])
    stage = PipelineStage(model, ctx.coords.pp, ctx.case.pp, ctx.device, group=mesh["pp"].get_group())
    first, last = ctx.coords.pp == 0, ctx.coords.pp == ctx.case.pp - 1

    def loss_fn(out: Any, target: Tensor) -> Tensor:
        return model.pipeline_loss(out, target)  # type: ignore[no-any-return]

    schedule = Schedule1F1B(stage, ctx.a.micro_batches, loss_fn=loss_fn)
    opt = _adamw(model)
    dp_group = mesh["dp"].get_group() if ctx.case.dp > 1 else None

    def step(x: Tensor, y: Tensor) -> float | None:
        opt.zero_grad(set_to_none=True)
        losses: list[Tensor] = []
        with loss_parallel() if tp else contextlib.nullcontext():
            if first:
                schedule.step(x, target=y if last else None, losses=losses if last else None)
            elif last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        if dp_group is not None:  # data parallel over dp: the mean of the local gradient shards
            for p in model.parameters():
                if p.grad is not None:
                    local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    dist.all_reduce(local, group=dp_group)
                    local.div_(ctx.case.dp)
        opt.step()
        if not last:
            return None
        values = [(t.full_tensor() if hasattr(t, "full_tensor") else t).item() for t in losses]
        return sum(values) / len(values)

    out = _hand_loop(ctx, step)
    out["states"] = _states(model, opt)
    return out


HAND: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "dp": hand_one, "ddp": hand_ddp, "zero1": functools.partial(hand_ddp, zero=True),
    "zero2": functools.partial(hand_fsdp, reshard=False), "zero3": hand_fsdp, "offload": hand_deepspeed,
    "tp": hand_tp, "tp2d": hand_tp, "pp": hand_pipeline, "hybrid": hand_pipeline,
}


# ============================================================================================== Trainer runs
def _probe(ctx: Ctx) -> Any:
    import lightning.pytorch as pl

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.timer = Timer(ctx)

        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            from torch.nn.parallel import DistributedDataParallel

            if ctx.counter is not None and isinstance(trainer.strategy.model, DistributedDataParallel):
                _python_allreduce_hook(trainer.strategy.model)

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.timer.begin(batch_idx)

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            if hasattr(loss, "full_tensor"):
                loss = loss.full_tensor()
            self.timer.end(batch_idx, None if loss is None else loss.detach().item())
            if batch_idx == ctx.total_steps - 1:
                from lightning_parallel.callbacks.model_states import measure_rank_states

                ctx.out["states"] = measure_rank_states(trainer, pl_module)

    return Probe()


def _data_module(ctx: Ctx) -> Any:
    import lightning.pytorch as pl

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return ctx.loader()

    return Data()


def _model_parallel_gpt(ctx: Ctx) -> Any:
    """The GPT for Lightning's ModelParallelStrategy: ``configure_model`` applies the hand-written plan (TP over
    ``tensor_parallel``, FSDP2 over ``data_parallel``), the loss and its backward run under ``loss_parallel``."""
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_parallel.models import GPT

    tp = ctx.case.tp

    class ModelParallelGPT(GPT):
        def configure_model(self) -> None:
            mesh = self.device_mesh
            if tp > 1:
                apply_tp(self, mesh["tensor_parallel"])
            if mesh["data_parallel"].size() > 1:
                _fsdp(self, mesh=mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            with loss_parallel() if tp > 1 else contextlib.nullcontext():
                return self._loss(batch)

        def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
            with loss_parallel() if tp > 1 else contextlib.nullcontext():
                loss.backward()

    return ctx.model(ModelParallelGPT)


def _host_adam_gpt(ctx: Ctx) -> Any:
    """The GPT with DeepSpeed's CPU Adam as its optimizer, as Lightning's ``deepspeed`` offload needs (DeepSpeed
    refuses a torch optimizer under ZeRO-Offload); the library's ``lp_zero_offload`` makes that swap itself."""
    from lightning_parallel.models import GPT

    class HostAdamGPT(GPT):
        def configure_optimizers(self) -> Any:
            return _host_adam(self)

    return ctx.model(HostAdamGPT)


def _our_strategy(ctx: Ctx) -> Any:
    from lightning_parallel.strategies import (
        LPDDPStrategy,
        LPDPStrategy,
        LPHybridStrategy,
        LPPipelineStrategy,
        LPShardedStrategy,
        LPTensorStrategy,
        LPZeroOffloadStrategy,
    )

    c, m = ctx.case, ctx.a.micro_batches
    if c.key == "dp":
        return LPDPStrategy()
    if c.key == "ddp":
        return LPDDPStrategy()
    if c.key in ("zero1", "zero2", "zero3"):
        return LPShardedStrategy(zero_stage=c.zero)
    if c.key == "offload":
        return LPZeroOffloadStrategy(zero_stage=c.zero, offload=c.offload)  # type: ignore[arg-type]
    if c.key in ("tp", "tp2d"):
        return LPTensorStrategy({"data_parallel_size": c.dp, "tensor_parallel_size": c.tp, "zero_stage": c.zero})
    if c.key == "pp":
        return LPPipelineStrategy({"pipeline_parallel_size": c.pp, "num_micro_batches": m,
                                   "pipeline_schedule": "1f1b"})
    return LPHybridStrategy({"data_parallel_size": c.dp, "pipeline_parallel_size": c.pp,
                             "tensor_parallel_size": c.tp, "zero_stage": 0, "num_micro_batches": m,
                             "pipeline_schedule": "1f1b"})


def _lightning_strategy(ctx: Ctx) -> Any:
    from lightning.pytorch import strategies as ls

    name = lightning_name(ctx.case, ctx.device.type)
    if name == "ddp":
        return ls.DDPStrategy()
    if name == "model_parallel":
        return ls.ModelParallelStrategy(data_parallel_size=ctx.case.dp, tensor_parallel_size=ctx.case.tp)
    if name is not None and name.startswith("deepspeed"):
        stage = int(name.split("_")[2])
        return ls.DeepSpeedStrategy(stage=stage, offload_optimizer=name.endswith("offload"))
    raise ValueError(f"case {ctx.case.key}: no Lightning built-in on {ctx.device.type}")


def run_trainer(ctx: Ctx) -> dict[str, Any]:
    import lightning.pytorch as pl

    lightning = ctx.role == "lightning"
    strategy = _lightning_strategy(ctx) if lightning else _our_strategy(ctx)
    name = lightning_name(ctx.case, ctx.device.type) if lightning else None
    if name == "model_parallel":
        model = _model_parallel_gpt(ctx)
    elif name is not None and name.endswith("offload"):
        model = _host_adam_gpt(ctx)
    else:
        model = ctx.model()
    probe = _probe(ctx)
    devices = ctx.a.dp_devices if ctx.case.key == "dp" else ctx.world
    trainer = pl.Trainer(accelerator=ctx.device.type, devices=devices, strategy=strategy,
                         max_steps=ctx.total_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[probe])
    trainer.fit(model, datamodule=_data_module(ctx))
    return {**probe.timer.result(), **ctx.out}


# ============================================================================================== one rank
def _rss_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def _rank_main(local_rank: int, job: dict[str, Any]) -> None:
    """One rank of one run: set the torchrun-style environment, create the process group, run, write the result."""
    a, case, role, world = job["args"], CASES[job["case"]], job["role"], job["world"]
    out_file = Path(job["folder"]) / f"rank{local_rank}.json"
    start_rss = _rss_kb("VmRSS") * 1024 if a.device == "cpu" else 0
    try:
        import logging
        import warnings

        from lightning_parallel.parallel.faults.watchdog import enable_fault_handler

        enable_fault_handler()  # a crashing rank prints its threads' Python stacks
        warnings.filterwarnings("ignore")
        for name in ("lightning.pytorch", "lightning.fabric", "lightning_parallel", "DeepSpeed"):
            logging.getLogger(name).setLevel(logging.ERROR)
        torch.set_num_threads(a.threads)
        if world > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]), WORLD_SIZE=str(world),
                              RANK=str(local_rank), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world),
                              GROUP_RANK="0", ROLE_RANK=str(local_rank), ROLE_WORLD_SIZE=str(world),
                              NODE_RANK="0", TORCHELASTIC_RUN_ID=f"bench-{job['port']}")
        if a.device == "cuda":
            device = torch.device("cuda", local_rank if world > 1 else 0)
            torch.get_device_module(device).set_device(device)
        else:
            device = torch.device("cpu")
        if world > 1:
            dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=local_rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=a.timeout),
                                    device_id=device if a.device == "cuda" else None)
        from lightning_parallel.parallel.dims import ParallelDims

        dims = ParallelDims(dp=case.dp if case.processes is None else 1, pp=case.pp, tp=case.tp, world_size=world)
        counter = None
        if job["count"]:
            counter = CommCount(local_rank, dims)
            counter.install()
        g = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, a.vocab, (a.batch * (a.warmup + a.steps + 1), a.seq + 1), generator=g)
        ctx = Ctx(a=a, case=case, role=role, rank=local_rank, world=world, device=device, dims=dims,
                  counter=counter, tokens=tokens, profile=job.get("profile"))
        result = HAND[case.key](ctx) if role == "torch" else run_trainer(ctx)
        if a.device == "cuda":
            result["peak_bytes"] = torch.get_device_module(device).max_memory_allocated(device)
        else:
            result["peak_bytes"] = _rss_kb("VmHWM") * 1024
            result["start_bytes"] = start_rss
        if counter is not None:
            result["comm"] = dict(counter.bytes)
            result["comm_calls"] = dict(counter.calls)
        result["coords"] = list(dims.coords(local_rank))
        out_file.write_text(json.dumps(result))
    except BaseException:
        out_file.write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.barrier()  # no rank tears down while another still talks to rank 0's store
                dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(a: argparse.Namespace, case: Case, role: str, *, count: bool,
              profile: str | None = None) -> dict[str, Any]:
    """Start ``case.world`` ranks for one run of ``role``; every rank's result (or the first error)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="lp_bench_") as folder:
        job = {"args": a, "case": case.key, "role": role, "world": case.world, "folder": folder,
               "port": _free_port(), "count": count, "profile": profile}
        method = a.start_method
        try:
            mp.start_processes(_rank_main, args=(job,), nprocs=case.world, start_method=method, join=True)
        except Exception as err:
            ranks = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("rank*.json"))]
            errors = [r["error"] for r in ranks if "error" in r]
            return {"error": errors[0] if errors else f"{type(err).__name__}: {err}"}
        ranks = [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(case.world)]
    return {"ranks": ranks}


# ============================================================================================== formulas
def _local_params(a: argparse.Namespace, case: Case) -> int:
    """Parameters of the busiest pipeline stage on one tp rank, before any dp sharding (the formulas' Psi): the
    planner's count for the GPT's shape."""
    from lightning_parallel.models import GPT
    from lightning_parallel.planner.detect import model_spec_from_module

    with torch.device("meta"):
        model = GPT(n_layer=a.layers, n_head=a.heads, n_embd=a.hidden, block_size=a.seq, vocab_size=a.vocab)
    spec, _ = model_spec_from_module(model)
    return spec.params_per_device(pp=case.pp, tp=case.tp)


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
    s = model_states(n, StateBytes(param=4, grad=4, optimizer=8), dp=case.dp, zero_stage=case.zero,
                     offload=case.offload)
    return s.device + s.host


def comm_theory(a: argparse.Namespace, case: Case) -> dict[str, float]:
    """Bytes one rank sends per step by axis (ring model): the technique's textbook figure."""
    out: dict[str, float] = {}
    psi = _local_params(a, case) * 4
    d, b, s, h = case.dp, a.batch // case.dp, a.seq, a.hidden
    if d > 1 and case.key != "dp":
        factor = 3 if case.zero == 3 else 2  # ZeRO-3: all-gather forward + backward, reduce-scatter; else 2 Psi
        out["dp"] = factor * (d - 1) / d * psi
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
    return out


# ============================================================================================== the table
def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(a: argparse.Namespace, case: Case, reps: list[dict[str, dict[str, Any]]],
              counted: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per role: medians, paired ratios, memory and traffic."""
    rows = []
    roles = [r for r in reps[0] if "error" not in reps[0][r]] if reps else []
    for role in reps[0] if reps else []:
        row: dict[str, Any] = {"case": case.key, "title": case.title, "role": role}
        runs = [rep[role] for rep in reps]
        failed = next((r for r in runs if "error" in r), None)
        if failed is not None:
            row["error"] = failed["error"].strip().splitlines()[-1][:300]
            row["error_full"] = failed["error"]
            rows.append(row)
            continue
        per_rep = [_median(run["ranks"][0]["step_s"]) for run in runs]
        row["step_s_reps"] = per_rep
        row["step_s"] = _median(per_rep)
        row["tokens_per_s"] = a.batch * a.seq / row["step_s"]
        row["cpu_s"] = _median([_median(run["ranks"][0]["cpu_s"]) for run in runs])
        for anchor in ("torch", "lightning"):
            if anchor == role or role != "ours" or anchor not in roles:
                continue
            for key, prefix in (("step_s", "x"), ("cpu_s", "cpu_x")):  # paired: the same repetition's runs
                ratios = [_median(run["ranks"][0][key]) / _median(rep[anchor]["ranks"][0][key])
                          for run, rep in zip(runs, reps, strict=True)]
                row[f"{prefix}_{anchor}"] = _median(ratios)
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
        row["comm_theory"] = comm_theory(a, case)
        rows.append(row)
    torch_row = next((r for r in rows if r["role"] == "torch" and "losses" in r), None)
    for row in rows:
        if torch_row is not None and row is not torch_row and row.get("losses"):
            row["dloss"] = max(abs(x - y) for x, y in zip(row["losses"], torch_row["losses"], strict=False))
    return rows


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
        case = CASES[r["case"]]
        name = {"ours": case.title, "torch": f"torch: {case.anchor}",
                "lightning": f"Lightning `{lightning_name(case, a.device)}`"}[r["role"]]
        if "error" in r:
            lines.append(f"| {case.key} | {name} | failed: {r['error']} |" + " |" * 10)
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
        lines.append(f"| {case.key} | {name} | {r['step_s'] * 1e3:.1f} | {xt} | {xl} | {cpu} | "
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


# ============================================================================================== main
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


def available(a: argparse.Namespace, case: Case) -> str | None:
    """Why ``case`` cannot run here, or None."""
    if a.device == "cuda":
        n = torch.cuda.device_count()
        need = case.dp if case.key == "dp" else case.world
        if n < need:
            return f"needs {need} GPUs, {n} present"
    return None


def _roles(a: argparse.Namespace, case: Case) -> list[str]:
    roles = [r for r in a.roles if r != "lightning" or lightning_name(case, a.device) is not None]
    return roles


def profile(a: argparse.Namespace, case: Case) -> None:
    """Run the library and its anchors under torch.profiler and cProfile on rank 0 (4 steps after warm-up); print
    the top ops by self CPU time, the Python functions by cumulative time, and the time split of each."""
    print(f"profiling {case.key}: {case.title} vs torch: {case.anchor}", flush=True)
    for role in _roles(a, case):
        res = run_world(a, case, role, count=False, profile="full")
        if "error" in res:
            print(f"{role}: failed\n{res['error']}")
            continue
        prof = res["ranks"][0].get("profile", {})
        print(f"\n== {role}: median step {_median(res['ranks'][0]['step_s']) * 1e3:.1f} ms; profiled: "
              f"{_split_text(prof)}\n{prof.get('table', '')}\nPython functions (cProfile, the same steps, by "
              f"cumulative time):\n{prof.get('python', '')}")


def _split_text(prof: dict[str, Any]) -> str:
    if "wall_ms" not in prof:
        return "-"
    calls = f"; {prof['aten_calls']:.0f} aten op calls/step" if "aten_calls" in prof else ""
    return (f"{prof['wall_ms']:.1f} ms/step = compute {prof['compute_ms']:.1f} + collectives "
            f"{prof['collectives_ms']:.1f} + other {prof['other_ms']:.1f}{calls}")


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
            print(f"[bench] {case.key} {row['role']} profiled: {_split_text(row['split'])}", flush=True)


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


def render(path: Path) -> None:
    """The table and the plots of an earlier run, from its ``results.json`` (written next to it)."""
    data = json.loads(path.read_text())
    a = argparse.Namespace(**{**data["args"], "profile": None})
    rows = data["rows"]
    text = markdown(a, rows, data.get("header", ""), data.get("skipped", {}))
    (path.parent / "results.md").write_text(text)
    written = plots(a, rows, path.parent)
    print(f"{text}\n[bench] wrote {path.parent / 'results.md'}, {', '.join(str(p) for p in written)}")


def markdown(a: argparse.Namespace, rows: list[dict[str, Any]], header: str, skipped: dict[str, str]) -> str:
    """``results.md``: the header, the table, where the time goes (cases above 3 %), the skipped cases."""
    text = f"{header}\n\n{table(a, rows)}\n"
    split = split_table(rows)
    if split:
        text += ("\nWhere the time goes, for the cases above 3 % (rank 0, torch.profiler over the timed steps of one "
                 "more run of each variant; compute = self time of aten ops, collectives = c10d and functional "
                 f"collective ops with their waits, other = the rest of the wall time):\n\n{split}\n")
    if skipped:
        text += "\n" + "\n".join(f"- {k}: skipped, {v}" for k, v in skipped.items()) + "\n"
    return text


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.dp_devices = 2
    if a.render is not None:
        render(Path(a.render))
        return 0
    import lightning_parallel  # noqa: F401  (registers the strategies; imported once, before forking)

    if any(k == "offload" for k in a.cases) or a.profile == "offload":
        import deepspeed  # noqa: F401  (import once in the parent; the ops were built by the set-up)
    if a.profile is not None:
        profile(a, CASES[a.profile])
        return 0
    date = datetime.date.today().isoformat()
    folder = Path(a.out) if a.out else ROOT / "benchmarks" / date
    folder.mkdir(parents=True, exist_ok=True)
    machine = _machine(a)
    print(f"[bench] {machine}; GPT {a.layers} layers x {a.hidden} (heads {a.heads}), seq {a.seq}, vocab {a.vocab}, "
          f"global batch {a.batch}; {a.warmup} warm-up + {a.steps} timed steps; {a.reps} interleaved reps; "
          f"device {a.device}", flush=True)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for key in a.cases:
        case = CASES[key]
        why = available(a, case)
        if why is not None:
            skipped[key] = why
            print(f"[bench] {key}: skipped ({why})", flush=True)
            continue
        roles = _roles(a, case)
        reps: list[dict[str, dict[str, Any]]] = []
        for rep in range(a.reps):
            results: dict[str, dict[str, Any]] = {}
            for role in roles[rep % len(roles):] + roles[:rep % len(roles)]:  # rotated: no variant always first
                t0 = time.perf_counter()
                results[role] = run_world(a, case, role, count=False)
                status = "failed" if "error" in results[role] else \
                    f"median step {_median(results[role]['ranks'][0]['step_s']) * 1e3:.1f} ms"
                print(f"[bench] {key} rep {rep + 1}/{a.reps} {role}: {status} ({time.perf_counter() - t0:.1f} s "
                      f"with start-up; {time.perf_counter() - started:.0f} s in all)", flush=True)
            reps.append(results)
        counted = {role: run_world(a, case, role, count=True) for role in roles}
        case_rows = summarize(a, case, reps, counted)
        where_time_goes(a, case, case_rows)
        for r in case_rows:
            if "error" in r:
                print(f"[bench] {key} {r['role']} failed:\n{r['error_full']}", flush=True)
        rows.extend(case_rows)
        print(table(a, case_rows), flush=True)
    elapsed = time.perf_counter() - started
    header = (f"Measured {date} on {machine}; device {a.device}; GPT {a.layers} x {a.hidden}, seq {a.seq}, global "
              f"batch {a.batch}, fp32 AdamW; {a.reps} interleaved repetitions of {a.steps} timed steps (median); "
              f"`python scripts/bench.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
              f"took {elapsed:.0f} s.")
    text = markdown(a, rows, header, skipped)
    (folder / "results.md").write_text(text)
    (folder / "results.json").write_text(json.dumps({
        "machine": machine, "date": date, "header": header, "args": vars(a),
        "rows": [{k: v for k, v in r.items() if k != "error_full"} for r in rows], "skipped": skipped,
        "seconds": elapsed}, indent=1, default=str))
    written = plots(a, rows, folder)
    print(f"\n{text}")
    print(f"[bench] wrote {folder / 'results.json'}, {folder / 'results.md'}, "
          f"{', '.join(str(p) for p in written)}")
    failed = [r for r in rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
