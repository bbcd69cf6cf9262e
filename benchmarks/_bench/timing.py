"""One rank's context (``Ctx``) and the step clock (``Timer``): step starts, CPU time, losses, the counted last step
and the optional profile."""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .cases import Case
from .counting import CommCount


def batches_per_step(a: argparse.Namespace) -> int:
    """Batches accumulated per optimizer step: ``--study accumulate``'s variant, 1 in the table."""
    return int(getattr(a, "accumulate", None) or 1)


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
    """None, "full" (``--profile``), "breakdown" (torch.profiler: where the time of a case above 3 % goes) or
    "split" (``--overhead``: plain, torch.profiler and cProfile windows of the timed steps)."""
    out: dict[str, Any] = field(default_factory=dict)

    @property
    def total_steps(self) -> int:
        return self.a.warmup + self.a.steps + 1  # the last one is counted (count runs) and never timed

    @property
    def accumulate(self) -> int:
        """Batches per optimizer step (:func:`batches_per_step`): a timed step is all of them."""
        return batches_per_step(self.a)

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
    ``"breakdown"`` -- torch.profiler over every timed step, summed as compute / collectives / the rest;
    ``"split"`` -- the timed steps in three equal windows of the same run (``--overhead``): plain (the step time),
    torch.profiler (compute / collectives), cProfile alone (Python self time by category, ``_bench.overhead``)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.starts: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float | None] = []
        self._stack: contextlib.ExitStack | None = None
        self._profiler: Any = None
        self._python: Any = None
        self._window: tuple[str, range] | None = None
        self._profile_wall = 0.0
        self.profile: dict[str, Any] = {}
        a, w = ctx.a, ctx.a.warmup
        self._windows: list[tuple[str, range]] = []
        if ctx.profile is not None and ctx.rank == 0:
            if ctx.profile == "split":
                k = a.steps // 3
                self._windows = [("ops", range(w + k, w + 2 * k)), ("python", range(w + 2 * k, w + 3 * k))]
            else:
                self._windows = [(ctx.profile, range(w, w + min(4 if ctx.profile == "full" else a.steps, a.steps)))]

    def begin(self, i: int) -> None:
        window = next((wd for wd in self._windows if len(wd[1]) and i == wd[1][0]), None)
        if window is not None:
            self._window = window
            if window[0] != "python":
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.ctx.device.type == "cuda"
                                                       else [])
                self._profiler = profile(activities=activities)
                self._profiler.__enter__()
            if window[0] in ("full", "python"):
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
        if self._window is not None and i == self._window[1][-1]:
            self._finish_window()
        if self._stack is not None:
            assert self.ctx.counter is not None
            self.ctx.counter.active = False
            self._stack.close()
            self._stack = None

    def _finish_window(self) -> None:
        wall = time.perf_counter() - self._profile_wall
        assert self._window is not None
        kind, steps = self._window
        n = len(steps)
        self._window = None
        if self._python is not None:
            self._python.disable()
        if kind == "python":
            from .overhead import python_split

            folder = getattr(self.ctx.a, "pstats_dir", None)
            if folder is not None:  # --overhead keeps rank 0's statistics: `python -m pstats` diffs them
                self._python.dump_stats(f"{folder}/{self.ctx.case.name}_{self.ctx.role}.pstats")
            self.profile["python"] = {"steps": n, "wall_ms": wall * 1e3 / n, **python_split(self._python, n)}
            self._python = None
            return
        self._profiler.__exit__(None, None, None)
        events = self._profiler.key_averages()
        self._profiler = None
        if kind == "ops":
            self.profile["ops"] = {"steps": n, **breakdown(events, wall, n)}
            return
        if kind == "breakdown":
            self.profile = {"steps": n, **breakdown(events, wall, n)}
            return
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(self._python, stream=text).sort_stats("cumulative").print_stats(45)
        self._python = None
        self.profile = {"table": events.table(sort_by="self_cpu_time_total", row_limit=30),
                        "python": text.getvalue(), "steps": n, **breakdown(events, wall, n)}

    def result(self) -> dict[str, Any]:
        a = self.ctx.a
        periods = [b - s for s, b in zip(self.starts, self.starts[1:], strict=False)]
        cpu = [b - s for s, b in zip(self.cpu, self.cpu[1:], strict=False)]
        out: dict[str, Any] = {"step_s": periods[a.warmup:a.warmup + a.steps], "losses": self.losses,
                               "cpu_s": cpu[a.warmup:a.warmup + a.steps]}
        if self.ctx.profile == "split" and self.profile:
            plain = sorted(periods[a.warmup:a.warmup + a.steps // 3])
            self.profile["plain_ms"] = plain[len(plain) // 2] * 1e3
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


