"""``lightning_parallel.grad_norm`` gives one device's gradient norms under every layout, where Lightning's
``grad_norm`` reads each rank's ``.grad`` (partial under ZeRO-1 and pipelines, ``None`` under ZeRO-2, DTensor shards
under ZeRO-3 and tensor parallelism)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

import lightning_parallel
from lightning_parallel.models import GPT
from lightning_parallel.strategies import LPDDPStrategy, LPPipelineStrategy, LPShardedStrategy, LPTensorStrategy
from tests.trainer.token_data import T, fit


class _LoggingGPT(GPT):
    """Writes, per rank, the norms of each optimizer step (2-norm and inf-norm) to ``<out>/rank<r>.json``."""

    def __init__(self, out: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out = out
        self.seen: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        two = lightning_parallel.grad_norm(self, norm_type=2)
        inf = lightning_parallel.grad_norm(self, norm_type="inf")
        self.seen.append({k: float(v) for k, v in {**two, **inf}.items()})
        if self.trainer.world_size == 1:  # on one device, Lightning's own function gives the same values
            theirs = lightning_grad_norm(self, norm_type=2)
            assert set(theirs) == set(two)
            for key, value in theirs.items():
                assert float(value) == pytest.approx(float(two[key]), rel=1e-6), key

    def on_train_end(self) -> None:
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as f:
            json.dump(self.seen, f)


def _gpt(out: Path) -> _LoggingGPT:
    torch.manual_seed(0)
    return _LoggingGPT(str(out), n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=2,
                       bias=False)


LAYOUTS: list[tuple[str, Any, int, int]] = [
    ("lp_ddp", lambda: LPDDPStrategy(start_method="fork"), 2, 2),
    ("zero1", lambda: LPShardedStrategy({"zero_stage": 1}, start_method="fork"), 2, 2),
    ("zero2", lambda: LPShardedStrategy({"zero_stage": 2}, start_method="fork"), 2, 2),
    ("zero3", lambda: LPShardedStrategy({"zero_stage": 3}, start_method="fork"), 2, 2),
    ("tp2", lambda: LPTensorStrategy({"tensor_parallel_size": 2}, start_method="fork"), 2, 1),
    ("dp2 x tp2 zero1", lambda: LPTensorStrategy({"tensor_parallel_size": 2, "zero_stage": 1}, start_method="fork"),
     4, 2),
    ("pp2", lambda: LPPipelineStrategy({"pipeline_parallel_size": 2}, start_method="fork"), 2, 1),
]


def test_gradient_norms_equal_one_device_under_every_layout(tmp_path: Path) -> None:
    """4 AdamW steps of 2 accumulated batches each; every rank's logged 2-norms and inf-norms (each parameter's and
    the total) against one device's, which equal Lightning's ``grad_norm`` there."""
    (tmp_path / "one").mkdir()
    fit("auto", 1, 1, model=_gpt(tmp_path / "one"), steps=4)
    reference = json.loads((tmp_path / "one" / "rank0.json").read_text())
    assert len(reference) == 4 and len(reference[0]) == 2 * (len(list(_gpt(tmp_path).parameters())) + 1)
    worst: dict[str, float] = {}
    for name, make, devices, dp in LAYOUTS:
        out = tmp_path / name.replace(" ", "_")
        out.mkdir()
        fit(make(), devices, dp, model=_gpt(out), steps=4)
        for rank in range(devices):
            steps = json.loads((out / f"rank{rank}.json").read_text())
            assert len(steps) == 4 and all(set(s) == set(r) for s, r in zip(steps, reference, strict=True)), name
            worst[name] = max(worst.get(name, 0.0), max(abs(s[k] - r[k]) / max(abs(r[k]), 1e-12)
                                                         for s, r in zip(steps, reference, strict=True) for k in r))
    print("\nlargest relative difference from one device's gradient norms:",
          ", ".join(f"{name} {value:.1e}" for name, value in worst.items()))
    assert all(value < 1e-4 for value in worst.values()), worst
