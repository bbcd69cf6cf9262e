"""The named ("dp", "pp", "tp") DeviceMesh on gloo ranks in both mesh orders, and the harness's failure handling."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch
import torch.distributed as dist

from lightning_parallel import ParallelConfig, ParallelDims
from lightning_parallel.testing import DistributedTestError, run_distributed


def _orders(dp: int, pp: int) -> tuple[str, ...]:
    """The mesh orders that differ for this layout: with dp = 1 or pp = 1 both give the same ranks."""
    return ("dp-pp-tp", "pp-dp-tp") if dp > 1 and pp > 1 else ("dp-pp-tp",)


def _check_all_layouts(rank: int, world_size: int) -> list[tuple[int, int, int, str]]:
    """For every (dp, pp, tp) whose product is the world size, in each mesh order where it matters: the mesh agrees
    with ParallelDims on the dim names and order, the coordinates, and who is in each named axis group (the group's
    ranks, the 1-D sub-mesh ``mesh[axis]``, and an all-reduce of the global ranks over it summing exactly them)."""
    checked = []
    for dp, pp, tp in itertools.product(range(1, world_size + 1), repeat=3):
        if dp * pp * tp != world_size:
            continue
        for order in _orders(dp, pp):
            config = ParallelConfig(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                    num_micro_batches=max(pp, 1), mesh_order=order)  # type: ignore[arg-type]
            dims = ParallelDims.from_config(config, world_size=world_size)
            mesh = dims.build_mesh("cpu")
            coords = dims.coords(rank)
            where = (order, dims.shape, rank)
            assert mesh.mesh_dim_names == tuple(order.split("-")) == dims.order, where
            assert tuple(mesh.shape) == dims.shape, where
            for axis in ("dp", "pp", "tp"):
                expected = dims.group_ranks(axis, rank)
                assert mesh.get_local_rank(axis) == getattr(coords, axis), (axis, *where)
                assert dist.get_process_group_ranks(mesh.get_group(axis)) == expected, (axis, *where)
                assert mesh[axis].mesh.tolist() == expected, (axis, *where)
                value = torch.tensor([float(rank)])
                dist.all_reduce(value, group=mesh.get_group(axis))
                assert value.item() == sum(expected), (axis, *where)
            checked.append((dp, pp, tp, order))
    return checked


@pytest.mark.parametrize("world_size", [4, 8])
def test_mesh_matches_dims_for_every_layout(world_size: int) -> None:
    results = run_distributed(_check_all_layouts, world_size, timeout_s=240)
    expected = {(dp, pp, tp, order) for dp, pp, tp in itertools.product(range(1, 9), repeat=3)
                if dp * pp * tp == world_size for order in _orders(dp, pp)}
    assert set(results[0]) == expected and all(r == results[0] for r in results)
    # pp-dp-tp ran where it differs: dp2 x pp2 (x tp1) on 4 ranks; dp2 x pp2 x tp2, dp2 x pp4, dp4 x pp2 on 8
    assert {r[:3] for r in results[0] if r[3] == "pp-dp-tp"} == (
        {(2, 2, 1)} if world_size == 4 else {(2, 2, 2), (2, 4, 1), (4, 2, 1)})


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _hang_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: the collective timeout must end it


def _segfault_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        ctypes.string_at(0)  # SIGSEGV, as a crash in a C++ extension or destructor would
    return rank


def test_failing_rank_error_reaches_pytest() -> None:
    with pytest.raises(DistributedTestError, match=r"rank 1 of 2 failed:(.|\n)*boom on rank 1"):
        run_distributed(_fail_on_rank_one, 2, timeout_s=60)


def test_a_hanging_collective_times_out() -> None:
    with pytest.raises(DistributedTestError, match="rank 0 of 2 failed"):
        run_distributed(_hang_on_rank_zero, 2, timeout_s=60, collective_timeout_s=3)


def test_a_segfaulting_rank_prints_its_python_stack(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[1\] of 2 died without a result: \{1: -11\}"):
        run_distributed(_segfault_on_rank_one, 2, timeout_s=60)
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err, err[-3000:]
    assert "_segfault_on_rank_one" in err, err[-3000:]  # the faulting rank's stack, from its own stderr
