"""Exchange accounting: how many transfers a step makes, of which kind, and how many bytes each moves.

DP makes five exchanges per batch, all through device 0, and DDP one (``docs/formulas.md``, "DP versus DDP: what
moves per step"). This module makes that countable. :class:`ExchangeCounter` is a thread-safe tally of
``kind -> (calls, bytes)``; the DP engine records into it at every transfer it makes, and
:func:`counting_allreduce_hook` is an exact DDP comm hook (a plain all-reduce, no compression) that records every
gradient bucket it all-reduces.

What a byte count means:

* DP kinds count the bytes that leave or reach device 0 for replicas ``1..N-1`` (replica 0 lives on device 0 and
  needs no transfer): :data:`SCATTER_INPUTS` (forward), :data:`REPLICATE_PARAMS` (forward, every step: the latest
  weights), :data:`GATHER_OUTPUTS` (forward), :data:`SCATTER_GRAD` (backward: the loss gradient sent back to the
  replicas), :data:`REDUCE_GRADS` (backward: the replicas' parameter gradients summed on device 0).
* DDP's :data:`ALLREDUCE_GRADS` counts the payload each rank hands to the all-reduce (the bucket size); a ring
  all-reduce sends ``2 (N-1)/N`` times that per rank.

No Lightning import here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ALLREDUCE_GRADS",
    "DP_KINDS",
    "GATHER_OUTPUTS",
    "REDUCE_GRADS",
    "REPLICATE_PARAMS",
    "SCATTER_GRAD",
    "SCATTER_INPUTS",
    "CountingHookState",
    "ExchangeCounter",
    "ExchangeStats",
    "counting_allreduce_hook",
    "tensor_bytes",
]

SCATTER_INPUTS = "scatter_inputs"
REPLICATE_PARAMS = "replicate_params"
GATHER_OUTPUTS = "gather_outputs"
SCATTER_GRAD = "scatter_grad"
REDUCE_GRADS = "reduce_grads"
ALLREDUCE_GRADS = "allreduce_grads"
DP_KINDS: tuple[str, ...] = (SCATTER_INPUTS, REPLICATE_PARAMS, GATHER_OUTPUTS, SCATTER_GRAD, REDUCE_GRADS)
"""The five DP exchanges in the order a training step makes them."""


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (what a transfer of it moves)."""
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class ExchangeStats:
    """One kind of exchange over a number of steps: transfer calls and bytes, in total and per step."""

    kind: str
    calls: int
    nbytes: int
    steps: int

    @property
    def calls_per_step(self) -> float:
        return self.calls / max(1, self.steps)

    @property
    def bytes_per_step(self) -> float:
        return self.nbytes / max(1, self.steps)


class ExchangeCounter:
    """Thread-safe tally of exchanges: ``record(kind, nbytes)`` per transfer, ``step()`` per optimizer step.

    ``exchanges_per_step`` is the number of distinct kinds seen per step (DP: 5, DDP: 1); ``calls`` counts the
    individual transfers (a DDP step all-reduces one bucket per call).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._steps = 0
        self.enabled = True

    def __getstate__(self) -> dict[str, Any]:  # the spawn launchers pickle the strategy that holds one
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def record(self, kind: str, nbytes: int, *, calls: int = 1) -> None:
        """Count ``calls`` transfers of kind ``kind`` moving ``nbytes`` bytes in all."""
        if not self.enabled:
            return
        with self._lock:
            self._calls[kind] = self._calls.get(kind, 0) + calls
            self._bytes[kind] = self._bytes.get(kind, 0) + int(nbytes)

    def step(self, n: int = 1) -> None:
        """Mark the end of ``n`` optimizer steps (the per-step figures divide by this)."""
        with self._lock:
            self._steps += n

    def reset(self) -> None:
        """Forget everything counted so far (e.g. after warm-up steps)."""
        with self._lock:
            self._calls.clear()
            self._bytes.clear()
            self._steps = 0

    @property
    def steps(self) -> int:
        return self._steps

    def stats(self) -> list[ExchangeStats]:
        """Per-kind totals, DP kinds first in step order, then any others."""
        with self._lock:
            order = [k for k in DP_KINDS if k in self._calls] + sorted(k for k in self._calls if k not in DP_KINDS)
            return [ExchangeStats(k, self._calls[k], self._bytes[k], self._steps) for k in order]

    @property
    def exchanges_per_step(self) -> int:
        """Distinct kinds of exchange a step makes (GUIDE: five for DP, one for DDP)."""
        return len(self._calls)

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
        """One line per kind: ``kind: calls/step, MB/step``."""
        lines = [f"{s.kind}: {s.calls_per_step:.1f} calls/step, {s.bytes_per_step / 2**20:.3f} MiB/step"
                 for s in self.stats()]
        return "\n".join(lines) if lines else "(no exchanges counted)"


@dataclass
class CountingHookState:
    """State of :func:`counting_allreduce_hook`: the process group to all-reduce over and the counter."""

    process_group: Any
    counter: ExchangeCounter


def counting_allreduce_hook(state: CountingHookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the exact default all-reduce (average over the group), counting each bucket's bytes.

    Register with ``ddp.register_comm_hook(CountingHookState(group, counter), counting_allreduce_hook)``. It records
    one :data:`ALLREDUCE_GRADS` call per bucket with the bucket's payload in bytes, then runs torch's own
    ``allreduce_hook`` unchanged, so training stays bit-identical to DDP without a hook.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.counter.record(ALLREDUCE_GRADS, tensor_bytes(bucket.buffer()))
    return allreduce_hook(state.process_group, bucket)


# torch checks a hook's annotations as objects; with postponed (string) annotations it refuses the hook.
counting_allreduce_hook.__annotations__ = {
    "state": CountingHookState,
    "bucket": getattr(torch.distributed, "GradBucket", Any),
    "return": torch.futures.Future[torch.Tensor],
}
