"""Context parallelism on bare gloo ranks (one world of 4): the mesh with a cp axis, ring and all-to-all attention
against full attention (forward and backward, fp64 and fp32, cp = 2 and 4), the head-tail balance of the causal
work, the ring's point-to-point traffic, and the reference GPT composed with cp against one device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_parallel import ParallelConfig, ParallelDims
from lightning_parallel.testing import run_distributed

WORLD = 4


def _mesh_checks(rank: int) -> list[str]:
    """Every cp layout of 4 ranks: the mesh's dims and groups agree with ParallelDims, dp_cp is dp x cp."""
    checked = []
    for layout in ({"context_parallel_size": 4}, {"context_parallel_size": 2},
                   {"context_parallel_size": 2, "tensor_parallel_size": 2},
                   {"context_parallel_size": 2, "pipeline_parallel_size": 2, "num_micro_batches": 2},
                   {"context_parallel_size": 2, "zero_stage": 3, "data_parallel_shard_size": 1}):
        config = ParallelConfig(**layout)  # type: ignore[arg-type]
        dims = ParallelDims.from_config(config, world_size=WORLD)
        mesh = dims.build_mesh("cpu")
        names = tuple("dp" if n == "dp_replicate" else n for n in mesh.mesh_dim_names or () if n != "dp_shard")
        assert names == tuple(a for a in dims.order), (names, dims.order)
        for axis in ("dp", "pp", "cp", "tp"):
            if axis in dims.order:
                assert dist.get_process_group_ranks(mesh.get_group(axis)) == dims.group_ranks(axis, rank), axis
        assert dist.get_process_group_ranks(mesh.get_group("dp_cp")) == dims.replica_group_ranks(rank)
        for axis in dims.fsdp_axes:
            assert mesh.get_group(axis) is not None
        checked.append(config.describe())
    return checked


def _attention(rank: int, group: Any, cp: int, style: str, dtype: torch.dtype) -> dict[str, float]:
    """Max |difference| of the output and of dq, dk, dv against one device's full causal attention."""
    from lightning_parallel.parallel.context_parallel import (
        SequenceShard,
        all_to_all_attention,
        ring_attention,
        shard_sequence,
        unshard_sequence,
    )

    g = torch.Generator().manual_seed(3)
    b, h, s, d = 2, 4, 8 * cp, 8
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g, dtype=dtype) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True).backward(dout)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    shard = SequenceShard(cp, dist.get_rank(group))
    local = [shard_sequence(t, 2, shard).requires_grad_() for t in (q, k, v)]
    fn = ring_attention if style == "ring" else all_to_all_attention
    out = fn(*local, group=group)
    out.backward(shard_sequence(dout, 2, shard))
    diffs = {"out": (unshard_sequence(out.detach(), 2, shard, group) - full).abs().max().item()}
    for name, mine, theirs in zip(("dq", "dk", "dv"), local, ref, strict=True):
        assert mine.grad is not None and theirs.grad is not None
        diffs[name] = (unshard_sequence(mine.grad, 2, shard, group) - theirs.grad).abs().max().item()
    return diffs


def _balance_and_traffic(rank: int, group: Any, cp: int) -> dict[str, Any]:
    """Scores each rank computes in one ring attention (forward), and its point-to-point sends forward/backward."""
    from lightning_parallel.parallel.context_parallel import ring, ring_attention

    scores = [0]
    original = ring.block_attention

    def counting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool) -> Any:
        lq, lk = q.shape[-2], k.shape[-2]
        scores[0] += lq * (lq + 1) // 2 if causal else lq * lk
        return original(q, k, v, scale=scale, causal=causal)

    sends: list[int] = []
    real_batch = dist.batch_isend_irecv

    def counting_batch(ops: list[Any]) -> Any:
        sends.extend(op.tensor.numel() for op in ops if op.op is dist.isend)
        return real_batch(ops)

    c, b, h, d = 4, 1, 2, 4
    q, k, v = (torch.randn(b, h, 2 * c, d, requires_grad=True) for _ in range(3))
    ring.block_attention, dist.batch_isend_irecv = counting, counting_batch  # type: ignore[assignment]
    try:
        out = ring_attention(q, k, v, group=group)
        forward_sends = list(sends)
        out.sum().backward()
    finally:
        ring.block_attention, dist.batch_isend_irecv = original, real_batch  # type: ignore[assignment]
    return {"scores": scores[0], "forward_sends": forward_sends, "backward_sends": sends[len(forward_sends):],
            "block": 2 * b * h * 2 * c * d}


def _gpt_under_cp(rank: int, world: int) -> dict[str, Any]:
    """The reference GPT composed for cp = 4 (placement -> context parallel -> data-parallel wrap) on this world:
    its loss on each rank's tokens, averaged, and its gradients, averaged over cp, against one device."""
    from lightning_parallel.models import GPT
    from lightning_parallel.parallel.compose import compose, data_parallel_plan
    from lightning_parallel.parallel.context_parallel import active, context_parallel_modules, deactivate

    def model() -> GPT:
        torch.manual_seed(0)
        return GPT(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=32, dropout=0.0)

    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 32, (2, 32), generator=g), torch.randint(0, 32, (2, 32), generator=g)
    one = model()
    ref_loss = one.pipeline_loss(one(x), y)
    ref_loss.backward()
    config = ParallelConfig(context_parallel_size=world)
    dims = ParallelDims.from_config(config, world_size=world)
    mesh = dims.build_mesh("cpu")
    gpt = model()
    composition = compose(gpt, layout=config, dims=dims, rank=rank, mesh=mesh, device=torch.device("cpu"), seed=0,
                          data_parallel=data_parallel_plan(config, dims), fitting=False)
    assert composition.context_plan is not None and active() is composition.context_state
    from lightning_parallel.parallel.context_parallel import SequenceShard, split_batch

    xl, yl = split_batch((x, y), composition.context_plan, SequenceShard(world, dims.coord(rank, "cp")))
    loss = gpt.pipeline_loss(gpt(xl), yl)
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    grad_diff = 0.0
    for (name, p), (_, p_ref) in zip(gpt.named_parameters(), one.named_parameters(), strict=True):
        assert p.grad is not None and p_ref.grad is not None, name
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grad_diff = max(grad_diff, (grad / world - p_ref.grad).abs().max().item())
    routed = context_parallel_modules(gpt)
    deactivate()
    with torch.no_grad():  # with no cp state the routed cores run their own forward: the one-device model again
        plain_diff = (gpt(x) - one(x)).abs().max().item()
    return {"loss_diff": abs(mean_loss.item() / world - ref_loss.item()), "grad_diff": grad_diff, "routed": routed,
            "local_tokens": tuple(xl.shape), "plain_diff": plain_diff,
            "steps": list(getattr(gpt, "_lp_composition_steps", []))}


def _world(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"mesh": _mesh_checks(rank)}
    whole = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    for style in ("ring", "all_to_all"):
        for dtype in (torch.float64, torch.float32):
            name = f"{style}-{str(dtype).split('.')[-1]}"
            out[f"cp4-{name}"] = _attention(rank, whole, 4, style, dtype)
            out[f"cp2-{name}"] = _attention(rank, pair, 2, style, dtype)
    out["balance4"] = _balance_and_traffic(rank, whole, 4)
    out["balance2"] = _balance_and_traffic(rank, pair, 2)
    out["gpt"] = _gpt_under_cp(rank, world)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_distributed(_world, WORLD, timeout_s=300)


def test_mesh_has_cp_next_to_tp_and_dp_cp(world: list[dict[str, Any]]) -> None:
    assert world[0]["mesh"] == ["dp=auto pp=1 tp=1 zero=preset cp=4", "dp=auto pp=1 tp=1 zero=preset cp=2",
                                "dp=auto pp=1 tp=2 zero=preset cp=2", "dp=auto pp=2 tp=1 zero=preset cp=2",
                                "dp=auto pp=1 tp=1 zero=3 shard=1 cp=2"]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("style", ["ring", "all_to_all"])
def test_attention_over_cp_equals_full_attention(world: list[dict[str, Any]], cp: int, style: str) -> None:
    print(f"cp={cp} {style}: max |diff| fp64 {world[0][f'cp{cp}-{style}-float64']}, "
          f"fp32 {world[0][f'cp{cp}-{style}-float32']}")
    for out in world:
        fp64, fp32 = out[f"cp{cp}-{style}-float64"], out[f"cp{cp}-{style}-float32"]
        assert max(fp64.values()) < 1e-12  # exact up to the order of additions
        assert max(fp32.values()) < 2e-6


@pytest.mark.parametrize("cp", [2, 4])
def test_head_tail_balances_the_causal_work_and_the_ring_moves_kv_blocks(world: list[dict[str, Any]], cp: int) -> None:
    ranks = world if cp == 4 else world[:2]
    scores = [out[f"balance{cp}"]["scores"] for out in ranks]
    c = 4  # tokens per chunk
    assert len(set(scores)) == 1  # every rank computes the same number of scores
    assert scores[0] == 2 * c * (2 * c + 1) // 2 + (cp - 1) * 2 * c * c
    for out in ranks:
        info = out[f"balance{cp}"]
        block = info["block"]  # k and v of one rank: 2 x b x h x 2c x d
        assert info["forward_sends"] == [block] * (cp - 1)  # cp - 1 hops of the k/v block
        assert sorted(info["backward_sends"]) == sorted([block] * (cp - 1) + [block] * cp)  # + cp dk/dv hops


def test_gpt_composed_with_cp_equals_one_device(world: list[dict[str, Any]]) -> None:
    print(f"GPT cp=4: |loss - 1dev| {world[0]['gpt']['loss_diff']:.2e}, "
          f"max |grad - 1dev| {world[0]['gpt']['grad_diff']:.2e}")
    for out in world:
        gpt = out["gpt"]
        assert gpt["steps"] == ["placement", "context parallel", "data-parallel wrap"]
        assert gpt["routed"] == ["blocks.0.attn.core", "blocks.1.attn.core"]
        assert gpt["local_tokens"] == (2, 8)
        assert gpt["loss_diff"] < 1e-6 and gpt["grad_diff"] < 1e-6
        assert gpt["plain_diff"] < 1e-6
