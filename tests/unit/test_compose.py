"""``compose()`` on its own: the plan table, each step's effect on a bare process group, the order enforced by code,
and the path every strategy takes through it.

The pure parts run in the test process; the steps that need a process group run in one world of two gloo ranks
forked from it (every check batched into that world).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.models import GPT
from lightning_parallel.parallel.compose import (
    COMPOSITION_ORDER,
    CompositionOrderError,
    apply_compile,
    apply_recomputation,
    apply_tensor_plan,
    compose,
    composition_path,
    data_parallel_plan,
    place,
    split_pipeline,
    steps_done,
    wrap_data_parallel,
)
from lightning_parallel.parallel.dims import ParallelDims
from lightning_parallel.testing.distributed import run_distributed


def _gpt(device: str = "cpu") -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, tie_embeddings=False)


def _dims(world: int, **layout: Any) -> tuple[ParallelConfig, ParallelDims]:
    config = ParallelConfig(**layout)
    return config, ParallelDims.from_config(config, world_size=world)


# ---------------------------------------------------------------------------------------------------- pure
@pytest.mark.parametrize(("layout", "world", "backend", "sync"), [
    ({"zero_stage": 0}, 2, "native", "ddp"),
    ({"zero_stage": 1}, 2, "native", "zero"),
    ({"zero_stage": 2}, 4, "native", "zero"),
    ({"zero_stage": 3}, 2, "native", "fsdp"),
    ({"zero_stage": 1}, 2, "fairscale", "fairscale"),
    ({"tensor_parallel_size": 2}, 4, "native", "allreduce"),
    ({"tensor_parallel_size": 2, "zero_stage": 1}, 4, "native", "zero"),
    ({"tensor_parallel_size": 2, "zero_stage": 3}, 4, "native", "fsdp"),
    ({"pipeline_parallel_size": 2}, 4, "native", "allreduce"),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1}, 8, "native", "zero"),
    ({"pipeline_parallel_size": 2, "zero_stage": 2}, 4, "native", "fsdp"),
    ({"pipeline_parallel_size": 2, "zero_stage": 3}, 4, "native", "fsdp"),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}, 8, "native", "fsdp"),
    ({"zero_stage": 2, "data_parallel_shard_size": 2}, 4, "native", "fsdp"),
    ({"zero_stage": 3, "data_parallel_shard_size": 2}, 4, "native", "fsdp"),
])
def test_data_parallel_plan_picks_the_sync_of_each_layout(layout: dict[str, Any], world: int, backend: Any,
                                                          sync: str) -> None:
    config, dims = _dims(world, **layout)
    plan = data_parallel_plan(config, dims, backend=backend)
    assert plan.sync == sync and plan.zero_stage == config.zero


def test_data_parallel_plan_refuses_what_is_not_composed() -> None:
    config, dims = _dims(4, tensor_parallel_size=2, zero_stage=2)
    with pytest.raises(LayoutError, match="zero_stage=2 with tensor_parallel_size=2 and no pipeline"):
        data_parallel_plan(config, dims)
    config, dims = _dims(4, tensor_parallel_size=2, zero_stage=1)
    with pytest.raises(LayoutError, match="fairscale backend runs ZeRO stage 1 or 2 over dp alone"):
        data_parallel_plan(config, dims, backend="fairscale")


def test_reshard_policy_per_stage_and_schedule() -> None:
    """ZeRO-3 reshards after forward except on a pipeline's last stage under 1F1B-family schedules; ZeRO-2 never;
    an explicit setting wins."""
    from lightning_parallel.parallel.compose import reshard_policy

    z3 = data_parallel_plan(*_dims(4, pipeline_parallel_size=2, zero_stage=3))
    z2 = data_parallel_plan(*_dims(4, pipeline_parallel_size=2, zero_stage=2))
    assert [reshard_policy(z3, stage=s, num_stages=2, schedule="1f1b") for s in (0, 1)] == [True, False]
    assert [reshard_policy(z3, stage=s, num_stages=2, schedule="gpipe") for s in (0, 1)] == [True, True]
    assert reshard_policy(z3, stage=None, num_stages=1, schedule="1f1b") is True
    assert [reshard_policy(z2, stage=s, num_stages=2, schedule="1f1b") for s in (0, 1)] == [False, False]
    forced = data_parallel_plan(*_dims(4, pipeline_parallel_size=2, zero_stage=3, reshard_after_forward=False))
    assert reshard_policy(forced, stage=0, num_stages=2, schedule="gpipe") is False
    hsdp = data_parallel_plan(*_dims(4, zero_stage=3, data_parallel_shard_size=2))
    assert hsdp.hsdp and not data_parallel_plan(*_dims(4, zero_stage=3)).hsdp


def test_composition_path_of_every_layout_strategy() -> None:
    """The path each layout strategy takes through compose() (what the architecture docs list)."""
    from lightning_parallel.strategies import (
        LPDDPStrategy,
        LPHybridStrategy,
        LPPipelineStrategy,
        LPShardedStrategy,
        LPTensorStrategy,
    )

    cases = [
        (LPDDPStrategy, {}, 2, ("placement", "data-parallel wrap"), "ddp"),
        (LPShardedStrategy, {"zero_stage": 1}, 2, ("placement", "data-parallel wrap"), "zero"),
        (LPShardedStrategy, {"zero_stage": 3, "activation_checkpointing": "full"}, 2,
         ("placement", "activation checkpointing", "data-parallel wrap"), "fsdp"),
        (LPTensorStrategy, {"tensor_parallel_size": 2, "zero_stage": 3}, 4,
         ("placement", "tensor plan", "data-parallel wrap"), "fsdp"),
        (LPPipelineStrategy, {"pipeline_parallel_size": 2, "zero_stage": 1}, 4,
         ("pipeline split", "placement", "data-parallel wrap"), "zero"),
        (LPHybridStrategy, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "activation_checkpointing":
                            "selective", "compile": "aot_eager"}, 8,
         tuple(s for s in COMPOSITION_ORDER if s != "context parallel"), "allreduce"),
        (LPShardedStrategy, {"zero_stage": 3, "compile": True}, 2,
         ("placement", "compile", "data-parallel wrap"), "fsdp"),
        (LPHybridStrategy, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "context_parallel_size": 2,
                            "activation_checkpointing": "selective", "compile": "aot_eager"}, 8, COMPOSITION_ORDER,
         "allreduce"),
        (LPDDPStrategy, {"context_parallel_size": 2}, 4, ("placement", "context parallel", "data-parallel wrap"),
         "ddp"),
        (LPShardedStrategy, {"zero_stage": 3, "context_parallel_size": 2}, 4,
         ("placement", "context parallel", "data-parallel wrap"), "fsdp"),
        (LPTensorStrategy, {"tensor_parallel_size": 2, "context_parallel_size": 2}, 4,
         ("placement", "tensor plan", "context parallel", "data-parallel wrap"), "allreduce"),
        (LPPipelineStrategy, {"pipeline_parallel_size": 2, "context_parallel_size": 2}, 4,
         ("pipeline split", "placement", "context parallel", "data-parallel wrap"), "allreduce"),
    ]
    for cls, layout, world, path, sync in cases:
        strategy = cls(parallel=layout)
        dims = ParallelDims.from_config(strategy.layout, world_size=world)
        assert composition_path(strategy.layout, dims, pipeline=strategy.pipelined) == path, cls.__name__
        strategy._dims = dims
        assert strategy.data_parallel_plan().sync == sync, cls.__name__


def test_context_parallelism_syncs_over_dp_x_cp() -> None:
    """With cp > 1 every plan keeps the replicas of dp x cp equal (the mesh's dp_cp; FSDP2 over it, or over
    dp_replicate x dp_shard_cp under HSDP); the fairscale backend (dp alone) is refused; cp = 1 plans are as before."""
    for layout, world, sync, fsdp in (
            ({"context_parallel_size": 2}, 4, "ddp", ("dp_cp",)),
            ({"context_parallel_size": 2, "zero_stage": 1}, 4, "zero", ("dp_cp",)),
            ({"context_parallel_size": 2, "zero_stage": 3}, 4, "fsdp", ("dp_cp",)),
            ({"context_parallel_size": 2, "zero_stage": 3, "data_parallel_shard_size": 2}, 8, "fsdp",
             ("dp_replicate", "dp_shard_cp")),
            ({"context_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}, 8, "fsdp", ("dp_cp",)),
            ({"context_parallel_size": 2, "pipeline_parallel_size": 2}, 8, "allreduce", ("dp_cp",))):
        plan = data_parallel_plan(*_dims(world, **layout))
        assert (plan.sync, plan.axis, plan.fsdp_axes) == (sync, "dp_cp", fsdp), layout
    assert data_parallel_plan(*_dims(2, zero_stage=3)).axis == "dp"
    assert data_parallel_plan(*_dims(4, zero_stage=3, data_parallel_shard_size=2)).fsdp_axes == (
        "dp_replicate", "dp_shard")
    with pytest.raises(LayoutError, match=r"fairscale backend runs over the dp group alone, but "
                                          r"context_parallel_size=2"):
        data_parallel_plan(*_dims(4, context_parallel_size=2, zero_stage=1), backend="fairscale")


def test_context_parallel_step_keeps_its_place_in_the_order() -> None:
    """The cp routing after the tensor plan and before recomputation (a recomputed core recomputes its ring) and the
    dp wrap; applied after either, it is refused before it touches the module."""
    from lightning_parallel.parallel.compose import apply_context_parallel_step
    from lightning_parallel.parallel.context_parallel import SequenceShard, context_parallel_modules

    assert COMPOSITION_ORDER.index("tensor plan") < COMPOSITION_ORDER.index("context parallel") < \
        COMPOSITION_ORDER.index("activation checkpointing") < COMPOSITION_ORDER.index("data-parallel wrap")
    model = _gpt()
    apply_recomputation(model, mode="selective")
    with pytest.raises(CompositionOrderError, match="'context parallel' after 'activation checkpointing'"):
        apply_context_parallel_step(model, cp_group=None, shard=SequenceShard(2, 0), style="ring")
    assert context_parallel_modules(model) == [] and steps_done(model) == ["activation checkpointing"]


def test_steps_out_of_order_are_impossible() -> None:
    """Each step records itself; a step after a later one (or twice) raises before it touches the module."""
    config, dims = _dims(2, pipeline_parallel_size=2, num_micro_batches=2)
    model = _gpt()
    apply_recomputation(model, mode="full")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CompositionOrderError, match="'placement' after 'activation checkpointing'"):
        place(model, device=torch.device("cpu"), seed=0)
    with pytest.raises(CompositionOrderError, match="'pipeline split' after 'activation checkpointing'"):
        split_pipeline(model, layout=config, dims=dims, pp_rank=0)
    with pytest.raises(CompositionOrderError, match="'activation checkpointing' after 'activation checkpointing'"):
        apply_recomputation(model, mode="full")
    assert steps_done(model) == ["activation checkpointing"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # refused before any change
    assert len(model.blocks) == 2  # no split happened


def _compile_world(rank: int, world: int) -> dict[str, Any]:
    """The compile checks, in a forked rank: torch.compile leaves threads and state in its process, and the pytest
    process must stay clean for the fork launchers of later tests."""
    from lightning_parallel.parallel.compile import compiled_modules, strip_compile_prefix, unwrap_compiled

    out: dict[str, Any] = {}
    model = _gpt()
    names = list(model.state_dict())
    apply_recomputation(model, mode="full")
    out["compiled"] = apply_compile(model, setting="aot_eager")
    out["listed"] = compiled_modules(model)
    out["names_kept"] = list(model.state_dict()) == names
    out["inside_checkpoint"] = all("_lp_compiled_forward" in model.blocks[k].__dict__ for k in ("0", "1"))
    try:
        apply_recomputation(model, mode="full")
        out["ac_after_compile"] = "allowed"
    except CompositionOrderError as err:
        out["ac_after_compile"] = str(err)
    x = torch.randint(0, 32, (2, 8))
    ref = _gpt()
    model.pipeline_loss(model(x), x).backward()
    ref.pipeline_loss(ref(x), x).backward()
    grads = dict(ref.named_parameters())
    out["grad_diff"] = max(float((p.grad - grads[n].grad).abs().max()) for n, p in model.named_parameters())
    plain = _gpt()
    apply_compile(plain, setting="aot_eager")
    out["in_place"] = compiled_modules(plain) == ["blocks.0", "blocks.1"] and all(
        plain.blocks[k]._compiled_call_impl is not None for k in ("0", "1"))
    try:
        apply_compile(plain, setting="aot_eager")
        out["twice"] = "allowed"
    except CompositionOrderError as err:
        out["twice"] = str(err)
    # a module the user compiled: unwrapped in place, compiled with the same backend, no "_orig_mod."
    user = _gpt()
    user.blocks["1"] = torch.compile(user.blocks["1"], backend="aot_eager")  # type: ignore[assignment]
    out["prefixed"] = any("_orig_mod." in n for n in user.state_dict())
    out["unwrapped"] = unwrap_compiled(user)
    out["user_names"] = list(user.state_dict()) == names and user.blocks["1"]._compiled_call_impl is not None
    out["user_runs"] = tuple(user(x).shape)
    out["strip"] = strip_compile_prefix("model._orig_mod.layers.0._orig_mod.w")
    return out


def test_compile_after_recomputation_in_place_and_user_compiled_unwrapped() -> None:
    """compile after the dp wrap, or recomputation after compile, is refused; compiling keeps every name and
    compiles each block in place (a recomputed block: its forward, inside the checkpoint); a submodule the user
    compiled is unwrapped with its names."""
    out = run_distributed(_compile_world, world_size=1, timeout_s=300)[0]
    assert out["compiled"] == out["listed"] == ["blocks.0", "blocks.1"] and out["names_kept"]
    assert out["inside_checkpoint"] and out["in_place"] and out["grad_diff"] < 1e-6
    assert "'activation checkpointing' after 'compile'" in out["ac_after_compile"]
    assert "'compile' after 'compile'" in out["twice"]
    assert out["prefixed"] and out["unwrapped"] == ["blocks.1"] and out["user_names"]
    assert out["user_runs"] == (2, 8, 32) and out["strip"] == "model.layers.0.w"


def test_compile_needs_the_blocks_named_and_a_known_backend() -> None:
    from lightning_parallel.parallel.compile import check_backend, compile_targets

    with pytest.raises(LayoutError, match=r"parallel.compile compiles each block.*pipeline_layers"):
        compile_targets(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(LayoutError, match=r"parallel.compile='nope' is not a torch.compile backend"):
        check_backend("nope")
    with pytest.raises(LayoutError, match=r"parallel.compile=3 must be true, false or the name"):
        ParallelConfig(compile=3)  # type: ignore[arg-type]
    assert ParallelConfig(compile=True).describe().endswith("compile")


def test_pipeline_split_keeps_this_ranks_layers_under_their_names() -> None:
    config, dims = _dims(2, pipeline_parallel_size=2, num_micro_batches=2)
    whole = {n for n, _ in _gpt().named_parameters()}
    kept = []
    for pp_rank in (0, 1):
        model = _gpt()
        _, chunks = split_pipeline(model, layout=config, dims=dims, pp_rank=pp_rank)
        names = {n for n, _ in model.named_parameters()}
        assert names and names < whole and len(chunks) == 1
        kept.append(names)
    assert kept[0] | kept[1] == whole and not kept[0] & kept[1]


def test_placement_materializes_a_meta_module_from_the_seed() -> None:
    meta = _gpt("meta")
    place(meta, device=torch.device("cpu"), seed=0)
    assert not any(p.is_meta for p in meta.parameters())
    again = _gpt("meta")
    place(again, device=torch.device("cpu"), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(meta.parameters(), again.parameters(), strict=True))


# ---------------------------------------------------------------------------------------------------- 2 ranks
def _world(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {}
    dp_mesh = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    tp_mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp", "pp", "tp"))

    # tensor plan: the plan's linears become DTensor shards over tp (half the rows/columns each)
    model = _gpt()
    place(model, device=torch.device("cpu"), seed=0)
    applied = apply_tensor_plan(model, tp_mesh=tp_mesh["tp"], sequence_parallel=False)
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor) and isinstance(p.placements[0], Shard)]
    out["tp_sharded"] = len(sharded)
    out["tp_plan"] = len(applied)
    out["tp_local_half"] = all(p.to_local().numel() * 2 == p.numel() for n, p in model.named_parameters()
                               if n in sharded)
    # ... and a tensor plan after the dp wrap is refused
    wrap_data_parallel(model, plan=data_parallel_plan(*_dims(4, tensor_parallel_size=2)), mesh=tp_mesh,
                       dp_src=rank, fitting=True)
    try:
        apply_tensor_plan(model, tp_mesh=tp_mesh["tp"], sequence_parallel=False)
        out["tp_after_wrap"] = "allowed"
    except CompositionOrderError as err:
        out["tp_after_wrap"] = str(err)

    # dp wrap: replicas made equal (rank 1 starts from other weights), DDP when fitting, FSDP2 at ZeRO-3
    for sync_layout, fitting in (({"zero_stage": 0}, True), ({"zero_stage": 0}, False), ({"zero_stage": 1}, True),
                                 ({"zero_stage": 3}, True)):
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        plan = data_parallel_plan(*_dims(2, **sync_layout))
        wrapped = wrap_data_parallel(model, plan=plan, mesh=dp_mesh, dp_src=0, fitting=fitting)
        full = wrapped.state_dict() if plan.sync != "fsdp" else {
            k: v.full_tensor() for k, v in model.state_dict().items()}
        flat = torch.cat([v.reshape(-1) for v in full.values()])
        gathered = [torch.zeros_like(flat) for _ in range(world)]
        torch.distributed.all_gather(gathered, flat)
        key = f"{plan.sync}-{'fit' if fitting else 'eval'}"
        out[key] = {"equal": torch.equal(gathered[0], gathered[1]),
                    "ddp": isinstance(wrapped, DistributedDataParallel),
                    "fsdp": isinstance(wrapped, FSDPModule)}

    # compose(): the whole order, reused for the same layout, refused for another
    config, dims = _dims(2, zero_stage=0)
    model = _gpt()
    mesh = init_device_mesh("cpu", dims.shape, mesh_dim_names=dims.order)
    plan = data_parallel_plan(config, dims)
    first = compose(model, layout=config, dims=dims, rank=rank, mesh=mesh, device=torch.device("cpu"), seed=0,
                    data_parallel=plan, fitting=False)
    out["compose_steps"] = steps_done(model)
    again = compose(model, layout=config, dims=dims, rank=rank, mesh=mesh, device=torch.device("cpu"), seed=0,
                    data_parallel=plan, fitting=True)
    out["compose_reused"] = again is first and isinstance(again.module, DistributedDataParallel)
    other, other_dims = _dims(2, zero_stage=1)
    try:
        compose(model, layout=other, dims=other_dims, rank=rank, mesh=mesh, device=torch.device("cpu"), seed=0,
                data_parallel=data_parallel_plan(other, other_dims))
        out["compose_other"] = "allowed"
    except CompositionOrderError as err:
        out["compose_other"] = str(err)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_distributed(_world, world_size=2, timeout_s=180)


def test_tensor_plan_splits_the_plans_layers_over_tp(world: list[dict[str, Any]]) -> None:
    for out in world:
        assert out["tp_plan"] > 0 and out["tp_sharded"] > 0 and out["tp_local_half"]
        assert "'tensor plan' after 'data-parallel wrap'" in out["tp_after_wrap"]


def test_data_parallel_wrap_makes_replicas_equal_and_wraps_as_planned(world: list[dict[str, Any]]) -> None:
    for out in world:
        assert out["ddp-fit"] == {"equal": True, "ddp": True, "fsdp": False}
        assert out["ddp-eval"] == {"equal": True, "ddp": False, "fsdp": False}
        assert out["zero-fit"] == {"equal": True, "ddp": False, "fsdp": False}
        assert out["fsdp-fit"] == {"equal": True, "ddp": False, "fsdp": True}


def test_compose_runs_the_order_once_and_refuses_another_layout(world: list[dict[str, Any]]) -> None:
    for out in world:
        assert out["compose_steps"] == ["placement", "data-parallel wrap"]
        assert out["compose_reused"]
        assert "composed for another layout" in out["compose_other"]
