"""``calibrate(ranks=2)`` end to end: two forked gloo ranks measure compute, the optimizer step, the collectives and
the cost of an FSDP2 unit, of a tensor-parallel pair, of a pipeline micro-batch and of a layer's ring attention (each
with its share of CPU time; the ring's cost per element at a step's size; DeepSpeed's offload engine where its ops are
built), then ``lp_ddp`` forks two ranks for the distributed step overhead."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_parallel.planner.calibrate import cached_rates, calibrate, offload_calibration_ops
from lightning_parallel.planner.rates import Rates


def test_two_rank_calibration_measures_units_and_the_distributed_overhead(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    monkeypatch.setenv("LIGHTNING_PARALLEL_CACHE", str(tmp_path))
    lines: list[str] = []
    rates = calibrate(ranks=2, progress=lines.append, repeats=1)  # one measurement: the median is unit-tested
    said = "\n".join(lines)
    for line in ("all_reduce over 2 ranks", "an FSDP2 unit over 2 ranks", "a tensor-parallel pair of linears over 2",
                 "a pipeline micro-batch over 2 ranks", "a layer's ring attention over 2 ranks",
                 "host overhead per step over 2 ranks (lp_ddp"):
        assert line in said, said
    assert rates.calibrated_ranks == 2 and rates.cores >= 1
    assert 0 < rates.fsdp_unit_s < 1 and 0 < rates.tp_pair_s < 1 and 0 < rates.pp_micro_batch_s < 1
    assert 0 < rates.cp_layer_s < 1
    # the optimizer step per tensor (a DTensor one costs more: DTensor's dispatch) and each cost's share on the CPU
    assert 0 < rates.optimizer_tensor_s < rates.optimizer_dtensor_s < 1e-2 and rates.optimizer_rate > 1e8
    assert rates.cp_element_s > 0  # the ring at a step's size costs more than the tiny one's
    units = {"fsdp_unit", "tp_pair", "pp_micro_batch", "cp_layer", "collectives"}
    if offload_calibration_ops("cpu") == []:  # DeepSpeed and its ops built (the test set-up builds them)
        assert "ZeRO-offload engine (DeepSpeed ZeRO-2, optimizer on the host) over 2 ranks" in said, said
        assert 0 < rates.offload_step_s < 1 and 0 < rates.offload_tensor_s < 0.1 and 0 < rates.offload_param_s < 1e-6
        assert rates.host_optimizer_params_per_s != Rates.host_optimizer_params_per_s  # measured, not the default
        units |= {"offload_step", "offload_tensor"}
    else:
        assert "offload engine: " in said and rates.offload_step_s == 0
    assert set(rates.busy) == units
    assert all(0 <= share <= 1 for share in rates.busy.values())
    assert 0 < rates.host_overhead_s < rates.distributed_overhead_s < 1  # a distributed step has collectives too
    assert rates.host_overhead(1) == rates.host_overhead_s and rates.host_overhead(4) == rates.distributed_overhead_s
    # the share of it that recurs with every batch of an accumulating step: measured, a share
    assert "host overhead that recurs with every batch of an accumulating step" in said, said
    assert 0 < rates.host_batch_share <= 1  # 0 would say four batches cost no more than one
    again = cached_rates(2)
    assert again is not None and again.fsdp_unit_s == pytest.approx(rates.fsdp_unit_s)
    assert again.host_batch_share == pytest.approx(rates.host_batch_share)
