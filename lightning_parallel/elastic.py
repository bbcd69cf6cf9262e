"""Elastic training: the world read again at every (re)start, and the global batch kept when the data-parallel size
changes.

An elastic job (``scripts/launch/torchrun.sh --elastic MIN:MAX``: torchrun's elastic agent with a c10d rendezvous;
or ``scripts/launch/slurm.sbatch --elastic`` under a SLURM requeue) may restart on another number of nodes. Two
things make such a restart continue the *same* training:

* the layout is resolved again against the world the restart got (:func:`elastic_world`: torchrun's ``WORLD_SIZE``
  and ``LOCAL_WORLD_SIZE``, read by the command line in every rank; the recipe's ``auto`` degrees or ``lp_auto``'s
  plan), and a layout that no longer fits is refused with the reason;
* the global batch -- samples per optimizer step -- stays what ``parallel.global_batch_size`` says: the per-rank batch
  (the data module's ``batch_size``) is kept and gradient accumulation takes up the difference
  (:func:`accumulation_for`: ``accumulate_grad_batches = global_batch_size / (batch_size x dp)``), refused with the
  arithmetic when no whole number does it.

The checkpoint, the data position (in samples, so it maps onto any dp size) and the loop counters (rescaled to the
new accumulation by :class:`~lightning_parallel.callbacks.GlobalBatch`) do the rest. Plain Python: nothing here
starts a process or imports Lightning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lightning_parallel.config import LayoutError

__all__ = ["ELASTIC_ENV", "ElasticWorld", "accumulation_for", "elastic_requested", "elastic_world"]

ELASTIC_ENV = "LP_ELASTIC"
"""Set (to ``1``) by ``scripts/launch/torchrun.sh --elastic`` for its ranks: the command line then takes
``trainer.num_nodes`` and ``trainer.devices`` from the world torchrun's rendezvous formed, at every (re)start."""


@dataclass(frozen=True)
class ElasticWorld:
    """The world a torchrun (re)start got: ``nodes x devices_per_node`` ranks, this rank's node, the restart count."""

    world_size: int
    devices_per_node: int
    node_rank: int
    restart: int
    max_restarts: int | None

    @property
    def nodes(self) -> int:
        return self.world_size // self.devices_per_node

    def describe(self) -> str:
        restarts = f" of {self.max_restarts}" if self.max_restarts is not None else ""
        return (f"{self.nodes} node(s) x {self.devices_per_node} rank(s) = world {self.world_size} "
                f"(restart {self.restart}{restarts})")


def elastic_requested() -> bool:
    """Whether this process is a rank of an elastic launch (``LP_ELASTIC=1``, set by ``torchrun.sh --elastic``)."""
    return os.environ.get(ELASTIC_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def elastic_world() -> ElasticWorld:
    """The world torchrun's rendezvous formed for this (re)start, from the variables it sets in each rank.

    Raises :class:`LayoutError` outside torchrun or when the world is not ``nodes x ranks per node``."""
    try:
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        raise LayoutError(
            f"{ELASTIC_ENV}=1 says this is an elastic torchrun launch, but WORLD_SIZE / LOCAL_WORLD_SIZE are not set "
            "(they are set by torchrun in each rank). Fix: start the run with scripts/launch/torchrun.sh --elastic "
            f"MIN:MAX, or unset {ELASTIC_ENV}."
        ) from None
    if local < 1 or world < local or world % local:
        raise LayoutError(f"the elastic world of {world} ranks is not a whole number of nodes of {local} ranks "
                          "(torchrun starts the same --nproc-per-node on every node).")
    max_restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    return ElasticWorld(world_size=world, devices_per_node=local, node_rank=int(os.environ.get("GROUP_RANK", "0")),
                        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                        max_restarts=int(max_restarts) if max_restarts and max_restarts.isdigit() else None)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def accumulation_for(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """``accumulate_grad_batches`` that keeps ``global_batch_size`` samples per optimizer step with
    ``micro_batch_size`` samples per rank and batch on ``data_parallel_size`` replicas.

    Raises :class:`LayoutError` with the arithmetic and the fix when ``global_batch_size`` is not a whole multiple of
    ``micro_batch_size x data_parallel_size``."""
    g, b, dp = int(global_batch_size), int(micro_batch_size), int(data_parallel_size)
    if b < 1 or dp < 1:
        raise LayoutError(f"the per-rank batch size ({b}) and the data-parallel size ({dp}) must be positive.")
    per_batch = b * dp
    if g % per_batch == 0:
        return g // per_batch
    head = (f"parallel.global_batch_size={g} cannot be kept on this world: one optimizer step takes batch_size {b} "
            f"x dp {dp} x accumulate_grad_batches samples, and {g} / ({b} x {dp}) = {g / per_batch:.4g} is not a "
            f"whole number ({g} % {per_batch} = {g % per_batch}).")
    fixes = []
    if g % b == 0:
        fits = [d for d in _divisors(g // b) if d <= max(64, 2 * dp)]
        fixes.append(f"a world whose data-parallel size divides {g} / {b} = {g // b} (dp in {fits})")
    sizes = [s for s in _divisors(g // dp) if s <= 4 * b] if g % dp == 0 else []
    if sizes:
        fixes.append(f"a per-rank batch size (the data module's batch_size) dividing {g} / {dp} = {g // dp} "
                     f"({sizes})")
    fixes.append(f"global_batch_size a multiple of {per_batch}")
    return_line = f"{head} Fix: {'; or '.join(fixes)}."
    raise LayoutError(return_line)
