"""The step-time model: layer work from shapes, the pipeline bubble by schedule, overlap of each axis's collectives,
and the published configurations it must reproduce (docs/formulas.md, "Published throughput")."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_parallel.config import ParallelConfig
from lightning_parallel.planner.calibrate import rates_for
from lightning_parallel.planner.cost import StepCost, bubble_factor, estimate_step
from lightning_parallel.planner.flops import KERNELS, layer_work, model_flops_per_token
from lightning_parallel.planner.hardware import load_profile
from lightning_parallel.planner.model import MODEL_PRESETS, ModelShape, ModelSpec
from lightning_parallel.planner.published import PUBLISHED, format_table, predict_all
from lightning_parallel.planner.settings import TrainingSettings


def test_layer_gemms_are_megatrons_24_h_squared_per_token() -> None:
    """GPT-2 shape: the four GEMMs of a layer are 2 x 12 h^2 FLOPs per token (on tp ranks: / t); attention 4 s h."""
    shape = MODEL_PRESETS["gpt3-1.3b"]
    h, s = shape.n_embd, 2048
    work = layer_work(shape, batch=2, seq=s)
    assert work.gemm_flops == 2 * 2 * s * 12 * h * h
    assert work.attention_flops == 4 * 2 * s * s * h
    assert layer_work(shape, batch=2, seq=s, tp=4).gemm_flops == work.gemm_flops / 4
    per_token = model_flops_per_token(shape, seq=s)
    assert per_token == pytest.approx(3 * (shape.n_layer * (24 * h * h + 4 * s * h) + 2 * h * shape.vocab_size))


def test_llama_shape_counts_8b_parameters() -> None:
    """Grouped-query attention, a SwiGLU MLP of 14336 and rotary positions: Llama 3.1 8B's 8.03e9 parameters."""
    shape = ModelShape(n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, ffn_hidden=14336, vocab_size=128256,
                       bias=False, gated_mlp=True, learned_positions=False)
    assert shape.total_params() == 8_030_261_248
    assert shape.largest_layer_params() == 128256 * 4096


def test_bubble_by_schedule() -> None:
    base = ParallelConfig.from_dict({"pipeline_parallel_size": 4, "num_micro_batches": 8})
    assert bubble_factor(base, 8) == pytest.approx((8 + 3) / 8)
    inter = base.replace(pipeline_schedule="interleaved_1f1b", virtual_pipeline_stages=2)
    assert bubble_factor(inter, 8) == pytest.approx((8 + 1.5) / 8)
    assert bubble_factor(base.replace(pipeline_schedule="zero_bubble"), 8) == pytest.approx((8 + 1) / 8)
    assert bubble_factor(ParallelConfig(), 1) == 1.0


def _cost(layout: dict[str, object], *, overlap: float = 1.0, nodes: int = 1):  # type: ignore[no-untyped-def]
    hardware = load_profile("dgx-a100-80gb", nodes=nodes)
    rates = replace(rates_for(hardware), overlap=overlap)
    training = TrainingSettings(micro_batch_size=4, seq_len=2048, activation_checkpointing="none")
    return estimate_step(ModelSpec.from_shape(MODEL_PRESETS["gpt3-1.3b"]), training, hardware,
                         ParallelConfig.from_dict({"activation_checkpointing": "none", **layout}), rates=rates)


def test_ddp_buckets_hide_under_backward_and_tp_does_not() -> None:
    hidden = _cost({"data_parallel_size": 8})
    waited = _cost({"data_parallel_size": 8}, overlap=0.0)
    assert hidden.exposed_s["dp"] < waited.exposed_s["dp"] == pytest.approx(waited.comm_s["dp"])
    assert hidden.exposed_s["dp"] > 0  # the last bucket is always waited for
    tp = _cost({"data_parallel_size": 4, "tensor_parallel_size": 2})
    assert tp.exposed_s["tp"] == pytest.approx(tp.comm_s["tp"])  # on the critical path
    zero1 = _cost({"data_parallel_size": 8, "zero_stage": 1})
    assert zero1.exposed_s["dp"] == pytest.approx(zero1.comm_s["dp"])  # flat shards after the backward


def test_step_parts_and_mfu() -> None:
    cost = _cost({"data_parallel_size": 8})
    assert cost.step_s == pytest.approx(cost.compute_s + sum(cost.exposed_s.values()) + cost.overhead_s)
    assert 0.3 < cost.mfu < 0.8
    slower = _cost({"data_parallel_size": 16}, nodes=2)  # dp across nodes: the slower link
    assert slower.comm_s["dp"] > cost.comm_s["dp"] and slower.links["dp"].startswith("inter-node")


def test_published_configurations_are_reproduced() -> None:
    """Megatron-LM's Table 1 rows within 20 %; torchtitan's Llama 3.1 8B rows are over-predicted by 22-26 % (their
    H100s ran at a 500 W power limit, which the profile does not model): held to the band they are in, so a change
    of the model that moves them shows."""
    predictions = predict_all()
    assert len(predictions) == len(PUBLISHED) >= 3
    for p in predictions:
        if p.row.source.startswith("Narayanan"):
            assert 0.8 <= p.ratio <= 1.2, (p.row.name, p.ratio)
        else:
            assert 1.0 <= p.ratio <= 1.3, (p.row.name, p.ratio)
    assert sum(0.8 <= p.ratio <= 1.2 for p in predictions) >= 3
    assert "| Megatron-LM GPT 145.6B |" in format_table(predictions)
    assert KERNELS["megatron-2021"].flash_attention is False


def test_cpu_ranks_beyond_the_cores_stretch_the_step() -> None:
    """On a CPU calibration of 2 ranks on 2 cores, a 4-rank layout's compute, collectives and overhead take twice
    what they take with the cores to themselves (the same layout on a calibration of 4 cores)."""
    from lightning_parallel.planner.hardware import make_hardware
    from lightning_parallel.planner.rates import COLLECTIVES, rates_from_dict

    def cost(cores: int) -> StepCost:
        rates = rates_from_dict({"matmul_tflops": {"fp32": 0.1}, "memory_bandwidth_gbs": 10, "op_overhead_us": 5,
                                 "links": {"intra_node": {c: {"alpha_us": 100, "beta_gbs": 1} for c in COLLECTIVES}},
                                 "cores": cores, "calibrated_ranks": 2, "overlap": 0.0})
        hardware = make_hardware(gpus_per_node=4, gpu_memory="1TB", rates=rates, name="cpu", accelerator="cpu")
        shape = ModelShape(n_layer=2, n_embd=128, n_head=4, vocab_size=256, block_size=64)
        training = TrainingSettings(precision="fp32", micro_batch_size=2, seq_len=64, activation_checkpointing="none")
        layout = ParallelConfig.from_dict({"data_parallel_size": 2, "tensor_parallel_size": 2})
        return estimate_step(ModelSpec.from_shape(shape), training, hardware, layout, rates=rates)

    shared, alone = cost(2), cost(4)
    assert shared.compute_s == pytest.approx(2 * alone.compute_s)
    assert shared.overhead_s == pytest.approx(2 * alone.overhead_s)
    for axis in ("dp", "tp"):
        assert shared.exposed_s[axis] == pytest.approx(2 * alone.exposed_s[axis])
    assert shared.step_s == pytest.approx(2 * alone.step_s)


def test_a_fixed_batch_per_replica_is_split_by_the_pipeline() -> None:
    """lp_auto's data module batch (16 per dp rank) is split into m micro-batches by a pipeline, as the run does: the
    largest divisor of 16 from the stage count to 4 x stages, micro-batches of 16 / m; without a pipeline, or when no
    divisor keeps every stage busy, the settings stay as given."""
    training = TrainingSettings(precision="fp32", micro_batch_size=16, batch_per_replica=16)
    assert training.micro_batches(2) == 8 and training.for_pipeline(2).micro_batch_size == 2
    assert training.for_pipeline(2).num_micro_batches == 8 and training.for_pipeline(1) is training
    assert TrainingSettings(micro_batch_size=6, batch_per_replica=6).micro_batches(2) == 6  # 8 does not divide 6
    odd = TrainingSettings(micro_batch_size=1, batch_per_replica=1)  # no split keeps 2 stages busy: as given
    assert odd.micro_batches(2) == 8 and odd.for_pipeline(2) is odd
    plain = TrainingSettings(micro_batch_size=16)  # the plan command's micro-batch: per micro-batch, 4 x stages
    assert plain.micro_batches(2) == 8 and plain.for_pipeline(2) is plain


def test_calibrated_fsdp_units_and_tp_pairs_replace_the_per_call_latency() -> None:
    """With a calibration's cost per FSDP2 unit, per tensor-parallel pair, per pipeline micro-batch and per layer of
    ring attention, a ZeRO-3 step counts one unit per block, the embedding, the head and the root, a tp step half a
    pair per DTensor linear (a pair is a column and a row linear), a pipeline one per
    micro-batch, context parallelism one per layer, in place of ``alpha`` per collective or transfer; the bytes
    still go at ``beta``."""
    from lightning_parallel.planner.hardware import make_hardware
    from lightning_parallel.planner.rates import COLLECTIVES, rates_from_dict

    def cost(layout: dict[str, object], **unit_ms: float) -> StepCost:
        rates = rates_from_dict({"matmul_tflops": {"fp32": 0.1}, "memory_bandwidth_gbs": 10,
                                 "links": {"intra_node": {c: {"alpha_us": 100, "beta_gbs": 1} for c in COLLECTIVES}},
                                 "cores": 2, "calibrated_ranks": 2, "overlap": 0.0, **unit_ms})
        hardware = make_hardware(gpus_per_node=2, gpu_memory="1TB", rates=rates, name="cpu", accelerator="cpu")
        shape = ModelShape(n_layer=3, n_embd=128, n_head=4, vocab_size=256, block_size=64)
        training = TrainingSettings(precision="fp32", micro_batch_size=2, seq_len=64, activation_checkpointing="none")
        return estimate_step(ModelSpec.from_shape(shape), training, hardware, ParallelConfig.from_dict(layout),
                             rates=rates)

    zero3 = {"data_parallel_size": 2, "zero_stage": 3, "activation_checkpointing": "none"}
    alpha, unit = cost(zero3), cost(zero3, fsdp_unit_ms=2.0)
    # 3 collectives per unit (6 units: 3 blocks, the embedding, the head, the root), less the head's second
    # all-gather (kept gathered from its forward into its backward): a third of a unit
    assert unit.comm_s["dp"] == pytest.approx(alpha.comm_s["dp"] - (3 * (3 + 1) - 1) * 100e-6
                                              + ((3 + 3) * 3 - 1) / 3 * 2e-3)
    explicit = cost({**zero3, "reshard_after_forward": True}, fsdp_unit_ms=2.0)  # every unit resharded, as set
    head = ModelShape(n_layer=3, n_embd=128, n_head=4, vocab_size=256, block_size=64).head_params()  # 33,024
    # one third of a unit, and the head's fp32 bytes gathered once more (half of them sent per rank) at 1 GB/s
    assert explicit.comm_s["dp"] - unit.comm_s["dp"] == pytest.approx(2e-3 / 3 + 4 * head / 2 / 1e9, rel=1e-6)
    hsdp = {"data_parallel_size": 2, "zero_stage": 3, "data_parallel_shard_size": 1, "activation_checkpointing": "none"}
    alpha, unit = cost(hsdp), cost(hsdp, fsdp_unit_ms=3.0)  # one all-reduce per unit over the replicas: a third
    assert unit.comm_s["dp_replicate"] == pytest.approx(alpha.comm_s["dp_replicate"] - (3 + 1) * 100e-6 + 6 * 1e-3)
    tp2 = {"data_parallel_size": 1, "tensor_parallel_size": 2, "activation_checkpointing": "none"}
    alpha, pair = cost(tp2), cost(tp2, tp_pair_ms=1.5)
    # half a pair per DTensor linear: 6 per GPT block (q, k, v, out, the MLP's two), the embedding and the head
    assert pair.comm_s["tp"] == pytest.approx(alpha.comm_s["tp"] - 4 * 3 * 100e-6 + (6 * 3 + 2) / 2 * 1.5e-3)
    assert cost(zero3, tp_pair_ms=1.5).comm_s == cost(zero3).comm_s  # each figure moves only its own axis
    pp2 = {"data_parallel_size": 1, "pipeline_parallel_size": 2, "activation_checkpointing": "none"}
    alpha, micro = cost(pp2), cost(pp2, pp_micro_batch_ms=0.5)
    m = TrainingSettings(micro_batch_size=2).micro_batches(2)  # the planner's default for 2 stages
    assert micro.comm_s["pp"] == pytest.approx(alpha.comm_s["pp"] - 2 * m * 100e-6 + m * 0.5e-3)
    cp2 = {"data_parallel_size": 1, "context_parallel_size": 2, "activation_checkpointing": "none"}
    alpha, ring = cost(cp2), cost(cp2, cp_layer_ms=2.0)  # a layer's ring attention, 3 layers
    assert ring.comm_s["cp"] == pytest.approx(alpha.comm_s["cp"] - 2 * 3 * 100e-6 + 3 * 2e-3)
    # and per element of a rank's queries (micro-batch 2 x 32 of the 64 tokens x width 128), per layer
    calls = cost(zero3, attention_call_us=300.0)  # the attention kernel's cost per call: 3 layers, each micro-batch
    assert calls.compute_s - cost(zero3).compute_s == pytest.approx(3 * 300e-6)
    sized = cost(cp2, cp_layer_ms=2.0, cp_element_ns=50.0)
    assert sized.comm_s["cp"] - ring.comm_s["cp"] == pytest.approx(3 * 50e-9 * 2 * 32 * 128)
    # FSDP2 units inside pipeline stages: resharding after forward (ZeRO-3) gathers once per micro-batch and once
    # more, then the reduce-scatter: m + 2 collectives per unit against the calibration's three; ZeRO-2 two
    m = TrainingSettings(micro_batch_size=2).micro_batches(2)
    for zero, collectives in ((3, m + 2), (2, 2)):
        staged = {"data_parallel_size": 1, "pipeline_parallel_size": 2, "zero_stage": zero,
                  "activation_checkpointing": "none"}
        units = {"data_parallel_size": 2, **{k: v for k, v in staged.items() if k != "data_parallel_size"}}
        alpha, unit = cost(units), cost(units, fsdp_unit_ms=3.0)
        layers = 2  # the busiest stage's blocks of 3 (first stage)
        assert unit.comm_s["dp"] == pytest.approx(alpha.comm_s["dp"] - collectives * (layers + 1) * 100e-6
                                                  + (layers + 2) * collectives / 3 * 3e-3)


def test_a_layout_of_several_ranks_pays_the_distributed_overhead() -> None:
    """A calibration's distributed step overhead (its lp_ddp fit over 2 ranks) replaces the one-process overhead in
    every layout of more than one rank, stretched like the rest when ranks outnumber the cores; one rank keeps the
    one-process figure."""
    from lightning_parallel.planner.hardware import make_hardware
    from lightning_parallel.planner.rates import COLLECTIVES, rates_from_dict

    def overhead(layout: dict[str, object], **extra: float) -> float:
        rates = rates_from_dict({"matmul_tflops": {"fp32": 0.1}, "memory_bandwidth_gbs": 10, "host_overhead_ms": 0.5,
                                 "links": {"intra_node": {c: {"alpha_us": 100, "beta_gbs": 1} for c in COLLECTIVES}},
                                 "cores": 2, "calibrated_ranks": 2, "overlap": 0.0, **extra})
        hardware = make_hardware(gpus_per_node=4, gpu_memory="1TB", rates=rates, name="cpu", accelerator="cpu")
        shape = ModelShape(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=32)
        training = TrainingSettings(precision="fp32", micro_batch_size=2, seq_len=32, activation_checkpointing="none")
        cost = estimate_step(ModelSpec.from_shape(shape), training, hardware,
                             ParallelConfig.from_dict({"activation_checkpointing": "none", **layout}), rates=rates)
        return cost.overhead_s

    one, two, four = ({"data_parallel_size": n} for n in (1, 2, 4))
    assert overhead(two, distributed_overhead_ms=3.0) - overhead(two) == pytest.approx(2.5e-3)
    assert overhead(four, distributed_overhead_ms=3.0) - overhead(four) == pytest.approx(2 * 2.5e-3)  # 4 ranks, 2 cores
    assert overhead(one, distributed_overhead_ms=3.0) == overhead(one)


def test_the_optimizer_step_counts_bytes_and_tensors() -> None:
    """A calibrated optimizer: ``2 P + G + 2 K`` bytes per parameter of the rank's shard at the optimizer rate, plus
    the cost per parameter tensor -- the model's 35 tensors (GPT: 15 per block, 5 outside), a flat shard per param
    group under ZeRO-1/2, DTensor parameters (ZeRO-3, tensor parallelism) at the DTensor figure; on CPU in series
    with the rest.
    Without a per-tensor figure, the ops are counted at the dispatch cost as before."""
    from lightning_parallel.planner.hardware import make_hardware
    from lightning_parallel.planner.rates import COLLECTIVES, rates_from_dict

    shape = ModelShape(n_layer=2, n_embd=128, n_head=4, vocab_size=256, block_size=64)
    assert shape.block_tensors == 15 and shape.edge_tensors() == 5
    assert shape.edge_tensors(first=False) == 3 and shape.edge_tensors(last=False) == 2
    llama = ModelShape(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, gated_mlp=True, bias=False,
                       learned_positions=False)
    assert llama.block_tensors == 9 and llama.edge_tensors() == 3  # 7 matrices and 2 norms; embedding, norm, head

    def overhead(layout: dict[str, object], **extra: float) -> float:
        rates = rates_from_dict({"matmul_tflops": {"fp32": 0.1}, "memory_bandwidth_gbs": 10, "host_overhead_ms": 0.5,
                                 "links": {"intra_node": {c: {"alpha_us": 100, "beta_gbs": 1} for c in COLLECTIVES}},
                                 "cores": 2, "calibrated_ranks": 2, "overlap": 0.0, **extra})
        hardware = make_hardware(gpus_per_node=2, gpu_memory="1TB", rates=rates, name="cpu", accelerator="cpu")
        training = TrainingSettings(precision="fp32", micro_batch_size=2, seq_len=64, activation_checkpointing="none")
        cost = estimate_step(ModelSpec.from_shape(shape), training, hardware,
                             ParallelConfig.from_dict({"activation_checkpointing": "none", **layout}), rates=rates)
        return cost.overhead_s

    calibrated = {"optimizer_gbs": 5.0, "optimizer_tensor_us": 20.0, "optimizer_dtensor_us": 100.0}
    params = shape.total_params()
    ddp, zero1, zero3 = ({"data_parallel_size": 2, "zero_stage": z} for z in (0, 1, 3))
    tp = {"data_parallel_size": 1, "tensor_parallel_size": 2}
    base = overhead(ddp)  # memory bandwidth 10 GB/s, 10 ops per tensor at no dispatch cost
    assert overhead(ddp, **calibrated) - base == pytest.approx(params * 28 / 5e9 - params * 28 / 10e9 + 35 * 20e-6)
    assert overhead(zero1, **calibrated) - overhead(zero1) == pytest.approx(params / 2 * 28 * (1 / 5e9 - 1 / 10e9)
                                                                          + 2 * 20e-6)  # two param groups
    assert overhead(zero3, **calibrated) - overhead(zero3) == pytest.approx(params / 2 * 28 * (1 / 5e9 - 1 / 10e9)
                                                                          + 35 * 100e-6)
    assert overhead(tp, **calibrated) > overhead(tp, optimizer_gbs=5.0, optimizer_tensor_us=20.0) + 35 * 70e-6
    assert overhead(ddp, op_overhead_us=2.0) - base == pytest.approx(35 * 10 * 2e-6 + (130 * 2 + 40) * 2e-6)


def test_ranks_beyond_the_cores_stretch_only_their_cpu_work() -> None:
    """Four CPU ranks on a 2-core calibration: with every calibrated cost all CPU (no ``busy`` measured) the step
    doubles; when the FSDP2 units are half waiting, the step is the longer of the calibrated step and twice the
    CPU work -- less than double, never less than the step unstretched."""
    from lightning_parallel.planner.hardware import make_hardware
    from lightning_parallel.planner.rates import COLLECTIVES, rates_from_dict

    def step(cores: int, **extra: object) -> float:
        rates = rates_from_dict({"matmul_tflops": {"fp32": 0.1}, "memory_bandwidth_gbs": 10, "fsdp_unit_ms": 5.0,
                                 "links": {"intra_node": {c: {"alpha_us": 100, "beta_gbs": 1} for c in COLLECTIVES}},
                                 "cores": cores, "calibrated_ranks": 2, "overlap": 0.0, **extra})
        hardware = make_hardware(gpus_per_node=4, gpu_memory="1TB", rates=rates, name="cpu", accelerator="cpu")
        shape = ModelShape(n_layer=2, n_embd=128, n_head=4, vocab_size=256, block_size=64)
        training = TrainingSettings(precision="fp32", micro_batch_size=2, seq_len=64, activation_checkpointing="none")
        layout = ParallelConfig.from_dict({"data_parallel_size": 4, "zero_stage": 3,
                                           "activation_checkpointing": "none"})
        return estimate_step(ModelSpec.from_shape(shape), training, hardware, layout, rates=rates).step_s

    alone, shared = step(4), step(2)
    assert shared == pytest.approx(2 * alone)
    half = step(2, busy={"fsdp_unit": 0.5})
    assert alone < half < shared
    assert step(4, busy={"fsdp_unit": 0.5}) == pytest.approx(alone)  # cores enough: nothing stretches
    assert step(2, busy={"fsdp_unit": 0.0}) >= alone


def test_flat_zero_shards_pay_one_reduce_scatter_and_one_all_gather() -> None:
    """ZeRO-1/2's flat shards: the gradient's reduce-scatter and the parameters' all-gather, half the dp bytes each,
    each at its own calibrated latency and bandwidth, one of each per optimizer param group; ZeRO-2 reduces the
    gradient in N chunk reduces per group during the backward (N latencies, the same bytes), which hide under the
    backward where the machine overlaps (a GPU's rates) but for the last chunk's."""
    from lightning_parallel.planner.hardware import make_hardware
    from lightning_parallel.planner.rates import rates_from_dict

    links = {"all_reduce": {"alpha_us": 100, "beta_gbs": 1}, "reduce_scatter": {"alpha_us": 2000, "beta_gbs": 0.5},
             "all_gather": {"alpha_us": 100, "beta_gbs": 2}, "p2p": {"alpha_us": 10, "beta_gbs": 5}}
    rates = rates_from_dict({"matmul_tflops": {"fp32": 0.1}, "memory_bandwidth_gbs": 10, "links": {"intra_node": links},
                             "cores": 2, "calibrated_ranks": 2, "overlap": 0.0})
    hardware = make_hardware(gpus_per_node=2, gpu_memory="1TB", rates=rates, name="cpu", accelerator="cpu")
    shape = ModelShape(n_layer=2, n_embd=128, n_head=4, vocab_size=256, block_size=64)
    training = TrainingSettings(precision="fp32", micro_batch_size=2, seq_len=64, activation_checkpointing="none")
    for zero in (1, 2):
        layout = ParallelConfig.from_dict({"data_parallel_size": 2, "zero_stage": zero,
                                           "activation_checkpointing": "none"})
        cost = estimate_step(ModelSpec.from_shape(shape), training, hardware, layout, rates=rates)
        sent = 4 * shape.total_params() / 2  # fp32 gradient (N-1)/N, then the parameters (N-1)/N, N = 2
        # one of each per optimizer param group (two: the weight-decayed matrices and the rest); ZeRO-2: 2 chunks each
        assert cost.comm_s["dp"] == pytest.approx(2 * zero * 2000e-6 + sent / 0.5e9 + 2 * 100e-6 + sent / 2e9)
        assert cost.exposed_s["dp"] == pytest.approx(cost.comm_s["dp"])  # no overlap on this machine
    overlapping = rates_from_dict({"matmul_tflops": {"fp32": 0.001}, "memory_bandwidth_gbs": 10,  # a long backward
                                   "links": {"intra_node": links}, "cores": 2, "calibrated_ranks": 2, "overlap": 1.0})
    layout = ParallelConfig.from_dict({"data_parallel_size": 2, "zero_stage": 2, "activation_checkpointing": "none"})
    cost = estimate_step(ModelSpec.from_shape(shape), training, hardware, layout, rates=overlapping)
    last_chunk = 2 * 2000e-6 + sent / 2 / 0.5e9
    assert cost.exposed_s["dp"] == pytest.approx(2 * 100e-6 + sent / 2e9 + last_chunk)  # the backward hides the rest


def test_the_offload_engine_pays_its_calibrated_step_tensors_and_parameters() -> None:
    """ZeRO-offload with a calibrated engine: its fixed cost per step, its cost per parameter tensor of the model
    (35: GPT, 2 blocks) and the part of its cost per parameter that the host link, the host Adam and the flat
    exchange's bytes do not already count (at the calibration's two ranks); the flat exchange's latency is then in
    the engine's step, its bytes still at ``beta``."""
    from lightning_parallel.planner.hardware import make_hardware
    from lightning_parallel.planner.rates import COLLECTIVES, rates_from_dict

    shape = ModelShape(n_layer=2, n_embd=128, n_head=4, vocab_size=256, block_size=64)
    params = shape.total_params()

    def cost(**extra: float) -> StepCost:
        rates = rates_from_dict({"matmul_tflops": {"fp32": 0.1}, "memory_bandwidth_gbs": 10, "host_link_gbs": 8,
                                 "host_optimizer_params_per_s": 1e9,
                                 "links": {"intra_node": {c: {"alpha_us": 100, "beta_gbs": 1} for c in COLLECTIVES}},
                                 "cores": 2, "calibrated_ranks": 2, "overlap": 0.0, **extra})
        hardware = make_hardware(gpus_per_node=2, gpu_memory="1TB", rates=rates, name="cpu", accelerator="cpu")
        training = TrainingSettings(precision="fp32", micro_batch_size=2, seq_len=64, activation_checkpointing="none")
        layout = ParallelConfig.from_dict({"data_parallel_size": 2, "zero_stage": 2, "offload": "cpu",
                                           "activation_checkpointing": "none"})
        return estimate_step(ModelSpec.from_shape(shape), training, hardware, layout, rates=rates)

    bare = cost()
    assert bare.exposed_s["offload"] == pytest.approx(2 * 4 * params / 2 / 8e9 + params / 2 / 1e9)
    counted = 2 * 4 / 2 / 8e9 + 1 / 2 / 1e9 + 2 * 4 / 2 / 1e9  # per parameter: host link, host Adam, exchange
    engine = cost(offload_step_ms=3.0, offload_tensor_ms=0.1, offload_param_ns=counted * 1e9 + 5.0)
    assert engine.exposed_s["offload"] - bare.exposed_s["offload"] == pytest.approx(3e-3 + 35 * 1e-4 + 5e-9 * params)
    # the flat exchange's latencies (a reduce-scatter and an all-gather per param group) are in the engine's step
    assert bare.comm_s["dp"] - engine.comm_s["dp"] == pytest.approx(2 * 2 * 100e-6)
    below = cost(offload_step_ms=3.0, offload_param_ns=counted * 1e9 / 2)  # the model counts more: nothing added
    assert below.exposed_s["offload"] - bare.exposed_s["offload"] == pytest.approx(3e-3)


def test_accumulation_repeats_the_batches_and_reduces_once() -> None:
    """A step accumulating ``a`` batches runs ``a`` times the compute and every per-batch collective (tensor- and
    context-parallel, pipeline sends, FSDP2's all-gathers) but one gradient reduction and one optimizer step: DDP's
    all-reduce and ZeRO-1/2's flat exchange stay as they are, ZeRO-3 pays ``2a`` all-gathers and one reduce-scatter
    per unit, and the tokens per step grow ``a`` times -- so accumulation favours the layouts whose traffic is once
    per step."""
    def both(layout: dict[str, object]) -> tuple[StepCost, StepCost]:
        hardware = load_profile("dgx-a100-80gb")
        rates = rates_for(hardware)
        spec = ModelSpec.from_shape(MODEL_PRESETS["gpt3-1.3b"])
        config = ParallelConfig.from_dict({"activation_checkpointing": "none", **layout})
        one, four = (TrainingSettings(micro_batch_size=4, seq_len=2048, activation_checkpointing="none",
                                      accumulate_grad_batches=a) for a in (1, 4))
        return (estimate_step(spec, one, hardware, config, rates=rates),
                estimate_step(spec, four, hardware, config, rates=rates))

    for layout in ({"data_parallel_size": 8}, {"data_parallel_size": 8, "zero_stage": 1},
                   {"data_parallel_size": 8, "zero_stage": 2}):
        one, four = both(layout)
        assert four.compute_s == pytest.approx(4 * one.compute_s)
        assert four.comm_s["dp"] == pytest.approx(one.comm_s["dp"])  # one reduction per step
        assert four.tokens == 4 * one.tokens and four.model_flops == pytest.approx(4 * one.model_flops)
        assert four.tokens_per_s > one.tokens_per_s  # the exchange spread over four batches
    one, four = both({"data_parallel_size": 8, "zero_stage": 3})
    # (2 x 4 all-gathers + 1 reduce-scatter) against (2 + 1): bf16 gathers and an fp32 reduction under bf16-mixed,
    # (8 x 2 + 4) / (2 x 2 + 4) = 2.5 times the bytes, 3 times the calls
    assert 2.5 * one.comm_s["dp"] < four.comm_s["dp"] < 3 * one.comm_s["dp"]
    tp_one, tp_four = both({"data_parallel_size": 4, "tensor_parallel_size": 2})
    assert tp_four.comm_s["tp"] == pytest.approx(4 * tp_one.comm_s["tp"])
    assert tp_four.comm_s["dp"] == pytest.approx(tp_one.comm_s["dp"])
    pp_one, pp_four = both({"data_parallel_size": 4, "pipeline_parallel_size": 2, "num_micro_batches": 8})
    assert pp_four.comm_s["pp"] == pytest.approx(4 * pp_one.comm_s["pp"])
    assert pp_four.compute_s == pytest.approx(4 * pp_one.compute_s)  # each batch's schedule pays its own bubble
    # in a pipeline at ZeRO-2/3 torch's schedule reduce-scatters at the end of every batch: all of dp's traffic a times
    for zero in (2, 3):
        pz_one, pz_four = both({"data_parallel_size": 4, "pipeline_parallel_size": 2, "num_micro_batches": 8,
                                "zero_stage": zero})
        assert pz_four.comm_s["dp"] == pytest.approx(4 * pz_one.comm_s["dp"])
    # reduce_each_batch: ZeRO-2/3 reduce every batch's gradient (a reductions a step, the gradient kept sharded)
    for zero, gathers in ((2, 1), (3, 2)):
        _, kept = both({"data_parallel_size": 8, "zero_stage": zero})
        _, each = both({"data_parallel_size": 8, "zero_stage": zero, "reduce_each_batch": True})
        assert each.comm_s["dp"] > kept.comm_s["dp"]
        # bytes per parameter under bf16-mixed: FSDP2 (ZeRO-3) gathers bf16 (2), the flat ZeRO-2 fp32 (4); the
        # gradients reduce in fp32 (4)
        gathered = gathers * (4 if zero == 3 else 1) * (2 if zero == 3 else 4)
        kept_bytes, each_bytes = gathered + 4, gathered + 4 * 4
        assert each.comm_s["dp"] / kept.comm_s["dp"] == pytest.approx(each_bytes / kept_bytes, rel=0.05)
    # a fixed global batch: the layouts of fewer replicas accumulate more batches per step
    fixed = TrainingSettings(micro_batch_size=4, batch_per_replica=4, seq_len=2048, activation_checkpointing="none",
                             global_batch_size=256)
    hardware = load_profile("dgx-a100-80gb")
    spec = ModelSpec.from_shape(MODEL_PRESETS["gpt3-1.3b"])
    tokens = {dp: estimate_step(spec, fixed, hardware, ParallelConfig.from_dict(
        {"data_parallel_size": dp, "activation_checkpointing": "none"}), rates=rates_for(hardware)).tokens
        for dp in (2, 4, 8)}
    assert tokens == {2: 256 * 2048, 4: 256 * 2048, 8: 256 * 2048}
