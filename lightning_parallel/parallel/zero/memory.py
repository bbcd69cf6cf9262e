"""Per-rank model-state bytes (parameters, gradients, optimizer state) and the ZeRO formulas they follow.

With ``Psi`` parameters, ``N`` dp ranks, ``P`` and ``G`` bytes per parameter and gradient element and ``K`` bytes of
optimizer state per parameter (``docs/formulas.md``, "ZeRO: model-state memory per device"; mixed-precision Adam has
``P = G = 2``, ``K = 12``; fp32 AdamW as trained here has ``P = G = 4``, ``K = 8``: ``exp_avg`` and ``exp_avg_sq``,
the parameters being the master copy)::

    stage 0 (DDP)  (P + G + K) Psi          stage 2  P Psi + (G + K) Psi / N
    stage 1        (P + G) Psi + K Psi / N  stage 3  (P + G + K) Psi / N

Communication per rank and step (ring, ``(N-1)/N`` of the buffer per pass): ``2 Psi`` elements for stages 0-2
(DDP all-reduce, or reduce-scatter + all-gather), ``3 Psi`` for stage 3 (two all-gathers + one reduce-scatter).
Measured bytes count each distinct storage once (a flat buffer and the parameter views into it are one storage);
DTensors count their local shard. No Lightning import.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["ModelStateBytes", "measure_model_state", "zero_comm_theory", "zero_memory_formula"]


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes one rank holds for the model state."""

    params: int
    grads: int
    optim: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _storage_bytes(tensors: Iterable[Any], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, Tensor):
            continue
        storage = _local(t).untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def measure_model_state(
    model: nn.Module, optimizer: Optimizer, *, extra_grads: Iterable[Tensor | None] = ()
) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state this rank holds (each storage counted once).

    ``extra_grads``: gradient tensors that live outside the model's ``.grad``; a
    :class:`~lightning_parallel.parallel.zero.ZeroOptimizer`'s gradient shards are found on their own.
    """
    seen: set[int] = set()
    params = list(model.parameters())
    param_bytes = _storage_bytes(params, seen)
    shard_grads = [s.shard_param.grad for s in getattr(optimizer, "shards", [])]  # ZeroOptimizer (stage 2's shards)
    grads = [*(p.grad for p in params if p.grad is not None), *shard_grads, *extra_grads]
    grad_bytes = _storage_bytes(grads, seen)
    state = [v for s in optimizer.state.values() for v in s.values()]
    optim_bytes = _storage_bytes(state, seen)
    return ModelStateBytes(params=param_bytes, grads=grad_bytes, optim=optim_bytes)


def zero_memory_formula(stage: int, *, numel: int, world_size: int, param_bytes: int = 4, grad_bytes: int = 4,
                        optim_bytes: int = 8) -> float:
    """Model-state bytes per rank the ZeRO paper predicts for ``stage`` (see the module doc)."""
    p, g, k, n, psi = param_bytes, grad_bytes, optim_bytes, world_size, numel
    formulas = {0: (p + g + k) * psi, 1: (p + g) * psi + k * psi / n, 2: p * psi + (g + k) * psi / n,
                3: (p + g + k) * psi / n}
    if stage not in formulas:
        raise ValueError(f"zero stage {stage} is not one of 0, 1, 2, 3.")
    return float(formulas[stage])


def zero_comm_theory(stage: int, *, numel: int, world_size: int, elem_bytes: int = 4, kept_numel: int = 0) -> float:
    """Bytes one rank sends per step: ``2 Psi`` (stages 0-2) or ``3 Psi`` (stage 3) x elem_bytes x (N-1)/N; at
    stage 3 less the ``kept_numel`` parameters of a unit kept gathered from its forward into its backward (gathered
    once, not twice: the head under ``apply_zero3(keep_last_gathered=True)``, the library's default)."""
    elements = 3 * numel - kept_numel if stage == 3 else 2 * numel
    return elements * elem_bytes * (world_size - 1) / world_size
