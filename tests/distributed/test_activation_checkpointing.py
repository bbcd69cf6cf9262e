"""Activation checkpointing under torch DDP and torch FSDP2 ``fully_shard`` (applied after it), 2 gloo ranks: the
same losses and weights as one device without checkpointing, dropout on, parameter names unchanged."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from lightning_parallel.models import GPT
from lightning_parallel.models.gpt import Block
from lightning_parallel.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointed_modules
from lightning_parallel.testing import run_distributed

CFG: dict[str, Any] = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64, "dropout": 0.1}
STEPS, BATCH = 3, 4  # global batch; each of the 2 ranks takes half


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(**CFG)


def _batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (BATCH, 16), generator=g), torch.randint(0, 64, (BATCH, 16), generator=g))
            for _ in range(STEPS)]


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 shards are DTensors


def _one_device(world: int) -> tuple[list[float], dict[str, Tensor]]:
    """The reference: one device, no checkpointing, each rank's half-batch with that rank's dropout seed, the mean
    of their gradients (what DDP and FSDP2 average)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step, (x, y) in enumerate(_batches()):
        total = 0.0
        for rank, (xr, yr) in enumerate(zip(x.chunk(world), y.chunk(world), strict=True)):
            torch.manual_seed(1000 + 10 * step + rank)
            loss = model.pipeline_loss(model(xr), yr)
            (loss / world).backward()
            total += loss.item() / world
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _wrapped(rank: int, world: int, wrapper: str, mode: str, calls: list[int]) -> tuple[list[float], dict[str, Any]]:
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    assert apply_activation_checkpointing(model, mode)
    run: nn.Module
    if wrapper == "ddp":
        run = DistributedDataParallel(model)
    else:
        mesh = dist.init_device_mesh("cpu", (world,))
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        run = fully_shard(model, mesh=mesh)
    assert [n for n, _ in model.named_parameters()] == names  # neither checkpointing nor wrapping renamed them
    assert checkpointed_modules(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step, (x, y) in enumerate(_batches()):
        torch.manual_seed(1000 + 10 * step + rank)
        xr, yr = x.chunk(world)[rank], y.chunk(world)[rank]
        calls[0] = 0
        loss = model.pipeline_loss(run(xr), yr)
        loss.backward()
        expected_calls = 2 * CFG["n_layer"] if mode == "full" else CFG["n_layer"]  # full: forward + recompute
        assert calls[0] == expected_calls, (wrapper, mode, calls[0])
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        opt.step()
        opt.zero_grad()
    return losses, {k: _full(v).detach().clone() for k, v in model.state_dict().items()}


def _check(rank: int, world: int) -> dict[str, float]:
    calls = [0]
    block_forward = Block.forward

    def counting(self: Block, x: Tensor) -> Tensor:
        calls[0] += 1
        return block_forward(self, x)

    Block.forward = counting  # type: ignore[method-assign]  # this forked worker only
    ref_losses, ref_state = _one_device(world)
    diffs = {}
    for wrapper in ("ddp", "fsdp2"):
        for mode in ("selective", "full"):
            losses, state = _wrapped(rank, world, wrapper, mode, calls)
            assert list(state) == list(ref_state), (wrapper, mode)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
            rel = max(float((state[k] - ref_state[k]).norm() / ref_state[k].norm().clamp_min(1e-12)) for k in state)
            assert rel < 1e-5, (wrapper, mode, rel)
            diffs[f"{wrapper}/{mode}"] = rel
    return diffs


def test_checkpointing_under_ddp_and_fsdp2_equals_one_device() -> None:
    results = run_distributed(_check, 2, timeout_s=240)
    print("\nmax relative weight difference to one device after 3 steps:", results[0])
    assert set(results[0]) == {"ddp/selective", "ddp/full", "fsdp2/selective", "fsdp2/full"}
