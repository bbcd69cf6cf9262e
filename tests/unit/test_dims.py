"""Mesh coordinates without a process group: every (dp, pp, tp) with a product up to 8."""

from __future__ import annotations

import itertools

import pytest

from lightning_parallel import ParallelDims

LAYOUTS = [(dp, pp, tp) for dp, pp, tp in itertools.product(range(1, 9), repeat=3) if dp * pp * tp <= 8]


@pytest.mark.parametrize(("dp", "pp", "tp"), LAYOUTS)
def test_coords_are_a_bijection_with_tp_innermost(dp: int, pp: int, tp: int) -> None:
    dims = ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dp * pp * tp)
    seen = set()
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert 0 <= c.dp < dp and 0 <= c.pp < pp and 0 <= c.tp < tp
        assert dims.rank_of(c) == rank
        seen.add(c)
        assert c.tp == rank % tp  # neighbouring ranks are tensor-parallel peers
        assert c.dp == rank // (pp * tp)  # dp is outermost
        for axis, size in (("dp", dp), ("pp", pp), ("tp", tp)):
            group = dims.group_ranks(axis, rank)
            assert len(group) == size and rank in group
    assert len(seen) == dims.world_size


def test_example_layout_dp2_pp2_tp2() -> None:
    dims = ParallelDims(dp=2, pp=2, tp=2, world_size=8)
    assert [tuple(dims.coords(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert dims.group_ranks("tp", 5) == [4, 5]
    assert dims.group_ranks("pp", 5) == [5, 7]
    assert dims.group_ranks("dp", 5) == [1, 5]


def test_rank_outside_the_world() -> None:
    with pytest.raises(ValueError, match="outside the world of 4"):
        ParallelDims(dp=4, pp=1, tp=1, world_size=4).coords(4)
