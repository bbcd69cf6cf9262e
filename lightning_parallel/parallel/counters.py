"""The one communication counter of the library, off unless a run asks for it.

Nothing in a training step counts by default: no strategy, optimizer or collective helper of the library calls
into this module. A run that wants the figures turns the counter on -- the ``ZeroStats`` callback, a strategy's
``count_communication()``, the benchmark -- and :meth:`CommCounter.counting` then sees every byte from outside:

* the ``torch.distributed`` functions (both ``torch.distributed`` and ``distributed_c10d`` namespaces) are wrapped
  while the block is open: the library's own reduce-scatters, all-gathers, all-reduces and broadcasts, FSDP2's,
  torch pipelining's point-to-point sends;
* DTensor's functional collectives (``_c10d_functional.*``: tensor parallelism, ``loss_parallel``) through a
  ``TorchDispatchMode``;
* DDP's gradient buckets, which the C++ reducer all-reduces without Python, through :func:`counting_allreduce_hook`
  (the exact all-reduce of torch's default hook, counted);
* the DP engine's in-process exchanges between the devices of one process (``lp_dp``: scatter, replicate, gather,
  reduce), recorded by the engine with :meth:`CommCounter.record` when it is given a counter.

Accounting (what a ring algorithm sends per rank, the model of the ZeRO paper's ``2 Psi`` and ``3 Psi``): for a
buffer of ``B`` bytes over ``N`` ranks, a reduce-scatter, an all-gather, a broadcast, a reduce and an all-to-all
each send ``(N-1)/N * B`` bytes per rank, an all-reduce ``2 (N-1)/N * B``; a point-to-point send its tensor's bytes.
Each collective is booked by kind, by ``phase`` (set from outside: ``"forward"``, ``"backward"``, ...) and by mesh
axis (``dp``, ``pp``, ``tp`` from the process group's ranks when the counter knows the layout, else ``group``).
No Lightning import.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ALLREDUCE_GRADS",
    "DP_KINDS",
    "GATHER_OUTPUTS",
    "REDUCE_GRADS",
    "REPLICATE_PARAMS",
    "SCATTER_GRAD",
    "SCATTER_INPUTS",
    "CommCounter",
    "CountingHookState",
    "ExchangeStats",
    "counting_allreduce_hook",
    "ring_bytes",
    "tensor_bytes",
    "uncounted_all_reduce",
]

SCATTER_INPUTS = "scatter_inputs"
REPLICATE_PARAMS = "replicate_params"
GATHER_OUTPUTS = "gather_outputs"
SCATTER_GRAD = "scatter_grad"
REDUCE_GRADS = "reduce_grads"
ALLREDUCE_GRADS = "allreduce_grads"
DP_KINDS: tuple[str, ...] = (SCATTER_INPUTS, REPLICATE_PARAMS, GATHER_OUTPUTS, SCATTER_GRAD, REDUCE_GRADS)
"""The five exchanges of single-process DP (``lp_dp``), in the order a training step makes them; DDP makes one,
:data:`ALLREDUCE_GRADS`."""

# collective kind -> factor of (N-1)/N * bytes of the full buffer
_RING_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "broadcast": 1.0, "reduce": 1.0,
                "all_to_all": 1.0}

# torch.distributed function -> (kind, argument holding the full buffer, how to read it)
_WRAPPED: dict[str, tuple[str, str, str]] = {
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

# DTensor's functional collectives -> kind
_FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
               "all_gather_into_tensor": "all_gather", "all_reduce_coalesced": "all_reduce",
               "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor_coalesced": "reduce_scatter",
               "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast"}


def ring_bytes(kind: str, *, full_bytes: int, world_size: int) -> float:
    """Bytes one rank sends for a ring ``kind`` collective over a full buffer of ``full_bytes`` bytes."""
    if world_size <= 1:
        return 0.0
    return _RING_FACTOR[kind] * (world_size - 1) / world_size * full_bytes


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (what a transfer of it moves)."""
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class ExchangeStats:
    """One kind of exchange over a number of steps: calls and bytes, in total and per step."""

    kind: str
    calls: int
    nbytes: float
    steps: int

    @property
    def calls_per_step(self) -> float:
        return self.calls / max(1, self.steps)

    @property
    def bytes_per_step(self) -> float:
        return self.nbytes / max(1, self.steps)


class CommCounter:
    """Bytes and calls of what this rank sends, by kind, phase and mesh axis, since the last :meth:`reset`.

    Thread-safe (the DP engine records from its worker threads). :meth:`step` marks optimizer steps for the
    per-step figures. Args: ``dims``/``rank``: the layout and this rank, to name the axis of each process group
    (without them every collective is booked under ``group``).
    """

    def __init__(self, *, dims: Any = None, rank: int = 0) -> None:
        self.dims, self.rank = dims, rank
        self.phase = "step"
        """Under which phase the next records are booked (set by whoever knows: ``forward``, ``backward``, ...)."""
        self.enabled = True
        """False pauses counting (e.g. while a validation loop runs inside a fit)."""
        self._lock = threading.Lock()
        self._depth = threading.local()
        self._calls: dict[tuple[str, str, str], int] = defaultdict(int)
        self._bytes: dict[tuple[str, str, str], float] = defaultdict(float)
        self._steps = 0

    def __getstate__(self) -> dict[str, Any]:  # spawn launchers pickle the strategy that holds one
        state = dict(self.__dict__)
        del state["_lock"], state["_depth"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._depth = threading.local()

    # ------------------------------------------------------------------ recording
    def record(self, kind: str, nbytes: float, *, calls: int = 1, axis: str = "local") -> None:
        """Book ``calls`` transfers of ``kind`` moving ``nbytes`` bytes in all, under the current phase."""
        if not self.enabled:
            return
        with self._lock:
            self._calls[(self.phase, axis, kind)] += calls
            self._bytes[(self.phase, axis, kind)] += float(nbytes)

    def record_collective(self, kind: str, *, full_bytes: int, group: Any = None) -> None:
        """Book one ``kind`` collective over ``group`` of a ``full_bytes`` buffer (ring model); one-rank groups send
        nothing and are not booked."""
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if len(ranks) > 1:
            self.record(kind, ring_bytes(kind, full_bytes=full_bytes, world_size=len(ranks)),
                        axis=self.axis_of_ranks(ranks))

    def axis_of_ranks(self, ranks: list[int]) -> str:
        """The mesh axis whose group is ``ranks`` (``world`` for the whole world of a layout of several axes)."""
        if self.dims is None:
            return "group"
        axes = ("dp", "pp", "cp", "tp") if getattr(self.dims, "cp", 1) > 1 else ("dp", "pp", "tp")
        if len(ranks) == self.dims.world_size and sum(self.dims.size(a) > 1 for a in axes) > 1 and \
                not (getattr(self.dims, "cp", 1) > 1 and len(ranks) == self.dims.replicas):
            return "world"
        for axis in axes:
            if self.dims.size(axis) > 1 and sorted(ranks) == sorted(self.dims.group_ranks(axis, self.rank)):
                return axis
        if getattr(self.dims, "cp", 1) > 1 and sorted(ranks) == sorted(self.dims.replica_group_ranks(self.rank)):
            return "dp_cp"  # the replicas of context parallelism: dp x cp
        if getattr(self.dims, "hsdp", False):
            for part in ("dp_shard", "dp_replicate"):
                if sorted(ranks) == sorted(self.dims.dp_subgroup_ranks(part, self.rank)):
                    return part
        return "other"

    def axis_of_peer(self, peer: int) -> str:
        """The mesh axis along which global rank ``peer`` differs from this rank (point-to-point)."""
        if self.dims is None:
            return "group"
        axes = ("dp", "pp", "cp", "tp") if getattr(self.dims, "cp", 1) > 1 else ("dp", "pp", "tp")
        moved = [a for a in axes if self.dims.coord(self.rank, a) != self.dims.coord(peer, a)]
        return moved[0] if len(moved) == 1 else "other"

    # ------------------------------------------------------------------ reading
    def _sum(self, table: dict[tuple[str, str, str], Any], *, phase: str | None, kind: str | None,
             axis: str | None) -> Any:
        with self._lock:
            return sum(v for (p, a, k), v in table.items()
                       if (phase is None or p == phase) and (kind is None or k == kind) and (axis is None or a == axis))

    def total(self, phase: str | None = None, *, kind: str | None = None, axis: str | None = None) -> float:
        """Bytes booked, optionally for one phase, kind and/or axis."""
        return float(self._sum(self._bytes, phase=phase, kind=kind, axis=axis))

    def count(self, phase: str | None = None, kind: str | None = None, *, axis: str | None = None) -> int:
        """Calls booked, optionally for one phase, kind and/or axis."""
        return int(self._sum(self._calls, phase=phase, kind=kind, axis=axis))

    def _by(self, table: dict[tuple[str, str, str], Any], index: int) -> dict[str, Any]:
        out: dict[str, Any] = defaultdict(type(next(iter(table.values()), 0)))
        with self._lock:
            for key, value in table.items():
                out[key[index]] += value
        return dict(out)

    def _by_phase(self, table: dict[tuple[str, str, str], Any]) -> dict[tuple[str, str], Any]:
        out: dict[tuple[str, str], Any] = defaultdict(type(next(iter(table.values()), 0)))
        with self._lock:
            for (phase, _, kind), value in table.items():
                out[(phase, kind)] += value
        return dict(out)

    def calls_by_phase(self) -> dict[tuple[str, str], int]:
        """Calls by ``(phase, kind)``."""
        return self._by_phase(self._calls)

    def bytes_by_phase(self) -> dict[tuple[str, str], float]:
        """Bytes by ``(phase, kind)``."""
        return self._by_phase(self._bytes)

    @property
    def bytes_by_kind(self) -> dict[str, float]:
        return self._by(self._bytes, 2)

    @property
    def calls_by_kind(self) -> dict[str, int]:
        return self._by(self._calls, 2)

    @property
    def bytes_by_axis(self) -> dict[str, float]:
        return self._by(self._bytes, 1)

    @property
    def total_bytes(self) -> float:
        return self.total()

    def snapshot(self) -> dict[str, float]:
        """Bytes by kind and their ``total``."""
        return {**self.bytes_by_kind, "total": self.total_bytes}

    def reset(self) -> None:
        """Forget everything counted so far (a new step's window; after warm-up steps)."""
        with self._lock:
            self._calls.clear()
            self._bytes.clear()
            self._steps = 0

    def step(self, n: int = 1) -> None:
        """Mark the end of ``n`` optimizer steps (the per-step figures divide by this)."""
        with self._lock:
            self._steps += n

    @property
    def steps(self) -> int:
        return self._steps

    def stats(self) -> list[ExchangeStats]:
        """Per-kind totals, the DP kinds first in step order, then any others."""
        calls, nbytes = self.calls_by_kind, self.bytes_by_kind
        order = [k for k in DP_KINDS if k in calls] + sorted(k for k in calls if k not in DP_KINDS)
        return [ExchangeStats(k, calls[k], nbytes[k], self._steps) for k in order]

    @property
    def exchanges_per_step(self) -> int:
        """Distinct kinds of exchange a step makes (five for DP, one for DDP)."""
        return len(self.calls_by_kind)

    @property
    def bytes_per_step(self) -> float:
        return sum(s.bytes_per_step for s in self.stats())

    @property
    def calls_per_step(self) -> float:
        return sum(s.calls_per_step for s in self.stats())

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly summary: steps, exchanges per step, and per kind calls/bytes per step."""
        return {
            "steps": self._steps,
            "exchanges_per_step": self.exchanges_per_step,
            "calls_per_step": self.calls_per_step,
            "bytes_per_step": self.bytes_per_step,
            "kinds": {s.kind: {"calls_per_step": s.calls_per_step, "bytes_per_step": s.bytes_per_step}
                      for s in self.stats()},
        }

    def describe(self) -> str:
        """One line per kind: ``kind: calls/step, MiB/step``."""
        lines = [f"{s.kind}: {s.calls_per_step:.1f} calls/step, {s.bytes_per_step / 2**20:.3f} MiB/step"
                 for s in self.stats()]
        return "\n".join(lines) if lines else "(no exchanges counted)"

    # ------------------------------------------------------------------ turning it on
    @contextlib.contextmanager
    def counting(self, *, functional: bool = True) -> Iterator[CommCounter]:
        """Count every ``torch.distributed`` collective (and, with ``functional``, DTensor's functional ones) issued
        in this process while the block is open; the original functions are back afterwards."""
        from torch.distributed import distributed_c10d as c10d

        originals: list[tuple[Any, str, Any]] = []
        wrapped = {name: self._wrap(name, fn) for name in _WRAPPED if (fn := getattr(c10d, name, None)) is not None}
        for module in (c10d, dist):
            for name, fn in wrapped.items():
                originals.append((module, name, getattr(module, name, None)))
                setattr(module, name, fn)
        try:
            with self.functional() if functional else contextlib.nullcontext():
                yield self
        finally:
            for module, name, fn in reversed(originals):
                setattr(module, name, fn)

    def functional(self) -> contextlib.AbstractContextManager[Any]:
        """Count DTensor's functional collectives (tensor parallelism, ``loss_parallel``) while the block is open:
        a ``TorchDispatchMode``, entered on the thread that runs them."""
        return _FunctionalCollectives(self)

    def by_axis_and_kind(self) -> dict[str, tuple[int, float]]:
        """``"axis:kind"`` -> (calls, bytes), over every phase."""
        out: dict[str, tuple[int, float]] = {}
        with self._lock:
            for (_, axis, kind), calls in self._calls.items():
                c, b = out.get(f"{axis}:{kind}", (0, 0.0))
                out[f"{axis}:{kind}"] = (c + calls, b + self._bytes[(_, axis, kind)])
        return out

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        kind, arg, how = _WRAPPED[name]
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0 and self.enabled:  # a collective implemented by another counts once
                self._book(kind, arg, how, signature.bind(*args, **kwargs).arguments)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return wrapper

    def _book(self, kind: str, arg: str, how: str, bound: dict[str, Any]) -> None:
        value, group = bound[arg], bound.get("group")
        if how == "p2p":
            peer = bound.get("dst")
            if peer is None:
                peer = dist.get_global_rank(group or dist.group.WORLD, bound["group_dst"])  # type: ignore[arg-type]
            self.record(kind, tensor_bytes(value), axis=self.axis_of_peer(int(peer)))
            return
        full = sum(tensor_bytes(t) for t in value) if how == "list" else tensor_bytes(value)
        self.record_collective(kind, full_bytes=int(full), group=group)


class _FunctionalCollectives(torch.utils._python_dispatch.TorchDispatchMode):
    """DTensor's functional collectives (run on plain local tensors) booked into a :class:`CommCounter`."""

    def __init__(self, counter: CommCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(t is DTensor or (isinstance(t, type) and issubclass(t, DTensor)) for t in types):
            return NotImplemented  # let DTensor run: its functional collectives come back here on plain tensors
        if func.namespace == "_c10d_functional" and self.counter.enabled:
            kind = _FUNCTIONAL.get(func._overloadpacket.__name__)
            if kind is not None:
                tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                group = dist.distributed_c10d._resolve_process_group(args[-1])
                size = sum(tensor_bytes(t) for t in tensors)
                world = dist.get_world_size(group)
                self.counter.record_collective(kind, full_bytes=size * world if kind == "all_gather" else size,
                                               group=group)
        return func(*args, **(kwargs or {}))


@dataclass
class CountingHookState:
    """State of :func:`counting_allreduce_hook`: the process group to all-reduce over and the counter."""

    process_group: Any
    counter: CommCounter


def counting_allreduce_hook(state: CountingHookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the exact default all-reduce (average over the group), counting each bucket's payload as one
    :data:`ALLREDUCE_GRADS` call (the bytes each rank hands to the all-reduce). Register with
    ``ddp.register_comm_hook(CountingHookState(group, counter), counting_allreduce_hook)``; training stays
    bit-identical to DDP without a hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.counter.record(ALLREDUCE_GRADS, tensor_bytes(bucket.buffer()))
    return allreduce_hook(state.process_group, bucket)


# torch checks a hook's annotations as objects; with postponed (string) annotations it refuses the hook.
counting_allreduce_hook.__annotations__ = {
    "state": CountingHookState,
    "bucket": getattr(torch.distributed, "GradBucket", Any),
    "return": torch.futures.Future[torch.Tensor],
}


def uncounted_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.all_reduce`` past any counter that wraps it (:meth:`CommCounter.counting`, a benchmark's):
    control traffic -- the ranks' per-batch agreement, in place of Lightning's broadcast -- is not the strategy's
    communication."""
    return inspect.unwrap(dist.all_reduce)(tensor, *args, **kwargs)
