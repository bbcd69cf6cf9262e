"""Tensor-parallel plans on gloo ranks (no Lightning Trainer): forward and backward of a tp=2 model equal one device.

One 2-rank world runs every check (a world costs seconds on 2 cores): the reference GPT with and without sequence
parallelism, a small non-GPT module with its own plan, and the tp collectives counted against Megatron's formula.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_parallel.testing import run_distributed
from tests.helpers import tiny_gpt


class _MLPStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _grads_equal(model: nn.Module, ref: nn.Module) -> float:
    from torch.distributed.tensor import DTensor

    ref_grads = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, float((g - ref_grads[name].grad).abs().max()))  # type: ignore[operator]
    return worst


def _checks(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_parallel.parallel.counters import CommCounter
    from lightning_parallel.parallel.tensor import apply_tensor_parallel
    from lightning_parallel.parallel.tensor.comm import megatron_tp_bytes
    from lightning_parallel.parallel.tensor.sync import settle_gradients

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    for sp in (False, True):
        ref, model = tiny_gpt(0), tiny_gpt(0)
        ref_loss = ref.pipeline_loss(ref(x), y)
        ref_loss.backward()
        apply_tensor_parallel(model, model.tensor_parallel_plan(), mesh=mesh, sequence_parallel=sp)
        shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if isinstance(p, DTensor)}
        counter = CommCounter()
        counter.phase = "forward"
        with loss_parallel(), counter.counting():
            logits = model(x)
            loss = model.pipeline_loss(logits, y).to_local()
            counter.phase = "backward"
            loss.backward()
        settle_gradients(model.parameters())
        partial = [n for n, p in model.named_parameters() if isinstance(p.grad, DTensor)
                   and p.grad.placements != p.placements]
        out[f"sp={sp}"] = {
            "loss": abs(float(loss.detach()) - float(ref_loss.detach())), "grad": _grads_equal(model, ref),
            "q_shape": shapes["blocks.0.attn.q_proj.weight"], "out_shape": shapes["blocks.0.attn.out_proj.weight"],
            "emb_shape": shapes["embed.tok.weight"], "logits": type(logits).__name__, "partial_after_settle": partial,
            "calls": counter.calls_by_phase(), "bytes": counter.bytes_by_phase(),
            "formula": megatron_tp_bytes(n_layer=2, batch=4, seq=16, hidden=32, tp=world, sequence_parallel=sp),
        }
    odd = tiny_gpt(0)
    apply_tensor_parallel(odd, odd.tensor_parallel_plan(), mesh=mesh, sequence_parallel=True)
    try:
        odd(x[:, :15])
    except ValueError as err:
        out["odd_sequence"] = str(err)
    torch.manual_seed(3)
    ref_mlp = _MLPStack()
    mlp = _MLPStack()
    mlp.load_state_dict(ref_mlp.state_dict())
    apply_tensor_parallel(mlp, {"layers.*.0": "column", "layers.*.2": "row"}, mesh=mesh)
    inp = torch.randn(3, 5, 16, generator=g)
    ref_out = ref_mlp(inp)
    ref_out.square().mean().backward()
    got = mlp(inp)
    got.square().mean().backward()
    out["mlp"] = {"out": float((got - ref_out).abs().max()), "grad": _grads_equal(mlp, ref_mlp)}
    return out


def test_tp2_forward_backward_equals_one_device() -> None:
    result = run_distributed(_checks, 2, timeout_s=240)[0]
    for sp in (False, True):
        r = result[f"sp={sp}"]
        print(f"GPT tp=2 sequence_parallel={sp}: |loss - loss_1dev| = {r['loss']:.1e}, max |grad - grad_1dev| = "
              f"{r['grad']:.1e}")
        assert r["loss"] < 1e-5 and r["grad"] < 1e-6
        assert r["q_shape"] == (16, 32) and r["out_shape"] == (32, 16) and r["emb_shape"] == (32, 32)  # 1/t each
        assert r["logits"] == "DTensor" and r["partial_after_settle"] == []
    assert "embed got a sequence of 15 positions: 15 % 2 = 1. Fix: a sequence length that is a multiple of 2 (e.g. " \
        "14 or 16), or sequence_parallel=False." in result["odd_sequence"]
    print(f"MLP stack (own plan) tp=2: max |out diff| = {result['mlp']['out']:.1e}, grads {result['mlp']['grad']:.1e}")
    assert result["mlp"]["out"] < 1e-6 and result["mlp"]["grad"] < 1e-6
    # Megatron without SP: 2 all-reduces per layer in forward (+1 embedding, +3 b x s statistics of the loss) and
    # 2 per layer in backward (+1 head input gradient); the bytes counted at each collective equal the formula
    plain = result["sp=False"]
    assert plain["calls"] == {("forward", "all_reduce"): 2 * 2 + 1 + 3, ("backward", "all_reduce"): 2 * 2 + 1}
    assert plain["bytes"][("backward", "all_reduce")] == plain["formula"]["backward"]
    assert plain["bytes"][("forward", "all_reduce")] == plain["formula"]["forward"] + plain["formula"]["loss"]
    # with SP: one all-gather per norm and one reduce-scatter per row linear in forward, the reverse in backward
    # (+ the embedding's scatter and the head's gather); one reduction per norm, not one per consumer linear
    sp = result["sp=True"]
    assert sp["calls"] == {("forward", "all_gather"): 2 * 2 + 1, ("forward", "reduce_scatter"): 2 * 2,
                           ("forward", "all_reduce"): 1 + 3, ("backward", "all_gather"): 2 * 2 + 1,
                           ("backward", "reduce_scatter"): 2 * 2 + 1}
    assert sum(v for (phase, _), v in sp["bytes"].items() if phase == "backward") == sp["formula"]["backward"]
    assert sum(v for (phase, _), v in sp["bytes"].items() if phase == "forward") == (sp["formula"]["forward"]
                                                                                     + sp["formula"]["loss"])
