"""Calibration: measure this machine's rates (:class:`~lightning_parallel.planner.rates.Rates`) and cache them.

``lightning-parallel plan --calibrate`` (and ``lp_auto`` with ``--planner.calibration now``) runs it once per machine,
measuring everything :data:`CALIBRATION_REPEATS` times and keeping the median of each figure:

* matmul throughput of square GEMMs at a few edges (:data:`~lightning_parallel.planner.rates.SHAPE_CLASSES`), by dtype
  (fp32 and bf16; fp16 too on accelerators), inside every rank at once, so that ranks sharing cores or a memory
  system are measured as a run finds them (rank 0's figures are kept);
* memory bandwidth: a 64 MiB tensor copy (read + write); and what a layer's memory-bound ops reach (GELU forward and
  backward, LayerNorm, an add), which the step-time model uses for them;
* the four collectives (all-reduce, reduce-scatter, all-gather, point-to-point) over ``ranks`` processes forked on
  127.0.0.1: gloo on CPU, NCCL on GPUs (one GPU per rank). Each is timed at several sizes and ``alpha`` (latency)
  and ``beta`` (bus bandwidth) are fitted by least squares to ``t = alpha + f(n) S / beta`` (:func:`fit_alpha_beta`);
  the link between nodes cannot be measured from one machine and keeps its profile or default figures;
* the framework's host overhead per step: a Lightning ``fit`` of a one-layer model, its step time; and the time one
  eager op takes to dispatch (a tiny add);
* the optimizer step (torch's AdamW as a run calls it): its cost per parameter tensor (many small tensors), per
  ``DTensor`` parameter (FSDP2 and tensor-parallel parameters, whose every op goes through DTensor's dispatch) and
  its bytes/s over the parameter, gradient and moments (one large tensor);
* what one unit of each parallel technique costs a step beyond its arithmetic, over the same ranks
  (:func:`measure_frameworks`): an FSDP2 unit, a Megatron pair of DTensor linears, a pipeline micro-batch and a
  layer's ring attention, each the slope of a training step's time over a few tiny units, so that what the latency
  of one collective alone misses (the Python around it, waiting for the other rank) is counted per unit; and, on
  CPU, an ``lp_ddp`` fit's step time over the ranks (the distributed host overhead);
* the calibrated peak: the best matmul rate measured, what MFU is reported against;
* on CPU, the cores this process may run on and the ranks measured at once, so that the step-time model can stretch a
  layout whose ranks outnumber the cores (:meth:`~lightning_parallel.planner.rates.Rates.core_share`).

The result is cached as JSON in ``$LIGHTNING_PARALLEL_CACHE`` (default ``~/.cache/lightning-parallel/``), one file
per machine key (:func:`machine_key`: host, device, rank count, torch version). ``LIGHTNING_PARALLEL_CALIBRATION=none``
(the test suite sets it) keeps the planner from reading or making one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.planner.rates import COLLECTIVES, SHAPE_CLASSES, Rates, default_rates, rates_from_dict

__all__ = [
    "ADAMW_BYTES_FP32",
    "ATTENTION_SHAPES",
    "CALIBRATION_REPEATS",
    "CALIBRATION_SIZES",
    "CP_RING_SHAPE",
    "CP_TINY_SHAPE",
    "HOST_ADAM_ELEMENTS",
    "OFFLOAD_UNITS",
    "OFFLOAD_WIDE",
    "OPTIMIZER_TENSORS",
    "attention_fit",
    "cache_dir",
    "cache_path",
    "cached_rates",
    "calibrate",
    "calibration_mode",
    "fit_alpha_beta",
    "format_rates",
    "machine_key",
    "measure_attention",
    "measure_collective_busy",
    "measure_frameworks",
    "measure_host_link",
    "measure_offload",
    "measure_optimizer",
    "median_rates",
    "offload_calibration_ops",
    "rates_for",
]

CALIBRATION_SIZES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20)
"""Buffer sizes (bytes) each collective is timed at."""
_BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_gather": lambda n: (n - 1) / n, "p2p": lambda n: 1.0}

Progress = Callable[[str], None]


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def machine_key(ranks: int, device: str | None = None) -> str:
    """``host-device-Nranks-torchV`` plus a short hash of it: what a calibration is valid for."""
    device = device or _device_type()
    name = torch.cuda.get_device_name(0) if device == "cuda" else (platform.processor() or platform.machine())
    text = f"{socket.gethostname()}|{device}|{name}|{ranks}|{torch.__version__}|{os.cpu_count()}"
    digest = hashlib.sha1(text.encode()).hexdigest()[:10]
    return f"{socket.gethostname()}-{device}-{ranks}ranks-{digest}"


def cache_dir() -> Path:
    """``$LIGHTNING_PARALLEL_CACHE``, else ``~/.cache/lightning-parallel``."""
    return Path(os.environ.get("LIGHTNING_PARALLEL_CACHE") or Path.home() / ".cache" / "lightning-parallel")


def cache_path(ranks: int) -> Path:
    return cache_dir() / f"calibration-{machine_key(ranks)}.json"


_MEMO: dict[str, tuple[float, Rates]] = {}


def cached_rates(ranks: int | None = None) -> Rates | None:
    """The cached calibration of this machine for ``ranks`` ranks (any rank count when None, the most ranks
    first); None when there is none."""
    folder = cache_dir()
    if ranks is not None:
        paths = [cache_path(ranks)]
    else:  # this machine's files only (host, device, torch version in the key), the most ranks first
        counts = sorted({int(m.group(1)) for p in (folder.glob("calibration-*.json") if folder.is_dir() else [])
                         if (m := re.search(r"-(\d+)ranks-", p.name))}, reverse=True)
        paths = [cache_path(n) for n in counts]
    for path in paths:
        if path.is_file():
            stamp = path.stat().st_mtime
            memo = _MEMO.get(str(path))
            if memo is not None and memo[0] == stamp:
                return memo[1]
            rates = rates_from_dict(json.loads(path.read_text())["rates"])
            _MEMO[str(path)] = (stamp, rates)
            return rates
    return None


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of ``t = alpha + x / beta`` over ``(x, t)`` points (``x``: the bus bytes ``f(n) S``), in relative
    error (weights ``1 / t^2``: the sizes span 4 KiB-16 MiB, and a plain fit lets the largest sizes' noise set the
    latency); alpha clamped at 0, beta at a positive value. Returns ``(alpha seconds, beta bytes/s)``."""
    if len(points) < 2:
        raise ValueError(f"fit_alpha_beta needs two points or more, got {len(points)}.")
    xs, ts = [p[0] for p in points], [p[1] for p in points]
    ws = [1.0 / max(t, 1e-12) ** 2 for t in ts]
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sum(ws)
    mt = sum(w * t for w, t in zip(ws, ts, strict=True)) / sum(ws)
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    slope = sum(w * (x - mx) * (t - mt) for w, (x, t) in zip(ws, points, strict=True)) / sxx if sxx else 0.0
    if slope <= 0:  # latency-bound at every size: bandwidth from the largest point
        slope = max(ts) / max(xs)
    alpha = max(mt - slope * mx, 0.0)
    return alpha, 1.0 / slope


def _timed(fn: Callable[[], Any], *, sync: Callable[[], None], seconds: float = 0.4, min_reps: int = 3) -> float:
    """Median seconds of one call of ``fn`` after a warm-up."""
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return statistics.median(times)


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    module = torch.get_device_module(device.type)
    return lambda: module.synchronize(device)


def measure_compute(device: torch.device, *, progress: Progress | None = None) -> dict[str, Any]:
    """Matmul FLOP/s by dtype and edge, and memory bandwidth, on ``device``."""
    sync = _sync_for(device)
    edges = SHAPE_CLASSES["cpu" if device.type == "cpu" else "gpu"]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if device.type != "cpu":
        dtypes["fp16"] = torch.float16
    table: dict[str, dict[str, float]] = {}
    for name, dtype in dtypes.items():
        table[name] = {}
        for edge in edges if device.type != "cpu" or dtype == torch.float32 else edges[:2]:  # CPU bf16 is slow
            a = torch.randn(edge, edge, device=device, dtype=dtype)
            b = torch.randn(edge, edge, device=device, dtype=dtype)
            seconds = _timed(partial(torch.mm, a, b), sync=sync)
            table[name][str(edge)] = 2.0 * edge**3 / seconds
            if progress:
                progress(f"matmul {name} {edge}x{edge}x{edge}: {table[name][str(edge)] / 1e9:,.1f} GFLOP/s")
    n = 16 * 2**20  # 64 MiB of fp32
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), sync=sync)
    bandwidth = 2.0 * 4 * n / seconds
    if progress:
        progress(f"memory bandwidth (64 MiB copy): {bandwidth / 1e9:,.1f} GB/s")
    elementwise = measure_elementwise(device, sync)
    if progress:
        progress(f"elementwise ops (GELU forward + backward, LayerNorm, add): {elementwise / 1e9:,.1f} GB/s")
    per_op = _timed(partial(_tiny_chain, device), sync=sync) / (3 * _CHAIN)
    if progress:
        progress(f"one eager op dispatched: {per_op * 1e6:,.1f} us")
    per_tensor, optimizer = measure_optimizer(device, sync)
    if progress:
        progress(f"optimizer step (AdamW): {per_tensor * 1e6:,.1f} us per tensor + {optimizer / 1e9:,.1f} GB/s")
    attention = measure_attention(device, sync)
    if progress:
        progress("attention (SDPA, causal, forward + backward): " + ", ".join(
            f"{_attention_flops(shape) / seconds / 1e9:,.1f} GFLOP/s at {seq} tokens"
            for shape, (seq, seconds) in zip(_attention_shapes(device.type), attention, strict=True)))
    host_link = measure_host_link(device, sync)
    if progress:
        progress(f"host link (16 MiB copies to and from {'pinned ' if device.type != 'cpu' else ''}host memory): "
                 f"{host_link / 1e9:,.1f} GB/s")
    return {"matmul": table, "memory_bandwidth": bandwidth, "elementwise_bandwidth": elementwise,
            "op_overhead": per_op, "optimizer_tensor": per_tensor, "optimizer_bandwidth": optimizer,
            "host_link_bandwidth": host_link, "attention": attention}


ATTENTION_SHAPES = {"cpu": ((4, 4, 64, 32), (4, 4, 256, 32)), "gpu": ((4, 16, 512, 64), (4, 16, 2048, 64))}
"""``(batch, heads, tokens, head dim)`` of the two causal attentions timed on each kind of device
(:func:`measure_attention`): a short and a long sequence, for a cost per call and a rate."""


def _attention_shapes(device_type: str) -> tuple[tuple[int, int, int, int], ...]:
    return ATTENTION_SHAPES["cpu" if device_type == "cpu" else "gpu"]


def _attention_flops(shape: tuple[int, int, int, int]) -> float:
    """The step-time model's count of an attention's forward and backward on ``(b, h, s, d)`` queries
    (``3 x 4 b s^2 h d``: scores and their product with the values, counted whole)."""
    b, h, s, d = shape
    return 3 * 4.0 * b * s * s * h * d


def _attention_step(q: torch.Tensor) -> None:
    """Forward and backward of torch's fused causal attention of ``q`` with itself."""
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()


def measure_attention(device: torch.device, sync: Callable[[], None]) -> list[tuple[int, float]]:
    """Seconds of the forward and backward of torch's fused attention (``scaled_dot_product_attention``, causal;
    fp32 on CPU, bf16 on accelerators) at each of :data:`ATTENTION_SHAPES`: ``[(tokens, seconds), ...]``. The
    calibration fits a cost per call and a rate against the GEMMs' to them (:func:`attention_fit`)."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    out = []
    for shape in _attention_shapes(device.type):
        q = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
        out.append((shape[2], _timed(partial(_attention_step, q), sync=sync)))
    return out


def attention_fit(points: list[tuple[int, float]], rates: Rates, device_type: str) -> tuple[float, float]:
    """``(efficiency, seconds per call)`` of the attention core from :func:`measure_attention`'s two points: each
    point's time is ``per call + flops / (efficiency x GEMM rate at the attention's shape)`` -- the GEMM rate as the
    step-time model reads it (``m = n = tokens``, ``k`` = head dim). The efficiency is kept within (0, 1]."""
    dtype = "fp32" if device_type == "cpu" else "bf16"
    at_gemm_rate = [(_attention_flops(shape) / rates.matmul_rate(dtype, m=shape[2], n=shape[2], k=shape[3]), seconds)
                    for shape, (_, seconds) in zip(_attention_shapes(device_type), points, strict=True)]
    (m0, t0), (m1, t1) = at_gemm_rate[0], at_gemm_rate[-1]
    efficiency = min(1.0, (m1 - m0) / (t1 - t0)) if t1 > t0 and m1 > m0 else min(1.0, m1 / t1)
    efficiency = max(efficiency, 1e-3)
    return efficiency, max(0.0, t0 - m0 / efficiency)


def measure_host_link(device: torch.device, sync: Callable[[], None]) -> float:
    """Bytes/s of a 16 MiB fp32 copy from ``device`` to host memory (pinned on an accelerator) and back, the mean
    of the two directions: what ZeRO-offload moves gradients and parameters over (on CPU a copy between two host
    buffers)."""
    n = 2**22
    dev = torch.randn(n, device=device)
    host = torch.empty(n, pin_memory=device.type != "cpu")
    down = _timed(lambda: host.copy_(dev, non_blocking=True), sync=sync, seconds=0.2)
    up = _timed(lambda: dev.copy_(host, non_blocking=True), sync=sync, seconds=0.2)
    return 2 * 4 * n / (down + up)


OPTIMIZER_TENSORS = 64
"""Small parameter tensors the optimizer calibration steps at once (the per-tensor cost is their step over them)."""
ADAMW_BYTES_FP32 = 28
"""Bytes an fp32 AdamW step reads and writes per parameter: the parameter (read, write), its gradient (read), the
two moments (read, write each)."""


def _adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """torch's AdamW over ``params``, its gradients set to ones and its state made (one step), as a run's step meets
    it."""
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    return opt


def measure_optimizer(device: torch.device, sync: Callable[[], None]) -> tuple[float, float]:
    """torch's AdamW step (its default implementation on ``device``): seconds per parameter tensor (the step over
    :data:`OPTIMIZER_TENSORS` 16-element tensors, per tensor) and bytes/s over a 2M-element tensor's
    :data:`ADAMW_BYTES_FP32` bytes per parameter (its per-tensor cost taken out)."""
    small = [torch.zeros(16, device=device, requires_grad=True) for _ in range(OPTIMIZER_TENSORS)]
    per_tensor = _timed(_adamw(small).step, sync=sync) / OPTIMIZER_TENSORS
    n = 2**21
    big = [torch.zeros(n, device=device, requires_grad=True)]
    seconds = max(_timed(_adamw(big).step, sync=sync) - per_tensor, 1e-9)
    return per_tensor, ADAMW_BYTES_FP32 * n / seconds


_CHAIN = 50


def _tiny_chain(device: torch.device) -> None:
    """``_CHAIN`` tiny ops with autograd, then their backward (about twice as many ops): dispatch, not work."""
    x = torch.ones(8, device=device, requires_grad=True)
    y = x
    for _ in range(_CHAIN):
        y = y * 1.0001
    y.sum().backward()


def measure_elementwise(device: torch.device, sync: Callable[[], None]) -> float:
    """Bytes/s of a layer's memory-bound ops on a 16 MiB fp32 activation of width 256: GELU forward and backward
    (5 passes), LayerNorm forward (2), an add (3); total bytes over total time."""
    x = torch.randn(2**22 // 256, 256, device=device, requires_grad=True)
    other = torch.randn_like(x).detach()
    nbytes = x.numel() * 4

    def gelu() -> None:
        torch.nn.functional.gelu(x).sum().backward()

    ops: list[tuple[Callable[[], Any], int]] = [
        (gelu, 5), (partial(torch.nn.functional.layer_norm, x.detach(), (256,)), 2),
        (partial(torch.add, x.detach(), other), 3)]
    seconds = sum(_timed(fn, sync=sync) for fn, _ in ops)
    return sum(passes for _, passes in ops) * nbytes / seconds


def measure_collectives(world: int, device: torch.device) -> dict[str, list[tuple[float, float]]]:
    """Inside an initialized process group of ``world`` ranks: ``(bus bytes, seconds)`` per collective and size
    (point-to-point needs two ranks)."""
    out: dict[str, list[tuple[float, float]]] = {c: [] for c in COLLECTIVES}
    for size in CALIBRATION_SIZES:
        for name, seconds in _time_size(size, world, device).items():
            out[name].append(((float(size) if name == "p2p" else _BUS[name](world) * size), seconds))
    return out


def measure_collective_busy(world: int, device: torch.device, *, size: int = 2**20, reps: int = 20) -> float:
    """The share of a collective's wall time its process spends on the CPU (every thread: gloo's copies and sockets),
    over all-reduces, reduce-scatters and all-gathers of ``size`` bytes: what of a collective stretches when CPU ranks
    outnumber the cores (the rest is waiting)."""
    import torch.distributed as dist

    sync = _sync_for(device)
    calls = _collective_calls(size, world, device)
    dist.barrier()
    wall = cpu = 0.0
    for name in ("all_reduce", "reduce_scatter", "all_gather"):
        fn = calls[name]
        fn()
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            fn()
        sync()
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
    return min(cpu / wall, 1.0) if wall > 0 else 1.0


def _collective_calls(size: int, world: int, device: torch.device) -> dict[str, Callable[[], Any]]:
    """Each collective on a ``size``-byte fp32 buffer, ready to call on every rank (point-to-point, with two ranks or
    more: a round trip 0 <-> 1)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    whole = torch.ones(size // 4, device=device)
    part = torch.empty(size // 4 // world, device=device)

    def p2p() -> None:
        if rank == 0:
            dist.send(whole, dst=1)
            dist.recv(whole, src=1)
        elif rank == 1:
            dist.recv(whole, src=0)
            dist.send(whole, dst=0)

    calls: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole),
        "all_gather": lambda: dist.all_gather_into_tensor(whole, part),
    }
    if world > 1:
        calls["p2p"] = p2p
    return calls


def _time_size(size: int, world: int, device: torch.device) -> dict[str, float]:
    """Seconds of each collective on a ``size``-byte fp32 buffer (point-to-point: half a round trip 0 <-> 1)."""
    import torch.distributed as dist

    sync = _sync_for(device)
    reps = 30 if size <= 2**20 else 8  # the same count on every rank: a collective called unevenly would hang
    out: dict[str, float] = {}
    for name, fn in _collective_calls(size, world, device).items():
        dist.barrier()
        fn()  # warm-up
        sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) / (2 if name == "p2p" else 1)
    return out


FRAMEWORK_UNITS = (1, 5)
"""Tiny units in the two runs of each measurement of :func:`measure_frameworks` (the cost per unit is the slope
between them; a pipeline starts from one micro-batch per stage)."""
SLOPE_ATTEMPTS = 3
"""Measurements of a :func:`measure_frameworks` slope that came out <= 0 (noise) before it is left at 0 (uncalibrated:
the planner then prices the unit from its collectives alone)."""


def _step_seconds(net: torch.nn.Module, x: torch.Tensor | None, sync: Callable[[], None], *, reps: int = 15,
                  run: Callable[[], None] | None = None, optimizer: bool = True) -> tuple[float, float]:
    """Median seconds of the forward and backward of a training step of ``net`` (on ``x``, or ``run()``), every rank
    in step (a barrier before each); AdamW and zero_grad follow, untimed (the optimizer step is calibrated on its
    own, per tensor: :func:`measure_optimizer`) -- not with ``optimizer=False`` (``run()`` steps its own). Returns
    the medians of the wall time and of the process's CPU time (every thread: the collectives' too)."""
    import torch.distributed as dist

    opt = torch.optim.AdamW(net.parameters(), lr=1e-3) if optimizer else None

    def forward_backward() -> None:
        if run is not None:
            run()
        else:
            assert x is not None
            net(x).sum().backward()

    times, cpu = [], []
    for i in range(3 + reps):
        sync()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        forward_backward()
        sync()
        if i >= 3:  # after the warm-up steps
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return statistics.median(times), statistics.median(cpu)


CP_TINY_SHAPE = (1, 1, 4, 16)
"""``(batch, heads, tokens, head dim)`` of each rank's queries in the tiny ring attention (``cp_layer``)."""
CP_RING_SHAPE = (8, 4, 32, 32)
"""``(batch, heads, tokens, head dim)`` of the queries of each rank in the ring attention timed at a step's size
(:func:`measure_frameworks`'s ``cp_element``)."""


def measure_frameworks(world: int, device: torch.device) -> dict[str, float]:
    """Seconds per training step that one tiny sharded unit adds over ``world`` ranks (every rank calls this), and
    the optimizer step's cost per ``DTensor`` parameter (``optimizer_dtensor``: torch's AdamW over
    :data:`OPTIMIZER_TENSORS` 16-element shards of parameters sharded over the world, per tensor):

    * ``fsdp_unit``: a ``Linear(16, 16)`` under ``fully_shard`` (FSDP2: all-gather in forward and in backward,
      reduce-scatter of its gradient) -- what a ZeRO-3 / FSDP unit (a block, the embedding, the head) costs beyond
      its arithmetic;
    * ``tp_pair``: a column-parallel then a row-parallel ``Linear(16, 16)`` (DTensor: the all-reduce of the row
      linear's output in forward and of the column linear's input gradient in backward) -- what each Megatron pair
      of a tensor-parallel layer (attention, MLP) costs beyond its arithmetic;
    * ``pp_micro_batch`` (more than one rank): a micro-batch more through a 1F1B pipeline of one ``Linear(16, 16)``
      stage per rank (torch's pipelining runtime, as ``lp_pipeline`` runs it: its sends and receives of activations
      and gradients, the schedule's Python) -- what each micro-batch of a pipeline costs beyond its arithmetic;
    * ``cp_layer`` (more than one rank): one more layer's ring attention over the ranks (the library's
      ``ring_attention``: ``n - 1`` k/v blocks along the ring in forward, blocks and gradients in backward, its
      Python) on a tiny sequence -- what context parallelism costs per layer beyond its arithmetic;
    * ``cp_element`` (more than one rank): the same ring at a step's size (:data:`CP_RING_SHAPE` queries per rank),
      less one device's causal attention over the whole sequence shared by the ranks and less ``cp_layer``, per
      element of a rank's queries: what grows with the layer's size (the block kernels' calls, the fp32 merges and
      accumulators, the copies along the ring) beyond the attention's arithmetic.

    Each is the slope between :data:`FRAMEWORK_UNITS` units (micro-batches: ``world`` and 4 more), so the fixed
    cost of a step, the root unit, the loss and the pipeline's fill and drain are left out; the tensors are tiny, so
    the figure is the collectives' latency as a real step meets it (with the Python around them and the other
    rank's arrival), not their bandwidth."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    sync = _sync_for(device)
    mesh = init_device_mesh(device.type, (world,))
    x = torch.randn(4, 16, device=device)

    def fsdp(units: int) -> tuple[float, float]:
        net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(units)]).to(device)
        for unit in net:
            fully_shard(unit, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return _step_seconds(net, x, sync)

    def tp(pairs: int) -> tuple[float, float]:
        net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(2 * pairs)]).to(device)
        plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(2 * pairs)}
        parallelize_module(net, mesh, plan)  # type: ignore[arg-type]
        return _step_seconds(net, x, sync)

    def pipeline(micro_batches: int) -> tuple[float, float]:  # one stage per rank, 1F1B over the world
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        rank = dist.get_rank()
        net = nn.Linear(16, 16).to(device)
        stage = PipelineStage(net, rank, world, device)
        schedule = Schedule1F1B(stage, micro_batches, loss_fn=lambda out, target: (out - target).pow(2).mean())
        inputs = torch.randn(4 * micro_batches, 16, device=device)
        target = torch.zeros(4 * micro_batches, 16, device=device)

        def run() -> None:
            if rank == 0:
                schedule.step(inputs)
            elif rank == world - 1:
                schedule.step(target=target)
            else:
                schedule.step()

        return _step_seconds(net, None, sync, run=run)

    def ring(layers: int, shape: tuple[int, int, int, int] = CP_TINY_SHAPE) -> tuple[float, float]:
        """The library's ring attention over the world, once per layer, on ``shape`` queries per rank."""
        from lightning_parallel.parallel.context_parallel.ring import ring_attention

        q = torch.randn(*shape, device=device, requires_grad=True)
        group = dist.group.WORLD
        assert group is not None

        def run() -> None:
            h = q
            for _ in range(layers):
                h = ring_attention(h, h, h, group=group)
            h.sum().backward()

        return _step_seconds(nn.Linear(1, 1), None, sync, run=run, optimizer=False)

    def attention_share() -> float:  # one device's causal attention on the whole sequence, per rank
        b, h, s, d = CP_RING_SHAPE
        q = torch.randn(b, h, s * world, d, device=device, requires_grad=True)
        return _step_seconds(nn.Linear(1, 1), None, sync, run=partial(_attention_step, q), optimizer=False)[0] / world

    def dtensor_optimizer() -> float:  # AdamW over DTensor parameters sharded over the world, per tensor
        from torch.distributed.tensor import Shard, distribute_tensor

        params = [nn.Parameter(distribute_tensor(torch.zeros(16 * world, device=device), mesh, [Shard(0)]))
                  for _ in range(OPTIMIZER_TENSORS)]
        return _timed(_adamw(list(params)).step, sync=sync) / OPTIMIZER_TENSORS

    lo, hi = FRAMEWORK_UNITS
    out = {"optimizer_dtensor": dtensor_optimizer()}
    spans = [("fsdp_unit", fsdp, lo, hi), ("tp_pair", tp, lo, hi)]
    if world > 1:  # a schedule needs at least a micro-batch per stage
        spans += [("pp_micro_batch", pipeline, world, world + hi - lo), ("cp_layer", ring, lo, hi)]
    slopes: dict[str, tuple[float, float]] = {}
    pending = spans
    for _ in range(SLOPE_ATTEMPTS):
        for name, f, a, b in pending:
            (wall_a, cpu_a), (wall_b, cpu_b) = f(a), f(b)
            slopes[name] = ((wall_b - wall_a) / (b - a), (cpu_b - cpu_a) / (b - a))
        # on a busy machine a slope can come out <= 0 (the smaller run met a stall): measure those spans again, on
        # every rank alike (their steps run collectives), so that a noisy run does not leave the unit uncalibrated
        redo = _any_rank([slopes[name][0] <= 0 for name, *_ in pending], device)
        pending = [span for span, again in zip(pending, redo, strict=True) if again]
        if not pending:
            break
    for name, *_ in spans:
        wall, cpu = slopes[name]
        out[name] = max(0.0, wall)
        out[f"{name}_cpu"] = min(max(0.0, cpu), out[name])
    if world > 1:  # the ring's cost that grows with the layer's size, beyond the attention's arithmetic
        elements = math.prod(CP_RING_SHAPE) - math.prod(CP_TINY_SHAPE)

        def per_element() -> dict[str, float]:
            wide = (ring(hi, CP_RING_SHAPE)[0] - ring(lo, CP_RING_SHAPE)[0]) / (hi - lo)
            return {"cp_element": (wide - attention_share() - out["cp_layer"]) / elements}

        out.update({name: max(0.0, value) for name, value in _until_positive(per_element, device).items()})
    return out


def _until_positive(measure: Callable[[], dict[str, float]], device: torch.device) -> dict[str, float]:
    """``measure()`` (figures that are differences of timings, each > 0 on a quiet machine), made again -- at most
    :data:`SLOPE_ATTEMPTS` times in all -- while any figure comes out <= 0 on any rank (a stall in the smaller run on a
    busy machine). Every rank takes the decision alike (:func:`_any_rank`): the measurements run collectives. Returns
    the last measurement's figures (a figure still <= 0 is the caller's to clamp)."""
    for _ in range(SLOPE_ATTEMPTS):
        figures = measure()
        if not _any_rank([any(value <= 0 for value in figures.values())], device)[0]:
            break
    return figures


def _any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag true where it is true on any rank (an all-reduce of the flags, MAX): the decision to measure again,
    which every rank must take alike when the measurement runs collectives."""
    import torch.distributed as dist

    agreed = torch.tensor([float(f) for f in flags], device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return [bool(v) for v in agreed.tolist()]


OFFLOAD_UNITS = 17
"""Tiny units in the larger of :func:`measure_offload`'s two runs, against one (wider apart than
:data:`FRAMEWORK_UNITS`: a tensor costs the engine a tenth of a millisecond, within one run's noise over four
units)."""
OFFLOAD_WIDE = 1024
"""Width of the one linear layer (about a million parameters) whose engine step gives the offload engine's cost per
parameter (:func:`measure_offload`)."""
HOST_ADAM_ELEMENTS = 2**22
"""Elements of the one tensor DeepSpeed's CPU Adam is timed on (:func:`measure_offload`)."""


def offload_calibration_ops(device_type: str) -> list[str] | None:
    """The DeepSpeed ops the offload engine's calibration loads that are not built yet ([] when all are); None
    when DeepSpeed is not installed. The calibration never builds an op (minutes): it measures the engine only
    when they are built."""
    from lightning_parallel.parallel.offload.ops import missing_ops, required_ops

    try:
        import deepspeed  # noqa: F401
    except Exception:  # not installed, or broken on this machine
        return None
    return missing_ops(required_ops(accelerator=device_type, offload_optimizer="cpu", offload_param="none"))


def measure_offload(world: int, device: torch.device) -> dict[str, float]:
    """What ZeRO-offload's engine (DeepSpeed's ZeRO-2 with the optimizer on the host, as ``lp_zero_offload`` builds
    it) costs a step beyond its arithmetic and its bytes, over ``world`` ranks (every rank calls this; DeepSpeed and
    its ops must be importable and built: :func:`offload_calibration_ops`):

    * ``offload_tensor``: the slope of a whole step (forward, ``engine.backward``: gradients reduced into the flat
      partition and copied to the host; ``engine.step``: the host Adam, the parameters copied back and all-gathered)
      between one and :data:`OFFLOAD_UNITS` ``Linear(16, 16)`` units, per parameter tensor (two per unit): the engine's
      per-tensor hooks, copies and bookkeeping;
    * ``offload_step``: the step of one unit less its arithmetic and its tensors' share: the engine's fixed
      cost per step (its Python, the flat collectives' latency, the host optimizer's call);
    * ``offload_param``: one ``Linear(OFFLOAD_WIDE, OFFLOAD_WIDE)`` against one ``Linear(16, 16)`` (the same two
      tensors), each less its plain forward and backward, per parameter: the engine's whole cost per parameter of
      the model (its copies into and out of the flat partitions, the host link, the host Adam, the flat exchange's
      bytes) -- the step-time model counts the part it does not price on its own;
    * ``host_optimizer_params_per_s``: parameters per second DeepSpeed's CPU Adam (AdamW mode) updates in one
      :data:`HOST_ADAM_ELEMENTS`-element tensor, every rank at once.

    The tensors are tiny, so the slopes are the engine's time as a step meets it, not its bandwidth (the host link
    and the host Adam's rate count the bytes)."""
    import contextlib
    import io

    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from torch import nn

    from lightning_parallel.parallel.offload.config import OffloadEngineConfig

    sync = _sync_for(device)
    config = OffloadEngineConfig.from_dict(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}).to_deepspeed()
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1, gradient_clipping=0.0)
    quiet = logging.getLogger("DeepSpeed")
    level = quiet.level
    quiet.setLevel(logging.ERROR)

    def engine_step(units: int, width: int = 16) -> tuple[float, float]:
        net = nn.Sequential(*[nn.Linear(width, width) for _ in range(units)]).to(device)
        data = torch.randn(4, width, device=device)
        opt = DeepSpeedCPUAdam(net.parameters(), lr=1e-3, adamw_mode=True)
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its config and op loads
            engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config, dist_init_required=False)

        def run() -> None:
            engine.backward(engine(data).sum())
            engine.step()

        try:
            return _step_seconds(net, None, sync, run=run, optimizer=False)
        finally:
            engine.destroy()

    def plain(width: int) -> tuple[float, float]:  # the same net's forward and backward, no engine
        return _step_seconds(nn.Linear(width, width).to(device), torch.randn(4, width, device=device), sync)

    tensors = 2 * (OFFLOAD_UNITS - 1)
    extra_params = OFFLOAD_WIDE * (OFFLOAD_WIDE + 1) - 16 * 17  # one wide unit against one tiny: two tensors each
    cpu: dict[str, float] = {}  # the CPU times of the last measurement's runs

    def differences() -> dict[str, float]:
        (wall_one, cpu["one"]), (wall_many, cpu["many"]) = engine_step(1), engine_step(OFFLOAD_UNITS)
        wide, wide_plain, one_plain = engine_step(1, OFFLOAD_WIDE)[0], plain(OFFLOAD_WIDE)[0], plain(16)
        cpu["plain"] = one_plain[1]
        per_tensor = (wall_many - wall_one) / tensors
        return {"offload_tensor": per_tensor, "offload_step": wall_one - one_plain[0] - 2 * max(0.0, per_tensor),
                "offload_param": ((wide - wide_plain) - (wall_one - one_plain[0])) / extra_params}

    try:
        out = {name: max(0.0, value) for name, value in _until_positive(differences, device).items()}
    finally:
        quiet.setLevel(level)
    out["offload_tensor_cpu"] = min(max(0.0, (cpu["many"] - cpu["one"]) / tensors), out["offload_tensor"])
    out["offload_step_cpu"] = min(max(0.0, cpu["one"] - cpu["plain"] - 2 * out["offload_tensor_cpu"]),
                                  out["offload_step"])
    param = nn.Parameter(torch.zeros(HOST_ADAM_ELEMENTS))
    param.grad = torch.ones_like(param)
    host_adam = DeepSpeedCPUAdam([param], lr=1e-3, adamw_mode=True)
    out["host_optimizer_params_per_s"] = HOST_ADAM_ELEMENTS / _timed(host_adam.step, sync=lambda: None)
    return out


def _rank_main(rank: int, world: int, device_type: str, offload: bool = False) -> dict[str, Any] | None:
    """One calibration rank: compute and memory measured by every rank at once (shared cores and memory as a run
    sees them), then the collectives; rank 0 returns the figures."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed collectives, same calls
    device = torch.device(device_type, rank) if device_type != "cpu" else torch.device("cpu")
    dist.barrier()
    compute = measure_compute(device)
    dist.barrier()
    collectives = measure_collectives(world, device)
    dist.barrier()
    frameworks = measure_frameworks(world, device)
    frameworks["collectives_cpu"] = measure_collective_busy(world, device)
    if offload:
        dist.barrier()
        try:
            frameworks.update(measure_offload(world, device))
        except Exception as err:  # DeepSpeed refusing this machine: the rest of the calibration stands
            if rank == 0:
                print(f"calibrate: the offload engine was not measured: {type(err).__name__}: {err}",
                      file=sys.stderr, flush=True)
    return {"compute": compute, "collectives": collectives, "frameworks": frameworks} if rank == 0 else None


def _run_world(ranks: int, device_type: str, progress: Progress | None, offload: bool = False) -> dict[str, Any]:
    """:func:`_rank_main` on ``ranks`` local processes (the multi-rank tests' launcher: a failing rank's traceback is
    raised here and the other ranks are stopped; the whole run is bounded)."""
    from lightning_parallel.parallel.local_ranks import run_distributed

    if progress:
        progress(f"starting {ranks} {'gloo' if device_type == 'cpu' else 'nccl'} ranks on 127.0.0.1 "
                 f"(matmul and bandwidth in every rank at once, then the collectives at {len(CALIBRATION_SIZES)} "
                 "sizes)")
    # CPU ranks share the cores out, as a run's ranks do: more threads than cores make OpenMP's threads wait on one
    # another (a small GEMM measured 300x slower with 2 ranks x 2 threads on 2 cores)
    threads = max(1, _cores() // ranks) if device_type == "cpu" else max(1, torch.get_num_threads())
    results = run_distributed(_rank_main, ranks, device_type, offload, timeout_s=600, collective_timeout_s=120,
                              start_method="fork" if device_type == "cpu" else "spawn",
                              threads_per_rank=threads, device_type=device_type)
    result: dict[str, Any] = results[0]
    return result


def measure_host_overhead(*, steps: int = 40, ranks: int = 1, accumulate: int = 1) -> float:
    """Seconds per training step of a Lightning ``fit`` of a one-layer model on CPU: the framework's own time. With
    ``ranks`` > 1, the library's ``lp_ddp`` over that many forked ranks (threads shared out over the cores), so that
    a distributed step's fixed costs are in it: the gradient all-reduce and the logged value's all-reduce as a step
    meets them (the other rank's arrival included), Lightning's distributed hooks. ``accumulate``: batches per
    optimizer step (``accumulate_grad_batches``); the seconds are per optimizer step."""
    import contextlib
    import tempfile

    import lightning.pytorch as pl
    from torch import nn

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)


    class Clock(pl.Callback):
        """Rank 0's step end times, written to a file (a forked rank's memory does not come back)."""

        def __init__(self, path: Path) -> None:
            self.path = path
            self.stamps: list[float] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            self.stamps.append(time.perf_counter())

        def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_rank == 0:
                self.path.write_text(json.dumps(self.stamps))

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(steps * 2 * ranks * accumulate, 8)),
                                       batch_size=2)
    quiet = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning",
                                                   "lightning_parallel")]
    levels = [log.level for log in quiet]
    threads, environ = torch.get_num_threads(), dict(os.environ)  # the launcher sets MASTER_PORT & co. here
    stack = contextlib.ExitStack()
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="lp-calibrate-"))
        if ranks > 1:
            torch.set_num_threads(max(1, _cores() // ranks))  # the forked ranks' share of the cores
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = pl.Trainer(accelerator="cpu", devices=ranks, max_steps=steps, logger=False,
                                 accumulate_grad_batches=accumulate,
                                 strategy="lp_ddp_fork" if ranks > 1 else "auto",
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 callbacks=[Clock(Path(folder) / "stamps.json")])
            trainer.fit(Tiny(), data)
        stamps = json.loads((Path(folder) / "stamps.json").read_text())
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
        stack.close()
    warm = stamps[accumulate - 1::accumulate][steps // 4:]  # the ends of the optimizer steps
    return float((warm[-1] - warm[0]) / (len(warm) - 1))


def calibrate(*, ranks: int = 2, save: bool = True, progress: Progress | None = None,
              hardware: Any = None, repeats: int | None = None) -> Rates:
    """Measure this machine over ``ranks`` processes (1: in this process, no collectives) ``repeats`` times (default
    :data:`CALIBRATION_REPEATS`), keep the median of every figure, and cache the result."""
    device_type = _device_type()
    if device_type == "cuda":
        ranks = min(ranks, torch.cuda.device_count())
    say = progress or (lambda line: None)
    t0 = time.perf_counter()
    base = default_rates(hardware) if hardware is not None else None
    repeats = CALIBRATION_REPEATS if repeats is None else repeats
    if repeats < 1:
        raise ValueError(f"calibrate(repeats={repeats}): at least 1.")
    missing = offload_calibration_ops(device_type) if ranks > 1 else None
    if ranks > 1 and missing is None:
        say("offload engine: DeepSpeed is not installed, not measured (the host Adam's rate from the defaults)")
    elif missing:
        say(f"offload engine: not measured, DeepSpeed's ops {missing} are not built yet (the first lp_zero_offload "
            "run builds them, minutes; calibrate again after it)")
    runs = []
    for i in range(repeats):
        runs.append(_measure_once(ranks, device_type, say if i == 0 else None, offload=missing == []))
        if repeats > 1:
            say(f"measurement {i + 1} of {repeats} done ({time.perf_counter() - t0:.1f} s); the median of each "
                "figure is kept")
    compute, collectives, frameworks, overhead = (_median_tree([run[i] for run in runs]) for i in range(4))
    for line in _compute_lines(compute):
        say(line)
    links: dict[str, Any] = {}
    if collectives:
        links["intra_node"] = {}
        for name, points in collectives.items():
            alpha, beta = fit_alpha_beta(points)
            links["intra_node"][name] = {"alpha_us": alpha * 1e6, "beta_gbs": beta / 1e9}
            say(f"{name} over {ranks} ranks: alpha {alpha * 1e6:,.1f} us, beta {beta / 1e9:,.2f} GB/s (bus)")
    else:
        say("collectives: one rank, nothing to measure (intra-node link from the defaults)")
    if "optimizer_dtensor" in frameworks:
        say(f"optimizer step (AdamW) over DTensor parameters: {frameworks['optimizer_dtensor'] * 1e6:,.1f} us per "
            "tensor")
    if "collectives_cpu" in frameworks:
        say(f"collectives over {ranks} ranks: {frameworks['collectives_cpu']:.0%} of their time on the CPU")
    for name, what in (("fsdp_unit", "an FSDP2 unit"), ("tp_pair", "a tensor-parallel pair of linears"),
                       ("pp_micro_batch", "a pipeline micro-batch"), ("cp_layer", "a layer's ring attention")):
        if name in frameworks:
            busy = frameworks.get(f"{name}_cpu", 0.0) / frameworks[name] if frameworks[name] > 0 else 1.0
            say(f"{what} over {ranks} ranks: {frameworks[name] * 1e3:,.2f} ms per step beyond its arithmetic "
                f"({min(busy, 1.0):.0%} on the CPU)"
                + (f", + {frameworks['cp_element'] * 1e9:,.1f} ns per element of a rank's queries"
                   if name == "cp_layer" and "cp_element" in frameworks else ""))
    if "offload_step" in frameworks:
        busy = frameworks["offload_step_cpu"] / frameworks["offload_step"] if frameworks["offload_step"] > 0 else 1.0
        say(f"ZeRO-offload engine (DeepSpeed ZeRO-2, optimizer on the host) over {ranks} ranks: "
            f"{frameworks['offload_step'] * 1e3:,.2f} ms per step + {frameworks['offload_tensor'] * 1e6:,.1f} us per "
            f"parameter tensor + {frameworks['offload_param'] * 1e9:,.2f} ns per parameter beyond its arithmetic "
            f"({min(busy, 1.0):.0%} of the fixed part on the CPU); DeepSpeed's CPU Adam "
            f"{frameworks['host_optimizer_params_per_s'] / 1e6:,.0f} M parameters/s")
    say(f"host overhead per step (Lightning fit of a one-layer model): {overhead * 1e3:.2f} ms")
    if "distributed_overhead" in frameworks:
        say(f"host overhead per step over {ranks} ranks (lp_ddp fit of a one-layer model): "
            f"{frameworks['distributed_overhead'] * 1e3:.2f} ms")
    if "host_batch_share" in frameworks:
        say(f"host overhead that recurs with every batch of an accumulating step (the same fit accumulating 4 "
            f"batches): {frameworks['host_batch_share']:.0%}")
    rates = _assemble(compute, links, overhead, device_type=device_type, ranks=ranks, base=base,
                      frameworks=frameworks)
    say(f"calibrated peak: {max(rates.peak_flops.values()) / 1e12:.4g} TFLOP/s; done in "
        f"{time.perf_counter() - t0:.1f} s")
    if save:
        path = cache_path(ranks)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": machine_key(ranks), "rates": rates.to_dict()}, indent=1))
        say(f"cached in {path}")
    return rates


CALIBRATION_REPEATS = 3
"""Whole measurements a calibration makes; the median of each figure is kept (on a shared machine the same figure
was seen to vary 2x between two calibrations a minute apart)."""


def _measure_once(ranks: int, device_type: str, say: Progress | None, offload: bool = False
                  ) -> tuple[dict[str, Any], dict[str, Any], dict[str, float], float]:
    """One measurement of everything: compute, collectives and unit costs over ``ranks`` ranks (``offload``: the
    ZeRO-offload engine's too), the host overheads."""
    if ranks > 1:
        world = _run_world(ranks, device_type, say, offload)
        compute, collectives, frameworks = world["compute"], world["collectives"], world["frameworks"]
    else:
        compute, collectives = measure_compute(torch.device(device_type, 0) if device_type != "cpu"
                                               else torch.device("cpu"), progress=say), {}
        frameworks = {}
    overhead = measure_host_overhead()
    if ranks > 1 and device_type == "cpu":
        frameworks["distributed_overhead"] = measure_host_overhead(ranks=ranks)
    # how much of it recurs with every batch of an accumulating step: a fit accumulating 4 batches against 1
    distributed = "distributed_overhead" in frameworks
    fit_ranks = ranks if distributed else 1
    one = frameworks["distributed_overhead"] if distributed else overhead
    for attempt in range(SLOPE_ATTEMPTS):
        if attempt:  # four batches a step measured no dearer than one (a stall in the one-batch fit): both again
            one = measure_host_overhead(ranks=fit_ranks)
        four = measure_host_overhead(ranks=fit_ranks, accumulate=4)
        if four > one:
            break
    if distributed:
        frameworks["distributed_overhead"] = one
    else:
        overhead = one
    frameworks["host_batch_share"] = min(max((four - one) / 3 / one, 0.0), 1.0) if one > 0 else 1.0
    return compute, collectives, frameworks, overhead


def _median_tree(values: list[Any]) -> Any:
    """The element-wise median of equally shaped figures: numbers, dicts of them, lists of ``(x, seconds)`` points
    (the median of the seconds)."""
    first = values[0]
    if isinstance(first, dict):
        return {k: _median_tree([v[k] for v in values]) for k in first if all(k in v for v in values)}
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], (list, tuple)):
        return [(point[0], statistics.median(v[i][1] for v in values)) for i, point in enumerate(first)]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(values)
    return first


def median_rates(calibrations: list[Rates]) -> Rates:
    """The median of every figure of several calibrations of one machine (non-numeric fields: the first's)."""
    if not calibrations:
        raise ValueError("median_rates needs at least one calibration.")
    return rates_from_dict(_median_tree([rates.to_dict() for rates in calibrations]))


def _cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _compute_lines(compute: dict[str, Any]) -> list[str]:
    lines = [f"matmul {d} {e}^3: {r / 1e9:,.1f} GFLOP/s" for d, t in compute["matmul"].items() for e, r in t.items()]
    return [*lines, f"memory bandwidth (64 MiB copy): {compute['memory_bandwidth'] / 1e9:,.1f} GB/s",
            f"elementwise ops (GELU forward + backward, LayerNorm, add): "
            f"{compute.get('elementwise_bandwidth', 0.0) / 1e9:,.1f} GB/s",
            f"one eager op dispatched: {compute.get('op_overhead', 0.0) * 1e6:,.1f} us",
            *(["attention (SDPA, causal, forward + backward): "
               + ", ".join(f"{seconds * 1e3:,.2f} ms at {seq} tokens" for seq, seconds in compute["attention"])]
              if compute.get("attention") else []),
            f"optimizer step (AdamW): {compute.get('optimizer_tensor', 0.0) * 1e6:,.1f} us per tensor + "
            f"{compute.get('optimizer_bandwidth', 0.0) / 1e9:,.1f} GB/s",
            *([f"host link (16 MiB copies to and from host memory): {compute['host_link_bandwidth'] / 1e9:,.1f} GB/s"]
              if "host_link_bandwidth" in compute else [])]


def _assemble(compute: dict[str, Any], links: dict[str, Any], overhead: float, *, device_type: str, ranks: int,
              base: Rates | None, frameworks: dict[str, float] | None = None) -> Rates:
    table: dict[str, dict[str, float]] = compute["matmul"]
    best = {d: max(t.values()) for d, t in table.items()}
    fallback = {c: {"alpha_us": 20.0, "beta_gbs": 1.0} for c in COLLECTIVES}
    default_link = base.to_dict()["links"]["intra_node"] if base is not None else fallback
    data = {
        "matmul_tflops": {d: r / 1e12 for d, r in best.items()},
        "matmul_tflops_by_shape": {d: {e: r / 1e12 for e, r in t.items()} for d, t in table.items()},
        "peak_tflops": {d: r / 1e12 for d, r in best.items()},
        "memory_bandwidth_gbs": compute["memory_bandwidth"] / 1e9,
        "elementwise_gbs": compute.get("elementwise_bandwidth", compute["memory_bandwidth"]) / 1e9,
        "links": {"intra_node": links.get("intra_node", default_link),
                  "inter_node": (base.to_dict()["links"]["inter_node"] if base is not None
                                 else links.get("intra_node", default_link))},
        "host_overhead_ms": overhead * 1e3,
        "op_overhead_us": compute.get("op_overhead", 0.0) * 1e6,
        **dict(_framework_entry(name, value) for name, value in (frameworks or {}).items()
               if not name.endswith("_cpu")),
        **({"host_link_gbs": compute["host_link_bandwidth"] / 1e9} if "host_link_bandwidth" in compute else {}),
        **({"busy": _busy(frameworks)} if device_type == "cpu" and frameworks else {}),
        **({"optimizer_tensor_us": compute["optimizer_tensor"] * 1e6,
            "optimizer_gbs": compute["optimizer_bandwidth"] / 1e9} if "optimizer_tensor" in compute else {}),
        "overlap": 0.0 if device_type == "cpu" else 1.0,
        **({"cores": _cores()} if device_type == "cpu" else {}),
        "calibrated_ranks": ranks,
        "attention_efficiency": 1.0 if device_type == "cpu" else 0.6,
        "source": f"calibrated {socket.gethostname()} {device_type} x{ranks} "
                  f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M')} UTC",
    }
    rates = rates_from_dict(data)
    if compute.get("attention"):  # fitted against the GEMM rates just assembled
        efficiency, per_call = attention_fit(compute["attention"], rates, device_type)
        rates = replace(rates, attention_efficiency=efficiency, attention_call_s=per_call)
    return rates


_FRAMEWORK_KEYS = {"optimizer_dtensor": ("optimizer_dtensor_us", 1e6), "cp_element": ("cp_element_ns", 1e9),
                   "offload_param": ("offload_param_ns", 1e9),
                   "host_optimizer_params_per_s": ("host_optimizer_params_per_s", 1.0),
                   "host_batch_share": ("host_batch_share", 1.0)}
"""The rates key and scale of each :func:`measure_frameworks` / :func:`measure_offload` figure that is not in
seconds per step (those become ``<name>_ms``)."""


def _framework_entry(name: str, value: float) -> tuple[str, float]:
    key, scale = _FRAMEWORK_KEYS.get(name, (f"{name}_ms", 1e3))
    return key, value * scale


def _busy(frameworks: dict[str, float]) -> dict[str, float]:
    """CPU time over wall time of each calibrated unit cost (``<unit>_cpu`` against ``<unit>``), and of the
    collectives (``collectives_cpu``, a share already)."""
    out = {name: min(frameworks[f"{name}_cpu"] / seconds, 1.0) if seconds > 0 else 1.0
           for name, seconds in frameworks.items() if f"{name}_cpu" in frameworks}
    if "collectives_cpu" in frameworks:
        out["collectives"] = frameworks["collectives_cpu"]
    return out


def format_rates(rates: Rates) -> str:
    """A few lines describing ``rates`` (what ``plan --calibrate`` prints at the end)."""
    lines = [f"rates: {rates.source}"]
    lines += [f"  matmul {d}: {r / 1e12:.4g} TFLOP/s (peak {rates.peak(d) / 1e12:.4g})"
              for d, r in rates.matmul_flops.items()]
    lines.append(f"  memory bandwidth: {rates.memory_bandwidth / 1e9:,.1f} GB/s (elementwise ops "
                 f"{rates.elementwise_rate / 1e9:,.1f}); op dispatch {rates.op_overhead_s * 1e6:.1f} us; host overhead "
                 f"{rates.host_overhead_s * 1e3:.2f} ms/step"
                 + (f" ({rates.distributed_overhead_s * 1e3:.2f} over {rates.calibrated_ranks} ranks)"
                    if rates.distributed_overhead_s else "")
                 + (f", {rates.host_batch_share:.0%} of it again per batch accumulated"
                    if rates.host_batch_share != 1.0 else "") + f"; overlap {rates.overlap:g}")
    if rates.optimizer_tensor_s or rates.optimizer_bandwidth:
        lines.append(f"  optimizer step: {rates.optimizer_tensor_s * 1e6:.1f} us per tensor"
                     + (f" ({rates.optimizer_dtensor_s * 1e6:.1f} per DTensor)" if rates.optimizer_dtensor_s else "")
                     + f" + {rates.optimizer_rate / 1e9:,.1f} GB/s")
    lines.append(f"  attention core: {rates.attention_efficiency:.2f} of the GEMM rate"
                 + (f" + {rates.attention_call_s * 1e6:,.0f} us per call" if rates.attention_call_s else ""))
    if rates.fsdp_unit_s or rates.tp_pair_s or rates.pp_micro_batch_s or rates.cp_layer_s:
        lines.append(f"  per unit and step: FSDP2 unit {rates.fsdp_unit_s * 1e3:.2f} ms, tensor-parallel pair "
                     f"{rates.tp_pair_s * 1e3:.2f} ms, pipeline micro-batch {rates.pp_micro_batch_s * 1e3:.2f} ms, "
                     f"ring-attention layer {rates.cp_layer_s * 1e3:.2f} ms"
                     + (f" + {rates.cp_element_s * 1e9:.1f} ns per element of its queries" if rates.cp_element_s
                        else ""))
    lines.append(f"  offload: host link {rates.host_link_bandwidth / 1e9:,.1f} GB/s, host Adam "
                 f"{rates.host_optimizer_params_per_s / 1e6:,.0f} M parameters/s"
                 + (f"; the engine {rates.offload_step_s * 1e3:.2f} ms per step + {rates.offload_tensor_s * 1e6:.1f} us"
                    f" per tensor + {rates.offload_param_s * 1e9:.2f} ns per parameter"
                    if rates.offload_step_s or rates.offload_param_s else ""))
    if rates.busy:
        lines.append("  on the CPU (share of the wall time; the rest waits): "
                     + ", ".join(f"{name} {share:.0%}" for name, share in rates.busy.items()))
    for kind, link in rates.links.items():
        parts = ", ".join(f"{c} {r.alpha * 1e6:,.0f} us + {r.beta / 1e9:,.2f} GB/s"
                          for c, r in link.collectives.items())
        lines.append(f"  {kind}: {parts}")
    return "\n".join(lines)


def calibration_mode() -> str:
    """``$LIGHTNING_PARALLEL_CALIBRATION``: ``cached`` (default: a cached calibration of this machine when there is
    one), ``now`` (calibrate when no cache exists), ``none`` (never read or make one; the tests set it)."""
    mode = os.environ.get("LIGHTNING_PARALLEL_CALIBRATION", "cached").strip().lower() or "cached"
    if mode not in ("cached", "now", "none"):
        raise ValueError(f"LIGHTNING_PARALLEL_CALIBRATION={mode!r}: use cached, now or none.")
    return mode


def rates_for(hardware: Any, *, calibration: str | None = None) -> Rates:
    """The rates a plan for ``hardware`` uses: the profile's own ``rates:`` when it has them (a machine not at
    hand); else, for a machine detected here, its calibration (``calibration``: ``cached`` reads the cache,
    ``now`` also measures when none is cached, ``none`` skips it; default :func:`calibration_mode`); else
    :func:`default_rates`."""
    own = getattr(hardware, "rates", None)
    if own is not None:
        return own if isinstance(own, Rates) else rates_from_dict(own, source=f"profile {hardware.name}")
    mode = calibration or calibration_mode()
    if mode != "none" and getattr(hardware, "name", "") in ("detected", "this machine"):
        found = cached_rates()
        if found is None and mode == "now":
            found = calibrate(ranks=min(2, hardware.gpus_per_node), save=True, hardware=hardware)
        if found is not None:
            return found
    return default_rates(hardware)


if __name__ == "__main__":  # pragma: no cover - python -m lightning_parallel.planner.calibrate [RANKS]
    print(format_rates(calibrate(ranks=int(sys.argv[1]) if len(sys.argv) > 1 else 2, progress=print)))
