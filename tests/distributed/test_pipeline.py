"""Pipeline stages and schedules on gloo ranks (no Lightning Trainer): AdamW training through every schedule equals
one device, forward-only evaluation gives the one-device outputs, and stages keep the module's parameter names.

Two worlds run every check (each costs seconds on 2 cores): p=2 runs the four schedules, p=4 runs 1F1B and
interleaved 1F1B (v=2) on a deeper model.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_parallel.testing import run_distributed
from tests.helpers import tiny_gpt

STEPS = 10


def _train(rank: int, world: int, schedule: str, v: int, m: int, n_layer: int, steps: int) -> dict[str, Any]:
    from lightning_parallel.parallel.pipeline import PipelineRunner, plan_stages, prune_to

    torch.manual_seed(0)
    model = tiny_gpt(0, n_layer=n_layer)
    ref = tiny_gpt(0, n_layer=n_layer)
    plan = plan_stages(model, model.pipeline_layers(), pp=world, chunks=v, pp_rank=rank)
    chunks = prune_to(model, plan)
    group = torch.distributed.new_group(list(range(world)))
    runner = PipelineRunner(list(zip(plan.my_stages, chunks, strict=True)), num_stages=plan.num_stages,
                            schedule=schedule, num_micro_batches=m, group=group, group_ranks=list(range(world)),
                            device=torch.device("cpu"), loss_fn=model.pipeline_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(steps):
        x, y = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
        opt.zero_grad()
        losses.append(float(runner.train_step(x, y)))
        opt.step()
        ref_opt.zero_grad()
        ref_loss = ref.pipeline_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(float(ref_loss))
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    worst = max(float((p - ref_params[n]).abs().max()) for n, p in model.named_parameters())
    # evaluation: another batch size (6 samples, not a multiple of m=4: 3 micro-batches of 2), forward only
    x = torch.randint(0, 64, (6, 16), generator=g)
    y = torch.randint(0, 64, (6, 16), generator=g)
    loss, out = runner.eval_loss(x, y)
    with torch.no_grad():
        ref_out = ref(x)
        ref_eval = float(ref.pipeline_loss(ref_out, y))
    everywhere = runner.outputs_everywhere(out)
    print(f"[pp] rank {rank} p={world} {schedule} v={v} m={m}: max |w - w_ref| after {steps} AdamW steps = "
          f"{worst:.2e}")
    return {"losses": losses, "ref_losses": ref_losses, "worst": worst, "names": names, "kept": plan.kept,
            "eval": float(loss), "ref_eval": ref_eval, "out_diff": float((everywhere - ref_out).abs().max())}


def _world_p2(rank: int, world: int) -> dict[str, Any]:
    return {(s, v): _train(rank, world, s, v, 4, 4, STEPS)
            for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1))}


def _world_p4(rank: int, world: int) -> dict[str, Any]:
    return {(s, v): _train(rank, world, s, v, 4, 6, STEPS) for s, v in (("1f1b", 1), ("interleaved_1f1b", 2))}


def _check(results: list[dict[str, Any]], world: int) -> None:
    for key in results[0]:
        per_rank = [r[key] for r in results]
        for r in per_rank:
            # the step's mean loss reaches every pipeline rank, equal to one device's loss on the batch
            assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"], strict=True)) < 1e-5, key
            assert r["worst"] < 1e-5, (key, r["worst"])
            assert abs(r["eval"] - r["ref_eval"]) < 1e-5, key
            assert r["out_diff"] < 1e-5, key
        # the ranks hold disjoint layers that cover the model, under the whole model's parameter names
        kept = [name for r in per_rank for name in r["kept"]]
        assert sorted(kept) == sorted(["embed", "head", *(f"blocks.{i}" for i in range(len(kept) - 2))]), key
        whole = {n for n, _ in tiny_gpt(0, n_layer=len(kept) - 2).named_parameters()}
        names = [n for r in per_rank for n in r["names"]]
        assert sorted(names) == sorted(whole), key


def test_every_schedule_at_p2_equals_one_device() -> None:
    _check(run_distributed(_world_p2, 2, timeout_s=300), 2)


def test_1f1b_and_interleaved_at_p4_equal_one_device() -> None:
    _check(run_distributed(_world_p4, 4, timeout_s=300), 4)
