"""Rates and calibration without measuring: profiles, the alpha-beta model, the fit, the cache, the opt-out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_parallel.planner.calibrate import (
    cache_path,
    cached_rates,
    calibration_mode,
    fit_alpha_beta,
    format_rates,
    rates_for,
)
from lightning_parallel.planner.hardware import load_profile, make_hardware
from lightning_parallel.planner.rates import (
    COLLECTIVES,
    Rates,
    default_rates,
    rates_from_dict,
)


def test_profiles_carry_vendor_rates() -> None:
    """H100, H200 and A100 profiles: 989 / 989 / 312 TFLOP/s bf16 peak; every collective on both links."""
    for name, peak in (("dgx-h100", 989e12), ("dgx-h200", 989e12), ("dgx-a100-80gb", 312e12)):
        rates = rates_for(load_profile(name))
        assert rates.peak("bf16") == peak
        assert rates.matmul_rate("bf16") < peak
        assert set(rates.links) == {"intra_node", "inter_node"}
        for link in rates.links.values():
            assert set(link.collectives) == set(COLLECTIVES)
        assert rates.links["intra_node"].bandwidth() > rates.links["inter_node"].bandwidth()
    assert load_profile("dgx-h200").gpu_memory == 141 * 10**9


def test_alpha_beta_time_uses_bus_factors() -> None:
    rates = rates_from_dict({
        "matmul_tflops": {"fp32": 1.0}, "memory_bandwidth_gbs": 10,
        "links": {"intra_node": {c: {"alpha_us": 10, "beta_gbs": 1} for c in COLLECTIVES}}})
    link = rates.links["intra_node"]
    assert link.time("all_reduce", 1e9, 4) == pytest.approx(10e-6 + 2 * 3 / 4)
    assert link.time("reduce_scatter", 1e9, 4) == pytest.approx(10e-6 + 3 / 4)
    assert link.time("p2p", 1e9, 2) == pytest.approx(10e-6 + 1)
    assert link.time("all_reduce", 1e9, 1) == 0.0
    assert rates.links["inter_node"] is link  # one link given: both kinds


def test_matmul_rate_interpolates_measured_edges() -> None:
    rates = rates_from_dict({
        "matmul_tflops": {"fp32": 4.0}, "matmul_tflops_by_shape": {"fp32": {"256": 1.0, "1024": 4.0}},
        "memory_bandwidth_gbs": 10, "links": {"intra_node": {c: {"alpha_us": 1, "beta_gbs": 1} for c in COLLECTIVES}}})
    assert rates.matmul_rate("fp32", m=256, n=256, k=256) == pytest.approx(1e12)
    assert rates.matmul_rate("fp32", m=512, n=512, k=512) == pytest.approx(2e12)  # halfway in log space
    assert rates.matmul_rate("fp32", m=8192, n=8192, k=8192) == pytest.approx(4e12)  # clamped
    assert rates.matmul_rate("fp32", m=16, n=16, k=16) == pytest.approx(1e12)


def test_rates_round_trip_and_bad_keys() -> None:
    rates = rates_for(load_profile("dgx-a100-80gb"))
    again = rates_from_dict(rates.to_dict())
    assert again.matmul_flops == rates.matmul_flops and again.memory_bandwidth == rates.memory_bandwidth
    for kind, link in rates.links.items():
        for name, rate in link.collectives.items():
            assert again.links[kind].collectives[name].alpha == pytest.approx(rate.alpha)
            assert again.links[kind].collectives[name].beta == pytest.approx(rate.beta)
    optimizer = rates_from_dict({**rates.to_dict(), "optimizer_gbs": 8, "optimizer_tensor_us": 20,
                                 "optimizer_dtensor_us": 90})
    assert (optimizer.optimizer_rate, optimizer.optimizer_tensor_s, optimizer.optimizer_dtensor_s) == pytest.approx(
        (8e9, 20e-6, 90e-6))
    again = rates_from_dict({**optimizer.to_dict(), "busy": {"fsdp_unit": 0.5, "collectives": 0.75}})
    assert (again.optimizer_rate, again.optimizer_tensor_s, again.optimizer_dtensor_s) == pytest.approx(
        (8e9, 20e-6, 90e-6))
    assert rates_from_dict(again.to_dict()).busy == {"fsdp_unit": 0.5, "collectives": 0.75}
    assert again.busy_share("fsdp_unit") == 0.5 and again.busy_share("tp_pair") == 1.0  # not measured: all CPU
    with pytest.raises(ValueError, match="busy"):
        rates_from_dict({**rates.to_dict(), "busy": {"tp_pair": 1.5}})
    assert rates.optimizer_rate == rates.memory_bandwidth  # not calibrated: the memory bandwidth
    units = rates_from_dict({**rates.to_dict(), "fsdp_unit_ms": 3.5, "tp_pair_ms": 1.25})
    assert (units.fsdp_unit_s, units.tp_pair_s) == pytest.approx((3.5e-3, 1.25e-3))
    assert (rates_from_dict(units.to_dict()).fsdp_unit_s, rates_from_dict(units.to_dict()).tp_pair_s) == (
        units.fsdp_unit_s, units.tp_pair_s)
    engines = rates_from_dict({**rates.to_dict(), "offload_step_ms": 3.0, "offload_tensor_ms": 0.1,
                               "offload_param_ns": 14.0, "cp_element_ns": 60.0, "host_optimizer_params_per_s": 1e9})
    assert (engines.offload_step_s, engines.offload_tensor_s, engines.offload_param_s, engines.cp_element_s,
            engines.host_optimizer_params_per_s) == pytest.approx((3e-3, 1e-4, 14e-9, 60e-9, 1e9))
    back = rates_from_dict(engines.to_dict())
    assert (back.offload_step_s, back.offload_tensor_s, back.offload_param_s, back.cp_element_s) == pytest.approx(
        (3e-3, 1e-4, 14e-9, 60e-9))
    with pytest.raises(ValueError, match="unknown keys"):
        rates_from_dict({**rates.to_dict(), "matmul_tflop": {}})
    with pytest.raises(ValueError, match="collectives"):
        rates_from_dict({"matmul_tflops": {"bf16": 1}, "memory_bandwidth_gbs": 1,
                         "links": {"intra_node": {"all_reduce": {"alpha_us": 1, "beta_gbs": 1}}}})


def test_fit_alpha_beta_recovers_the_line() -> None:
    alpha, beta = 25e-6, 3e9
    points = [(x, alpha + x / beta) for x in (4e3, 6.4e4, 1e6, 1.6e7)]
    got = fit_alpha_beta(points)
    assert got[0] == pytest.approx(alpha, rel=1e-6) and got[1] == pytest.approx(beta, rel=1e-6)
    assert fit_alpha_beta([(1e3, 1e-3), (1e6, 1e-3)])[1] > 0  # flat: latency-bound, still a positive bandwidth


def test_tests_never_calibrate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """conftest sets LIGHTNING_PARALLEL_CALIBRATION=none: a detected machine gets default rates, no cache read."""
    assert calibration_mode() == "none"
    detected = make_hardware(gpus_per_node=2, gpu_memory="4GB", accelerator="cpu", name="detected")
    assert rates_for(detected).source.startswith("defaults")
    monkeypatch.setenv("LIGHTNING_PARALLEL_CALIBRATION", "sometimes")
    with pytest.raises(ValueError, match="cached, now or none"):
        calibration_mode()


def test_cache_is_read_for_a_detected_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LIGHTNING_PARALLEL_CACHE", str(tmp_path))
    hardware = make_hardware(gpus_per_node=2, gpu_memory="4GB", accelerator="cpu", name="detected")
    fake = default_rates(hardware).to_dict() | {"source": "calibrated fake"}
    path = cache_path(2)
    assert path.parent == tmp_path
    path.write_text(json.dumps({"rates": fake}))
    assert cached_rates(2) is not None and cached_rates().source == "calibrated fake"  # type: ignore[union-attr]
    monkeypatch.setenv("LIGHTNING_PARALLEL_CALIBRATION", "cached")
    assert rates_for(hardware).source == "calibrated fake"
    custom = make_hardware(gpus_per_node=2, gpu_memory="4GB", accelerator="cpu")  # not this machine: defaults
    assert rates_for(custom).source.startswith("defaults")
    assert "intra_node" in format_rates(rates_for(hardware))


def test_default_rates_follow_the_profile() -> None:
    hw = make_hardware(gpus_per_node=8, gpu_memory="80GiB", peak_tflops=100, intra_node="pcie")
    rates = default_rates(hw)
    assert isinstance(rates, Rates)
    assert rates.peak("bf16") == 100e12 and rates.peak("fp32") == 25e12
    assert rates.links["intra_node"].bandwidth() == 12e9


def test_calibrate_one_rank_measures_and_caches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One rank: matmuls by edge and dtype, the copy bandwidth and Lightning's step overhead are measured (a few
    seconds), no collective; the result is cached under this machine's key and read back."""
    from lightning_parallel.planner.calibrate import calibrate

    monkeypatch.setenv("LIGHTNING_PARALLEL_CACHE", str(tmp_path))
    lines: list[str] = []
    rates = calibrate(ranks=1, progress=lines.append, repeats=2)
    assert "measurement 2 of 2 done" in " ".join(lines)
    assert any(line.startswith("matmul fp32 1024x1024x1024") for line in lines)
    assert any("host overhead per step" in line for line in lines) and any("cached in" in line for line in lines)
    assert rates.source.startswith("calibrated") and rates.overlap == 0.0
    assert rates.peak("fp32") == max(rates.matmul_by_shape["fp32"].values()) > 0
    assert 0 < rates.host_overhead_s < 1 and rates.memory_bandwidth > 1e8
    assert 0 < rates.optimizer_tensor_s < 1e-2 and rates.optimizer_rate > 1e8 and rates.optimizer_dtensor_s == 0
    assert any(line.startswith("optimizer step (AdamW):") for line in lines)
    assert cached_rates(1) is not None and cached_rates(1).source == rates.source  # type: ignore[union-attr]


def test_collectives_are_timed_inside_a_process_group(tmp_path: Path) -> None:
    """A one-rank gloo group in this process: every size of every collective (no point-to-point) gets a time, and
    the FSDP2 unit and the tensor-parallel pair each get a cost per step."""
    import torch
    import torch.distributed as dist

    from lightning_parallel.planner.calibrate import CALIBRATION_SIZES, measure_collectives, measure_frameworks

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        got = measure_collectives(1, torch.device("cpu"))
        units = measure_frameworks(1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    # no pipeline, no ring of one rank; each unit's wall and CPU time (the CPU share of it)
    assert set(units) == {"fsdp_unit", "tp_pair", "fsdp_unit_cpu", "tp_pair_cpu", "optimizer_dtensor"}
    assert all(0 <= s < 1 for s in units.values()) and units["optimizer_dtensor"] > 0
    assert units["fsdp_unit_cpu"] <= units["fsdp_unit"] and units["tp_pair_cpu"] <= units["tp_pair"]
    assert set(got) == {"all_reduce", "reduce_scatter", "all_gather", "p2p"} and got["p2p"] == []
    assert all(len(points) == len(CALIBRATION_SIZES) and all(t > 0 for _, t in points)
               for name, points in got.items() if name != "p2p")


def test_a_failing_calibration_rank_is_reported_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 fails in its compute measurement: the parent raises its traceback and stops rank 0, which would
    otherwise wait at the next barrier for the collective timeout (forked ranks inherit the patch)."""
    import importlib

    import torch.distributed as dist

    from lightning_parallel.testing import DistributedTestError

    cal = importlib.import_module("lightning_parallel.planner.calibrate")  # the package exports a function of the name

    real = cal.measure_compute

    def measure(device: object, **kwargs: object) -> object:
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 lost its device")
        return real(device, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cal, "measure_compute", measure)
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 of 2 failed:.*rank 1 lost its device"):
        cal._run_world(2, "cpu", None)


def test_cpu_ranks_beyond_the_cores_share_them_and_rings_add_latency() -> None:
    """A calibration of 2 ranks on 2 cores: 4 ranks compute at half the rate, 8 at a quarter; a ring's latency grows
    with its ``ranks - 1`` steps; a profile (no calibration) scales nothing. Both survive the JSON round trip."""
    links = {"intra_node": {c: {"alpha_us": 100, "beta_gbs": 1} for c in COLLECTIVES}}
    cpu = rates_from_dict({"matmul_tflops": {"fp32": 0.1}, "memory_bandwidth_gbs": 10, "links": links,
                           "cores": 2, "calibrated_ranks": 2})
    assert [cpu.core_share(n) for n in (1, 2, 4, 8)] == [1.0, 1.0, 2.0, 4.0]
    assert cpu.ring_latency_scale("all_reduce", 4) == 3.0 and cpu.ring_latency_scale("p2p", 8) == 1.0
    assert rates_from_dict(cpu.to_dict()).core_share(8) == 4.0
    wide = rates_from_dict({**cpu.to_dict(), "calibrated_ranks": 4})  # calibrated already sharing 2 cores by 4
    assert wide.core_share(8) == 2.0 and wide.core_share(2) == 0.5
    profile = rates_for(load_profile("dgx-h100"))
    assert profile.core_share(8) == 1.0 and profile.ring_latency_scale("all_reduce", 8) == 1.0


def test_a_calibration_keeps_the_median_of_its_measurements() -> None:
    """Each figure of several whole measurements, nested dicts and ``(bytes, seconds)`` points alike, is their
    median; what is not a number is the first measurement's."""
    from lightning_parallel.planner.calibrate import _median_tree

    runs = [{"matmul": {"fp32": {"128": 1.0}}, "points": [(4.0, 0.3), (8.0, 0.5)], "n": 1, "tag": "a"},
            {"matmul": {"fp32": {"128": 9.0}}, "points": [(4.0, 0.1), (8.0, 0.7)], "n": 5, "tag": "b"},
            {"matmul": {"fp32": {"128": 2.0}}, "points": [(4.0, 0.2), (8.0, 0.6)], "n": 3, "tag": "c"}]
    from lightning_parallel.planner.calibrate import median_rates

    profile = rates_for(load_profile("dgx-a100-80gb"))
    fast, slow = (rates_from_dict({**profile.to_dict(), "fsdp_unit_ms": ms}) for ms in (1.0, 5.0))
    assert median_rates([fast, slow, fast]).fsdp_unit_s == pytest.approx(1e-3)
    assert _median_tree(runs) == {"matmul": {"fp32": {"128": 2.0}}, "points": [(4.0, 0.2), (8.0, 0.6)], "n": 3,
                                  "tag": "a"}


def test_the_attention_core_is_fitted_a_cost_per_call_and_a_rate() -> None:
    """Two timed attentions (a short and a long sequence) made from a known cost per call and efficiency give them
    back against the GEMM rate the step-time model reads at the attention's shape; a kernel faster than the GEMMs
    is capped at efficiency 1. The step-time model then charges the call once per layer and micro-batch."""
    from lightning_parallel.planner.calibrate import ATTENTION_SHAPES, _attention_flops, attention_fit

    rates = rates_from_dict({"matmul_tflops": {"fp32": 0.1}, "memory_bandwidth_gbs": 10,
                             "matmul_tflops_by_shape": {"fp32": {"128": 0.05, "512": 0.1}},
                             "links": {"intra_node": {c: {"alpha_us": 10, "beta_gbs": 1} for c in COLLECTIVES}}})
    shapes = ATTENTION_SHAPES["cpu"]

    def seconds(shape: tuple[int, int, int, int], efficiency: float, call: float) -> float:
        seq, d = shape[2], shape[3]
        return call + _attention_flops(shape) / (efficiency * rates.matmul_rate("fp32", m=seq, n=seq, k=d))

    points = [(shape[2], seconds(shape, 0.4, 2e-4)) for shape in shapes]
    assert attention_fit(points, rates, "cpu") == pytest.approx((0.4, 2e-4))
    fast = [(shape[2], seconds(shape, 3.0, 0.0)) for shape in shapes]
    assert attention_fit(fast, rates, "cpu")[0] == 1.0
    back = rates_from_dict({**rates.to_dict(), "attention_efficiency": 0.4, "attention_call_us": 200})
    assert rates_from_dict(back.to_dict()).attention_call_s == pytest.approx(2e-4)


def test_a_difference_of_timings_that_comes_out_nonpositive_is_measured_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A figure measured as a difference of two timings (a slope, the offload engine's costs, the ring's cost per
    element) is measured again while any of it comes out <= 0 (a stall in the smaller run), at most
    ``SLOPE_ATTEMPTS`` times in all; the last measurement is kept. The host overhead of an accumulating step: when
    four batches a step measure no dearer than one, both fits are made again, so its share per batch is not left 0."""
    import importlib

    import torch

    cal = importlib.import_module("lightning_parallel.planner.calibrate")  # the package exports a function so named
    cpu = torch.device("cpu")
    made = iter([{"a": 1.0, "b": -2.0}, {"a": 0.0, "b": 3.0}, {"a": 2.0, "b": 1.0}, {"a": 9.0, "b": 9.0}])
    assert cal._until_positive(lambda: next(made), cpu) == {"a": 2.0, "b": 1.0}
    assert next(made) == {"a": 9.0, "b": 9.0}  # three measurements, not four
    calls: list[int] = []

    def never() -> dict[str, float]:
        calls.append(1)
        return {"a": -1.0}

    assert cal._until_positive(never, cpu) == {"a": -1.0} and len(calls) == cal.SLOPE_ATTEMPTS

    fits: list[tuple[int, int]] = []
    seconds = iter([0.010, 0.008, 0.006, 0.012])  # one batch, four (stalled one), then both again

    def fit(*, steps: int = 40, ranks: int = 1, accumulate: int = 1) -> float:
        fits.append((ranks, accumulate))
        return next(seconds)

    monkeypatch.setattr(cal, "measure_host_overhead", fit)
    monkeypatch.setattr(cal, "measure_compute", lambda *args, **kwargs: {})  # not measured here
    _, _, frameworks, overhead = cal._measure_once(1, "cpu", None)
    assert fits == [(1, 1), (1, 4), (1, 1), (1, 4)]
    assert overhead == 0.006 and frameworks["host_batch_share"] == pytest.approx((0.012 - 0.006) / 3 / 0.006)
