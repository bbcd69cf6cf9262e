"""RunSummary's MFU: model FLOPs of the samples trained over the window's time and the calibrated peak."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_parallel.callbacks.summary import RunSummary, calibrated_peak, model_flops_per_sample
from lightning_parallel.models import GPT
from lightning_parallel.planner.calibrate import cache_path
from lightning_parallel.planner.flops import model_flops_per_token
from lightning_parallel.planner.hardware import make_hardware
from lightning_parallel.planner.model import ModelShape
from lightning_parallel.planner.rates import default_rates


def _gpt() -> GPT:
    with torch.device("meta"):
        return GPT(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=256)


def test_model_flops_per_sample_of_a_gpt_and_of_any_module() -> None:
    shape = ModelShape(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=32)
    assert model_flops_per_sample(_gpt(), 32) == pytest.approx(model_flops_per_token(shape, seq=32) * 32)
    with torch.device("meta"):
        plain = torch.nn.Linear(10, 10)
    assert model_flops_per_sample(plain, 0) == 6.0 * 110


def _trainer(world: int = 2, replicas: int = 2) -> Any:
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": replicas, "rank": 0})
    return SimpleNamespace(strategy=strategy, world_size=world, precision="32-true")


def test_mfu_against_the_cached_peak(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    summary = RunSummary()
    module = _gpt()
    batch = (torch.zeros(8, 32, dtype=torch.long), torch.zeros(8, 32, dtype=torch.long))
    for _ in range(5):  # two warm-up batches, then three counted
        summary.on_train_batch_start(None, module, batch, 0)  # type: ignore[arg-type]
        summary.on_train_batch_end(None, module, None, batch, 0)  # type: ignore[arg-type]
    assert summary._samples == 24
    summary._train_s = 1.0  # a known window
    achieved = model_flops_per_sample(module, 32) * 24 * 2 / 2  # two dp replicas, two devices
    assert summary.throughput_text(_trainer()) == f"step 333.3 ms, {24 * 2 * 32:,} tokens/s"  # 3 batches in 1 s
    text = summary.mfu_text(_trainer(), module)
    assert "no calibration of this machine" in text  # conftest: LIGHTNING_PARALLEL_CALIBRATION=none
    monkeypatch.setenv("LIGHTNING_PARALLEL_CALIBRATION", "cached")
    monkeypatch.setenv("LIGHTNING_PARALLEL_CACHE", str(tmp_path))
    rates = default_rates(make_hardware(gpus_per_node=2, gpu_memory="4GB", accelerator="cpu", peak_tflops=0.4))
    cache_path(2).write_text(json.dumps({"rates": rates.to_dict() | {"source": "calibrated test"}}))
    peak = calibrated_peak("32-true")
    assert peak is not None and peak[0] == pytest.approx(0.1e12)
    assert summary.mfu_text(_trainer(), module) == (
        f"MFU {achieved / 0.1e12:.1%} of the calibrated peak 0.1 TFLOP/s (calibrated test)")
