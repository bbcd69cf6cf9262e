"""Context parallelism in the layout: the ``cp`` axis of ParallelDims (rank arithmetic in both mesh orders, cp = 1
unchanged), the layout keys and their rules, and the layout table's rows."""

from __future__ import annotations

import itertools

import pytest

from lightning_parallel import ParallelConfig, ParallelDims
from lightning_parallel.config import LayoutError, check_context_compat, check_model_compat
from lightning_parallel.layouts import refusal, strategy_for
from lightning_parallel.parallel.dims import ALL_AXES, MESH_ORDERS

LAYOUTS = [(dp, pp, cp, tp) for dp, pp, cp, tp in itertools.product(range(1, 9), repeat=4) if dp * pp * cp * tp <= 8]


@pytest.mark.parametrize("mesh_order", ["dp-pp-tp", "pp-dp-tp"])
def test_coords_with_cp_are_a_bijection_with_cp_next_to_tp(mesh_order: str) -> None:
    for dp, pp, cp, tp in LAYOUTS:
        world = dp * pp * cp * tp
        dims = ParallelDims(dp=dp, pp=pp, tp=tp, cp=cp, world_size=world, order=MESH_ORDERS[mesh_order])
        assert dims.order == ((*MESH_ORDERS[mesh_order][:2], "cp", "tp") if cp > 1 else MESH_ORDERS[mesh_order])
        assert dims.mesh_order == mesh_order and dims.shape == tuple(dims.size(a) for a in dims.order)
        assert dims.stride("tp") == 1 and dims.stride("cp") == tp  # cp just outside tp
        seen = set()
        for rank in range(world):
            coords = dims.coords(rank)
            c = dims.coord(rank, "cp")
            assert dims.rank_of(coords, cp=c) == rank
            seen.add((*coords, c))
            assert c == (rank // tp) % cp
            for axis in ALL_AXES:
                group = dims.group_ranks(axis, rank)
                assert len(group) == dims.size(axis) and rank in group
                assert [dims.coord(r, axis) for r in group] == list(range(dims.size(axis)))
                others = [a for a in ALL_AXES if a != axis]
                assert all([dims.coord(r, a) for a in others] == [dims.coord(rank, a) for a in others] for r in group)
            replicas = dims.replica_group_ranks(rank)
            assert len(replicas) == dp * cp and rank in replicas
            assert {(dims.coords(r).pp, dims.coords(r).tp) for r in replicas} == {(coords.pp, coords.tp)}
        assert len(seen) == world
        for axis in ALL_AXES:
            groups = dims.axis_groups(axis)
            assert sorted(r for g in groups for r in g) == list(range(world))


def test_cp_one_changes_nothing_of_the_existing_arithmetic() -> None:
    for dp, pp, _, tp in (layout for layout in LAYOUTS if layout[2] == 1):
        for order in MESH_ORDERS.values():
            a = ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dp * pp * tp, order=order)
            b = ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dp * pp * tp, order=order, cp=1)
            assert a == b and a.order == order and a.shape == tuple(a.size(x) for x in order)
            assert a.replica_axis == "dp" and a.fsdp_axes == ("dp",) and a.replicas == dp
            assert [a.coords(r) for r in range(a.world_size)] == [b.coords(r) for r in range(b.world_size)]
            assert "cp" not in a.describe()


def test_example_dp2_cp2_tp2() -> None:
    # rank = ((dp * pp + pp_rank) * cp + cp_rank) * tp + tp_rank with pp = 1
    dims = ParallelDims.from_config(ParallelConfig(context_parallel_size=2, tensor_parallel_size=2), world_size=8)
    assert (dims.dp, dims.pp, dims.cp, dims.tp) == (2, 1, 2, 2)
    assert dims.order == ("dp", "pp", "cp", "tp") and dims.shape == (2, 1, 2, 2)
    assert [dims.stride(a) for a in ("dp", "pp", "cp", "tp")] == [4, 4, 2, 1]
    assert dims.axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.axis_groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # next to tp: inside a node of 4
    assert dims.axis_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.replica_group_ranks(5) == [1, 3, 5, 7] and dims.replica_axis == "dp_cp" and dims.replicas == 4
    assert dims.describe() == "dp=2 x pp=1 x cp=2 x tp=2 = 8 ranks"
    pp_first = ParallelDims.from_config(ParallelConfig(context_parallel_size=2, pipeline_parallel_size=2,
                                                       mesh_order="pp-dp-tp"), world_size=8)
    assert pp_first.order == ("pp", "dp", "cp", "tp") and pp_first.describe().endswith("mesh_order pp-dp-tp")
    assert pp_first.axis_groups("cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pp_first.axis_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    hsdp = ParallelDims.from_config(ParallelConfig(context_parallel_size=2, zero_stage=3, data_parallel_shard_size=2),
                                    world_size=8)
    assert hsdp.fsdp_axes == ("dp_replicate", "dp_shard_cp") and hsdp.replicas == 8
    # ZeRO / FSDP2 shard over dp x cp (HSDP: dp_shard x cp), in the mesh's order (dp major); cp = 1 as before
    assert dims.shard_group_ranks(5) == [1, 3, 5, 7] and hsdp.shard_group_ranks(5) == [4, 5, 6, 7]
    assert hsdp.shard_group_ranks(2) == [0, 1, 2, 3] and hsdp.replica_group_ranks(2) == list(range(8))
    plain = ParallelDims(dp=4, pp=1, tp=1, world_size=4, dp_shard=2)
    assert plain.shard_group_ranks(3) == plain.dp_subgroup_ranks("dp_shard", 3) == [2, 3]


def test_world_size_arithmetic_names_cp() -> None:
    with pytest.raises(LayoutError, match=r"tensor_parallel_size \(1\) x context_parallel_size \(2\) = 6, but the "
                                          r"world size is 4"):
        ParallelDims.from_config(ParallelConfig(data_parallel_size=3, context_parallel_size=2), world_size=4)
    with pytest.raises(LayoutError, match=r"x context_parallel_size \(4\) = 8, but the world size is 6: 6 % 8"):
        ParallelDims.from_config(ParallelConfig(context_parallel_size=4, tensor_parallel_size=2), world_size=6)
    with pytest.raises(LayoutError, match=r"context_parallel_size \(2\) = 8, but the world size is 4"):
        ParallelDims(dp=2, pp=1, tp=2, cp=2, world_size=4)
    with pytest.raises(LayoutError, match="not a mesh order"):
        ParallelDims(dp=1, pp=1, tp=2, cp=2, world_size=4, order=("dp", "cp", "pp", "tp"))
    with pytest.warns(UserWarning, match=r"the cp ring .* crosses nodes"):
        ParallelDims.from_config(ParallelConfig(context_parallel_size=4, tensor_parallel_size=2), world_size=16,
                                 devices_per_node=4, num_nodes=4)


def test_the_context_keys_and_their_rules() -> None:
    config = ParallelConfig(context_parallel_size=2)
    assert config.describe() == "dp=auto pp=1 tp=1 zero=preset cp=2"
    assert ParallelConfig(context_parallel_size=2, context_parallel_style="all_to_all").describe().endswith(
        "cp=2 cp_style=all_to_all")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(LayoutError, match=r"parallel\.context_parallel_size=.* must be a positive integer"):
            ParallelConfig(context_parallel_size=bad)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"context_parallel_style='ulysses' is not one of \['ring', 'all_to_all'\]"):
        ParallelConfig(context_parallel_size=2, context_parallel_style="ulysses")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"context_parallel_style='all_to_all' is used only with "
                                          r"context_parallel_size >= 2"):
        ParallelConfig(context_parallel_style="all_to_all")
    with pytest.raises(LayoutError, match=r"context_parallel_size=2 with offload='cpu'.*DeepSpeed engine"):
        ParallelConfig(context_parallel_size=2, zero_stage=3, offload="cpu")
    with pytest.raises(LayoutError, match=r"unknown layout key 'context_parallel'.*context_parallel_size"):
        ParallelConfig.from_dict({"context_parallel": 2})


def test_sequence_and_heads_rules() -> None:
    cp4 = ParallelConfig(context_parallel_size=4)
    check_context_compat(cp4, sequence_length=64, n_head=3)  # ring: no heads rule
    check_context_compat(ParallelConfig(), sequence_length=63)  # no rule at cp = 1
    with pytest.raises(LayoutError) as err:
        check_model_compat(cp4, sequence_length=60)
    text = str(err.value)
    assert "context_parallel_size=4 splits each sequence into 2 x cp = 8 chunks" in text
    assert "60 % 8 = 4" in text and "Fix: a sequence length that is a multiple of 8 (e.g. 56 or 64)" in text
    assert "context_parallel_size in [1, 2, 3, 5" in text
    ulysses = ParallelConfig(context_parallel_size=2, context_parallel_style="all_to_all", tensor_parallel_size=2)
    check_context_compat(ulysses, n_head=8, sequence_length=16)
    with pytest.raises(LayoutError, match=r"n_head=6 / tensor_parallel_size=2 = 3 heads, 3 % 2 = 1\. Fix: "
                                          r"context_parallel_style='ring'"):
        check_model_compat(ulysses, n_head=6)


def test_layout_table_rows_take_cp() -> None:
    for name, layout in (("lp_ddp", {}), ("lp_sharded", {"zero_stage": 3}), ("lp_tensor", {"tensor_parallel_size": 2}),
                         ("lp_pipeline", {"pipeline_parallel_size": 2}),
                         ("lp_hybrid", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2})):
        config = ParallelConfig(context_parallel_size=2, **layout)  # type: ignore[arg-type]
        assert refusal(name, config) is None
        assert strategy_for(config) == name
    why = refusal("lp_zero_offload", ParallelConfig(context_parallel_size=2, zero_stage=2))
    assert why is not None and "context_parallel_size=2" in why and "Fix: set context_parallel_size to 1" in why
