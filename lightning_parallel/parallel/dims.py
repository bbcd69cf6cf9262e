"""``ParallelDims``: the single owner of the parallel degrees, the rank arithmetic and the named DeviceMesh.

The world of ``W = dp x pp x tp`` ranks is arranged as a 3-D mesh with the named axes ``dp``, ``pp`` and ``tp``.
``tp`` is always innermost: ranks ``r`` and ``r + 1`` differ in their tp coordinate first, which puts
tensor-parallel peers (two all-reduces per layer in forward and two in backward) on the same node and its fast links.
The order of the two outer axes is ``parallel.mesh_order`` (:attr:`ParallelDims.order`, outermost first):

* ``dp-pp-tp`` (the default): pipeline neighbours next, data-parallel replicas outermost::

      rank = (dp_rank * pp + pp_rank) * tp + tp_rank

* ``pp-dp-tp`` (Megatron-LM, torchtitan): data-parallel replicas next, pipeline stages outermost::

      rank = (pp_rank * dp + dp_rank) * tp + tp_rank

In general an axis's *stride* is the product of the sizes of the axes inside it (``tp``: 1; the middle axis:
``tp``; the outer axis: ``tp x`` the middle size); ``rank = sum(coord[a] * stride[a])`` and
``coord[a] = (rank // stride[a]) % size[a]``. An axis group (:meth:`ParallelDims.group_ranks`) is the ranks that
share every other coordinate: ``stride`` apart, in the order of the axis coordinate.

Launchers fill nodes in rank order (rank ``r`` runs on node ``r // devices_per_node``), so an axis group stays
inside one node when ``stride x size`` divides the devices of a node. On several nodes the order decides which traffic
crosses the slow inter-node links: with ``dp-pp-tp`` the dp gradient exchange (about twice the rank's parameters per
step) does, with ``pp-dp-tp`` only the pipeline's point-to-point activations do (what the planner weighs, see
:func:`lightning_parallel.planner.cost.cross_node_bytes`).

Worked example, ``dp=2 x pp=2 x tp=2`` on 2 nodes of 4 devices (node 0: ranks 0-3, node 1: ranks 4-7)::

    rank                   0    1    2    3  |  4    5    6    7
    dp-pp-tp (dp,pp,tp)   000  001  010  011 | 100  101  110  111
    pp-dp-tp (dp,pp,tp)   000  001  100  101 | 010  011  110  111

    dp-pp-tp   tp groups [0,1] [2,3] [4,5] [6,7]   inside a node
               pp groups [0,2] [1,3] [4,6] [5,7]   inside a node
               dp groups [0,4] [1,5] [2,6] [3,7]   every one crosses nodes (the gradient all-reduce)
    pp-dp-tp   tp groups [0,1] [2,3] [4,5] [6,7]   inside a node
               dp groups [0,2] [1,3] [4,6] [5,7]   inside a node
               pp groups [0,4] [1,5] [2,6] [3,7]   every one crosses nodes (activations, point to point)

**HSDP** (``parallel.data_parallel_shard_size = s < dp``): the dp axis splits into ``dp_replicate = dp / s`` (outer)
x ``dp_shard = s`` (inner), so a shard group is ``s`` consecutive dp coordinates (``stride(dp)`` apart) and a
replicate group the ranks ``s x stride(dp)`` apart. The mesh then has the four dims ``dp_replicate, dp_shard`` in
place of ``dp`` (plus ``pp``, ``tp``) and ``dp`` is their flattened view: ``mesh["dp"]`` is the whole dp axis for
the sampler, the broadcasts and every strategy that does not use HSDP; FSDP2 takes ``mesh["dp_replicate",
"dp_shard"]`` (shard inside, all-reduce across). Ranks keep their coordinates and dp groups.

**Context parallelism** (``parallel.context_parallel_size = c > 1``): a fourth axis ``cp`` sits just outside ``tp``
(next to it, inside a node: the ring passes key/value blocks every layer, in forward and backward), so the mesh's
axes are ``(dp, pp, cp, tp)`` or ``(pp, dp, cp, tp)`` and the world is ``dp x pp x cp x tp``::

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank          (dp-pp-tp, the default)
    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank          (pp-dp-tp)

With ``c = 1`` the axis is left out of :attr:`ParallelDims.order`, of the shape and of the mesh, and every stride
is what it was without it: the rank arithmetic of every existing layout is unchanged. The cp ranks of a replica
hold the same weights and read the same batch (the sampler takes dp only), so everything that makes or keeps
replicas equal runs over ``dp x cp``: the mesh gets the flattened dim ``dp_cp`` (:attr:`ParallelDims.replica_axis`)
for the dp broadcast, torch DDP, the gradient all-reduce, ZeRO's shards and FSDP2, and, with HSDP,
``dp_shard_cp`` (FSDP2 shards over ``dp_shard x cp``, replicates over ``dp_replicate``, as torchtitan does).

Nothing else in the library creates process groups: strategies ask this object for the mesh and address its
sub-groups by name (``mesh["dp"]``, ``mesh.get_group("pp")``), never by position. No Lightning import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, get_args

from lightning_parallel.config import LayoutError, MeshOrder, ParallelConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ALL_AXES", "MESH_AXES", "MESH_ORDERS", "ParallelDims", "RankCoords"]

MESH_AXES: tuple[str, str, str] = ("dp", "pp", "tp")
"""The axis names, in the field order of :class:`RankCoords`; also the default mesh order (``dp-pp-tp``)."""

ALL_AXES: tuple[str, str, str, str] = ("dp", "pp", "cp", "tp")
"""Every axis, ``cp`` (context parallelism) included: the axes :meth:`ParallelDims.size`,
:meth:`ParallelDims.coord` and :meth:`ParallelDims.group_ranks` take."""


def _axes(order: str) -> tuple[str, str, str]:
    outer, middle, inner = order.split("-")
    return outer, middle, inner


MESH_ORDERS: dict[str, tuple[str, str, str]] = {order: _axes(order) for order in get_args(MeshOrder)}
"""``parallel.mesh_order`` (:data:`lightning_parallel.config.MeshOrder`) -> the mesh's axes, outermost first."""


class RankCoords(NamedTuple):
    """A rank's coordinates by axis name, always in the field order ``(dp, pp, tp)`` whatever the mesh order."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees of a layout for a given world size: ``dp * pp * tp == world_size``.

    Build it with :meth:`from_config`, which resolves ``data_parallel_size='auto'`` and checks the product; the mesh
    is created once per process by :meth:`build_mesh` after the default process group exists. :attr:`order` is the
    mesh's axes, outermost first (``parallel.mesh_order``; the module docstring has the arithmetic of both).
    """

    dp: int
    pp: int
    tp: int
    world_size: int
    order: tuple[str, ...] = MESH_AXES
    """The mesh axes, outermost first: ``("dp", "pp", "tp")`` or ``("pp", "dp", "tp")``; tp is always innermost.
    With ``cp > 1``, ``"cp"`` is inserted just outside ``tp`` (``("dp", "pp", "cp", "tp")``); a 3-axis order given
    with ``cp > 1`` gets it there."""
    dp_shard: int = 0
    """HSDP: the dp ranks of one FSDP2 shard group (``parallel.data_parallel_shard_size``); 0 (or ``dp``) = the whole
    dp axis, no HSDP. Divides ``dp``."""
    cp: int = 1
    """Context parallelism: the ranks one sequence is split across (``parallel.context_parallel_size``)."""

    def __post_init__(self) -> None:
        for name, value in (("dp", self.dp), ("pp", self.pp), ("tp", self.tp), ("world_size", self.world_size),
                            ("cp", self.cp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name}={value!r} must be a positive integer.")
        three = tuple(a for a in self.order if a != "cp") if isinstance(self.order, (tuple, list)) else self.order
        if three not in MESH_ORDERS.values() or (isinstance(self.order, (tuple, list)) and "cp" in self.order
                                                  and tuple(self.order)[-2:] != ("cp", "tp")):
            raise LayoutError(
                f"ParallelDims order={self.order!r} is not a mesh order; tp is always innermost. "
                f"Fix: order={MESH_ORDERS['dp-pp-tp']} or {MESH_ORDERS['pp-dp-tp']} (parallel.mesh_order "
                "'dp-pp-tp' or 'pp-dp-tp'; cp, when above 1, goes just outside tp)."
            )
        assert isinstance(three, tuple)
        object.__setattr__(self, "order", (*three[:2], "cp", "tp") if self.cp > 1 else three)
        if self.dp_shard == 0:
            object.__setattr__(self, "dp_shard", self.dp)
        if isinstance(self.dp_shard, bool) or not isinstance(self.dp_shard, int) or self.dp_shard < 1 or \
                self.dp % self.dp_shard:
            raise LayoutError(
                f"data_parallel_shard_size={self.dp_shard!r} must divide data_parallel_size={self.dp} (dp = replicate "
                f"x shard). Fix: one of {[d for d in range(1, self.dp + 1) if self.dp % d == 0]}, or remove it."
            )
        if self.dp * self.pp * self.cp * self.tp != self.world_size:
            cp = f" x context_parallel_size ({self.cp})" if self.cp > 1 else ""
            raise LayoutError(
                f"data_parallel_size ({self.dp}) x pipeline_parallel_size ({self.pp}) x tensor_parallel_size "
                f"({self.tp}){cp} = {self.dp * self.pp * self.cp * self.tp}, but the world size is "
                f"{self.world_size}. Fix: make the product equal {self.world_size}, for example "
                "data_parallel_size='auto'."
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
        pp, tp, cp = config.pipeline_parallel_size, config.tensor_parallel_size, config.context_parallel_size
        model = pp * tp * cp  # the ranks of one model replica
        with_cp = f" x context_parallel_size ({cp})" if cp > 1 else ""
        if config.data_parallel_size == "auto":
            if world_size % model:
                raise LayoutError(
                    f"data_parallel_size='auto' needs the world size to be a multiple of pipeline_parallel_size "
                    f"({pp}) x tensor_parallel_size ({tp}){with_cp} = {model}, but the world size is "
                    f"{world_size}{where}: {world_size} % {model} = {world_size % model}. Fix: launch a multiple of "
                    f"{model} processes, or change pipeline_parallel_size / tensor_parallel_size"
                    f"{' / context_parallel_size' if cp > 1 else ''}."
                )
            dp = world_size // model
        else:
            dp = config.data_parallel_size
            if dp * model != world_size:
                raise LayoutError(
                    f"data_parallel_size ({dp}) x pipeline_parallel_size ({pp}) x tensor_parallel_size ({tp})"
                    f"{with_cp} = {dp * model}, but the world size is {world_size}{where}. Fix: set "
                    f"data_parallel_size={_suggest_dp(world_size, pp, tp * cp)}, or launch {dp * model} processes "
                    f"(devices x num_nodes)."
                )
        if devices_per_node is not None and num_nodes > 1 and tp > devices_per_node:
            raise LayoutError(
                f"tensor_parallel_size ({tp}) exceeds the devices of one node ({devices_per_node}): tensor-parallel "
                "peers exchange activations twice per layer and must share a node's fast links. "
                f"Fix: tensor_parallel_size <= {devices_per_node}; use pipeline_parallel_size across nodes."
            )
        if devices_per_node is not None and num_nodes > 1 and cp > 1 and cp * tp > devices_per_node:
            import warnings

            warnings.warn(
                f"context_parallel_size ({cp}) x tensor_parallel_size ({tp}) = {cp * tp} exceeds the devices of one "
                f"node ({devices_per_node}): the cp ring (key/value blocks every layer, forward and backward) then "
                f"crosses nodes. Fix: context_parallel_size <= {max(1, devices_per_node // tp)} to keep it inside "
                "a node.", stacklevel=2)
        shard = config.data_parallel_shard_size
        if shard is not None and dp % shard:
            raise LayoutError(
                f"parallel.data_parallel_shard_size={shard} does not divide the data-parallel size dp={dp}{where}: "
                f"{dp} % {shard} = {dp % shard} (dp = replicate x shard). Fix: data_parallel_shard_size in "
                f"{[d for d in range(1, dp + 1) if dp % d == 0]}."
            )
        dims = cls(dp=dp, pp=pp, tp=tp, world_size=world_size, order=MESH_ORDERS[config.mesh_order],
                   dp_shard=shard or dp, cp=cp)
        if dims.hsdp and devices_per_node is not None and num_nodes > 1 and \
                dims.shard_group_crosses_nodes(devices_per_node):
            import warnings

            warnings.warn(
                f"parallel.data_parallel_shard_size={dims.dp_shard}: a shard group spans {dims.dp_shard} dp ranks "
                f"{dims.stride('dp')} apart, which crosses nodes of {devices_per_node} devices, so FSDP2's "
                "all-gathers and reduce-scatters (every step, 3 x the parameters) run over the inter-node links. "
                + (f"Fix: data_parallel_shard_size <= {devices_per_node // dims.stride('dp')} (one node's dp ranks), "
                   if devices_per_node // dims.stride("dp") >= 2 else
                   "Fix: mesh_order='pp-dp-tp' (dp ranks next to each other inside a node), ")
                + "so that only the all-reduce of the gradient shards crosses nodes.", stacklevel=2)
        return dims

    # ------------------------------------------------------------------ pure arithmetic
    @property
    def hsdp(self) -> bool:
        """True when the dp axis is split into ``dp_replicate x dp_shard`` (``dp_shard < dp``)."""
        return self.dp_shard < self.dp

    @property
    def dp_replicate(self) -> int:
        """FSDP2 replicas of each shard (``dp / dp_shard``; 1 without HSDP)."""
        return self.dp // self.dp_shard

    def dp_subgroup_ranks(self, part: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s ``dp_shard`` group (``s`` consecutive dp coordinates) or ``dp_replicate``
        group (the ranks holding the same shard), in dp order."""
        dp_group, coord = self.group_ranks("dp", rank), self.coords(rank).dp
        if part == "dp_shard":
            start = coord - coord % self.dp_shard
            return dp_group[start:start + self.dp_shard]
        if part == "dp_replicate":
            return dp_group[coord % self.dp_shard::self.dp_shard]
        raise ValueError(f"unknown dp sub-axis {part!r}; the sub-axes are ('dp_replicate', 'dp_shard').")

    def shard_group_crosses_nodes(self, devices_per_node: int) -> bool:
        """Whether some ``dp_shard`` group spans ranks of more than one node (launchers fill nodes in rank order:
        rank ``r`` on node ``r // devices_per_node``)."""
        return any(len({r // devices_per_node for r in self.dp_subgroup_ranks("dp_shard", rank)}) > 1
                   for rank in range(self.world_size))

    @property
    def mesh_order(self) -> str:
        """:attr:`order` as ``parallel.mesh_order`` spells it, e.g. ``pp-dp-tp`` (``cp`` left out: it always sits
        just outside ``tp``)."""
        return "-".join(a for a in self.order if a != "cp")

    def size(self, axis: str) -> int:
        """The degree of ``axis`` (``dp``, ``pp``, ``cp`` or ``tp``)."""
        return int(getattr(self, _check_axis(axis)))

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape: the axis sizes in :attr:`order` (``(dp, pp, tp)`` for the default order)."""
        return tuple(self.size(axis) for axis in self.order)

    @property
    def _full_order(self) -> tuple[str, ...]:
        """:attr:`order` with ``cp`` in its place even when it is 1 (a size-1 axis changes no stride)."""
        return self.order if "cp" in self.order else (*self.order[:2], "cp", "tp")

    def stride(self, axis: str) -> int:
        """How far apart in rank two neighbours along ``axis`` are: the product of the sizes inside it."""
        order = self._full_order
        inner = order[order.index(_check_axis(axis)) + 1:]
        out = 1
        for a in inner:
            out *= self.size(a)
        return out

    def coord(self, rank: int, axis: str) -> int:
        """``rank``'s coordinate along ``axis`` (any of :data:`ALL_AXES`): ``(rank // stride) % size``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks.")
        return (rank // self.stride(axis)) % self.size(axis)

    def coords(self, rank: int) -> RankCoords:
        """The coordinates of a global rank: ``coord[a] = (rank // stride[a]) % size[a]`` (the cp coordinate:
        :meth:`coord`)."""
        return RankCoords(*(self.coord(rank, a) for a in MESH_AXES))

    def rank_of(self, coords: RankCoords | tuple[int, int, int], *, cp: int = 0) -> int:
        """The global rank at ``(dp, pp, tp)`` (field order, whatever the mesh order) and cp coordinate ``cp``;
        inverse of :meth:`coords` and :meth:`coord`."""
        return sum(int(c) * self.stride(a) for a, c in zip(MESH_AXES, coords, strict=True)) + cp * self.stride("cp")

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The global ranks that share every coordinate with ``rank`` except along ``axis``, in the order of the axis
        coordinate (``stride(axis)`` apart)."""
        stride, size = self.stride(axis), self.size(axis)
        base = rank - self.coord(rank, axis) * stride
        return [base + i * stride for i in range(size)]

    @property
    def replica_axis(self) -> str:
        """The mesh dim whose ranks hold the same weights and split the work of one step: ``dp``, or the flattened
        ``dp_cp`` with context parallelism (the dp broadcast, DDP, the gradient all-reduce, ZeRO, the logged loss)."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def replicas(self) -> int:
        """The size of :attr:`replica_axis`: ``dp x cp``."""
        return self.dp * self.cp

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """The mesh dims FSDP2 runs over: ``(replica_axis,)``, or with HSDP ``("dp_replicate", "dp_shard")``
        (``"dp_shard_cp"``, the flattened ``dp_shard x cp``, with context parallelism)."""
        if not self.hsdp:
            return (self.replica_axis,)
        return ("dp_replicate", "dp_shard_cp" if self.cp > 1 else "dp_shard")

    def shard_group_ranks(self, rank: int) -> list[int]:
        """The ranks ``rank``'s model states are sharded over by ZeRO / FSDP2 (in the mesh's order): its
        :meth:`replica_group_ranks`, or with HSDP its ``dp_shard`` group (times cp: ``dp_shard_cp``)."""
        if not self.hsdp:
            return self.replica_group_ranks(rank)
        return [r for d in self.dp_subgroup_ranks("dp_shard", rank) for r in self.group_ranks("cp", d)]

    def replica_group_ranks(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s :attr:`replica_axis` group (its dp x cp ranks, dp major), as the mesh orders them."""
        return [r for d in self.group_ranks("dp", rank) for r in self.group_ranks("cp", d)]

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` (``world_size / size(axis)`` of them, each as :meth:`group_ranks` lists it),
        ordered by their first rank."""
        stride, size = self.stride(axis), self.size(axis)
        return [[base + i * stride for i in range(size)]
                for base in range(self.world_size) if (base // stride) % size == 0]

    def describe(self) -> str:
        """``dp=2 x pp=2 x tp=2 = 8 ranks``: axes outermost first, ``, mesh_order pp-dp-tp`` when not the default."""
        def axis(a: str) -> str:
            if a == "dp" and self.hsdp:
                return f"dp={self.dp} ({self.dp_replicate} replicas x {self.dp_shard} shards)"
            return f"{a}={self.size(a)}"

        text = " x ".join(axis(a) for a in self.order) + f" = {self.world_size} ranks"
        return text if self.mesh_order == "dp-pp-tp" else f"{text}, mesh_order {self.mesh_order}"

    # ------------------------------------------------------------------ the mesh
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the DeviceMesh of shape :attr:`shape` with the dims named :attr:`order` over the default process
        group; address its dims by name (``mesh["dp"]``, ``mesh.get_group("pp")``), never by position.

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
        if not self.hsdp:
            mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.order)
            if self.cp > 1:
                mesh["dp", "cp"]._flatten("dp_cp")  # the replicas of one model: dp x cp
            return mesh
        names: list[str] = []
        shape: list[int] = []
        for a in self.order:
            if a == "dp":
                names += ["dp_replicate", "dp_shard"]
                shape += [self.dp_replicate, self.dp_shard]
            else:
                names.append(a)
                shape.append(self.size(a))
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        mesh["dp_replicate", "dp_shard"]._flatten("dp")  # mesh["dp"]: the whole dp axis, in dp order
        if self.cp > 1:
            mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # FSDP2 shards over dp_shard x cp
        return mesh


def _check_axis(axis: str) -> str:
    if axis not in ALL_AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; the axes are {ALL_AXES}.")
    return axis


def _suggest_dp(world_size: int, pp: int, tp: int) -> str:
    if world_size % (pp * tp) == 0:
        return f"{world_size // (pp * tp)} ({world_size} / ({pp} x {tp})) or 'auto'"
    return f"'auto' after making the world size a multiple of {pp * tp}"
