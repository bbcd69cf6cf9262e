"""The machine rates the step-time model runs on: matmul FLOP/s, memory bandwidth, collectives, host overhead.

A :class:`Rates` comes from one of three places (:func:`lightning_parallel.planner.calibrate.rates_for`):

1. a calibration of this machine (``lightning-parallel plan --calibrate``, :mod:`.calibrate`), cached per machine;
2. the ``rates:`` section of a hardware profile (``configs/hardware/*.yaml``), vendor figures for machines not at
   hand (``docs/planner.md`` lists each figure and its source);
3. defaults derived from the profile's ``peak_tflops`` and link kinds (the rough figures of :mod:`.hardware`).

Collectives follow the alpha-beta model with NCCL's *bus bandwidth* convention (``nccl-tests``' ``busbw``), so one
``beta`` per link describes a ring of any size: a collective over ``n`` ranks of a buffer of ``S`` bytes takes::

    all_reduce      alpha + 2 (n - 1) / n * S / beta
    reduce_scatter  alpha +   (n - 1) / n * S / beta      (S: the whole, unsharded buffer)
    all_gather      alpha +   (n - 1) / n * S / beta      (S: the whole, gathered buffer)
    p2p             alpha +                 S / beta

``alpha`` is the latency of one call (seconds), ``beta`` bytes per second. Matmul throughput is by dtype and, when
measured, by shape (:data:`SHAPE_CLASSES`: square GEMMs of a few edges); a GEMM's rate is read at the cube root of
``m n k``, interpolating between measured edges in log space.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COLLECTIVES",
    "CPU_GLOO",
    "LINK_BANDWIDTH",
    "LINK_KINDS",
    "SHAPE_CLASSES",
    "CollectiveRate",
    "LinkRates",
    "Rates",
    "default_rates",
    "rates_from_dict",
]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "p2p")
"""The four collectives each link is described by."""
LINK_KINDS = ("intra_node", "inter_node")
"""Links a launch uses: between the devices of a node, and between nodes."""
SHAPE_CLASSES: dict[str, tuple[int, ...]] = {"cpu": (128, 256, 1024, 2048), "gpu": (256, 1024, 4096, 8192)}
"""The GEMM edges (cube root of ``m n k``) calibration measures square matmuls at, on CPU and on accelerators."""

LINK_BANDWIDTH: dict[str, float] = {
    "nvlink": 150e9,
    "pcie": 12e9,
    "fast": 12.5e9,
    "slow": 1.25e9,
    "host": 12e9,
    "nvme": 3e9,
}
"""Bytes per second per device on each kind of link (rough defaults for profiles without rates)."""

_BUS_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}


@dataclass(frozen=True)
class CollectiveRate:
    """One collective on one link: ``alpha`` seconds per call, ``beta`` bytes per second (bus bandwidth)."""

    alpha: float
    """Latency of one call (s)."""
    beta: float
    """Bus bandwidth (bytes/s)."""

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta > 0 and math.isfinite(self.alpha) and math.isfinite(self.beta)):
            raise ValueError(f"collective rate alpha={self.alpha!r} s, beta={self.beta!r} B/s: need alpha >= 0 and "
                             "beta > 0 (finite).")


@dataclass(frozen=True)
class LinkRates:
    """The four collectives over one kind of link."""

    collectives: Mapping[str, CollectiveRate]
    """``all_reduce``, ``reduce_scatter``, ``all_gather``, ``p2p``."""

    def time(self, collective: str, nbytes: float, ranks: int) -> float:
        """Seconds for ``collective`` of ``nbytes`` (the whole buffer) over ``ranks`` ranks; 0 for one rank or no
        bytes."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        rate = self.collectives[collective]
        factor = 1.0 if collective == "p2p" else _BUS_FACTOR[collective] * (ranks - 1) / ranks
        return rate.alpha + factor * nbytes / rate.beta

    def bandwidth(self) -> float:
        """The all-reduce bus bandwidth, the link's headline figure."""
        return self.collectives["all_reduce"].beta


@dataclass(frozen=True)
class Rates:
    """What one device of a machine does per second, and what its links carry."""

    matmul_flops: Mapping[str, float]
    """Sustained FLOP/s of large GEMMs by dtype (``fp32``, ``bf16``, ``fp16``)."""
    memory_bandwidth: float
    """Device memory bytes/s (elementwise, normalization, optimizer step)."""
    links: Mapping[str, LinkRates]
    """``intra_node`` and ``inter_node``."""
    peak_flops: Mapping[str, float]
    """The physical limit by dtype: the calibrated peak (best measured matmul) or the vendor's dense peak; what
    MFU is reported against."""
    host_overhead_s: float = 0.002
    """Framework time per optimizer step the device waits for (Python, the training loop, launches)."""
    matmul_by_shape: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Measured FLOP/s by dtype and GEMM edge (``{"bf16": {"1024": ...}}``, :data:`SHAPE_CLASSES`); empty when only
    large GEMMs are known."""
    attention_efficiency: float = 0.6
    """The attention core's FLOP/s as a share of the GEMM rate (fused attention kernels reach less than GEMMs);
    calibrated with :attr:`attention_call_s` (two sequence lengths), from published kernel figures in the profiles."""
    attention_call_s: float = 0.0
    """Seconds an attention call costs (forward and backward, per layer and micro-batch) beyond its FLOPs at
    :attr:`attention_efficiency`: the fused kernel's fixed cost, which dominates short sequences; calibrated."""
    host_link_bandwidth: float = 12e9
    """Host <-> device bytes/s per device (PCIe), what offload moves its tensors over."""
    host_optimizer_params_per_s: float = 2.5e8
    """Parameters per second a host (CPU) Adam updates, per rank."""
    nvme_bandwidth: float = 3e9
    """NVMe bytes/s per node."""
    elementwise_bandwidth: float | None = None
    """Bytes/s the memory-bound ops of a layer reach (GELU, LayerNorm, adds: calibrated); None: ``memory_bandwidth``
    (a copy's rate; fused GPU kernels come close to it, CPU ones reach a fraction)."""
    op_overhead_s: float = 0.0
    """Host time to dispatch one eager op (Python, the dispatcher, a kernel launch); calibrated."""
    optimizer_bandwidth: float | None = None
    """Bytes/s the optimizer step reaches over the parameter, gradient and state bytes it reads and writes (AdamW:
    ``2 P + G + 2 K`` per parameter); calibrated (torch's AdamW on one large tensor). None: :attr:`memory_bandwidth`
    (a fused or multi-tensor kernel's rate)."""
    optimizer_tensor_s: float = 0.0
    """Host seconds the optimizer step spends per parameter tensor beyond its bytes (torch's per-tensor AdamW: about
    ten eager ops each); calibrated. 0: :data:`~lightning_parallel.planner.cost.ADAM_OPS_PER_TENSOR` ops at
    :attr:`op_overhead_s`."""
    optimizer_dtensor_s: float = 0.0
    """The same per ``DTensor`` parameter (FSDP2 shards, tensor-parallel weights: every op of the step goes through
    DTensor's sharding propagation); calibrated. 0: :attr:`optimizer_tensor_s`."""
    host_batch_share: float = 1.0
    """Share of the host overhead (:meth:`host_overhead`) that recurs with every batch when a step accumulates several
    (Lightning's loop and hooks, the logged values); the rest -- the optimizer step of the one-layer model, its
    gradient sync -- comes once per step. Calibrated (the same fit accumulating 4 batches against 1: about half on
    CPU); 1 when unknown (an upper bound)."""
    distributed_overhead_s: float = 0.0
    """Framework time per step of a data-parallel fit over :attr:`calibrated_ranks` ranks (the library's ``lp_ddp``,
    a one-layer model: Lightning's loop, the gradient and logged-value all-reduces as a step meets them);
    calibrated on CPU. Used for layouts of more than one rank; 0: :attr:`host_overhead_s`."""
    fsdp_unit_s: float = 0.0
    """Seconds one FSDP2 unit adds to a training step beyond its arithmetic and its bytes (its gathers' and
    reduce-scatter's latency as a step meets them, hooks, bookkeeping), over :attr:`calibrated_ranks` ranks;
    calibrated. 0: unknown, the collectives' latencies alone (``alpha`` per call) are counted."""
    pp_micro_batch_s: float = 0.0
    """Seconds one more micro-batch adds to a step of a 1F1B pipeline of one tiny stage per calibration rank
    (torch's pipelining runtime: its sends and receives, the schedule's Python) beyond its arithmetic and bytes;
    calibrated. 0: unknown, ``alpha`` per point-to-point transfer."""
    cp_layer_s: float = 0.0
    """Seconds one layer's ring attention over the calibration's ranks adds to a step (its transfers along the ring
    in forward and backward, its Python) beyond the attention's arithmetic and bytes; calibrated. 0: unknown,
    ``alpha`` per transfer."""
    cp_element_s: float = 0.0
    """Seconds a layer's ring attention adds per element of a rank's queries (``batch x tokens / cp x width / tp``)
    beyond :attr:`cp_layer_s` and the attention's arithmetic: its block kernels' calls, fp32 merges and
    accumulators, the copies along the ring; calibrated. 0: unknown, not counted."""
    tp_pair_s: float = 0.0
    """Seconds one Megatron pair of DTensor linears (column- then row-parallel) adds to a training step beyond its
    arithmetic and its bytes (two all-reduces' latency as a step meets them, DTensor dispatch); calibrated. 0:
    unknown, ``alpha`` per all-reduce."""
    offload_step_s: float = 0.0
    """Seconds ZeRO-offload's engine (DeepSpeed's, the optimizer on the host) costs per step beyond the arithmetic
    and the bytes it moves (its Python, the flat collectives' latency, the host optimizer's call), over
    :attr:`calibrated_ranks` ranks; calibrated where DeepSpeed's ops are built. 0: unknown, not counted."""
    offload_tensor_s: float = 0.0
    """The same engine's seconds per parameter tensor and step (its gradient hooks, copies to and from the host
    partition, the host Adam's per-tensor work); calibrated with :attr:`offload_step_s`."""
    offload_param_s: float = 0.0
    """The same engine's whole seconds per parameter of the model and step over :attr:`calibrated_ranks` ranks: its
    copies into and out of the flat partitions, the host link, the host Adam, the flat exchange's bytes; the
    step-time model adds what of it the host link, the host Adam's rate and the exchange do not already count."""
    busy: Mapping[str, float] = field(default_factory=dict)
    """Share of each calibrated cost a rank spends on its CPU (CPU time over wall time; the rest it waits for other
    ranks or the network): ``fsdp_unit``, ``tp_pair``, ``pp_micro_batch``, ``cp_layer``, ``offload_step``,
    ``offload_tensor``, ``collectives``; measured on CPU. When ranks outnumber the cores, only that share competes
    for them (:meth:`Rates.busy_share`)."""
    cores: int = 0
    """CPU cores the calibration ran on (0: not a CPU calibration): ranks beyond them share cores
    (:meth:`core_share`)."""
    calibrated_ranks: int = 0
    """Ranks the calibration ran at once (0: a profile or the defaults): its compute rates are what each of them
    reached, its collectives' latencies are of a ring of that many ranks."""
    overlap: float = 1.0
    """Share of overlappable communication (DDP buckets, FSDP prefetch) that hides under compute: 1 where a device
    computes while its links move data (GPUs, NCCL); 0 on CPU ranks, whose gloo transfers run on the same cores."""
    source: str = "defaults"
    """Where the figures come from: ``calibrated <host> <date>``, ``profile <name>`` or ``defaults``."""

    def matmul_rate(self, dtype: str, *, m: float = 4096, n: float = 4096, k: float = 4096) -> float:
        """FLOP/s of an ``m x k`` by ``k x n`` GEMM in ``dtype``: the measured edges interpolated in log space at the
        cube root of ``m n k``, clamped at the ends; the large-GEMM rate without a shape table."""
        table = self.matmul_by_shape.get(dtype)
        if not table:
            return self.matmul_flops[dtype]
        edge = max(1.0, (max(m, 1) * max(n, 1) * max(k, 1)) ** (1 / 3))
        points = sorted((float(edge), rate) for edge, rate in table.items())
        if edge <= points[0][0]:
            return points[0][1]
        for (x0, r0), (x1, r1) in itertools.pairwise(points):
            if edge <= x1:
                w = math.log(edge / x0) / math.log(x1 / x0)
                return math.exp(math.log(r0) * (1 - w) + math.log(r1) * w)
        return points[-1][1]

    @property
    def optimizer_rate(self) -> float:
        """Bytes/s of the optimizer step: :attr:`optimizer_bandwidth`, else :attr:`memory_bandwidth`."""
        return self.optimizer_bandwidth or self.memory_bandwidth

    @property
    def elementwise_rate(self) -> float:
        """Bytes/s of the memory-bound ops: :attr:`elementwise_bandwidth`, else :attr:`memory_bandwidth`."""
        return self.elementwise_bandwidth or self.memory_bandwidth

    def host_overhead(self, ranks: int) -> float:
        """Framework seconds per step of a run of ``ranks`` ranks: :attr:`distributed_overhead_s` when more than one
        and calibrated, else :attr:`host_overhead_s`."""
        return self.distributed_overhead_s if ranks > 1 and self.distributed_overhead_s > 0 else self.host_overhead_s

    def core_share(self, ranks: int) -> float:
        """How much slower each of ``ranks`` CPU ranks on one machine computes than the calibration's ranks did:
        ``max(1, ranks / cores) / max(1, calibrated_ranks / cores)`` (ranks beyond the cores take turns on them);
        1 for an accelerator, a profile or the defaults."""
        if self.cores <= 0 or self.calibrated_ranks <= 0:
            return 1.0
        return max(1.0, ranks / self.cores) / max(1.0, self.calibrated_ranks / self.cores)

    def busy_share(self, part: str) -> float:
        """The share of ``part``'s time on the CPU (:attr:`busy`); 1 when not measured."""
        return self.busy.get(part, 1.0)

    def ring_latency_scale(self, collective: str, ranks: int) -> float:
        """A calibrated collective's latency for a group of ``ranks``: a ring's ``ranks - 1`` steps against the
        calibration's (point-to-point: 1); 1 for a profile's or the defaults' figures, which are per collective."""
        if collective == "p2p" or self.calibrated_ranks <= 1 or ranks <= 1:
            return 1.0
        return (ranks - 1) / (self.calibrated_ranks - 1)

    def peak(self, dtype: str) -> float:
        """The calibrated (or vendor) peak FLOP/s of ``dtype``."""
        return self.peak_flops.get(dtype, self.matmul_flops[dtype])

    def to_dict(self) -> dict[str, Any]:
        """The YAML/JSON form :func:`rates_from_dict` reads back."""
        return {
            "matmul_tflops": {k: v / 1e12 for k, v in self.matmul_flops.items()},
            "matmul_tflops_by_shape": {d: {c: r / 1e12 for c, r in t.items()} for d, t in self.matmul_by_shape.items()},
            "peak_tflops": {k: v / 1e12 for k, v in self.peak_flops.items()},
            "memory_bandwidth_gbs": self.memory_bandwidth / 1e9,
            "links": {kind: {c: {"alpha_us": r.alpha * 1e6, "beta_gbs": r.beta / 1e9}
                             for c, r in link.collectives.items()} for kind, link in self.links.items()},
            "host_overhead_ms": self.host_overhead_s * 1e3,
            **({"host_batch_share": self.host_batch_share} if self.host_batch_share != 1.0 else {}),
            "attention_efficiency": self.attention_efficiency,
            **({"attention_call_us": self.attention_call_s * 1e6} if self.attention_call_s else {}),
            "host_link_gbs": self.host_link_bandwidth / 1e9,
            "host_optimizer_params_per_s": self.host_optimizer_params_per_s,
            "nvme_gbs": self.nvme_bandwidth / 1e9,
            "overlap": self.overlap,
            "op_overhead_us": self.op_overhead_s * 1e6,
            **({"optimizer_gbs": self.optimizer_bandwidth / 1e9} if self.optimizer_bandwidth else {}),
            **({"optimizer_tensor_us": self.optimizer_tensor_s * 1e6} if self.optimizer_tensor_s else {}),
            **({"optimizer_dtensor_us": self.optimizer_dtensor_s * 1e6} if self.optimizer_dtensor_s else {}),
            **({"distributed_overhead_ms": self.distributed_overhead_s * 1e3} if self.distributed_overhead_s else {}),
            **({"fsdp_unit_ms": self.fsdp_unit_s * 1e3} if self.fsdp_unit_s else {}),
            **({"tp_pair_ms": self.tp_pair_s * 1e3} if self.tp_pair_s else {}),
            **({"pp_micro_batch_ms": self.pp_micro_batch_s * 1e3} if self.pp_micro_batch_s else {}),
            **({"cp_layer_ms": self.cp_layer_s * 1e3} if self.cp_layer_s else {}),
            **({"cp_element_ns": self.cp_element_s * 1e9} if self.cp_element_s else {}),
            **({"offload_step_ms": self.offload_step_s * 1e3} if self.offload_step_s else {}),
            **({"offload_tensor_ms": self.offload_tensor_s * 1e3} if self.offload_tensor_s else {}),
            **({"offload_param_ns": self.offload_param_s * 1e9} if self.offload_param_s else {}),
            **({"busy": dict(self.busy)} if self.busy else {}),
            **({"cores": self.cores} if self.cores else {}),
            **({"calibrated_ranks": self.calibrated_ranks} if self.calibrated_ranks else {}),
            **({"elementwise_gbs": self.elementwise_bandwidth / 1e9} if self.elementwise_bandwidth else {}),
            "source": self.source,
        }


_KEYS = {"matmul_tflops", "matmul_tflops_by_shape", "peak_tflops", "memory_bandwidth_gbs", "links",
         "host_overhead_ms", "attention_efficiency", "attention_call_us", "host_link_gbs",
         "host_optimizer_params_per_s", "nvme_gbs",
         "overlap", "elementwise_gbs", "op_overhead_us", "distributed_overhead_ms", "fsdp_unit_ms", "tp_pair_ms",
         "pp_micro_batch_ms", "cp_layer_ms", "cores", "calibrated_ranks", "optimizer_gbs", "optimizer_tensor_us",
         "optimizer_dtensor_us", "offload_step_ms", "offload_tensor_ms", "offload_param_ns", "cp_element_ns", "busy",
         "host_batch_share", "source"}


def _link(data: Mapping[str, Any], where: str) -> LinkRates:
    missing = [c for c in COLLECTIVES if c not in data]
    if missing:
        raise ValueError(f"{where}: collectives {missing} missing; give alpha_us and beta_gbs for each of "
                         f"{list(COLLECTIVES)}.")
    return LinkRates({c: CollectiveRate(alpha=float(data[c]["alpha_us"]) * 1e-6, beta=float(data[c]["beta_gbs"]) * 1e9)
                      for c in COLLECTIVES})


def rates_from_dict(data: Mapping[str, Any], *, source: str = "") -> Rates:
    """A :class:`Rates` from the ``rates:`` section of a profile or a calibration cache (units in the key names:
    TFLOP/s, GB/s = 1e9 B/s, microseconds, milliseconds)."""
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ValueError(f"rates: unknown keys {unknown}. Valid keys: {sorted(_KEYS)}.")
    for key in ("matmul_tflops", "memory_bandwidth_gbs", "links"):
        if key not in data:
            raise ValueError(f"rates: {key} is missing (see docs/planner.md, 'Rates').")
    matmul = {k: float(v) * 1e12 for k, v in data["matmul_tflops"].items()}
    links = {kind: _link(data["links"][kind], f"rates.links.{kind}") for kind in LINK_KINDS if kind in data["links"]}
    if "intra_node" not in links:
        raise ValueError("rates.links.intra_node is missing.")
    links.setdefault("inter_node", links["intra_node"])
    optional: dict[str, Any] = {}
    scaled = {"host_overhead_ms": ("host_overhead_s", 1e-3), "host_link_gbs": ("host_link_bandwidth", 1e9),
              "nvme_gbs": ("nvme_bandwidth", 1e9), "attention_efficiency": ("attention_efficiency", 1.0),
              "attention_call_us": ("attention_call_s", 1e-6),
              "host_optimizer_params_per_s": ("host_optimizer_params_per_s", 1.0), "overlap": ("overlap", 1.0),
              "elementwise_gbs": ("elementwise_bandwidth", 1e9), "op_overhead_us": ("op_overhead_s", 1e-6),
              "fsdp_unit_ms": ("fsdp_unit_s", 1e-3), "tp_pair_ms": ("tp_pair_s", 1e-3),
              "distributed_overhead_ms": ("distributed_overhead_s", 1e-3),
              "pp_micro_batch_ms": ("pp_micro_batch_s", 1e-3), "cp_layer_ms": ("cp_layer_s", 1e-3),
              "optimizer_gbs": ("optimizer_bandwidth", 1e9), "optimizer_tensor_us": ("optimizer_tensor_s", 1e-6),
              "optimizer_dtensor_us": ("optimizer_dtensor_s", 1e-6), "offload_step_ms": ("offload_step_s", 1e-3),
              "offload_tensor_ms": ("offload_tensor_s", 1e-3), "offload_param_ns": ("offload_param_s", 1e-9),
              "cp_element_ns": ("cp_element_s", 1e-9), "host_batch_share": ("host_batch_share", 1.0)}
    for key, (name, scale) in scaled.items():
        if key in data:
            optional[name] = float(data[key]) * scale
    if not 0.0 <= optional.get("host_batch_share", 1.0) <= 1.0:
        raise ValueError(f"rates.host_batch_share={data['host_batch_share']!r}: a share of the host overhead, within "
                         "[0, 1].")
    for key in ("cores", "calibrated_ranks"):
        if key in data:
            optional[key] = int(data[key])
    if data.get("busy"):
        busy = {str(k): float(v) for k, v in data["busy"].items()}
        bad = {k: v for k, v in busy.items() if not 0.0 <= v <= 1.0}
        if bad:
            raise ValueError(f"rates.busy {bad}: each share of time on the CPU must be within [0, 1].")
        optional["busy"] = busy
    return Rates(
        matmul_flops=matmul,
        matmul_by_shape={d: {c: float(r) * 1e12 for c, r in t.items()}
                         for d, t in (data.get("matmul_tflops_by_shape") or {}).items()},
        peak_flops={k: float(v) * 1e12 for k, v in (data.get("peak_tflops") or data["matmul_tflops"]).items()},
        memory_bandwidth=float(data["memory_bandwidth_gbs"]) * 1e9,
        links=links,
        source=str(data.get("source") or source or "profile"),
        **optional,
    )


CPU_GLOO = (100e-6, 0.25e9)
"""Default alpha (s) and beta (B/s) of gloo between CPU ranks of one machine: what a 2-core VM gave (tensor
parallelism's 19 MB of all-reduces per step cost about 0.3 s there); a calibration replaces it."""

_LINK_ALPHA = {"nvlink": 10e-6, "pcie": 20e-6, "fast": 15e-6, "slow": 50e-6}


def default_rates(hardware: Any) -> Rates:
    """Rates from a profile without a ``rates:`` section: ``peak_tflops`` (16-bit; fp32 at a quarter) at 70 % for
    large GEMMs, the link kinds' rough bandwidths (:data:`LINK_BANDWIDTH`) with
    a latency each (CPU ranks: :data:`CPU_GLOO`), and 2 TB/s of memory bandwidth on accelerators (20 GB/s on
    CPU)."""
    peak16 = float(hardware.peak_tflops) * 1e12
    peak = {"bf16": peak16, "fp16": peak16, "fp32": peak16 / 4}

    def link(kind: str) -> LinkRates:
        rate = CollectiveRate(alpha=_LINK_ALPHA[kind], beta=LINK_BANDWIDTH[kind])
        return LinkRates(dict.fromkeys(COLLECTIVES, rate))

    cpu = getattr(hardware, "accelerator", "gpu") == "cpu"
    intra = link(hardware.intra_node)
    if cpu:  # gloo between CPU ranks of one machine: TCP through the kernel, on the cores that compute
        intra = LinkRates(dict.fromkeys(COLLECTIVES, CollectiveRate(alpha=CPU_GLOO[0], beta=CPU_GLOO[1])))
    return Rates(
        matmul_flops={k: 0.7 * v for k, v in peak.items()},
        peak_flops=peak,
        memory_bandwidth=20e9 if cpu else 2e12,
        links={"intra_node": intra, "inter_node": link(hardware.inter_node)},
        host_link_bandwidth=LINK_BANDWIDTH["host"],
        nvme_bandwidth=LINK_BANDWIDTH["nvme"],
        overlap=0.0 if cpu else 1.0,
        source=f"defaults from {getattr(hardware, 'name', 'custom')} (peak_tflops {hardware.peak_tflops:g})",
    )
