"""The named ("dp", "pp", "tp") DeviceMesh on gloo ranks, and the harness's failure handling."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from lightning_parallel import ParallelConfig, ParallelDims
from lightning_parallel.testing import DistributedTestError, run_distributed


def _check_all_layouts(rank: int, world_size: int) -> list[tuple[int, int, int]]:
    """For every (dp, pp, tp) whose product is the world size: the mesh agrees with ParallelDims on coordinates and
    on who is in each axis group (an all-reduce of the global ranks over each group sums exactly the expected ranks)."""
    checked = []
    for dp, pp, tp in itertools.product(range(1, world_size + 1), repeat=3):
        if dp * pp * tp != world_size:
            continue
        config = ParallelConfig(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                num_micro_batches=max(pp, 1))
        dims = ParallelDims.from_config(config, world_size=world_size)
        mesh = dims.build_mesh("cpu")
        coords = dims.coords(rank)
        assert mesh.mesh_dim_names == ("dp", "pp", "tp")
        for axis in ("dp", "pp", "tp"):
            assert mesh.get_local_rank(axis) == getattr(coords, axis), (axis, dims.shape, rank)
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=mesh.get_group(axis))
            assert value.item() == sum(dims.group_ranks(axis, rank)), (axis, dims.shape, rank)
        checked.append((dp, pp, tp))
    return checked


@pytest.mark.parametrize("world_size", [4, 8])
def test_mesh_matches_dims_for_every_layout(world_size: int) -> None:
    results = run_distributed(_check_all_layouts, world_size, timeout_s=240)
    expected = {(dp, pp, tp) for dp, pp, tp in itertools.product(range(1, 9), repeat=3) if dp * pp * tp == world_size}
    assert set(results[0]) == expected and all(r == results[0] for r in results)


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _hang_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: the collective timeout must end it


def test_failing_rank_error_reaches_pytest() -> None:
    with pytest.raises(DistributedTestError, match=r"rank 1 of 2 failed:(.|\n)*boom on rank 1"):
        run_distributed(_fail_on_rank_one, 2, timeout_s=60)


def test_a_hanging_collective_times_out() -> None:
    with pytest.raises(DistributedTestError, match="rank 0 of 2 failed"):
        run_distributed(_hang_on_rank_zero, 2, timeout_s=60, collective_timeout_s=3)
