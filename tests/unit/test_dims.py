"""Mesh coordinates without a process group: every (dp, pp, tp) with a product up to 8, in both mesh orders."""

from __future__ import annotations

import itertools
from typing import get_args

import pytest

from lightning_parallel import ParallelConfig, ParallelDims
from lightning_parallel.config import LayoutError, MeshOrder
from lightning_parallel.parallel.dims import MESH_AXES, MESH_ORDERS

LAYOUTS = [(dp, pp, tp) for dp, pp, tp in itertools.product(range(1, 9), repeat=3) if dp * pp * tp <= 8]
DP_PP_TP, PP_DP_TP = MESH_ORDERS["dp-pp-tp"], MESH_ORDERS["pp-dp-tp"]


def test_the_orders_are_the_config_values() -> None:
    assert set(MESH_ORDERS) == set(get_args(MeshOrder)) == {"dp-pp-tp", "pp-dp-tp"}
    assert DP_PP_TP == MESH_AXES == ("dp", "pp", "tp") and PP_DP_TP == ("pp", "dp", "tp")
    assert ParallelDims(dp=2, pp=1, tp=1, world_size=2).order == DP_PP_TP  # the default


@pytest.mark.parametrize("order", [DP_PP_TP, PP_DP_TP], ids="-".join)
@pytest.mark.parametrize(("dp", "pp", "tp"), LAYOUTS)
def test_coords_are_a_bijection_with_tp_innermost(dp: int, pp: int, tp: int, order: tuple[str, str, str]) -> None:
    dims = ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dp * pp * tp, order=order)
    outer = order[0]
    seen = set()
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert 0 <= c.dp < dp and 0 <= c.pp < pp and 0 <= c.tp < tp
        assert dims.rank_of(c) == rank  # inverse
        seen.add(c)
        assert c.tp == rank % tp  # neighbouring ranks are tensor-parallel peers
        assert getattr(c, outer) == rank // (dims.world_size // dims.size(outer))  # the outer axis
        for axis, size in (("dp", dp), ("pp", pp), ("tp", tp)):
            group = dims.group_ranks(axis, rank)
            assert len(group) == size and rank in group
            assert [getattr(dims.coords(r), axis) for r in group] == list(range(size))  # in axis order
            assert all({**dims.coords(r)._asdict(), axis: 0} == {**c._asdict(), axis: 0} for r in group)
    assert len(seen) == dims.world_size
    assert dims.shape == tuple(dims.size(a) for a in order)
    for axis in MESH_AXES:  # the groups of an axis partition the world
        groups = dims.axis_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
        assert all(dims.group_ranks(axis, r) == g for g in groups for r in g)


def test_example_layout_dp2_pp2_tp2_dp_outermost() -> None:
    # the module docstring's worked example, dp-pp-tp: rank = (dp * 2 + pp) * 2 + tp
    dims = ParallelDims(dp=2, pp=2, tp=2, world_size=8)
    assert [tuple(dims.coords(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert dims.group_ranks("tp", 5) == [4, 5]
    assert dims.group_ranks("pp", 5) == [5, 7]
    assert dims.group_ranks("dp", 5) == [1, 5]
    assert dims.axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.axis_groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.axis_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # on 2 nodes of 4: every dp group crosses
    assert [dims.stride(a) for a in ("dp", "pp", "tp")] == [4, 2, 1]
    assert dims.describe() == "dp=2 x pp=2 x tp=2 = 8 ranks"


def test_example_layout_dp2_pp2_tp2_pp_outermost() -> None:
    # pp-dp-tp: rank = (pp * 2 + dp) * 2 + tp
    dims = ParallelDims(dp=2, pp=2, tp=2, world_size=8, order=PP_DP_TP)
    assert [tuple(dims.coords(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)]
    assert dims.rank_of((1, 1, 0)) == 6 and dims.rank_of((1, 0, 1)) == 3 and dims.rank_of((0, 1, 1)) == 5
    assert dims.group_ranks("tp", 5) == [4, 5]
    assert dims.group_ranks("dp", 5) == [5, 7]
    assert dims.group_ranks("pp", 5) == [1, 5]
    assert dims.axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.axis_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # on 2 nodes of 4: inside a node
    assert dims.axis_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # only the pipeline crosses
    assert [dims.stride(a) for a in ("pp", "dp", "tp")] == [4, 2, 1]
    assert dims.shape == (2, 2, 2) and dims.mesh_order == "pp-dp-tp"
    assert dims.describe() == "pp=2 x dp=2 x tp=2 = 8 ranks, mesh_order pp-dp-tp"


def test_orders_differ_only_with_dp_and_pp_above_one() -> None:
    for dp, pp, tp in LAYOUTS:
        a = ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dp * pp * tp)
        b = ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dp * pp * tp, order=PP_DP_TP)
        same = all(a.coords(r) == b.coords(r) for r in range(a.world_size))
        assert same == (dp == 1 or pp == 1), (dp, pp, tp)


def test_from_config_takes_the_mesh_order() -> None:
    config = ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2, mesh_order="pp-dp-tp")
    dims = ParallelDims.from_config(config, world_size=16, devices_per_node=8, num_nodes=2)
    assert (dims.dp, dims.pp, dims.tp, dims.order) == (4, 2, 2, PP_DP_TP)
    assert dims.shape == (2, 4, 2)  # (pp, dp, tp): what build_mesh passes to init_device_mesh
    assert ParallelDims.from_config(ParallelConfig(), world_size=4).order == DP_PP_TP


@pytest.mark.parametrize("bad", [("tp", "dp", "pp"), ("dp", "tp", "pp"), ("pp", "tp", "dp"), ("dp", "pp"), "pp-dp-tp"])
def test_a_bad_order_is_refused(bad: object) -> None:
    with pytest.raises(LayoutError, match=r"not a mesh order; tp is always innermost.*Fix: order="):
        ParallelDims(dp=2, pp=2, tp=2, world_size=8, order=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["tp-dp-pp", "dp-tp-pp", "pp-tp-dp", "tp-pp-dp", "dp-pp", "DP-PP-TP", None])
def test_a_bad_mesh_order_key_is_refused_with_the_fix(bad: object) -> None:
    with pytest.raises(LayoutError) as err:
        ParallelConfig(mesh_order=bad)  # type: ignore[arg-type]
    text = str(err.value)
    assert text.startswith(f"parallel.mesh_order={bad!r} is not a mesh order")
    assert "tp is always innermost" in text and "Fix: mesh_order='dp-pp-tp' or mesh_order='pp-dp-tp'" in text
    with pytest.raises(LayoutError, match=r"parallel\.mesh_order="):
        ParallelConfig.from_dict({"mesh_order": bad})


def test_mesh_order_in_describe_only_when_not_the_default() -> None:
    assert "order" not in ParallelConfig().describe()
    assert ParallelConfig(mesh_order="pp-dp-tp").describe().endswith(" order=pp-dp-tp")


def test_rank_outside_the_world() -> None:
    with pytest.raises(ValueError, match="outside the world of 4"):
        ParallelDims(dp=4, pp=1, tp=1, world_size=4).coords(4)
