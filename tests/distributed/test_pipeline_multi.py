"""Several tensors between pipeline stages (no Lightning Trainer): layers that read and return named tensors --
a mask from the batch, position codes made by the first layer, a long skip connection that crosses every stage --
trained through every schedule on 2 gloo ranks equal one device, and the stage boundaries carry exactly the tensors
later layers read."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel import PipelineLayer
from lightning_parallel.testing import run_distributed

V, H, T = 32, 16, 8


def _embed(module: nn.Module, tokens: Tensor) -> tuple[Tensor, Tensor]:
    h = module(tokens)
    pos = torch.sin(torch.arange(T, dtype=h.dtype) / 3.0)[None, :, None].expand(h.shape[0], T, 1).contiguous()
    return h, pos


class Mix(nn.Module):
    """``h + lin(h + pos) * mask`` (reads three tensors, returns one)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, h: Tensor, mask: Tensor, pos: Tensor) -> Tensor:
        return h + torch.tanh(self.lin(h + pos)) * mask.unsqueeze(-1)


class Carrying(nn.Module):
    """embed -> 4 Mix layers -> head(h + skip): the embedding output ``skip`` crosses every stage boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Mix() for _ in range(4))
        self.head = nn.Linear(H, V)

    def pipeline_layers(self) -> list[Any]:
        return [
            PipelineLayer(self.embed, inputs=("tokens",), outputs=("h", "pos"), call=_embed),
            *(PipelineLayer(b, inputs=("h", "mask", "pos"), outputs=("h",)) for b in self.blocks),
            PipelineLayer(self.head, inputs=("h", "skip"), outputs=("logits",), call=lambda m, h, s: m(h + s)),
        ]

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        h, pos = _embed(self.embed, tokens)
        skip = h
        for b in self.blocks:
            h = b(h, mask, pos)
        return self.head(h + skip)


def _skip_layer(model: Carrying) -> list[Any]:
    """The same model, with the skip named by the embedding: ``h`` is also written as ``skip``."""
    layers = model.pipeline_layers()
    layers[0] = PipelineLayer(model.embed, inputs=("tokens",), outputs=("h", "pos", "skip"),
                              call=lambda m, t: (*_embed(m, t), m(t)))
    return layers


def loss_fn(out: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def _train(rank: int, world: int, schedule: str, v: int) -> dict[str, Any]:
    from lightning_parallel.parallel.pipeline import PipelineRunner, plan_stages, prune_to

    torch.manual_seed(0)
    model, ref = Carrying(), Carrying()
    ref.load_state_dict(model.state_dict())
    layers = _skip_layer(model)
    plan = plan_stages(model, layers, pp=world, chunks=v, pp_rank=rank)
    bounds = plan.boundaries(("tokens", "mask"))
    chunks = prune_to(model, plan, layers)
    group = torch.distributed.new_group(list(range(world)))
    runner = PipelineRunner(list(zip(plan.my_stages, chunks, strict=True)), num_stages=plan.num_stages,
                            schedule=schedule, num_micro_batches=4, group=group, group_ranks=list(range(world)),
                            device=torch.device("cpu"), loss_fn=loss_fn, plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        x, y = torch.randint(0, V, (8, T), generator=g), torch.randint(0, V, (8, T), generator=g)
        mask = (torch.rand(8, T, generator=g) > 0.3).float()
        opt.zero_grad()
        runner.train_step({"tokens": x, "mask": mask}, y)
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref(x, mask), y).backward()
        ref_opt.step()
    ref_params = dict(ref.named_parameters())
    worst = max(float((p - ref_params[n]).abs().max()) for n, p in model.named_parameters())
    moved = max(float((p - Carrying().state_dict()[n]).abs().max()) for n, p in ref.named_parameters())
    x, mask = torch.randint(0, V, (4, T), generator=g), torch.ones(4, T)
    out = runner.outputs_everywhere(runner.forward_only({"tokens": x, "mask": mask}))
    with torch.no_grad():
        out_diff = float((out - ref(x, mask)).abs().max())
    print(f"[pp multi] rank {rank} {schedule} v={v}: boundaries {bounds}, max |w - w_ref| = {worst:.2e}")
    return {"worst": worst, "out_diff": out_diff, "bounds": bounds, "moved": moved}


def _world(rank: int, world: int) -> dict[str, Any]:
    return {(s, v): _train(rank, world, s, v)
            for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1))}


def test_named_tensors_cross_stages_under_every_schedule() -> None:
    results = run_distributed(_world, 2, timeout_s=300)
    for key in results[0]:
        for r in results:
            assert r[key]["worst"] < 1e-5, (key, r[key]["worst"])
            assert r[key]["out_diff"] < 1e-5, key
        bounds = results[0][key]["bounds"]
        assert bounds[0] == ("tokens", "mask") and bounds[-1] == ("logits",)
        # between stages: h, the mask and position codes the next blocks read, the skip the head reads
        for inner in bounds[1:-1]:
            assert set(inner) <= {"h", "pos", "skip", "mask"} and {"h", "skip"} <= set(inner), (key, inner)
    assert results[0][("gpipe", 1)]["bounds"][1] == ("mask", "h", "pos", "skip")


def test_flow_and_signature_refusals() -> None:
    import pytest

    from lightning_parallel.config import LayoutError
    from lightning_parallel.module_hooks import check_layer_signature
    from lightning_parallel.parallel.pipeline import PipelineFlowError, plan_stages

    model = Carrying()
    plan = plan_stages(model, model.pipeline_layers(), pp=2, chunks=1, pp_rank=0)
    with pytest.raises(PipelineFlowError, match=r"head reads 'skip'"):
        plan.boundaries(("tokens", "mask"))
    with pytest.raises(PipelineFlowError, match=r"blocks.0 reads 'mask'"):
        plan.boundaries(("tokens",))
    # a plain Mix (one tensor in) cannot be followed: named layer and argument
    with pytest.raises(LayoutError, match=r"pipeline layer blocks.0 \(Mix\).*'mask'"):
        check_layer_signature(PipelineLayer(model.blocks[0]), "blocks.0")
    with pytest.raises(LayoutError, match=r"blocks.1 .*takes 3 values, the pipeline would pass 4"):
        check_layer_signature(PipelineLayer(model.blocks[1], inputs=("h", "mask", "pos", "x")), "blocks.1")
    check_layer_signature(model.pipeline_layers()[1], "blocks.0")
