"""lp_zero_offload's configuration: DeepSpeed names, closed keys, base configs, conflicts, refusals -- all before any
process starts (no process group, no op build)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_parallel.config import LayoutError
from lightning_parallel.parallel.offload import (
    OffloadConfigError,
    OffloadEngineConfig,
    OptimizerNotOffloadableError,
    check_batch_sizes,
    required_ops,
    to_host_optimizer,
)

deepspeed = pytest.importorskip("deepspeed", reason="lp_zero_offload needs DeepSpeed")

from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy  # noqa: E402


def test_unknown_keys_are_refused_with_the_nearest_name_and_path() -> None:
    with pytest.raises(OffloadConfigError, match=r"'zero_optimization.offload_optimizer.pin_memroy'.*"
                                                 r"Did you mean 'zero_optimization.offload_optimizer.pin_memory'"):
        OffloadEngineConfig.from_dict({"zero_optimization": {"offload_optimizer": {"pin_memroy": True}}})
    with pytest.raises(OffloadConfigError, match=r"Did you mean 'zero_optimization.overlap_comm'"):
        OffloadEngineConfig.from_dict({"zero_optimization": {"overlap_com": True}})
    with pytest.raises(OffloadConfigError, match=r"offload_optimizer.device='disk' is not one of"):
        OffloadEngineConfig.from_dict({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})
    with pytest.raises(OffloadConfigError, match="reduce_bucket_size=0 must be >= 1"):
        OffloadEngineConfig.from_dict({"zero_optimization": {"reduce_bucket_size": 0}})
    with pytest.raises(OffloadConfigError, match="must be bool"):
        OffloadEngineConfig.from_dict({"zero_optimization": {"overlap_comm": "yes"}})


def test_typed_keys_override_a_whole_deepspeed_config_and_keep_its_other_keys(tmp_path: Path) -> None:
    base = {"zero_optimization": {"stage": 3, "overlap_comm": False, "sub_group_size": 1000},
            "wall_clock_breakdown": True}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(base))
    typed = OffloadEngineConfig.from_dict({"zero_optimization": {"overlap_comm": True}})
    assert typed.explicit == {"zero_optimization.overlap_comm"}
    cfg = typed.to_deepspeed(base)
    assert cfg["zero_optimization"]["overlap_comm"] is True  # explicit typed key wins
    assert cfg["zero_optimization"]["sub_group_size"] == 1000  # the base beats typed defaults
    assert cfg["wall_clock_breakdown"] is True  # keys this library does not type pass through
    strategy = LPZeroOffloadStrategy(parallel={"zero_stage": 3, "offload": "cpu"}, config=str(path),
                                     zero_optimization={"overlap_comm": True})
    zero = strategy.config["zero_optimization"]
    assert (zero["stage"], zero["offload_optimizer"]["device"], zero["offload_param"]["device"]) == (3, "cpu", "cpu")
    assert zero["overlap_comm"] is True and zero["sub_group_size"] == 1000


def test_batch_size_conflicts_are_reported_not_rewritten() -> None:
    check_batch_sizes({"train_batch_size": 32}, micro_batch=16, accumulation=1, world_size=2)  # consistent
    with pytest.raises(OffloadConfigError, match=r"train_batch_size=64, but micro batch 16 x accumulation 1 x world "
                                                 r"size 2 = 32"):
        check_batch_sizes({"train_batch_size": 64}, micro_batch=16, accumulation=1, world_size=2)
    with pytest.raises(OffloadConfigError, match="gradient_accumulation_steps=4, but the Trainer accumulates"):
        check_batch_sizes({"gradient_accumulation_steps": 4}, micro_batch=16, accumulation=1, world_size=2)
    with pytest.raises(OffloadConfigError, match="train_micro_batch_size_per_gpu=8, but the DataLoader yields"):
        check_batch_sizes({"train_micro_batch_size_per_gpu": 8}, micro_batch=16, accumulation=1, world_size=2)


def test_the_layout_is_the_source_of_truth_and_conflicts_are_refused() -> None:
    assert LPZeroOffloadStrategy(zero_stage=3, offload="cpu").layout.describe().endswith("zero=3 offload=cpu")
    assert LPZeroOffloadStrategy().layout.zero_stage == 2  # lp_zero_offload's default: stage 2 + CPU
    with pytest.raises(LayoutError, match=r"parallel.zero_stage=3 but the strategy preset says zero_stage=2"):
        LPZeroOffloadStrategy(parallel={"zero_stage": 3, "offload": "cpu"}, zero_stage=2, offload="cpu")
    with pytest.raises(OffloadConfigError, match=r"the DeepSpeed config sets zero_optimization.stage=3, but the "
                                                 "layout says zero_stage=2"):
        LPZeroOffloadStrategy(parallel={"zero_stage": 2, "offload": "cpu"}, config={"zero_optimization": {"stage": 3}})
    with pytest.raises(OffloadConfigError, match=r"offload_optimizer.device='none', but the layout says offload='cpu'"):
        LPZeroOffloadStrategy(zero_optimization={"offload_optimizer": {"device": "none"}})
    with pytest.raises(LayoutError, match="offload='nvme' needs zero_stage=3"):
        LPZeroOffloadStrategy(parallel={"zero_stage": 2, "offload": "nvme", "nvme_path": "/tmp/x"})
    with pytest.raises(LayoutError, match=r"needs parallel.nvme_path"):
        LPZeroOffloadStrategy(zero_stage=3, offload="nvme")
    with pytest.raises(LayoutError, match="data parallel only"):
        LPZeroOffloadStrategy(parallel={"zero_stage": 2, "offload": "cpu", "tensor_parallel_size": 2})


def test_registered_presets_and_the_cli_hands_them_the_layout() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_parallel.cli import resolve_strategy
    from lightning_parallel.config import ParallelConfig

    assert StrategyRegistry["lp_zero3_offload"]["init_params"] == {"zero_stage": 3, "offload": "cpu"}
    for name, stage, offload in (("lp_zero_offload", 2, "cpu"), ("lp_zero3_offload", 3, "cpu")):
        resolved = resolve_strategy(name, ParallelConfig())
        assert (resolved.layout.zero_stage, resolved.layout.offload) == (stage, offload)
    generic = resolve_strategy("lp_zero_offload", ParallelConfig(zero_stage=3, offload="cpu"))
    assert generic.layout.zero_stage == 3  # lp_zero_offload takes stage and offload from the layout
    nvme = resolve_strategy("lp_zero3_offload_nvme", ParallelConfig(zero_stage=3, offload="nvme", nvme_path="/tmp/s"))
    assert nvme.config["zero_optimization"]["offload_param"] == {**nvme.config["zero_optimization"]["offload_param"],
                                                                 "device": "nvme", "nvme_path": "/tmp/s"}
    instance = LPZeroOffloadStrategy()  # a class-path strategy without init args takes the `parallel` section
    assert resolve_strategy(instance, ParallelConfig(zero_stage=3, offload="cpu")).layout.zero_stage == 3
    given = LPZeroOffloadStrategy(parallel={"zero_stage": 2, "offload": "cpu"})
    with pytest.raises(LayoutError, match="the layout is given twice and the two differ"):
        resolve_strategy(given, ParallelConfig(zero_stage=3, offload="cpu"))


def test_optimizers_that_cannot_be_offloaded_are_refused_with_the_fix() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(OptimizerNotOffloadableError, match=r"SGD, which cannot be offloaded.*Adam/AdamW"):
        to_host_optimizer(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(OptimizerNotOffloadableError, match=r"amsgrad=True\) has no DeepSpeedCPUAdam"):
        to_host_optimizer(torch.optim.Adam(params, amsgrad=True))


def test_required_ops_per_target() -> None:
    assert required_ops(accelerator="cpu", offload_optimizer="cpu", offload_param="none") == [
        "deepspeed_shm_comm", "cpu_adam"]
    assert required_ops(accelerator="cuda", offload_optimizer="nvme", offload_param="nvme") == [
        "cpu_adam", "pin_memory", "async_io"]
