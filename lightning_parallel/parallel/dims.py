"""``ParallelDims``: the single owner of the parallel degrees and the named DeviceMesh.

The world of ``W`` ranks is arranged as a 3-D mesh with named axes ``("dp", "pp", "tp")`` in that order, so ``tp``
is innermost: ranks ``r`` and ``r + 1`` differ in their tp coordinate first, which puts tensor-parallel peers (two
all-reduces per layer in forward and two in backward) on the same node and its fast links, then pipeline
neighbours (point-to-point activations), and data-parallel replicas (one gradient all-reduce or reduce-scatter per
step) outermost, across nodes::

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

Nothing else in the library creates process groups: strategies ask this object for the mesh and its sub-groups.
No Lightning import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from lightning_parallel.config import LayoutError, ParallelConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_AXES", "ParallelDims", "RankCoords"]

MESH_AXES: tuple[str, str, str] = ("dp", "pp", "tp")


class RankCoords(NamedTuple):
    """A rank's coordinates in the ``(dp, pp, tp)`` mesh."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees of a layout for a given world size: ``dp * pp * tp == world_size``.

    Build it with :meth:`from_config`, which resolves ``data_parallel_size='auto'`` and checks the product; the mesh
    is created once per process by :meth:`build_mesh` after the default process group exists.
    """

    dp: int
    pp: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        for name, value in (("dp", self.dp), ("pp", self.pp), ("tp", self.tp), ("world_size", self.world_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name}={value!r} must be a positive integer.")
        if self.dp * self.pp * self.tp != self.world_size:
            raise LayoutError(
                f"data_parallel_size ({self.dp}) x pipeline_parallel_size ({self.pp}) x tensor_parallel_size "
                f"({self.tp}) = {self.dp * self.pp * self.tp}, but the world size is {self.world_size}. "
                f"Fix: make the product equal {self.world_size}, for example data_parallel_size='auto'."
            )

    @classmethod
    def from_config(
        cls, config: ParallelConfig, *, world_size: int, devices_per_node: int | None = None, num_nodes: int = 1
    ) -> ParallelDims:
        """Resolve ``config`` against ``world_size`` ranks; raises :class:`LayoutError` with the arithmetic.

        ``devices_per_node`` and ``num_nodes`` only make the message say where the world size came from and add the
        rule that ``tensor_parallel_size`` should not exceed the devices of one node.
        """
        where = (
            f" (devices={devices_per_node} per node x num_nodes={num_nodes})" if devices_per_node is not None else ""
        )
        pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
        if config.data_parallel_size == "auto":
            if world_size % (pp * tp):
                raise LayoutError(
                    f"data_parallel_size='auto' needs the world size to be a multiple of pipeline_parallel_size "
                    f"({pp}) x tensor_parallel_size ({tp}) = {pp * tp}, but the world size is {world_size}{where}: "
                    f"{world_size} % {pp * tp} = {world_size % (pp * tp)}. Fix: launch a multiple of {pp * tp} "
                    f"processes, or change pipeline_parallel_size / tensor_parallel_size."
                )
            dp = world_size // (pp * tp)
        else:
            dp = config.data_parallel_size
            if dp * pp * tp != world_size:
                raise LayoutError(
                    f"data_parallel_size ({dp}) x pipeline_parallel_size ({pp}) x tensor_parallel_size ({tp}) = "
                    f"{dp * pp * tp}, but the world size is {world_size}{where}. Fix: set data_parallel_size="
                    f"{_suggest_dp(world_size, pp, tp)}, or launch {dp * pp * tp} processes "
                    f"(devices x num_nodes)."
                )
        if devices_per_node is not None and num_nodes > 1 and tp > devices_per_node:
            raise LayoutError(
                f"tensor_parallel_size ({tp}) exceeds the devices of one node ({devices_per_node}): tensor-parallel "
                "peers exchange activations twice per layer and must share a node's fast links. "
                f"Fix: tensor_parallel_size <= {devices_per_node}; use pipeline_parallel_size across nodes."
            )
        return cls(dp=dp, pp=pp, tp=tp, world_size=world_size)

    # ------------------------------------------------------------------ pure arithmetic
    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.dp, self.pp, self.tp)

    def coords(self, rank: int) -> RankCoords:
        """The ``(dp, pp, tp)`` coordinates of a global rank (tp innermost)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks.")
        tp_rank = rank % self.tp
        pp_rank = (rank // self.tp) % self.pp
        dp_rank = rank // (self.tp * self.pp)
        return RankCoords(dp=dp_rank, pp=pp_rank, tp=tp_rank)

    def rank_of(self, coords: RankCoords | tuple[int, int, int]) -> int:
        """The global rank at ``(dp, pp, tp)``; inverse of :meth:`coords`."""
        dp_rank, pp_rank, tp_rank = coords
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The global ranks that share every coordinate with ``rank`` except along ``axis``."""
        c = self.coords(rank)._asdict()
        size = dict(zip(MESH_AXES, self.shape, strict=True))[_check_axis(axis)]
        return [self.rank_of(tuple({**c, axis: i}.values())) for i in range(size)]  # type: ignore[arg-type]

    def describe(self) -> str:
        return f"dp={self.dp} x pp={self.pp} x tp={self.tp} = {self.world_size} ranks"

    # ------------------------------------------------------------------ the mesh
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the named ``("dp", "pp", "tp")`` DeviceMesh over the default process group.

        Collective: creates one sub-group per axis line (``new_group`` on every rank). Call once per process, after
        ``torch.distributed.init_process_group``; the result is the only mesh strategies use.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh needs torch.distributed to be initialized first.")
        if dist.get_world_size() != self.world_size:
            raise LayoutError(
                f"the layout was resolved for {self.world_size} ranks ({self.describe()}), but the process group "
                f"has {dist.get_world_size()}. Fix: launch {self.world_size} processes."
            )
        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES)


def _check_axis(axis: str) -> str:
    if axis not in MESH_AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; the axes are {MESH_AXES}.")
    return axis


def _suggest_dp(world_size: int, pp: int, tp: int) -> str:
    if world_size % (pp * tp) == 0:
        return f"{world_size // (pp * tp)} ({world_size} / ({pp} x {tp})) or 'auto'"
    return f"'auto' after making the world size a multiple of {pp * tp}"
